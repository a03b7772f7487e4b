"""Work formulas, device peaks and document layouts of bench/moepp_kernels.py and bench/gpu_probe.py
(no timing here).

FLOPs and bytes per call of each MoE++ kernel (useful work: routed tokens only, causal half of
attention, no recomputation) in the letters of docs/shapes.md; the kernel READMEs give the
kernels' own counts, including what they recompute. `training_step_ops` adds the remaining pieces of
a trainer step (projections, norms, the LM head as it is executed, optimizer, FSDP2 casts) for the
roofline estimate of a whole step.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import torch

from zrl.moepp.config import MoEPPConfig

# Dense bf16 tensor-core FLOP/s of the vendor data sheets (their "with sparsity" figure halved), the MFU
# denominator as verl, torchtitan and prime-rl take it: (pattern, card, FLOP/s), the first pattern found in
# torch.cuda.get_device_name (case ignored) wins, so a PCIe or NVL part comes before its SXM name ("NVIDIA H200",
# "NVIDIA H800"). An H100 names its form factor or memory ("NVIDIA H100 PCIe", "... 80GB HBM3" = SXM, "HBM2e" =
# PCIe); a name matching no row gets no figure (never a guess).
BF16_DENSE_PEAKS = (
    (r"\bH100 PCIe|\bH100\b.*\bHBM2e\b", "H100 PCIe", 756e12),
    (r"\bH100 NVL\b", "H100 NVL", 835e12),
    (r"\bH100 SXM|\bH100\b.*\bHBM3\b", "H100 SXM", 989e12),
    (r"\bH200 NVL\b", "H200 NVL", 835e12),
    (r"\bH200\b", "H200 SXM", 989e12),
    (r"\bH800 PCIe|\bH800\b.*\bHBM2e\b", "H800 PCIe", 756e12),
    (r"\bH800\b", "H800 SXM", 989e12),
    (r"\bA100\b", "A100", 312e12),  # SXM4 and PCIe, 40 and 80 GB alike
)
# fp32 FMA FLOP/s (no tensor cores) and HBM bytes/s of the data sheets, by card (bench/moepp_kernels.py's columns).
FP32_HBM_PEAKS = {"H100 PCIe": (51e12, 2.0e12), "H100 SXM": (67e12, 3.35e12), "H200 SXM": (67e12, 4.8e12)}


@dataclasses.dataclass(frozen=True)
class Shape:
    """One layer's sizes, in the letters of docs/shapes.md."""
    D: int  # hidden
    E: int  # routed experts (+ the skip class)
    F: int  # expert intermediate
    Hq: int
    Hk: int
    d: int  # head dim
    R: int  # router latent
    V: int  # vocabulary
    k0: int = 2  # cca_time0
    k1: int = 2  # cca_time1
    rotary: int = 64  # rotary_dim

    @property
    def C(self) -> int:
        return (self.Hq + self.Hk) * self.d

    def config(self) -> MoEPPConfig:
        return MoEPPConfig(vocab_size=self.V, hidden_size=self.D, num_hidden_layers=2, num_attention_heads=self.Hq,
                           num_key_value_heads=self.Hk, head_dim=self.d, moe_intermediate_size=self.F,
                           num_experts=self.E, router_hidden_size=self.R, cca_time0=self.k0, cca_time1=self.k1,
                           partial_rotary_factor=self.rotary / self.d)


FULL = Shape(D=2048, E=16, F=2048, Hq=8, Hk=2, d=128, R=256, V=262_272)  # = config.zaya1_8b_config()
SMALL = Shape(D=256, E=8, F=256, Hq=4, Hk=2, d=64, R=64, V=8192, rotary=32)


@dataclasses.dataclass(frozen=True)
class Work:
    """FLOPs and bytes moved of one call, forward and backward separately."""
    flops_fwd: float
    flops_bwd: float
    bytes_fwd: float
    bytes_bwd: float

    def flops(self, mode: str) -> float:
        return self.flops_fwd + (self.flops_bwd if mode == "fwd+bwd" else 0.0)

    def bytes(self, mode: str) -> float:
        return self.bytes_fwd + (self.bytes_bwd if mode == "fwd+bwd" else 0.0)


# ---------------------------------------------------------------- work formulas (s: bytes per element)

