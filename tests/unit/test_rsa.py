"""Markovian RSA (serving/rsa.py) on the tiny tokenizer: tails in tokens, aggregation prompts through the
chat template, the prefill bound, config errors, and the runner's bookkeeping on a scripted engine
(the vLLM engine itself is exercised in tests/integration/serving/test_serving_rsa.py)."""

import json

import numpy as np
import pytest

from serving.engine import FinishedSample, SampleOutput, SamplingConfig
from serving.rsa import (AGGREGATION_TEMPLATE, CANDIDATE_TEMPLATE, AggregationPrompter, RSAConfig,
                         run_markovian_rsa)
from zrl.env.base import THINK_END, Environment
from zrl.types import Message, Prompt


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from zrl.assets import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("rsa_tok"))


@pytest.fixture(scope="module")
def prompter(tokenizer):
    return AggregationPrompter(tokenizer)


def problem(text="what is 12 + 30?", system=None, prompt_id="p0", answer="42"):
    messages = ((Message("system", system),) if system else ()) + (Message("user", text),)
    return Prompt(env="toy", prompt_id=prompt_id, messages=messages, answer=answer, data_source="toy")


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def contains(ids, part):
    return any(list(ids[k:k + len(part)]) == list(part) for k in range(len(ids) - len(part) + 1))


# ---------------------------------------------------------------------------------------------- tails

def test_tail_is_the_last_tau_tokens_of_the_reasoning(tokenizer, prompter):
    reasoning = encode(tokenizer, "first 12 plus 30 then so the result is 42")
    answer = encode(tokenizer, "42")
    generated = reasoning + [prompter.think_end_id] + answer + [tokenizer.eos_token_id]
    assert len(reasoning) > 6
    assert prompter.tail(generated, "stop", 4, hybrid=False) == reasoning[-4:]
    assert prompter.tail(generated, "stop", len(reasoning), hybrid=False) == reasoning  # exactly tau
    assert prompter.tail(generated, "stop", len(reasoning) + 5, hybrid=False) == reasoning  # shorter than tau


def test_unclosed_reasoning_is_all_generated_tokens_without_eos(tokenizer, prompter):
    reasoning = encode(tokenizer, "think step first 7 times 6")
    assert prompter.tail(reasoning, "length", 3, hybrid=False) == reasoning[-3:]
    # An EOS before `</think>` ends the reasoning but is not part of it.
    assert prompter.tail(reasoning + [tokenizer.eos_token_id], "stop", 3, hybrid=False) == reasoning[-3:]
    assert prompter.split(reasoning + [tokenizer.eos_token_id]) == (reasoning, None)


def test_hybrid_forwards_a_finished_candidates_answer(tokenizer, prompter):
    reasoning = encode(tokenizer, "first 12 plus 30 then so")
    answer = encode(tokenizer, "the answer is 42")
    finished = reasoning + [prompter.think_end_id] + answer + [tokenizer.eos_token_id]
    assert prompter.tail(finished, "stop", 50, hybrid=True) == answer
    assert prompter.tail(finished, "stop", 2, hybrid=True) == answer[-2:]  # cut like a tail: the bound holds
    # Not finished: closed its reasoning but ran out of budget in the answer, or never closed it.
    truncated = reasoning + [prompter.think_end_id] + answer
    assert prompter.tail(truncated, "length", 3, hybrid=True) == reasoning[-3:]
    assert prompter.tail(reasoning, "length", 3, hybrid=True) == reasoning[-3:]


# ---------------------------------------------------------------------------------------------- prompts

