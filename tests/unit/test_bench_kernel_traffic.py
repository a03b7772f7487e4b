"""bench/kernel_traffic.py: the traffic counter by hand, and what the CCA's Triton path and the experts' fused
glue launch (tiny shapes, Triton's interpreter). Counts, not times."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from zrl.modeling.kernels.experts import grouped_mm

_BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(_BENCH))  # the script imports its neighbours roofline.py and moepp_kernels_work.py
_spec = importlib.util.spec_from_file_location("bench_kernel_traffic", _BENCH / "kernel_traffic.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

TINY_CCA = dict(hq=2, hk=1, d=32, k0=3, k1=2, rotary=16)
TINY_EXPERTS = dict(d=32, f=48, e=3)
TINY_PROJ = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
TINY_LAYER = dict(hidden_size=64, moe_intermediate_size=64, num_experts=4, router_hidden_size=32,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def test_counter_by_hand():
    x, y = torch.ones(4, 4), torch.ones(4, 4)
    with bench.Traffic() as t:
        x + y  # reads 2 x 64 B, writes 64 B
        x.view(16).t()  # views: nothing
        torch.zeros(4)  # writes 16 B, reads nothing
        x[:, :2] * 2  # the sliced input at its 32 B, not its 64 B storage; writes 32 B
        torch.empty_like(x)  # an allocation: nothing
        x @ y  # a GEMM: not glue
    assert t.names["fwd"] == ["add", "zeros", "mul", "mm"]
    assert t.launches["fwd"] == 4 and t.bytes["fwd"] == 192 + 16 + 64 + 192 and t.glue_bytes["fwd"] == 272
    line = bench.at(300, dict(bytes={"fwd": 10}), dict(bytes={"fwd": 16}), small_tokens=100)
    assert line("bytes", "fwd") == 22  # 4 + 0.06 T through (100, 10) and (200, 16)


def test_cca_triton_path_launches_and_moves_less_than_the_reference():
    paths = {path: bench.count("cca", path, 256, TINY_CCA) for path in bench.PATHS["cca"]}
    # Forward: the taps, the grouped convolution, the epilogue; backward: the epilogue, g_W1, g_taps, the taps
    # (with the q/k gradients). Around them the weights' casts and layouts, and the partials' sums.
    for path, gemm in (("triton", "bf16_gemm"), ("triton fp32 weights", "bmm")):
        names = paths[path]["names"]
        assert [n for n in names["fwd"] if n.endswith("_kernel") or n in bench.GEMMS] == [
            "_taps_fwd_kernel", gemm, "_fwd_kernel"], path
        assert [n for n in names["bwd"] if n.endswith("_kernel") or n in bench.GEMMS] == [
            "_bwd_kernel", gemm, gemm, "_taps_bwd_kernel"], path
        # measured here: launches 5.2x / 4.9x fewer (fwd / bwd; fp32 weights 10.4x / 7.2x), bytes 2.8x / 4.5x
        # fewer (3.5x / 3.7x; with bf16 weights the taps are saved as three bf16 parts, 6 B for 4)
        for phase in ("fwd", "bwd"):
            assert paths[path]["launches"][phase] < paths["reference"]["launches"][phase] / 4
            assert paths[path]["bytes"][phase] < paths["reference"]["bytes"][phase] / 2.5
    # fp32 weights: the library formulation's GEMMs (one batched product forward, two backward) in fp32;
    # bf16 weights: on the tensor cores, the forward's K three times as long (the taps' three parts)
    library = paths["library"]["gemm_flops"]
    assert paths["triton fp32 weights"]["gemm_flops"] == library > 0
    assert paths["triton"]["gemm_flops"] == 0 and paths["triton"]["bf16_gemm_flops"] == 5 / 3 * library


@pytest.mark.skipif(not grouped_mm.available(), reason=f"torch {torch.__version__} has no torch._grouped_mm")
def test_experts_fused_glue_launches_and_moves_less_than_the_torch_glue():
    torch_glue, fused = (bench.count("experts", path, 64, TINY_EXPERTS) for path in ("torch glue", "fused glue"))
    for phase in ("fwd", "bwd"):
        kernels_and_gemms = [n for n in fused["names"][phase] if n.startswith("_")]
        assert kernels_and_gemms == {
            "fwd": ["_move_rows_kernel", "_grouped_mm", "_swiglu_fwd_kernel", "_grouped_mm", "_move_rows_kernel"],
            "bwd": ["_unpermute_scale_bwd_kernel", "_grouped_mm", "_grouped_mm", "_swiglu_bwd_kernel", "_grouped_mm",
                    "_grouped_mm", "_move_rows_kernel"]}[phase]
        assert not {"index_copy", "where", "silu", "silu_backward", "cat"} & set(fused["names"][phase])
        assert fused["launches"][phase] < torch_glue["launches"][phase]
        assert fused["glue_bytes"][phase] < 0.6 * torch_glue["glue_bytes"][phase]
    assert fused["gemm_flops"] == torch_glue["gemm_flops"] > 0


def test_cca_projections_as_one_gemm_launch_and_move_less_than_four():
    four, one = (bench.count("cca_proj", path, 256, TINY_PROJ) for path in ("four GEMMs", "one GEMM"))
    gemms = {path: {phase: [n for n in c["names"][phase] if n in bench.GEMMS] for phase in ("fwd", "bwd")}
             for path, c in (("four", four), ("one", one))}
    assert [len(gemms["four"][p]) for p in ("fwd", "bwd")] == [4, 8]  # per projection: forward, dx, dW
    assert [len(gemms["one"][p]) for p in ("fwd", "bwd")] == [1, 2]
    assert "add" in four["names"]["bwd"] and "add" not in one["names"]["bwd"]  # no sum of four input gradients
    assert one["gemm_flops"] == four["gemm_flops"] > 0
    # measured here: bytes 2.2x fewer forward, 2.9x backward (ZAYA1's shape at 64k tokens: 3.2x, 4.8x)
    for phase in ("fwd", "bwd"):
        assert one["bytes"][phase] < four["bytes"][phase] / 2



@pytest.mark.skipif(not grouped_mm.available(), reason=f"torch {torch.__version__} has no torch._grouped_mm")
def test_layer_paths_and_where_their_bytes_go():
    auto, candidates = (bench.count("layer", path, 64, TINY_LAYER, sites=True) for path in bench.PATHS["layer"])
    for counted in (auto, candidates):
        for phase in ("fwd", "bwd"):
            # every launch is placed at a zrl function, and the sites add up to the totals
            sites = {site: v for (p, site), v in counted["sites"].items() if p == phase}
            assert "-" not in sites
            assert sum(n for n, _ in sites.values()) == counted["launches"][phase]
            assert sum(b for _, b in sites.values()) == counted["bytes"][phase]
        # the input norm writes bf16, as the q, k, v projections take it: nothing casts it there
        assert counted["sites"][("fwd", "zrl/modeling/blocks.py:linears")][0] == 2  # the weights' cat, the GEMM
    # auto's CCA reference and PyTorch glue against the Triton CCA and the fused glue
    assert {"zrl/moepp/kernels/cca/reference.py:cca_precondition", "zrl/modeling/rope.py:apply_partial_rope"} <= {
        site for _, site in auto["sites"]}
    assert "zrl/modeling/kernels/experts/glue.py:permute" in {site for _, site in candidates["sites"]}
    for phase in ("fwd", "bwd"):
        assert candidates["launches"][phase] < auto["launches"][phase] / 1.5
        assert candidates["bytes"][phase] < auto["bytes"][phase]