def experts_work(s: Shape, tokens: int, routed: int, act: int) -> Work:
    """Grouped SwiGLU experts on n = `routed` of T = `tokens` tokens (the experts README's formulas,
    with Eu = E and the K-dependent dgate partials left out).

    FLOPs: forward 6 n D F (gate_up 4, down 2); backward 12 n D F (dA 2, dx 4, dW_gu 4, dW_down 2).
    Bytes forward: x n D c, weights 3 E D F c, act written and read 2 n F c, gu written 2 n F c,
    y zero-filled T D 4 and stored n D 4, gate and order 12 n.
    Bytes backward: dy 2 n D 4, weights read 3 E D F c and gradients written 3 E D F c, gu read
    2 n F c, dgu written and read twice 6 n F c, act 2 n F c, dx zero-filled T D c and stored n D c, x n D c.
    """
    n, w = routed, 3 * s.E * s.D * s.F * act
    return Work(
        flops_fwd=6.0 * n * s.D * s.F,
        flops_bwd=12.0 * n * s.D * s.F,
        bytes_fwd=float(n * s.D * act + w + 4 * n * s.F * act + tokens * s.D * 4 + n * s.D * 4 + 12 * n),
        bytes_bwd=float(8 * n * s.D + 2 * w + 10 * n * s.F * act + tokens * s.D * act + 2 * n * s.D * act),
    )


def dense_gemm_flops(tokens: int, s: Shape) -> float:
    """[T, D] x [D, 2F]: the gate_up GEMM as if every token went to one expert."""
    return 2.0 * tokens * s.D * 2 * s.F


def router_work(s: Shape, tokens: int, act: int) -> Work:
    """Router head on r [T, R] (the router README's formulas, C = E + 1 classes, r in the compute dtype).

    FLOPs (GEMMs): forward 2 T (2 R^2 + R C); backward the useful 2 T (4 R^2 + 2 R C) (the kernel
    recomputes fc1 and the logits on top). Bytes forward: T (R a + 20) + (2 R^2 + R C + 3 R) a + 4 C;
    backward: T (2 R a + 10 R a + 2 C a + 12), plus the weights read and their gradients written.
    """
    c, weights = s.E + 1, (2 * s.R * s.R + s.R * (s.E + 1) + 3 * s.R) * act
    gemm = 2.0 * tokens * (2 * s.R * s.R + s.R * c)
    return Work(flops_fwd=gemm, flops_bwd=2 * gemm, bytes_fwd=float(tokens * (s.R * act + 20) + weights + 4 * c),
                bytes_bwd=float(tokens * (12 * s.R * act + 2 * c * act + 12) + 2 * weights))


def residual_norm_work(s: Shape, tokens: int, act: int) -> Work:
    """x = (b + hb) hs + (r + rb) rs; normed = RMSNorm(x) (the residual_norm README; memory-bound).

    FLOPs ~9 T D forward, ~23 T D backward. Bytes forward: branch T D a, residual T D 4, x and normed
    written T D 8, rstd 4 T, five [D] vectors 5 D a; backward reads branch, residual, dx, dnormed and
    writes dbranch, dresidual: T D (2 a + 16) + 4 T + 5 D a (the [5, P, D] partials left out).
    """
    e, vectors = tokens * s.D, 5 * s.D * act + 4 * tokens
    return Work(flops_fwd=9.0 * e, flops_bwd=23.0 * e,
                bytes_fwd=float(e * (act + 12) + vectors), bytes_bwd=float(e * (2 * act + 16) + vectors))


def cca_work(s: Shape, tokens: int, act: int) -> Work:
    """CCA preconditioner on q [T, Hq d], k [T, Hk d] in the compute dtype (a bytes), C = (Hq + Hk) d.

    FLOPs per token, useful work: depthwise conv 2 k0 C, grouped conv 2 k1 d C (d inputs per output
    channel), mean skip + residual + norm + temperature ~10 C, RoPE 3 rotary (Hq + Hk); backward 2x.
    Bytes, those of one fused pass per direction (cos and sin [T, rotary / 2] fp32 each = 4 T rotary):
    forward q, k read T C a, q, k written fp32 4 T C, doc_offset 8 T; backward T C (3 a + 12 + k1 (4 + a))
    plus cos and sin. What each path really moves: bench/kernel_traffic.py.
    """
    per_token = 2 * s.k0 * s.C + 2 * s.k1 * s.d * s.C + 10 * s.C + 3 * s.rotary * (s.Hq + s.Hk)
    rope = tokens * s.rotary * 4
    return Work(flops_fwd=float(tokens * per_token), flops_bwd=2.0 * tokens * per_token,
                bytes_fwd=float(tokens * s.C * (act + 4) + rope + 8 * tokens),
                bytes_bwd=float(tokens * s.C * (3 * act + 12 + s.k1 * (4 + act)) + rope))


