"""Typed records that cross stage boundaries (docs/design.md "Contracts"): frozen, no dict bags.

`Prompt` flows from an environment's prompt source to the rollout workers; `Rollout` from a rollout
worker (tokens, behaviour logprobs, routing record, per-token policy versions) to verification and the
buffer; `Verification` from an environment's verifier to the buffer.
"""

import re
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

import numpy as np

RewardType = Literal["binary", "continuous"]
Split = Literal["train", "eval"]


@dataclass(frozen=True)
class Message:
    role: Literal["system", "user", "assistant"]
    content: str


@dataclass(frozen=True)
class Prompt:
    """One task instance. `payload` belongs to the environment that made it and is opaque to zrl."""

    env: str                       # the environment's name; in a stage, the key of the entry that made it
                                   # (zrl/prompts.py stamps it; the recipe's `key`, default the name)
    prompt_id: str                 # stable across runs for the same (env, seed, index)
    messages: tuple[Message, ...]
    answer: str                    # reference answer, or "" when the verifier needs none
    data_source: str               # key of the running max solve rate (length reward gate)
    difficulty: float | None = None
    payload: Mapping[str, Any] = field(default_factory=dict)

    def chat(self) -> list[dict[str, str]]:
        """The messages in the form tokenizers' chat templates take."""
        return [{"role": m.role, "content": m.content} for m in self.messages]


@dataclass(frozen=True)
class Verification:
    reward: float
    error: str | None = None       # set when the verifier raised or timed out (reward is then 0)
    metadata: Mapping[str, Any] = field(default_factory=dict)


# The one "no routing record" value of a routing record (uint8; expert ids are 0..E with E <= 254): the
# engine writes it for tokens it never ran (the last sampled one), the trainer routes them natively.
NO_ROUTE = 255


@dataclass(frozen=True, eq=False, slots=True)  # slots: ~2x cheaper to build, and a rollout has no dict
class Rollout:
    """One sampled response, as the rollout engine produced it.

    `routing` holds the experts the engine chose in every MoE layer for every prompt and response
    token ([Tp + Tr, L * k] uint8, k per layer, layer-major: the model family's `ModelShape.routing_width`;
    MoE++ is top-1 with the skip expert id E; NO_ROUTE where there is no record, e.g. the last sampled
    token, which never went through the model). `version_segments` are (response token index,
    policy version) pairs in increasing index order: token t was sampled by the version of the last
    segment starting at or before t. The first segment starts at 0.

    `policy_mask` marks the response tokens the policy sampled (trained) against those an environment
    wrote into the sequence between turns (a tool's output, a user's reply: context only, no loss and no
    logprob, routed as recorded); None means every response token is the policy's (a single turn). The
    staleness anchor, the length reward and the loss count the policy's tokens only.
    """

    prompt_ids: np.ndarray            # [Tp] int32
    token_ids: np.ndarray             # [Tr] int32
    logprobs: np.ndarray              # [Tr] float32, behaviour logprobs of the sampled tokens
    routing: np.ndarray | None        # [Tp + Tr, L * k] uint8
    version_segments: tuple[tuple[int, int], ...]
    finish_reason: str                # "stop" | "length" | "abort"
    text: str = ""                    # decoded response, what the verifier reads
    policy_mask: np.ndarray | None = None  # [Tr] bool, True where the policy sampled the token
    # The oldest policy version that produced a response token (staleness is measured from it); derived
    # once here, since the buffer and every released batch read it per rollout.
    min_version: int = field(init=False, repr=False)

    def __post_init__(self):
        r = len(self.token_ids)
        if len(self.logprobs) != r:
            raise ValueError(f"logprobs has {len(self.logprobs)} entries for {r} response tokens")
        if self.routing is not None and self.routing.shape[0] != len(self.prompt_ids) + r:
            raise ValueError(f"routing has {self.routing.shape[0]} rows for {len(self.prompt_ids) + r} tokens")
        if self.policy_mask is not None and (self.policy_mask.dtype != np.bool_ or self.policy_mask.shape != (r,)):
            raise ValueError(f"policy_mask must be a [{r}] bool array, got {self.policy_mask.dtype} "
                             f"{self.policy_mask.shape}")
        segments = self.version_segments
        if len(segments) == 1 and segments[0][0] == 0:  # no weight sync during the rollout: the common case
            object.__setattr__(self, "min_version", segments[0][1])
            return
        starts = [s for s, _ in segments]
        if not starts or starts[0] != 0 or starts != sorted(set(starts)):
            raise ValueError(f"version_segments must start at token 0 and increase: {segments}")
        if self.policy_mask is not None and self.policy_mask.any():
            covered = self.token_versions()[self.policy_mask].tolist()
        else:
            covered = [v for s, v in segments if s < r]
        object.__setattr__(self, "min_version", min(covered) if covered else segments[0][1])

    @property
    def num_policy_tokens(self) -> int:
        """Response tokens the policy sampled (all of them unless `policy_mask` says otherwise)."""
        return len(self.token_ids) if self.policy_mask is None else int(np.count_nonzero(self.policy_mask))

    def token_versions(self) -> np.ndarray:
        """[Tr] int64 policy version of every response token."""
        versions = np.empty(len(self.token_ids), dtype=np.int64)
        bounds = [s for s, _ in self.version_segments[1:]] + [len(self.token_ids)]
        for (start, version), end in zip(self.version_segments, bounds):
            versions[start:end] = version
        return versions


