"""Launches and memory traffic of the CCA preconditioner's three paths, forward and backward, counted on
CPU: what each would launch on a GPU and the bytes those launches move, and the time that traffic and
the fp32 products take at the H200's data-sheet rates.

  python bench/cca_traffic.py [--tokens 4096] [--scale-to 65536] [--out bench/results/cca-traffic-cpu-DATE.md]

A dispatch mode sees every aten op the paths run, autograd's backward included (the same calls on any
device). Each op that is not a view counts as one launch moving the bytes of its tensor inputs and
outputs (a broadcast or sliced input at most its storage). The Triton path's four kernels are
not aten ops: their launches are counted where they are made, with the bytes of every tensor argument
(each read or written once: re-reads of a neighbour row or of a query head within a program are taken
as cache hits). Views and allocations move nothing; a fill writes its output only. Bytes grow linearly
in the tokens, so a count at `--tokens` is scaled to `--scale-to` (the weights' few MB scale too: at the
default 4,096 tokens an overcount of ~1%).

Paths (zrl/moepp/kernels/cca): "reference" (cuDNN convolutions over a padded stream, PyTorch ops after
them), "library" (the convolutions as shifted sums and one batched GEMM, the same PyTorch ops after),
"triton" (the grouped convolution as the same GEMM, everything around it in Triton: triton_kernel.py).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import functools
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton epilogue on CPU
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.utils._pytree  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402

from roofline import ROOFLINE  # noqa: E402
from zrl.modeling.kernels import use_backend  # noqa: E402
from zrl.modeling.kernels.gemm_count import GemmCounter  # noqa: E402
from zrl.modeling.packing import build_layout  # noqa: E402
from zrl.modeling.rope import rope_cos_sin  # noqa: E402
from zrl.moepp.kernels.cca import cca_precondition, library, reference, triton_kernel  # noqa: E402

ZAYA1 = dict(hq=8, hk=2, d=128, k0=2, k1=2, rotary=64)
PATHS = ("reference", "library", "triton")
TRITON_KERNELS = ("_taps_fwd_kernel", "_fwd_kernel", "_bwd_kernel", "_taps_bwd_kernel")
aten = torch.ops.aten
NO_TRAFFIC = {aten.detach, aten._unsafe_view, aten.empty_like, aten.new_empty, aten.empty, aten.empty_strided,
              aten.new_empty_strided, aten.lift_fresh}  # views in all but name, and allocations
WRITE_ONLY = {aten.zeros, aten.new_zeros, aten.zeros_like, aten.ones_like, aten.full, aten.new_full,
              aten.fill_, aten.zero_, aten.arange}  # they write their output and read nothing


def _bytes(t: torch.Tensor) -> int:
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


class Traffic(TorchDispatchMode):
    """launches, bytes and the launches' names per phase ("fwd" / "bwd", set by the caller) of every aten op
    that is not a view or an allocation."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "fwd"
        self.launches: collections.Counter[str] = collections.Counter()
        self.bytes: collections.Counter[str] = collections.Counter()
        self.names: dict[str, list[str]] = collections.defaultdict(list)

    def add(self, name: str, tensors: list) -> None:
        self.launches[self.phase] += 1
        self.bytes[self.phase] += sum(_bytes(t) for t in tensors if isinstance(t, torch.Tensor))
        self.names[self.phase].append(name)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        packet = func.overloadpacket
        if not func.is_view and packet not in NO_TRAFFIC:
            moved = out if packet in WRITE_ONLY else (args, kwargs, out)
            self.add(packet.__name__, torch.utils._pytree.tree_leaves(moved))
        return out


class _CountedLaunch:
    """Stands in for a Triton kernel object: `kernel[grid](*args)` records one launch and its tensors' bytes."""

    def __init__(self, name: str, kernel, traffic: Traffic) -> None:
        self.name, self.kernel, self.traffic = name, kernel, traffic

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.traffic.add(self.name, list(args))
            with _disable_current_modes():  # the interpreter's own copies
                return self.kernel[grid](*args, **kwargs)
        return launch


