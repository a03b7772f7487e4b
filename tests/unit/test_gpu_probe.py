"""bench/gpu_probe.py: its work formulas (bench/moepp_kernels_work.py's step model), the time-boxed part
runner, the pytest report parser, the roofline estimate, and the whole probe in --smoke mode on CPU (so
the command meant for a GPU machine cannot rot). Nothing here asserts a time."""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from zrl.moepp import MoEPPForCausalLM
from zrl.optim import ns_flops

_ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_gpu_probe", _ROOT / "bench" / "gpu_probe.py")
probe = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = probe  # dataclasses look their module up there
_spec.loader.exec_module(probe)
work = sys.modules["moepp_kernels_work"]  # the probe put bench/ on the path and imported it
roofline = sys.modules["roofline"]  # likewise

# Tiny shape for hand computation: C = (Hq + Hk) d = 6.
S = work.Shape(D=4, E=2, F=3, Hq=2, Hk=1, d=2, R=2, V=5, k0=2, k1=2, rotary=2)


def test_gemm_norm_attention_and_split_lm_head_work_hand_computed():
    g = work.gemm_work(3, 5, 7, act=2)
    assert (g.flops_fwd, g.flops_bwd) == (210, 420)
    assert (g.bytes_fwd, g.bytes_bwd) == ((21 + 35 + 15) * 2, 2 * (15 + 35 + 21) * 2)

    n = work.rms_norm_work(S, tokens=3, act=2)  # T D = 12
    assert (n.flops_fwd, n.flops_bwd) == (48, 96)
    assert (n.bytes_fwd, n.bytes_bwd) == (12 * 6 + 4 * 2, 12 * 10 + 4 * 4)

    a = work.attention_work(S, [2, 1], act=2)  # T = 3, sum S^2 = 5
    assert a.flops_fwd == 2 * 2 * 2 * 5 and a.flops_bwd == 2 * a.flops_fwd
    assert a.bytes_fwd == 3 * 2 * (2 * 2 + 2 * 1) * 2 + 4 * 3 * 2
    assert a.bytes_bwd == 3 * 2 * (4 * 2 + 4 * 1) * 2 + 8 * 3 * 2

    h = work.lm_head_split_work(S, tokens=3, act=2)  # 2 T V D = 120, T D = 12, V D = 20
    assert (h.flops_fwd, h.flops_bwd) == (3 * 120, 9 * 120)  # the library's 3 + (3 + 3 + 3) GEMMs
    assert h.bytes_fwd == 12 * 4 + 20 * 2 + 12 * 3
    assert h.bytes_bwd == 2 * (12 * 4 + 20 * 2) + 12 * 4 + 20 * (8 + 2) + 16 * 3
    b = work.lm_head_block_work(S, tokens=3)  # T V = 15
    assert (b.bytes_fwd, b.bytes_bwd) == (44 * 15, 134 * 15) and (b.flops_fwd, b.flops_bwd) == (150, 450)


def test_model_step_flops_is_three_forwards_with_one_lm_head_gemm():
    docs, routed = [2, 1], [3, 1]
    layers = work.layer_flops(S, docs, 3).flops_fwd + work.layer_flops(S, docs, 1).flops_fwd
    assert work.model_step_flops(S, 2, docs, routed) == 3 * (layers + 2 * 3 * 5 * 4)
    with pytest.raises(ValueError, match="one routed count per layer"):
        work.model_step_flops(S, 3, docs, routed)


def test_optimizer_shapes_cover_every_parameter_once():
    config = work.FULL.config()
    muon, adamw = work.optimizer_shapes(config)
    params = sum(p.numel() for p in MoEPPForCausalLM(work.SMALL.config()).parameters())
    small_muon, small_adamw = work.optimizer_shapes(work.SMALL.config())
    assert sum(math.prod(s) for s in small_muon) + small_adamw == params
    assert (16, 2 * 2048, 2048) in muon and (16, 2048, 2048) in muon  # the experts go to Muon
    assert adamw >= 262_272 * 2048  # the tied embedding goes to AdamW


