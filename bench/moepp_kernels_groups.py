"""The groups bench/moepp_kernels.py times: per op (experts, router, residual_norm, cca, lm_logprobs, the whole
decoder layer), its inputs on the ZAYA1-8B layer shape and each implementation of it (zrl's reference and
Triton kernel, a library path, transformers' piece) with the same weights. moepp_kernels.py times and
reports them; gpu_probe.py runs them in its kernel part.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from moepp_kernels_work import (Shape, Work, cca_work, doc_lengths, experts_work, layer_flops, lm_logprobs_work,
                                residual_norm_work, router_work)
from zrl.modeling.kernels import use_backend


@dataclasses.dataclass
class Impl:
    """One implementation of a group: `run` returns the outputs to differentiate; `leaves` get grads."""
    name: str
    run: Callable[[], object]
    leaves: list[torch.Tensor]


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
    return [Impl(b + suffix, scoped(b, lambda: run(op)), leaves) for b in ("reference", "triton") if b in ctx.impls]


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
        return scoped("auto", lambda: head_loss(hidden, weight, targets, token_grad)[0])
    products = functools.partial(FusedSplitProducts, grad_hidden_order=order, grad_weight_order=order)
    return lambda: fused_head_loss(hidden, weight, targets, token_grad, products=products)[0]


def init_layer(layer: torch.nn.Module) -> None:
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
    init_layer(layer)
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

        impls = [Impl(b, scoped(b, run), leaves) for b in ("reference", "triton") if b in ctx.impls]
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


def scoped(backend: str, fn: Callable[[], object]) -> Callable[[], object]:
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
