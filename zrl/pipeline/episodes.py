"""Multi-turn episodes on a rollout engine: one token sequence per episode, the policy's tokens marked.

`EpisodeRunner` keeps many episodes in flight on one engine (serving.engine.RolloutEngine or anything with
its `submit` / `version` / `max_model_len`): each policy turn is one engine request of the whole sequence so
far, so turns of different episodes batch together as the engine's continuous batching allows. The owner
runs the engine's steps and hands every finished sample of the runner's requests to `on_sample`, which
records the turn, asks the episode for the environment's reply and submits the next turn, or returns the
finished episode.

Per episode, the response is the policy's turns and the environment's replies back to back:
- `policy_mask` [Tr]: True on the policy's tokens (trained), False on the replies' (context only, logprob 0);
- `version_segments`: each turn's segments shifted to its place in the response, so a weight sync in the
  middle of an episode versions the tokens sampled after it; a reply's tokens lie inside the last segment
  (they are not sampled, and the staleness anchor reads the policy's tokens only);
- `routing` [Tp + Tr, L]: each position's rows from the turn whose forward first computed it (the prompt and
  a reply in the prefill of the turn after them, a policy token in its own turn's decode), i.e. the routing
  under which the behaviour logprobs were computed; NO_ROUTE for the last token, which no forward ran.
An episode ends when its turn says done, at `max_turns` policy messages, when the next turn would not fit
(`max_response_tokens` response tokens, or the engine's `max_model_len`), when a policy message was cut by
the token budget, when the engine aborted a turn, or when the environment raised (reward 0, the error kept).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from zrl.env.episode import Episode, Turn
from zrl.types import NO_ROUTE, Rollout

SEED_STRIDE = 1 << 20  # turn k of an episode seeded s samples with seed s + k * SEED_STRIDE
END_REASONS = ("done", "max_turns", "response_budget", "context", "truncated", "env_error", "abort")
_FINISH = {"done": "stop", "max_turns": "stop", "env_error": "stop", "response_budget": "length",
           "context": "length", "truncated": "length", "abort": "abort"}


@dataclass(frozen=True)
class EpisodeOutput:
    rollout: Rollout
    reward: float
    end_reason: str               # one of END_REASONS
    turns: int                    # policy messages
    tool_calls: int
    tool_errors: int
    error: str | None = None      # what the environment raised (end_reason "env_error")


@dataclass
class _Open:
    episode: Episode
    prompt_ids: np.ndarray
    seed: int | None
    tokens: list[int] = field(default_factory=list)
    policy: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    routing: list[np.ndarray] = field(default_factory=list)   # row blocks, positions 0 .. routed - 1
    segments: list[tuple[int, int]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    reward: float = 0.0

    @property
    def routed(self) -> int:
        return sum(len(rows) for rows in self.routing)


class EpisodeRunner:
    def __init__(self, engine, sampling, render_reply: Callable[[Sequence[dict], int | None], list[int]], *,
                 max_turns: int, max_response_tokens: int) -> None:
        """`sampling`: a serving.engine.SamplingConfig for every policy turn (its max_tokens caps one turn);
        `render_reply(messages, last_token)`: the token ids that append the environment's messages to the
        conversation after a policy message ending in `last_token` and open the policy's next turn
        (zrl.env.chat.ChatContinuation.reply_ids)."""
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.engine = engine
        self.sampling = sampling
        self.render_reply = render_reply
        self.max_turns = max_turns
        self.max_response_tokens = max_response_tokens
        self._open: dict[int, _Open] = {}  # engine group id of the current turn -> its episode

    def owns(self, group_id: int) -> bool:
        return group_id in self._open

    def __len__(self) -> int:
        return len(self._open)

    def start(self, episode: Episode, prompt_ids: Sequence[int], seed: int | None = None) -> None:
        state = _Open(episode, np.asarray(prompt_ids, dtype=np.int64), seed)
        if not self._submit(state):
            raise ValueError(f"a prompt of {len(state.prompt_ids)} tokens leaves no room to generate "
                             f"(max_model_len {self.engine.max_model_len})")

    def on_sample(self, sample) -> EpisodeOutput | None:
        """Take the finished turn `sample` (a serving.engine.FinishedSample of this runner's); returns the
        episode's output when it ended, else None (its next turn is submitted)."""
        state = self._open.pop(sample.group_id)
        out = sample.output
        start = len(state.tokens)
        total = len(state.prompt_ids) + start + len(out.token_ids)
        state.routing.append(np.asarray(out.routing[state.routed: total - 1]))  # the last row: no forward ran it
        for segment in out.version_segments:
            if not state.segments or state.segments[-1][1] != segment.version:
                state.segments.append((start + segment.start, segment.version))
        state.tokens += out.token_ids.tolist()
        state.policy += [True] * len(out.token_ids)
        state.logprobs += out.logprobs.tolist()
        state.texts.append(out.text)
        state.turns += 1
        if out.finish_reason == "abort":
            return self._end(state, "abort")
        if out.finish_reason == "length" and self._budget(state) <= 0:
            return self._end(state, "truncated")
        try:
            turn = state.episode.step(out.text)
        except Exception as exc:  # an environment's failure costs this episode's reward, not the run
            return self._end(state, "env_error", error=f"{type(exc).__name__}: {exc}")
        state.tool_calls += turn.tool_calls
        state.tool_errors += turn.tool_errors
        if turn.reward is not None:
            state.reward = float(turn.reward)
        if turn.done:
            return self._end(state, "done")
        if state.turns >= self.max_turns:
            return self._end(state, "max_turns")
        reply = list(self.render_reply(turn.messages, state.tokens[-1] if state.tokens else None))
        if len(state.tokens) + len(reply) >= self.max_response_tokens:
            return self._end(state, "response_budget")
        state.tokens += reply
        state.policy += [False] * len(reply)
        state.logprobs += [0.0] * len(reply)
        state.texts.append("".join(m["content"] for m in turn.messages))
        if not self._submit(state):  # the next turn would not fit the context: the reply stays out
            kept = len(state.tokens) - len(reply)
            del state.tokens[kept:], state.policy[kept:], state.logprobs[kept:]
            state.texts.pop()
            return self._end(state, "context")
        return None

    def _budget(self, state: _Open) -> int:
        """Tokens the policy's next turn may generate."""
        length = len(state.prompt_ids) + len(state.tokens)
        return min(self.sampling.max_tokens, self.max_response_tokens - len(state.tokens),
                   self.engine.max_model_len - length)

    def _submit(self, state: _Open) -> bool:
        budget = self._budget(state)
        if budget < 1:
            return False
        seed = None if state.seed is None else state.seed + state.turns * SEED_STRIDE
        ids = np.concatenate([state.prompt_ids, np.asarray(state.tokens, dtype=np.int64)])
        group = self.engine.submit(ids, 1, dataclasses.replace(self.sampling, max_tokens=budget), seed=seed)
        self._open[group] = state
        return True

    def _end(self, state: _Open, reason: str, error: str | None = None) -> EpisodeOutput:
        state.episode.close()
        total = len(state.prompt_ids) + len(state.tokens)
        routing = np.concatenate(state.routing) if state.routing else np.zeros((0, 0), np.uint8)
        rows = np.full((total, routing.shape[1]), NO_ROUTE, np.uint8)
        rows[: len(routing)] = routing
        rollout = Rollout(
            prompt_ids=state.prompt_ids.astype(np.int32), token_ids=np.asarray(state.tokens, np.int32),
            logprobs=np.asarray(state.logprobs, np.float32), routing=rows, version_segments=tuple(state.segments),
            finish_reason=_FINISH[reason], text="".join(state.texts), policy_mask=np.asarray(state.policy, bool))
        reward = 0.0 if reason == "env_error" else state.reward
        return EpisodeOutput(rollout, reward, reason, state.turns, state.tool_calls, state.tool_errors, error)


__all__ = ["END_REASONS", "EpisodeOutput", "EpisodeRunner"]
