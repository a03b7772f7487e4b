"""Markovian RSA: test-time compute by recursive aggregation of bounded reasoning tails.

Markovian RSA keeps a population of N candidate solutions per problem. Round 0 samples N independent
candidates of the problem's own prompt. Every later round builds N new candidates; each one:
- draws C distinct candidates of the previous round's population, uniformly;
- takes from each its *tail*: the last tau tokens of its reasoning section (the generated tokens before
  the end-of-thinking marker `</think>`; all generated tokens when the marker never came). In the
  PaCoRe-hybrid variant (`hybrid=True`) a finished candidate (it closed its reasoning and stopped by
  itself) forwards its answer section (the tokens after `</think>`) instead, cut to its last tau tokens;
- builds an aggregation prompt from the problem and the C tails (`AGGREGATION_TEMPLATE`, rendered
  through the model's chat template) and generates the new candidate under the thinking budget beta
  (at most beta generated tokens).
After T rounds the answer is read from the final population: a majority vote over the extracted
answers (zrl.env.extract_answer) and the mean correctness of the candidates (the environment's
verifier), reported for every round.

A candidate that spent its whole budget without closing its reasoning gets its answer forced: its
prompt and generated tokens, then `</think>`, continued for at most `answer_budget` tokens (no forcing
when `answer_budget` is 0). Forced answers are scored only; they never enter a tail.

Special cases, exact by construction:
- T = 0 is plain parallel sampling: round 0 of problem j, candidate i uses seed `seed + j * N + i`, the
  seeds `RolloutEngine.generate(prompts, N, SamplingConfig(seed=seed))` gives, on the same prompt ids.
- C = 1 is bounded continuation (Delethink): each new candidate continues from one tail.
- tau = beta is full-chain RSA: a tail is the whole reasoning section (never longer than beta).

Invariants:
- Tails are cut in tokens and spliced into the prompt as token ids (the template's text pieces are
  tokenized on their own), so an aggregation prompt has exactly |q| + sum of tail lengths + overhead
  tokens, where |q| is the problem text's token count and the overhead (`AggregationPrompter.overhead`)
  depends only on the problem's messages and C. Hence every aggregation prefill is at most
  |q| + C * tau + overhead (`prefill_bound`); the runner checks it on every prompt it submits.
- Seeds depend only on (config seed, problem index, round, candidate index), and the C candidates each
  new candidate aggregates are drawn by a generator seeded with (config seed, problem index, round):
  a run is reproducible and a problem's samples do not depend on the other problems of the call.
- All problems of a call share one engine pass per round: the round's N candidates of every problem,
  plus the forced answers of the previous round. The engine must be idle when the run starts.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from serving.engine import RolloutEngine, SampleOutput, SamplingConfig
from zrl.env.base import THINK_END, Environment, extract_answer, safe_verify
from zrl.types import Prompt

if TYPE_CHECKING:
    from zrl.config.schema import EnvironmentSpec

# The one aggregation template: it replaces the content of the problem's last user message and goes
# through the model's chat template with the other messages unchanged.
AGGREGATION_TEMPLATE = (
    "{problem}\n\n"
    "Last part of {count} candidate solutions, maybe wrong:\n\n"
    "{candidates}"
    "Write one better solution and its final answer."
)
CANDIDATE_TEMPLATE = "[{number}]\n{tail}\n\n"
# Markers standing for the spliced token ids while the template is rendered as text.
_PROBLEM_MARK = "\x00zrl-problem\x00"
_TAIL_MARK = "\x00zrl-tail-{}\x00"
# Round r, problem j, candidate i: seed + (2 r + answer) * stride + j * N + i (answer = 1 for a forced answer).
SEED_ROUND_STRIDE = 2**32


@dataclasses.dataclass(frozen=True)
class RSAConfig:
    num_candidates: int = 16   # N, the population per problem
    num_aggregated: int = 4    # C, candidates whose tails one aggregation prompt carries
    num_rounds: int = 2        # T, aggregation rounds after round 0
    thinking_budget: int = 1024  # beta, generated tokens per candidate
    tail_tokens: int = 256     # tau, tokens per tail
    answer_budget: int = 0     # tokens of a forced answer (0: no forcing)
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    hybrid: bool = False       # PaCoRe-hybrid: a finished candidate forwards its answer, not its tail

    def __post_init__(self) -> None:
        for name in ("num_candidates", "num_aggregated", "thinking_budget", "tail_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_rounds", "answer_budget", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.tail_tokens > self.thinking_budget:
            raise ValueError(f"tail_tokens (tau = {self.tail_tokens}) must be <= thinking_budget "
                             f"(beta = {self.thinking_budget})")
        if self.num_aggregated > self.num_candidates:
            raise ValueError(f"num_aggregated (C = {self.num_aggregated}) must be <= num_candidates "
                             f"(N = {self.num_candidates})")
        self.sampling(1)  # temperature and top_p checked by the engine's own rules

    def sampling(self, max_tokens: int) -> SamplingConfig:
        return SamplingConfig(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p)

    def check_context(self, max_model_len: int) -> None:
        """One-line error when the budgets cannot fit the engine's context, whatever the problem."""
        need = self.num_aggregated * self.tail_tokens * (self.num_rounds > 0) + self.thinking_budget
        if self.answer_budget:
            need += 1 + self.answer_budget  # `</think>` and the forced answer
        if need >= max_model_len:
            raise ValueError(f"budgets need {need} tokens before any prompt (C * tau + beta + forced answer) "
                             f"but the engine's max_model_len is {max_model_len}")

    def request_seed(self, problem_index: int, round_index: int, index: int, answer: bool = False) -> int:
        slot = problem_index * self.num_candidates + index
        if slot >= SEED_ROUND_STRIDE:
            raise ValueError(f"problem {problem_index} x N = {self.num_candidates} exceeds the seed range")
        return self.seed + (2 * round_index + int(answer)) * SEED_ROUND_STRIDE + slot


