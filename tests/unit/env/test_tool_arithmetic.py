"""tool_arithmetic: the episode (tool calls answered by the real sandbox, a final answer scored), the
problems (deterministic, train and eval disjoint), and its demonstration as a multi-turn SFT example whose
trained tokens are exactly the assistant's turns, rendered as a rollout renders the conversation."""

import numpy as np
import torch
import pytest

from environments.tool_arithmetic import ToolArithmetic
from zrl.assets import build_tokenizer
from zrl.config.schema import EnvironmentSpec
from zrl.env.chat import ChatContinuation
from zrl.env.tools import tool_call_text
from zrl.pipeline.sft_stage import build_examples
from zrl.prompts import PromptSource
from zrl.trainer.batch import pack_sft

REFERENCE = "environments.tool_arithmetic:ToolArithmetic"


@pytest.fixture(scope="module")
def env():
    return ToolArithmetic(limits={"wall_s": 2.0, "cpu_s": 1.0})


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def test_problems_multiply_two_numbers_of_the_given_digits(env):
    prompts = env.sample(50, seed=3)
    for p in prompts:
        a, b = p.payload["a"], p.payload["b"]
        assert 100 <= a <= 999 and 100 <= b <= 999 and p.answer == str(a * b)
        assert p.messages[0].content.startswith(f"What is {a} * {b}? ")
        assert '<tool_call>{"name":"python","arguments":{"code":"..."}}</tool_call>' in p.messages[0].content
    assert {len(str(p.payload["a"])) for p in ToolArithmetic(digits=2).sample(50, seed=3)} == {2}
    with pytest.raises(ValueError, match="digits must be >= 1"):
        ToolArithmetic(digits=0)


def test_sampling_is_deterministic(env):
    assert env.sample(20, seed=5) == env.sample(20, seed=5)
    assert env.sample(20, seed=5) != env.sample(20, seed=6)
    assert env.sample(20, seed=5, split="eval") != env.sample(20, seed=5)


def test_train_and_eval_problems_are_disjoint():
    env = ToolArithmetic(digits=2)  # 8100 problems: 2000 draws of each split would collide without the split
    train = {p.payload["a"] * 1000 + p.payload["b"] for p in env.sample(2000, seed=0)}
    held_out = {p.payload["a"] * 1000 + p.payload["b"] for p in env.sample(2000, seed=0, split="eval")}
    assert train and held_out and not train & held_out


def test_a_tool_call_gets_the_tools_reply_and_the_episode_goes_on(env):
    [prompt] = env.sample(1, seed=0)
    a, b = prompt.payload["a"], prompt.payload["b"]
    episode = env.episode(prompt)
    turn = episode.step(f"</think>\n{tool_call_text('python', {'code': f'print({a} * {b})'})}")
    assert turn.messages == ({"role": "tool", "content": f"{a * b}\n"},)
    assert (turn.done, turn.reward, turn.tool_calls, turn.tool_errors) == (False, None, 1, 0)
    broken = episode.step('<tool_call>{"name": "python", "arguments": {"code": "1/0"}}</tool_call>'
                          '<tool_call>{"name": "python"</tool_call>')
    assert (broken.done, broken.tool_calls, broken.tool_errors) == (False, 2, 2)
    assert broken.messages[0]["content"].endswith("ZeroDivisionError: division by zero")
    assert broken.messages[1]["content"].startswith("Error: the tool call is not valid JSON")
    final = episode.step(f"</think>{a * b}")
    assert (final.done, final.reward, final.tool_calls, final.messages) == (True, 1.0, 0, ())
    episode.close()


def test_a_message_without_a_call_ends_the_episode_with_its_reward(env):
    [prompt] = env.sample(1, seed=1)
    answer = int(prompt.answer)
    assert env.episode(prompt).step(f"{answer}\n</think>\n{answer + 1}").reward == 0.0
    assert env.episode(prompt).step(f"{answer}").reward == 1.0  # no </think>: the whole message is the answer
    assert env.episode(prompt).step(f"I think {answer}").reward == 0.0
    assert all(env.episode(prompt).step(text).done for text in ("", "</think>", f"</think>{answer}"))


def test_verify_scores_a_finished_transcript(env):
    [prompt] = env.sample(1, seed=2)
    call = tool_call_text("python", {"code": "print(1)"})
    assert env.verify(prompt, f"</think>{call}1\n</think>\n{prompt.answer}") == 1.0
    assert env.verify(prompt, f"</think>{call}") == 0.0
    assert env.verify(prompt, f"</think>{int(prompt.answer) - 1}") == 0.0


