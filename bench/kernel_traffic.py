"""Launches and memory traffic of the CCA preconditioner's, the CCA projections' and the MoE experts' paths,
forward and backward, counted on CPU: what each would launch on a GPU, the bytes those launches move, and the
time that traffic and the GEMMs take at the H200's rates.

  python bench/kernel_traffic.py [--ops cca experts cca_proj] [--tokens 1024] [--scale-to 65536]
                                 [--out bench/results/kernel-traffic-cpu-DATE.md]

A dispatch mode sees every aten op a path runs, autograd's backward included (the same calls on any
device). Each op that is not a view or an allocation counts as one launch moving the bytes of its tensor
inputs and outputs (a broadcast or sliced input at most its storage; a fill its output only). Triton
kernels are not aten ops: their launches are counted where they are made, with the bytes of every
tensor argument, each read or written once (re-reads of a neighbour row or of a query head within a
program are taken as cache hits). Bytes are a + b T in the tokens T (weights a, activations b): each
path is counted at `--tokens` and twice that, and the line through both gives the figure at `--scale-to`.

bf16_split.bf16_gemm, a cuBLAS bf16 GEMM with an fp32 result on CUDA, is counted where it is called (one
launch, its operands' and result's bytes, its FLOPs at the tensor cores' rate); CPU runs it on fp32 copies.

Paths. CCA (zrl/moepp/kernels/cca), with bf16 weights as the trainer has them: "reference" (cuDNN
convolutions over a padded stream, PyTorch ops after them), "library" (the convolutions as shifted sums
and one batched fp32 GEMM, the same PyTorch ops after), "triton" (the grouped convolution as one bf16
GEMM over the taps' three bf16 parts, everything around it in Triton), "triton fp32 weights" (the same
with fp32 weights: the GEMMs in fp32 on the FMA units). Experts
(zrl/modeling/kernels/experts, grouped_mm.py, what auto runs on Hopper): "torch glue" (the row moves
around the two grouped GEMMs as PyTorch ops), "fused glue" (as glue.py's Triton passes), "transformers"
(transformers' ZayaExperts on its grouped_mm implementation, the skip class as expert 0 with weight 0).
CCA projections (zrl/moepp/cca.py, `CCAProjection.project`, from the input norm's fp32 output): "one GEMM"
(the four weights concatenated, the input cast once), "four GEMMs" (the formulation it replaced). Layer
(zrl/moepp/model.py's DecoderLayer, bf16 weights, the fp32 stream, the previous layer's router state): "auto"
(each op as `auto` runs it on an H200, AUTO_ON_CUDA, the Triton kernels in the interpreter and
`torch._grouped_mm` on its CPU kernel), "candidates" (the same with the CCA's Triton path and the experts' fused
glue); attention is counted as bytes only (on CPU one SDPA call per document shape, FlashAttention's operands).
For the layer, `--sites` adds a table of where its bytes are moved: per function of zrl that launched them,
the backward's launches under the forward function that built their autograd node.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import inspect
import os
import re
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels on CPU
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
import torch.utils._pytree  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402
from triton.runtime.jit import KernelInterface  # noqa: E402

from moepp_kernels_work import FULL  # noqa: E402
from roofline import ROOFLINE  # noqa: E402
from zrl.modeling.kernels import use_backend  # noqa: E402
from zrl.modeling.kernels import gemm_count  # noqa: E402

SHAPES = {"cca": dict(hq=FULL.Hq, hk=FULL.Hk, d=FULL.d, k0=FULL.k0, k1=FULL.k1, rotary=FULL.rotary),
          "experts": dict(d=FULL.D, f=FULL.F, e=FULL.E),
          "cca_proj": dict(hidden_size=FULL.D, num_attention_heads=FULL.Hq, num_key_value_heads=FULL.Hk,
                           head_dim=FULL.d),
          "layer": {}}  # the layer: overrides of FULL.config()
PATHS = {"cca": ("reference", "library", "triton", "triton fp32 weights"),
         "experts": ("torch glue", "fused glue", "transformers"),
         "cca_proj": ("four GEMMs", "one GEMM"),
         "layer": ("auto", "candidates")}
aten = torch.ops.aten
NO_TRAFFIC = {aten.detach, aten._unsafe_view, aten.empty_like, aten.new_empty, aten.empty, aten.empty_strided,
              aten.new_empty_strided, aten.lift_fresh}  # views in all but name, and allocations
WRITE_ONLY = {aten.zeros, aten.new_zeros, aten.zeros_like, aten.ones_like, aten.full, aten.new_full,
              aten.fill_, aten.zero_, aten.arange}  # they write their output and read nothing
GEMMS = {packet.__name__ for packet in gemm_count.GEMMS} | {"bf16_gemm"}  # the launches that are not glue


def _bytes(t: torch.Tensor) -> int:
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


class Traffic(TorchDispatchMode):
    """Per phase ("fwd" / "bwd", set by the caller): launches, bytes, the launches' names, and the bytes of
    the launches that are not GEMMs (the glue around them)."""

    def __init__(self, sites: bool = False) -> None:
        super().__init__()
        self.phase = "fwd"
        self.launches: collections.Counter[str] = collections.Counter()
        self.bytes: collections.Counter[str] = collections.Counter()
        self.glue_bytes: collections.Counter[str] = collections.Counter()
        self.names: dict[str, list[str]] = collections.defaultdict(list)
        # with `sites`: (phase, site) -> [launches, bytes], the site from `_site` (backward: run the forward
        # under torch.autograd.set_detect_anomaly(True, check_nan=False), which records where each node was built)
        self.sites: dict[tuple[str, str], list[int]] | None = collections.defaultdict(lambda: [0, 0]) if sites else None

    def add(self, name: str, tensors: list) -> None:
        moved = sum(_bytes(t) for t in tensors if isinstance(t, torch.Tensor))
        self.launches[self.phase] += 1
        self.bytes[self.phase] += moved
        self.glue_bytes[self.phase] += 0 if name in GEMMS else moved
        self.names[self.phase].append(name)
        if self.sites is not None:
            site = self.sites[self.phase, _site(self.phase)]
            site[0] += 1
            site[1] += moved

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        packet = func.overloadpacket
        if not func.is_view and packet not in NO_TRAFFIC:
            moved = out if packet in WRITE_ONLY else (args, kwargs, out)
            self.add(packet.__name__, torch.utils._pytree.tree_leaves(moved))
        return out


def _zrl_site(frames: list[tuple[str, str]]) -> str:
    """'zrl/<path>.py:<function>' for a stack of (file, function), outermost first: of the innermost file of the zrl
    package on it, the outermost function in that file's innermost run of frames (the op's entry point, not its
    autograd Function's forward or the helper that launches); "-" when no frame is in zrl."""
    inside = [(Path(f), name) for f, name in frames if Path(f).is_relative_to(ROOT / "zrl")]
    if not inside:
        return "-"
    i = len(inside) - 1
    while i > 0 and inside[i - 1][0] == inside[-1][0]:
        i -= 1
    return f"{inside[i][0].relative_to(ROOT).as_posix()}:{inside[i][1]}"


