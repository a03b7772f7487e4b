"""Without CUDA, the Triton-backend test runs the kernels through Triton's interpreter: TRITON_INTERPRET
must be set before any kernel is created (they are created lazily, at first use), as in
zrl/moepp/kernels/conftest.py."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
