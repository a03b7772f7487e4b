"""Fused kernels every family shares, and the switch that picks, per op, what runs (for these and for a
family's own kernels, e.g. MoE++'s cca/ and router/ in zrl/moepp/kernels, which the table below names too).

Each kernel has its own folder: `reference.py` (pure PyTorch, any device, the definition of
the result), `triton_kernel.py` (the fused Triton version, forward and backward), a parity test and a
README with shapes and tolerances. The folder's `__init__.py` exposes one function that dispatches
through `resolve(op, x)`; model code calls only that function, so the checkpoint layout never depends
on which implementation ran.

Backends:
  "reference"  pure PyTorch everywhere.
  "triton"     the Triton kernels of every op. On CUDA tensors; on CPU tensors only under Triton's
               interpreter (TRITON_INTERPRET=1 set before the kernels are imported; the parity tests
               use it). For benchmarks and tests of the kernels.
  "auto"       (default) on CUDA, per op what AUTO_ON_CUDA names: the fastest measured of the Triton
               kernel, a library op and the reference; the reference on any other device.
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

# What "auto" runs for CUDA tensors, per op, from fwd+bwd timings on one H200 (torch 2.11, Triton
# 3.6; bench/results/nvidia-h200-2026-11-27*.md; the op's README, "Choice on CUDA", has the figures). "library" = the op's library formulation
# (experts: torch._grouped_mm; lm_logprobs: the reference's chunks with bf16 cuBLAS GEMMs on exact parts
# of the fp32 operands; cca: the reference with its convolutions as one batched GEMM, no padded stream) where
# the op's inputs suit it, else the reference.
AUTO_ON_CUDA = {
    "experts": "library",  # grouped_mm 5.0 / 16.8 ms vs Triton 7.4 / 25.3 ms at 16k / 64k tokens
    "cca": "reference",  # 2.1 / 6.9 ms (fwd / fwd+bwd, 16k tokens); its Triton and library paths untimed
    # Triton (tensor-core split kernel) 445 / 2,424 ms vs the fp32 reference 385 / 1,535 ms (fwd /
    # fwd+bwd, V 262,272, 16k tokens, 2026-11-27): the library formulation replaces both
    "lm_logprobs": "library",  # 482 ms fwd+bwd at 16k tokens (transformers' bf16 head: 133 ms)
    "router": "triton",  # Triton 1.42 / 1.67 ms vs reference 2.41 / 2.46 ms fwd+bwd at 16k / 64k tokens
    "residual_norm": "triton",  # Triton 1.11 / 2.94 ms vs reference 2.96 / 10.75 ms, likewise
}
CHOICES = ("triton", "library", "reference")


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


def resolve(op: str, x: torch.Tensor) -> str:
    """What op `op` (a key of AUTO_ON_CUDA) runs on its main input `x`: one of CHOICES. Raises when the
    backend is forced to "triton" and Triton cannot run on `x`."""
    if op not in AUTO_ON_CUDA:
        raise ValueError(f"unknown kernel op {op!r}; ops: {', '.join(AUTO_ON_CUDA)}")
    backend = get_backend()
    if backend == "reference":
        return "reference"
    if backend == "triton":
        if not (triton_available() and (x.is_cuda or (x.device.type == "cpu" and interpreting()))):
            raise RuntimeError(
                f"kernel backend 'triton' cannot run on a {x.device.type} tensor here (Triton "
                f"{'installed' if triton_available() else 'missing'}; CPU needs TRITON_INTERPRET=1); "
                f"set {_ENV}=reference or auto")
        return "triton"
    if not x.is_cuda:  # auto never picks the interpreter
        return "reference"
    choice = AUTO_ON_CUDA[op]
    return "reference" if choice == "triton" and not triton_available() else choice


def use_triton(x: torch.Tensor, op: str) -> bool:
    """Whether op `op` runs its Triton kernels on `x` (see `resolve`)."""
    return resolve(op, x) == "triton"
