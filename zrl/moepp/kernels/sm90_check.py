"""Compile every Triton kernel of zrl.moepp.kernels for sm_90a (H100/H200) on a machine without a GPU.

Responsibility: catch what Triton's CPU interpreter cannot (tl.dot shape/dtype rules, constexpr misuse,
lowering errors, ptxas failures) and report each kernel's registers, spills and shared memory, in the
specialisations the launchers really produce at the ZAYA1-8B shapes.

How: each public launcher runs on `meta` tensors (shapes and dtypes, no storage) with
`KernelInterface.__getitem__` patched to record the launch instead of running it; forward and
backward are both driven (autograd on meta tensors). Every recorded launch then goes through the
runtime's own binder (`create_function_from_signature`, `_pack_args`: the same argument typing,
divisibility-by-16 and ==1 specialisation as a real launch; meta tensors have data_ptr 0, i.e. the
16-byte alignment a fresh CUDA allocation has) and `triton.compile` for GPUTarget("cuda", 90, 32).
Registers and spills come from ptxas's -v log (Triton's `dump_ptxas_log` knob; n_regs/n_spills of a
CompiledKernel are only filled when a GPU loads the binary), shared memory from the metadata.

Invariants: the kernel modules must be imported in a process where TRITON_INTERPRET is unset (Triton
fixes interpreted-vs-compiled when a kernel is decorated); `run_all` raises if they are not. The
Triton cache goes to a temporary directory and every kernel is compiled afresh (the log of a cache
hit would be empty). Run: `python -m zrl.moepp.kernels.sm90_check` (prints the table).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import torch

logger = logging.getLogger(__name__)

# ZAYA1-8B shapes (docs/shapes.md letters): D hidden, E experts (+1 skip class), F expert FFN,
# R router latent, Hq/Hk/d heads, k0/k1 CCA kernel sizes, rotary_dim = d / 2, V vocabulary.
ZAYA1 = dict(D=2048, E=16, F=2048, R=256, HQ=8, HK=2, HEAD_DIM=128, K0=2, K1=2, ROTARY=64, V=262_272)
# Shared memory one block of an sm_90 GPU may use (227 KiB, H100 and H200): a kernel asking more
# compiles but raises OutOfResources at its first launch, so it counts as a failure here.
MAX_SHARED = 232_448
TOKENS = 4096  # T of a microbatch; a multiple of 16, so T gets the runtime's divisibility specialisation

_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


@dataclasses.dataclass
class Launch:
    kernel: object  # triton JITFunction
    args: tuple
    kwargs: dict


@dataclasses.dataclass
class Result:
    kernel: str  # "<op>.<kernel function>"
    variant: str  # dtypes / mode of the launch that produced it
    ok: bool
    error: str = ""
    n_regs: int = 0
    spill_stores: int = 0  # bytes
    spill_loads: int = 0  # bytes
    stack: int = 0  # bytes of stack frame
    shared: int = 0  # bytes of shared memory
    num_warps: int = 0
    num_stages: int = 0
    seconds: float = 0.0

    @property
    def n_spills(self) -> int:
        return self.spill_stores + self.spill_loads


def ptxas_path() -> str | None:
    """The ptxas Triton would run for sm_90a, or None when it is not there."""
    try:
        from triton import knobs
        path = knobs.nvidia.ptxas.path
    except Exception as err:  # noqa: BLE001 - any failure to locate it means "not available"
        logger.info("no ptxas: %s", err)
        return None
    return path if path and os.access(path, os.X_OK) else None


@contextlib.contextmanager
def _recording() -> Iterator[list[Launch]]:
    """Patch `kernel[grid](...)` to record the launch instead of running it."""
    import triton

    launches: list[Launch] = []
    previous = triton.KernelInterface.__getitem__

    def getitem(kernel, grid):
        def record(*args, **kwargs):
            launches.append(Launch(kernel, args, kwargs))
        return record

    triton.KernelInterface.__getitem__ = getitem
    try:
        yield launches
    finally:
        triton.KernelInterface.__getitem__ = previous


def _meta(*shape: int, dtype: torch.dtype, grad: bool = False) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta", requires_grad=grad)


def _backward(outputs: tuple[torch.Tensor, ...], inputs: list[torch.Tensor]) -> None:
    outs = [o for o in outputs if o.requires_grad]
    torch.autograd.grad(outs, [i for i in inputs if i.requires_grad], [torch.empty_like(o) for o in outs],
                        allow_unused=True)


def _drive_experts(dtype: torch.dtype) -> None:
    from zrl.moepp.kernels.experts.triton_kernel import KernelConfig, moe_experts_triton

    z, t = ZAYA1, TOKENS
    cfg = KernelConfig.for_device(torch.device("cuda"), dtype)
    x = _meta(t, z["D"], dtype=dtype, grad=True)
    ids = _meta(t, dtype=torch.int64)
    gate = _meta(t, dtype=torch.float32, grad=True)
    w_gu = _meta(z["E"], 2 * z["F"], z["D"], dtype=dtype, grad=True)
    w_down = _meta(z["E"], z["D"], z["F"], dtype=dtype, grad=True)
    _backward((moe_experts_triton(x, ids, gate, w_gu, w_down, config=cfg),), [x, gate, w_gu, w_down])
    with torch.no_grad():  # inference path: SAVE_GU=False
        moe_experts_triton(x, ids, gate, w_gu, w_down, config=cfg)


def _drive_router(dtype: torch.dtype) -> None:
    from zrl.moepp.kernels.router.triton_kernel import route

    z, t, r = ZAYA1, TOKENS, ZAYA1["R"]
    c = z["E"] + 1
    # norm weight, fc1 weight/bias, fc2 weight/bias, out weight
    weights = [_meta(*shape, dtype=dtype, grad=True) for shape in ((r,), (r, r), (r,), (r, r), (r,), (c, r))]
    x = _meta(t, r, dtype=dtype, grad=True)
    bias = _meta(c, dtype=torch.float32)
    gate, _, _ = route(x, *weights, bias, None, 1e-6)
    _backward((gate,), [x, *weights])
    route(x, *weights, bias, _meta(t, dtype=torch.int64), 1e-6)  # replay variant of the forward


def _drive_residual_norm(dtype: torch.dtype) -> None:
    from zrl.moepp.kernels.residual_norm.triton_kernel import rms_norm, scaled_residual_add_rmsnorm

    t, d = TOKENS, ZAYA1["D"]
    branch = _meta(t, d, dtype=dtype, grad=True)
    residual = _meta(t, d, dtype=torch.float32, grad=True)  # the residual stream is fp32
    params = [_meta(d, dtype=dtype, grad=True) for _ in range(5)]  # FSDP2 mixed precision: compute dtype
    x, normed = scaled_residual_add_rmsnorm(branch, residual, *params, 1e-6)
    _backward((x, normed), [branch, residual, *params])
    x, _ = scaled_residual_add_rmsnorm(branch, residual, *params[:4], None, 0.0)
    _backward((x,), [branch, residual, *params[:4]])
    normed = rms_norm(residual, params[4], 1e-6)
    _backward((normed,), [residual, params[4]])


def _drive_cca(dtype: torch.dtype) -> None:
    from zrl.moepp.kernels.cca.triton_kernel import cca_precondition

    z, t = ZAYA1, TOKENS
    hq, hk, d = z["HQ"], z["HK"], z["HEAD_DIM"]
    c = (hq + hk) * d
    q = _meta(t, hq * d, dtype=dtype, grad=True)
    k = _meta(t, hk * d, dtype=dtype, grad=True)
    # Conv parameters in the compute dtype: the launcher casts them to fp32 (an autograd op).
    params = [_meta(c, 1, z["K0"], dtype=dtype, grad=True), _meta(c, dtype=dtype, grad=True),
              _meta(c, d, z["K1"], dtype=dtype, grad=True), _meta(c, dtype=dtype, grad=True),
              _meta(hk, dtype=dtype, grad=True)]
    rope = [_meta(t, z["ROTARY"] // 2, dtype=torch.float32) for _ in range(2)]
    q_out, k_out = cca_precondition(q, k, *params, _meta(t, dtype=torch.int64), *rope, hq, hk, d)
    _backward((q_out, k_out), [q, k, *params])


def _drive_lm_logprobs(hidden_dtype: torch.dtype, weight_dtype: torch.dtype) -> None:
    from zrl.moepp.kernels.lm_logprobs.triton_kernel import _uses_fp32, default_config, token_logprobs_triton

    z, t = ZAYA1, TOKENS
    hidden = _meta(t, z["D"], dtype=hidden_dtype, grad=True)
    weight = _meta(z["V"], z["D"], dtype=weight_dtype, grad=True)
    cfg = default_config(torch.device("cuda"), _uses_fp32(hidden, weight))
    for with_entropy in (False, True):
        logprob, entropy = token_logprobs_triton(hidden, weight, _meta(t, dtype=torch.int64),
                                                 with_entropy=with_entropy, config=cfg)
        _backward((logprob, entropy) if with_entropy else (logprob,), [hidden, weight])


bf16, fp32 = torch.bfloat16, torch.float32

# (op, variant label, driver): bf16 is the training dtype; fp32 wherever the launcher takes it.
DRIVERS: list[tuple[str, str, Callable[[], None]]] = [
    ("experts", "bf16", lambda: _drive_experts(bf16)),
    ("experts", "fp32", lambda: _drive_experts(fp32)),
    ("router", "bf16", lambda: _drive_router(bf16)),
    ("router", "fp32", lambda: _drive_router(fp32)),
    ("residual_norm", "bf16 branch+params", lambda: _drive_residual_norm(bf16)),
    ("residual_norm", "fp32", lambda: _drive_residual_norm(fp32)),
    ("cca", "bf16 q/k", lambda: _drive_cca(bf16)),
    ("cca", "fp32 q/k", lambda: _drive_cca(fp32)),
    ("lm_logprobs", "fp32 hidden, bf16 W", lambda: _drive_lm_logprobs(fp32, bf16)),
    ("lm_logprobs", "bf16 hidden+W", lambda: _drive_lm_logprobs(bf16, bf16)),
]


def _describe(signature: dict, constexprs: dict, kernel) -> str:
    """Short label of a specialisation: the constexprs that differ between launches of one kernel."""
    names = kernel.arg_names
    shown = {names[k[0]]: v for k, v in constexprs.items() if len(k) == 1 and not names[k[0]].startswith("BLOCK")
             and v is not None and names[k[0]] not in ("E", "E_PAD", "HQ", "HK", "D", "K0", "K1", "HALF", "SENTINEL")}
    ptr_types = sorted({v[1:] for v in signature.values() if isinstance(v, str) and v.startswith("*")})
    flags = " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in shown.items())
    return f"[{','.join(ptr_types)}] {flags}".strip()


def _error_text(err: BaseException) -> str:
    """The root cause first (a CompilationError's own text is the source excerpt), then the chain."""
    chain = [err]
    while chain[-1].__cause__ is not None:
        chain.append(chain[-1].__cause__)
    return "\n".join(f"{type(e).__name__}: {str(e).strip()}" for e in reversed(chain))


def compile_launch(launch: Launch, target) -> tuple[str, Result]:
    """Compile one recorded launch for `target`; returns (specialisation key, result)."""
    from triton import knobs
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(launch.kwargs, debug=False)
    bound_args, specialization, _ = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, None)
    key = repr((kernel.fn.__qualname__, signature, sorted(constexprs.items()), sorted(attrs.items()),
                options.num_warps, options.num_stages))
    op = kernel.fn.__module__.split(".")[-2]
    result = Result(f"{op}.{kernel.fn.__name__}", _describe(signature, constexprs, kernel), ok=False,
                    num_warps=options.num_warps, num_stages=options.num_stages)
    log = io.StringIO()
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log), knobs.nvidia.scope(), knobs.compilation.scope():
            knobs.nvidia.dump_ptxas_log = True
            knobs.compilation.always_compile = True
            compiled = compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                               options=options.__dict__)
    except Exception as err:  # noqa: BLE001 - every failure is reported per kernel, not raised
        result.error = _error_text(err)
        result.seconds = time.perf_counter() - start
        return key, result
    result.seconds = time.perf_counter() - start
    text = log.getvalue()
    logger.debug("ptxas log of %s:\n%s", result.kernel, text)
    used, spill = _PTXAS_USED.search(text), _PTXAS_SPILL.search(text)
    if used is None or spill is None:
        result.error = f"compiled, but no ptxas -v statistics in its log: {text[-400:]!r}"
        return key, result
    result.n_regs = int(used.group(1))
    result.stack, result.spill_stores, result.spill_loads = (int(g) for g in spill.groups())
    result.shared = compiled.metadata.shared
    result.ok = result.shared <= MAX_SHARED
    if not result.ok:
        result.error = (f"OutOfResources at launch: {result.shared} B of shared memory > {MAX_SHARED} B "
                        f"(sm_90 limit per block)")
    return key, result


