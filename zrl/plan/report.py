"""What `zrl plan` computes and prints: one cluster (async vs sync) or a sweep of rollout:trainer
ratios, as tables and a throughput plot with the knee marked.

`WorkloadSpec` is the workload a user writes (YAML, every field optional): its defaults are the
ZAYA1-8B-on-H100 assumptions of bench/results/plan_zaya1.md; `with_model` replaces the trainer's
FLOP-model fields it does not set by the recipe checkpoint's (the model family's `flop_model`,
zrl/models); `with_recipe_model` finds that checkpoint's config.json (a local directory or a Hub repo's
cached snapshot) and refuses to plan a Hub model whose config is not here unless the workload gives its
FLOP model (FLOP_FIELDS), so a plan never stands the defaults' model in for the recipe's.
`build(stage, trainer_gpus)` turns it
into a `Workload`: the trainer's rate scales with its GPUs, response lengths are cut at the stage's
`max_response_tokens`.

Invariants: async and sync are simulated on the same workload and seed; sync is
`synchronous_variant(stage)`; the knee is the smallest swept ratio whose async throughput reaches
KNEE_FRACTION of the sweep's best.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field

from zrl.config.schema import RLStage
from zrl.models import FlopModel
from zrl.pipeline.schedule import StageSchedule
from zrl.plan.simulator import PlanResult, simulate, synchronous_variant
from zrl.plan.workload import DecodeModel, ResponseLengths, TrainerModel, Workload

KNEE_FRACTION = 0.9
FLOP_FIELDS = ("active_params", "layers", "attention_dim")  # the trainer's FLOP model in a workload

log = logging.getLogger("zrl")


class WorkloadSpec(BaseModel):
    """A plan's workload; units in the names. The trainer's rate is either measured
    (`trainer_tokens_per_s_per_gpu`) or model FLOPs at `trainer_mfu` of `peak_flops_per_gpu`."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    median_response_tokens: float = Field(17600, ge=1)
    p90_response_tokens: float = Field(30000, ge=1)
    prompt_tokens: int = Field(1024, ge=0)
    decode_step_s: float = Field(5.0e-3, ge=0, description="weight reads per decode step")
    decode_per_sequence_s: float = Field(3.0e-5, ge=0)
    decode_per_kv_token_s: float = Field(1.75e-8, ge=0, description="KV-cache reads per token in context")
    max_running_sequences: int = Field(256, ge=1)
    trainer_tokens_per_s_per_gpu: float | None = Field(None, gt=0)
    trainer_mfu: float = Field(0.25, gt=0, le=1)
    peak_flops_per_gpu: float = Field(989e12, gt=0)
    active_params: float = Field(0.76e9, gt=0)
    layers: int = Field(40, ge=1)
    attention_dim: int = Field(1024, ge=1, description="query heads x head dim")
    trainer_overhead_s: float = Field(0.0, ge=0)
    sync_s: float = Field(10.0, ge=0)
    zero_signal_fraction: float = Field(0.1, ge=0, lt=1)
    round_s: float = Field(0.5, gt=0)
    kv_capacity_tokens: float = Field(1.34e6, gt=0, description="KV-cache tokens one rollout worker holds "
                                      "(reported against the plan's peak; the engine would preempt above it)")

    def check(self) -> None:
        """Rules across fields (one field's range is its Field's)."""
        if self.p90_response_tokens < self.median_response_tokens:
            raise ValueError(f"p90_response_tokens: {self.p90_response_tokens:g} is below median_response_tokens "
                             f"{self.median_response_tokens:g}")

    def build(self, stage: RLStage, trainer_gpus: int) -> Workload:
        self.check()
        if self.trainer_tokens_per_s_per_gpu is not None:
            trainer = TrainerModel(self.trainer_tokens_per_s_per_gpu * trainer_gpus, self.trainer_overhead_s)
        else:
            trainer = TrainerModel.from_mfu(mfu=self.trainer_mfu, peak_flops=self.peak_flops_per_gpu, gpus=trainer_gpus,
                                            active_params=self.active_params, layers=self.layers,
                                            attention_dim=self.attention_dim, overhead_s=self.trainer_overhead_s)
        return Workload(
            lengths=ResponseLengths.from_median_p90(self.median_response_tokens, self.p90_response_tokens,
                                                    stage.sampling.max_response_tokens),
            engine=DecodeModel(self.decode_step_s, self.decode_per_sequence_s, self.decode_per_kv_token_s,
                                 self.max_running_sequences),
            trainer=trainer, prompt_tokens=self.prompt_tokens, sync_s=self.sync_s,
            zero_signal_fraction=self.zero_signal_fraction, round_s=self.round_s)