@dataclass(frozen=True, eq=False)
class RolloutGroup:
    """The G rollouts of one prompt with their verifications; the buffer's unit of admission and release.

    A rollout worker builds it with the first four fields. The buffer's admitted form (the same four
    fields, constructed again) also carries, per rollout ([G] arrays, read-only): `rewards` = task rewards
    after the repetition gate, `length_bonuses` = Δr, `advantages` (broadcast to every response token
    by the trainer) and `canary_flags` = LZ77 repetition flags. Either all four are set or none.
    """

    group_id: str                          # unique per generated group (a prompt may be sampled again)
    prompt: Prompt
    rollouts: tuple[Rollout, ...]          # [G]
    verifications: tuple[Verification, ...]  # [G], verifications[i] judges rollouts[i]
    rewards: np.ndarray | None = None         # [G] float64
    length_bonuses: np.ndarray | None = None  # [G] float64
    advantages: np.ndarray | None = None      # [G] float64
    canary_flags: np.ndarray | None = None    # [G] bool

    def __post_init__(self):
        object.__setattr__(self, "rollouts", tuple(self.rollouts))
        object.__setattr__(self, "verifications", tuple(self.verifications))
        g = len(self.rollouts)
        if g == 0:
            raise ValueError(f"group {self.group_id!r} has no rollouts")
        if len(self.verifications) != g:
            raise ValueError(f"group {self.group_id!r}: {len(self.verifications)} verifications for {g} rollouts")
        scored = [self.rewards, self.length_bonuses, self.advantages, self.canary_flags]
        if any(a is not None for a in scored):
            if any(a is None for a in scored):
                raise ValueError(f"group {self.group_id!r}: rewards, length_bonuses, advantages and "
                                 "canary_flags are set together (the buffer's admitted form)")
            for name, a in zip(("rewards", "length_bonuses", "advantages", "canary_flags"), scored):
                if np.shape(a) != (g,):
                    raise ValueError(f"group {self.group_id!r}: {name} has shape {np.shape(a)}, expected ({g},)")

    @property
    def size(self) -> int:
        return len(self.rollouts)

    @property
    def admitted(self) -> bool:
        return self.advantages is not None

    @property
    def min_version(self) -> int:
        """The oldest policy version of any response token in the group (its staleness anchor)."""
        return min([r.min_version for r in self.rollouts])

    def task_rewards(self) -> np.ndarray:
        """[G] float64 verifier rewards (0 where the verifier failed), before any gate."""
        return np.array([v.reward for v in self.verifications], dtype=np.float64)

    def response_lengths(self) -> np.ndarray:
        """[G] int64 response tokens the policy sampled (what the length reward counts)."""
        return np.array([r.num_policy_tokens for r in self.rollouts], dtype=np.int64)


