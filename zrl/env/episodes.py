"""Multi-turn episodes on a rollout engine: one token sequence per episode, the policy's tokens marked.

`EpisodeRunner` keeps many episodes in flight on one engine (serving.engine.RolloutEngine or anything with
its `submit` / `version` / `max_model_len`): each policy turn is one engine request of the whole sequence so
far, so turns of different episodes batch together as the engine's continuous batching allows. The owner
runs the engine's steps on one thread and hands every finished sample of the runner's requests to
`on_sample`, which records the turn and asks the episode for the environment's reply on the runner's
environment threads (a tool in a sandbox takes tens of milliseconds; the engine keeps decoding the other
episodes meanwhile). `poll` applies the replies that came back, on the owner's thread: it submits the
next turns and returns the episodes that ended.

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
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import numpy as np

from zrl.env.episode import Episode, Turn
from zrl.types import NO_ROUTE, Rollout, Verification

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
    key: Hashable = None          # the owner's tag for the episode, given to `start`


@dataclass
class _Open:
    episode: Episode
    prompt_ids: np.ndarray
    sampling: object              # serving.engine.SamplingConfig of every turn (its max_tokens caps one turn)
    max_turns: int
    max_response_tokens: int
    seed: int | None
    key: Hashable
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
    def __init__(self, engine, render_reply: Callable[[Sequence[dict], int | None], list[int]],
                 env_threads: int = 8) -> None:
        """`render_reply(messages, last_token)`: the token ids that append the environment's messages to the
        conversation after a policy message ending in `last_token` and open the policy's next turn
        (zrl.env.chat.ChatContinuation.reply_ids); `env_threads`: the environment steps that run at once."""
        self.engine = engine
        self.render_reply = render_reply
        self._open: dict[int, _Open] = {}          # engine group id of the current turn -> its episode
        self._stepping: dict[Future, _Open] = {}   # an environment step running -> its episode
        self._ended: list[EpisodeOutput] = []      # not yet returned by `poll`
        self._pool = ThreadPoolExecutor(env_threads, thread_name_prefix="episode-step")

    def owns(self, group_id: int) -> bool:
        return group_id in self._open

    def __len__(self) -> int:
        """Episodes started and not yet returned by `poll`."""
        return len(self._open) + len(self._stepping) + len(self._ended)

    @property
    def stepping(self) -> int:
        """Episodes waiting for their environment's reply (no engine request in flight)."""
        return len(self._stepping)

    def recorded_policy_tokens(self) -> int:
        """Policy tokens of the finished turns of the episodes still open (the engine counts the running turns')."""
        return sum(sum(state.policy) for state in [*self._open.values(), *self._stepping.values()])

    def start(self, episode: Episode, prompt_ids: Sequence[int], sampling, *, max_turns: int, max_response_tokens: int,
              seed: int | None = None, key: Hashable = None) -> None:
        """Start `episode` on `prompt_ids`: every policy turn samples with `sampling` (a serving.engine
        SamplingConfig; its max_tokens caps one turn), the episode ends after `max_turns` policy messages or
        `max_response_tokens` response tokens (the policy's and the replies'); turn k is seeded
        `seed + k * SEED_STRIDE`; `key` comes back in its EpisodeOutput."""
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        state = _Open(episode, np.asarray(prompt_ids, dtype=np.int64), sampling, max_turns, max_response_tokens, seed,
                      key)
        if not self._submit(state):
            raise ValueError(f"a prompt of {len(state.prompt_ids)} tokens leaves no room to generate "
                             f"(max_model_len {self.engine.max_model_len})")

    def on_sample(self, sample) -> None:
        """Take the finished turn `sample` (a serving.engine.FinishedSample of this runner's): record it and
        ask its episode for the environment's reply (on an environment thread; `poll` applies it)."""
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
            self._end(state, "abort")
        elif out.finish_reason == "length" and self._budget(state) <= 0:
            self._end(state, "truncated")
        else:
            self._stepping[self._pool.submit(state.episode.step, out.text)] = state

    def poll(self, timeout: float | None = 0.0) -> list[EpisodeOutput]:
        """Apply the environment replies that came back (first waiting up to `timeout` seconds for one, when
        any is pending and none has come back; None: as long as it takes): submit the next turns and return
        the episodes that ended since the last call."""
        if self._stepping and not self._ended and timeout != 0:
            wait(self._stepping, timeout=timeout, return_when=FIRST_COMPLETED)
        for future in [f for f in self._stepping if f.done()]:  # in the order the steps started
            self._take_turn(self._stepping.pop(future), future)
        ended, self._ended = self._ended, []
        return ended

    def close(self) -> None:
        """Stop: episodes still open are closed without an output (their group is lost with the worker)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        for state in [*self._open.values(), *self._stepping.values()]:
            state.episode.close()
        self._open.clear()
        self._stepping.clear()

    def _take_turn(self, state: _Open, step: Future) -> None:
        try:
            turn: Turn = step.result()
        except Exception as exc:  # an environment's failure costs this episode's reward, not the run
            return self._end(state, "env_error", error=f"{type(exc).__name__}: {exc}")
        state.tool_calls += turn.tool_calls
        state.tool_errors += turn.tool_errors
        if turn.reward is not None:
            state.reward = float(turn.reward)
        if turn.done:
            return self._end(state, "done")
        if state.turns >= state.max_turns:
            return self._end(state, "max_turns")
        reply = list(self.render_reply(turn.messages, state.tokens[-1] if state.tokens else None))
        if len(state.tokens) + len(reply) >= state.max_response_tokens:
            return self._end(state, "response_budget")
        state.tokens += reply
        state.policy += [False] * len(reply)
        state.logprobs += [0.0] * len(reply)
        state.texts.append("".join(m["content"] for m in turn.messages))
        if not self._submit(state):  # the next turn would not fit the context: the reply stays out
            kept = len(state.tokens) - len(reply)
            del state.tokens[kept:], state.policy[kept:], state.logprobs[kept:]
            state.texts.pop()
            self._end(state, "context")

    def _budget(self, state: _Open) -> int:
        """Tokens the policy's next turn may generate."""
        length = len(state.prompt_ids) + len(state.tokens)
        return min(state.sampling.max_tokens, state.max_response_tokens - len(state.tokens),
                   self.engine.max_model_len - length)

    def _submit(self, state: _Open) -> bool:
        budget = self._budget(state)
        if budget < 1:
            return False
        seed = None if state.seed is None else state.seed + state.turns * SEED_STRIDE
        ids = np.concatenate([state.prompt_ids, np.asarray(state.tokens, dtype=np.int64)])
        group = self.engine.submit(ids, 1, dataclasses.replace(state.sampling, max_tokens=budget), seed=seed)
        self._open[group] = state
        return True

    def _end(self, state: _Open, reason: str, error: str | None = None) -> None:
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
        self._ended.append(EpisodeOutput(rollout, reward, reason, state.turns, state.tool_calls, state.tool_errors,
                                         error, state.key))