def test_aggregation_prompt_goes_through_the_chat_template(tokenizer, prompter):
    q = problem(system="solve it")
    tails = [encode(tokenizer, "12 plus 30 so 42"), encode(tokenizer, "first 12"), encode(tokenizer, "so 41")]
    built = prompter.build(q, tails)
    candidates = "".join(CANDIDATE_TEMPLATE.format(number=k + 1, tail=tokenizer.decode(t))
                         for k, t in enumerate(tails))
    expected = tokenizer.apply_chat_template(
        [{"role": "system", "content": "solve it"},
         {"role": "user", "content": AGGREGATION_TEMPLATE.format(problem=q.messages[-1].content, count=3,
                                                                 candidates=candidates)}],
        add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(list(built.ids)) == expected
    assert contains(built.ids, prompter.problem_ids(q))
    for tail in tails:
        assert contains(built.ids, tail)  # spliced as the very token ids, not re-tokenized text
    assert built.tail_tokens == tuple(map(len, tails))


def test_prompt_length_is_problem_plus_tails_plus_overhead_within_the_bound(tokenizer, prompter):
    rng = np.random.default_rng(0)
    q = problem()
    tau, c = 9, 3
    bound = prompter.prefill_bound(q, c, tau)
    overhead = prompter.overhead(q, c)
    assert bound == len(prompter.problem_ids(q)) + c * tau + overhead
    lengths = []
    for _ in range(50):
        # Arbitrary tokens (also ones that would merge differently as text), lengths 0..tau.
        tails = [rng.integers(5, len(tokenizer) - 2, size=rng.integers(0, tau + 1)).tolist() for _ in range(c)]
        built = prompter.build(q, tails)
        assert built.overhead == overhead
        assert len(built.ids) == built.problem_tokens + sum(map(len, tails)) + overhead <= bound
        lengths.append(len(built.ids))
    full = prompter.build(q, [list(range(10, 10 + tau))] * c)
    assert len(full.ids) == bound  # the bound is tight
    assert min(lengths) < bound


def test_plain_prompt_is_the_chat_template_of_the_messages(tokenizer, prompter):
    q = problem()
    text = tokenizer.apply_chat_template(q.chat(), add_generation_prompt=True, tokenize=False)
    assert prompter.plain(q) == encode(tokenizer, text)


def test_problem_without_user_message_is_an_error(prompter):
    q = Prompt(env="toy", prompt_id="bad", messages=(Message("system", "x"),), answer="", data_source="toy")
    with pytest.raises(ValueError, match="problem 'bad' has no user message"):
        prompter.problem_ids(q)


# ---------------------------------------------------------------------------------------------- config

@pytest.mark.parametrize("kwargs, message", [
    (dict(tail_tokens=65, thinking_budget=64), r"tail_tokens \(tau = 65\) must be <= thinking_budget \(beta = 64\)"),
    (dict(num_aggregated=5, num_candidates=4), r"num_aggregated \(C = 5\) must be <= num_candidates \(N = 4\)"),
    (dict(num_candidates=0), "num_candidates must be >= 1, got 0"),
    (dict(num_aggregated=0), "num_aggregated must be >= 1, got 0"),
    (dict(thinking_budget=0, tail_tokens=0), "thinking_budget must be >= 1, got 0"),
    (dict(tail_tokens=-1), "tail_tokens must be >= 1, got -1"),
    (dict(num_rounds=-1), "num_rounds must be >= 0, got -1"),
    (dict(answer_budget=-2), "answer_budget must be >= 0, got -2"),
    (dict(temperature=0.001), "temperature must be 0"),
    (dict(top_p=0.0), "top_p must be in"),
])
def test_bad_settings_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError, match=message) as error:
        RSAConfig(**kwargs)
    assert "\n" not in str(error.value)


def test_budgets_larger_than_the_context_are_one_line_errors():
    config = RSAConfig(num_candidates=4, num_aggregated=2, num_rounds=1, thinking_budget=64, tail_tokens=32,
                       answer_budget=16)
    config.check_context(200)  # 2 * 32 + 64 + 1 + 16 = 145 < 200
    with pytest.raises(ValueError, match="budgets need 145 tokens .* max_model_len is 145") as error:
        config.check_context(145)
    assert "\n" not in str(error.value)
    RSAConfig(num_rounds=0, thinking_budget=64, tail_tokens=32).check_context(65)  # no aggregation: no tails


