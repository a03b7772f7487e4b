"""What a trainer rank needs to know about its stage: objective, optimizer, memory and sharding knobs.

`TrainerSettings.from_stage` maps a recipe stage (zrl.config) onto it; the remaining fields are
deployment choices (token budget, precision, activation checkpointing/offload, HSDP replicas) that the
controller sets from the cluster it runs on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zrl.config.schema import Algorithm, LoRASpec, ModelSpec, Optimizer, Resources, RLStage, Sampling, SFTStage
from zrl.modeling.kernels import BACKENDS
from zrl.modeling.logprobs import SamplingDistribution
from zrl.modeling.routing import BIAS_BALANCER_LR
from zrl.optim import AdamWHyperparams, MuonHyperparams
from zrl.trainer.loss import RLObjective

# The dtype names recipes and deployment settings use, and their torch dtypes (the one such map).
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# Defaults of the fields a recipe also sets are the recipe schema's (the one place defaults are written).
_RESOURCES, _MODEL = Resources.model_fields, ModelSpec.model_fields


@dataclass(frozen=True)
class TrainerSettings:
    optimizer: Optimizer = field(default_factory=Optimizer)  # recipe spec: Muon + AdamW, schedule, clipping
    algorithm: Algorithm = field(default_factory=Algorithm)  # trust region, aggregation, replay, bias update
    # T_norm of the Dr-GRPO aggregation (the stage's generation cap)
    max_response_tokens: int = Sampling.model_fields["max_response_tokens"].default
    # the rollout engine's temperature and filters: the trainer's log p is taken under them
    sampling: SamplingDistribution = SamplingDistribution()
    total_steps: int | None = None  # the stage's optimizer steps (needed by the cosine schedule)
    token_budget: int = _RESOURCES["trainer_microbatch_tokens"].default  # tokens per rank per microbatch
    # compute dtype of the gathered parameters; masters and reduction fp32
    param_dtype: str = _MODEL["dtype"].default
    kernels: str = _MODEL["kernels"].default  # zrl.modeling.kernels backend: auto, triton or reference
    # recipe model.lora: adapters on a frozen base kept in param_dtype (zrl.modeling.lora); None = full fine-tuning
    lora: LoRASpec | None = _MODEL["lora"].default
    activation_checkpointing: bool = _RESOURCES["activation_checkpointing"].default  # recompute each layer
    # with checkpointing: every k-th layer (zrl.trainer.activations), and whether matmul outputs are kept
    activation_checkpointing_every_layers: int = _RESOURCES["activation_checkpointing_every_layers"].default
    activation_checkpointing_selective: bool = _RESOURCES["activation_checkpointing_selective"].default
    activation_offload: bool = _RESOURCES["activation_offload"].default  # saved layer inputs in host memory
    # > 1: 2-D mesh, shard within world_size / hsdp_replicas ranks, replicate across
    hsdp_replicas: int = _RESOURCES["hsdp_replicas"].default
    muon_mode: str = "layer_sharded"  # zrl.optim distributed_mode ("replicated" = baseline)
    bias_balancer_lr: float = BIAS_BALANCER_LR  # AdamW lr of the router balancing biases (bias update on)
    # tokens per rank and RL step scored again under the previous synced version's weights (onpolicy.py); 0: off
    onpolicy_mismatch_tokens: int = _RESOURCES["trainer_onpolicy_mismatch_tokens"].default
    with_entropy: bool = True  # compute the policy entropy of response tokens for metrics
    logprob_chunk_tokens: int | None = None  # LM-head chunk (None: zrl.modeling default)

    def __post_init__(self) -> None:
        if self.param_dtype not in DTYPES:
            raise ValueError(f"param_dtype must be one of {sorted(DTYPES)}, got {self.param_dtype!r}")
        if self.kernels not in BACKENDS:
            raise ValueError(f"kernels must be one of {', '.join(BACKENDS)}, got {self.kernels!r}")
        if self.token_budget < 2 or self.max_response_tokens < 1 or self.hsdp_replicas < 1:
            raise ValueError("token_budget must be >= 2, max_response_tokens and hsdp_replicas >= 1")
        if self.onpolicy_mismatch_tokens < 0:
            raise ValueError(f"onpolicy_mismatch_tokens must be >= 0, got {self.onpolicy_mismatch_tokens}")

    @classmethod
    def from_stage(cls, stage: RLStage | SFTStage, **deployment) -> TrainerSettings:
        """Settings of a recipe stage; `deployment` sets the non-recipe fields (token_budget, ...)."""
        if isinstance(stage, RLStage):
            s = stage.sampling
            sampling = SamplingDistribution(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p)
            return cls(optimizer=stage.optimizer, algorithm=stage.algorithm, max_response_tokens=s.max_response_tokens,
                       sampling=sampling, total_steps=stage.steps, **deployment)
        return cls(optimizer=stage.optimizer, total_steps=stage.steps, **deployment)

    @property
    def torch_param_dtype(self) -> torch.dtype:
        return DTYPES[self.param_dtype]

    @property
    def replay(self) -> bool:
        return self.algorithm.router_replay

    def objective(self) -> RLObjective:
        tr = self.algorithm.trust_region.model_dump()
        return RLObjective(trust_region=tr.pop("type"), trust_region_params=tr,
                           aggregation=self.algorithm.loss_aggregation, max_response_tokens=self.max_response_tokens,
                           sampling=self.sampling)

    def muon_hyperparams(self) -> MuonHyperparams:
        m = self.optimizer.muon
        return MuonHyperparams(lr=m.lr, weight_decay=m.weight_decay, momentum=m.momentum, nesterov=m.nesterov)

    def adamw_hyperparams(self) -> AdamWHyperparams:
        a = self.optimizer.adamw
        return AdamWHyperparams(lr=a.lr if a.lr is not None else self.optimizer.muon.lr, betas=tuple(a.betas),
                                eps=a.eps, weight_decay=a.weight_decay)
