"""The pure helpers of bench/moepp_kernels.py and its neighbours: work formulas, peaks, document layouts, argument parsing
and the timing loop's bookkeeping. Nothing here asserts a time."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from zrl.moepp.config import zaya1_8b_config

_PATH = Path(__file__).resolve().parents[2] / "bench" / "moepp_kernels.py"
_spec = importlib.util.spec_from_file_location("bench_moepp_kernels", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench  # dataclasses look their module up there
_spec.loader.exec_module(bench)
work, groups = sys.modules["moepp_kernels_work"], sys.modules["moepp_kernels_groups"]  # its neighbours

# Tiny shape for hand computation: C = (Hq + Hk) d = 6.
S = work.Shape(D=4, E=2, F=3, Hq=2, Hk=1, d=2, R=2, V=5, k0=2, k1=2, rotary=2)


def test_experts_work_hand_computed():
    w = work.experts_work(S, tokens=5, routed=4, act=2)
    assert w.flops_fwd == 6 * 4 * 4 * 3 == 288
    assert w.flops_bwd == 576
    weights = 3 * 2 * 4 * 3 * 2  # 3 E D F c
    # x 4*4*2, weights, act written+read and gu written 4*4*3*2, y zero fill 5*4*4 and store 4*4*4, 12 n
    assert w.bytes_fwd == 32 + weights + 96 + 80 + 64 + 48
    # dy 2*4*4*4, weights read + written, gu/dgu/act 10*4*3*2, dx zero fill 5*4*2 + store 4*4*2, x 4*4*2
    assert w.bytes_bwd == 128 + 2 * weights + 240 + 40 + 64
    assert w.flops("fwd") == 288 and w.flops("fwd+bwd") == 864
    assert w.bytes("fwd+bwd") == w.bytes_fwd + w.bytes_bwd


def test_experts_work_all_skipped_costs_only_weights_and_zero_fill():
    w = work.experts_work(S, tokens=5, routed=0, act=2)
    assert w.flops_fwd == 0 and w.flops_bwd == 0
    assert w.bytes_fwd == 144 + 5 * 4 * 4
    assert w.bytes_bwd == 2 * 144 + 5 * 4 * 2


def test_dense_gemm_flops():
    assert work.dense_gemm_flops(5, S) == 2 * 5 * 4 * 6


def test_router_work_hand_computed():
    w = work.router_work(S, tokens=3, act=4)  # R = 2, C = E + 1 = 3
    assert w.flops_fwd == 2 * 3 * (2 * 4 + 2 * 3) == 84
    assert w.flops_bwd == 168
    weights = (2 * 4 + 2 * 3 + 3 * 2) * 4  # fc1, fc2, out, three [R] vectors
    assert w.bytes_fwd == 3 * (2 * 4 + 20) + weights + 4 * 3
    assert w.bytes_bwd == 3 * (12 * 2 * 4 + 2 * 3 * 4 + 12) + 2 * weights


def test_residual_norm_work_hand_computed():
    w = work.residual_norm_work(S, tokens=3, act=2)  # T D = 12
    assert (w.flops_fwd, w.flops_bwd) == (108, 276)
    vectors = 5 * 4 * 2 + 4 * 3
    assert w.bytes_fwd == 12 * (2 + 4 + 8) + vectors
    assert w.bytes_bwd == 12 * (2 * 2 + 16) + vectors


def test_cca_work_hand_computed():
    w = work.cca_work(S, tokens=3, act=2)  # C = 6, d = 2, k0 = k1 = 2, rotary 2, Hq + Hk = 3
    per_token = 2 * 2 * 6 + 2 * 2 * 2 * 6 + 10 * 6 + 3 * 2 * 3
    assert per_token == 150
    assert (w.flops_fwd, w.flops_bwd) == (450, 900)
    rope = 3 * 2 * 4  # cos and sin [T, 1] fp32
    assert w.bytes_fwd == 3 * 6 * (2 + 4) + rope + 3 * 8
    assert w.bytes_bwd == 3 * 6 * (3 * 2 + 12 + 2 * (4 + 2)) + rope


def test_lm_logprobs_work_hand_computed():
    w = work.lm_logprobs_work(S, tokens=3, act=2)  # V D = 20
    assert (w.flops_fwd, w.flops_bwd) == (120, 240)
    assert w.bytes_fwd == 3 * 4 * 4 + 20 * 2 + 3 * 12
    assert w.bytes_bwd == 2 * 3 * 4 * 4 + 2 * 20 * 2 + 3 * 4 * 8 + 20 * (8 + 2) + 3 * 16


def test_layer_flops_hand_computed_and_depends_on_documents():
    w = work.layer_flops(S, [2, 1], routed=2)
    proj = 2 * 3 * 4 * (2 * 2 * 2 + 2 * 1 * 2)
    attention = 2 * 2 * 2 * (2 * 2 + 1 * 1)
    assert (proj, attention) == (288, 40)
    assert w.flops_fwd == proj + attention + 48 + 84 + 144 + 450
    assert w.flops_bwd == 2 * w.flops_fwd
    assert math.isnan(w.bytes("fwd"))
    one_doc = work.layer_flops(S, [3], routed=2)
    assert one_doc.flops_fwd - w.flops_fwd == 2 * 2 * 2 * (9 - 5)


def test_full_shape_is_zaya1_8b():
    full, ref = work.FULL.config(), zaya1_8b_config()
    for key in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "moe_intermediate_size", "num_experts", "router_hidden_size", "cca_time0", "cca_time1",
                "rotary_dim", "rope_theta", "rms_norm_eps"):
        assert getattr(full, key) == getattr(ref, key), key
    assert work.FULL.C == (8 + 2) * 128
    assert work.SMALL.config().rotary_dim == work.SMALL.rotary


@pytest.mark.parametrize("name, expected", [
    ("NVIDIA H100 80GB HBM3", (989e12, 67e12, 3.35e12)),
    ("NVIDIA H100 PCIe", (756e12, 51e12, 2.0e12)),
    ("NVIDIA H200", (989e12, 67e12, 4.8e12)),
    ("NVIDIA A100-SXM4-80GB", None),  # a dense bf16 figure (datasheet_bf16) but no fp32 or HBM row
    ("NVIDIA H100 NVL", None),  # not an SXM H100's fp32 and HBM rates
])
def test_device_peaks(name, expected):
    assert work.device_peaks(name) == expected


def test_doc_lengths():
    assert work.doc_lengths(10, 4, ragged=False) == [4, 4, 2]
    assert work.doc_lengths(8, 4, ragged=False) == [4, 4]
    lens = work.doc_lengths(1000, 64, ragged=True)
    assert sum(lens) == 1000 and min(lens) >= 1
    assert all(16 <= n <= 112 for n in lens[:-1])
    assert lens == work.doc_lengths(1000, 64, ragged=True)  # seeded


def test_parse_args_defaults_per_device():
    gpu = bench.parse_args([], cuda=True)
    assert gpu.tokens == [8192, 16384, 32768, 65536] and gpu.iters == 20 and "triton" in gpu.impls
    assert gpu.kernels == list(bench.KERNELS) and gpu.doc_len == 4096
    cpu = bench.parse_args([], cuda=False)
    assert cpu.tokens == [512, 1024, 2048] and cpu.iters == 5 and "triton" not in cpu.impls
    small = bench.parse_args(["--small", "--kernels", "experts", "layer", "--iters", "3"], cuda=True)
    assert small.tokens == [512, 1024, 2048] and small.doc_len == 256
    assert small.kernels == ["experts", "layer"] and small.iters == 3


@pytest.mark.parametrize("argv", [["--kernels", "moe"], ["--skip-share", "1.0"], ["--tokens", "0"],
                                  ["--impls", "cutlass"]])
def test_parse_args_rejects(argv):
    with pytest.raises(SystemExit):
        bench.parse_args(argv, cuda=False)


def test_triton_on_cpu_without_interpreter_exits_clearly(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="TRITON_INTERPRET=1"):
        bench.main(["--impls", "triton", "--small"])


def test_time_group_runs_warmup_then_interleaved_iterations():
    calls = []
    steps = [lambda: calls.append("a"), lambda: calls.append("b")]
    times = bench.time_group(steps, iters=3, warmup=2, cuda=False)
    assert calls == ["a", "a", "b", "b"] + ["a", "b"] * 3
    assert len(times) == 2 and all(t >= 0 for t in times)


def test_make_step_differentiates_all_outputs():
    x = torch.ones(3, requires_grad=True)
    seen = []
    impl = groups.Impl("f", lambda: (x * 2, torch.arange(3), x.sum()), [x])
    step = bench.make_step(impl, "fwd+bwd")
    orig = torch.autograd.grad

    def spy(outputs, inputs, grads, **kw):
        seen.append((len(outputs), [g.shape for g in grads]))
        return orig(outputs, inputs, grads, **kw)

    torch.autograd.grad = spy
    try:
        step()
    finally:
        torch.autograd.grad = orig
    assert seen == [(2, [torch.Size([3]), torch.Size([])])]  # the int64 output is not differentiated


def _tiny_ctx(seed: int = 0):
    import transformers.models.zaya.modeling_zaya as hf

    shape = work.Shape(D=32, E=4, F=16, Hq=4, Hk=2, d=8, R=16, V=64, rotary=4)
    return groups.Ctx(shape=shape, device=torch.device("cpu"), dtype=torch.float32,
                     impls=["reference", "transformers", "grouped_mm"], skip_share=0.25, doc_len=8, hf=hf,
                     gen=torch.Generator().manual_seed(seed))


def _outputs(group):
    return {impl.name: impl.run() for impl in group.impls}


def test_baselines_compute_the_same_thing_with_the_same_weights():
    """Every timed implementation of a group gets the same weights, so the ratios compare equal work.
    fp32, measured: bitwise equal, except the LM head's log-softmax (4.8e-7 on log-probs near -4.2)."""
    ctx, tol = _tiny_ctx(), dict(rtol=1e-5, atol=1e-5)
    (experts,) = groups.experts_groups(ctx, 32)
    out = _outputs(experts)
    assert set(out) == {"reference", "grouped_mm", "transformers"}
    torch.testing.assert_close(out["grouped_mm"], out["reference"], **tol)
    torch.testing.assert_close(out["transformers"], out["reference"], **tol)

    (router,) = groups.router_groups(ctx, 32)
    out = _outputs(router)
    hf_gate = out["transformers"][:, 0]  # [T, top-1]; HF zeroes the gate of skip-class tokens
    routed = hf_gate != 0
    assert routed.sum() > 16
    torch.testing.assert_close(hf_gate[routed], out["reference"][routed], **tol)

    (norm,) = groups.residual_norm_groups(ctx, 32)
    out = _outputs(norm)
    for got, want in zip(out["transformers"], out["reference"]):
        torch.testing.assert_close(got, want, **tol)

    ctx.doc_len = 64  # one document: HF's CCA has no boundaries
    _, with_proj = groups.cca_groups(ctx, 32)
    out = _outputs(with_proj)
    ref, hf = out["reference+proj"], out["transformers"]
    torch.testing.assert_close(hf[0][0].transpose(0, 1), ref[0], **tol)  # q: HF [1, Hq, T, d]
    torch.testing.assert_close(hf[1][0].transpose(0, 1), ref[1], **tol)

    (lm,) = groups.lm_logprobs_groups(ctx, 32)
    out = _outputs(lm)
    torch.testing.assert_close(out["transformers"], out["reference"], **tol)


def test_layer_baseline_matches_zrl_layer():
    ctx = _tiny_ctx(1)
    with torch.random.fork_rng():  # the layers' initialisation draws from torch's global generator
        torch.manual_seed(0)
        uniform, ragged = groups.layer_groups(ctx, 32)
    assert [i.name for i in uniform.impls] == ["reference", "transformers"]
    assert [i.name for i in ragged.impls] == ["reference"]
    out = _outputs(uniform)
    hf_hidden, hf_state = out["transformers"]
    torch.testing.assert_close(hf_hidden.reshape(32, -1), out["reference"][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hf_state.reshape(32, -1), out["reference"][1], rtol=1e-5, atol=1e-5)
    assert "4 equal docs" in uniform.note and "ragged docs" in ragged.note