@dataclasses.dataclass(frozen=True)
class AggregationPrompt:
    ids: tuple[int, ...]
    problem_tokens: int            # |q|
    tail_tokens: tuple[int, ...]   # length of each spliced tail
    overhead: int                  # everything else: chat template, instruction, candidate headers


class AggregationPrompter:
    """Plain and aggregation prompts of a problem, and candidates' tails, in the model's tokens."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        ids = tokenizer.encode(THINK_END, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"the tokenizer must encode {THINK_END!r} as one token, got {ids}")
        self.think_end_id = ids[0]
        self._special_ids = frozenset(tokenizer.all_special_ids)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def plain(self, prompt: Prompt) -> list[int]:
        """The problem's own prompt: its messages through the chat template (round 0, parallel sampling)."""
        return self._encode(self.tokenizer.apply_chat_template(prompt.chat(), add_generation_prompt=True,
                                                               tokenize=False))

    def problem_ids(self, prompt: Prompt) -> list[int]:
        return self._encode(_problem_text(prompt))

    def _pieces(self, prompt: Prompt, num_tails: int) -> list[list[int]]:
        """The template's text pieces around the problem and the tails, tokenized: num_tails + 2 lists."""
        candidates = "".join(CANDIDATE_TEMPLATE.format(number=k + 1, tail=_TAIL_MARK.format(k))
                             for k in range(num_tails))
        content = AGGREGATION_TEMPLATE.format(problem=_PROBLEM_MARK, count=num_tails, candidates=candidates)
        chat = prompt.chat()
        last_user = max(i for i, m in enumerate(chat) if m["role"] == "user")
        chat[last_user] = {"role": "user", "content": content}
        text = self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        pieces = []
        for mark in [_PROBLEM_MARK] + [_TAIL_MARK.format(k) for k in range(num_tails)]:
            if text.count(mark) != 1:
                raise ValueError("the chat template must render the user message verbatim exactly once")
            piece, text = text.split(mark)
            pieces.append(self._encode(piece))
        return pieces + [self._encode(text)]

    def overhead(self, prompt: Prompt, num_tails: int) -> int:
        """Tokens of an aggregation prompt that are neither the problem's nor a tail's."""
        return sum(map(len, self._pieces(prompt, num_tails)))

    def prefill_bound(self, prompt: Prompt, num_tails: int, tail_tokens: int) -> int:
        """|q| + C * tau + overhead: no aggregation prompt of this problem is longer."""
        return len(self.problem_ids(prompt)) + num_tails * tail_tokens + self.overhead(prompt, num_tails)

    def build(self, prompt: Prompt, tails: Sequence[Sequence[int]]) -> AggregationPrompt:
        pieces = self._pieces(prompt, len(tails))
        problem = self.problem_ids(prompt)
        ids = pieces[0] + problem
        for tail, piece in zip(tails, pieces[1:]):
            ids += piece + list(tail)
        ids += pieces[-1]
        return AggregationPrompt(ids=tuple(ids), problem_tokens=len(problem),
                                 tail_tokens=tuple(len(t) for t in tails), overhead=sum(map(len, pieces)))

    def split(self, token_ids: Sequence[int]) -> tuple[list[int], list[int] | None]:
        """(reasoning, answer) of generated tokens, special tokens (EOS) dropped; answer None when the
        reasoning was never closed."""
        ids = [t for t in token_ids if t not in self._special_ids]
        if self.think_end_id not in ids:
            return ids, None
        end = ids.index(self.think_end_id)
        return ids[:end], ids[end + 1:]

    def tail(self, token_ids: Sequence[int], finish_reason: str, tail_tokens: int, hybrid: bool) -> list[int]:
        """What a candidate forwards to an aggregation prompt: at most `tail_tokens` tokens."""
        reasoning, answer = self.split(token_ids)
        forwarded = answer if hybrid and answer is not None and finish_reason == "stop" else reasoning
        return forwarded[len(forwarded) - tail_tokens:] if len(forwarded) > tail_tokens else forwarded


