"""Session-wide test set-up: project-owned compile caches, offline services, Triton's interpreter without
CUDA, GPU-test skipping.

Caches (TorchInductor, vLLM, Triton) live in `<repo>/.cache` so a warm run reuses compiled ops;
`zrl/bootstrap.py` sets the same variables, this file covers a plain `pytest` call too.
"""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache"
for _var, _sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("VLLM_CACHE_ROOT", "vllm"),
                   ("TRITON_CACHE_DIR", "triton")):
    os.environ.setdefault(_var, str(CACHE / _sub))
    Path(os.environ[_var]).mkdir(parents=True, exist_ok=True)
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

# Without CUDA, tests of the Triton backend run its kernels through Triton's interpreter. Triton reads
# TRITON_INTERPRET when a kernel is created, and any test may create one first, so it is set here, before
# collection, for every invocation (`pytest tests/unit` too), as zrl/moepp/kernels/conftest.py does for
# the kernel folders. torch is imported after the cache variables above are set.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
