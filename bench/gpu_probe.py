"""One command that measures the trainer on one GPU: environment, `gpu` tests, kernel table, trainer steps.

On one H100/H200 in about 6 minutes it writes bench/results/<gpu>-<date>.md and a JSON twin:
  env        device; torch, CUDA, Triton, transformers versions; the dense bf16 GEMM rate (8192^3) measured
             now, the denominator of every MFU figure (a measured rate, not the data sheet's)
  trainer    full RL steps through TrainerWorker, in-process (one FSDP2 rank on NCCL, world size 1; no
             Ray) at the ZAYA1-8B layer shape cut to 4 and 8 layers, ~64k tokens per step in one
             microbatch, activation checkpointing, bf16 parameters, kernels "auto": tokens/s, MFU,
             optimizer share, peak memory, a torch.profiler top-20 table (self CUDA time) of one step
  kernels    at 16k and 64k tokens, each op (lm_logprobs, experts, cca, attention, router,
             residual_norm, decoder layer) as the Triton kernel vs the PyTorch reference vs transformers'
             piece vs the library op (experts: torch._grouped_mm), fwd and fwd+bwd: ms, TFLOP/s and the
             share of a dense [T, D] x [D, 2F] GEMM timed in the same part (bench/moepp_kernels.py's
             groups; FLOPs from bench/moepp_kernels_work.py)
  gpu_tests  `pytest -m gpu zrl/modeling/kernels zrl/moepp/kernels`: counts and each failure's first line
The report (summary, goals, Markdown) is gpu_probe_report.py. Each part runs in its own Python process
under a time limit: a CUDA error or a hang ends that part
only, what it measured before is kept, and time a part leaves unused goes to the later ones. In the
kernel table a first call over FIRST_CALL_LIMIT_S is reported alone (compilation included: an upper
bound, marked "~"), and an implementation whose forward takes over SLOW_FORWARD_S gets no fwd+bwd row.

MFU = model FLOPs per step / step time / the measured GEMM rate, with the model FLOPs per step
(moepp_kernels_work.model_step_flops) 3 x forward =
  3 x [ sum over layers l of ( 2 T D (2 Hq d + 2 Hk d)     q, k, v, o projections
                              + 2 Hq d sum_i S_i^2          causal attention over documents S_i
                              + 2 T D R + router head       router
                              + 6 n_l D F                   experts, n_l tokens routed in layer l
                              + CCA )                       convolutions, norms, RoPE
        + 2 T V D ]                                          LM head, one GEMM
Recomputation (activation checkpointing, an LM head split into several bf16 products) is not counted.

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
import socket
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

from moepp_kernels_work import FULL, Shape, attention_work, doc_lengths, model_step_flops  # noqa: E402
from gpu_probe_report import PartResult, goals, render, summarise  # noqa: E402
from roofline import render_roofline  # noqa: E402

# (part, argument, seconds it is planned to take): most important first; a later part gets what an
# earlier one leaves unused. The sum is the default --budget-s less process start-ups.
PLAN = (("env", "", 20), ("trainer", "4", 70), ("kernels", "16384", 70), ("kernels", "65536", 45),
        ("trainer", "8", 45), ("gpu_tests", "", 90))
SMOKE_ARGS = {"16384": "64", "65536": "128"}  # --smoke: kernel token counts on the tiny shape
SMOKE_SHAPE = Shape(D=32, E=4, F=16, Hq=4, Hk=2, d=8, R=16, V=64, rotary=4)
# The kernel part's ops, most important first; above OPS_ALL_UP_TO tokens the experts come first (their
# goal is measured there too) and the whole layer is left out (its 16k rows answer its question).
OPS = ("lm_logprobs", "experts", "cca", "layer", "attention", "router", "residual_norm")
OPS_ALL_UP_TO = 16384
OPS_LARGE = ("experts", "lm_logprobs", "attention", "cca", "router", "residual_norm")
FIRST_CALL_LIMIT_S = 20.0  # a first call (compilation included) slower than this is not repeated
SLOW_FORWARD_S = 5.0  # an implementation whose forward is slower than this is not run forward + backward
TIMED_CALLS, CALL_BUDGET_S = 5, 0.5  # per implementation and mode, after the first call


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


class Rows:
    """A child part's output: one JSON object per line, flushed at once (a killed part keeps its rows)."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "a")

    def __call__(self, kind: str, **row) -> None:
        self.file.write(json.dumps({"kind": kind, **row}, default=float) + "\n")
        self.file.flush()


