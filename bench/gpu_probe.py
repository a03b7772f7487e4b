"""One command that measures the trainer on one GPU: environment, trainer steps and MFU, kernel table, `gpu` tests.

On one H100/H200 in about 9 minutes (one 10-minute device call) it writes bench/results/<gpu>-<date>.md and
its JSON twin:
  env        device; torch, CUDA, Triton, transformers versions; the card's data-sheet dense bf16 peak
             (moepp_kernels_work.BF16_DENSE_PEAKS; an unlisted card gets none, and the report says so) and
             the dense bf16 GEMM rate (8192^3) measured now
  trainer    full RL steps through TrainerWorker, in-process (one FSDP2 rank on NCCL, world size 1; no Ray)
             at the ZAYA1-8B layer shape cut to 4 and 8 layers, kernels "auto", bf16 parameters; each step
             --microbatches microbatches (default 2) of ~115k tokens (~1k-token documents, token budget
             131,072: the recipe's trainer_microbatch_tokens), gradients accumulated, then one Muon + AdamW
             step. 4 layers with full activation checkpointing, then with selective checkpointing
             (resources.activation_checkpointing_selective), then full with the CCA's Triton path, the
             experts' fused glue and the norms' pipelined backward in place of auto's choices
             ("full+cca=triton+fused_glue+pipelined_norm"), 8 layers full:
             tokens/s, MFU, optimizer
             share, peak memory, a torch.profiler top-20 table (self CUDA time) of one 4-layer step
  projection the 40-layer step of the recipe's 20 microbatches (RECIPE_MICROBATCHES), from the 4- and
             8-layer steps: per token, compute time and model FLOPs are head + layers x layer (the head: LM
             head, embedding, loss), the optimizer's seconds per step likewise; its tokens/s and MFU
  fit        the largest layer count whose full trainer step (1 microbatch) fits the GPU: first the layer
             count where the 4- and 8-layer peaks' line reaches FIT_MEMORY_SHARE of the device memory,
             then up by ~10% while steps fit and down or in between once one runs out of memory; each try
             a process of its own, an out-of-memory error a row of the report
  kernels    at 16k and 64k tokens, each op (lm_logprobs, experts, cca, attention, router,
             residual_norm, decoder layer) as the Triton kernel vs the PyTorch reference vs transformers'
             piece vs the library op (experts: torch._grouped_mm), fwd and fwd+bwd: ms, TFLOP/s and the
             share of a dense [T, D] x [D, 2F] GEMM timed in the same part (bench/moepp_kernels_groups.py's
             groups; FLOPs from bench/moepp_kernels_work.py). The LM head also as "fused": the head fused
             with the RL loss (lm_logprobs/fused.py, what the trainer's loss runs); the summary sets its
             fwd+bwd at 16k tokens against transformers' bf16 head (goal <= 1.5x). At 64k the fwd+bwd of
             the experts (zrl's and transformers' grouped_mm), the CCA (reference, Triton, library) and
             the fused head once more under torch.profiler: their top device kernels (PROFILED)
  gpu_tests  `pytest -m gpu zrl/modeling/kernels zrl/moepp/kernels`: counts and each failure's first line
The report (summary, projection, goals, Markdown) is gpu_probe_report.py, the trainer parts and the fit
search's arithmetic gpu_probe_trainer.py. Each part runs in its own Python process under a time limit: a CUDA error or a hang ends that part only, what it measured before is kept,
and time a part leaves unused goes to the later ones. In the kernel table a first call over
FIRST_CALL_LIMIT_S is reported alone (compilation included: an upper bound, marked "~"), and an
implementation whose forward takes over SLOW_FORWARD_S gets no fwd+bwd row.

MFU = model FLOPs per step / step time / the card's data-sheet dense bf16 peak (989 TFLOP/s on an H100 SXM
or H200: the convention of verl, torchtitan and prime-rl), printed beside the same over the measured GEMM
(720-790 TFLOP/s on an H200). Model FLOPs per step (moepp_kernels_work.model_step_flops) = 3 x forward =
  3 x [ sum over layers l of ( 2 T D (2 Hq d + 2 Hk d)     q, k, v, o projections
                              + 2 Hq d sum_i S_i^2          causal attention over documents S_i (half the
                                                            S^2 score and value products)
                              + 2 T D R + router head       router
                              + 6 n_l D F                   experts, n_l tokens routed in layer l
                              + CCA )                       convolutions, RoPE
        + 2 T V D ]                                          LM head, counted once as one bf16 GEMM
Recomputation (activation checkpointing, an LM head split into several bf16 products) is not counted;
norms, elementwise ops and the optimizer are not counted either.
Goals (the report's summary): >= 30% of the data sheet projected at 40 layers, >= 20% measured at 4.

--smoke   the same parts on CPU with tiny shapes (tests/unit/test_gpu_probe.py runs it); its rates
          are not claims about anything.
--roofline  writes bench/results/roofline-zaya1-4layer-64k.md: FLOPs and bytes per op of a 4-layer,
          64k-token step (bench/roofline.py, from moepp_kernels_work.training_step_ops) against an H200's
          roofline; no device.

The device machine has torch and Triton only (no vLLM, no Ray; the probe blocks both imports, so any
run, a CPU one included, shows it needs neither) and no network. Wheels to install there (CPython 3.12,
`pip install --no-index --no-deps --target /tmp/site <folder>/*.whl`): pydantic, pydantic-core,
annotated-types, typing-inspection, typing-extensions (the trainer's settings); transformers and
tokenizers (transformers' rows; without them only those rows are missing; numpy, safetensors and PyYAML
come with transformers); pytest, pluggy and iniconfig where pytest is missing. Then, from the checkout:
  PYTHONPATH=.:/tmp/site python3 bench/gpu_probe.py --out bench/results
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

if __name__ == "__main__":  # the device machines have neither vLLM nor Ray: importing them fails here too
    sys.modules.update(vllm=None, ray=None)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `python bench/gpu_probe.py` from anywhere
sys.path.insert(0, str(ROOT / "bench"))  # moepp_kernels and its work formulas, beside it

import torch  # noqa: E402

from moepp_kernels_work import FULL, Shape, attention_work, doc_lengths  # noqa: E402
from gpu_probe_report import FLOP_CONVENTION, PartResult, base_runs, goals, render, summarise  # noqa: E402
from gpu_probe_trainer import (FIT_MEMORY_SHARE, first_line, next_fit_layers, part_trainer,  # noqa: E402
                               predicted_fit_layers, profiled)
from roofline import render_roofline  # noqa: E402
from zrl.modeling.precision import fp32_without_tf32  # noqa: E402

# (part, argument, seconds it is planned to take): most important first; a later part gets what an
# earlier one leaves unused. The sum is the default --budget-s less process start-ups. A trainer part's
# argument: its layer count, then the activation checkpointing of each run (one TrainerWorker each).
# Planned from the H200 runs of 2026-11-27/28 (checkpoints written and read at ~1 s per GB): the two 4-layer
# runs took 83 s, a third (the CCA's Triton path in the whole step) adds ~35 s; a fit try at 40-44 layers takes
# 70-90 s, so the fit gets one try in its share and another in what the earlier parts leave (44 layers
# fitted on 2026-11-28). The 64k kernels took 86 s, before their profiles (PROFILED): their share is the larger.
PLAN = (("env", "", 15), ("trainer", "4 full selective full+cca=triton+fused_glue+pipelined_norm", 150),
        ("trainer", "8 full", 50), ("fit", "", 80), ("kernels", "16384", 70), ("kernels", "65536", 85), ("gpu_tests", "", 60))
SMOKE_ARGS = {"16384": "64", "65536": "128"}  # --smoke: kernel token counts on the tiny shape
SMOKE_SHAPE = Shape(D=32, E=4, F=16, Hq=4, Hk=2, d=8, R=16, V=64, rotary=4)
# The kernel part's ops, most important first; above OPS_ALL_UP_TO tokens the experts come first (their
# goal is measured there too) and the whole layer is left out (its 16k rows answer its question).
OPS = ("lm_logprobs", "experts", "cca", "layer", "attention", "router", "residual_norm")
OPS_ALL_UP_TO = 16384
OPS_LARGE = ("experts", "lm_logprobs", "attention", "cca", "router", "residual_norm")
# fwd+bwd of these (op group, implementation) pairs also runs once under torch.profiler at PROFILED_TOKENS
# (the trainer's microbatch size), their top PROFILE_TOP device kernels a table each: where the experts' glue
# and the CCA's Triton kernels spend their time, beside the library paths they are weighed against.
PROFILED = (("experts", "grouped_mm"), ("experts", "grouped_mm fused glue"), ("experts", "transformers grouped_mm"),
            ("cca", "reference"), ("cca", "triton"), ("cca", "library"), ("lm_logprobs", "fused"))
PROFILED_TOKENS, PROFILE_TOP = "65536", 12
FIRST_CALL_LIMIT_S = 20.0  # a first call (compilation included) slower than this is not repeated
SLOW_FORWARD_S = 5.0  # an implementation whose forward is slower than this is not run forward + backward
TIMED_CALLS, CALL_BUDGET_S = 5, 0.5  # per implementation and mode, after the first call
MICROBATCHES = 2  # --microbatches: per optimizer step of the trainer parts (the recipe runs ~20: RECIPE_MICROBATCHES)
FIT_MOST_LAYERS, SMOKE_FIT_MOST_LAYERS = 96, 9  # the fit search's cap (--smoke: one try, at 9)


# ---------------------------------------------------------------- running parts in child processes



def run_part(name: str, arg: str, command: list[str], rows_path: Path, timeout_s: float) -> PartResult:
    """Run `command`, which appends JSON rows to `rows_path`, for at most `timeout_s` seconds. At the limit
    it is interrupted (SIGINT: pytest then still writes its report), killed 15 s later; rows kept."""
    log_path = rows_path.with_suffix(".log")
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                    [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])})
        try:
            rc = proc.wait(timeout=max(timeout_s, 1.0))
            status = "ok" if rc == 0 else f"failed (exit status {rc})"
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            status = f"timed out after {timeout_s:.0f} s"
    rows = []
    if rows_path.exists():
        for line in rows_path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # the line being written when the part was killed
                pass
    tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-25:]) if status != "ok" else ""
    return PartResult(name, arg, status, time.monotonic() - start, rows, tail)


def run_child(name: str, arg: str, tmp: Path, timeout_s: float, args: argparse.Namespace) -> PartResult:
    """Part `name` with `arg` in a child process of this script (run_part); it stops its steps 10 s early."""
    rows = tmp / f"{name}-{arg.replace(' ', '-')}.jsonl"
    command = [sys.executable, str(Path(__file__).resolve()), "--part", name, "--part-arg", arg, "--rows", str(rows),
               "--steps", str(args.steps), "--microbatches", str(args.microbatches), "--doc-len", str(args.doc_len),
               "--deadline", str(time.time() + timeout_s - 10)] + (["--smoke"] if args.smoke else [])
    return run_part(name, arg, command, rows, timeout_s)


class Rows:
    """A child part's output: one JSON object per line, flushed at once (a killed part keeps its rows)."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "a")

    def __call__(self, kind: str, **row) -> None:
        self.file.write(json.dumps({"kind": kind, **row}, default=float) + "\n")
        self.file.flush()