def _site(phase: str) -> str:
    """Where the launch being counted comes from (`_zrl_site`): forward, of the stack; backward, of the forward's
    stack where the autograd node being run was built (anomaly mode records it)."""
    if phase == "fwd":
        return _zrl_site([(f.filename, f.name) for f in traceback.extract_stack()])
    node = torch._C._current_autograd_node()
    trace = "" if node is None else "".join(node.metadata.get("traceback_", ()))
    return _zrl_site(re.findall(r'File "(.+)", line \d+, in (\S+)', trace))


@contextlib.contextmanager
def counted_bf16_gemms(traffic: Traffic, flops: list[float]):
    """bf16_split.bf16_gemm (a cuBLAS bf16 GEMM with an fp32 result on CUDA; CPU runs it on fp32 copies, which
    are not the GPU's traffic) counted as one launch with its operands' and result's bytes, its FLOPs
    added to `flops[0]` (tensor-core FLOPs, apart from the GEMMs the dispatch mode sees)."""
    from zrl.modeling.kernels import bf16_split

    real = bf16_split.bf16_gemm

    def gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        with _disable_current_modes():
            out = real(a, b)
        traffic.add("bf16_gemm", [a, b, out])
        flops[0] += 2.0 * a.shape[:-1].numel() * a.shape[-1] * b.shape[-1]
        return out

    bf16_split.bf16_gemm = gemm
    try:
        yield
    finally:
        bf16_split.bf16_gemm = real


