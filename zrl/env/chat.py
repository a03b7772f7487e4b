"""How an environment's messages continue a conversation in token ids (token in, token out).

An episode is one token sequence: the rendered prompt, the policy's first message as sampled, then the
environment's reply, the policy's next message, ... The reply is rendered by the tokenizer's own chat
template with a fixed base conversation: the text the template puts after an assistant message (its end
of turn, e.g. `<|im_end|>\\n`), the environment's messages, and the opening of the next assistant turn.
The policy's own tokens are never re-tokenized, so the trainer scores exactly what the engine sampled.

A policy message that ended with the end-of-turn token already holds the reply's first token; the
runner does not repeat it (`ChatContinuation.reply_ids(messages, last_token)`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

_BASE = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]


class ChatContinuation:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        head = tokenizer.apply_chat_template(_BASE, tokenize=False)
        cut = head.rfind(_BASE[-1]["content"]) + len(_BASE[-1]["content"])
        self._after_assistant = head[cut:]   # the template's text after an assistant message's content
        self._head = head

    def text(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The text between the end of a policy message's content and the start of its next message."""
        full = self.tokenizer.apply_chat_template(_BASE + [dict(m) for m in messages], add_generation_prompt=True,
                                                  tokenize=False)
        if not full.startswith(self._head):
            raise ValueError("the chat template renders a conversation's start differently once messages follow; "
                             "it cannot continue an episode token by token")
        return self._after_assistant + full[len(self._head):]

    def reply_ids(self, messages: Sequence[Mapping[str, str]], last_token: int | None = None) -> list[int]:
        """The token ids appending `messages` after a policy message whose last sampled token is `last_token`."""
        ids = self.tokenizer(self.text(messages), add_special_tokens=False)["input_ids"]
        if ids and last_token is not None and ids[0] == last_token:
            ids = ids[1:]
        return list(ids)


__all__ = ["ChatContinuation"]