def error_row(emit: Rows, where: str, exc: BaseException) -> None:
    emit("error", where=where, error=first_line(exc))


# ---------------------------------------------------------------- part: environment

def part_env(args: argparse.Namespace, emit: Rows) -> None:
    cuda = torch.cuda.is_available()
    versions = {}
    for dist in ("triton", "transformers", "tokenizers", "pydantic", "numpy", "safetensors", "pytest"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    try:
        from zrl.modeling import kernels
        auto = dict(getattr(kernels, "AUTO_ON_CUDA", {}))  # what "auto" runs per op on CUDA, where recorded
    except Exception as exc:  # noqa: BLE001 - the probe reports what it cannot import
        auto = {"error": f"{type(exc).__name__}: {exc}"}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        device = dict(name=props.name, capability=f"{props.major}.{props.minor}",
                      memory_gib=props.total_memory / 2**30, sms=props.multi_processor_count)
    else:
        threads = torch.get_num_threads()
        device = dict(name=f"{platform.machine()} CPU, {threads} thread{'s' if threads > 1 else ''}", capability=None,
                      memory_gib=None, sms=None)
    emit("env", device=device, torch=torch.__version__, cuda=torch.version.cuda, python=platform.python_version(),
         versions=versions, auto_on_cuda=auto)
    # The MFU denominator. --smoke: a small fp32 matmul, so the code path runs; its rate is no claim.
    n, dtype = (8192, torch.bfloat16) if cuda else (256, torch.float32)
    a = torch.randn(n, n, device="cuda" if cuda else "cpu", dtype=dtype)
    b = torch.randn_like(a)
    seconds = median_seconds(lambda: torch.mm(a, b), cuda, iters=50, budget_s=2.0)[0]  # clocks settle
    emit("gemm", n=n, dtype=str(dtype), tflops=2.0 * n**3 / seconds / 1e12)


# ---------------------------------------------------------------- part: kernel table

def median_seconds(call: Callable[[], object], cuda: bool, iters: int = TIMED_CALLS,
                   budget_s: float = CALL_BUDGET_S) -> tuple[float, int]:
    """(median seconds, timed calls) of `call` after one first call (compilation, autotuning, the
    allocator's growth; errors surface there). A first call over FIRST_CALL_LIMIT_S is returned as it is
    with 0 timed calls: compilation included, an upper bound."""
    import moepp_kernels as mk

    first = mk.elapsed_seconds(call, cuda)
    if first > FIRST_CALL_LIMIT_S:
        return first, 0
    times, deadline = [], time.perf_counter() + budget_s
    while len(times) < iters and (not times or time.perf_counter() < deadline):
        times.append(mk.elapsed_seconds(call, cuda))
    return statistics.median(times), len(times)


def attention_groups(ctx, tokens: int) -> list:
    """zrl's causal attention (zrl.modeling.attention.causal_attention) on the packed layout, under each
    backend the group times: ragged documents (what the trainer sees) and equal ones (one SDPA batch)."""
    import moepp_kernels_groups as mk
    from zrl.modeling.attention import causal_attention
    from zrl.modeling.packing import build_layout

    s, groups = ctx.shape, []
    q, k, v = ctx.leaf(tokens, s.Hq, s.d), ctx.leaf(tokens, s.Hk, s.d), ctx.leaf(tokens, s.Hk, s.d)
    for ragged in (True, False):
        lens = doc_lengths(tokens, ctx.doc_len, ragged=ragged)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=ctx.device)
        layout = build_layout(tokens, device=ctx.device, cu_seqlens=cu)
        impls = [mk.Impl(b, mk.scoped(b, lambda layout=layout: causal_attention(q, k, v, layout)), [q, k, v])
                 for b in ("reference", "triton") if b in ctx.impls]
        name = "attention" if ragged else "attention equal"
        groups.append(mk.Group(name, attention_work(s, lens, ctx.act), impls,
                               f"{len(lens)} {'ragged' if ragged else 'equal'} docs"))
    return groups


