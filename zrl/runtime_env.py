"""Process environment defaults for everything that hosts a vLLM engine or a trainer rank.

zrl runs each vLLM engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0): start-up 2 s instead of 15-22 s,
weight updates and routing records pass by reference, and killing the process leaks no shared memory
(docs/cpu-stack.md). The CPU KV cache must be sized explicitly. Caches go to the project-owned
`.cache/` when the bootstrap or the test suite set them; values already set are never overridden.

Console vs files: a run's console is zrl's own progress lines. vLLM logs every engine start-up step and,
every few seconds, engine throughput at INFO; Ray forwards each actor's stdout/stderr to the driver, so
those lines would flood it. `engine_logs(log_dir)` writes a logging configuration that vLLM applies in
every process that imports it (VLLM_LOGGING_CONFIG_PATH, forwarded to the actors): all its records go
to one file per process, `<log_dir>/vllm-<host>-<pid>.log` (the pid is the one Ray prints in front of
the actor's forwarded lines), and only warnings and errors also go to stderr, hence to the console.
The run directory must therefore be reachable from every node, as for checkpoints.
"""

import contextlib
import json
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path

DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_USAGE_STATS_ENABLED": "0",
}
ENGINE_LOG_CONFIG = "VLLM_LOGGING_CONFIG_PATH"  # vLLM's logging dictConfig file (JSON)
# Forwarded to Ray actors when set in the driver (compile caches, offline modes, engine logging).
FORWARDED = ("TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TMPDIR", "WANDB_MODE", "PYTHONPATH",
             ENGINE_LOG_CONFIG)
_LOG_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"


# Left to the caller in the driver: it resolves Hugging Face repo ids (zrl/hub.py), downloading one on first
# use unless the user set HF_HUB_OFFLINE; actors get local directories only and keep the offline default.
NOT_IN_DRIVER = frozenset({"HF_HUB_OFFLINE"})


def apply_defaults() -> None:
    """DEFAULTS for this process (a driver: the CLI, an in-process engine), except NOT_IN_DRIVER."""
    for key, value in DEFAULTS.items():
        if key not in NOT_IN_DRIVER:
            os.environ.setdefault(key, value)


def actor_env(cpus: float) -> dict[str, str]:
    """The environment of a Ray actor reserved `cpus` CPUs: defaults, the driver's forwarded values."""
    env = {k: os.environ.get(k, v) for k, v in DEFAULTS.items()}
    env.update({k: os.environ[k] for k in FORWARDED if k in os.environ})
    env["OMP_NUM_THREADS"] = str(max(1, int(cpus)))
    return env


def light_actor(cls, *args, max_restarts: int = 0, num_cpus: float = 0, num_gpus: float = 0,
                name: str | None = None, **kwargs):
    """An actor of the plain class `cls` outside the placement groups (buffer, verifiers, reward models),
    holding `num_cpus` and `num_gpus` (none by default) with `actor_env`'s environment; `name` makes it
    findable with ray.get_actor."""
    import ray

    return ray.remote(cls).options(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=max_restarts, name=name,
                                   runtime_env={"env_vars": actor_env(num_cpus)}).remote(*args, **kwargs)


def engine_log_handler(directory: str) -> logging.Handler:
    """This process's engine log file (vLLM's dictConfig calls it by name: this module stays light to import)."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    path = Path(directory) / f"vllm-{socket.gethostname()}-{os.getpid()}.log"
    return logging.FileHandler(path, delay=True)  # delay: a process that never logs leaves no empty file


def engine_logging_config(log_dir: Path) -> dict:
    """vLLM's logging configuration (logging.config.dictConfig schema): every record at the file level
    (VLLM_LOGGING_LEVEL, default INFO) to the process's file in `log_dir`, warnings and errors also to stderr."""
    level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,  # the process's other loggers (zrl's among them) keep working
        "formatters": {"engine": {"format": _LOG_FORMAT, "datefmt": "%H:%M:%S"}},
        "handlers": {
            "file": {"()": f"{__name__}.engine_log_handler", "directory": str(log_dir), "level": level,
                     "formatter": "engine"},
            "console": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "level": "WARNING",
                        "formatter": "engine"},
        },
        "loggers": {"vllm": {"handlers": ["file", "console"], "level": level, "propagate": False}},
    }


@contextlib.contextmanager
def engine_logs(log_dir: str | Path) -> Iterator[Path | None]:
    """Within the block, vLLM in this process and in the actors it starts logs to files in `log_dir`.

    Yields the configuration file, or None when the user set ENGINE_LOG_CONFIG already (theirs wins).
    """
    if os.environ.get(ENGINE_LOG_CONFIG):
        yield None
        return
    log_dir = Path(log_dir).resolve()  # actors may run in another working directory
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / "vllm-logging.json"
    path.write_text(json.dumps(engine_logging_config(log_dir), indent=1) + "\n")
    os.environ[ENGINE_LOG_CONFIG] = str(path)
    try:
        yield path
    finally:
        os.environ.pop(ENGINE_LOG_CONFIG, None)
