"""Runs one SFT stage: supervised warm start on demonstrations that the stage's environments produce.

Each step draws `examples_per_step` prompts from the stage's prompt source, renders them with the
tokenizer's chat template (the assistant turn opens the reasoning section), appends the demonstration
of the environment entry that made the prompt (found by the key the prompt source stamped on it) and
the end-of-turn token (a multi-turn demonstration: each assistant turn so, the environment's replies
between them rendered as a rollout renders them and not trained; `build_examples`), and sends the same examples to every trainer rank, which pack their share and
take one optimizer step (token-mean NLL over the global batch). Examples longer than
`max_sequence_tokens` are skipped and counted, never truncated.
Resume: the prompt source's draw counter is the whole data position (zrl/prompts.py), so a stage
continued from a checkpoint builds the same examples an uninterrupted run would have built.
"""

import logging

import numpy as np
import ray

from zrl.config.schema import SFTStage
from zrl.env.base import EnvironmentFault
from zrl.env.episode import transcript_problem
from zrl.pipeline.faults import StageStopped, raise_if_stop_requested, trainer_results
from zrl.pipeline.stage_report import step_count
from zrl.prompts import PromptSource

log = logging.getLogger("zrl")

END_OF_TURN = "<|im_end|>"


def build_examples(source: PromptSource, tokenizer, n: int, max_tokens: int):
    """`n` examples (fewer by those over `max_tokens`) and the number skipped. A demonstration is a string
    (one assistant turn) or a list of chat messages: the assistant's turns (trained) and the environment's
    replies between them (context, rendered as a rollout renders them: zrl.env.chat.ChatContinuation)."""
    from zrl.trainer import SFTExample

    examples, skipped = [], 0
    entries = {e.key: e.env for e in source.entries}
    chat = None
    for prompt in source.next_prompts(n):
        demo = entries[prompt.env].demonstration(prompt)
        if demo is None:
            raise ValueError(f"environment {prompt.env!r} has no demonstrations: it cannot feed an sft stage")
        text = tokenizer.apply_chat_template(prompt.chat(), add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        end = END_OF_TURN if END_OF_TURN in tokenizer.get_vocab() else tokenizer.eos_token
        loss_mask = None
        if isinstance(demo, str):
            token_ids = tokenizer(demo + end, add_special_tokens=False)["input_ids"]
        else:
            if chat is None:
                from zrl.env.chat import ChatContinuation

                chat = ChatContinuation(tokenizer)
            token_ids, loss_mask = _multi_turn_ids(demo, tokenizer, chat, end, prompt.env)
        if len(prompt_ids) + len(token_ids) > max_tokens:
            skipped += 1
            continue
        examples.append(SFTExample(np.asarray(prompt_ids, np.int64), np.asarray(token_ids, np.int64),
                                   None if loss_mask is None else np.asarray(loss_mask, bool)))
    return examples, skipped


def _multi_turn_ids(messages, tokenizer, chat, end: str, env: str) -> tuple[list[int], list[bool]]:
    """The response ids of a multi-turn demonstration and which of them are trained: each assistant turn's
    content and end of turn (trained); between two turns, the messages of other roles (none: an empty
    reply, as a Turn without messages gets in an episode) as the reply that opens the next turn (context)."""
    problem = transcript_problem(messages)
    if problem:
        raise ValueError(f"environment {env!r}: {problem}")
    ids, mask, replies = [], [], []
    for message in messages:
        if message["role"] != "assistant":
            replies.append(message)
            continue
        if ids:
            reply = chat.reply_ids(replies, ids[-1])
            ids += reply
            mask += [False] * len(reply)
            replies = []
        turn = tokenizer(message["content"] + end, add_special_tokens=False)["input_ids"]
        ids += turn
        mask += [True] * len(turn)
    return ids, mask


def run_sft_stage(stage: SFTStage, ranks: list, tokenizer, seed: int, first_step: int, log_metrics,
                  checkpoint=None, resume_step: int | None = None, data_state: dict | None = None) -> int:
    """Train steps first_step+1 .. first_step+steps; returns the last. With `resume_step` and a
    checkpoint's `data_state` (the ranks already hold its weights) it continues after `resume_step`."""
    source = PromptSource(stage.environments, seed=seed)
    step = first_step
    end = first_step + stage.steps
    if data_state is not None:
        if data_state.get("stage") != stage.name:
            raise ValueError(f"stage {stage.name!r}: the checkpoint's data state is of stage {data_state.get('stage')!r}")
        source.load_state_dict(data_state["prompt_source"])
        step = resume_step
    log.info("stage %r: %d SFT steps from trainer step %d", stage.name, end - step, step)
    while step < end:
        try:
            examples, skipped = build_examples(source, tokenizer, stage.examples_per_step, stage.max_sequence_tokens)
        except EnvironmentFault as exc:
            raise StageStopped(f"stage {stage.name!r} stopped: {exc}") from None
        if not examples:
            raise ValueError(f"stage {stage.name!r}: every example exceeds max_sequence_tokens="
                             f"{stage.max_sequence_tokens}")
        ref = ray.put(examples)
        metrics = trainer_results([rank.sft_step.remote(ref) for rank in ranks], f"SFT step {step + 1}", ray.get,
                                  timeout_s=None)[0]
        step += 1
        metrics["sft/skipped_long_examples"] = float(skipped)
        log_metrics(step, metrics)
        log.info("%s | sft loss %.4f | %d examples | %.0f tok/s", step_count(step, end, stage.steps),
                 metrics.get("loss/sft", float("nan")), len(examples), metrics.get("perf/tokens_per_s", 0.0))
        save = (lambda at: checkpoint(at, {"stage": stage.name, "prompt_source": source.state_dict()})) if checkpoint else None
        if save and (step % stage.checkpoint_every_steps == 0 or step == end):
            save(step)
            save = None  # saved at this step already
        raise_if_stop_requested(step, save)
    return step
