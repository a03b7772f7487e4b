"""`zrl run`: everything that happens before the first stage trains.

Responsibilities: create the run directory and record the resolved recipe in it; make the model
assets exist (a Hugging Face repo id is downloaded into the cache on first use, the tiny CPU checkpoint
is built at a scratch asset path when the recipe asks for it: zrl/hub.py); connect to the Ray
cluster named by `--address` (or the one `ray job submit` provides) or start an embedded one; and
check that the cluster can host the recipe's rollout and trainer pools before anything is launched.
Then it hands the recipe to the cascade controller (zrl/pipeline/controller.py).

The run directory is never silently reused (`prepare_run_dir`): without `--resume`, a directory that
holds checkpoints or metrics of an earlier run is an error. With `--resume` the recipe must equal the
run's `recipe.resolved.yaml` except in RESUMABLE_FIELDS, the fields that say where the work runs and
how it is recorded, not what is optimised: labels, output_dir (a moved run directory), resources
(pool sizes and CPUs/GPUs: the trainer checkpoint reshards to any rank count and HSDP grouping; the
token budget of a microbatch only changes the packing; activation checkpointing only recomputes and
activation offload only moves saved activations to host memory), metrics sinks,
`model.build_tiny_if_missing`, a stage's `checkpoint_every_steps` and its fault limits (`asynchrony`'s
`verifier_timeout_s`, `max_worker_restarts`, `progress_timeout_s`, `max_discarded_batches`).

The console shows zrl's progress lines; the engines' (vLLM's) logs go to `<output_dir>/logs/`, one
file per process, and only their warnings and errors also reach the console (zrl/runtime_env.py).

`<output_dir>/driver.json` names the driver that uses the directory and the tag (ZRL_DRIVER_TAG) it put
in its environment. A second driver on the same host is refused while that one is alive; after it
died, what its embedded Ray left running is found by the tag and killed (see `_reap`).
"""

import contextlib
import fnmatch
import json
import logging
import os
import signal
import socket
import threading
import time
import uuid
from pathlib import Path

import yaml

from zrl.config import Recipe, parse_recipe
from zrl.pipeline.faults import Interrupted, StageStopped, StopRequest, TrainerFailed
from zrl.reaper import Reaper, driver_environment, kill_tagged
from zrl.run_dir import RunDir
from zrl.runtime_env import engine_logs

log = logging.getLogger("zrl")

RESUMABLE_FIELDS = (
    "name", "description", "output_dir", "resources.*", "metrics.*", "model.build_tiny_if_missing",
    "stages.*.checkpoint_every_steps", "stages.*.asynchrony.verifier_timeout_s",
    "stages.*.asynchrony.max_worker_restarts", "stages.*.asynchrony.progress_timeout_s",
    "stages.*.asynchrony.max_discarded_batches",
)
LOG_DIR = "logs"  # engine log files, under the run directory


class RunDirectoryError(Exception):
    """The run directory does not fit the request (an earlier run would be overwritten, nothing to
    resume, a recipe that changes the optimisation, a driver already using it)."""


def _flatten(value, prefix: str = "") -> dict[str, object]:
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = ((str(i), v) for i, v in enumerate(value))
    else:
        return {prefix: value}
    out = {}
    for key, item in items:
        out.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    return out


def recipe_changes(saved: dict, new: dict) -> list[str]:
    """Dotted paths (stages by index) whose values differ and that are not RESUMABLE_FIELDS."""
    a, b = _flatten(saved), _flatten(new)
    missing = object()
    return sorted(p for p in set(a) | set(b) if a.get(p, missing) != b.get(p, missing)
                  and not any(fnmatch.fnmatchcase(p, pattern) for pattern in RESUMABLE_FIELDS))


def prepare_run_dir(recipe: Recipe, resume: bool):
    """Check the run directory against the request, claim it, record the recipe.

    Returns (the resume point or None, (driver file, driver tag) from `claim_run_dir`)."""
    from zrl.pipeline.controller import latest_checkpoint

    out = Path(recipe.output_dir)
    point = latest_checkpoint(out)
    resolved = RunDir(out).resolved_recipe
    if not resume:
        if point is not None:
            raise RunDirectoryError(
                f"{out} holds checkpoints of an earlier run (latest: trainer step {point.step}, stage {point.stage!r}); "
                "continue it with `zrl run RECIPE --resume`, or set a fresh output_dir")
        if RunDir(out).metrics.exists():
            raise RunDirectoryError(f"{out} holds metrics of an earlier run that saved no checkpoint; remove it or "
                                    "set a fresh output_dir")
    else:
        if point is None:
            raise RunDirectoryError(f"--resume: {out} has no checkpoint to resume from (no checkpoints/latest.json); "
                                    "run without --resume to start the cascade")
        if not resolved.is_file():
            raise RunDirectoryError(f"--resume: {resolved} is missing; cannot check that the recipe is the run's")
        saved = parse_recipe(yaml.safe_load(resolved.read_text()), str(resolved)).model_dump(mode="json")
        changes = recipe_changes(saved, recipe.model_dump(mode="json"))
        if changes:
            shown = ", ".join(changes[:12]) + (f" (+{len(changes) - 12} more)" if len(changes) > 12 else "")
            raise RunDirectoryError(
                f"--resume: the recipe differs from the run's {resolved} in fields that change the optimisation: "
                f"{shown}. Only these may change on resume: {', '.join(RESUMABLE_FIELDS)}")
    out.mkdir(parents=True, exist_ok=True)
    driver = claim_run_dir(out)
    resolved.write_text(yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False))
    return point, driver