def test_seeds_follow_problem_round_and_candidate():
    config = RSAConfig(num_candidates=4, num_aggregated=2, seed=7)
    # Round 0 uses RolloutEngine.generate's seeds: seed + problem * N + candidate.
    assert [config.request_seed(j, 0, i) for j in range(2) for i in range(4)] == list(range(7, 15))
    seeds = {config.request_seed(j, r, i, answer) for j in range(3) for r in range(3) for i in range(4)
             for answer in (False, True)}
    assert len(seeds) == 3 * 3 * 4 * 2


# ---------------------------------------------------------------------------------------------- runner

class ScriptedEngine:
    """RolloutEngine's submit/step surface over the tiny tokenizer: a sample is a pure function of its
    prompt ids and seed (reasoning words, sometimes `</think>` and a number), like a seeded vLLM request."""

    def __init__(self, tokenizer, max_model_len=512):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.think_end_id = encode(tokenizer, THINK_END)[0]
        self.words = [encode(tokenizer, w) for w in ("first", " so", " 12", " plus", " then")]
        self.digits = [encode(tokenizer, str(d)) for d in range(3)]
        self.requests = []  # (prompt ids, sampling, seed) of every submitted request
        self._queue = []
        self._groups = 0

    def has_unfinished(self):
        return bool(self._queue)

    def submit(self, prompt_ids, num_samples, sampling: SamplingConfig, seed=None):
        assert num_samples == 1 and len(prompt_ids) + sampling.max_tokens <= self.max_model_len
        self.requests.append((list(prompt_ids), sampling, seed))
        self._queue.append((self._groups, list(prompt_ids), sampling, seed))
        self._groups += 1
        return self._groups - 1

    def step(self):
        done, self._queue = self._queue[::-1], []  # finish out of submission order on purpose
        return [FinishedSample(group, 0, self._sample(prompt, sampling, seed))
                for group, prompt, sampling, seed in done]

    def _sample(self, prompt, sampling, seed):
        rng = np.random.default_rng([seed, sum(prompt) % 1000, len(prompt)])
        ids = []
        while len(ids) < sampling.max_tokens:
            ids += self.words[rng.integers(len(self.words))]
            if rng.random() < 0.3:
                ids += [self.think_end_id] + self.digits[rng.integers(len(self.digits))] + [self.tokenizer.eos_token_id]
                break
        ids = ids[:sampling.max_tokens]
        finish = "stop" if ids[-1] == self.tokenizer.eos_token_id else "length"
        token_ids = np.asarray(ids, dtype=np.int64)
        return SampleOutput(prompt_ids=np.asarray(prompt, dtype=np.int64), token_ids=token_ids,
                            logprobs=np.zeros(len(ids), np.float32), routing=np.zeros((0, 1), np.uint8),
                            finish_reason=finish, version_segments=(),
                            text=self.tokenizer.decode(ids, skip_special_tokens=True))


class AnswerIsOne(Environment):
    name = "answer_is_one"

    def sample(self, n, seed, split="train", difficulty=None):
        raise NotImplementedError

    def verify(self, prompt, response):
        return float(response.rsplit(THINK_END, 1)[-1].strip() == prompt.answer)


PROBLEMS = [problem("what is 12 + 30?", prompt_id="a", answer="1"), problem("0 plus 1", prompt_id="b", answer="1")]


