"""RolloutWorker: one vLLM engine generating groups for one stage (a Ray actor hosts it; docs/design.md,
style rule 1).

The stage loop drives it in short *rounds*: `round(new_groups)` draws that many prompts from the
stage's prompt source, submits G samples of each, runs engine steps for at most `round_seconds`, and
reports the groups that finished. Prompts are drawn on a background thread while the engine decodes
what is already in flight, so a slow generator (RLVE-Gym's run in child processes with a per-problem
time limit) never stops generation: drawn prompts join the running batch at the next engine step, and a
draw still running when the round ends carries over to the next round. The engine waits for a draw only
when it has nothing else to decode. Requests still running stay in the engine between rounds with their
KV cache and CCA state, so a weight update (queued between two rounds by the loop) lands between
engine steps while generation is in flight (PipelineRL "keep"): tokens sampled after it carry the new
version in their segments.

Data plane: a finished group's arrays (token ids, logprobs, routing) never travel in the round's
report. The worker `publish`es each group twice (Ray: `ray.put`, so both stay in the object store):
whole, for the buffer, and as its `GroupText` (prompt and responses), for the verifier, which then
never pulls routing records. The report carries a `GroupTicket`: ids, counts and both references.
The loop, which reads only reports, never holds rollout arrays.

Held-out evaluation (`evaluate`, zrl/pipeline/held_out.py): between two rounds, an entry's `eval` split
prompts join the engine's running batch like a round's groups, with the weights the engine holds; the
round's groups keep decoding beside them, and those that finish during it are reported with the next
round. It returns when every evaluation sample is done (one policy version: a sync is a call of its own).
At the stage's end (`evaluate_export`) the worker stops its stream, loads the stage's export from disk in
place and evaluates that: the export is what is measured, on the engine that is already up.

Stages: a worker serves one RL stage at a time. `begin_stage` moves it to the next one (the cascade
carries workers between consecutive RL stages, zrl/pipeline/controller.py): the old stream ends
(`end_stream`), the new stage's prompt source, sampling settings and seeds replace it, the engine and
its weights stay (the stage's first sync replaces them).

Weight sync: `join_sync` makes the worker a receiver of the trainer's sync group; `receive_weights`
takes one streamed sync and loads it in place as it arrives (zrl.pipeline.weight_sync).
`update_weights` is the fallback that loads a whole state dict (or a reference to one). In a LoRA run
synced adapter-only (serving/lora_sync.py; the engine started with `engine_lora`), a sync carries the
adapters alone: they are written as a PEFT directory and loaded as the new version's adapter, which new
requests take while requests in flight finish with theirs.

Multi-turn environments (zrl.env.episode.EpisodicEnvironment): each of a group's G samples is an episode
that the worker's `EpisodeRunner` (zrl/env/episodes.py) drives on the same engine, beside the
single-turn groups; its turns batch with everything else, its environment steps run on the runner's
threads. The group is reported when its G episodes ended; the episodes' own rewards travel in its
`GroupText` (`verifications`), so the verifier does not score them again.

Invariants: a group is reported once, complete (all G samples); draws are submitted in stream order,
and the reported state counts only submitted draws (a restarted worker draws pending ones again: they
never made a group); `in_flight_groups` includes groups still being drawn; prompts longer than
`max_prompt_tokens` are skipped and counted, never truncated; a group's id is its place in the prompt
stream (`stream_group_id`).
"""

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from zrl.canaries import gibberish_fraction, rare_token_fractions
from zrl.config.schema import RLStage
from zrl.env.chat import ChatContinuation
from zrl.env.episode import EpisodicEnvironment
from zrl.env.episodes import EpisodeOutput, EpisodeRunner, episode_verification
from zrl.env.errors import EnvErrorLog
from zrl.host_memory import HostPeakMemory
from zrl.models import family_of_checkpoint
from zrl.prompts import Assignment, PromptSource, build_entries
from zrl.types import Prompt, Rollout, Verification, rollout_array_bytes, stream_group_id