def _problem_text(prompt: Prompt) -> str:
    users = [m.content for m in prompt.messages if m.role == "user"]
    if not users:
        raise ValueError(f"problem {prompt.prompt_id!r} has no user message")
    return users[-1]


@dataclasses.dataclass(frozen=True)
class CandidateRecord:
    round: int
    index: int
    parents: tuple[int, ...]     # indices into the previous round's population; () in round 0
    seed: int
    prompt_tokens: int           # prefill of the candidate's request, as the engine reports it
    token_ids: tuple[int, ...]   # generated tokens
    finish_reason: str
    text: str
    answer_prompt_tokens: int = 0  # prefill of the forced-answer request (0: none ran)
    answer_tokens: int = 0
    answer_text: str = ""        # generated after a forced `</think>`
    response: str = ""           # what is scored: text, plus `</think>` and answer_text when forced
    answer: str = ""             # extract_answer(response)
    reward: float | None = None  # None without a verifier

    @property
    def generated_tokens(self) -> int:
        return len(self.token_ids) + self.answer_tokens


@dataclasses.dataclass(frozen=True)
class RoundRecord:
    round: int
    candidates: tuple[CandidateRecord, ...]
    majority_answer: str         # most frequent non-empty answer (first seen on a tie); "" when none
    majority_reward: float | None
    mean_reward: float | None

    @property
    def generated_tokens(self) -> int:
        return sum(c.generated_tokens for c in self.candidates)

    @property
    def max_prefill(self) -> int:
        return max(c.prompt_tokens for c in self.candidates)


@dataclasses.dataclass(frozen=True)
class ProblemResult:
    problem_index: int
    prompt_id: str
    problem_tokens: int          # |q|
    template_overhead: int       # overhead of an aggregation prompt with C tails
    prefill_bound: int           # |q| + C * tau + overhead
    rounds: tuple[RoundRecord, ...]

    def rows(self) -> list[dict]:
        """One JSON-ready dict per candidate (the JSONL schema: problem fields, round fields, candidate)."""
        head = {"problem_index": self.problem_index, "prompt_id": self.prompt_id,
                "problem_tokens": self.problem_tokens, "prefill_bound": self.prefill_bound}
        return [{**head, "majority_answer": r.majority_answer, "majority_reward": r.majority_reward,
                 **dataclasses.asdict(c), "token_ids": list(c.token_ids), "parents": list(c.parents)}
                for r in self.rounds for c in r.candidates]


@dataclasses.dataclass(frozen=True)
class RSAResult:
    config: RSAConfig
    problems: tuple[ProblemResult, ...]
    pass_seconds: tuple[float, ...]  # wall time of each engine pass (pass r: round r + answers of r - 1)

    def write_jsonl(self, path: str | Path) -> None:
        with open(path, "w") as f:
            for problem in self.problems:
                for row in problem.rows():
                    f.write(json.dumps(row) + "\n")

    def round_summary(self, round_index: int) -> dict[str, float | None]:
        """Over problems: mean correctness, majority-vote accuracy, generated tokens per problem, largest
        prefill of the round (aggregation prompts from round 1 on), wall time of the round's engine pass
        (which also carries the previous round's forced answers)."""
        rounds = [p.rounds[round_index] for p in self.problems]
        scored = all(r.mean_reward is not None for r in rounds)
        return {"round": round_index,
                "mean_reward": float(np.mean([r.mean_reward for r in rounds])) if scored else None,
                "majority_accuracy": float(np.mean([r.majority_reward for r in rounds])) if scored else None,
                "generated_tokens_per_problem": float(np.mean([r.generated_tokens for r in rounds])),
                # D(q): every token generated for the problem up to this round
                "total_generated_tokens_per_problem": float(np.mean(
                    [sum(r.generated_tokens for r in p.rounds[:round_index + 1]) for p in self.problems])),
                "max_prefill": max(r.max_prefill for r in rounds),
                "pass_seconds": self.pass_seconds[round_index]}


