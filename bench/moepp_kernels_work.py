"""Work formulas, device peaks and document layouts of bench/moepp_kernels.py (no timing here).

FLOPs and bytes per call of each MoE++ kernel (useful work: routed tokens only, causal half of
attention, no recomputation) in the letters of docs/shapes.md; the kernel READMEs give the
kernels' own counts, including what they recompute.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from zrl.moepp.config import MoEPPConfig

# name, dense bf16 tensor-core FLOP/s (no sparsity), fp32 FMA FLOP/s (no tensor cores), HBM bytes/s, from
# the vendor data sheets. Matched against torch.cuda.get_device_name in order: PCIe H100 before SXM.
PEAKS = (("H100 PCIe", 756e12, 51e12, 2.0e12), ("H100", 989e12, 67e12, 3.35e12), ("H200", 989e12, 67e12, 4.8e12))


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
    channel), mean skip + residual + norm + temperature ~10 C, RoPE 3 rotary (Hq + Hk); backward the
    minimum 2x (the kernel's executed backward is (k0 + 2)x on the convolutions: cca README).
    Bytes (cca README; cos and sin [T, rotary / 2] fp32 each = 4 T rotary): forward q, k read T C a,
    q, k written fp32 4 T C, doc_offset 8 T; backward T C (3 a + 12 + k1 (4 + a)) plus cos and sin.
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


def device_peaks(name: str) -> tuple[float, float, float] | None:
    """(dense bf16 FLOP/s, fp32 FLOP/s, memory bytes/s) of a CUDA device name; None when unknown."""
    for key, *peaks in PEAKS:
        if key in name:
            return tuple(peaks)
    return None


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
