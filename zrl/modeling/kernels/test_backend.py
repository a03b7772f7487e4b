"""The backend switch: names, precedence (set_backend over ZRL_KERNELS), per-op resolution per tensor."""

from pathlib import Path

import pytest
import torch

from zrl.modeling import kernels
from zrl.modeling.kernels import (AUTO_ON_CUDA, CHOICES, get_backend, resolve, set_backend, use_backend,
                                  use_triton)


@pytest.fixture(autouse=True)
def _restore():
    set_backend(None)  # an in-process TrainerWorker earlier in the session may have chosen one
    yield
    set_backend(None)


def test_environment_then_explicit_choice(monkeypatch):
    monkeypatch.delenv("ZRL_KERNELS", raising=False)
    assert get_backend() == "auto"
    monkeypatch.setenv("ZRL_KERNELS", "reference")
    assert get_backend() == "reference"
    set_backend("triton")
    assert get_backend() == "triton"
    with use_backend("auto"):
        assert get_backend() == "auto"
    assert get_backend() == "triton"
    set_backend(None)
    assert get_backend() == "reference"


def test_unknown_names_are_rejected(monkeypatch):
    with pytest.raises(ValueError, match="unknown kernel backend 'fast'; choose one of auto, triton, reference"):
        set_backend("fast")
    monkeypatch.setenv("ZRL_KERNELS", "cuda")
    with pytest.raises(ValueError, match="'cuda'"):
        get_backend()
    with pytest.raises(ValueError, match="unknown kernel op 'expert'; ops: experts, cca"):
        resolve("expert", torch.zeros(2))


def test_auto_table_names_every_kernel_folder():
    import zrl.moepp.kernels as moepp_kernels

    folders = {p.parent.name for package in (kernels, moepp_kernels)
               for p in Path(package.__file__).parent.glob("*/triton_kernel.py")}
    assert set(AUTO_ON_CUDA) == folders
    assert set(AUTO_ON_CUDA.values()) <= set(CHOICES)


@pytest.mark.parametrize("op", list(AUTO_ON_CUDA))
def test_resolution_on_cpu(monkeypatch, op):
    x = torch.zeros(2)
    with use_backend("reference"):
        assert resolve(op, x) == "reference"
    with use_backend("auto"):
        assert resolve(op, x) == "reference"  # auto never picks the interpreter, nor a library op on CPU
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if kernels.triton_available():
        with use_backend("triton"):
            assert resolve(op, x) == "triton" and use_triton(x, op)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with use_backend("triton"), pytest.raises(RuntimeError, match="CPU needs TRITON_INTERPRET=1"):
        resolve(op, x)


@pytest.mark.gpu
@pytest.mark.parametrize("op", list(AUTO_ON_CUDA))
def test_resolution_on_cuda(op):
    x = torch.zeros(2, device="cuda")
    auto = AUTO_ON_CUDA[op]
    if auto == "triton" and not kernels.triton_available():
        auto = "reference"
    for backend, expected in (("auto", auto), ("reference", "reference"), ("triton", "triton")):
        with use_backend(backend):
            assert resolve(op, x) == expected, backend