def _zrl_process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (ProcessLookupError, PermissionError, FileNotFoundError):
        return False
    return b"zrl" in cmdline


def _reap(holder: dict) -> None:
    """Kill what the embedded Ray of a dead driver left running (its reaper normally did already;
    see zrl/reaper.py)."""
    pids = kill_tagged(holder["tag"])
    if pids:
        log.warning("killed %d process(es) left by the interrupted driver (pid %d): %s", len(pids), holder["pid"],
                    pids)


def claim_run_dir(out: Path) -> tuple[Path, str]:
    """Write `driver.json` with a fresh driver tag; refuse if a live zrl driver on this host holds the
    directory, and clean up after a dead one. Returns the file and the tag."""
    file = RunDir(out).driver
    host = socket.gethostname()
    if file.is_file():
        holder = json.loads(file.read_text())
        if holder.get("host") == host and holder.get("pid") != os.getpid():
            if _zrl_process_alive(holder["pid"]):
                raise RunDirectoryError(f"{out} is in use by a running zrl driver (pid {holder['pid']}); stop it "
                                        "first or set another output_dir")
            if holder.get("tag") and Path("/proc").is_dir():
                _reap(holder)
    tag = uuid.uuid4().hex
    file.write_text(json.dumps({"pid": os.getpid(), "host": host, "tag": tag, "started": time.time()}) + "\n")
    return file, tag


def prepare_model(recipe: Recipe) -> Path:
    """The local checkpoint directory everything downstream reads (zrl/hub.py): `model.path` itself, the
    Hugging Face cache snapshot of a repo id (downloaded on first use), or the tiny CPU checkpoint, built
    first when build_tiny_if_missing allows it there. Raises zrl.hub.ModelPathError (one line)."""
    from zrl.assets import is_checkpoint_dir
    from zrl.hub import local_checkpoint
    from zrl.models import get_family

    spec = recipe.model
    tiny = get_family(spec.tiny_arch)
    build = (lambda path: tiny.build_tiny(path, seed=recipe.seed)) if spec.build_tiny_if_missing else None
    path = local_checkpoint("model.path", spec.path, spec.revision, is_checkpoint_dir,
                            "model checkpoint directory (config.json and *.safetensors)", build)
    log.info("model: %s", path)
    return path


def required_resources(recipe: Recipe) -> dict[str, float]:
    r = recipe.resources
    scorers = r.reward_model_workers if recipe.reward_model is not None else 0
    return {
        "CPU": r.rollout_workers * r.cpus_per_rollout_worker + r.trainer_workers * r.cpus_per_trainer_worker
               + scorers * r.cpus_per_reward_model_worker,
        "GPU": r.rollout_workers * r.gpus_per_rollout_worker + r.trainer_workers * r.gpus_per_trainer_worker
               + scorers * r.gpus_per_reward_model_worker,
    }


def connect_ray(address: str | None):
    """Join the cluster at `address`, the one a `ray job submit` driver runs in, or start an embedded one."""
    import ray

    if address and address.startswith(("http://", "https://")):
        # A job submission (dashboard) address is not one a driver joins; zrl.cli refuses it with the remedy.
        raise ValueError(f"{address} is a Ray job submission address; submit with `ray job submit --address "
                         f"{address} -- zrl run RECIPE`")
    if address is None and os.environ.get("RAY_ADDRESS"):
        address = os.environ["RAY_ADDRESS"]
    if address:
        log.info("ray: connecting to %s", address)
        ray.init(address=address, log_to_driver=True)
    else:
        log.info("ray: starting an embedded instance")
        # address="local": a new instance even when a `ray start` cluster runs on this machine (without it
        # ray.init joins that cluster, and refuses num_cpus there).
        # No idle workers prestarted for the first driver: every actor of a run asks for its own runtime
        # environment (env_vars), so a default worker started ahead would only cost a process start.
        ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=True,
                 _system_config={"prestart_worker_first_driver": False})
    return ray


