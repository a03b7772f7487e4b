"""bench/cca_traffic.py: the traffic counter by hand, and what the CCA's Triton path launches (on a tiny
shape, through Triton's interpreter). Counts, not times."""

import importlib.util
import sys
from pathlib import Path

import torch

_BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(_BENCH))  # the script imports its neighbour roofline.py
_spec = importlib.util.spec_from_file_location("bench_cca_traffic", _BENCH / "cca_traffic.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

TINY = dict(hq=2, hk=1, d=32, k0=3, k1=2, rotary=16)


def test_counter_by_hand():
    x, y = torch.ones(4, 4), torch.ones(4, 4)
    with bench.Traffic() as t:
        x + y  # reads 2 x 64 B, writes 64 B
        x.view(16).t()  # views: nothing
        torch.zeros(4)  # writes 16 B, reads nothing
        x[:, :2] * 2  # the sliced input at its 32 B, not its 64 B storage; writes 32 B
        torch.empty_like(x)  # an allocation: nothing
    assert t.names["fwd"] == ["add", "zeros", "mul"]
    assert t.launches["fwd"] == 3 and t.bytes["fwd"] == 192 + 16 + 64


def test_triton_path_launches_and_moves_less_than_the_reference():
    paths = {path: bench.measure(path, 256, doc_len=100, shape=TINY) for path in bench.PATHS}
    names = paths["triton"]["names"]
    # Forward: the GEMM weight's layout (flip, clone), the taps, the grouped convolution, the epilogue.
    assert names["fwd"] == ["flip", "clone", "_taps_fwd_kernel", "baddbmm", "_fwd_kernel"]
    # Backward: the epilogue, g_W1, g_b1, g_taps, the taps (with the q/k gradients), the partials' sums
    # (g_w0, g_b0, g_temp) and the weights' layouts back.
    kernels_and_gemms = [n for n in names["bwd"] if n.startswith("_") or n in ("bmm", "baddbmm")]
    assert kernels_and_gemms == ["_bwd_kernel", "bmm", "bmm", "_taps_bwd_kernel"]
    assert len(names["bwd"]) == 11, names["bwd"]
    for phase in ("fwd", "bwd"):
        assert paths["triton"]["launches"][phase] < paths["reference"]["launches"][phase] / 4
        assert paths["triton"]["bytes"][phase] < paths["reference"]["bytes"][phase] / 3
    # the same GEMMs as the library formulation: one batched product forward, two backward
    assert paths["triton"]["gemm_flops"] == paths["library"]["gemm_flops"] > 0