class _CountedLaunch:
    """Stands in for a Triton kernel object: `kernel[grid](*args)` records one launch and its tensors' bytes."""

    def __init__(self, name: str, kernel, traffic: Traffic) -> None:
        self.name, self.kernel, self.traffic = name, kernel, traffic

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.traffic.add(self.name, list(args))
            with _disable_current_modes():  # the interpreter's own copies are not the kernel's traffic
                return self.kernel[grid](*args, **kwargs)
        return launch


@contextlib.contextmanager
def counted_launches(module, traffic: Traffic):
    """Every Triton kernel `module` launches (`name[grid](...)` in its source) counted into `traffic` while the
    block runs. Its device functions, called from inside kernels, stay as they are."""
    source = inspect.getsource(module)
    names = [n for n, v in vars(module).items() if isinstance(v, KernelInterface) and re.search(rf"\b{n}\[", source)]
    saved = {n: getattr(module, n) for n in names}
    for n, kernel in saved.items():
        setattr(module, n, _CountedLaunch(n, kernel, traffic))
    try:
        yield
    finally:
        for n, kernel in saved.items():
            setattr(module, n, kernel)


def _cca(path: str, tokens: int, shape: dict, gen: torch.Generator):
    """(run, leaves) of the CCA preconditioner on `tokens` tokens in documents of 1,024."""
    from zrl.modeling.packing import build_layout
    from zrl.modeling.rope import rope_cos_sin
    from zrl.moepp.kernels.cca import cca_precondition, library, reference

    s = shape
    c = (s["hq"] + s["hk"]) * s["d"]
    lens = [1024] * (tokens // 1024) + ([tokens % 1024] if tokens % 1024 else [])
    layout = build_layout(tokens, device=torch.device("cpu"),
                          cu_seqlens=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]))
    cos, sin = rope_cos_sin(layout.positions, s["rotary"], 10_000.0)

    def leaf(*size, scale=1.0, dtype=torch.float32):
        return (scale * torch.randn(*size, generator=gen)).to(dtype).requires_grad_()

    weights = torch.float32 if path == "triton fp32 weights" else torch.bfloat16  # bf16: the trainer's
    leaves = [leaf(tokens, s["hq"] * s["d"], dtype=torch.bfloat16), leaf(tokens, s["hk"] * s["d"], dtype=torch.bfloat16),
              leaf(c, 1, s["k0"], scale=0.5, dtype=weights), leaf(c, scale=0.1, dtype=weights),
              leaf(c, s["d"], s["k1"], scale=0.05, dtype=weights), leaf(c, scale=0.1, dtype=weights),
              leaf(s["hk"], scale=0.1, dtype=weights)]
    args = (*leaves, layout.doc_offset, cos, sin, s["hq"], s["hk"], s["d"])

    def run():
        if path == "library":
            return reference.cca_precondition(*args, convs=library.causal_convs)
        with use_backend(path.split()[0]):
            return cca_precondition(*args, num_docs=layout.num_docs)

    return run, leaves