@dataclasses.dataclass
class _Job:
    problem_index: int
    round: int
    index: int
    prompt_ids: list[int]
    sampling: SamplingConfig
    seed: int
    parents: tuple[int, ...] = ()


def context_needed(prompter: AggregationPrompter, config: RSAConfig, problem: Prompt) -> int:
    """The longest sequence a run of `problem` can need: its longest prompt (plain, or the aggregation
    bound), the thinking budget, and `</think>` plus a forced answer when answers are forced."""
    longest = len(prompter.plain(problem))
    if config.num_rounds:
        longest = max(longest, prompter.prefill_bound(problem, config.num_aggregated, config.tail_tokens))
    return longest + config.thinking_budget + (1 + config.answer_budget if config.answer_budget else 0)


def run_markovian_rsa(engine: RolloutEngine, problems: Sequence[Prompt], config: RSAConfig,
                      verifier: Environment | None = None) -> RSAResult:
    """Markovian RSA over all `problems` at once; `verifier` (optional) scores every candidate."""
    if engine.has_unfinished():
        raise RuntimeError("run_markovian_rsa needs an idle engine")
    if not problems:
        raise ValueError("run_markovian_rsa needs at least one problem")
    config.check_context(engine.max_model_len)
    prompter = AggregationPrompter(engine.tokenizer)
    n, c = config.num_candidates, config.num_aggregated
    plain = [prompter.plain(p) for p in problems]
    bounds = [prompter.prefill_bound(p, c, config.tail_tokens) for p in problems]
    for problem in problems:
        need = context_needed(prompter, config, problem)
        if need > engine.max_model_len:
            raise ValueError(f"problem {problem.prompt_id!r}: its longest prompt + thinking budget + forced answer "
                             f"need {need} tokens, more than the engine's max_model_len {engine.max_model_len}")

    outputs: list[list[list[SampleOutput]]] = [[] for _ in problems]  # [problem][round][candidate]
    jobs_of: list[list[list[_Job]]] = [[] for _ in problems]
    answers: dict[tuple[int, int, int], SampleOutput] = {}
    pass_seconds = []
    for pass_index in range(config.num_rounds + 2):
        jobs = []
        if pass_index <= config.num_rounds:
            for j, problem in enumerate(problems):
                round_jobs = _round_jobs(prompter, config, j, problem, pass_index, plain[j],
                                         outputs[j][-1] if pass_index else None, bounds[j])
                jobs_of[j].append(round_jobs)
                outputs[j].append([])
                jobs += round_jobs
        if pass_index >= 1 and config.answer_budget:
            jobs += _answer_jobs(prompter, config, outputs, pass_index - 1)
        if not jobs:
            break
        start = time.perf_counter()
        results = _run_pass(engine, jobs)
        pass_seconds.append(time.perf_counter() - start)
        for job, output in zip(jobs, results):
            if job.round == pass_index:  # jobs are in candidate order within a problem
                outputs[job.problem_index][pass_index].append(output)
            else:
                answers[(job.problem_index, job.round, job.index)] = output

    records = []
    for j, problem in enumerate(problems):
        rounds = tuple(_round_record(prompter, problem, verifier, r, jobs_of[j][r], outputs[j][r],
                                     [answers.get((j, r, i)) for i in range(n)])
                       for r in range(config.num_rounds + 1))
        records.append(ProblemResult(
            problem_index=j, prompt_id=problem.prompt_id, problem_tokens=len(prompter.problem_ids(problem)),
            template_overhead=prompter.overhead(problem, c), prefill_bound=bounds[j], rounds=rounds))
    return RSAResult(config=config, problems=tuple(records), pass_seconds=tuple(pass_seconds))