if TYPE_CHECKING:  # imported where used: the verifiers and the buffer load this module (its groups) without torch
    from zrl.pipeline.weight_sync import SyncAddress, SyncGroup


# With nothing to decode, how long the worker waits for an environment's reply before it looks at its
# prompt draws again (a draw that ends meanwhile would otherwise wait for a slow tool).
ENV_POLL_S = 0.05


@dataclass(frozen=True)
class GeneratedGroup:
    """G finished samples of one prompt, before verification."""

    group_id: str
    prompt: Prompt
    rollouts: tuple[Rollout, ...]
    verifications: tuple[Verification, ...] | None = None  # episodes' own rewards (a multi-turn environment)


@dataclass(frozen=True)
class GroupText:
    """What a verifier reads of a group: the prompt and the decoded responses, no arrays; a multi-turn
    group's episodes were scored by their environment as they ran (`verifications`, one per response)."""

    prompt: Prompt
    texts: tuple[str, ...]
    verifications: tuple[Verification, ...] | None = None


@dataclass(frozen=True)
class GroupTicket:
    """A finished group as the stage loop sees it: ids and counts; the data stays behind references."""

    group_id: str
    num_rollouts: int
    ref: Any                       # what `publish` returned for the GeneratedGroup (Ray: an ObjectRef)
    text_ref: Any                  # ... and for its GroupText (the verifier fetches only this)
    level: tuple[str, int] | None = None  # (scheduler key, level) of a `difficulty: adaptive` entry's group


@dataclass(frozen=True)
class RoundReport:
    tickets: list[GroupTicket]
    in_flight_groups: int          # groups still generating in this worker
    generated_tokens: int          # response tokens sampled during the round
    busy_s: float                  # wall time spent in engine steps
    policy_version: int            # the engine's policy version at the end of the round
    skipped_long_prompts: int = 0
    skipped_levels: tuple = ()     # (scheduler key, level) of each skipped prompt of an adaptive entry
    array_bytes: int = 0           # bytes of the finished groups' rollout arrays (published, not in the report)
    canary_sums: dict = field(default_factory=dict)  # monitor name -> sum over the finished rollouts
    environment_counts: dict = field(default_factory=dict)  # entry key -> its environment's metrics()
    state: dict = field(default_factory=dict)         # the worker's state_dict() after the round


@dataclass(frozen=True)
class HeldOutReport:
    """A held-out evaluation on a rollout worker: each entry's result (zrl.evaluate.EvalResult) with the
    weights of `policy_version`."""

    policy_version: int
    results: tuple                 # ((entry key, EvalResult), ...) in the requests' order
    seconds: float


@dataclass(frozen=True)
class SyncReceived:
    """What a rollout worker did in one weight sync (the typed reply to the loop)."""

    policy_version: int
    seconds: float                 # receiving and loading (the engine is paused this long)
    num_bytes: int
    peak_extra_bytes: int          # host memory peak above the level before the sync (-1 unknown)


@dataclass(frozen=True)
class _Draw:
    """A draw of the prompt stream running (or done) on the background thread, not yet submitted."""

    index: int                     # its place in the stream (PromptSource.draws before it)
    groups: int
    result: Future                 # -> PromptSource.draw's list of (prompt, level)


@dataclass
class _Open:
    group_id: str | tuple        # a stream group id; ("eval", request, prompt) for an evaluation's prompt
    prompt: Prompt
    size: int                    # samples
    level: tuple[str, int] | None = None
    samples: dict = field(default_factory=dict)  # sample index -> the engine's SampleOutput or an EpisodeOutput