def part_kernels(args: argparse.Namespace, emit: Rows) -> None:
    import moepp_kernels as mk

    fp32_without_tf32()  # fp32 math as the trainer runs it (TrainerWorker sets the same): no TF32 in cuDNN
    cuda = torch.cuda.is_available()
    tokens = int(SMOKE_ARGS.get(args.part_arg, args.part_arg) if args.smoke else args.part_arg)
    try:
        import transformers.models.zaya.modeling_zaya as hf
    except ImportError as exc:
        hf = None
        error_row(emit, "transformers rows", exc)
    impls = [i for i in mk.IMPLS if i != "triton" or cuda]
    timing = (1, 0.0) if args.smoke else (TIMED_CALLS, CALL_BUDGET_S)  # (calls, seconds) per row after the first
    ctx = mk.Ctx(shape=FULL if cuda else SMOKE_SHAPE, device=torch.device("cuda" if cuda else "cpu"),
                 dtype=torch.bfloat16 if cuda else torch.float32, impls=impls, skip_share=0.1,
                 doc_len=args.doc_len if cuda else 16, hf=hf, gen=torch.Generator().manual_seed(0))
    rate = mk.dense_rate(ctx, tokens, argparse.Namespace(iters=10, warmup=2))
    emit("dense_gemm", tokens=tokens, tflops=rate / 1e12, shape=str(ctx.shape), doc_len=ctx.doc_len)
    for op in OPS if tokens <= OPS_ALL_UP_TO or args.smoke else OPS_LARGE:
        time_op(op, ctx, tokens, rate, timing, emit, profile=args.part_arg == PROFILED_TOKENS)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def time_op(op: str, ctx, tokens: int, rate: float, timing: tuple[int, float], emit: Rows,
            profile: bool = False) -> None:
    """Rows of every group of `op` (its inputs live only while this runs); with `profile`, a profile of each
    PROFILED implementation's fwd+bwd."""
    import moepp_kernels as mk

    cuda = ctx.device.type == "cuda"
    try:
        groups = {**mk.BUILDERS, "attention": attention_groups}[op](ctx, tokens)
    except Exception as exc:  # noqa: BLE001 - one broken op must not end the table
        error_row(emit, f"{op} inputs", exc)
        return
    for group in groups:
        slow = set()  # implementations whose forward alone passed SLOW_FORWARD_S: their fwd+bwd is not run
        for mode in ("fwd", "fwd+bwd"):
            for impl in group.impls:
                if impl.name in slow:
                    emit("error", where=f"{group.name} {impl.name} {mode}", error="not run: its fwd alone took "
                         f"over {SLOW_FORWARD_S:.0f} s")
                    continue
                try:
                    seconds, calls = median_seconds(mk.make_step(impl, mode), cuda, *timing)
                except Exception as exc:  # noqa: BLE001
                    error_row(emit, f"{group.name} {impl.name} {mode}", exc)
                    continue
                if calls == 0 or seconds > SLOW_FORWARD_S:
                    slow.add(impl.name)
                flops, nbytes = group.work.flops(mode), group.work.bytes(mode)
                emit("kernel", tokens=tokens, group=group.name, impl=impl.name, mode=mode, ms=seconds * 1e3,
                     calls=calls, tflops=flops / seconds / 1e12, gbs=nbytes / seconds / 1e9,
                     share_gemm=flops / seconds / rate, fp32=group.fp32, note=group.note)
                if profile and mode == "fwd+bwd" and (group.name, impl.name) in PROFILED:
                    try:
                        _, prof = profiled(mk.make_step(impl, mode), cuda, PROFILE_TOP)
                    except Exception as exc:  # noqa: BLE001 - a profile is extra; its table is simply missing
                        error_row(emit, f"{group.name} {impl.name} {mode} profile", exc)
                        continue
                    emit("kernel_profile", tokens=tokens, group=group.name, impl=impl.name, mode=mode,
                         ms=seconds * 1e3, **prof)