def _experts(path: str, tokens: int, shape: dict, gen: torch.Generator):
    """(run, leaves) of the experts on `tokens` tokens, ~1/17 of them in the skip class (uniform ids)."""
    from zrl.modeling.kernels.experts.grouped_mm import moe_experts_grouped_mm

    d, f, e = shape["d"], shape["f"], shape["e"]
    x = torch.randn(tokens, d, generator=gen).bfloat16().requires_grad_()
    ids = torch.randint(0, e + 1, (tokens,), generator=gen)
    gate = torch.rand(tokens, generator=gen).requires_grad_()
    gate_up = (0.02 * torch.randn(e, 2 * f, d, generator=gen)).bfloat16().requires_grad_()
    down = (0.02 * torch.randn(e, d, f, generator=gen)).bfloat16().requires_grad_()
    if path != "transformers":
        return (lambda: moe_experts_grouped_mm(x, ids, gate, gate_up, down, fused_glue=path == "fused glue"),
                [x, gate, gate_up, down])
    import transformers.models.zaya.modeling_zaya as hf

    config = {k: v for k, v in FULL.config().to_hf_dict().items() if k not in ("architectures", "model_type")}
    experts = hf.ZayaExperts(hf.ZayaConfig(**{**config, "hidden_size": d, "moe_intermediate_size": f,
                                              "num_experts": e}))
    experts.load_state_dict({"gate_up_proj": gate_up.detach(), "down_proj": down.detach()})
    experts = experts.to(torch.bfloat16)
    experts.config._experts_implementation = "grouped_mm"
    hf_ids, hf_gate = torch.where(ids == e, 0, ids)[:, None], torch.where(ids == e, 0.0, gate)[:, None]
    return lambda: experts(x, hf_ids, hf_gate), [x, *experts.parameters()]


def _cca_proj(path: str, tokens: int, shape: dict, gen: torch.Generator):
    """(run, leaves) of the CCA's four projections (q, k, v current, v delayed) of `tokens` fp32 inputs (the input
    norm's output), bf16 weights: "one GEMM" is CCAProjection.project; "four GEMMs" its formulation before
    2026-11-29, each projection casting the input itself, autograd summing the four input gradients."""
    from zrl.modeling.blocks import linear
    from zrl.modeling.packing import build_layout
    from zrl.moepp.cca import CCAProjection

    proj = CCAProjection(dataclasses.replace(FULL.config(), attention_bias=False, **shape)).to(torch.bfloat16)
    projections = (proj.q_proj, proj.k_proj, proj.v_proj_current, proj.v_proj_delayed)
    x = torch.randn(tokens, shape["hidden_size"], generator=gen).requires_grad_()
    leaves = [x, *(p.weight for p in projections)]
    layout = build_layout(tokens, device=torch.device("cpu"), cu_seqlens=torch.tensor([0, tokens]))
    if path == "one GEMM":
        return lambda: proj.project(x, layout), leaves

    def four() -> tuple[torch.Tensor, ...]:
        q, k, v_current, v_all = (linear(x, p) for p in projections)
        v_delayed = torch.where(layout.doc_start[:, None], 0.0, torch.roll(v_all, 1, dims=0))
        return q, k, torch.cat([v_current, v_delayed], dim=-1).view(tokens, -1, proj.head_dim)

    return four, leaves


@contextlib.contextmanager
def as_on_cuda(choices: dict[str, str], fused_glue: bool):
    """Each kernel op dispatched as `choices` says (op -> backend), whatever the device: the Triton kernels in
    the interpreter, `torch._grouped_mm` on its CPU kernel; the experts' glue fused or not."""
    from zrl.modeling import kernels
    from zrl.modeling.kernels.experts import grouped_mm

    saved = kernels.resolve, grouped_mm.unsupported_reason, grouped_mm.FUSED_GLUE
    kernels.resolve = lambda op, x: choices[op]
    grouped_mm.unsupported_reason = lambda *args: None
    grouped_mm.FUSED_GLUE = fused_glue
    try:
        yield
    finally:
        kernels.resolve, grouped_mm.unsupported_reason, grouped_mm.FUSED_GLUE = saved


def _layer(path: str, tokens: int, shape: dict, gen: torch.Generator):
    """(run, leaves) of one MoE++ decoder layer with the model's initial values (layer 1: it takes the previous
    layer's router state) on `tokens` tokens in documents of 1,024, bf16 weights, the fp32 stream."""
    from moepp_kernels_groups import init_layer
    from zrl.modeling.kernels import AUTO_ON_CUDA
    from zrl.modeling.packing import build_layout
    from zrl.modeling.rope import rope_cos_sin
    from zrl.moepp.model import DecoderLayer

    config = dataclasses.replace(FULL.config(), **shape)
    with torch.random.fork_rng():  # the layer's initial values from `gen`, the global generator left as it was
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
        layer = DecoderLayer(config, 1)
        init_layer(layer)
    layer = layer.to(torch.bfloat16)
    x = torch.randn(tokens, config.hidden_size, generator=gen).requires_grad_()
    state = torch.randn(tokens, config.router_hidden_size, generator=gen).requires_grad_()
    lens = [1024] * (tokens // 1024) + ([tokens % 1024] if tokens % 1024 else [])
    layout = build_layout(tokens, device=torch.device("cpu"),
                          cu_seqlens=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]))
    rope = rope_cos_sin(layout.positions, config.rotary_dim, config.rope_theta)
    choices = {**AUTO_ON_CUDA, "cca": "triton"} if path == "candidates" else dict(AUTO_ON_CUDA)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        with as_on_cuda(choices, fused_glue=path == "candidates"):
            out, routing = layer(x, state, layout, rope)
        return out, routing.state

    return run, [x, state, *layer.parameters()]