def check_capacity(cluster: dict[str, float], needed: dict[str, float]) -> list[str]:
    return [f"resources: the recipe needs {amount:g} {kind} but the cluster has {cluster.get(kind, 0):g}"
            for kind, amount in needed.items() if amount > cluster.get(kind, 0) + 1e-9]


def run_recipe(recipe: Recipe, address: str | None = None, resume: bool = False, command: str = "zrl run RECIPE") -> int:
    """Run the cascade; returns the exit code. `command`: how the user started it (for the resume hint).

    Stops (see zrl/pipeline/faults.py): the first SIGINT/SIGTERM saves a checkpoint at the next step
    boundary and exits 128 + the signal; a stage that cannot go on exits 1 with its reason; a failed
    trainer rank restarts the trainer pool from the latest checkpoint up to `resources.trainer_restarts`
    times. Each ends with one line, and the resume command when a checkpoint exists."""
    out = Path(recipe.output_dir)
    point, (driver_file, tag) = prepare_run_dir(recipe, resume)
    log.info("run directory: %s (resolved recipe written)%s", out,
             "" if point is None else f"; resuming from trainer step {point.step} of stage {point.stage!r}")
    reaper = Reaper(tag) if address is None and Path("/proc").is_dir() else None
    try:
        # The tag goes into the environment before ray.init: an embedded Ray's processes inherit it.
        with driver_environment(tag), engine_logs(out / LOG_DIR) as config, _stop_on_signals():
            if config is not None:
                log.info("engine (vLLM) logs: %s; their warnings and errors also show here", out / LOG_DIR)
            return _run(recipe, address, point, f"{command} --resume")
    finally:
        driver_file.unlink(missing_ok=True)
        if reaper is not None:
            reaper.stop()


@contextlib.contextmanager
def _stop_on_signals():
    """SIGINT/SIGTERM ask for a stop at the next step boundary (only the main thread can take signals)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    StopRequest.install()
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        StopRequest.clear()


def _run(recipe: Recipe, address: str | None, point, resume_command: str) -> int:
    from zrl.pipeline.controller import Cascade, latest_checkpoint, rollback_point
    from zrl.pipeline.health import RollBack, record_rollback

    model_path = prepare_model(recipe)
    if recipe.reward_model is not None:
        from zrl.reward_model import prepare_reward_model

        log.info("reward model: %s", prepare_reward_model(recipe.reward_model))
    ray = connect_ray(address)
    restarts = recipe.resources.trainer_restarts
    try:
        cluster = ray.cluster_resources()
        needed = required_resources(recipe)
        log.info("ray: cluster %s; recipe needs %s", json.dumps({k: cluster.get(k, 0) for k in needed}),
                 json.dumps(needed))
        problems = check_capacity(cluster, needed)
        if problems:
            for line in problems:
                log.error(line)
            return 2
        while True:
            try:
                step = Cascade(recipe, model_path, resume=point).run()
                log.info("cascade %r finished at trainer step %d; run directory %s", recipe.name, step,
                         recipe.output_dir)
                return 0
            except TrainerFailed as exc:
                point = latest_checkpoint(recipe.output_dir)
                if restarts == 0 or point is None:
                    why = "no checkpoint to restart from" if point is None else "resources.trainer_restarts used up"
                    return _stopped(f"{exc} ({why})", point, resume_command, 1)
                restarts -= 1
                log.warning("%s; restarting the trainer pool from the checkpoint at trainer step %d (%d restart(s) "
                            "left)", exc, point.step, restarts)
            except RollBack as exc:
                point = rollback_point(recipe, exc.good_step)
                if point is None:
                    return _stopped(f"{exc} (no checkpoint at or before step {exc.good_step} to roll back to)",
                                    latest_checkpoint(recipe.output_dir), resume_command, 1)
                record_rollback(RunDir(recipe.output_dir).alarms, exc.stage, exc.alarm_step, point.step)
                log.warning("%s; rolling back to the checkpoint at trainer step %d (health.on_alarm: rollback)",
                            exc, point.step)
            except StageStopped as exc:
                return _stopped(str(exc), latest_checkpoint(recipe.output_dir), resume_command, 1)
            except Interrupted as exc:
                return _stopped(f"zrl run {exc}", latest_checkpoint(recipe.output_dir), resume_command,
                                128 + exc.signum)
            except OSError as exc:  # the run directory's disk is full or it became unwritable
                where = exc.filename or recipe.output_dir
                return _stopped(f"writing {where} failed: {exc.strerror or exc}", latest_checkpoint(recipe.output_dir),
                                resume_command, 1)
    finally:
        ray.shutdown()


def _stopped(message: str, point, resume_command: str, code: int) -> int:
    hint = ("; no checkpoint was saved" if point is None else
            f"; latest checkpoint: trainer step {point.step}; resume with: {resume_command}")
    log.error("%s%s", message, hint)
    return code
