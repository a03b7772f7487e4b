"""Per-kernel and whole-layer time of the MoE++ kernels: Triton vs PyTorch reference vs transformers.

Every kernel of zrl/modeling/kernels/ (experts, residual_norm, lm_logprobs) and zrl/moepp/kernels/ (router, cca) and zrl's
DecoderLayer run on the ZAYA1-8B layer shape (D 2048, E 16 experts + skip, F 2048, 8/2 heads x 128,
router latent R 256, V 262,272) against, in the same run and with the same weights:
  reference     the PyTorch reference of the same op (zrl.modeling.kernels.use_backend("reference"))
  triton        the fused Triton kernel (CUDA only: the CPU interpreter runs each program instance in
                Python, far too slow to time; on CPU it is skipped unless asked for under TRITON_INTERPRET=1)
  transformers  the same piece of transformers' ZayaForCausalLM (ZayaExperts, ZayaRouter,
                ZayaResidualScaling + ZayaRMSNorm, ZayaCCAProjection + ZayaQKNorm + RoPE,
                ZayaDecoderLayer; the LM head as lm_head + log_softmax + gather)
  grouped_mm    for the experts: zrl's torch._grouped_mm path (experts/grouped_mm.py, what auto runs on
                Hopper: sort, grouped GEMM, SwiGLU, grouped GEMM, unsort; on CUDA also "grouped_mm fused
                glue", the same with its glue as glue.py's Triton passes); transformers' own grouped_mm
                experts path too on CUDA
  library       for the LM head: its library formulation (lm_logprobs/library.py: the reference's chunks
                with every product a sum of bf16 cuBLAS GEMMs on exact parts of the fp32 operands); for
                the CCA: the reference with its convolutions as shifted sums and one batched GEMM
                (cca/library.py, no padded stream)
  fused         for the LM head: the head fused with the RL loss (lm_logprobs/fused.py, what the trainer's
                loss runs): dh and dW formed in the forward, its "fwd" row is the whole head; beside it the
                split products with dh and dW at order 1 (the default before 2026-11-28), for what the orders cost
Rows are grouped: "vs ref" and "vs HF" are speed-ups (baseline time / row time, > 1 = faster) against
the group's reference and transformers rows. TFLOP/s and GB/s use the formulas of moepp_kernels_work.py
(useful work: routed tokens only, causal attention half, no recomputation), and "%pk" is the share of
the device's peak (moepp_kernels_work.device_peaks; n/a on CPU or an unlisted card). A dense
[T, D] x [D, 2F] GEMM is timed in the same run: the expert path's share of that rate is the number the
">= 70% at >= 16k tokens" goal is about.

Timing: warm-up, then the implementations of a group interleaved round-robin, median of --iters;
CUDA events on GPU, perf_counter on CPU. "fwd" runs the forward with autograd recording (as in
training), "fwd+bwd" adds the backward to all differentiable inputs.

Usage:
  .venv/bin/python bench/moepp_kernels.py                          # CUDA: 8k-64k tokens, all kernels
  .venv/bin/python bench/moepp_kernels.py --small --threads 2      # CPU: reduced shape, 512-2048 tokens
  .venv/bin/python bench/moepp_kernels.py --kernels experts layer --tokens 16384 --iters 20
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/...` from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent))  # its work formulas, beside it

from zrl.modeling.kernels import interpreting, triton_available  # noqa: E402
from zrl.modeling.precision import fp32_without_tf32  # noqa: E402
from moepp_kernels_groups import BUILDERS, Ctx, Group, Impl  # noqa: E402
from moepp_kernels_work import FULL, SMALL, dense_gemm_flops, device_peaks  # noqa: E402

KERNELS = ("experts", "router", "residual_norm", "cca", "lm_logprobs", "layer")
IMPLS = ("reference", "triton", "transformers", "grouped_mm", "library", "fused")
GOAL_TOKENS, GOAL_FRACTION = 16384, 0.70


def parse_args(argv: Sequence[str] | None, cuda: bool) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", help="token counts T (default: 8192..65536 on CUDA, "
                        "512 1024 2048 with --small)")
    parser.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
    parser.add_argument("--impls", nargs="+", choices=IMPLS, help="implementations to time (default: all "
                        "that can run here; triton only on CUDA)")
    parser.add_argument("--iters", type=int, default=None, help="timed iterations (default 20 CUDA, 5 CPU)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--small", action="store_true", help=f"reduced shape for CPU: {SMALL}")
    parser.add_argument("--doc-len", type=int, default=None, help="document length (default 4096, 256 small)")
    parser.add_argument("--skip-share", type=float, default=0.1, help="share of tokens routed to the skip class")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads; on a "
                        "busy 2-core machine 2 threads stalled 10-100x: keep 1 there)")
    args = parser.parse_args(argv)
    if args.tokens is None:
        args.tokens = [512, 1024, 2048] if args.small or not cuda else [8192, 16384, 32768, 65536]
    if args.iters is None:
        args.iters = 20 if cuda else 5
    if args.doc_len is None:
        args.doc_len = 256 if args.small else 4096
    if args.impls is None:
        args.impls = [i for i in IMPLS if i != "triton" or cuda]
    if not 0.0 <= args.skip_share < 1.0:
        parser.error(f"--skip-share must be in [0, 1), got {args.skip_share}")
    if min(args.tokens) < 1 or args.iters < 1 or args.doc_len < 4:
        parser.error("--tokens, --iters must be positive and --doc-len >= 4")
    return args


# ---------------------------------------------------------------- timing

def make_step(impl: Impl, mode: str) -> Callable[[], None]:
    cotangents: dict[int, torch.Tensor] = {}  # fixed upstream gradients, made in the warm-up call

    def step() -> None:
        with torch.enable_grad():
            out = impl.run()
            outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
                    if isinstance(o, torch.Tensor) and o.requires_grad]
            if mode == "fwd":
                return
            grads = [cotangents.setdefault(i, torch.randn_like(o) * 1e-2) for i, o in enumerate(outs)]
            torch.autograd.grad(outs, impl.leaves, grads, allow_unused=True)

    return step


def elapsed_seconds(call: Callable[[], object], cuda: bool) -> float:
    """Seconds one call takes: between CUDA events on the current stream, or on the host clock."""
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    begin = time.perf_counter()
    call()
    return time.perf_counter() - begin


def time_group(steps: Sequence[Callable[[], None]], iters: int, warmup: int, cuda: bool,
               budget_s: float = 20.0) -> list[float]:
    """Median seconds of each step, the steps run round-robin (they share the machine's noise).
    Slow groups get fewer iterations (at least 3) so that one group takes about `budget_s`."""
    last = [0.0] * len(steps)
    for i, step in enumerate(steps):
        for _ in range(warmup):
            last[i] = elapsed_seconds(step, cuda)
    rounds = max(min(iters, 3), min(iters, int(budget_s / max(sum(last), 1e-9))))
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(rounds):
        for i, step in enumerate(steps):
            times[i].append(elapsed_seconds(step, cuda))
    return [statistics.median(t) for t in times]


# ---------------------------------------------------------------- report

def _fmt(value: float, spec: str) -> str:
    return "-" if value is None or not math.isfinite(value) else format(value, spec)


def run_group(group: Group, mode: str, ctx: Ctx, args: argparse.Namespace) -> dict[str, float]:
    """Seconds per implementation; an implementation that fails is reported and dropped."""
    steps, names = [], []
    for impl in group.impls:
        step = make_step(impl, mode)
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - one broken implementation must not end the run
            print(f"# {group.name} {impl.name} {mode}: failed, dropped: {type(exc).__name__}: {exc}")
            continue
        steps.append(step)
        names.append(impl.name)
    return dict(zip(names, time_group(steps, args.iters, args.warmup, ctx.device.type == "cuda")))


def print_rows(tokens: int, group: Group, mode: str, seconds: dict[str, float],
               peaks: tuple[float, float, float] | None, dense_rate: float) -> None:
    ref, hf = seconds.get("reference+proj", seconds.get("reference")), seconds.get("transformers")
    flops, nbytes = group.work.flops(mode), group.work.bytes(mode)
    for name, sec in seconds.items():
        tflops, gbs = flops / sec / 1e12, nbytes / sec / 1e9
        pk = ("n/a", "n/a") if peaks is None else (_fmt(100 * flops / sec / peaks[1 if group.fp32 else 0], ".1f"),
                                                   _fmt(100 * nbytes / sec / peaks[2], ".1f"))
        print(f"{tokens:>6} {group.name:<13} {name:<23} {mode:<7} {sec * 1e3:>10.3f} "
              f"{_fmt(ref / sec if ref else math.nan, '.2f'):>6} {_fmt(hf / sec if hf else math.nan, '.2f'):>6} "
              f"{_fmt(tflops, '.3f'):>8} {pk[0]:>5} {_fmt(gbs, '.1f'):>8} {pk[1]:>5}")
    if group.note and mode == "fwd":
        print(f"{'':>6} {group.name:<13} ({group.note})")
    if group.name == "experts":
        shares = {name: flops / sec / dense_rate for name, sec in seconds.items()}
        line = ", ".join(f"{name} {share:.1%}" for name, share in shares.items())
        print(f"{'':>6} experts {mode} share of the dense GEMM rate: {line}")
        if "triton" in shares and tokens >= GOAL_TOKENS:
            met = "met" if shares["triton"] >= GOAL_FRACTION else "NOT met"
            print(f"{'':>6} goal: triton >= {GOAL_FRACTION:.0%} of dense GEMM at >= {GOAL_TOKENS} tokens: {met}")


def dense_rate(ctx: Ctx, tokens: int, args: argparse.Namespace) -> float:
    """Measured FLOP/s of torch.mm [T, D] x [D, 2F] in the compute dtype."""
    a = torch.randn(tokens, ctx.shape.D, generator=ctx.gen).to(ctx.device, ctx.dtype)
    b = torch.randn(ctx.shape.D, 2 * ctx.shape.F, generator=ctx.gen).to(ctx.device, ctx.dtype)
    (sec,) = time_group([lambda: torch.mm(a, b)], args.iters, args.warmup, ctx.device.type == "cuda")
    return dense_gemm_flops(tokens, ctx.shape) / sec


def main(argv: Sequence[str] | None = None) -> None:
    cuda = torch.cuda.is_available()
    args = parse_args(argv, cuda)
    if "triton" in args.impls and not cuda and not interpreting():
        sys.exit("--impls triton on CPU needs Triton's interpreter: set TRITON_INTERPRET=1 before starting "
                 "(it is far too slow to time at these shapes; CPU runs time reference and transformers)")
    if "triton" in args.impls and not triton_available():
        sys.exit("--impls triton: Triton is not installed")
    torch.set_num_threads(args.threads)
    fp32_without_tf32()  # fp32 math as the trainer runs it (TrainerWorker sets the same): no TF32 in cuDNN
    device = torch.device("cuda" if cuda else "cpu")
    try:
        import transformers
        import transformers.models.zaya.modeling_zaya as hf
        hf_line = f"transformers {transformers.__version__}"
    except ImportError:
        hf, hf_line = None, "transformers: not installed"
    shape = SMALL if args.small else FULL
    ctx = Ctx(shape=shape, device=device, dtype=torch.bfloat16 if cuda else torch.float32, impls=args.impls,
              skip_share=args.skip_share, doc_len=args.doc_len, hf=hf, gen=torch.Generator().manual_seed(0))
    name = torch.cuda.get_device_name() if cuda else f"{platform.machine()} CPU, {torch.get_num_threads()} threads"
    peaks = device_peaks(name) if cuda else None
    triton_line = f"triton {importlib.metadata.version('triton')}" if triton_available() else "triton: not installed"
    print(f"# {datetime.date.today()} {name}; torch {torch.__version__}, {triton_line}, {hf_line}; {ctx.dtype}")
    print(f"# shape {shape}; skip share {args.skip_share}; doc length {args.doc_len}; median of {args.iters} "
          f"(at least 3, fewer when a group passes 20 s) after {args.warmup} warm-up, implementations interleaved")
    print("# peaks: " + (f"{peaks[0] / 1e12:.0f} TFLOP/s dense bf16, {peaks[1] / 1e12:.0f} TFLOP/s fp32 (the "
                          f"%pk of cca and lm_logprobs), {peaks[2] / 1e12:.2f} TB/s" if peaks
                          else "n/a (CPU or unknown device)"))
    if not cuda:
        print(f"# triton: not timed on CPU (the interpreter runs every program instance in Python); "
              f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'T':>6} {'kernel':<13} {'impl':<23} {'mode':<7} {'ms':>10} {'vs ref':>6} {'vs HF':>6} "
          f"{'TFLOP/s':>8} {'%pk':>5} {'GB/s':>8} {'%bw':>5}")
    for tokens in args.tokens:
        rate = dense_rate(ctx, tokens, args)
        print(f"{tokens:>6} dense GEMM [T, D] x [D, 2F] {rate / 1e12:.3f} TFLOP/s"
              + (f" ({100 * rate / peaks[0]:.1f}% of peak)" if peaks else ""))
        for kernel in args.kernels:
            for group in BUILDERS[kernel](ctx, tokens):
                for mode in ("fwd", "fwd+bwd"):
                    print_rows(tokens, group, mode, run_group(group, mode, ctx, args), peaks, rate)
            if cuda:
                torch.cuda.empty_cache()
        sys.stdout.flush()


if __name__ == "__main__":
    main()
