"""Every Triton kernel of zrl.moepp.kernels compiles for sm_90a (H100/H200), without a GPU, and the ones
that multiply matrices on the trainer's dtype path do it on the tensor cores.

The check (sm90_check.py) drives each launcher on meta tensors at the ZAYA1-8B shapes and at every
shape the kernels' CUDA (`gpu`) tests launch (sm90_drivers.py), and compiles each distinct
specialisation with Triton's bundled ptxas. It runs in a subprocess whose environment has no
TRITON_INTERPRET: this folder's conftest sets it in the pytest process, and a kernel decorated under
it is an interpreted function that cannot be compiled. ~280 compiles in a process per CPU (3.5 min on
2 shared cores, ~400 CPU-seconds): `slow`.
"""

import json
import os
import subprocess
import sys

import pytest

from zrl.moepp.kernels.sm90_check import ptxas_path

# Kernels that multiply matrices (tl.dot) and must issue tensor-core instructions (wgmma or mma.sync in
# the PTX) in every launch of the trainer's dtype path: bf16 parameters and activations, fp32 final
# hidden states with the bf16 tied embedding into lm_logprobs (sm90_drivers.Driver.trainer).
TENSOR_CORE_KERNELS = {
    "experts._gate_up_fwd_kernel", "experts._row_gemm_kernel", "experts._down_bwd_kernel",
    "experts._wgrad_kernel",
    "router._route_fwd", "router._route_bwd",
    "lm_logprobs._forward_kernel", "lm_logprobs._grad_hidden_kernel", "lm_logprobs._grad_weight_kernel",
}
# The CCA's Triton kernels have no matrix product (its GEMMs are cuBLAS's): they are not in the set.

# Measured spills (bytes stored + loaded per thread, sm_90a, Triton 3.9) of the production-shape
# launches that spill; every other production launch must spill nothing, and these no more. The tests'
# shapes are only required to compile. Keys: (kernel, launch label as sm90_check prints it). Since T
# is not specialised on, router._route_bwd spills 8 B (bf16) / 84 B (fp32) more than with T % 16 == 0
# known (same vector widths on every [rows, features] tile).
KNOWN_SPILLS: dict[tuple[str, str], int] = {
    ("experts._down_bwd_kernel", "bf16 [bf16,fp32,i32,i64] stride_wn=1 IEEE=0"): 32,
    ("router._route_bwd", "bf16 [bf16,fp32,i64] DOT_PRECISION=tf32"): 1572,
    ("router._route_bwd", "fp32 [fp32,i64] DOT_PRECISION=ieee"): 860,
}

_SCRIPT = """
import dataclasses, json, sys
from zrl.moepp.kernels import sm90_check
results = sm90_check.run_all()
json.dump([dict(dataclasses.asdict(r), n_spills=r.n_spills, tensor_core=r.tensor_core) for r in results],
          sys.stdout)
"""


@pytest.fixture(scope="module")
def results() -> list[dict]:
    if ptxas_path() is None:
        pytest.skip("Triton's ptxas is not available: cannot compile for sm_90a")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9's default, set to silence its warning
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True,
                          timeout=1800, check=False)
    assert proc.returncode == 0, f"sm90_check failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout)


@pytest.mark.slow
def test_every_op_is_checked(results):
    kernels = {r["kernel"] for r in results if "." in r["kernel"]}  # not a launcher's refusal
    assert {k.split(".")[0] for k in kernels} == {"experts", "router", "residual_norm", "cca", "lm_logprobs"}
    # forward and backward kernels of every op (counts of distinct kernel functions); experts: 4 + the glue's 4
    # lm_logprobs: 3 + the fused head's row statistics and gradient parts
    assert len(kernels) == 8 + 2 + 2 + 4 + 5, sorted(kernels)
    assert any(r["production"] for r in results) and any(not r["production"] for r in results)


@pytest.mark.slow
def test_every_launch_compiles_for_sm90a(results):
    """At the production shapes and at every CUDA test's (a launcher refusing a test's tiles fails too)."""
    failed = [f"{r['kernel']} ({r['variant']}): {r['error']}" for r in results if not r["ok"]]
    assert not failed, "\n".join(failed)


@pytest.mark.slow
def test_matmul_kernels_use_tensor_cores_on_the_trainer_path(results):
    trainer = [r for r in results if r["trainer"] and r["ok"]]
    assert {r["kernel"] for r in trainer} >= TENSOR_CORE_KERNELS
    missing = [f"{r['kernel']} ({r['variant']}): wgmma {r['wgmma']}, mma.sync {r['mma']}, fma.f32 {r['fma']}"
               for r in trainer if r["kernel"] in TENSOR_CORE_KERNELS and r["tensor_core"] == 0]
    assert not missing, "no tensor-core instruction in:\n" + "\n".join(missing)


@pytest.mark.slow
def test_production_spills_are_the_measured_ones(results):
    unexpected = []
    for r in results:
        bound = KNOWN_SPILLS.get((r["kernel"], r["variant"]), 0)
        if r["production"] and r["n_spills"] > bound:
            unexpected.append(f"{r['kernel']} ({r['variant']}): {r['n_spills']} B spilled, expected <= {bound}")
    assert not unexpected, "\n".join(unexpected)


@pytest.mark.slow
def test_pipelined_norm_backward_stages_its_loads_in_shared_memory(results):
    """residual_norm's backward with STAGES > 1 (triton_kernel.PIPELINED_STAGES) is software-pipelined:
    its row loads are cp.async copies into shared memory; with STAGES = 1 the loop loads to registers."""
    backward = [r for r in results if r["kernel"] == "residual_norm._backward_kernel" and r["ok"]]
    pipelined = [r for r in backward if "STAGES=1" not in r["variant"]]
    assert pipelined and any(r["production"] for r in pipelined), sorted(r["variant"] for r in backward)
    assert all(r["cp_async"] > 0 for r in pipelined), [(r["variant"], r["cp_async"]) for r in pipelined]
    assert all(r["cp_async"] == 0 for r in backward if "STAGES=1" in r["variant"])
