"""The backend switch: names, precedence (set_backend over ZRL_KERNELS), resolution per tensor."""

import pytest
import torch

from zrl.moepp import kernels
from zrl.moepp.kernels import get_backend, set_backend, use_backend, use_triton


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


def test_resolution_on_cpu(monkeypatch):
    x = torch.zeros(2)
    with use_backend("reference"):
        assert not use_triton(x)
    with use_backend("auto"):
        assert not use_triton(x)  # auto never picks the interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with use_backend("triton"):
        assert use_triton(x) == kernels.triton_available()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with use_backend("triton"), pytest.raises(RuntimeError, match="CPU needs TRITON_INTERPRET=1"):
        use_triton(x)


@pytest.mark.gpu
def test_auto_picks_triton_on_cuda():
    with use_backend("auto"):
        assert use_triton(torch.zeros(2, device="cuda")) == kernels.triton_available()