# ---------------------------------------------------------------- part: gpu tests

def gpu_tests_command(xml: Path, smoke: bool) -> list[str]:
    # In 8 processes where pytest-xdist is installed: one process compiled 29 of the ~170 tests' kernels in
    # 74 s (H200, 2026-11-27); the GPU has room for eight. Not with --smoke: on CPU every test skips, and
    # eight start-ups took 25 s of 2 cores where one process takes 5 s.
    workers = ["-n", "8"] if importlib.util.find_spec("xdist") and not smoke else []
    return [sys.executable, "-m", "pytest", "-m", "gpu", "zrl/modeling/kernels", "zrl/moepp/kernels", "-q",
            "-p", "no:cacheprovider", *workers, f"--junitxml={xml}"]


def parse_junit(xml: Path) -> dict:
    """Counts and failures of a pytest JUnit XML report: per failure the test id, the first line of its
    message and pytest's `E` lines of the traceback (the values a tolerance was missed by; up to 1,500
    characters)."""
    if not xml.exists():
        return {"error": "no report (pytest did not get to write one)"}
    counts = dict(tests=0, failures=0, errors=0, skipped=0)
    failures = []
    for suite in ET.parse(xml).getroot().iter("testsuite"):
        for key in counts:
            counts[key] += int(suite.get(key, 0))
        for case in suite.iter("testcase"):
            for bad in [*case.findall("failure"), *case.findall("error")]:
                message = (bad.get("message") or bad.text or "").strip().splitlines()
                detail = "\n".join(line[1:].strip() for line in (bad.text or "").splitlines() if line.startswith("E "))
                failures.append(dict(test=f"{case.get('classname')}::{case.get('name')}",
                                     first_line=(message[0] if message else "")[:300], detail=detail[:1500]))
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "failed": failures}


