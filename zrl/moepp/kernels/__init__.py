"""Fused kernels of the MoE++ model and the switch that picks them.

Each kernel has its own folder here: `reference.py` (pure PyTorch, any device, the definition of
the result), `triton_kernel.py` (the fused Triton version, forward and backward), a parity test and a
README with shapes and tolerances. The folder's `__init__.py` exposes one function that dispatches
between the two; model code calls only that function, so the checkpoint layout never depends on
which backend ran.

Backends:
  "reference"  pure PyTorch everywhere.
  "triton"     the Triton kernels. On CUDA tensors; on CPU tensors only under Triton's interpreter
               (TRITON_INTERPRET=1 set before the kernels are imported; the parity tests use it).
  "auto"       (default) "triton" for CUDA tensors when Triton is importable, else "reference".
The process-wide choice comes from the ZRL_KERNELS environment variable or `set_backend`;
`use_backend` scopes it (tests, benchmarks).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from collections.abc import Iterator

import torch

BACKENDS = ("auto", "triton", "reference")
_ENV = "ZRL_KERNELS"
_chosen: str | None = None  # set_backend's value; None = read the environment


def _check(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return name


def get_backend() -> str:
    """The configured backend name (before resolving "auto")."""
    return _chosen if _chosen is not None else _check(os.environ.get(_ENV, "auto"))


def set_backend(name: str | None) -> None:
    """Choose the backend for this process; None goes back to the environment variable."""
    global _chosen
    _chosen = None if name is None else _check(name)


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    global _chosen
    previous, _chosen = _chosen, _check(name)
    try:
        yield
    finally:
        _chosen = previous


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton kernels run in Triton's CPU interpreter (for tests on machines without a GPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(x: torch.Tensor) -> bool:
    """Resolve the backend for an op whose main input is `x`; raises when "triton" cannot run on it."""
    backend = get_backend()
    if backend == "reference":
        return False
    runnable = triton_available() and (x.is_cuda or (x.device.type == "cpu" and interpreting()))
    if backend == "auto":
        return runnable and x.is_cuda
    if not runnable:
        raise RuntimeError(
            f"kernel backend 'triton' cannot run on a {x.device.type} tensor here (Triton "
            f"{'installed' if triton_available() else 'missing'}; CPU needs TRITON_INTERPRET=1); "
            f"set {_ENV}=reference or auto")
    return True
