"""Compile every Triton kernel of zrl.modeling.kernels and zrl.moepp.kernels for sm_90a (H100/H200) on a machine without a GPU.

Responsibility: catch what Triton's CPU interpreter cannot (tl.dot shape/dtype rules, constexpr misuse,
lowering errors, ptxas failures) and report each kernel's registers, spills, shared memory and tensor-core
instructions, in the specialisations the launchers really produce, at the ZAYA1-8B shapes and at every
shape the kernels' CUDA (`gpu`) tests launch (sm90_drivers.py).

How: each driver runs a public launcher on `meta` tensors (shapes and dtypes, no storage) with
`KernelInterface.__getitem__` patched to record the launch instead of running it; forward and
backward are both driven (autograd on meta tensors). Every recorded launch then goes through the
runtime's own binder (`create_function_from_signature`, `_pack_args`: the same argument typing,
divisibility-by-16 and ==1 specialisation as a real launch; a meta tensor's data_ptr is its view's
byte offset from 0: the alignment a fresh CUDA allocation and its views have), is deduplicated by that
specialisation key, and goes to
`triton.compile` for GPUTarget("cuda", 90, 32). Registers and spills come from ptxas's -v log (Triton's
`dump_ptxas_log` knob; n_regs/n_spills of a CompiledKernel are only filled when a GPU loads the
binary), shared memory from the metadata, tensor-core use from the PTX: `wgmma.mma_async` (Hopper's
warpgroup MMA) and `mma.sync` (the warp-level MMA of sm_80, which Triton emits on sm_90 for tiles too
small for wgmma) instructions, counted separately; `fma.rn.f32` counts the fp32 FMA-unit products and
`cp.async` the loads staged through shared memory (a software-pipelined loop's).
tl.dot is held to Triton 3.6's minimum sizes (K >= 16), stricter than the installed 3.9's for fp32.

Compiles run in a pool of spawned worker processes (one per CPU, at most 8; each compile is
single-threaded), which import the kernel modules themselves.

Invariants: the kernel modules must be imported in a process where TRITON_INTERPRET is unset (Triton
fixes interpreted-vs-compiled when a kernel is decorated); `run_all` raises if they are not (the workers
inherit the environment). The Triton cache goes to a temporary directory and every kernel is compiled
afresh (the log of a cache hit would be empty).
Run: `python -m zrl.moepp.kernels.sm90_check [--production] [op ...]` (prints the table; --production
skips the tests' shapes).
"""

from __future__ import annotations

import concurrent.futures
import argparse
import contextlib
import dataclasses
import importlib
import io
import logging
import multiprocessing
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

from zrl.moepp.kernels.sm90_drivers import Driver, drivers

logger = logging.getLogger(__name__)

# Shared memory one block of an sm_90 GPU may use (227 KiB, H100 and H200): a kernel asking more
# compiles but raises OutOfResources at its first launch, so it counts as a failure here.
MAX_SHARED = 232_448
TARGET = ("cuda", 90, 32)  # GPUTarget(backend, capability, warp size): sm_90a

_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
# PTX instructions, optionally predicated (`@%p1 wgmma...`), at the start of a line.
_WGMMA = re.compile(r"^\s*(?:@!?%\w+\s+)?wgmma\.mma_async\b", re.MULTILINE)
_MMA_SYNC = re.compile(r"^\s*(?:@!?%\w+\s+)?mma\.sync\b", re.MULTILINE)
_FMA_F32 = re.compile(r"^\s*(?:@!?%\w+\s+)?fma\.rn\.f32\b", re.MULTILINE)
_CP_ASYNC = re.compile(r"^\s*(?:@!?%\w+\s+)?cp\.async\.c[ag]\b", re.MULTILINE)


@dataclasses.dataclass
class Launch:
    kernel: object  # triton JITFunction
    args: tuple
    kwargs: dict


@dataclasses.dataclass
class Result:
    kernel: str  # "<op>.<kernel function>"
    variant: str  # the driver's label, then the pointer dtypes and switches of the launch
    ok: bool
    production: bool = False  # from a production-shape driver (sm90_drivers.Driver)
    trainer: bool = False  # from a driver of the trainer's dtype path
    error: str = ""
    n_regs: int = 0
    spill_stores: int = 0  # bytes
    spill_loads: int = 0  # bytes
    stack: int = 0  # bytes of stack frame
    shared: int = 0  # bytes of shared memory
    num_warps: int = 0
    num_stages: int = 0
    wgmma: int = 0  # wgmma.mma_async instructions in the PTX
    mma: int = 0  # mma.sync instructions in the PTX
    fma: int = 0  # fma.rn.f32 instructions in the PTX
    cp_async: int = 0  # cp.async instructions in the PTX: loads staged through shared memory (pipelining)
    seconds: float = 0.0

    @property
    def n_spills(self) -> int:
        return self.spill_stores + self.spill_loads

    @property
    def tensor_core(self) -> int:
        return self.wgmma + self.mma


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