# ---------------------------------------------------------------- part: the fit search

def run_fit_search(parts: list[PartResult], args: argparse.Namespace, tmp: Path, timeout_s: float) -> list[PartResult]:
    """The fit part: a try (a child process of part "fit") at each layer count next_fit_layers names, until the
    search is settled or a try would outlast the part's time; the tries' results and the search's own row."""
    start = time.monotonic()
    s = summarise(parts)
    peaks = {r["layers"]: r["peak_gib"] for r in base_runs(s["trainer"])}
    memory_gib = s["env"].get("device", {}).get("memory_gib")
    guess = args.fit_from or predicted_fit_layers(peaks, memory_gib)
    most = SMOKE_FIT_MOST_LAYERS if args.smoke else FIT_MOST_LAYERS
    tried, results, stopped = [], [], "settled"
    while (layers := next_fit_layers(tried, max(peaks, default=0), guess, most)) is not None:
        left = start + timeout_s - time.monotonic()
        if results and left < results[-1].seconds:
            stopped = f"stopped: no time left for a try at {layers}"
            break
        result = run_child("fit", str(layers), tmp, left, args)
        results.append(result)
        kinds = {row["kind"] for row in result.rows}
        if not kinds & {"oom", "trainer_step"}:
            stopped = f"stopped: the try at {layers} ran no step ({result.status})"
            break
        tried.append((layers, "oom" not in kinds))
    fits, ooms = [n for n, ok in tried if ok], [n for n, ok in tried if not ok]
    row = dict(kind="fit_search", predicted=guess, given=args.fit_from is not None, memory_gib=memory_gib, memory_share=FIT_MEMORY_SHARE, most=most,
               tried=tried, largest_fit=max(fits + list(peaks), default=None), smallest_oom=min(ooms, default=None),
               stopped=stopped)
    return results + [PartResult("fit", "search", "ok", time.monotonic() - start, [row])]