BUILDERS = {"cca": _cca, "experts": _experts, "cca_proj": _cca_proj, "layer": _layer}


def count(op: str, path: str, tokens: int, shape: dict | None = None, seed: int = 0, sites: bool = False) -> dict:
    """One forward and backward of `op`'s `path` on `tokens` tokens: launches, bytes, glue bytes and launch
    names per phase, the GEMM FLOPs and, with `sites`, {(phase, site): [launches, bytes]}."""
    from zrl.modeling.kernels.experts import glue
    from zrl.modeling.kernels.residual_norm import triton_kernel as residual_norm
    from zrl.moepp.kernels.cca import triton_kernel as cca
    from zrl.moepp.kernels.router import triton_kernel as router

    gen = torch.Generator().manual_seed(seed)
    run, leaves = BUILDERS[op](path, tokens, shape if shape is not None else SHAPES[op], gen)
    traffic, gemms, bf16_flops = Traffic(sites), gemm_count.GemmCounter(), [0.0]
    with contextlib.ExitStack() as stack:
        for module in (cca, glue, residual_norm, router):
            stack.enter_context(counted_launches(module, traffic))
        for context in (counted_bf16_gemms(traffic, bf16_flops), gemms, traffic,
                        torch.autograd.set_detect_anomaly(sites, check_nan=False)):
            stack.enter_context(context)
        out = run()
        outs = out if isinstance(out, tuple) else (out,)
        traffic.phase = "bwd"
        with _disable_current_modes():
            grads_out = [torch.ones_like(o) for o in outs]
        torch.autograd.grad(outs, leaves, grads_out)
    return dict(launches=dict(traffic.launches), bytes=dict(traffic.bytes), glue_bytes=dict(traffic.glue_bytes),
                names=dict(traffic.names), gemm_flops=gemms.total_flops, bf16_gemm_flops=bf16_flops[0],
                sites=dict(traffic.sites or {}))


def at(tokens: int, small: dict, large: dict, small_tokens: int) -> Callable[[str, str], float]:
    """The line through two counts (at small_tokens and twice that) read at `tokens`: value(key, phase)."""
    def value(key: str, phase: str) -> float:
        a, b = small[key].get(phase, 0), large[key].get(phase, 0)
        return a + (b - a) * (tokens - small_tokens) / small_tokens
    return value