def measure(path: str, tokens: int, doc_len: int = 1024, seed: int = 0, shape: dict = ZAYA1) -> dict:
    """One forward and backward of `path` on `tokens` tokens in documents of `doc_len`: launches, bytes and
    launch names per phase, and the GEMM FLOPs."""
    s = shape
    gen = torch.Generator().manual_seed(seed)
    c = (s["hq"] + s["hk"]) * s["d"]
    lens = [doc_len] * (tokens // doc_len) + ([tokens % doc_len] if tokens % doc_len else [])
    cu_seqlens = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    layout = build_layout(tokens, device=torch.device("cpu"), cu_seqlens=cu_seqlens)
    cos, sin = rope_cos_sin(layout.positions, s["rotary"], 10_000.0)

    def leaf(*shape, scale=1.0, dtype=torch.float32):
        return (scale * torch.randn(*shape, generator=gen)).to(dtype).requires_grad_()

    q, k = leaf(tokens, s["hq"] * s["d"], dtype=torch.bfloat16), leaf(tokens, s["hk"] * s["d"], dtype=torch.bfloat16)
    params = [leaf(c, 1, s["k0"], scale=0.5), leaf(c, scale=0.1), leaf(c, s["d"], s["k1"], scale=0.05),
              leaf(c, scale=0.1), leaf(s["hk"], scale=0.1)]
    args = (q, k, *params, layout.doc_offset, cos, sin, s["hq"], s["hk"], s["d"])
    traffic, gemms = Traffic(), GemmCounter()
    saved = {name: getattr(triton_kernel, name) for name in TRITON_KERNELS}
    for name, kernel in saved.items():
        setattr(triton_kernel, name, _CountedLaunch(name, kernel, traffic))
    try:
        with use_backend("triton" if path == "triton" else "reference"), gemms, traffic:
            if path == "library":
                outs = reference.cca_precondition(*args, convs=library.causal_convs)
            else:
                outs = cca_precondition(*args, num_docs=layout.num_docs) if path == "reference" else \
                    cca_precondition(*args)
            traffic.phase = "bwd"
            with _disable_current_modes():
                grads_out = [torch.ones_like(o) for o in outs]
            torch.autograd.grad(outs, [q, k, *params], grads_out)
    finally:
        for name, kernel in saved.items():
            setattr(triton_kernel, name, kernel)
    return dict(launches=dict(traffic.launches), bytes=dict(traffic.bytes), names=dict(traffic.names),
                gemm_flops=gemms.total_flops)


def report(tokens: int, scale_to: int, results: dict[str, dict]) -> str:
    k = scale_to / tokens
    hbm, fp32 = ROOFLINE["hbm_tbs"] * 1e12, ROOFLINE["fp32_tflops"] * 1e12
    lines = [
        f"| path | launches fwd / bwd | GB fwd / bwd at {scale_to:,} tokens | bytes ms at {ROOFLINE['hbm_tbs']} TB/s | "
        f"fp32 GEMM ms at {ROOFLINE['fp32_tflops']:.0f} TFLOP/s | floor ms fwd+bwd |",
        "|---|---|---|---|---|---|"]
    for path, r in results.items():
        b = {p: r["bytes"].get(p, 0) * k for p in ("fwd", "bwd")}
        byte_ms = (b["fwd"] + b["bwd"]) / hbm * 1e3
        gemm_ms = r["gemm_flops"] * k / fp32 * 1e3
        lines.append(f"| {path} | {r['launches'].get('fwd', 0)} / {r['launches'].get('bwd', 0)} | "
                     f"{b['fwd'] / 1e9:.2f} / {b['bwd'] / 1e9:.2f} | {byte_ms:.2f} | {gemm_ms:.2f} | "
                     f"{byte_ms + gemm_ms:.2f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--scale-to", type=int, default=65536)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    torch.manual_seed(0)
    results = {path: measure(path, a.tokens) for path in PATHS}
    table = report(a.tokens, a.scale_to, results)
    text = (f"# CCA preconditioner: launches and traffic per path ({datetime.date.today()}, counted on CPU)\n\n"
            f"`python bench/cca_traffic.py --tokens {a.tokens} --scale-to {a.scale_to}`; ZAYA1-8B shape {ZAYA1}, "
            f"bf16 q/k, documents of 1,024 tokens. Floor = bytes at the data-sheet bandwidth + the fp32 "
            f"GEMM FLOPs at the data-sheet fp32 rate (no overlap assumed).\n\n{table}\n")
    print(text)
    if a.out:
        a.out.write_text(text)


if __name__ == "__main__":
    main()
