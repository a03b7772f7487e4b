"""Fixtures of the kernel parity tests (each kernel folder holds its own test file).

`device` runs a test on CPU through Triton's interpreter and on CUDA with the compiled kernels
(marked `gpu`, skipped without CUDA). Without CUDA this file sets TRITON_INTERPRET=1 when pytest
collects the folder: Triton reads it when a kernel is decorated, and the kernel modules are imported
lazily (at first use), so every kernel is created as an interpreted function. The interpreter needs
fp32 (or fp16) inputs: bf16 comes out wrong, so bf16 parity is a GPU test.
"""

import os

import pytest
import torch

from zrl.modeling.kernels import use_backend

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> torch.device:
    if request.param == "cpu" and torch.cuda.is_available():
        pytest.skip("the CPU interpreter run is for machines without CUDA")
    return torch.device(request.param)


@pytest.fixture
def triton_backend():
    with use_backend("triton"):
        yield


def pytest_runtest_setup(item):
    # tests/conftest.py skips `gpu` tests only for the tests/ tree; this folder is collected on its own too.
    if "gpu" in item.keywords and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