def error_row(emit: Rows, where: str, exc: BaseException) -> None:
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    emit("error", where=where, error=f"{type(exc).__name__}: {first}")


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
    import moepp_kernels as mk
    from zrl.modeling.attention import causal_attention
    from zrl.modeling.packing import build_layout

    s, groups = ctx.shape, []
    q, k, v = ctx.leaf(tokens, s.Hq, s.d), ctx.leaf(tokens, s.Hk, s.d), ctx.leaf(tokens, s.Hk, s.d)
    for ragged in (True, False):
        lens = doc_lengths(tokens, ctx.doc_len, ragged=ragged)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=ctx.device)
        layout = build_layout(tokens, device=ctx.device, cu_seqlens=cu)
        impls = [mk.Impl(b, mk._scoped(b, lambda layout=layout: causal_attention(q, k, v, layout)), [q, k, v])
                 for b in ("reference", "triton") if b in ctx.impls]
        name = "attention" if ragged else "attention equal"
        groups.append(mk.Group(name, attention_work(s, lens, ctx.act), impls,
                               f"{len(lens)} {'ragged' if ragged else 'equal'} docs"))
    return groups


def part_kernels(args: argparse.Namespace, emit: Rows) -> None:
    import moepp_kernels as mk

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
        time_op(op, ctx, tokens, rate, timing, emit)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def time_op(op: str, ctx, tokens: int, rate: float, timing: tuple[int, float], emit: Rows) -> None:
    """Rows of every group of `op` (its inputs live only while this runs)."""
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


# ---------------------------------------------------------------- part: trainer steps

def trainer_config(layers: int, smoke: bool):
    from zrl.moepp.config import zaya1_8b_config

    config = zaya1_8b_config()
    if smoke:
        config = dataclasses.replace(config, vocab_size=512, hidden_size=64, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=16, moe_intermediate_size=64, num_experts=4,
                                     router_hidden_size=16)
    return dataclasses.replace(config, num_hidden_layers=layers)


# rollouts per step and their prompt / response length ranges: 64 x ~1024 = ~64k tokens (smoke ~0.2k)
BATCH = dict(num_groups=4, group_size=16, prompt_tokens=(128, 384), response_tokens=(512, 1024))
SMOKE_BATCH = dict(num_groups=1, group_size=4, prompt_tokens=(8, 24), response_tokens=(16, 48))
TOKEN_BUDGET = 131072  # one microbatch per step (the production microbatch size)


def batch_work(batch, num_layers: int, num_experts: int) -> tuple[list[int], list[int]]:
    """(document lengths as packed, tokens routed to an expert per layer) of a batch under router replay:
    the recorded ids are the ones used (the last routing row of a rollout is never an input)."""
    from zrl.trainer.packing import input_length

    docs, routed = [], [0] * num_layers
    for r in batch.rollouts():
        n = input_length(len(r.prompt_ids), len(r.token_ids))
        docs.append(n)
        for layer, count in enumerate((r.routing[:n] < num_experts).sum(axis=0).tolist()):
            routed[layer] += count
    return docs, routed