def with_model(spec: WorkloadSpec, flops: FlopModel) -> WorkloadSpec:
    """`spec` with the trainer's FLOP model (active parameters, layers, attention width) of a model,
    except for the fields the workload file set itself."""
    values = {"active_params": float(flops.active_params), "layers": flops.num_layers,
              "attention_dim": flops.attention_dim}
    return spec.model_copy(update={k: v for k, v in values.items() if k not in spec.model_fields_set})


def with_recipe_model(spec: WorkloadSpec, path: str, revision: str | None) -> WorkloadSpec:
    """`spec` with the FLOP model of the recipe's model (`model.path`, `model.revision`), read from its
    config.json through its family; fields the workload file set win. Raises ValueError (one line) for a
    Hub repo whose config.json is not here (not downloaded, or offline) when the workload does not set
    FLOP_FIELDS itself. A local directory without a checkpoint yet (a tiny model built on first run, a
    checkpoint still to be copied) keeps the workload's values, with a warning when they are the defaults."""
    from zrl import hub
    from zrl.models import family_of_checkpoint

    where = hub.locate(path, revision, "model.path")
    config = None if where.local is None else where.local.expanduser() / "config.json"
    if config is not None and config.is_file():
        try:
            family = family_of_checkpoint(config.parent)
            flops = family.flop_model(family.read_config(config.parent))
        except ValueError as exc:
            raise ValueError(f"model.path: {config}: {exc}") from None
        log.info("trainer FLOP model of %s: %.3g active parameters, %d layers", config.parent, flops.active_params,
                 flops.num_layers)
        return with_model(spec, flops)
    unset = [name for name in FLOP_FIELDS if name not in spec.model_fields_set]
    if where.repo_id is not None and unset:
        why = where.missing or f"not in the Hugging Face cache {hub.cache_dir()}"
        raise ValueError(f"model.path: {path}: its config.json is not here ({why}), so the plan cannot count "
                         f"its FLOPs; give a --workload that sets "
                         f"{', '.join(unset)} (the family's flop_model of its config.json), or download it with: "
                         f"{hub.download_command(path, revision)}")
    if unset:
        log.warning("model.path: %s holds no config.json yet: the trainer's %s are the workload defaults "
                    "(ZAYA1-8B's)", path, ", ".join(unset))
    return spec


def load_workload(path: str | None) -> WorkloadSpec:
    """The spec in a YAML file (None: the defaults). Raises ValueError with one line naming the field."""
    if path is None:
        return WorkloadSpec()
    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: file not found") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: invalid YAML: {exc}".splitlines()[0]) from None
    from pydantic import ValidationError

    try:
        spec = WorkloadSpec.model_validate(data or {})
        spec.check()
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "workload"
        raise ValueError(f"{path}: {field}: {first['msg']}") from None
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return spec


@dataclass(frozen=True)
class PlanPoint:
    rollout_gpus: int
    trainer_gpus: int
    rollout_workers: int
    async_result: PlanResult
    sync_result: PlanResult
    kv_capacity_tokens: float

    @property
    def ratio(self) -> float:
        return self.rollout_gpus / self.trainer_gpus

    @property
    def speedup(self) -> float:
        return self.async_result.steps_per_hour / self.sync_result.steps_per_hour


def rollout_workers_for(stage_gpus_per_worker: float, rollout_gpus: int) -> int:
    """Rollout workers on `rollout_gpus` GPUs (one per unit when workers reserve no GPU, as on CPU)."""
    per = stage_gpus_per_worker or 1.0
    workers = rollout_gpus / per
    if workers < 1 or abs(workers - round(workers)) > 1e-9:
        raise ValueError(f"--rollout-gpus: {rollout_gpus} GPUs do not make a whole number of rollout workers "
                         f"of {per:g} GPU(s) each")
    return int(round(workers))


def plan_point(stage: RLStage, spec: WorkloadSpec, *, rollout_gpus: int, trainer_gpus: int,
               gpus_per_rollout_worker: float, steps: int, seed: int = 0,
               schedule_class: type[StageSchedule] = StageSchedule) -> PlanPoint:
    workers = rollout_workers_for(gpus_per_rollout_worker, rollout_gpus)
    workload = spec.build(stage, trainer_gpus)
    kwargs = {"steps": steps, "seed": seed, "schedule_class": schedule_class}
    return PlanPoint(rollout_gpus, trainer_gpus, workers, simulate(stage, workload, workers, **kwargs),
                     simulate(synchronous_variant(stage), workload, workers, **kwargs), spec.kv_capacity_tokens)


