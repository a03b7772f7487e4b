"""Process environment defaults for everything that hosts a vLLM engine or a trainer rank.

zrl runs each vLLM engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0): start-up 2 s instead of 15-22 s,
weight updates and routing records pass by reference, and killing the process leaks no shared memory
(shared CPU_STACK.md). The CPU KV cache must be sized explicitly. Caches go to the project-owned
`.cache/` when the bootstrap or the test suite set them; values already set are never overridden.
"""

import os

DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_USAGE_STATS_ENABLED": "0",
}
# Forwarded to Ray actors when set in the driver (compile caches, offline modes).
FORWARDED = ("TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TMPDIR", "WANDB_MODE", "PYTHONPATH")


def apply_defaults() -> None:
    for key, value in DEFAULTS.items():
        os.environ.setdefault(key, value)


def actor_env(cpus: float) -> dict[str, str]:
    """The environment of a Ray actor reserved `cpus` CPUs: defaults, the driver's forwarded values."""
    env = {k: os.environ.get(k, v) for k, v in DEFAULTS.items()}
    env.update({k: os.environ[k] for k in FORWARDED if k in os.environ})
    env["OMP_NUM_THREADS"] = str(max(1, int(cpus)))
    return env