def record(drive: Callable[[], None]) -> list[Launch]:
    """The launches `drive` makes (none of them runs)."""
    with _recording() as launches:
        drive()
    return launches


@dataclasses.dataclass(frozen=True)
class Specialisation:
    """What the runtime compiles one variant of a kernel for, from a launch's arguments."""

    key: str  # equal keys = one compiled binary (kernel, argument types, constexprs, attributes, options)
    kernel: object
    signature: dict
    constexprs: dict
    attrs: dict
    options: object


def specialise(launch: Launch, target=None) -> Specialisation:
    """Bind a launch's arguments as the runtime does (no GPU needed, nothing compiled)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    backend = make_backend(target or GPUTarget(*TARGET))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(launch.kwargs, debug=False)
    bound_args, specialization, _ = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, None)
    key = repr((kernel.fn.__qualname__, signature, sorted(constexprs.items()), sorted(attrs.items()),
                options.num_warps, options.num_stages))
    return Specialisation(key, kernel, signature, constexprs, attrs, options)


def kernel_name(kernel) -> str:
    """"<op>.<kernel function>" of a JITFunction of zrl.modeling.kernels.<op> or zrl.moepp.kernels.<op>."""
    return f"{kernel.fn.__module__.split('.')[-2]}.{kernel.fn.__name__}"


def specialisations(drive: Callable[[int], None], token_counts: list[int]) -> dict[str, set[str]]:
    """Per kernel ("<op>.<function>"), the distinct specialisation keys that `drive(T)` launches over
    the token counts: the variants a run whose T changes every step compiles (no compiling here)."""
    keys: dict[str, set[str]] = {}
    for t in token_counts:
        for launch in record(lambda: drive(t)):
            keys.setdefault(kernel_name(launch.kernel), set()).add(specialise(launch).key)
    return keys


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


def compile_specialisation(module: str, name: str, signature: dict, constexprs: dict, attrs: dict,
                           options: dict, cache_dir: str) -> Result:
    """Compile kernel `name` of `module` in one specialisation for sm_90a, with Triton's cache in
    `cache_dir`. Plain arguments, so that it can run in a worker process (which imports the kernel's
    module itself)."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    kernel = getattr(importlib.import_module(module), name)
    _require_triton36_dot_sizes()
    result = Result(kernel_name(kernel), _describe(signature, constexprs, kernel), ok=False,
                    num_warps=options["num_warps"], num_stages=options["num_stages"])
    log = io.StringIO()
    start = time.perf_counter()
    try:
        with (contextlib.redirect_stdout(log), knobs.nvidia.scope(), knobs.compilation.scope(),
              knobs.cache.scope()):
            knobs.cache.dir = cache_dir
            knobs.nvidia.dump_ptxas_log = True
            knobs.compilation.always_compile = True
            compiled = compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget(*TARGET),
                               options=options)
    except Exception as err:  # noqa: BLE001 - every failure is reported per kernel, not raised
        result.error = _error_text(err)
        result.seconds = time.perf_counter() - start
        return result
    result.seconds = time.perf_counter() - start
    text = log.getvalue()
    logger.debug("ptxas log of %s:\n%s", result.kernel, text)
    ptx = compiled.asm["ptx"]
    result.wgmma, result.mma, result.fma, result.cp_async = (
        len(p.findall(ptx)) for p in (_WGMMA, _MMA_SYNC, _FMA_F32, _CP_ASYNC))
    used, spill = _PTXAS_USED.search(text), _PTXAS_SPILL.search(text)
    if used is None or spill is None:
        result.error = f"compiled, but no ptxas -v statistics in its log: {text[-400:]!r}"
        return result
    result.n_regs = int(used.group(1))
    result.stack, result.spill_stores, result.spill_loads = (int(g) for g in spill.groups())
    result.shared = compiled.metadata.shared
    result.ok = result.shared <= MAX_SHARED
    if not result.ok:
        result.error = (f"OutOfResources at launch: {result.shared} B of shared memory > {MAX_SHARED} B "
                        f"(sm_90 limit per block)")
    return result


def _require_triton36_dot_sizes() -> None:
    """Hold tl.dot to Triton 3.6's minimum K of 16 (32 for 8-bit operands), which the GPU machines run:
    Triton 3.9 accepts a K of 8 for fp32 operands, so a tile that fails there would pass here (the
    CCA tests' block_t 8 did). Patches the installed backend's bound, in this process only."""
    from triton.backends.nvidia import compiler

    laxer = compiler.min_dot_size
    if getattr(laxer, "triton36", False):
        return

    def min_dot_size(target):
        check = laxer(target)

        def at_least_triton36(lhs_type, rhs_type):
            m, n, k = check(lhs_type, rhs_type)
            return m, n, max(k, 16)
        return at_least_triton36

    min_dot_size.triton36 = True
    compiler.min_dot_size = min_dot_size


