"""Markovian RSA (serving/rsa.py) on the session's fp32 vLLM engine: T = 0 is exactly parallel sampling,
and a multi-round run keeps every aggregation prefill within |q| + C * tau + overhead while recording
every candidate. The tiny random model rarely closes its reasoning, so forced answers are exercised."""

import numpy as np
import pytest

from serving.engine import SamplingConfig
from serving.rsa import AggregationPrompter, RSAConfig, run_markovian_rsa
from zrl.env.base import THINK_END, Environment
from zrl.types import Message, Prompt

pytestmark = pytest.mark.integration

PROBLEMS = [Prompt(env="toy", prompt_id=f"q{k}", messages=(Message("user", text),), answer=answer, data_source="toy")
            for k, (text, answer) in enumerate([("what is 2 + 3?", "5"), ("7 minus 4", "3")])]


class NonEmptyAnswer(Environment):
    """Reward 1 for a non-empty answer section: a verifier whose rewards vary on random text."""

    name = "non_empty_answer"

    def sample(self, n, seed, split="train", difficulty=None):
        raise NotImplementedError

    def verify(self, prompt, response):
        return float(bool(response.rsplit(THINK_END, 1)[-1].strip()))


def test_zero_rounds_are_exactly_the_parallel_samples(fp32_engine):
    config = RSAConfig(num_candidates=3, num_aggregated=2, num_rounds=0, thinking_budget=12, tail_tokens=6,
                       temperature=1.0, seed=11)
    result = run_markovian_rsa(fp32_engine, PROBLEMS, config)
    prompter = AggregationPrompter(fp32_engine.tokenizer)
    direct = fp32_engine.generate([prompter.plain(q) for q in PROBLEMS], 3, SamplingConfig(max_tokens=12, seed=11))
    for record, samples in zip(result.problems, direct):
        (only,) = record.rounds
        assert [c.token_ids for c in only.candidates] == [tuple(s.token_ids.tolist()) for s in samples]
        assert [c.text for c in only.candidates] == [s.text for s in samples]
    # Distinct seeds within a problem: the candidates are not all one sample.
    assert any(len({c.token_ids for c in r.rounds[0].candidates}) > 1 for r in result.problems)


def test_rounds_stay_within_the_prefill_bound_and_record_everything(fp32_engine):
    config = RSAConfig(num_candidates=3, num_aggregated=2, num_rounds=2, thinking_budget=12, tail_tokens=6,
                       answer_budget=6, seed=3)
    prompter = AggregationPrompter(fp32_engine.tokenizer)
    result = run_markovian_rsa(fp32_engine, PROBLEMS, config, verifier=NonEmptyAnswer())
    aggregation_prompts = 0
    for q, record in zip(PROBLEMS, result.problems):
        assert record.prefill_bound == (len(prompter.problem_ids(q)) + 2 * 6 + prompter.overhead(q, 2))
        assert [r.round for r in record.rounds] == [0, 1, 2]
        for r in record.rounds:
            assert [c.index for c in r.candidates] == [0, 1, 2]
            for c in r.candidates:
                assert 1 <= len(c.token_ids) <= 12 and c.text is not None
                reasoning, answer = prompter.split(c.token_ids)
                if answer is None:  # forced: prompt + reasoning + `</think>`, then at most answer_budget tokens
                    assert c.answer_prompt_tokens == c.prompt_tokens + len(reasoning) + 1
                    assert 1 <= c.answer_tokens <= 6
                    assert c.response == c.text + THINK_END + c.answer_text
                assert c.reward == NonEmptyAnswer().verify(q, c.response)
                if r.round == 0:
                    assert c.parents == ()
                    continue
                # prompt_tokens is the engine's own count of the submitted prompt.
                previous = record.rounds[r.round - 1].candidates
                tails = [prompter.tail(previous[k].token_ids, previous[k].finish_reason, 6, False) for k in c.parents]
                assert len(set(c.parents)) == 2
                assert c.prompt_tokens == record.problem_tokens + sum(map(len, tails)) + record.template_overhead
                assert c.prompt_tokens <= record.prefill_bound
                aggregation_prompts += 1
            assert r.mean_reward == pytest.approx(np.mean([c.reward for c in r.candidates]))
    assert aggregation_prompts == len(PROBLEMS) * 2 * 3
    assert result.round_summary(1)["max_prefill"] <= max(p.prefill_bound for p in result.problems)


def test_one_candidate_per_prompt_continues_exactly_one_tail(fp32_engine):
    config = RSAConfig(num_candidates=2, num_aggregated=1, num_rounds=1, thinking_budget=12, tail_tokens=12, seed=5)
    prompter = AggregationPrompter(fp32_engine.tokenizer)
    result = run_markovian_rsa(fp32_engine, PROBLEMS[:1], config)
    first, second = result.problems[0].rounds
    for c in second.candidates:
        (parent,) = c.parents
        tail = prompter.tail(first.candidates[parent].token_ids, first.candidates[parent].finish_reason, 12, False)
        assert len(tail) >= 1
        assert c.prompt_tokens == len(prompter.build(PROBLEMS[0], [tail]).ids)
        assert c.prompt_tokens == result.problems[0].problem_tokens + len(tail) + prompter.overhead(PROBLEMS[0], 1)