def report(op: str, tokens: int, scale_to: int, counts: dict[str, tuple[dict, dict]]) -> str:
    hbm, bf16 = ROOFLINE["hbm_tbs"] * 1e12, ROOFLINE["gemm_tflops"] * 1e12
    # the GEMMs the dispatch mode sees: the CCA's are fp32 (CCA_STATE; FMA units), the experts' bf16 (tensor
    # cores); bf16_split's GEMMs (the CCA's with bf16 weights) are bf16 on the tensor cores
    rate = ROOFLINE["fp32_tflops"] * 1e12 if op == "cca" else bf16
    lines = [f"| path | launches fwd / bwd | GB fwd / bwd | glue GB fwd / bwd | bytes ms at {ROOFLINE['hbm_tbs']} "
             f"TB/s | GEMM TFLOP fp32 / bf16 | GEMM ms | floor ms fwd+bwd |", "|---|---|---|---|---|---|---|---|"]
    for path, (small, large) in counts.items():
        v = at(scale_to, small, large, tokens)
        gb = {p: v("bytes", p) / 1e9 for p in ("fwd", "bwd")}
        glue = {p: v("glue_bytes", p) / 1e9 for p in ("fwd", "bwd")}
        byte_ms = (gb["fwd"] + gb["bwd"]) * 1e9 / hbm * 1e3
        seen, split = (small[key] * scale_to / tokens for key in ("gemm_flops", "bf16_gemm_flops"))
        fp32_flops, bf16_flops = (seen, split) if rate != bf16 else (0.0, seen + split)
        gemm_ms = (fp32_flops / rate + bf16_flops / bf16) * 1e3
        lines.append(f"| {path} | {small['launches'].get('fwd', 0)} / {small['launches'].get('bwd', 0)} | "
                     f"{gb['fwd']:.2f} / {gb['bwd']:.2f} | {glue['fwd']:.2f} / {glue['bwd']:.2f} | {byte_ms:.2f} | "
                     f"{fp32_flops / 1e12:.3f} / {bf16_flops / 1e12:.3f} | {gemm_ms:.2f} | {byte_ms + gemm_ms:.2f} |")
    return "\n".join(lines)


def site_report(tokens: int, scale_to: int, small: dict, large: dict) -> str:
    """Per site of one path's counts (at `tokens` and twice that): launches and GB at `scale_to`, most first."""
    def gb(phase: str, site: str) -> float:
        a, b = (c["sites"].get((phase, site), (0, 0))[1] for c in (small, large))
        return (a + (b - a) * (scale_to - tokens) / tokens) / 1e9

    sites = {site for _, site in small["sites"]} | {site for _, site in large["sites"]}
    rows = sorted(sites, key=lambda site: -(gb("fwd", site) + gb("bwd", site)))
    lines = ["| site | launches fwd / bwd | GB fwd / bwd |", "|---|---|---|"]
    for site in rows:
        n = [small["sites"].get((phase, site), (0, 0))[0] for phase in ("fwd", "bwd")]
        lines.append(f"| `{site}` | {n[0]} / {n[1]} | {gb('fwd', site):.2f} / {gb('bwd', site):.2f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", nargs="+", choices=tuple(PATHS), default=list(PATHS))
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--scale-to", type=int, default=65536)
    p.add_argument("--sites", action="store_true", help="the layer's bytes per zrl function that moves them")
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    sections = []
    for op in a.ops:
        sites = a.sites and op == "layer"
        counts = {path: tuple(count(op, path, t, sites=sites) for t in (a.tokens, 2 * a.tokens)) for path in PATHS[op]}
        shape = SHAPES[op] or "(the model's)"
        sections.append(f"## {op}, ZAYA1-8B shape {shape}, at {a.scale_to:,} tokens\n\n"
                        f"{report(op, a.tokens, a.scale_to, counts)}\n")
        for path, (small, large) in counts.items() if sites else ():
            sections.append(f"### {op} {path}: where the bytes are moved, at {a.scale_to:,} tokens\n\n"
                            f"{site_report(a.tokens, a.scale_to, small, large)}\n")
    ops = " ".join(a.ops)
    text = (f"# Kernel launches and traffic per path ({datetime.date.today()}, counted on CPU)\n\n"
            f"`python bench/kernel_traffic.py --ops {ops} --tokens {a.tokens} --scale-to {a.scale_to}"
            f"{' --sites' if a.sites else ''}`; bf16 "
            f"activations (CCA: q/k; experts: x and the weights; CCA projections: fp32 input, bf16 weights; layer: "
            f"bf16 weights, the fp32 stream), documents of 1,024 tokens. Glue = the "
            f"launches that are not GEMMs. Floor = bytes at the data-sheet bandwidth + GEMM FLOPs, fp32 ones at "
            f"{ROOFLINE['fp32_tflops']:.0f} TFLOP/s (FMA units, data sheet) and bf16 ones at "
            f"{ROOFLINE['gemm_tflops']:.0f} (tensor cores, the measured 8192^3 GEMM), no overlap assumed.\n\n"
            + "\n".join(sections))
    print(text)
    if a.out:
        a.out.write_text(text)


if __name__ == "__main__":
    main()