def test_zero_rounds_are_the_parallel_samples(tokenizer, prompter):
    config = RSAConfig(num_candidates=3, num_aggregated=2, num_rounds=0, thinking_budget=12, tail_tokens=4, seed=5)
    engine = ScriptedEngine(tokenizer)
    result = run_markovian_rsa(engine, PROBLEMS, config, verifier=AnswerIsOne())
    assert [(r[0], r[2]) for r in engine.requests] == [(prompter.plain(q), 5 + j * 3 + i)
                                                       for j, q in enumerate(PROBLEMS) for i in range(3)]
    for j, q in enumerate(PROBLEMS):
        (only,) = result.problems[j].rounds
        direct = [engine._sample(prompter.plain(q), config.sampling(12), 5 + j * 3 + i) for i in range(3)]
        assert [c.token_ids for c in only.candidates] == [tuple(s.token_ids.tolist()) for s in direct]


def test_rounds_record_every_candidate_within_the_bound(tokenizer, prompter, tmp_path):
    config = RSAConfig(num_candidates=4, num_aggregated=2, num_rounds=2, thinking_budget=10, tail_tokens=4,
                       answer_budget=3, seed=1)
    engine = ScriptedEngine(tokenizer)
    result = run_markovian_rsa(engine, PROBLEMS, config, verifier=AnswerIsOne())
    # One pass per round, then one for the final round's forced answers when it has any.
    final_open = any(prompter.think_end_id not in c.token_ids for r in result.problems for c in r.rounds[-1].candidates)
    assert len(result.pass_seconds) == config.num_rounds + 1 + final_open
    assert any(c.answer_tokens for r in result.problems for rr in r.rounds for c in rr.candidates)
    assert any(c.answer_tokens == 0 for r in result.problems for rr in r.rounds for c in rr.candidates)
    for j, (q, record) in enumerate(zip(PROBLEMS, result.problems)):
        assert [r.round for r in record.rounds] == [0, 1, 2]
        assert record.prefill_bound == prompter.prefill_bound(q, 2, 4)
        for r in record.rounds:
            assert [c.index for c in r.candidates] == list(range(4))
            for c in r.candidates:
                closed = prompter.think_end_id in c.token_ids
                assert (c.answer_tokens > 0) == (not closed)  # forced exactly when reasoning stayed open
                assert c.reward == AnswerIsOne().verify(q, c.response)
                if r.round == 0:
                    assert c.parents == () and c.prompt_tokens == len(prompter.plain(q))
                    continue
                assert len(set(c.parents)) == 2 and c.prompt_tokens <= record.prefill_bound
                previous = record.rounds[r.round - 1].candidates
                rebuilt = prompter.build(q, [prompter.tail(previous[k].token_ids, previous[k].finish_reason, 4, False)
                                             for k in c.parents])
                assert c.prompt_tokens == len(rebuilt.ids)
                assert (list(rebuilt.ids), c.seed) in [(p, s) for p, _, s in engine.requests]
            assert r.mean_reward == pytest.approx(np.mean([c.reward for c in r.candidates]))
            votes = [c.answer for c in r.candidates if c.answer]
            if votes:
                assert votes.count(r.majority_answer) == max(votes.count(a) for a in votes)
    # Every aggregation request the engine saw (not a plain prompt, not a forced answer) is within a bound.
    plains = [prompter.plain(q) for q in PROBLEMS]
    aggregations = [p for p, sampling, _ in engine.requests if sampling.max_tokens == 10 and p not in plains]
    assert len(aggregations) == len(PROBLEMS) * 2 * 4
    assert max(map(len, aggregations)) <= max(prompter.prefill_bound(q, 2, 4) for q in PROBLEMS)
    path = tmp_path / "rsa.jsonl"
    result.write_jsonl(path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == len(PROBLEMS) * 3 * 4
    assert {(row["prompt_id"], row["round"], row["index"]) for row in rows} == {
        (q.prompt_id, r, i) for q in PROBLEMS for r in range(3) for i in range(4)}
    summary = result.round_summary(2)
    assert summary["max_prefill"] == max(r.rounds[2].max_prefill for r in result.problems)


def test_one_candidate_per_prompt_is_bounded_continuation(tokenizer, prompter):
    config = RSAConfig(num_candidates=3, num_aggregated=1, num_rounds=1, thinking_budget=10, tail_tokens=10, seed=2)
    engine = ScriptedEngine(tokenizer)
    result = run_markovian_rsa(engine, PROBLEMS[:1], config)
    first, second = result.problems[0].rounds
    for c in second.candidates:
        (parent,) = c.parents
        tail = prompter.tail(first.candidates[parent].token_ids, first.candidates[parent].finish_reason, 10, False)
        expected = prompter.build(PROBLEMS[0], [tail])
        assert c.prompt_tokens == len(expected.ids) and expected.tail_tokens == (len(tail),)
    assert second.mean_reward is None and second.majority_reward is None  # no verifier given


def test_a_problem_too_long_for_the_context_is_refused_before_generating(tokenizer):
    config = RSAConfig(num_candidates=2, num_aggregated=2, num_rounds=1, thinking_budget=16, tail_tokens=8)
    engine = ScriptedEngine(tokenizer, max_model_len=100)
    with pytest.raises(ValueError, match="problem 'a': its longest prompt .* need [0-9]+ tokens, "
                                         "more than the engine's max_model_len 100"):
        run_markovian_rsa(engine, PROBLEMS, config)
    assert engine.requests == []


@pytest.mark.parametrize("argv, message", [
    (["--tail-tokens", "300", "--thinking-budget", "256"], "tail_tokens (tau = 300) must be <= thinking_budget"),
    (["-N", "2", "-C", "3"], "num_aggregated (C = 3) must be <= num_candidates (N = 2)"),
    (["--rounds", "-1"], "num_rounds must be >= 0, got -1"),
])
def test_ttc_command_refuses_bad_settings_in_one_line(tmp_path, capsys, argv, message):
    from zrl.cli import EXIT_BAD_INPUT, main

    assert main(["ttc", str(tmp_path), "--env", "arithmetic", "--output", str(tmp_path / "out.jsonl"), *argv]) \
        == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err == f"zrl: error: {err.removeprefix('zrl: error: ').strip()}\n" and message in err
    assert not (tmp_path / "out.jsonl").exists()


def test_tail_equal_to_the_budget_forwards_whole_reasoning_chains(tokenizer, prompter):
    config = RSAConfig(num_candidates=3, num_aggregated=3, num_rounds=1, thinking_budget=10, tail_tokens=10, seed=4)
    result = run_markovian_rsa(ScriptedEngine(tokenizer), PROBLEMS[:1], config)
    record = result.problems[0]
    first, second = record.rounds
    for c in second.candidates:
        assert sorted(c.parents) == [0, 1, 2]  # C = N: every candidate aggregates the whole population
        chains = [prompter.split(first.candidates[k].token_ids)[0] for k in c.parents]
        assert c.prompt_tokens == record.problem_tokens + sum(map(len, chains)) + record.template_overhead


def test_hybrid_run_forwards_finished_answers(tokenizer, prompter):
    config = RSAConfig(num_candidates=4, num_aggregated=2, num_rounds=1, thinking_budget=10, tail_tokens=3,
                       seed=6, hybrid=True)
    engine = ScriptedEngine(tokenizer)
    result = run_markovian_rsa(engine, PROBLEMS, config)
    forwarded_answers = 0
    for q, record in zip(PROBLEMS, result.problems):
        first, second = record.rounds
        for c in second.candidates:
            parts = []
            for k in c.parents:
                parent = first.candidates[k]
                reasoning, answer = prompter.split(parent.token_ids)
                finished = answer is not None and parent.finish_reason == "stop"
                parts.append(answer[-3:] if finished else reasoning[-3:])
                forwarded_answers += finished
            expected = prompter.build(q, parts)
            assert (list(expected.ids), c.seed) in [(p, s) for p, _, s in engine.requests]
    assert forwarded_answers > 0  # the scripted model finishes some candidates: the hybrid path ran