def run_all(ops: set[str] | None = None, tests: bool = True, workers: int | None = None) -> list[Result]:
    """Drive every launcher (or those of `ops`; with `tests` also at the tests' shapes), compile each
    distinct specialisation for sm_90a in `workers` processes (default: one per CPU, at most 8). A
    specialisation is reported once, under the first driver that launched it (production first)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("sm90_check needs TRITON_INTERPRET unset: with it, the kernels are interpreted "
                           "functions that cannot be compiled (run it in a fresh process without it)")
    jobs: list[tuple[Driver, Specialisation | Result]] = []  # a Result: the driver itself failed
    seen: set[str] = set()
    for driver in drivers(tests):
        if ops is None or driver.op in ops:
            jobs += [(driver, job) for job in _specialisations_of(driver, seen)]
    workers = workers or min(os.cpu_count() or 1, 8)
    with tempfile.TemporaryDirectory(prefix="zrl-sm90-") as cache:
        # Each compile is single-threaded (MLIR passes, ptxas): processes, spawned (a forked child
        # would inherit the parent's torch threads in whatever state they are).
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
            futures = [job if isinstance(job, Result) else pool.submit(
                compile_specialisation, job.kernel.fn.__module__, job.kernel.fn.__name__, job.signature,
                job.constexprs, job.attrs, job.options.__dict__, cache) for _, job in jobs]
            results = []
            for (driver, _), future in zip(jobs, futures):
                result = future if isinstance(future, Result) else future.result()
                if "." in result.kernel:  # a compiled launch; a launcher's refusal keeps its label
                    result.variant = f"{driver.label} {result.variant}"
                result.production, result.trainer = driver.production, driver.trainer
                logger.info("%s %s: %s", result.kernel, result.variant, "ok" if result.ok else result.error)
                results.append(result)
    return results


def _specialisations_of(driver: Driver, seen: set[str]) -> list[Specialisation | Result]:
    """The specialisations `driver` launches that are not in `seen` (added), or the failure of the driver."""
    try:
        launches = record(driver.run)
    except Exception as err:  # noqa: BLE001 - a launcher refusing a test's configuration is a finding
        return [Result(f"{driver.op} (launcher)", driver.label, ok=False, error=_error_text(err))]
    if not launches:
        raise RuntimeError(f"driving {driver.op} ({driver.label}) launched no kernel")
    new = []
    for launch in launches:
        spec = specialise(launch)
        if spec.key not in seen:
            seen.add(spec.key)
            new.append(spec)
    return new


def format_table(results: list[Result]) -> str:
    lines = ["| kernel | launch (driver, pointer dtypes, switches) | warps/stages | regs | spill st/ld (B) | "
             "smem (KiB) | wgmma | mma.sync | fma.f32 | cp.async | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        status = "ok" if r.ok else "FAIL: " + r.error.splitlines()[0][:120]
        lines.append(f"| {r.kernel} | {r.variant} | {r.num_warps}/{r.num_stages} | {r.n_regs} | "
                     f"{r.spill_stores}/{r.spill_loads} | {r.shared / 1024:.1f} | {r.wgmma} | {r.mma} | "
                     f"{r.fma} | {r.cp_async} | {status} |")
    return "\n".join(lines)


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    if ptxas_path() is None:
        sys.stderr.write("ptxas not found: cannot compile for sm_90a\n")
        return 2
    parser = argparse.ArgumentParser(prog="python -m zrl.moepp.kernels.sm90_check",
                                     description="Compile every Triton kernel launch for sm_90a (no GPU).")
    parser.add_argument("ops", nargs="*", help="ops to compile (default: all)")
    parser.add_argument("--production", action="store_true",
                        help="only the production shapes, not the `gpu` tests' cases")
    args = parser.parse_args()
    start = time.perf_counter()
    results = run_all(set(args.ops) or None, not args.production)
    sys.stdout.write(format_table(results) + "\n")
    sys.stdout.write(f"{len(results)} specialisations, {sum(not r.ok for r in results)} failed, "
                     f"{sum(r.n_spills > 0 for r in results)} spilling; {time.perf_counter() - start:.0f} s\n")
    for r in results:
        if not r.ok:
            sys.stdout.write(f"\n--- {r.kernel} ({r.variant}):\n{r.error}\n")
    return 1 if any(not r.ok for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
