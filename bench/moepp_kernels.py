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
import dataclasses
import datetime
import functools
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
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/...` from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent))  # its work formulas, beside it

from zrl.modeling.kernels import interpreting, triton_available, use_backend  # noqa: E402
from zrl.modeling.precision import fp32_without_tf32  # noqa: E402
from moepp_kernels_work import (FULL, SMALL, Shape, Work, cca_work, dense_gemm_flops,  # noqa: E402
                                device_peaks, doc_lengths, experts_work, layer_flops, lm_logprobs_work,
                                residual_norm_work, router_work)

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

@dataclasses.dataclass
class Impl:
    """One implementation of a group: `run` returns the outputs to differentiate; `leaves` get grads."""
    name: str
    run: Callable[[], object]
    leaves: list[torch.Tensor]


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


# ---------------------------------------------------------------- inputs and implementations

@dataclasses.dataclass
class Ctx:
    shape: Shape
    device: torch.device
    dtype: torch.dtype  # weights and activations in the compute dtype (bf16 CUDA, fp32 CPU)
    impls: list[str]
    skip_share: float
    doc_len: int
    hf: object | None  # transformers.models.zaya.modeling_zaya, None when not installed
    gen: torch.Generator

    @property
    def act(self) -> int:
        return torch.finfo(self.dtype).bits // 8

    def leaf(self, *size: int, std: float = 1.0, dtype: torch.dtype | None = None, mean: float = 0.0) -> torch.Tensor:
        t = torch.randn(size, generator=self.gen) * std + mean
        return t.to(self.device, dtype or self.dtype).requires_grad_()

    def hf_config(self):
        cfg = {k: v for k, v in self.shape.config().to_hf_dict().items() if k not in ("architectures", "model_type")}
        config = self.hf.ZayaConfig(**cfg)
        config._attn_implementation = "sdpa"  # the default None falls back to eager [T, T] attention
        config._experts_implementation = "eager"
        return config


@dataclasses.dataclass
class Group:
    """Implementations of one computation, timed together; ratios are taken inside a group."""
    name: str
    work: Work
    impls: list[Impl]
    note: str = ""
    fp32: bool = False  # fp32 math (FP32 op set): "%pk" against the fp32 FMA peak, not bf16


def _op(kernel: str, name: str) -> Callable | None:
    try:
        package = "zrl.moepp.kernels" if kernel in ("cca", "router") else "zrl.modeling.kernels"
        module = __import__(f"{package}.{kernel}", fromlist=[name])
        return getattr(module, name)
    except (ImportError, AttributeError) as exc:
        print(f"# {kernel}: op {name} not available ({exc}); its zrl rows are skipped")
        return None


def _backends(ctx: Ctx, op: Callable | None, run: Callable[[Callable], object], leaves: list[torch.Tensor],
              suffix: str = "") -> list[Impl]:
    """The reference and (if asked) Triton rows of a zrl op; `run(op)` calls it on the group's inputs."""
    if op is None:
        return []
    return [Impl(b + suffix, _scoped(b, lambda: run(op)), leaves) for b in ("reference", "triton") if b in ctx.impls]


def _load(module: torch.nn.Module, tensors: dict[str, torch.Tensor], ctx: Ctx) -> torch.nn.Module:
    """`module` on the device in the compute dtype holding copies of `tensors` (HF parameter names)."""
    module.load_state_dict({k: v.detach() for k, v in tensors.items()}, strict=True)
    return module.to(ctx.device, ctx.dtype)


def experts_groups(ctx: Ctx, tokens: int) -> list[Group]:
    s = ctx.shape
    x, gate = ctx.leaf(tokens, s.D), torch.rand(tokens, generator=ctx.gen).to(ctx.device).requires_grad_()
    skip = torch.rand(tokens, generator=ctx.gen) < ctx.skip_share
    ids = torch.where(skip, s.E, torch.randint(0, s.E, (tokens,), generator=ctx.gen)).to(ctx.device)  # [T]
    gate_up, down = ctx.leaf(s.E, 2 * s.F, s.D, std=0.02), ctx.leaf(s.E, s.D, s.F, std=0.02)
    leaves = [x, gate, gate_up, down]
    impls = _backends(ctx, _op("experts", "moe_experts"), lambda op: op(x, ids, gate, gate_up, down), leaves)
    if "grouped_mm" in ctx.impls and hasattr(torch, "_grouped_mm"):
        from zrl.modeling.kernels.experts.grouped_mm import moe_experts_grouped_mm  # what auto runs on Hopper

        impls.append(Impl("grouped_mm", lambda: moe_experts_grouped_mm(x, ids, gate, gate_up, down), leaves))
        if ctx.device.type == "cuda":  # its glue as glue.py's Triton passes (the interpreter is too slow to time)
            impls.append(Impl("grouped_mm fused glue", lambda: moe_experts_grouped_mm(
                x, ids, gate, gate_up, down, fused_glue=True), leaves))
    if "transformers" in ctx.impls and ctx.hf is not None:
        # HF's router hands the skip class over as expert 0 with weight 0 (computed, then zeroed).
        hf_ids = torch.where(ids == s.E, 0, ids)[:, None]  # [T, 1]
        variants = ["eager"] + (["grouped_mm"] if ctx.device.type == "cuda" and "grouped_mm" in ctx.impls else [])
        for variant in variants:
            experts = _load(ctx.hf.ZayaExperts(ctx.hf_config()), {"gate_up_proj": gate_up, "down_proj": down}, ctx)
            experts.config._experts_implementation = variant

            def run(m=experts) -> torch.Tensor:
                return m(x, hf_ids, torch.where(ids == s.E, 0.0, gate)[:, None])

            name = "transformers" if variant == "eager" else "transformers grouped_mm"
            impls.append(Impl(name, run, [x, gate, *experts.parameters()]))
    routed = int((~skip).sum())
    return [Group("experts", experts_work(s, tokens, routed, ctx.act), impls, f"routed {routed}/{tokens}")]


def router_groups(ctx: Ctx, tokens: int) -> list[Group]:
    s, eps = ctx.shape, 1e-5
    r = ctx.leaf(tokens, s.R)
    w = dict(norm=ctx.leaf(s.R, std=0.1, mean=1.0), fc1=ctx.leaf(s.R, s.R, std=0.02), fc1b=ctx.leaf(s.R, std=0.02),
             fc2=ctx.leaf(s.R, s.R, std=0.02), fc2b=ctx.leaf(s.R, std=0.02), out=ctx.leaf(s.E + 1, s.R, std=0.02))
    biases = torch.zeros(s.E + 1, device=ctx.device)
    biases[-1] = -1.0
    leaves = [r, *w.values()]
    impls = _backends(ctx, _op("router", "route"), lambda op: op(
        r, w["norm"], w["fc1"], w["fc1b"], w["fc2"], w["fc2b"], w["out"], biases, None, eps)[0], leaves)
    if "transformers" in ctx.impls and ctx.hf is not None:
        # The same piece: ZayaRouter of layer 0 (no EDA) with its down-projection replaced by identity,
        # so it starts from r like the op (it still clones r as the next layer's state).
        router = ctx.hf.ZayaRouter(ctx.hf_config(), 0)
        router.down_proj = torch.nn.Identity()
        router = _load(router, {"router_mlp.norm.weight": w["norm"], "router_mlp.fc1.weight": w["fc1"],
                                "router_mlp.fc1.bias": w["fc1b"], "router_mlp.fc2.weight": w["fc2"],
                                "router_mlp.fc2.bias": w["fc2b"], "router_mlp.out_proj.weight": w["out"],
                                "balancing_biases": biases}, ctx)
        impls.append(Impl("transformers", lambda: router(r[None])[1], [r, *router.parameters()]))
    return [Group("router", router_work(s, tokens, ctx.act), impls)]


def residual_norm_groups(ctx: Ctx, tokens: int) -> list[Group]:
    s, eps = ctx.shape, 1e-5
    branch, residual = ctx.leaf(tokens, s.D), ctx.leaf(tokens, s.D, dtype=torch.float32)
    v = dict(hs=ctx.leaf(s.D, std=0.1, mean=1.0), hb=ctx.leaf(s.D, std=0.1), rs=ctx.leaf(s.D, std=0.1, mean=1.0),
             rb=ctx.leaf(s.D, std=0.1), norm=ctx.leaf(s.D, std=0.1, mean=1.0))
    leaves = [branch, residual, *v.values()]
    impls = _backends(ctx, _op("residual_norm", "scaled_residual_add_rmsnorm"), lambda op: op(
        branch, residual, v["hs"], v["hb"], v["rs"], v["rb"], v["norm"], eps), leaves)
    if "triton" in ctx.impls and ctx.device.type == "cuda":  # the backward's row loop software-pipelined
        from zrl.modeling.kernels.residual_norm import triton_kernel

        impls.append(Impl("triton pipelined", lambda: triton_kernel.scaled_residual_add_rmsnorm(
            branch, residual, v["hs"], v["hb"], v["rs"], v["rb"], v["norm"], eps,
            stages=triton_kernel.PIPELINED_STAGES), leaves))
    if "transformers" in ctx.impls and ctx.hf is not None:
        scaling = _load(ctx.hf.ZayaResidualScaling(s.D), {
            "hidden_states_scale": v["hs"], "hidden_states_bias": v["hb"], "residual_scale": v["rs"],
            "residual_bias": v["rb"]}, ctx)
        norm = _load(ctx.hf.ZayaRMSNorm(s.D, eps), {"weight": v["norm"]}, ctx)

        def run() -> tuple[torch.Tensor, torch.Tensor]:
            x = scaling(branch, residual)  # as ZayaDecoderLayer: fp32 stream, normed in the weight dtype
            return x, norm(x.to(norm.weight.dtype))

        impls.append(Impl("transformers", run, [branch, residual, *scaling.parameters(), *norm.parameters()]))
    return [Group("residual_norm", residual_norm_work(s, tokens, ctx.act), impls)]


def cca_groups(ctx: Ctx, tokens: int) -> list[Group]:
    from zrl.modeling.rope import rope_cos_sin
    from zrl.modeling.packing import build_layout

    s, cfg = ctx.shape, ctx.shape.config()
    lens = doc_lengths(tokens, ctx.doc_len, ragged=True)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=ctx.device)
    layout = build_layout(tokens, device=ctx.device, cu_seqlens=cu)
    cos, sin = rope_cos_sin(layout.positions, s.rotary, cfg.rope_theta)  # [T, rotary / 2]
    conv = dict(dw=ctx.leaf(s.C, 1, s.k0, std=0.5), dwb=ctx.leaf(s.C, std=0.1), gr=ctx.leaf(s.C, s.d, s.k1, std=0.05),
                grb=ctx.leaf(s.C, std=0.1), temp=ctx.leaf(s.Hk, std=0.1, mean=1.0))
    op = _op("cca", "cca_precondition")

    def call(op: Callable, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return op(q, k, conv["dw"], conv["dwb"], conv["gr"], conv["grb"], conv["temp"], layout.doc_offset,
                  cos, sin, s.Hq, s.Hk, s.d)

    q, k = ctx.leaf(tokens, s.Hq * s.d), ctx.leaf(tokens, s.Hk * s.d)  # projections' outputs, compute dtype
    impls = _backends(ctx, op, lambda o: call(o, q, k), [q, k, *conv.values()])
    if "library" in ctx.impls and op is not None:  # the reference with its convolutions as one batched GEMM
        from zrl.moepp.kernels.cca import library, reference

        convs = functools.partial(reference.cca_precondition, convs=library.causal_convs)
        impls.append(Impl("library", lambda: call(convs, q, k), [q, k, *conv.values()]))
    groups = [Group("cca", cca_work(s, tokens, ctx.act), impls, f"{len(lens)} ragged docs", fp32=True)]

    # With the q/k/v projections in front: the piece transformers has as modules.
    x = ctx.leaf(tokens, s.D)
    proj = dict(q=ctx.leaf(s.Hq * s.d, s.D, std=0.02), k=ctx.leaf(s.Hk * s.d, s.D, std=0.02),
                vc=ctx.leaf(s.Hk * s.d // 2, s.D, std=0.02), vd=ctx.leaf(s.Hk * s.d // 2, s.D, std=0.02))
    leaves = [x, *proj.values(), *conv.values()]

    def with_proj(op: Callable) -> tuple[torch.Tensor, ...]:
        qo, ko = call(op, F.linear(x, proj["q"]), F.linear(x, proj["k"]))
        return qo, ko, F.linear(x, proj["vc"]), F.linear(x, proj["vd"])

    impls = _backends(ctx, op, with_proj, leaves, suffix="+proj")
    if "transformers" in ctx.impls and ctx.hf is not None:
        config = ctx.hf_config()
        cca = _load(ctx.hf.ZayaCCAProjection(config, 0), {
            "q_proj.weight": proj["q"], "k_proj.weight": proj["k"], "v_proj_current.weight": proj["vc"],
            "v_proj_delayed.weight": proj["vd"], "conv_qk_depthwise.weight": conv["dw"],
            "conv_qk_depthwise.bias": conv["dwb"], "conv_qk_grouped.weight": conv["gr"],
            "conv_qk_grouped.bias": conv["grb"]}, ctx)
        qk_norm = _load(ctx.hf.ZayaQKNorm(config), {"temp": conv["temp"]}, ctx)
        rotary = ctx.hf.ZayaRotaryEmbedding(config, device=ctx.device)
        hf_cos, hf_sin = rotary(x, layout.positions[None], "hybrid")  # [1, T, rotary]

        def run() -> tuple[torch.Tensor, ...]:
            # One [1, T] row: HF has no document boundaries (its convolutions cross them; same cost).
            qh, kh, vh = cca(x[None], None, None)
            qh, kh = qk_norm(qh, kh)
            qh, kh = ctx.hf.apply_rotary_pos_emb(qh.transpose(1, 2), kh.transpose(1, 2), hf_cos, hf_sin)
            return qh, kh, vh

        impls.append(Impl("transformers", run, [x, *cca.parameters(), *qk_norm.parameters()]))
    gemm, base = 2.0 * tokens * s.D * (s.Hq + 2 * s.Hk) * s.d, cca_work(s, tokens, ctx.act)  # q, k, v GEMMs
    work = Work(base.flops_fwd + gemm, base.flops_bwd + 2 * gemm, math.nan, math.nan)
    return [*groups, Group("cca+proj", work, impls, "incl. q/k/v projections")]


def lm_logprobs_groups(ctx: Ctx, tokens: int) -> list[Group]:
    s = ctx.shape
    hidden, weight = ctx.leaf(tokens, s.D, dtype=torch.float32), ctx.leaf(s.V, s.D, std=0.02)
    targets = torch.randint(0, s.V, (tokens,), generator=ctx.gen).to(ctx.device)
    leaves = [hidden, weight]
    impls = _backends(ctx, _op("lm_logprobs", "token_logprobs"), lambda op: op(hidden, weight, targets)[0], leaves)
    if "library" in ctx.impls:
        from zrl.modeling.kernels.lm_logprobs.library import token_logprobs_library

        impls.append(Impl("library", lambda: token_logprobs_library(hidden, weight, targets, chunk_tokens=None,
                                                                    with_entropy=False)[0], leaves))
    if "fused" in ctx.impls:
        impls.append(Impl("fused", _fused_head_loss(ctx, hidden, weight, targets), leaves))
        # the split products with dh and dW at order 1, the default before 2026-11-28 (on CUDA "fused" is the
        # split products at order 0: the pair shows what the orders cost)
        impls.append(Impl("fused (split, order-1 gradients)", _fused_head_loss(ctx, hidden, weight, targets, order=1),
                          leaves))
    note = ""
    if "transformers" in ctx.impls and ctx.hf is not None:
        # lm_head in the weight dtype, then log_softmax in fp32: [T, V] logits, their fp32 copy, the
        # log-softmax and the two gradients of that size live at once.
        need = tokens * s.V * (2 * ctx.act + 3 * 4)
        free = torch.cuda.mem_get_info(ctx.device)[0] if ctx.device.type == "cuda" else 16 << 30
        if need > 0.7 * free:
            note = f"transformers skipped: [T, V] logits need ~{need / 2**30:.0f} GiB"
        else:
            def run() -> torch.Tensor:
                logits = F.linear(hidden.to(weight.dtype), weight)  # [T, V] as ZayaForCausalLM.lm_head
                return torch.log_softmax(logits.float(), dim=-1).gather(1, targets[:, None])[:, 0]

            impls.append(Impl("transformers", run, leaves))
    return [Group("lm_logprobs", lm_logprobs_work(s, tokens, ctx.act), impls, note, fp32=True)]


def _fused_head_loss(ctx: Ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                     order: int | None = None) -> Callable[[], torch.Tensor]:
    """The LM head fused with the RL loss (lm_logprobs.head_loss, what the trainer runs: DPPO Binary-TV,
    Dr-GRPO aggregation) under `auto`: its forward forms dh and dW, its backward scales them. With `order`:
    the split products with dh and dW at that order instead of the defaults (fused.py)."""
    from zrl.algorithms import policy_loss_grad, token_weights
    from zrl.modeling.kernels.lm_logprobs import head_loss
    from zrl.modeling.kernels.lm_logprobs.fused import FusedSplitProducts, fused_head_loss

    tokens = hidden.shape[0]
    advantages = torch.randn(tokens, generator=ctx.gen).to(ctx.device)
    behaviour = (-torch.rand(tokens, generator=ctx.gen) * 8).to(ctx.device)
    mask = torch.ones(tokens, dtype=torch.bool, device=ctx.device)
    weights = token_weights("seq_mean_token_sum_norm", mask, None, global_num_seqs=max(1, tokens // ctx.doc_len),
                            global_num_tokens=tokens, max_response_tokens=ctx.doc_len)

    def token_grad(rows, logprob, entropy):
        loss, grad = policy_loss_grad("dppo_binary_tv", logprob, behaviour[rows], advantages[rows], mask[rows])
        return loss * weights[rows], grad * weights[rows], None

    if order is None:
        return _scoped("auto", lambda: head_loss(hidden, weight, targets, token_grad)[0])
    products = functools.partial(FusedSplitProducts, grad_hidden_order=order, grad_weight_order=order)
    return lambda: fused_head_loss(hidden, weight, targets, token_grad, products=products)[0]


def _init_layer(layer: torch.nn.Module) -> None:
    """The model's initial values (MoEPPForCausalLM.reset_parameters), without building a whole model."""
    with torch.no_grad():
        for module in layer.modules():
            if isinstance(module, torch.nn.Linear):
                torch.nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    torch.nn.init.zeros_(module.bias)
            elif hasattr(module, "reset_parameters"):
                module.reset_parameters()
        layer.self_attn.qk_norm.temp.fill_(1.0)  # the initial 0 makes attention uniform
        layer.mlp.gate.balancing_biases[-1] = 0.0  # the skip class chosen ~1/(E+1) of the time


def layer_groups(ctx: Ctx, tokens: int) -> list[Group]:
    from zrl.modeling.rope import rope_cos_sin
    from zrl.moepp.model import DecoderLayer
    from zrl.modeling.packing import build_layout

    s, cfg = ctx.shape, ctx.shape.config()
    layer = DecoderLayer(cfg, 1)
    _init_layer(layer)
    layer = layer.to(ctx.device, ctx.dtype)
    x, state = ctx.leaf(tokens, s.D, dtype=torch.float32), ctx.leaf(tokens, s.R)
    leaves = [x, state, *layer.parameters()]
    groups = []
    for ragged in (False, True):
        lens = doc_lengths(tokens, ctx.doc_len, ragged=ragged)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=ctx.device)
        layout = build_layout(tokens, device=ctx.device, cu_seqlens=cu)
        rope = rope_cos_sin(layout.positions, s.rotary, cfg.rope_theta)

        def run(layout=layout, rope=rope) -> tuple[torch.Tensor, torch.Tensor]:
            out, routing = layer(x, state, layout, rope)
            return out, routing.state

        impls = [Impl(b, _scoped(b, run), leaves) for b in ("reference", "triton") if b in ctx.impls]
        with torch.no_grad(), use_backend("reference"):
            routed = int((layer(x, state, layout, rope)[1].chosen < s.E).sum())
        note = f"{len(lens)} {'ragged' if ragged else 'equal'} docs, routed {routed}/{tokens}"
        if not ragged and "transformers" in ctx.impls and ctx.hf is not None:
            if tokens % ctx.doc_len:
                note += "; transformers skipped (T not a multiple of --doc-len)"
            else:
                impls.append(_hf_layer(ctx, layer, x, state, tokens // ctx.doc_len))
        groups.append(Group("layer ragged" if ragged else "layer", layer_flops(s, lens, routed), impls, note))
    return groups


def _scoped(backend: str, fn: Callable[[], object]) -> Callable[[], object]:
    def call() -> object:
        with use_backend(backend):
            return fn()
    return call


def _hf_layer(ctx: Ctx, layer: torch.nn.Module, x: torch.Tensor, state: torch.Tensor, rows: int) -> Impl:
    """transformers' ZayaDecoderLayer with the zrl layer's weights, the stream as [rows, S] documents."""
    config = ctx.hf_config()
    hf_layer = ctx.hf.ZayaDecoderLayer(config, 1)
    hf_layer.load_state_dict(layer.state_dict(), strict=True)  # same keys below `model.layers.<i>.`
    hf_layer.to(ctx.device, ctx.dtype)
    seq = x.shape[0] // rows
    positions = torch.arange(seq, device=ctx.device).expand(rows, seq)
    rotary = ctx.hf.ZayaRotaryEmbedding(config, device=ctx.device)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        # transformers' layer takes its stream and router state in the parameters' dtype (an fp32 stream
        # with bf16 weights fails there: fp32 q/k against a bf16 v in SDPA)
        hidden = x.to(ctx.dtype).view(rows, seq, -1)
        return hf_layer(hidden, state.to(ctx.dtype).view(rows, seq, -1), attention_mask={"causal": None, "conv": None},
                        position_embeddings=rotary(hidden, positions, "hybrid"))

    return Impl("transformers", run, [x, state, *hf_layer.parameters()])


BUILDERS = {"experts": experts_groups, "router": router_groups, "residual_norm": residual_norm_groups,
            "cca": cca_groups, "lm_logprobs": lm_logprobs_groups, "layer": layer_groups}


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