def lm_logprobs_work(s: Shape, tokens: int, act: int) -> Work:
    """Token log-probabilities through the [V, D] LM head, fp32 math (the lm_logprobs README, hidden fp32,
    weight in the compute dtype a, split-K partials left out).

    FLOPs: forward 2 T V D; backward the useful 4 T V D (dH and dW; the kernels also recompute the
    logits, once per gradient). Bytes forward: hidden T D 4, weight V D a, targets and logprob 12 T.
    Backward, dH pass: hidden, weight, dH summed and cast T D (4 + 4); dW pass: hidden, weight, dW
    zeroed 4 V D and cast V D (4 + a); targets, lse and dlogprob 16 T.
    """
    vd = s.V * s.D
    return Work(flops_fwd=2.0 * tokens * vd, flops_bwd=4.0 * tokens * vd,
                bytes_fwd=float(tokens * s.D * 4 + vd * act + tokens * 12),
                bytes_bwd=float(2 * tokens * s.D * 4 + 2 * vd * act + tokens * s.D * 8 + vd * (8 + act) + tokens * 16))


def layer_flops(s: Shape, doc_lens: Sequence[int], routed: int) -> Work:
    """One decoder layer. Forward: q/k/v/o projections 2 T D (2 Hq d + 2 Hk d), causal attention
    2 Hq d sum(S_i^2) (QK^T and PV over the causal half), router 2 T D R + router head, experts
    6 n D F, CCA; backward twice the forward (the usual 3x training convention). Bytes: not modelled."""
    t = sum(doc_lens)
    fwd = (2.0 * t * s.D * (2 * s.Hq * s.d + 2 * s.Hk * s.d) + 2.0 * s.Hq * s.d * sum(n * n for n in doc_lens)
           + 2.0 * t * s.D * s.R + router_work(s, t, 2).flops_fwd + experts_work(s, t, routed, 2).flops_fwd
           + cca_work(s, t, 2).flops_fwd)
    return Work(flops_fwd=fwd, flops_bwd=2 * fwd, bytes_fwd=math.nan, bytes_bwd=math.nan)


def gemm_work(m: int, n: int, k: int, act: int) -> Work:
    """Y [m, n] = X [m, k] W^T with W [n, k] (an nn.Linear), everything in the compute dtype (a bytes).

    FLOPs: forward 2 m n k; backward 4 m n k (dX = dY W, dW = dY^T X). Bytes: forward X and W read,
    Y written (m k + n k + m n) a; backward dY read twice, W and X once, dX and dW written 2 (m n + n k + m k) a.
    """
    return Work(flops_fwd=2.0 * m * n * k, flops_bwd=4.0 * m * n * k, bytes_fwd=float((m * k + n * k + m * n) * act),
                bytes_bwd=float(2 * (m * n + n * k + m * k) * act))


def rms_norm_work(s: Shape, tokens: int, act: int) -> Work:
    """RMSNorm of the fp32 residual stream [T, D] (memory-bound). FLOPs ~4 T D forward, ~8 T D backward.
    Bytes forward: x read T D 4, normed written T D a, weight D a; backward: x and dnormed read, dx
    written T D (8 + a), the weight's gradient D 4."""
    e = tokens * s.D
    return Work(flops_fwd=4.0 * e, flops_bwd=8.0 * e, bytes_fwd=float(e * (4 + act) + s.D * act),
                bytes_bwd=float(e * (8 + act) + s.D * 4))


def attention_work(s: Shape, doc_lens: Sequence[int], act: int) -> Work:
    """Causal GQA attention inside each document: q, o [T, Hq, d], k, v [T, Hk, d] in the compute dtype.

    FLOPs (useful): forward 2 Hq d sum(S_i^2) (QK^T and PV, each 2 S^2 d over the causal half);
    backward twice that (a flash backward executes 2.5x: it recomputes QK^T, see FLASH_BWD_EXECUTED).
    Bytes (the [S, S] scores never reach memory): forward q, k, v read and o written T d (2 Hq + 2 Hk) a
    plus the log-sum-exp 4 T Hq; backward q, k, v, o, do read and dq, dk, dv written T d (4 Hq + 4 Hk) a
    plus the log-sum-exp and the row sums 8 T Hq.
    """
    t, sq = sum(doc_lens), sum(n * n for n in doc_lens)
    fwd = 2.0 * s.Hq * s.d * sq
    return Work(flops_fwd=fwd, flops_bwd=2 * fwd, bytes_fwd=float(t * s.d * (2 * s.Hq + 2 * s.Hk) * act + 4 * t * s.Hq),
                bytes_bwd=float(t * s.d * (4 * s.Hq + 4 * s.Hk) * act + 8 * t * s.Hq))