def knee(points: list[PlanPoint]) -> PlanPoint:
    best = max(p.async_result.steps_per_hour for p in points)
    return min((p for p in points if p.async_result.steps_per_hour >= KNEE_FRACTION * best), key=lambda p: p.ratio)


def _staleness(histogram: dict[int, float]) -> str:
    return " ".join(f"{k}:{100 * v:.0f}%" for k, v in histogram.items())


def point_summary(point: PlanPoint) -> dict:
    """One cluster's numbers for `zrl plan --json` (each mode's PlanResult without its per-step rows)."""
    def result(r: PlanResult) -> dict:
        fields = {f.name: getattr(r, f.name) for f in dataclasses.fields(r) if f.name != "rows"}
        return {**fields, "evicted": r.evicted}

    return {"rollout_gpus": point.rollout_gpus, "trainer_gpus": point.trainer_gpus, "ratio": point.ratio,
            "rollout_workers": point.rollout_workers, "speedup": point.speedup,
            "kv_capacity_tokens": point.kv_capacity_tokens, "async": result(point.async_result),
            "sync": result(point.sync_result)}


def format_point(point: PlanPoint) -> str:
    lines = [f"rollout {point.rollout_gpus} GPU(s) = {point.rollout_workers} worker(s), trainer {point.trainer_gpus} "
             f"GPU(s) (ratio {point.ratio:g}:1)",
             f"{'mode':6s}{'steps/h':>10s}{'rollout idle':>14s}{'trainer idle':>14s}{'evicted':>9s}"
             f"{'dropped':>9s}  staleness of trained tokens"]
    for r in (point.async_result, point.sync_result):
        c = r.buffer_counts
        lines.append(f"{r.mode:6s}{r.steps_per_hour:10.2f}{100 * r.rollout_idle_frac:13.0f}%"
                     f"{100 * r.trainer_idle_frac:13.0f}%{r.evicted:9d}{c['dropped_zero_signal']:9d}  {_staleness(r.staleness_tokens)}")
    a = point.async_result
    lines.append(f"(staleness by the rollout's oldest token, which the bound limits; async by each token's own "
                 f"version: {_staleness(a.token_staleness)})")
    lines.append(f"async / sync: {point.speedup:.2f}x; {a.workers_used} of {a.rollout_workers} rollout workers were "
                 f"given groups; peak KV tokens per worker {a.peak_kv_tokens_per_worker:.3g}")
    if a.peak_kv_tokens_per_worker > point.kv_capacity_tokens:
        lines.append(f"warning: that exceeds kv_capacity_tokens {point.kv_capacity_tokens:.3g}: the engine would "
                     "preempt sequences, which the plan does not model (it is optimistic here)")
    return "\n".join(lines)


def format_sweep(points: list[PlanPoint]) -> str:
    k = knee(points)
    lines = [f"{'ratio':>6s}{'rollout GPUs':>14s}{'async steps/h':>15s}{'sync steps/h':>14s}{'speedup':>9s}"
             f"{'rollout idle':>14s}{'trainer idle':>14s}"]
    for p in points:
        a = p.async_result
        mark = "  <- knee" if p is k else ""
        lines.append(f"{p.ratio:6g}{p.rollout_gpus:14d}{a.steps_per_hour:15.2f}{p.sync_result.steps_per_hour:14.2f}"
                     f"{p.speedup:8.2f}x{100 * a.rollout_idle_frac:13.0f}%{100 * a.trainer_idle_frac:13.0f}%{mark}")
    lines.append(f"knee: ratio {k.ratio:g}:1, the smallest reaching {KNEE_FRACTION:.0%} of the best async throughput")
    return "\n".join(lines)


def plot_sweep(points: list[PlanPoint], path: str | Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = [p.ratio for p in points]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ratios, [p.async_result.steps_per_hour for p in points], "o-", label="asynchronous")
    ax.plot(ratios, [p.sync_result.steps_per_hour for p in points], "s--", label="synchronous")
    k = knee(points)
    ax.axvline(k.ratio, color="grey", linestyle=":")
    ax.annotate(f"knee {k.ratio:g}:1", (k.ratio, k.async_result.steps_per_hour), textcoords="offset points",
                xytext=(6, -14))
    ax.set_xlabel("rollout : trainer GPUs")
    ax.set_ylabel("trainer steps per hour")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