def test_training_step_ops_count_recomputation_but_model_flops_do_not():
    docs, optimizer = [3, 2], work.optimizer_shapes(work.SMALL.config())
    on = {op.name: op for op in work.training_step_ops(work.SMALL, 2, docs, 4, optimizer=optimizer)}
    off = {op.name: op for op in work.training_step_ops(work.SMALL, 2, docs, 4, checkpointing=False)}
    experts = work.experts_work(work.SMALL, 5, 4, 2)
    assert on["experts"].flops == 2 * (2 * experts.flops_fwd + experts.flops_bwd)
    assert off["experts"].flops == 2 * (experts.flops_fwd + experts.flops_bwd)
    assert on["experts"].model_flops == off["experts"].model_flops == off["experts"].flops
    attention = work.attention_work(work.SMALL, docs, 2)
    assert off["attention"].flops == 2 * (attention.flops_fwd + 1.25 * attention.flops_bwd)
    assert on["lm_head"].flops == 12 / 3 * on["lm_head"].model_flops  # 12 GEMM-equivalents where MFU counts 3
    assert on["lm_head_blocks"].model_flops == 0 and not on["lm_head_blocks"].tensor_cores
    assert on["muon"].flops == sum(ns_flops(s) for s in optimizer[0]) and on["muon"].model_flops == 0
    assert {"muon", "adamw", "fsdp_casts"} <= set(on) and not {"muon", "adamw"} & set(off)
    assert all(op.bytes > 0 for op in on.values())


def test_roofline_bound_is_the_sum_of_per_op_bounds_and_moves_with_the_lm_head():
    base = roofline.roofline()
    rates = roofline.ROOFLINE
    by_hand = sum(max(row["op"].flops / ((rates["gemm_tflops"] if row["op"].tensor_cores else rates["fp32_tflops"])
                                         * 1e12), row["op"].bytes / (rates["hbm_tbs"] * 1e12)) for row in base["rows"])
    assert base["bound_s"] == pytest.approx(by_hand, rel=1e-12)
    assert base["step_s"] == pytest.approx(base["bound_s"] / rates["efficiency"])
    assert base["tokens"] == 65536 and base["layers"] == 4
    bf16_head = roofline.roofline(lm_head_dots=(1, 2))
    assert bf16_head["mfu"] > base["mfu"]  # the split LM head is what the projection hinges on
    assert bf16_head["model_flops"] == base["model_flops"]  # MFU counts the same work either way


def test_roofline_mode_writes_its_file(tmp_path):
    path = probe.main(["--roofline", "--out", str(tmp_path)])
    text = path.read_text()
    assert path.name == "roofline-zaya1-4layer-64k.md"
    assert "**Projected step" in text and "| lm_head | 1 |" in text and "| experts | 4 |" in text


def test_parse_junit_counts_and_first_lines(tmp_path):
    xml = tmp_path / "report.xml"
    xml.write_text(
        '<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="4" failures="1" errors="1" skipped="1">'
        '<testcase classname="a.test_x" name="test_ok"/>'
        '<testcase classname="a.test_x" name="test_bad"><failure message="AssertionError: 1 != 2&#10;more">'
        'def test_bad():&#10;&gt;       assert f() == 2&#10;E       AssertionError: 1 != 2&#10;E         max 3e-5&#10;'
        'x.py:3: AssertionError</failure></testcase>'
        '<testcase classname="a.test_y" name="test_err"><error message="CompilationError: K &gt;= 16"/></testcase>'
        '<testcase classname="a.test_y" name="test_skip"><skipped message="needs CUDA"/></testcase>'
        '</testsuite></testsuites>')
    got = probe.parse_junit(xml)
    assert (got["tests"], got["passed"], got["failures"], got["errors"], got["skipped"]) == (4, 1, 1, 1, 1)
    assert got["failed"] == [{"test": "a.test_x::test_bad", "first_line": "AssertionError: 1 != 2",
                              "detail": "AssertionError: 1 != 2\nmax 3e-5"},
                             {"test": "a.test_y::test_err", "first_line": "CompilationError: K >= 16", "detail": ""}]
    assert "error" in probe.parse_junit(tmp_path / "missing.xml")


def test_run_part_keeps_rows_of_a_part_that_times_out_or_fails(tmp_path):
    rows = tmp_path / "rows.jsonl"
    hang = ("import json, sys, time; f = open(sys.argv[1], 'a'); f.write(json.dumps({'kind': 'note', 'text': 'a'}) "
            "+ '\\n'); f.flush(); f.write('{\"trunc'); f.flush(); time.sleep(600)")
    result = probe.run_part("slow", "", [sys.executable, "-c", hang, str(rows)], rows, timeout_s=3)
    assert result.status == "timed out after 3 s"
    assert result.rows == [{"kind": "note", "text": "a"}]  # the half-written line is dropped
    rows2 = tmp_path / "rows2.jsonl"
    fail = "import sys; print('the reason'); sys.exit(3)"
    result = probe.run_part("bad", "", [sys.executable, "-c", fail], rows2, timeout_s=30)
    assert result.status == "failed (exit status 3)" and "the reason" in result.log_tail and result.rows == []


