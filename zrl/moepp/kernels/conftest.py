"""Fixtures of MoE++'s kernel parity tests: those of zrl/modeling/kernels/conftest.py (the CPU runs use
Triton's interpreter, CUDA cases are `gpu`)."""

from zrl.modeling.kernels.conftest import device, pytest_runtest_setup, triton_backend  # noqa: F401
