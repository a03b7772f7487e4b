"""The LM head's GEMM launches per chunk, unfused (library.py) against fused with the loss (fused.py), and
the fused head's accuracy against float64 for each order of its gradient sums.

  python bench/lm_head_gemm_count.py [--device-label "CPU (2-core box)"] [--vocab 8320]

Counts come from a dispatch mode (zrl.modeling.kernels.gemm_count) around forward + backward: the same
aten calls run on any device, so a CPU run gives the GPU's counts. "GEMM-eq" is FLOPs / (2 c V D), the
head's work in units of one [c, D] x [D, V] product. The accuracy table uses fp32 hidden states of
RMSNorm scale and a bf16 weight giving logits ~ N(0, 16), as the model calls the head, T = 8 and D = 2048
(the unfused op's float64 test); errors are max |result - float64| and, relative, over max |float64|.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from zrl.modeling.kernels.gemm_count import GemmCounter  # noqa: E402
from zrl.modeling.kernels.lm_logprobs.fused import FusedFp32Products, FusedSplitProducts, fused_head_loss  # noqa: E402
from zrl.modeling.kernels.lm_logprobs.library import token_logprobs_library  # noqa: E402


def weighted_logprob(upstream: torch.Tensor):
    """The token function of L = sum_t u_t log p_t (a smooth loss: its float64 gradient is well defined)."""
    def token_grad(rows, logprob, entropy):
        u = upstream[rows].to(logprob.dtype)
        return u * logprob, u, None
    return token_grad


def count(hidden_dtype: torch.dtype, weight_dtype: torch.dtype, chunks: int = 4, c: int = 8, d: int = 16,
          v: int = 64) -> dict[str, tuple[float, float]]:
    """Per chunk (launches, GEMM-equivalents) of: unfused forward, unfused backward, fused forward, fused backward."""
    gen = torch.Generator().manual_seed(0)
    t = chunks * c
    hidden = torch.randn(t, d, generator=gen).to(hidden_dtype)
    weight = torch.randn(v, d, generator=gen).to(weight_dtype)
    targets = torch.randint(0, v, (t,), generator=gen)
    upstream = torch.randn(t, generator=gen)
    unit = 2.0 * c * v * d
    out = {}
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with GemmCounter() as fwd:
        lp = token_logprobs_library(h, w, targets, chunk_tokens=c, with_entropy=False)[0]
    with GemmCounter() as bwd:
        (lp * upstream).sum().backward()
    out["unfused fwd"], out["unfused bwd"] = [(k.total_launches / chunks, k.total_flops / unit / chunks)
                                              for k in (fwd, bwd)]
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with GemmCounter() as fwd:
        loss = fused_head_loss(h, w, targets, weighted_logprob(upstream), products=FusedSplitProducts,
                               chunk_tokens=c)[0]
    with GemmCounter() as bwd:
        loss.backward()
    out["fused fwd"], out["fused bwd"] = [(k.total_launches / chunks, k.total_flops / unit / chunks)
                                          for k in (fwd, bwd)]
    return out


def accuracy(v: int, t: int = 8, d: int = 2048) -> list[tuple[str, float, float, float, float, float]]:
    """Rows (name, logprob error, dh error, dh relative, dW error, dW relative) against float64."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(t, d, generator=gen)
    weight = (torch.randn(v, d, generator=gen) * 4 / math.sqrt(d)).bfloat16()
    targets = torch.randint(0, v, (t,), generator=gen)
    upstream = torch.randn(t, generator=gen)
    z = hidden.double() @ weight.double().t()
    logp = torch.log_softmax(z, dim=-1)
    exact_lp = logp.gather(1, targets[:, None])[:, 0]
    grad_z = -logp.exp() * upstream.double()[:, None]
    grad_z[torch.arange(t), targets] += upstream.double()
    exact_dh, exact_dw = grad_z @ weight.double(), grad_z.t() @ hidden.double()
    rows = []

    def record(name, lp, dh, dw):
        e_dh, e_dw = (dh.double() - exact_dh).abs().max().item(), (dw.double() - exact_dw).abs().max().item()
        rows.append((name, (lp.double() - exact_lp).abs().max().item(), e_dh, e_dh / exact_dh.abs().max().item(),
                     e_dw, e_dw / exact_dw.abs().max().item()))

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp = token_logprobs_library(h, w, targets, chunk_tokens=None, with_entropy=False)[0]
    (lp * upstream).sum().backward()
    record("unfused library (dh order 2, dW order 1)", lp.detach(), h.grad, w.grad)
    variants = [("fused fp32 reference products", FusedFp32Products)]
    for dh_order in (0, 1, 2):
        for dw_order in (0, 1):
            name = f"fused split, dh order {dh_order}, dW order {dw_order}"
            variants.append((name, functools.partial(FusedSplitProducts, grad_hidden_order=dh_order,
                                                     grad_weight_order=dw_order)))
    for name, products in variants:
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss, lp, _ = fused_head_loss(h, w, targets, weighted_logprob(upstream), products=products, chunk_tokens=t)
        loss.backward()
        record(name, lp, h.grad, w.grad)
    # for scale: the exact results rounded once to bf16
    rows.append(("float64 results rounded to bf16 (scale)", math.nan,
                 (exact_dh.bfloat16().double() - exact_dh).abs().max().item(),
                 (exact_dh.bfloat16().double() - exact_dh).abs().max().item() / exact_dh.abs().max().item(),
                 (exact_dw.bfloat16().double() - exact_dw).abs().max().item(),
                 (exact_dw.bfloat16().double() - exact_dw).abs().max().item() / exact_dw.abs().max().item()))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device-label", default="CPU")
    ap.add_argument("--vocab", type=int, default=4 * 2048 + 128)
    args = ap.parse_args(argv)
    lines = [f"# LM head: GEMMs per chunk and accuracy of the fused head ({datetime.date.today()}, "
             f"{args.device_label}, torch {torch.__version__})", "",
             "## GEMM launches per chunk (forward + backward, dispatch-mode count)", "",
             "| hidden / weight | path | fwd launches | bwd launches | total launches | GEMM-eq (2 c V D) |",
             "|---|---|---|---|---|---|"]
    for hd, wd in ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)):
        counts = count(hd, wd)
        label = f"{str(hd).removeprefix('torch.')} / {str(wd).removeprefix('torch.')}"
        for path in ("unfused", "fused"):
            (lf, ef), (lb, eb) = counts[f"{path} fwd"], counts[f"{path} bwd"]
            lines.append(f"| {label} | {path} | {lf:g} | {lb:g} | {lf + lb:g} | {ef + eb:g} |")
    lines += ["", f"## Accuracy against float64 (T = 8, D = 2048, V = {args.vocab}; logits ~ N(0, 16))", "",
              "| path | logprob | dh | dh / max|dh| | dW (bf16) | dW / max|dW| |", "|---|---|---|---|---|---|"]
    for name, lp, dh, dh_rel, dw, dw_rel in accuracy(args.vocab):
        lines.append(f"| {name} | {lp:.3g} | {dh:.3g} | {dh_rel:.3g} | {dw:.3g} | {dw_rel:.3g} |")
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
