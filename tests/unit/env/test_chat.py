"""ChatContinuation: an environment's reply continues the policy's sampled tokens exactly as the chat
template would render the whole conversation."""

import pytest

from zrl.assets import build_tokenizer
from zrl.env.chat import ChatContinuation


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def test_reply_continues_the_conversation_as_the_template_renders_it(tokenizer):
    chat = ChatContinuation(tokenizer)
    user = [{"role": "user", "content": "what is 12 * 34"}]
    reply = [{"role": "tool", "content": "408"}]
    prompt = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
    policy = "call</think>python"
    whole = tokenizer.apply_chat_template(user + [{"role": "assistant", "content": policy}] + reply,
                                          add_generation_prompt=True, tokenize=False)
    # the template renders an assistant message without the generation prompt's "<think>\n" opening;
    # the sequence the engine sees keeps what it sampled after that opening
    opening = "<think>\n"
    assert prompt.endswith(opening)
    assert prompt + policy + chat.text(reply) == whole.replace("assistant\n" + policy, "assistant\n" + opening + policy)
    assert chat.text(reply) == "<|im_end|>\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n<think>\n"


def test_the_end_of_turn_the_policy_sampled_is_not_repeated(tokenizer):
    chat = ChatContinuation(tokenizer)
    reply = [{"role": "user", "content": "try again"}]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    full = chat.reply_ids(reply)
    assert full[0] == end
    assert chat.reply_ids(reply, last_token=end) == full[1:]
    assert chat.reply_ids(reply, last_token=5) == full   # a turn cut short gets its end of turn


def test_a_template_that_changes_the_start_is_refused(tokenizer):
    class Shifting:
        def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=False):
            return f"{len(messages)}:" + "".join(m["content"] for m in messages)

    with pytest.raises(ValueError, match="cannot continue an episode"):
        ChatContinuation(Shifting()).text([{"role": "user", "content": "x"}])