FLASH_BWD_EXECUTED = 1.25  # a flash attention backward runs 5 [S, S] products to the forward's 2: 2.5x, not 2x
# The CCA's grouped convolution as its Triton path runs it with bf16 weights (the trainer's;
# zrl/moepp/kernels/cca/triton_kernel.py, "Precision"): forward one bf16 GEMM over the taps' three exact bf16
# parts (3 GEMM-equivalents of its 2 k1 d C FLOPs per token, K-stacked), backward g_W1 and g_taps at order 0
# (1 each, the useful 2).
CCA_GEMM_DOTS = (3, 2)


def cca_gemm_work(s: Shape, tokens: int) -> Work:
    """The CCA's grouped convolution as GEMMs (its FLOPs are in cca_work too): forward 2 k1 d per output
    channel and token, backward twice that. Bytes (the weights left out): forward the taps' three bf16 parts
    read, T C k1 6, conv written fp32, T C 4; backward g_conv in bf16 read twice, T C 4, the taps' hi part,
    T C k1 2, g_taps written fp32, T C k1 4."""
    tc = tokens * s.C
    return Work(flops_fwd=2.0 * s.k1 * s.d * tc, flops_bwd=4.0 * s.k1 * s.d * tc,
                bytes_fwd=float(tc * (6 * s.k1 + 4)), bytes_bwd=float(tc * (4 + 6 * s.k1)))

# The LM head as the RL loss runs it on CUDA, fused with the loss (zrl/modeling/kernels/lm_logprobs/fused.py),
# in bf16 GEMM-equivalents of 2 T V D: the fp32 hidden state in three exact bf16 parts against the bf16
# weight for the logits (3, K-stacked: fp32-level log-probs); dh = G W and dW = G^T h at order 0 (1 each:
# G's hi part, against the weight and the hidden hi part). All in the forward; the backward only scales the
# saved dh and dW. (The unfused library op, lm_logprobs/library.py, runs 3 + 9: the backward recomputes the
# logits.)
LM_HEAD_DOTS = (5, 0)
# Bytes per element of the [T, V] logits that the fused head moves through HBM over its fp32 [c, V]
# blocks, GEMM outputs and block operands included, with its two Triton passes (grad_parts_kernel.py):
# the logits GEMM writes 4, row_stats reads 4, grad_parts reads 4 and writes G's hi part 2, the dh and dW
# GEMMs read it 2 each. (The library op's eager passes: 44 + 134.)
LM_HEAD_BLOCK_BYTES = (18, 0)


def lm_head_split_work(s: Shape, tokens: int, act: int, dots: tuple[int, int] = LM_HEAD_DOTS) -> Work:
    """The LM head's GEMMs as executed with `dots` = (forward, backward) bf16 GEMM-equivalents of 2 T V D
    FLOPs each (LM_HEAD_DOTS). Bytes: the GEMMs' operands outside the [T, V] blocks (lm_head_block_work
    has those), as the unfused op splits them (the fused head moves about the same, all in its forward):
    forward hidden T D 4, weight V D a, targets and log-probs 12 T; backward hidden and weight read twice,
    dh written T D 4, dW accumulated in fp32 V D 4 and cast V D (4 + a), targets, lse and dlogprob 16 T."""
    gemm, vd, td = 2.0 * tokens * s.V * s.D, s.V * s.D, tokens * s.D
    return Work(flops_fwd=dots[0] * gemm, flops_bwd=dots[1] * gemm, bytes_fwd=float(td * 4 + vd * act + 12 * tokens),
                bytes_bwd=float(2 * (td * 4 + vd * act) + td * 4 + vd * (8 + act) + 16 * tokens))