def part_trainer(args: argparse.Namespace, emit: Rows) -> None:
    from zrl.config.schema import Algorithm, MuonSpec, Optimizer
    from zrl.models import get_family
    from zrl.moepp import MoEPPForCausalLM
    from zrl.moepp.checkpoint import save_hf_checkpoint
    from zrl.trainer import Rendezvous, TrainerSettings, TrainerWorker
    from zrl.trainer.synthetic import synthetic_train_batch

    cuda = torch.cuda.is_available()
    layers = int(args.part_arg)
    config = trainer_config(layers, args.smoke)
    shape = Shape(D=config.hidden_size, E=config.num_experts, F=config.moe_intermediate_size,
                  Hq=config.num_attention_heads, Hk=config.num_key_value_heads, d=config.head_dim,
                  R=config.router_hidden_size, V=config.vocab_size, k0=config.cca_time0, k1=config.cca_time1,
                  rotary=config.rotary_dim)
    dtype = torch.bfloat16 if cuda else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        torch.manual_seed(0)
        with torch.device("cuda" if cuda else "cpu"):  # random weights: initialised on the GPU in seconds
            model = MoEPPForCausalLM(config)
        params = sum(p.numel() for p in model.parameters())
        save_hf_checkpoint(model, tmp, dtype=dtype, max_shard_bytes=2 << 30)
        del model
        if cuda:
            torch.cuda.empty_cache()
        built = time.perf_counter()
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        settings = TrainerSettings(param_dtype="bfloat16" if cuda else "float32", kernels="auto",
                                   activation_checkpointing=True, token_budget=TOKEN_BUDGET, max_response_tokens=1024,
                                   optimizer=Optimizer(muon=MuonSpec(lr=1e-6)), algorithm=Algorithm(router_replay=True))
        worker = TrainerWorker(Rendezvous("127.0.0.1", port, rank=0, world_size=1), tmp, settings)
        emit("trainer_setup", layers=layers, params=params, shape=str(shape), build_s=built - start,
             load_s=time.perf_counter() - built, dtype=str(dtype), kernels=settings.kernels,
             checkpointing=settings.activation_checkpointing)
        spec = SMOKE_BATCH if args.smoke else BATCH
        model_shape = get_family(config.model_type).shape(config)
        try:
            last = None
            for step in range(args.steps + 1):  # step 0 is the warm-up: compilation, allocator growth
                # After the first timed step, stop while one more step and the profiled one still fit.
                if step >= 2 and time.time() + 3 * last > args.deadline:
                    emit("note", text=f"stopped after {step} steps: the part's time is running out")
                    break
                batch = synthetic_train_batch(vocab_size=config.vocab_size, shape=model_shape,
                                              trainer_step=worker.version, seed=step, **spec)
                metrics = worker.train_step(worker.share_of(batch))
                last = metrics["perf/step_s"]
                emit("trainer_step", **step_row(step, batch, metrics, shape, layers))
            if last is not None and time.time() + 2 * last < args.deadline:
                batch = synthetic_train_batch(vocab_size=config.vocab_size, shape=model_shape,
                                              trainer_step=worker.version, seed=1000, **spec)
                profile_step(worker, batch, cuda, emit)
            else:
                emit("note", text="no profiled step: the part's time is running out")
        finally:
            worker.shutdown()


def step_row(step: int, batch, metrics: dict[str, float], shape: Shape, layers: int) -> dict:
    docs, routed = batch_work(batch, layers, shape.E)
    perf = {k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith("perf/")}
    return dict(step=step, warmup=step == 0, tokens=sum(docs), input_tokens=metrics["batch/input_tokens"],
                docs=len(docs), routed=routed,
                model_flops=model_step_flops(shape, layers, docs, routed), loss=metrics.get("loss/policy"), **perf)


