"""The recipe's algorithm and optimizer blocks (`stages[].algorithm`, `stages[].optimizer`): the RL objective
(advantage, trust region, loss aggregation, length reward, canaries) and Muon + AdamW. Their defaults are the
ZAYA1-8B production values (zrl/config/schema.py, module docstring); zrl.algorithms and zrl.optim read them."""

from typing import Annotated, Literal

from pydantic import Field, field_validator

from zrl.config.base import Strict


class DPPOBinaryTV(Strict):
    type: Literal["dppo_binary_tv"] = "dppo_binary_tv"
    delta: float = Field(0.1, gt=0, le=1, description="threshold on p - q (probabilities)")
    is_cap: float = Field(1e4, gt=0, description="truncated importance-sampling cap C")


class DPPOBinaryKL(Strict):
    type: Literal["dppo_binary_kl"]
    delta: float = Field(0.05, gt=0, description="threshold on the binary KL between q and p")
    is_cap: float = Field(1e4, gt=0)


class PPOClip(Strict):
    type: Literal["ppo_clip"]
    clip_low: float = Field(0.2, gt=0, lt=1)
    clip_high: float = Field(0.2, gt=0)


TrustRegion = Annotated[DPPOBinaryTV | DPPOBinaryKL | PPOClip, Field(discriminator="type")]


class LengthReward(Strict):
    """Difficulty-scaled length reward (ZAYA1-8B report eqs. 8-10); c ramps linearly from c_start to c_end."""

    enabled: bool = True
    c_start: float = Field(0.1, ge=0)
    c_end: float = Field(0.1, ge=0)
    tolerance_tokens: int | None = Field(200, ge=0, description="L_tol of lambda-tilde; null = plain lambda")
    accuracy_tolerance: float = Field(0.1, ge=0, le=1, description="T_acc of the gate m_i")


class LZ77Canary(Strict):
    """Streaming LZ77 compressibility gate. Defaults calibrated in zrl/canaries (3 bytes/token keeps
    the 762-byte deflate window at 254 tokens and holds ids < 2^24; 64-token chunks flag every loop
    period of 1-254 tokens within P + 128 tokens; exact repetition gives ratios <= 0.021)."""

    enabled: bool = True
    zero_reward: bool = Field(True, description="zero the reward of flagged rollouts before advantages")
    chunk_tokens: int = Field(64, ge=8)
    bytes_per_token: Literal[2, 3, 4] = 3
    threshold: float = Field(0.05, gt=0, lt=1, description="flag a rollout when any chunk ratio is below it")


class Canaries(Strict):
    lz77: LZ77Canary = LZ77Canary()
    rare_token_bands: list[float] = Field(default_factory=lambda: [0.10, 0.05, 0.02, 0.01])


class Algorithm(Strict):
    advantage: Literal["maxrl", "grpo", "drgrpo"] = "maxrl"
    trust_region: TrustRegion = DPPOBinaryTV()
    loss_aggregation: Literal["seq_mean_token_sum_norm", "token_mean", "seq_mean_token_mean"] = \
        "seq_mean_token_sum_norm"
    dynamic_sampling: bool = Field(True, description="drop groups whose task rewards are all equal (counted)")
    length_reward: LengthReward = LengthReward()
    canaries: Canaries = Canaries()
    router_replay: bool = True
    router_bias_update: bool = Field(False, description="keep updating router balancing biases during RL, by the "
                                                         "family's rule (MoE++: the PID-like AdamW balancer; "
                                                         "glm4_moe: DeepSeek-V3's sign update of the correction "
                                                         "bias); frozen when false")


class MuonSpec(Strict):
    lr: float = Field(5e-6, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    momentum: float = Field(0.0, ge=0, lt=1, description="0 = momentum-free, stateless (ZAYA1)")
    nesterov: bool = False


class AdamWSpec(Strict):
    lr: float | None = Field(None, gt=0, description="defaults to the Muon lr (Muon's update is RMS-matched)")
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.0, ge=0)

    @field_validator("betas", mode="before")
    @classmethod
    def _a_pair_is_written_as_a_list(cls, value):
        # YAML (and the run directory's resolved recipe) has lists, not tuples; strict mode wants a tuple.
        return tuple(value) if isinstance(value, list) else value


class Optimizer(Strict):
    muon: MuonSpec = MuonSpec()
    adamw: AdamWSpec = AdamWSpec()
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "cosine"] = "constant"
    grad_clip_norm: float | None = Field(
        1.0, gt=0, description="clips AdamW-managed gradients only; Muon's update is scale-invariant")