def lm_head_block_work(s: Shape, tokens: int) -> Work:
    """The LM head's elementwise passes over its fp32 [c, V] blocks (LM_HEAD_BLOCK_BYTES per element of
    the [T, V] logits); FLOPs: ~20 per element (the row statistics' max, exp, sums; p and G and its parts)."""
    tv = float(tokens * s.V)
    return Work(flops_fwd=20 * tv, flops_bwd=0.0, bytes_fwd=LM_HEAD_BLOCK_BYTES[0] * tv,
                bytes_bwd=LM_HEAD_BLOCK_BYTES[1] * tv)


@dataclasses.dataclass(frozen=True)
class StepOp:
    """One op's share of a training step (all its calls): FLOPs and bytes as executed (recomputation
    included), the useful FLOPs that MFU counts, and which units its FLOPs run on."""
    name: str
    calls: int
    flops: float
    bytes: float
    model_flops: float
    tensor_cores: bool  # bf16 tensor cores; False: fp32 CUDA cores (elementwise, norms, fp32 convolutions)


def model_step_flops(s: Shape, layers: int, doc_lens: Sequence[int], routed: Sequence[int]) -> float:
    """Useful FLOPs of one training step (forward + backward = 3x the forward): `layers` x layer_flops with
    `routed[i]` tokens routed to an expert in layer i, plus the LM head 2 T V D (one GEMM, whatever
    precision trick executes it). Recomputation (activation checkpointing, a split LM head) is not counted."""
    if len(routed) != layers:
        raise ValueError(f"need one routed count per layer ({layers}), got {len(routed)}")
    t = sum(doc_lens)
    forward = sum(layer_flops(s, doc_lens, n).flops_fwd for n in routed) + 2.0 * t * s.V * s.D
    return 3.0 * forward


def optimizer_shapes(config: MoEPPConfig) -> tuple[list[tuple[int, ...]], int]:
    """(shapes of the Muon matrices, number of AdamW parameters) of the model built from `config`
    (on the meta device: no memory), grouped as the trainer groups them."""
    from zrl.modeling.params import optimizer_param_groups
    from zrl.moepp import MoEPPForCausalLM

    with torch.device("meta"):
        groups = optimizer_param_groups(MoEPPForCausalLM(config))
    return ([tuple(p.shape) for p in groups["muon"].values()], sum(p.numel() for p in groups["adamw"].values()))