def profile_step(worker, batch, cuda: bool, emit: Rows, top: int = 20) -> None:
    """One step under torch.profiler: the `top` ops by self device time (CPU time on CPU)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        metrics = worker.train_step(worker.share_of(batch))
    events = list(prof.key_averages())

    def self_device_us(e) -> float:  # the attribute's name moved between torch releases
        return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)) or 0.0)

    key = self_device_us if cuda else (lambda e: float(e.self_cpu_time_total))
    busy = sum(key(e) for e in events) / 1e6
    rows = [dict(name=e.key[:90], calls=e.count, self_ms=key(e) / 1e3, self_cpu_ms=e.self_cpu_time_total / 1e3)
            for e in sorted(events, key=key, reverse=True)[:top]]
    emit("profile", step_s=metrics["perf/step_s"], timed=("self CUDA" if cuda else "self CPU"), busy_s=busy, top=rows)


# ---------------------------------------------------------------- part: gpu tests

def gpu_tests_command(xml: Path) -> list[str]:
    # In 8 processes where pytest-xdist is installed: one process compiled 29 of the ~170 tests' kernels in
    # 74 s (H200, 2026-11-27); the GPU has room for eight.
    workers = ["-n", "8"] if importlib.util.find_spec("xdist") else []
    return [sys.executable, "-m", "pytest", "-m", "gpu", "zrl/modeling/kernels", "zrl/moepp/kernels", "-q", "-p", "no:cacheprovider",
            *workers, f"--junitxml={xml}"]


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


# ---------------------------------------------------------------- main

PARTS = {"env": part_env, "kernels": part_kernels, "trainer": part_trainer}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="folder of the results files")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (CI); no rate is a claim")
    ap.add_argument("--roofline", action="store_true", help="write the roofline estimate of a 4-layer 64k step")
    ap.add_argument("--budget-s", type=float, default=345.0, help="wall-clock budget of the whole probe")
    ap.add_argument("--parts", nargs="+", choices=sorted({*PARTS, "gpu_tests"}), help="run only these parts")
    ap.add_argument("--steps", type=int, help="timed trainer steps after the warm-up (default 3, 1 with --smoke)")
    ap.add_argument("--doc-len", type=int, default=1024, help="mean document length of the kernel table")
    ap.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)  # a child process: one part
    ap.add_argument("--part-arg", default="", help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=math.inf, help=argparse.SUPPRESS)  # time.time() to stop by
    args = ap.parse_args(argv)
    if args.steps is None:
        args.steps = 1 if args.smoke else 3
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
            rows = Path(tmp) / f"{i}-{name}.jsonl"
            if name == "gpu_tests":
                xml = Path(tmp) / "gpu_tests.xml"
                result = run_part(name, arg, gpu_tests_command(xml), rows, timeout)
                result.rows.append({"kind": "gpu_tests", **parse_junit(xml)})
            else:
                command = [sys.executable, str(Path(__file__).resolve()), "--part", name, "--part-arg", arg, "--rows",
                           str(rows), "--steps", str(args.steps), "--doc-len", str(args.doc_len),
                           "--deadline", str(time.time() + timeout - 10)] + (["--smoke"] if args.smoke else [])
                result = run_part(name, arg, command, rows, timeout)
            parts.append(result)
            print(f"# {name} {arg}: {result.status} in {result.seconds:.0f} s", flush=True)
    summary = summarise(parts)
    device = summary["env"].get("device", {}).get("name", "unknown device")
    kernel_tokens = tuple(int(SMOKE_ARGS[t] if args.smoke else t) for t in ("16384", "65536"))
    meta = dict(date=str(datetime.date.today()), smoke=args.smoke, commit=commit(), wall_s=time.monotonic() - start,
                budget_s=args.budget_s, kernel_tokens=kernel_tokens,
                command=" ".join(["python3", "bench/gpu_probe.py", *(argv if argv is not None else sys.argv[1:])]))
    path = results_path(args.out, device, args.smoke)
    path.write_text(render(summary, parts, meta))
    twin = dict(meta=meta, summary=summary, goals=goals(summary, kernel_tokens),
                parts=[dataclasses.asdict(p) | {"rows": None} for p in parts])
    path.with_suffix(".json").write_text(json.dumps(twin, indent=1, default=str) + "\n")
    for goal, measured, target, verdict in twin["goals"]:
        print(f"{goal}: {measured} (target {target}) {verdict}")
    print(f"wrote {path} and {path.with_suffix('.json').name}")
    return path


if __name__ == "__main__":
    main()