class RolloutWorker:
    def __init__(self, worker_index: int, model_path: str | Path, stage: RLStage, seed: int, dtype: str,
                 policy_version: int = 0, kernels: str = "auto", publish: Callable[[GeneratedGroup], Any] | None = None,
                 round_seconds: float = 0.5, max_num_seqs: int = 256, prefix_caching: bool = False,
                 max_model_len: int | None = None, engine_lora: dict | None = None):
        """`seed`: the stage's seed (the recipe's, offset by the stage); `publish`: how a finished group
        is handed on (None: the report carries the group itself, for in-process use); `max_model_len`: the
        engine's longest sequence (default: the stage's prompt + response limit; the cascade sizes it for
        its longest RL stage, so the worker can be carried into each of them, `begin_stage`); `engine_lora`: vLLM's
        LoRA arguments of an adapter-only sync (serving.lora_sync.engine_lora_args), None otherwise."""
        from serving.engine import RolloutEngine
        from zrl.modeling import kernels as kernel_backend

        kernel_backend.set_backend(kernels)
        s = stage.sampling
        self.worker_index = worker_index
        self.round_seconds = round_seconds
        self.publish = publish if publish is not None else (lambda group: group)
        self.engine = RolloutEngine(model_path, dtype=dtype,
                                    max_model_len=max_model_len or s.max_prompt_tokens + s.max_response_tokens,
                                    max_num_seqs=max_num_seqs, seed=worker_seeds(seed, s.seed, worker_index)[0],
                                    policy_version=policy_version, prefix_caching=prefix_caching,
                                    **(engine_lora or {}))
        family = family_of_checkpoint(model_path)
        self.vocab_size = family.shape(family.read_config(model_path)).vocab_size
        self._eval_envs: dict[tuple[str, str], Any] = {}  # (entry key, its spec) -> the held-out environment
        self._eval_errors = EnvErrorLog()  # their errors: each distinct one shown once in the worker's life
        self._sync_group: SyncGroup | None = None
        self._drawer: ThreadPoolExecutor | None = None
        self._episodes: EpisodeRunner | None = None
        self.begin_stage(stage, seed)

    def begin_stage(self, stage: RLStage, seed: int) -> None:
        """Serve `stage` from here on, with the stage's `seed` (as the constructor does): the previous
        stage's stream ends (`end_stream`), the engine and its weights stay. Every sample is seeded per
        request from the prompt stream's generator, so a carried engine samples what a fresh one would."""
        from serving.engine import SamplingConfig

        s = stage.sampling
        if s.max_prompt_tokens + s.max_response_tokens > self.engine.max_model_len:
            raise ValueError(f"stage {stage.name!r} needs sequences of {s.max_prompt_tokens + s.max_response_tokens} "
                             f"tokens; this rollout worker's engine takes {self.engine.max_model_len}")
        self.end_stream()
        self.stage = stage
        self.group_size = s.group_size
        self.max_prompt_tokens = s.max_prompt_tokens
        self.sampling = SamplingConfig(max_tokens=s.max_response_tokens, temperature=s.temperature, top_p=s.top_p,
                                       top_k=max(s.top_k, 0), min_p=s.min_p, stop=tuple(s.stop))
        stream_seed = worker_seeds(seed, s.seed, self.worker_index)[1]
        self.source = PromptSource(stage.environments, seed=stream_seed)
        self.rare_bands = tuple(stage.algorithm.canaries.rare_token_bands)
        self._rng = np.random.default_rng(stream_seed)
        self._envs = {e.key: e.env for e in self.source.entries}
        self._drawer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prompt-draw")

    def end_stream(self) -> None:
        """Stop the stage's prompt stream for good: draws are cancelled, unfinished groups and episodes
        dropped, the engine emptied. Evaluations (`evaluate`) and weight loads still work."""
        if self._drawer is not None:
            self._drawer.shutdown(wait=False, cancel_futures=True)
            self._drawer = None
        if self._episodes is not None:
            self._episodes.close()
            self._episodes = None  # the next multi-turn group starts a runner (`_start_samples`)
        self.engine.abort_all()
        self._open: dict[str | tuple, _Open] = {}      # group id -> its samples so far
        self._evaluated: dict[tuple, list] = {}         # an evaluation's finished prompts -> their samples
        self._engine_groups: dict[int, str] = {}        # engine group id of a single-turn group -> stream group id
        self._finished: list[tuple[GeneratedGroup, tuple[str, int] | None]] = []  # closed, not yet reported
        self._reported_in_flight_tokens = 0  # tokens of unfinished samples the last report counted
        self._drawing: deque[_Draw] = deque()

    @property
    def policy_version(self) -> int:
        return self.engine.version

    def round(self, new_groups: int, levels: dict[str, Assignment] | None = None) -> RoundReport:
        """`levels`: what each adaptive entry's prompts of this round are drawn at (PromptSource.draw)."""
        if new_groups > 0:
            self._start_draw(new_groups, levels or {})
        busy = 0.0
        deadline = time.perf_counter() + self.round_seconds
        skipped = self._submit_drawn()  # levels of the prompts skipped as too long (None: not adaptive)
        while (now := time.perf_counter()) < deadline:
            if not self.engine.has_unfinished():  # nothing to decode until an environment replies or a draw ends
                if self._episodes is not None and self._episodes.stepping:
                    self._take_episodes(timeout=min(deadline - now, ENV_POLL_S))
                elif self._drawing:
                    wait([self._drawing[0].result], timeout=deadline - now)
                else:
                    break
                skipped += self._submit_drawn()
                continue
            for sample in self.engine.step():
                self._take(sample)
            busy += time.perf_counter() - now
            self._take_episodes()
            skipped += self._submit_drawn()
        finished, self._finished = self._finished, []
        in_flight_tokens = self._in_flight_tokens()
        generated = (sum(r.num_policy_tokens for g, _ in finished for r in g.rollouts) + in_flight_tokens
                     - self._reported_in_flight_tokens)
        self._reported_in_flight_tokens = in_flight_tokens
        tickets = [GroupTicket(g.group_id, len(g.rollouts), self.publish(g),
                               self.publish(GroupText(g.prompt, tuple(r.text for r in g.rollouts), g.verifications)),
                               level)
                   for g, level in finished]
        in_flight = len(self._open) + sum(d.groups for d in self._drawing)
        return RoundReport(tickets=tickets, in_flight_groups=in_flight, generated_tokens=generated,
                           busy_s=busy, policy_version=self.engine.version, skipped_long_prompts=len(skipped),
                           skipped_levels=tuple(level for level in skipped if level is not None),
                           array_bytes=sum(rollout_array_bytes(r) for g, _ in finished for r in g.rollouts),
                           canary_sums=self._token_canaries([g for g, _ in finished]), state=self.state_dict(),
                           environment_counts={e.key: e.env.metrics() for e in self.source.entries})

    def evaluate_export(self, checkpoint: str, requests: list, seed: int, version: int) -> HeldOutReport | None:
        """A stage's end: the prompt stream stops for good (`end_stream`), the engine loads the stage's
        export from `checkpoint` in place (as policy `version`), and `requests` are evaluated on it as
        `evaluate` does: the same results as a fresh engine on the export, without starting one. None
        (nothing loaded) when a problem's prompt and response would not fit the engine, which a fresh
        engine sized for the requests would take."""
        self.end_stream()
        problems = self._held_out_problems(requests, seed)
        if any(len(ids) + r.max_response_tokens > self.engine.max_model_len
               for (_, r), (kept, _) in zip(requests, problems) for _, ids in kept):
            return None
        adapter = Path(checkpoint).parent / "adapter"  # RunDir.stage_adapter beside RunDir.stage_hf
        if self.engine.serves_adapters and adapter.is_dir():
            # The engine's base stays the trainer's: the export's adapters, not its merged weights, so that
            # the next RL stage's adapters land on the same base.
            import shutil
            import tempfile

            copy = tempfile.mkdtemp(prefix=f"zrl-adapter-v{version}-")  # the engine owns (and deletes) it
            self.engine.load_adapter(shutil.copytree(adapter, copy, dirs_exist_ok=True), version)
        else:
            self.engine.update_weights(checkpoint, version=version)
        return self.evaluate(requests, seed, checkpoint=checkpoint, problems=problems)

    def evaluate(self, requests: list, seed: int, checkpoint: str | None = None,
                 problems: list | None = None) -> HeldOutReport:
        """Held-out evaluation with the engine's current weights (the module docstring): `requests` are
        (entry key, zrl.evaluate.EvalRequest) pairs, `seed` the recipe's, as at the stage's end;
        `checkpoint` names what the results evaluated (default: the policy version); `problems`: what
        `_held_out_problems` drew for them already."""
        from serving.engine import SamplingConfig
        from zrl.evaluate import score

        start, version = time.perf_counter(), self.engine.version
        problems = self._held_out_problems(requests, seed) if problems is None else problems
        for i, ((key, r), (kept, _)) in enumerate(zip(requests, problems)):
            sampling = SamplingConfig(max_tokens=r.max_response_tokens, temperature=r.temperature, seed=seed)
            n = r.samples_per_prompt
            for j, (prompt, ids) in enumerate(kept):  # the seeds RolloutEngine.generate gives the stage-end evaluation
                self._open[("eval", i, j)] = _Open(("eval", i, j), prompt, n)
                self._start_samples(("eval", i, j), self._eval_env(key, r.environment), ids, n, sampling,
                                    seed + j * n, r.max_response_tokens)
        groups = sum(len(kept) for kept, _ in problems)
        while len(self._evaluated) < groups:  # a round's samples finishing meanwhile are reported next round
            for sample in self.engine.step() if self.engine.has_unfinished() else ():
                self._take(sample)
            self._take_episodes(timeout=0.0 if self.engine.has_unfinished() else None)
        name = checkpoint or f"policy version {version}"
        results = []
        for i, ((key, r), (kept, skipped)) in enumerate(zip(requests, problems)):
            outputs = [self._evaluated.pop(("eval", i, j)) for j in range(len(kept))]
            results.append((key, score(name, self._eval_env(key, r.environment), r, [p for p, _ in kept], outputs,
                                       skipped, self._eval_errors)))
        return HeldOutReport(version, tuple(results), time.perf_counter() - start)

    def _held_out_problems(self, requests: list, seed: int) -> list[tuple[list, int]]:
        """Per request: its problems kept as (prompt, token ids), and how many were skipped as longer than
        its `max_prompt_tokens`."""
        problems = []
        for key, r in requests:
            prompts = self._eval_env(key, r.environment).sample(r.num_prompts, seed=seed, split=r.split)
            encoded = [(p, self._encode(p)) for p in prompts]
            kept = [(p, ids) for p, ids in encoded if r.max_prompt_tokens is None or len(ids) <= r.max_prompt_tokens]
            problems.append((kept, len(prompts) - len(kept)))
        return problems

    def _eval_env(self, key: str, spec):
        """The held-out instance of entry `key`'s environment (its own: the draw thread samples the training
        ones), built once per spec: a later stage may give the same key other options."""
        cache_key = (key, spec.model_dump_json())
        if cache_key not in self._eval_envs:
            self._eval_envs[cache_key] = build_entries([spec])[0].env
        return self._eval_envs[cache_key]

    def _token_canaries(self, groups: list[GeneratedGroup]) -> dict[str, float]:
        """Rare-token and gibberish monitors (no gate), summed over rollouts; the loop averages."""
        sums: dict[str, float] = {}
        for rollout in (r for g in groups for r in g.rollouts):
            fractions = rare_token_fractions(rollout.token_ids, self.vocab_size, self.rare_bands)
            for band, value in fractions.items():
                key = f"canary/rare_token_frac_top{band:.0%}"
                sums[key] = sums.get(key, 0.0) + value
            key = "canary/gibberish_frac"
            sums[key] = sums.get(key, 0.0) + gibberish_fraction(rollout.token_ids, rollout.logprobs, self.vocab_size)
        return sums

    # ------------------------------------------------------------------ weights

    def join_sync(self, address: "SyncAddress", group_rank: int) -> None:
        """Join the trainer's weight-sync group (blocks until every member has joined)."""
        from zrl.pipeline.weight_sync import SyncGroup

        self.leave_sync()
        self._sync_group = SyncGroup(address, group_rank)

    def leave_sync(self) -> None:
        if self._sync_group is not None:
            self._sync_group.close()
            self._sync_group = None

    def receive_weights(self) -> SyncReceived:
        """Take one streamed sync from the group and load it in place as it arrives."""
        from serving.worker_ext import WeightStream
        from zrl.pipeline.weight_sync import drain

        if self._sync_group is None:
            raise RuntimeError(f"rollout worker {self.worker_index} is in no weight-sync group")
        start = time.perf_counter()
        with HostPeakMemory() as memory:
            header, tensors = self._sync_group.receive()
            try:
                if header.adapter_config is not None:
                    self._load_adapter(dict(tensors), header.adapter_config, header.version)
                else:
                    self.engine.update_weights(WeightStream(frozenset(header.names()), tensors), version=header.version)
            finally:
                drain(tensors)  # a failed load still completes the collective for the others
        return SyncReceived(header.version, time.perf_counter() - start, header.num_bytes, memory.peak_extra_bytes)

    def update_weights(self, state_dict, version: int) -> SyncReceived:
        """Fallback sync: load a whole state dict (or an object reference to one) in place."""
        from zrl.pipeline.weight_sync import AdapterState

        start = time.perf_counter()
        with HostPeakMemory() as memory:
            if isinstance(state_dict, AdapterState):  # an adapter-only sync's (Ray resolved the reference)
                stats = self._load_adapter(state_dict.tensors, state_dict.config, version)
            else:
                stats = self.engine.update_weights(state_dict, version=version)
        return SyncReceived(version, time.perf_counter() - start, stats.num_bytes, memory.peak_extra_bytes)

    def _load_adapter(self, tensors: dict, config: dict, version: int):
        """An adapter-only sync's adapters, written as a PEFT directory the engine then owns, as `version`."""
        import tempfile

        from zrl.modeling.lora import write_peft_adapter

        path = write_peft_adapter(tensors, config, tempfile.mkdtemp(prefix=f"zrl-adapter-v{version}-"))
        return self.engine.load_adapter(path, version, num_bytes=sum(t.numel() * t.element_size()
                                                                     for t in tensors.values()))

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """Prompt-stream position (submitted draws only) and sampling-seed generator: enough to continue
        the same streams."""
        source = self.source.state_dict()
        if self._drawing:
            source["draws"] = self._drawing[0].index
        return {"prompt_source": source, "seed_rng": self._rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        self.source.load_state_dict(state["prompt_source"])
        if "seed_rng" in state:
            self._rng.bit_generator.state = state["seed_rng"]

    def close(self) -> None:
        if self._drawer is not None:
            self._drawer.shutdown(wait=False, cancel_futures=True)
        if self._episodes is not None:
            self._episodes.close()
        self.leave_sync()
        self.engine.close()

    # ------------------------------------------------------------------ helpers

    def _start_draw(self, n: int, levels: dict[str, Assignment]) -> None:
        """Queue the stream's next draw on the background thread (one thread: draws run in order)."""
        index = self._drawing[-1].index + 1 if self._drawing else self.source.draws
        self._drawing.append(_Draw(index, n, self._drawer.submit(self.source.draw, n, levels)))

    def _submit_drawn(self) -> list[tuple[str, int] | None]:
        """Submit the finished draws at the head of the queue, in order; the level of each prompt skipped
        as too long. A draw that raised (an environment's fault) raises here."""
        skipped = []
        while self._drawing and self._drawing[0].result.done():
            draw = self._drawing[0]
            for position, (prompt, level) in enumerate(draw.result.result()):
                ids = self._encode(prompt)
                if len(ids) > self.max_prompt_tokens:
                    skipped.append(level)
                    continue
                seed = int(self._rng.integers(2**31))
                group = _Open(stream_group_id(self.worker_index, draw.index, position, prompt.prompt_id), prompt,
                              self.group_size, level)
                self._open[group.group_id] = group
                self._start_samples(group.group_id, self._envs[prompt.env], ids, self.group_size, self.sampling, seed,
                                    self.stage.sampling.max_response_tokens)
            self._drawing.popleft()
        return skipped

    def _start_samples(self, group_id, env, ids: list[int], n: int, sampling, seed: int, max_response_tokens: int):
        """`n` samples of the open group `group_id` on `env`, sample i seeded `seed + i`: one engine group, or
        `n` episodes of a multi-turn environment (each ends within `max_response_tokens` response tokens)."""
        if not isinstance(env, EpisodicEnvironment):
            self._engine_groups[self.engine.submit(ids, n, sampling, seed=seed)] = group_id
            return
        prompt = self._open[group_id].prompt
        if self._episodes is None:
            self._episodes = EpisodeRunner(self.engine, ChatContinuation(self.engine.tokenizer).reply_ids)
        for i in range(n):
            self._episodes.start(env.episode(prompt), ids, sampling, max_turns=env.max_turns,
                                 max_response_tokens=max_response_tokens, seed=seed + i, key=(group_id, i))

    def _encode(self, prompt: Prompt) -> list[int]:
        tokenizer = self.engine.tokenizer
        text = tokenizer.apply_chat_template(prompt.chat(), add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def _take(self, sample) -> None:
        """A finished engine sample: a turn of an episode, or a sample of a round's single-turn group."""
        if self._episodes is not None and self._episodes.owns(sample.group_id):
            self._episodes.on_sample(sample)
            return
        group_id = self._engine_groups[sample.group_id]
        self._add(group_id, sample.sample_index, sample.output)
        if group_id not in self._open:
            del self._engine_groups[sample.group_id]

    def _take_episodes(self, timeout: float = 0.0) -> None:
        if self._episodes is not None:
            for out in self._episodes.poll(timeout):
                self._add(*out.key, out)

    def _add(self, group_id, index: int, output) -> None:
        """A finished sample (SampleOutput or EpisodeOutput) of a group; the group closes when all G are in."""
        group = self._open[group_id]
        group.samples[index] = output
        if len(group.samples) < group.size:
            return
        if isinstance(group_id, tuple):  # an evaluation's prompt
            del self._open[group_id]
            self._evaluated[group_id] = [group.samples[i] for i in range(group.size)]
        else:
            self._finished.append(self._close(group_id))

    def _close(self, group_id: str) -> tuple[GeneratedGroup, tuple[str, int] | None]:
        group = self._open.pop(group_id)
        samples = [group.samples[i] for i in range(len(group.samples))]
        episodic = isinstance(samples[0], EpisodeOutput)
        rollouts = tuple(s.rollout if episodic else _to_rollout(s) for s in samples)
        verifications = tuple(episode_verification(s) for s in samples) if episodic else None
        return GeneratedGroup(group.group_id, group.prompt, rollouts, verifications), group.level

    def _in_flight_tokens(self) -> int:
        """Policy tokens sampled so far of the samples not yet finished."""
        recorded = 0 if self._episodes is None else self._episodes.recorded_policy_tokens()
        return sum(self.engine.in_flight().values()) + recorded


def worker_seeds(stage_seed: int, sampling_seed: int, worker_index: int) -> tuple[int, int]:
    """(engine seed, prompt-stream seed) of one rollout worker; `sampling_seed` is the recipe's
    `stages[].sampling.seed`, an offset that draws other prompts and samples with the same recipe."""
    seed = stage_seed + sampling_seed
    return seed + worker_index, seed * 1000 + worker_index


def _to_rollout(out) -> Rollout:
    return Rollout(prompt_ids=out.prompt_ids.astype(np.int32), token_ids=out.token_ids.astype(np.int32),
                   logprobs=out.logprobs, routing=out.routing,
                   version_segments=tuple((s.start, s.version) for s in out.version_segments),
                   finish_reason=out.finish_reason, text=out.text)