# ---------------------------------------------------------------- main

PARTS = {"env": part_env, "kernels": part_kernels, "trainer": part_trainer, "fit": part_trainer}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="folder of the results files")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (CI); no rate is a claim")
    ap.add_argument("--roofline", action="store_true", help="write the roofline estimate of a 4-layer 64k step")
    ap.add_argument("--budget-s", type=float, default=550.0, help="wall-clock budget of the whole probe")
    ap.add_argument("--parts", nargs="+", choices=sorted({*PARTS, "gpu_tests"}), help="run only these parts")
    ap.add_argument("--steps", type=int, help="timed trainer steps after the warm-up (default 2, 1 with --smoke)")
    ap.add_argument("--microbatches", type=int, default=MICROBATCHES,
                    help=f"microbatches per optimizer step of the trainer parts (default {MICROBATCHES})")
    ap.add_argument("--doc-len", type=int, default=1024, help="mean document length of the kernel table")
    ap.add_argument("--fit-from", type=int, help="the fit search's first try (default: where the trainer parts' "
                    "peaks predict the memory is full)")
    ap.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)  # a child process: one part
    ap.add_argument("--part-arg", default="", help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=math.inf, help=argparse.SUPPRESS)  # time.time() to stop by
    args = ap.parse_args(argv)
    if args.steps is None:
        args.steps = 1 if args.smoke else 2
    return args