@dataclass(frozen=True, eq=False)
class TrainBatch:
    """The admitted groups for one trainer optimizer step, as the buffer released them.

    `trainer_step` is the trainer's policy version when it pulled the batch (optimizer steps done);
    the batch produces step `trainer_step + 1`. The global counts and the staleness facts are derived
    from the groups at construction, so they cannot disagree with them. Rollout order everywhere is
    group-major: group 0's rollouts, then group 1's, ...
    """

    groups: tuple[RolloutGroup, ...]
    trainer_step: int
    num_sequences: int = field(init=False)        # N_seq of the loss aggregation (empty responses count)
    num_response_tokens: int = field(init=False)  # N_tok of the loss aggregation (the policy's tokens)
    staleness: np.ndarray = field(init=False)     # [N_seq] int64, trainer_step - rollout.min_version

    def __post_init__(self):
        object.__setattr__(self, "groups", tuple(self.groups))
        if not self.groups:
            raise ValueError("a train batch needs at least one group")
        unscored = [g.group_id for g in self.groups if not g.admitted]
        if unscored:
            raise ValueError(f"groups {unscored[:5]} were not admitted by the buffer (no advantages)")
        rollouts = [r for g in self.groups for r in g.rollouts]
        staleness = np.array([self.trainer_step - r.min_version for r in rollouts], dtype=np.int64)
        if staleness.min() < 0:
            raise ValueError(f"a rollout's policy version is newer than trainer step {self.trainer_step}: "
                             f"staleness {staleness.min()}")
        staleness.flags.writeable = False
        object.__setattr__(self, "num_sequences", len(rollouts))
        object.__setattr__(self, "num_response_tokens", sum(r.num_policy_tokens for r in rollouts))
        object.__setattr__(self, "staleness", staleness)

    @property
    def max_staleness(self) -> int:
        return int(self.staleness.max())

    def rollouts(self) -> tuple[Rollout, ...]:
        """[N_seq] rollouts in group-major order."""
        return tuple(r for g in self.groups for r in g.rollouts)

    def advantages(self) -> np.ndarray:
        """[N_seq] float64 per-rollout advantages in group-major order."""
        return np.concatenate([g.advantages for g in self.groups])


@dataclass(frozen=True, eq=False)
class RankShare:
    """One trainer rank's part of a released batch: only the rollouts the packing plan gave this rank.

    The buffer splits a `TrainBatch` into one share per rank (zrl.trainer.packing.split_batch), so each
    rank receives its own rollouts and never the whole batch. The loss is normalised by the batch's
    GLOBAL counts, which every share carries. `microbatches` index `rollouts` (this share's order); an
    empty list is a slot where this rank has nothing to compute but must join the collectives. Every
    rank of a batch gets the same number of microbatches.
    """

    trainer_step: int                    # the policy version the batch was pulled at
    rank: int
    rollouts: tuple[Rollout, ...]        # [N_rank], this rank's sequences
    advantages: np.ndarray               # [N_rank] float64
    microbatches: tuple[tuple[int, ...], ...]  # indices into `rollouts`, per microbatch
    num_sequences: int                   # N_seq of the whole batch
    num_response_tokens: int             # N_tok of the whole batch
    max_staleness: int                   # over the whole batch
    mean_staleness: float                # over the whole batch's rollouts
    advantage_abs_mean: float            # over the whole batch's rollouts
    packing_stats: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self):
        if len(self.advantages) != len(self.rollouts):
            raise ValueError(f"rank {self.rank}: {len(self.advantages)} advantages for {len(self.rollouts)} rollouts")

    @property
    def num_bytes(self) -> int:
        """Bytes of the rollout arrays this share carries (token ids, logprobs, routing)."""
        return sum(rollout_array_bytes(r) for r in self.rollouts)


def rollout_array_bytes(rollout: Rollout) -> int:
    """Bytes of one rollout's arrays: prompt and response token ids, logprobs and routing record."""
    arrays = (rollout.prompt_ids, rollout.token_ids, rollout.logprobs, rollout.routing)
    return sum(a.nbytes for a in arrays if a is not None)


_STREAM_PLACE = re.compile(r"^w(\d+)-d(\d+)\.(\d+)-")


def stream_group_id(worker_index: int, draw: int, position: int, prompt_id: str) -> str:
    """A generated group's id: its place in a rollout worker's prompt stream (draw, position in the
    draw), the same whenever that place is drawn again (a restarted or resumed worker), so the buffer's
    prompt ledger recognises a repeat; the prompt id is for the reader."""
    return f"w{worker_index}-d{draw}.{position}-{prompt_id}"


def stream_place(group_id: str) -> tuple[int, int] | None:
    """(worker index, draw) of a `stream_group_id`, None for other ids."""
    match = _STREAM_PLACE.match(group_id)
    return None if match is None else (int(match[1]), int(match[2]))