def training_step_ops(s: Shape, layers: int, doc_lens: Sequence[int], routed: int, *, act: int = 2,
                      checkpointing: bool = True, lm_head_dots: tuple[int, int] = LM_HEAD_DOTS,
                      optimizer: tuple[Sequence[tuple[int, ...]], int] | None = None) -> list[StepOp]:
    """Every op of one trainer step on one microbatch of `doc_lens` documents, `routed` tokens routed to an
    expert in each layer, parameters gathered in the compute dtype (a = `act` bytes).

    Per layer: input RMSNorm, q/k/v projections (one GEMM of (Hq + 2 Hk) d outputs), CCA (its grouped
    convolution's GEMMs apart, on the tensor cores as the Triton path runs them: CCA_GEMM_DOTS), attention,
    o projection, residual add + RMSNorm, router down-projection, router head, experts, residual add
    (counted as residual_norm_work, whose normed output it does not write). `checkpointing`: each layer's
    forward runs again in the backward. Outside the layers: embedding gather (and its gradient's scatter),
    final RMSNorm, the LM head as executed (its GEMMs, `lm_head_dots`, and its passes over [c, V] blocks),
    and with `optimizer` = optimizer_shapes(...)
    Muon (Newton-Schulz FLOPs in bf16; momentum-free as ZAYA1 trains: gradient read, fp32 master read
    and written, 12 B per parameter; Newton-Schulz's own reads and writes ~4 a per parameter and
    iteration), AdamW (p, g, m, v read, p, m, v written, the clipping norm's read: 32 B per parameter)
    and the FSDP2 casts at world
    size 1 (the fp32 shards cast to the compute dtype for the forward and again for the backward, the
    gradients to fp32: 3 (4 + a) B per parameter).
    """
    from zrl.optim import NS_STEPS, ns_flops

    t = sum(doc_lens)
    runs = 2 if checkpointing else 1
    cca, conv = cca_work(s, t, act), cca_gemm_work(s, t)
    layer_ops = (  # name, useful work, tensor cores, executed / useful forward and backward FLOPs
        ("input_norm", rms_norm_work(s, t, act), False, 1.0, 1.0),
        ("qkv_proj", gemm_work(t, (s.Hq + 2 * s.Hk) * s.d, s.D, act), True, 1.0, 1.0),
        # the CCA: its grouped convolution's GEMMs on the tensor cores, the rest (and all its bytes) fp32
        ("cca", Work(cca.flops_fwd - conv.flops_fwd, cca.flops_bwd - conv.flops_bwd, cca.bytes_fwd, cca.bytes_bwd),
         False, 1.0, 1.0),
        ("cca_gemm", conv, True, CCA_GEMM_DOTS[0], CCA_GEMM_DOTS[1] / 2),
        ("attention", attention_work(s, doc_lens, act), True, 1.0, FLASH_BWD_EXECUTED),
        ("o_proj", gemm_work(t, s.D, s.Hq * s.d, act), True, 1.0, 1.0),
        ("residual_norm", residual_norm_work(s, t, act), False, 1.0, 1.0),
        ("router_down", gemm_work(t, s.R, s.D, act), True, 1.0, 1.0),
        ("router", router_work(s, t, act), True, 1.0, 1.0),
        ("experts", experts_work(s, t, routed, act), True, 1.0, 1.0),
        ("residual_add", residual_norm_work(s, t, act), False, 1.0, 1.0),
    )
    ops = [StepOp(name, layers, layers * (runs * fwd * w.flops_fwd + bwd * w.flops_bwd),
                  layers * (runs * w.bytes_fwd + w.bytes_bwd), layers * (w.flops_fwd + w.flops_bwd), tc)
           for name, w, tc, fwd, bwd in layer_ops]
    embed = Work(0.0, 0.0, float(t * s.D * (act + 4) + 8 * t), float(t * s.D * (4 + 2 * act) + 8 * t))
    norm, head = rms_norm_work(s, t, act), lm_head_split_work(s, t, act, lm_head_dots)
    useful_head, blocks = lm_logprobs_work(s, t, act), lm_head_block_work(s, t)
    ops += [StepOp("embedding", 1, 0.0, embed.bytes("fwd+bwd"), 0.0, False),
            StepOp("final_norm", 1, norm.flops("fwd+bwd"), norm.bytes("fwd+bwd"), norm.flops("fwd+bwd"), False),
            StepOp("lm_head", 1, head.flops("fwd+bwd"), head.bytes("fwd+bwd"), useful_head.flops("fwd+bwd"), True),
            StepOp("lm_head_blocks", 1, blocks.flops("fwd+bwd"), blocks.bytes("fwd+bwd"), 0.0, False)]
    if optimizer is not None:
        muon_shapes, adamw_numel = optimizer
        muon_numel = sum(math.prod(shape) for shape in muon_shapes)
        every = muon_numel + adamw_numel
        ops += [StepOp("muon", 1, float(sum(ns_flops(shape) for shape in muon_shapes)),
                       float(muon_numel * (12 + NS_STEPS * 4 * act)), 0.0, True),
                StepOp("adamw", 1, 12.0 * adamw_numel, 32.0 * adamw_numel, 0.0, False),
                StepOp("fsdp_casts", 1, 0.0, 3.0 * every * (4 + act), 0.0, False)]
    return ops


def datasheet_bf16(name: str) -> tuple[str, float] | None:
    """(card, dense bf16 FLOP/s) of a CUDA device name from BF16_DENSE_PEAKS; None when it has no row."""
    for pattern, card, flops in BF16_DENSE_PEAKS:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return card, flops
    return None


def device_peaks(name: str) -> tuple[float, float, float] | None:
    """(dense bf16 FLOP/s, fp32 FLOP/s, memory bytes/s) of a CUDA device name; None when any is unknown."""
    card = datasheet_bf16(name)
    if card is None or card[0] not in FP32_HBM_PEAKS:
        return None
    return (card[1], *FP32_HBM_PEAKS[card[0]])


def doc_lengths(tokens: int, doc_len: int, ragged: bool, seed: int = 0) -> list[int]:
    """Document lengths summing to `tokens`: all `doc_len` (the last shorter), or uniform in
    [doc_len / 4, 7 doc_len / 4] (mean doc_len) with the remainder as the last document."""
    if not ragged:
        return [doc_len] * (tokens // doc_len) + ([tokens % doc_len] if tokens % doc_len else [])
    gen = torch.Generator().manual_seed(seed)
    lens: list[int] = []
    while sum(lens) < tokens:
        lens.append(min(int(torch.randint(doc_len // 4, 7 * doc_len // 4 + 1, (1,), generator=gen)),
                        tokens - sum(lens)))
    return lens