def child(args: argparse.Namespace) -> None:
    emit = Rows(args.rows)
    if args.smoke:
        torch.set_num_threads(1)  # tiny shapes: one thread is faster, and CI shares its cores
    try:
        PARTS[args.part](args, emit)
    except BaseException as exc:  # noqa: BLE001 - recorded, then the part's exit status says it failed
        error_row(emit, args.part, exc)
        traceback.print_exc()
        sys.exit(1)


def commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                               text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if head.returncode:
        return "unknown (no git checkout)"
    return head.stdout.strip() + (" + uncommitted changes" if dirty.stdout.strip() else "")


def results_path(out: Path, device: str, smoke: bool) -> Path:
    """out/<device>-<date>.md (smoke- in front for --smoke), -2, -3... when a run of that day exists."""
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-") or "device"
    stem = f"{'smoke-' if smoke else ''}{slug}-{datetime.date.today()}"
    path, n = out / f"{stem}.md", 2
    while path.exists():
        path, n = out / f"{stem}-{n}.md", n + 1
    return path


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    if args.part:
        child(args)
        return args.rows
    args.out.mkdir(parents=True, exist_ok=True)
    if args.roofline:
        path = args.out / "roofline-zaya1-4layer-64k.md"
        path.write_text(render_roofline())
        print(path.read_text())
        return path
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("gpu_probe: no CUDA device here; use --smoke for the CPU check of the probe itself")
    start, deadline = time.monotonic(), time.monotonic() + args.budget_s
    plan = [p for p in PLAN if args.parts is None or p[0] in args.parts]
    parts: list[PartResult] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, arg, _) in enumerate(plan):
            later = sum(share for _, _, share in plan[i + 1:])
            timeout = deadline - time.monotonic() - later
            if timeout < 5:
                parts.append(PartResult(name, arg, "skipped: no time left", 0.0, []))
                continue
            if name == "gpu_tests":
                xml = Path(tmp) / "gpu_tests.xml"
                results = [run_part(name, arg, gpu_tests_command(xml, args.smoke), Path(tmp) / "gpu_tests.jsonl",
                                    timeout)]
                results[0].rows.append({"kind": "gpu_tests", **parse_junit(xml)})
            elif name == "fit":
                results = run_fit_search(parts, args, Path(tmp), timeout)
            else:
                results = [run_child(name, arg, Path(tmp), timeout, args)]
            parts += results
            for result in results:
                print(f"# {result.name} {result.arg}: {result.status} in {result.seconds:.0f} s", flush=True)
    summary = summarise(parts)
    device = summary["env"].get("device", {}).get("name", "unknown device")
    kernel_tokens = tuple(int(SMOKE_ARGS[t] if args.smoke else t) for t in ("16384", "65536"))
    meta = dict(date=str(datetime.date.today()), smoke=args.smoke, commit=commit(), wall_s=time.monotonic() - start,
                budget_s=args.budget_s, kernel_tokens=kernel_tokens,
                command=" ".join(["python3", "bench/gpu_probe.py", *(argv if argv is not None else sys.argv[1:])]))
    path = results_path(args.out, device, args.smoke)
    path.write_text(render(summary, parts, meta))
    twin = dict(meta=meta, flop_convention=FLOP_CONVENTION, summary=summary, goals=goals(summary, kernel_tokens),
                parts=[dataclasses.asdict(p) | {"rows": None} for p in parts])
    path.with_suffix(".json").write_text(json.dumps(twin, indent=1, default=str) + "\n")
    for goal, measured, target, verdict in twin["goals"]:
        print(f"{goal}: {measured} (target {target}) {verdict}")
    print(f"wrote {path} and {path.with_suffix('.json').name}")
    return path


if __name__ == "__main__":
    main()