def test_the_demonstration_is_what_the_episode_does(env):
    """Its tool reply is the real tool's reply to its call, and its final answer earns the reward."""
    for prompt in env.sample(3, seed=4):
        call, reply, answer = env.demonstration(prompt)
        assert [call["role"], reply["role"], answer["role"]] == ["assistant", "tool", "assistant"]
        episode = env.episode(prompt)
        assert episode.step(call["content"]).messages == (reply,)
        assert episode.step(answer["content"]).reward == 1.0


def test_the_demonstration_is_a_masked_sft_example_of_the_assistant_turns(tokenizer):
    source = PromptSource([EnvironmentSpec(name=REFERENCE, options={"limits": {"wall_s": 2.0}})], seed=0)
    env = source.entries[0].env
    examples, skipped = build_examples(source, tokenizer, 4, max_tokens=512)
    assert (len(examples), skipped) == (4, 0)
    prompts = PromptSource([EnvironmentSpec(name=REFERENCE)], seed=0).next_prompts(4)  # the same draw
    chat = ChatContinuation(tokenizer)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    for example, prompt in zip(examples, prompts):
        call, reply, answer = env.demonstration(prompt)
        tokens, mask = example.token_ids.tolist(), example.loss_mask
        assert mask is not None and mask.dtype == np.bool_
        turn1, turn2 = ids(call["content"]) + [end], ids(answer["content"]) + [end]
        context = chat.reply_ids([reply], end)
        assert tokens == turn1 + context + turn2  # the episode's sequence, as a rollout would hold it
        assert mask.tolist() == [True] * len(turn1) + [False] * len(context) + [True] * len(turn2)
        whole = tokenizer.apply_chat_template(prompt.chat() + [call, reply, answer], tokenize=False)
        # the template renders a past turn without the "<think>\n" that opened it; a rollout ends at its end of turn
        opening = "<|im_start|>assistant\n"
        rendered = whole.replace(opening, opening + "<think>\n").removesuffix("\n")
        assert tokenizer.decode(example.prompt_ids.tolist() + tokens) == rendered
        # the loss is on the assistant's turns and nothing else
        mb = pack_sft([example], [0], device=torch.device("cpu"))
        assert mb.targets[mb.loss_mask].tolist() == turn1 + turn2
        assert example.num_trained_tokens == len(turn1 + turn2)


def test_a_string_demonstration_is_one_trained_turn(tokenizer):
    source = PromptSource([EnvironmentSpec(name="arithmetic")], seed=0)
    [example], _ = build_examples(source, tokenizer, 1, max_tokens=512)
    [prompt] = PromptSource([EnvironmentSpec(name="arithmetic")], seed=0).next_prompts(1)
    demo = source.entries[0].env.demonstration(prompt)
    assert example.loss_mask is None
    assert example.token_ids.tolist() == tokenizer(demo + "<|im_end|>", add_special_tokens=False)["input_ids"]


def test_a_demonstration_must_start_and_end_with_the_assistant(tokenizer, monkeypatch):
    source = PromptSource([EnvironmentSpec(name=REFERENCE)], seed=0)
    monkeypatch.setattr(source.entries[0].env, "demonstration", lambda prompt: [
        {"role": "tool", "content": "1"}, {"role": "assistant", "content": "</think>1"}])
    with pytest.raises(ValueError, match=r"starts and ends with an assistant message, got roles \['tool', "):
        build_examples(source, tokenizer, 1, max_tokens=512)


def test_two_turns_without_a_reply_are_joined_as_an_episode_joins_them(tokenizer, monkeypatch):
    """An episode's Turn without messages still closes the policy's turn and opens the next one."""
    source = PromptSource([EnvironmentSpec(name=REFERENCE)], seed=0)
    monkeypatch.setattr(source.entries[0].env, "demonstration", lambda prompt: [
        {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "</think>1"}])
    [example], _ = build_examples(source, tokenizer, 1, max_tokens=512)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    first, second = (tokenizer(text, add_special_tokens=False)["input_ids"] + [end] for text in ("a", "</think>1"))
    opening = ChatContinuation(tokenizer).reply_ids([], end)
    assert tokenizer.decode(opening) == "\n<|im_start|>assistant\n<think>\n"
    assert example.token_ids.tolist() == first + opening + second
    assert example.loss_mask.tolist() == [True] * len(first) + [False] * len(opening) + [True] * len(second)