def _round_jobs(prompter: AggregationPrompter, config: RSAConfig, j: int, problem: Prompt, round_index: int,
                plain: list[int], previous: list[SampleOutput] | None, bound: int) -> list[_Job]:
    sampling = config.sampling(config.thinking_budget)
    if previous is None:
        return [_Job(j, 0, i, plain, sampling, config.request_seed(j, 0, i)) for i in range(config.num_candidates)]
    tails = [prompter.tail(s.token_ids.tolist(), s.finish_reason, config.tail_tokens, config.hybrid)
             for s in previous]
    rng = np.random.default_rng([config.seed, j, round_index])
    jobs = []
    for i in range(config.num_candidates):
        parents = tuple(int(k) for k in rng.choice(config.num_candidates, size=config.num_aggregated,
                                                   replace=False))
        prompt = prompter.build(problem, [tails[k] for k in parents])
        if len(prompt.ids) > bound:  # holds by construction; measured because the budget rests on it
            raise RuntimeError(f"aggregation prompt of {len(prompt.ids)} tokens exceeds its bound {bound}")
        jobs.append(_Job(j, round_index, i, list(prompt.ids), sampling,
                         config.request_seed(j, round_index, i), parents))
    return jobs


def _answer_jobs(prompter: AggregationPrompter, config: RSAConfig, outputs, round_index: int) -> list[_Job]:
    """Forced answers for the round's candidates that never closed their reasoning."""
    sampling = config.sampling(config.answer_budget)
    jobs = []
    for j, rounds in enumerate(outputs):
        for i, sample in enumerate(rounds[round_index]):
            reasoning, answer = prompter.split(sample.token_ids.tolist())
            if answer is None:
                jobs.append(_Job(j, round_index, i, sample.prompt_ids.tolist() + reasoning + [prompter.think_end_id],
                                 sampling, config.request_seed(j, round_index, i, answer=True)))
    return jobs


def _run_pass(engine: RolloutEngine, jobs: list[_Job]) -> list[SampleOutput]:
    """Every job as one request of a single engine pass; outputs in job order."""
    slot = {engine.submit(job.prompt_ids, 1, job.sampling, seed=job.seed): k for k, job in enumerate(jobs)}
    results: list[SampleOutput | None] = [None] * len(jobs)
    while engine.has_unfinished():
        for done in engine.step():
            results[slot[done.group_id]] = done.output
    return results  # type: ignore[return-value]


def _round_record(prompter: AggregationPrompter, problem: Prompt, verifier: Environment | None, round_index: int,
                  jobs: list[_Job], samples: list[SampleOutput], answers: list[SampleOutput | None]) -> RoundRecord:
    candidates = []
    for job, sample, forced in zip(jobs, samples, answers):
        response = sample.text if forced is None else sample.text + THINK_END + forced.text
        reward = None if verifier is None else safe_verify(verifier, problem, response).reward
        candidates.append(CandidateRecord(
            round=round_index, index=job.index, parents=job.parents, seed=job.seed,
            prompt_tokens=len(sample.prompt_ids), token_ids=tuple(sample.token_ids.tolist()),
            finish_reason=sample.finish_reason, text=sample.text,
            answer_prompt_tokens=0 if forced is None else len(forced.prompt_ids),
            answer_tokens=0 if forced is None else len(forced.token_ids),
            answer_text="" if forced is None else forced.text,
            response=response, answer=extract_answer(response), reward=reward))
    votes = collections.Counter(c.answer for c in candidates if c.answer)
    majority = votes.most_common(1)[0][0] if votes else ""
    if verifier is None:
        majority_reward = mean_reward = None
    else:
        winners = [c.reward for c in candidates if c.answer == majority and majority]
        majority_reward = winners[0] if winners else 0.0
        mean_reward = float(np.mean([c.reward for c in candidates]))
    return RoundRecord(round=round_index, candidates=tuple(candidates), majority_answer=majority,
                       majority_reward=majority_reward, mean_reward=mean_reward)


def evaluate_rsa(checkpoint: str | Path, environment: EnvironmentSpec, config: RSAConfig, num_prompts: int = 50,
                 dtype: str = "float32") -> RSAResult:
    """Markovian RSA over an environment's eval split (problems drawn with the config's seed), scored by
    its verifier, on an engine started here whose context fits the longest request."""
    from transformers import AutoTokenizer

    from zrl.prompts import build_environment

    env = build_environment(environment)
    if getattr(env, "uses_reward_model", False):
        raise ValueError(f"{environment.name!r} scores with a reward model, which Markovian RSA evaluation "
                         "does not start")
    problems = env.sample(num_prompts, seed=config.seed, split="eval")
    prompter = AggregationPrompter(AutoTokenizer.from_pretrained(checkpoint))
    max_model_len = max(context_needed(prompter, config, p) for p in problems)
    engine = RolloutEngine(checkpoint, dtype=dtype, max_model_len=max_model_len, seed=config.seed)
    try:
        return run_markovian_rsa(engine, problems, config, verifier=env)
    finally:
        engine.close()
