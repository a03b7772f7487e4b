"""Process environment of actors, and where the engines' (vLLM's) logs go during a run.

The console of a run must keep zrl's progress lines, not vLLM's per-step INFO lines: vLLM applies the
logging configuration `engine_logs` writes in every process whose environment carries it (the actors
get it through `actor_env`). The vLLM test configures logging the way an engine does at start-up
(`configure_logging(LoggingConfig())`) in a fresh process with the actor's environment.
"""

import os
import subprocess
import sys

from zrl.runtime_env import ENGINE_LOG_CONFIG, actor_env, engine_logs

_ENGINE_PROCESS = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(message)s")
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging, init_logger
configure_logging(LoggingConfig())  # what vLLM does when an engine is created
stats = init_logger("vllm.v1.metrics.loggers")
stats.info("engine-info-line")
stats.warning("engine-warning-line")
stats.error("engine-error-line")
logging.getLogger("zrl.pipeline").info("zrl-info-line")  # configured before vLLM: must keep working
"""


def _without_engine_config() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != ENGINE_LOG_CONFIG}


def test_actors_get_the_engine_log_config_only_inside_a_run(tmp_path, monkeypatch):
    monkeypatch.delenv(ENGINE_LOG_CONFIG, raising=False)
    assert ENGINE_LOG_CONFIG not in actor_env(1)
    with engine_logs(tmp_path / "run" / "logs") as config:
        assert config == (tmp_path / "run" / "logs" / "vllm-logging.json").resolve() and config.is_file()
        assert actor_env(2)[ENGINE_LOG_CONFIG] == str(config)
    assert ENGINE_LOG_CONFIG not in os.environ and ENGINE_LOG_CONFIG not in actor_env(1)


def test_a_users_own_engine_log_config_wins(tmp_path, monkeypatch):
    monkeypatch.setenv(ENGINE_LOG_CONFIG, "/etc/my-vllm-logging.json")
    with engine_logs(tmp_path / "logs") as config:
        assert config is None and actor_env(1)[ENGINE_LOG_CONFIG] == "/etc/my-vllm-logging.json"
    assert os.environ[ENGINE_LOG_CONFIG] == "/etc/my-vllm-logging.json"
    assert not (tmp_path / "logs").exists()


def test_engine_info_goes_to_the_run_directory_and_warnings_also_to_the_console(tmp_path, monkeypatch):
    monkeypatch.delenv(ENGINE_LOG_CONFIG, raising=False)
    log_dir = tmp_path / "logs"
    with engine_logs(log_dir):
        env = _without_engine_config() | actor_env(1)  # Ray adds the actor's variables to the worker's
        proc = subprocess.run([sys.executable, "-c", _ENGINE_PROCESS], env=env, capture_output=True, text=True,
                              timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = proc.stdout + proc.stderr
    assert "engine-info-line" not in console
    assert "engine-warning-line" in console and "engine-error-line" in console
    assert "zrl.pipeline zrl-info-line" in console
    [log_file] = log_dir.glob("vllm-*.log")  # one file per process: vllm-<host>-<pid>.log
    lines = log_file.read_text().splitlines()
    assert [line.split()[0] for line in lines] == ["INFO", "WARNING", "ERROR"]
    assert lines[0].endswith("engine-info-line")
    assert "zrl-info-line" not in log_file.read_text()