def run_all(ops: set[str] | None = None) -> list[Result]:
    """Drive every launcher (or those of `ops`), compile each distinct launch for sm_90a."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("sm90_check needs TRITON_INTERPRET unset: with it, the kernels are interpreted "
                           "functions that cannot be compiled (run it in a fresh process without it)")
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", 90, 32)
    results: list[Result] = []
    seen: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="zrl-sm90-") as cache, knobs.cache.scope():
        knobs.cache.dir = cache
        for op, variant, drive in DRIVERS:
            if ops is not None and op not in ops:
                continue
            with _recording() as launches:
                drive()
            if not launches:
                raise RuntimeError(f"driving {op} ({variant}) launched no kernel")
            for launch in launches:
                key, result = compile_launch(launch, target)
                if key in seen:
                    continue
                seen.add(key)
                result.variant = f"{variant} {result.variant}"
                logger.info("%s %s: %s", result.kernel, result.variant, "ok" if result.ok else result.error)
                results.append(result)
    return results


def format_table(results: list[Result]) -> str:
    lines = ["| kernel | launch (pointer dtypes, switches) | warps/stages | regs | spill st/ld (B) | "
             "stack (B) | smem (KiB) | status |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        status = "ok" if r.ok else "FAIL: " + r.error.splitlines()[0][:120]
        lines.append(f"| {r.kernel} | {r.variant} | {r.num_warps}/{r.num_stages} | {r.n_regs} | "
                     f"{r.spill_stores}/{r.spill_loads} | {r.stack} | {r.shared / 1024:.1f} | {status} |")
    return "\n".join(lines)


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    if ptxas_path() is None:
        sys.stderr.write("ptxas not found: cannot compile for sm_90a\n")
        return 2
    ops = set(sys.argv[1:]) or None
    start = time.perf_counter()
    results = run_all(ops)
    sys.stdout.write(format_table(results) + "\n")
    sys.stdout.write(f"{len(results)} launches, {sum(not r.ok for r in results)} failed, "
                     f"{sum(r.n_spills > 0 for r in results)} spilling; {time.perf_counter() - start:.0f} s\n")
    for r in results:
        if not r.ok:
            sys.stdout.write(f"\n--- {r.kernel} ({r.variant}):\n{r.error}\n")
    return 1 if any(not r.ok for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