def run_episodes(engine, env, prompts: Sequence, prompt_ids: Sequence[Sequence[int]], samples: int, sampling,
                 max_response_tokens: int) -> list[list[EpisodeOutput]]:
    """Each prompt's `samples` episodes of `env` (an EpisodicEnvironment), run to their end on an engine nothing
    else uses (an evaluation). Sample i of prompt j is seeded `sampling.seed + j * samples + i`, as
    RolloutEngine.generate seeds single-turn samples."""
    from zrl.env.chat import ChatContinuation

    runner = EpisodeRunner(engine, ChatContinuation(engine.tokenizer).reply_ids)
    outputs: list[list] = [[None] * samples for _ in prompts]
    try:
        for j, (prompt, ids) in enumerate(zip(prompts, prompt_ids)):
            for i in range(samples):
                seed = None if sampling.seed is None else sampling.seed + j * samples + i
                runner.start(env.episode(prompt), ids, sampling, max_turns=env.max_turns,
                             max_response_tokens=max_response_tokens, seed=seed, key=(j, i))
        while len(runner):
            for sample in engine.step() if engine.has_unfinished() else ():
                runner.on_sample(sample)
            for out in runner.poll(timeout=0.0 if engine.has_unfinished() else None):
                outputs[out.key[0]][out.key[1]] = out
    finally:
        runner.close()
    return outputs


def episode_verification(out: EpisodeOutput) -> Verification:
    """An episode's reward as a verification (the environment scored it while it ran): its end reason is the
    counted `reason`, and its turns and tool calls are metadata."""
    return Verification(reward=out.reward, error=out.error,
                        metadata={"reason": out.end_reason, "turns": out.turns, "tool_calls": out.tool_calls,
                                  "tool_errors": out.tool_errors, "used_tools": float(out.tool_calls > 0)})


__all__ = ["END_REASONS", "EpisodeOutput", "EpisodeRunner", "episode_verification", "run_episodes"]
