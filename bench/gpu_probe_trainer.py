"""The GPU probe's trainer parts (bench/gpu_probe.py runs each in a child process) and its fit search's arithmetic.

A trainer part builds a random ZAYA1-8B-shaped checkpoint cut to some layers (tiny dimensions with --smoke)
and runs full RL steps on it through TrainerWorker (one FSDP2 rank, world size 1), one worker per activation
checkpointing; each step's row carries its tokens, routed tokens, phase times, peak memory and model FLOPs
(moepp_kernels_work.model_step_flops). Running out of GPU memory is an "oom" row, not a failure: the fit
search (the probe's "fit" part, one process per try) reads it as its answer.

A run's mode is its activation checkpointing ("full" or "selective"), optionally with kernel choices of
`auto` overridden for that run: "full+cca=triton+fused_glue+pipelined_norm" runs full checkpointing with
the CCA's Triton path where auto would run what AUTO_ON_CUDA names, the experts' grouped_mm path with its
fused glue and the residual norms' backward software-pipelined (SWITCHES), so that one probe weighs the
candidates in the whole step.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib
import math
import socket
import tempfile
import time
from collections.abc import Callable

import torch

from moepp_kernels_work import Shape, model_step_flops

Emit = Callable[..., None]  # gpu_probe.Rows: emit(kind, **row) appends one JSON row


# A microbatch's rollouts (groups x group size) and their prompt / response length ranges: 112 x ~1024 =
# ~115k tokens, packed under the recipe's token budget (resources.trainer_microbatch_tokens, 131,072), so
# steps of M x these rollouts run M microbatches. Smoke: ~190 tokens under a budget of 256.
BATCH = dict(groups=7, group_size=16, prompt_tokens=(128, 384), response_tokens=(512, 1024))
SMOKE_BATCH = dict(groups=1, group_size=4, prompt_tokens=(8, 24), response_tokens=(16, 48))
SMOKE_TOKEN_BUDGET = 256
PROFILED_RUN = "4 full"  # the run whose extra step runs under torch.profiler
FIT_MEMORY_SHARE = 0.9  # the fit search's first guess: the peaks' line at this share of the device memory


def out_of_memory(exc: BaseException) -> bool:
    """torch's OutOfMemoryError, or a library's CUDA error saying the same (cuBLAS, NCCL)."""
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"


# Candidates a mode turns on by name ("+fused_glue"): (module, its setting, the setting's value when on).
SWITCHES = {
    "fused_glue": ("zrl.modeling.kernels.experts.grouped_mm", "FUSED_GLUE", lambda module: True),
    "pipelined_norm": ("zrl.modeling.kernels.residual_norm.triton_kernel", "BACKWARD_STAGES",
                       lambda module: module.PIPELINED_STAGES),
}


def parse_mode(mode: str) -> tuple[str, dict[str, str]]:
    """"full+cca=triton+fused_glue" -> ("full", {"cca": "triton", "fused_glue": "on"}); one-line errors for a
    mode the probe cannot run."""
    from zrl.modeling.kernels import AUTO_ON_CUDA, CHOICES

    checkpointing, *overrides = mode.split("+")
    if checkpointing not in ("full", "selective"):
        raise ValueError(f"trainer mode {mode!r}: checkpointing must be 'full' or 'selective', got {checkpointing!r}")
    choices = {}
    for item in overrides:
        op, _, choice = item.partition("=")
        if item in SWITCHES:
            choices[item] = "on"
        elif op in AUTO_ON_CUDA and choice in CHOICES:
            choices[op] = choice
        else:
            raise ValueError(f"trainer mode {mode!r}: {item!r} must be one of {', '.join(SWITCHES)} or op=choice "
                             f"with op one of {', '.join(AUTO_ON_CUDA)} and choice one of {', '.join(CHOICES)}")
    return checkpointing, choices


@contextlib.contextmanager
def auto_choices(choices: dict[str, str]):
    """AUTO_ON_CUDA with `choices` in place, and the SWITCHES that `choices` names on, while the block runs
    (the run's worker lives in this process)."""
    from zrl.modeling.kernels import AUTO_ON_CUDA

    saved = dict(AUTO_ON_CUDA)
    switched = []  # (module, setting, value before)
    AUTO_ON_CUDA.update({op: choice for op, choice in choices.items() if op in AUTO_ON_CUDA})
    try:
        for name in choices.keys() & SWITCHES.keys():
            module_name, setting, value = SWITCHES[name]
            module = importlib.import_module(module_name)
            switched.append((module, setting, getattr(module, setting)))
            setattr(module, setting, value(module))
        yield
    finally:
        AUTO_ON_CUDA.clear()
        AUTO_ON_CUDA.update(saved)
        for module, setting, before in switched:
            setattr(module, setting, before)


def trainer_config(layers: int, smoke: bool):
    from zrl.moepp.config import zaya1_8b_config

    config = zaya1_8b_config()
    if smoke:
        config = dataclasses.replace(config, vocab_size=512, hidden_size=64, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=16, moe_intermediate_size=64, num_experts=4,
                                     router_hidden_size=16)
    return dataclasses.replace(config, num_hidden_layers=layers)


def batch_work(batch, num_layers: int, num_experts: int) -> tuple[list[int], list[int]]:
    """(document lengths as packed, tokens routed to an expert per layer) of a batch under router replay:
    the recorded ids are the ones used (the last routing row of a rollout is never an input)."""
    from zrl.trainer.packing import input_length

    docs, routed = [], [0] * num_layers
    for r in batch.rollouts():
        n = input_length(len(r.prompt_ids), len(r.token_ids))
        docs.append(n)
        for layer, count in enumerate((r.routing[:n] < num_experts).sum(axis=0).tolist()):
            routed[layer] += count
    return docs, routed


def part_trainer(args: argparse.Namespace, emit: Emit) -> None:
    """Trainer steps at one layer count, on one random checkpoint: part "trainer" runs each activation
    checkpointing its argument names ("4 full selective"), part "fit" is one try of the fit search (full
    checkpointing, 1 microbatch, 1 timed step). Running out of GPU memory ends the part with an "oom" row."""
    from zrl.moepp import MoEPPForCausalLM
    from zrl.moepp.checkpoint import save_hf_checkpoint

    cuda = torch.cuda.is_available()
    layers, *modes = args.part_arg.split()
    fit = args.part == "fit"
    runs = [(f"fit {layers}", "full")] if fit else [(f"{layers} {mode}", mode) for mode in modes]
    config = trainer_config(int(layers), args.smoke)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        try:
            torch.manual_seed(0)
            with torch.device("cuda" if cuda else "cpu"):  # random weights: initialised on the GPU in seconds
                model = MoEPPForCausalLM(config)
            params = sum(p.numel() for p in model.parameters())
            save_hf_checkpoint(model, tmp, dtype=torch.bfloat16 if cuda else torch.float32, max_shard_bytes=2 << 30)
        except RuntimeError as exc:
            if not out_of_memory(exc):
                raise
            emit("oom", run=runs[0][0], error=f"building the checkpoint: {first_line(exc)}")
            return
        del model
        setup = dict(layers=int(layers), fit=fit, params=params, build_s=time.perf_counter() - start)
        weights = [2 if run == PROFILED_RUN else 1 for run, _ in runs]  # its compilation and its profiled step
        for i, (run, mode) in enumerate(runs):
            gc.collect()  # the previous run's worker
            if cuda:
                torch.cuda.empty_cache()
            deadline = time.time() + (args.deadline - time.time()) * weights[i] / sum(weights[i:])
            if not trainer_run(args, emit, run, mode, config, tmp, setup, deadline):
                return


def trainer_run(args: argparse.Namespace, emit: Emit, run: str, mode: str, config, checkpoint: str, setup: dict,
                deadline: float) -> bool:
    """One TrainerWorker on `checkpoint` in `mode` (parse_mode): a warm-up step, up to
    --steps timed ones (1 in the fit search) of --microbatches microbatches (1 in the fit search), and for
    PROFILED_RUN one more under torch.profiler, as far as `deadline` allows. False when it ran out of GPU memory."""
    from zrl.config.schema import Algorithm, MuonSpec, Optimizer
    from zrl.models import get_family
    from zrl.trainer import Rendezvous, TrainerSettings, TrainerWorker
    from zrl.trainer.synthetic import synthetic_train_batch

    cuda = torch.cuda.is_available()
    shape = Shape(D=config.hidden_size, E=config.num_experts, F=config.moe_intermediate_size,
                  Hq=config.num_attention_heads, Hk=config.num_key_value_heads, d=config.head_dim,
                  R=config.router_hidden_size, V=config.vocab_size, k0=config.cca_time0, k1=config.cca_time1,
                  rotary=config.rotary_dim)
    checkpointing, choices = parse_mode(mode)
    microbatches, steps = (1, 1) if setup["fit"] else (args.microbatches, args.steps)
    spec = SMOKE_BATCH if args.smoke else BATCH
    budget = dict(token_budget=SMOKE_TOKEN_BUDGET) if args.smoke else {}  # else the recipe's default
    settings = TrainerSettings(param_dtype="bfloat16" if cuda else "float32", kernels="auto",
                               activation_checkpointing=True,
                               activation_checkpointing_selective=checkpointing == "selective",
                               max_response_tokens=1024, optimizer=Optimizer(muon=MuonSpec(lr=1e-6)),
                               algorithm=Algorithm(router_replay=True), **budget)
    model_shape = get_family(config.model_type).shape(config)

    def batch(seed: int):
        return synthetic_train_batch(vocab_size=config.vocab_size, shape=model_shape, trainer_step=worker.version,
                                     seed=seed, num_groups=microbatches * spec["groups"], group_size=spec["group_size"],
                                     prompt_tokens=spec["prompt_tokens"], response_tokens=spec["response_tokens"])

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    loading, worker = time.perf_counter(), None
    with auto_choices(choices):
        try:
            worker = TrainerWorker(Rendezvous("127.0.0.1", port, rank=0, world_size=1), checkpoint, settings)
            kernels = settings.kernels + "".join(f", {op} {choice}" for op, choice in choices.items())
            emit("trainer_setup", run=run, **setup, checkpointing=checkpointing, overrides=choices, shape=str(shape),
                 load_s=time.perf_counter() - loading, dtype=settings.param_dtype, kernels=kernels,
                 token_budget=settings.token_budget, microbatches=microbatches)
            last = None
            profiled = run == PROFILED_RUN
            for step in range(steps + 1):  # step 0 is the warm-up: compilation, allocator growth
                # After the first timed step, stop while one more step (and the profiled one) still fit, with a margin.
                if step >= 2 and time.time() + (2 + profiled) * last > deadline:
                    emit("note", text=f"{run}: stopped after {step} steps: the part's time is running out")
                    break
                b = batch(step)
                metrics = worker.train_step(worker.share_of(b))
                last = metrics["perf/step_s"]
                emit("trainer_step", run=run, **step_row(step, b, metrics, shape, setup["layers"]))
            if profiled:
                if time.time() + 2 * last < deadline:
                    profile_step(run, worker, batch(1000), cuda, emit)
                else:
                    emit("note", text=f"{run}: no profiled step: the part's time is running out")
        except RuntimeError as exc:
            if not out_of_memory(exc):
                raise
            emit("oom", run=run, error=first_line(exc))
            return False
        finally:
            if worker is not None:
                worker.shutdown()
        return True


def step_row(step: int, batch, metrics: dict[str, float], shape: Shape, layers: int) -> dict:
    docs, routed = batch_work(batch, layers, shape.E)
    perf = {k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith("perf/")}
    return dict(step=step, warmup=step == 0, tokens=sum(docs), input_tokens=metrics["batch/input_tokens"],
                docs=len(docs), routed=routed,
                model_flops=model_step_flops(shape, layers, docs, routed), loss=metrics.get("loss/policy"), **perf)


def profiled(call: Callable[[], object], cuda: bool, top: int) -> tuple[object, dict]:
    """(what `call` returned, its profile) with `call` run once under torch.profiler. The profile: which time
    ranks the ops (self CUDA time; self CPU on CPU), their sum `busy_s` and the `top` ops by it."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        out = call()
    events = list(prof.key_averages())

    def self_device_us(e) -> float:  # the attribute's name moved between torch releases
        return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)) or 0.0)

    key = self_device_us if cuda else (lambda e: float(e.self_cpu_time_total))
    rows = [dict(name=e.key[:90], calls=e.count, self_ms=key(e) / 1e3, self_cpu_ms=e.self_cpu_time_total / 1e3)
            for e in sorted(events, key=key, reverse=True)[:top]]
    return out, dict(timed="self CUDA" if cuda else "self CPU", busy_s=sum(key(e) for e in events) / 1e6, top=rows)


def profile_step(run: str, worker, batch, cuda: bool, emit: Emit, top: int = 20) -> None:
    """One step under torch.profiler: the `top` ops by self device time (CPU time on CPU)."""
    metrics, prof = profiled(lambda: worker.train_step(worker.share_of(batch)), cuda, top)
    emit("profile", run=run, step_s=metrics["perf/step_s"], **prof)


# ---------------------------------------------------------------- the fit search

def predicted_fit_layers(peaks_gib: dict[int, float], memory_gib: float | None) -> int | None:
    """The layer count at which the line through two measured (layers, peak GiB) reaches FIT_MEMORY_SHARE of
    `memory_gib`; None without a device memory, two points or a line that grows."""
    if memory_gib is None or len(peaks_gib) < 2:
        return None
    (l1, p1), (l2, p2) = sorted(peaks_gib.items())[:2]
    per_layer = (p2 - p1) / (l2 - l1)
    return l1 + math.floor((FIT_MEMORY_SHARE * memory_gib - p1) / per_layer) if per_layer > 0 else None


def next_fit_layers(tried: list[tuple[int, bool]], fitted: int, guess: int | None, most: int) -> int | None:
    """The fit search's next layer count, None once settled (the largest fit and the smallest out-of-memory
    count adjacent, or `most` fits). `tried`: its (layers, fits) in order; `fitted`: the most layers the trainer
    parts ran. First `guess` (else twice `fitted`), then ~10% up after a fit and down after an out-of-memory,
    or halfway between the largest fit and the smallest out-of-memory when that step would leave them."""
    low = max([fitted] + [n for n, fits in tried if fits])
    high = min([most + 1] + [n for n, fits in tried if not fits])
    if high - low <= 1:
        return None
    if tried:
        n, fits = tried[-1]
        guess = n + max(1, n // 10) if fits else n - max(1, n // 10)
    elif guess is None:
        guess = 2 * fitted
    return guess if low < guess < high else (low + high) // 2
