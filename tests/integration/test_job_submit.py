"""`ray job submit -- zrl run RECIPE` against a local head node: the cluster path of DESIGN.md.

The test starts its own head (`ray start --head`, every port free-picked, dashboard on 127.0.0.1,
token authentication with a token file of its own, a short private temp dir) in a new session, so
stopping it touches no other Ray instance on the machine: the head's processes are exactly those of
that process group (SIGTERM, then SIGKILL after a grace period; `ray stop` would stop every Ray
instance of the machine). The job's working directory holds the recipe and the environment module it
references (`coinflip_env:CoinFlip`): the driver and every actor import it from there.
"""

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BIN = Path(sys.executable).parent
PIPELINE_TESTS = Path(__file__).resolve().parent / "pipeline"
STEPS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _recipe(run_dir: Path, model_dir: Path) -> dict:
    return {
        "name": "job-submit-test", "model": {"path": str(model_dir), "build_tiny_if_missing": True, "dtype": "float32"},
        "output_dir": str(run_dir), "seed": 5,
        "resources": {"rollout_workers": 1, "trainer_workers": 2, "cpus_per_rollout_worker": 0.5,
                      "cpus_per_trainer_worker": 0.5, "trainer_microbatch_tokens": 256},
        "metrics": {"wandb": {"enabled": False}, "tensorboard": False},
        "stages": [{
            "name": "rl", "kind": "rl", "steps": STEPS, "environments": [{"name": "coinflip_env:CoinFlip"}],
            "sampling": {"prompts_per_batch": 4, "group_size": 4, "max_prompt_tokens": 48, "max_response_tokens": 8},
            "algorithm": {"length_reward": {"enabled": False}, "canaries": {"lz77": {"enabled": False}}},
            "asynchrony": {"sync_every_steps": 1, "max_staleness_steps": 1, "min_ready_batches": 1},
        }],
    }


def _marked(marker: str) -> list[int]:
    """Live processes whose environment carries ZRL_TEST_MARKER=marker: the head, the job, its actors."""
    needle = f"ZRL_TEST_MARKER={marker}".encode()
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    pids.append(int(entry.name))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return pids


def _group_alive(pgid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


def _stop_group(pgid: int, grace_s: float = 5.0) -> None:
    """SIGTERM the head's process group, SIGKILL what is left after `grace_s` (the GCS and raylet
    take longer than that to honour SIGTERM)."""
    sig = signal.SIGTERM
    deadline = time.monotonic() + grace_s
    while _group_alive(pgid):
        if time.monotonic() > deadline:
            sig = signal.SIGKILL
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        time.sleep(0.5)


@pytest.fixture
def head(tmp_path):
    """A private Ray head node; yields (dashboard address, environment for the `ray` CLI)."""
    temp_dir = tempfile.mkdtemp(prefix="zrl-ray-", dir="/tmp")  # short: Ray's unix sockets live under it
    token = tmp_path / "ray_token"
    token.write_text(secrets.token_hex(32))
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token), "ZRL_TEST_MARKER": secrets.token_hex(8)}
    env.pop("RAY_ADDRESS", None)
    env.pop("PYTHONPATH", None)  # the job must find its environment module through its working directory
    ports = {flag: _free_port() for flag in (
        "port", "dashboard-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "node-manager-port",
        "object-manager-port", "runtime-env-agent-port", "metrics-export-port", "ray-client-server-port")}
    args = [str(BIN / "ray"), "start", "--head", "--num-cpus=2", "--include-dashboard=true",
            "--dashboard-host=127.0.0.1", f"--temp-dir={temp_dir}", "--disable-usage-stats",
            *(f"--{flag}={port}" for flag, port in ports.items())]
    start = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    try:
        out, _ = start.communicate(timeout=120)
        assert start.returncode == 0, out[-4000:]
        yield f"http://127.0.0.1:{ports['dashboard-port']}", env
    finally:
        _stop_group(start.pid)
        deadline = time.monotonic() + 10
        while (leftover := _marked(env["ZRL_TEST_MARKER"])) and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid in leftover:  # outside the head's process group: report, and do not leak it
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert leftover == [], f"processes of the head or the job still alive after it stopped: {leftover}"


def _ray(args: list[str], env: dict, timeout_s: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "ray"), *args], env=env, capture_output=True, text=True, timeout=timeout_s)


def test_zrl_run_as_a_ray_job(head, tmp_path, tmp_path_factory):
    address, env = head
    work = tmp_path / "job"
    work.mkdir()
    shutil.copy(PIPELINE_TESTS / "coinflip_env.py", work / "coinflip_env.py")
    run_dir = tmp_path / "run"
    (work / "recipe.yaml").write_text(yaml.safe_dump(_recipe(run_dir, tmp_path_factory.getbasetemp() / "tiny-model")))

    submit = ["job", "submit", "--address", address, "--submission-id", "zrl-test-job", "--working-dir", str(work),
              "--", "zrl", "run", "recipe.yaml"]
    deadline = time.monotonic() + 90
    while True:  # the head's job agent comes up a few seconds after `ray start` returns
        result = _ray(submit, env)
        if "No available agent" not in result.stdout + result.stderr or time.monotonic() > deadline:
            break
        time.sleep(2)
    logs = result.stdout + result.stderr
    status = _ray(["job", "status", "--address", address, "zrl-test-job"], env, timeout_s=60)
    assert "Job 'zrl-test-job' succeeded" in status.stdout + status.stderr, logs[-6000:]  # JobStatus.SUCCEEDED
    assert "cascade 'job-submit-test' finished at trainer step 3" in logs

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[-1]["env/verifier_errors"] == 0  # verifier actors imported coinflip_env from the working dir
    assert (run_dir / "stages" / "rl" / "hf" / "config.json").is_file()
    assert (run_dir / "stages" / "rl" / "summary.png").is_file()
    assert not (run_dir / "driver.json").exists()
