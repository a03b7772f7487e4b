"""Helpers of the end-to-end tests: small recipes on the tiny model, `zrl` in a subprocess, leak checks.

Every `zrl` subprocess gets a unique ZRL_TEST_MARKER environment variable. Ray's processes (GCS,
raylet, workers, actors) inherit the driver's environment, so the processes a run left behind are
exactly those whose environment holds its marker, whatever their session or process title.
"""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import yaml

ZRL = str(Path(sys.executable).parent / "zrl")
ROOT = Path(__file__).resolve().parents[2]  # relative recipe and model paths are the repository's
PIPELINE_TESTS = Path(__file__).resolve().parent.parent / "integration" / "pipeline"  # coinflip_env.py


def tiny_resources(trainer_workers: int = 2) -> dict:
    return {"rollout_workers": 1, "trainer_workers": trainer_workers, "cpus_per_rollout_worker": 0.5,
            "cpus_per_trainer_worker": 0.5, "trainer_microbatch_tokens": 256}


def sft_stage(name: str = "sft", steps: int = 2, checkpoint_every_steps: int = 50) -> dict:
    return {"name": name, "kind": "sft", "steps": steps, "checkpoint_every_steps": checkpoint_every_steps,
            "environments": [{"name": "arithmetic", "options": {"max_operand": 9}}],
            "examples_per_step": 8, "max_sequence_tokens": 64}


def rl_stage(name: str = "rl", steps: int = 4, checkpoint_every_steps: int = 50,
             env: str = "coinflip_env:CoinFlip") -> dict:
    return {"name": name, "kind": "rl", "steps": steps, "checkpoint_every_steps": checkpoint_every_steps,
            "environments": [{"name": env}],
            "sampling": {"prompts_per_batch": 4, "group_size": 4, "max_prompt_tokens": 48, "max_response_tokens": 8},
            "algorithm": {"length_reward": {"enabled": False}, "canaries": {"lz77": {"enabled": False}}},
            "optimizer": {"muon": {"lr": 1e-3}},
            "asynchrony": {"sync_every_steps": 2, "max_staleness_steps": 2, "min_ready_batches": 2,
                           "buffer_capacity_batches": 4}}


def recipe(output_dir: Path, model_dir: Path, stages: list[dict], name: str = "e2e", tensorboard: bool = False,
           trainer_workers: int = 2) -> dict:
    """`model_dir`: a checkpoint, or a scratch path (last component `tiny-*`) where the run builds the tiny
    model (build_tiny_if_missing builds nowhere else: zrl/hub.py)."""
    return {"name": name, "model": {"path": str(model_dir), "build_tiny_if_missing": True, "dtype": "float32"},
            "output_dir": str(output_dir), "seed": 3, "resources": tiny_resources(trainer_workers),
            "metrics": {"wandb": {"enabled": False}, "tensorboard": tensorboard}, "stages": stages}


def write_recipe(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def zrl_env(pythonpath: list[Path] = (), marker: str | None = None) -> dict:
    env = {**os.environ, "ZRL_TEST_MARKER": marker or uuid.uuid4().hex}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in (*pythonpath, PIPELINE_TESTS))
    return env


def start_zrl(args: list[str], env: dict, log_path: Path) -> subprocess.Popen:
    """`zrl ARGS` in its own session, output to `log_path`."""
    log = log_path.open("w")
    return subprocess.Popen([ZRL, *args], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def run_zrl(args: list[str], env: dict, log_path: Path, timeout_s: float = 600) -> int:
    """`zrl ARGS` to its end; its exit code. A run still going after `timeout_s` fails the test with the
    driver's thread stacks (SIGUSR1) and the log's tail."""
    proc = start_zrl(args, env, log_path)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(3)
        raise AssertionError(f"`zrl {' '.join(args)}` still running after {timeout_s:g} s; its log's tail, with the "
                             f"driver's stacks:\n{log_path.read_text()[-12000:]}") from None
    finally:
        if proc.poll() is None:
            proc.kill()


def run_to_completion(recipe_path: Path, log_path: Path, timeout_s: float = 900) -> None:
    """`zrl run RECIPE` to its end (exit 0, else the log's tail), then kill whatever it left running."""
    env = zrl_env()
    try:
        assert run_zrl(["run", str(recipe_path)], env, log_path, timeout_s) == 0, log_path.read_text()[-4000:]
    finally:
        kill_marked(env["ZRL_TEST_MARKER"])


def read_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written right now
            break
    return rows


def read_latest(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / "checkpoints" / "latest.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def interrupt_after_rl_checkpoint(proc: subprocess.Popen, run_dir: Path, stage: str, last_step: int,
                                  timeout_s: float = 900) -> tuple[dict, list[dict]]:
    """SIGKILL the driver once a checkpoint of RL stage `stage` exists and a later step was logged;
    (latest.json, metric rows) as the killed run left them.

    The driver is stopped (SIGSTOP) before the files are read, so what the test sees is exactly what the
    killed run left behind: only the driver writes metrics and latest.json."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before it could be interrupted"
        latest, rows = read_latest(run_dir), read_rows(run_dir)
        if latest and latest["stage"] == stage and any(r["step"] > latest["step"] for r in rows):
            os.kill(proc.pid, signal.SIGSTOP)
            latest, rows = read_latest(run_dir), read_rows(run_dir)
            if any(r["step"] > latest["step"] for r in rows) and latest["step"] < last_step:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
                return latest, rows
            os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.1)
    raise AssertionError("no RL checkpoint followed by a logged step within the time limit")


def tensorboard_steps(log_dir: Path, tag: str) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


def marked_processes(marker: str) -> dict[int, str]:
    """pid -> command line of every live process whose environment carries `marker`."""
    found = {}
    needle = f"ZRL_TEST_MARKER={marker}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":  # a zombie holds no resources; its parent reaps it
                    found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return found


def wait_until_gone(marker: str, timeout_s: float = 60) -> dict[int, str]:
    """Wait for the marked processes to exit; returns those still alive after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (alive := marked_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return alive


def kill_marked(marker: str) -> None:
    """Last-resort clean-up so that a failing test leaks nothing into the next one."""
    for pid in marked_processes(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