def test_summarise_and_goals_from_rows():
    gemm = 100e12
    step = dict(step=1, warmup=False, tokens=1000, step_s=2.0, model_flops=60e12, optimizer_s=0.5,
                peak_memory_gib=3.0)
    parts = [probe.PartResult("env", "", "ok", 1.0, [{"kind": "gemm", "n": 8, "dtype": "bf16", "tflops": gemm / 1e12}]),
             probe.PartResult("trainer", "4", "ok", 1.0, [{"kind": "trainer_step", **step, "step": 0, "warmup": True},
                                                          {"kind": "trainer_step", **step}]),
             probe.PartResult("kernels", "16", "ok", 1.0, [
                 {"kind": "kernel", "tokens": 16, "group": "lm_logprobs", "impl": impl, "mode": "fwd", "ms": ms,
                  "share_gemm": 0.5} for impl, ms in (("library", 2.0), ("triton", 9.0), ("transformers", 3.0))]
              + [{"kind": "kernel", "tokens": 16, "group": "experts", "impl": "grouped_mm", "mode": "fwd", "ms": 1.0,
                  "share_gemm": 0.75}, {"kind": "error", "where": "cca triton fwd", "error": "OutOfMemoryError: x"}])]
    s = probe.summarise(parts)
    run = s["trainer"]["4"]["summary"]
    assert run["steps"] == 1 and not run["warmup_only"] and run["mfu"] == pytest.approx(60e12 / 2.0 / gemm)
    assert run["optimizer_share"] == 0.25 and run["tokens_per_s"] == 500
    assert s["errors"] == ["kernels 16: cca triton fwd: OutOfMemoryError: x"]
    rows = {g[0]: g for g in probe.goals(s, (16, 64))}
    assert rows["MFU fwd+bwd, 4 layers x ~64k tokens"][1:] == ("30.0% (30 TFLOP/s)", ">= 30%", "met")
    # the LM head that CUDA runs ("library"), against transformers' bf16 head
    assert rows["LM head fwd at 16: transformers (bf16) ms / library ms"][1:] == ("1.50x", ">= 0.25x", "met")
    assert rows["experts fwd share of the dense GEMM at 16"][3] == "met"
    assert rows["experts fwd share of the dense GEMM at 64"][3] == "-"  # not measured, not a verdict
    assert rows["`gpu` tests"][1] == "not run"


@pytest.mark.slow  # 63-67 s measured on 2 cores at load average ~6 (~33 s of CPU time): six child processes
def test_smoke_run_writes_a_complete_report(tmp_path):
    """The whole probe on CPU, as CI runs it: every part ends ok, every op of the kernel table has rows at
    both token counts, both trainer runs have steps and a profile, and nothing failed on the way."""
    done = subprocess.run([sys.executable, str(_ROOT / "bench" / "gpu_probe.py"), "--smoke", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (md,) = tmp_path.glob("smoke-*.md")
    twin = json.loads(md.with_suffix(".json").read_text())
    assert [p["status"] for p in twin["parts"]] == ["ok"] * len(probe.PLAN), twin["parts"]
    s = twin["summary"]
    assert s["errors"] == [] and s["notes"] == []
    assert s["gemm"]["tflops"] > 0
    for tokens in (64, 128):
        groups = {r["group"] for r in s["kernels"] if r["tokens"] == tokens}
        assert {"lm_logprobs", "experts", "cca", "cca+proj", "layer", "layer ragged", "attention", "attention equal",
                "router", "residual_norm"} <= groups
        impls = {r["impl"] for r in s["kernels"] if r["tokens"] == tokens}
        assert {"reference", "transformers", "grouped_mm", "library"} <= impls  # triton runs on CUDA only
    for layers in ("4", "8"):
        run = s["trainer"][layers]
        assert len(run["steps"]) == 2 and run["summary"]["tokens_per_s"] > 0 and len(run["profile"]["top"]) == 20
        for step in run["steps"]:
            assert step["tokens"] == step["input_tokens"]  # the probe's FLOP count sees the tokens the trainer saw
            assert 0 < min(step["routed"]) and max(step["routed"]) <= step["tokens"]
    assert s["gpu_tests"]["tests"] > 0 and s["gpu_tests"]["failures"] == 0  # on CPU every `gpu` test skips
    text = md.read_text()
    assert text.startswith("# GPU probe: ") and "Smoke run" in text and "## Trainer: 4 layers" in text
