"""RolloutWorker: one vLLM engine generating groups for one stage (a Ray actor hosts it; style rule 1).

The controller drives it in short *rounds*: `round(new_groups)` draws that many prompts from the
stage's prompt source, submits G samples of each, runs engine steps for at most `round_seconds`, and
returns the groups that finished. Requests still running stay in the engine between rounds with their
KV cache and CCA state, so a weight update (`update_weights`, queued between two rounds by the
controller) lands between engine steps while generation is in flight (PipelineRL "keep"): tokens
sampled after it carry the new version in their segments.

Invariants: a group is returned once, complete (all G samples), in `Rollout` form; prompts longer than
`max_prompt_tokens` are skipped and counted, never truncated.
"""

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from zrl.canaries import gibberish_fraction, rare_token_fractions
from zrl.config.schema import RLStage
from zrl.moepp.config import MoEPPConfig
from zrl.prompts import PromptSource
from zrl.types import Prompt, Rollout


@dataclass(frozen=True)
class GeneratedGroup:
    """G finished samples of one prompt, before verification."""

    group_id: str
    prompt: Prompt
    rollouts: tuple[Rollout, ...]


@dataclass(frozen=True)
class RoundResult:
    groups: list[GeneratedGroup]
    in_flight_groups: int          # groups still generating in this worker
    generated_tokens: int          # response tokens sampled during the round
    busy_s: float                  # wall time spent in engine steps
    version: int                   # the engine's policy version at the end of the round
    skipped_long_prompts: int = 0
    canary_sums: dict = field(default_factory=dict)  # monitor name -> sum over the finished rollouts
    state: dict = field(default_factory=dict)         # the worker's state_dict() after the round


@dataclass
class _Open:
    prompt: Prompt
    samples: list = field(default_factory=list)


class RolloutWorker:
    def __init__(self, worker_index: int, model_path: str | Path, stage: RLStage, seed: int, dtype: str,
                 initial_version: int = 0, round_seconds: float = 0.5, max_num_seqs: int = 256):
        from serving.engine import RolloutEngine, SamplingConfig

        s = stage.sampling
        self.worker_index = worker_index
        self.stage = stage
        self.group_size = s.group_size
        self.max_prompt_tokens = s.max_prompt_tokens
        self.round_seconds = round_seconds
        self.sampling = SamplingConfig(max_tokens=s.max_response_tokens, temperature=s.temperature, top_p=s.top_p,
                                       top_k=max(s.top_k, 0), min_p=s.min_p, stop=tuple(s.stop))
        self.engine = RolloutEngine(model_path, dtype=dtype, max_model_len=s.max_prompt_tokens + s.max_response_tokens,
                                    max_num_seqs=max_num_seqs, seed=seed + worker_index,
                                    initial_version=initial_version)
        self.source = PromptSource(stage.environments, seed=seed * 1000 + worker_index)
        self.vocab_size = MoEPPConfig.from_pretrained_dir(model_path).vocab_size
        self.rare_bands = tuple(stage.algorithm.canaries.rare_token_bands)
        self._rng = np.random.default_rng(seed * 1000 + worker_index)
        self._open: dict[int, _Open] = {}

    @property
    def version(self) -> int:
        return self.engine.version

    def round(self, new_groups: int) -> RoundResult:
        skipped = self._submit(new_groups)
        finished, busy = [], 0.0
        deadline = time.perf_counter() + self.round_seconds
        before = self._in_flight_tokens()
        while self.engine.has_unfinished() and time.perf_counter() < deadline:
            t0 = time.perf_counter()
            for sample in self.engine.step():
                group = self._open[sample.group_id]
                group.samples.append(sample)
                if len(group.samples) == self.group_size:
                    finished.append(self._close(sample.group_id))
            busy += time.perf_counter() - t0
        generated = sum(len(r.token_ids) for g in finished for r in g.rollouts) + self._in_flight_tokens() - before
        return RoundResult(groups=finished, in_flight_groups=len(self._open), generated_tokens=generated,
                           busy_s=busy, version=self.engine.version, skipped_long_prompts=skipped,
                           canary_sums=self._token_canaries(finished), state=self.state_dict())

    def _token_canaries(self, groups: list[GeneratedGroup]) -> dict[str, float]:
        """Rare-token and gibberish monitors (no gate), summed over rollouts; the controller averages."""
        sums: dict[str, float] = {}
        for rollout in (r for g in groups for r in g.rollouts):
            fractions = rare_token_fractions(rollout.token_ids, self.vocab_size, self.rare_bands)
            for band, value in fractions.items():
                key = f"canary/rare_token_frac_top{band:.0%}"
                sums[key] = sums.get(key, 0.0) + value
            key = "canary/gibberish_frac"
            sums[key] = sums.get(key, 0.0) + gibberish_fraction(rollout.token_ids, rollout.logprobs, self.vocab_size)
        return sums

    def update_weights(self, state_dict, version: int) -> dict[str, float]:
        stats = self.engine.update_weights(state_dict, version=version)
        return {"sync/update_s": stats.seconds, "sync/bytes": float(stats.num_bytes), "sync/version": float(version)}

    def state_dict(self) -> dict:
        """Prompt-stream position and sampling-seed generator: enough to continue the same streams."""
        return {"prompt_source": self.source.state_dict(), "seed_rng": self._rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        self.source.load_state_dict(state["prompt_source"])
        if "seed_rng" in state:
            self._rng.bit_generator.state = state["seed_rng"]

    def close(self) -> None:
        self.engine.close()

    # ------------------------------------------------------------------ helpers

    def _submit(self, n: int) -> int:
        skipped = 0
        tokenizer = self.engine.tokenizer
        for prompt in self.source.next_prompts(n) if n > 0 else []:
            text = tokenizer.apply_chat_template(prompt.chat(), add_generation_prompt=True, tokenize=False)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) > self.max_prompt_tokens:
                skipped += 1
                continue
            seed = int(self._rng.integers(2**31))
            group = self.engine.submit(ids, self.group_size, self.sampling, seed=seed)
            self._open[group] = _Open(prompt)
        return skipped

    def _close(self, engine_group: int) -> GeneratedGroup:
        group = self._open.pop(engine_group)
        samples = sorted(group.samples, key=lambda s: s.sample_index)
        rollouts = tuple(_to_rollout(s.output) for s in samples)
        return GeneratedGroup(group_id=f"w{self.worker_index}-{group.prompt.prompt_id}-{engine_group}",
                              prompt=group.prompt, rollouts=rollouts)

    def _in_flight_tokens(self) -> int:
        return sum(self.engine.in_flight().values())


def _to_rollout(out) -> Rollout:
    return Rollout(prompt_ids=out.prompt_ids.astype(np.int32), token_ids=out.token_ids.astype(np.int32),
                   logprobs=out.logprobs, routing=out.routing,
                   version_segments=tuple((s.start, s.version) for s in out.version_segments),
                   finish_reason=out.finish_reason, text=out.text)
