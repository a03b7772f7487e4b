"""IFEval's verifiable instructions: checked by IFEval's own code, read from JSONL, generated and followed.

- `check(response, prompt)`: IFEval's strict check, one verdict per instruction, run by lm-eval's copy of
  Google's reference implementation (`lm_eval.tasks.ifeval`): each instruction's checker gets
  `build_description(**kwargs)` (arguments that are None, 0 or empty dropped, as the reference drops
  them), again with the prompt when the instruction takes it, then `check_following(response)`; an empty
  or whitespace response fails every instruction. Which text is checked is the caller's choice (the
  behavioural environments pass the answer section after `</think>`).
- `read_prompts(path)`: IFEval's JSONL (IFBench's format; its ids must be IFEval's).
- `synthetic_prompts(n, seed, level)`: the tiny task "Repeat the word w." with one ("simple") or 2-3
  non-conflicting ("hard") instructions, described in IFEval's own wording (`build_description`).
- `follow(answer, instructions)`: a response that follows the instructions, built from an answer
  (SFT demonstrations); it returns only responses `check` passes, else None.

Invariants:
- Offline: the checks count sentences with NLTK's English punkt_tab model, which lm-eval downloads at
  import unless NLTK finds it. NLTK searches `NLTK_DATA` and its default directories, among them
  `<sys.prefix>/nltk_data`, i.e. `.venv/nltk_data` (written by `python3 zrl/bootstrap.py setup`), so any
  process of the environment finds it wherever the code runs from (a Ray job's uploaded copy too); when
  none has it the first check stops with one line saying so, before lm-eval is imported.
- lm-eval is imported on first use (a few seconds), not when this module is.
- Deterministic: langdetect (the case and language checks) samples at random; its seed is fixed at 0
  so a response always gets the same verdict. The reference leaves it unseeded: clear text gets the
  same verdict either way, ambiguous text one of the verdicts the reference can give.
"""

import difflib
import functools
import json
import random
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from zrl.env.base import in_split
from zrl.types import Split

NLTK_DATA = Path(sys.prefix) / "nltk_data"  # on NLTK's default search path; the set-up writes punkt_tab there
BASE_TASK = "Repeat the word {w}."
_RELATIONS = ("less than", "at least")  # IFEval's comparison relations
_END_PHRASES = ("Any other questions?", "Is there anything else I can help with?")  # IFEval's options
_POSTSCRIPT_MARKERS = ("P.S.", "P.P.S")  # IFEval's options

SIMPLE = ("change_case:english_capital", "change_case:english_lowercase", "startend:quotation",
          "detectable_format:title", "punctuation:no_comma", "startend:end_checker", "keywords:existence",
          "detectable_content:postscript", "combination:repeat_prompt", "detectable_format:json_format")
HARD = SIMPLE + ("keywords:frequency", "keywords:forbidden_words", "length_constraints:number_words",
                 "detectable_format:number_bullet_lists", "change_case:capital_word_frequency",
                 "detectable_content:number_placeholders")

# The fixed text `follow` writes. English sentences are added, fewest first, only where the case checks'
# language detection needs them: langdetect skips the letters inside all-capital words, so it judges an
# uppercase response by its words' first letters, and a short word alone is rarely English. Measured on
# 2,883 synthetic prompts with a case instruction, answers with and without "Hope this helps.": these
# (no commas, no capital word) needed 0 sentences for 2,623, 1 for 3,141, 2 for 2 and never failed;
# "This is my answer." and the like failed 32.
_TITLE = "<<Answer>>"
_ENGLISH = ("That is the answer that you wanted.", "This was what you asked me to write.",
            "Thank you for the question that you asked.")
_POSTSCRIPT = "Thank you for reading."
_SHOUTED = ("PLEASE", "NOTE", "THIS", "WELL", "NOW")
_PLACEHOLDERS = ("[name]", "[date]", "[place]", "[time]")
_FILLER = "here is some more text so that the response is long enough".split()
_FIXED_TEXT = " ".join((BASE_TASK, _TITLE, *_ENGLISH, _POSTSCRIPT, *_SHOUTED, *_PLACEHOLDERS, *_FILLER,
                        *_END_PHRASES, "keywords keyword details point")).lower()


@dataclass(frozen=True)
class Instruction:
    id: str  # IFEval instruction id, e.g. "change_case:english_capital"
    kwargs: dict = field(default_factory=dict)  # its arguments as in IFEval's JSONL, None-valued keys dropped


@dataclass(frozen=True)
class IFPrompt:
    key: str  # stable id
    prompt: str  # the full user prompt: base task and instruction descriptions
    instructions: tuple[Instruction, ...]
    base_answer: str | None = None  # synthetic prompts: the base task's answer; None for user data


@functools.cache
def _ifeval():
    """lm-eval's IFEval registry, imported once NLTK can find punkt_tab without downloading it."""
    import langdetect
    import nltk

    try:
        nltk.data.find("tokenizers/punkt_tab/english/")
    except LookupError:
        raise RuntimeError(f"NLTK's punkt_tab data (IFEval's sentence counts) is in neither {NLTK_DATA} nor "
                           "NLTK_DATA: run `python3 zrl/bootstrap.py setup`") from None
    langdetect.DetectorFactory.seed = 0
    from lm_eval.tasks.ifeval import instructions_registry, instructions_util

    return instructions_registry, instructions_util


def _checker_class(instruction_id: str):
    known = _ifeval()[0].INSTRUCTION_DICT
    if instruction_id not in known:
        close = difflib.get_close_matches(instruction_id, known, n=3)
        raise ValueError(f"unknown instruction {instruction_id!r}" + (f"; did you mean {close}?" if close else ""))
    return known[instruction_id]


def _checker(instruction: Instruction, prompt: str):
    """IFEval's checker for `instruction`, set up as the reference's strict check sets it up."""
    checker = _checker_class(instruction.id)(instruction.id)
    checker.build_description(**{k: v for k, v in instruction.kwargs.items() if v})
    args = checker.get_instruction_args()
    if args and "prompt" in args:
        checker.build_description(prompt=prompt)
    return checker


def check(response: str, prompt: IFPrompt) -> tuple[bool, ...]:
    """One verdict per instruction of `prompt`: IFEval's strict check of `response` (module docstring)."""
    checkers = [_checker(instruction, prompt.prompt) for instruction in prompt.instructions]
    return tuple(bool(response.strip()) and bool(c.check_following(response)) for c in checkers)


def jsonl_objects(path, fields: str) -> Iterator[tuple[str, int, dict]]:
    """(where, line number, object) per non-blank line of a JSONL file; a line that is not a JSON object
    is a one-line ValueError naming file:line (`fields`: what the object should hold, for the message)."""
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected an object with {fields}")
        yield where, number, row


def read_prompts(path) -> list[IFPrompt]:
    """IFEval's JSONL: {"key", "prompt", "instruction_id_list", "kwargs"} per line (a missing key is the
    line number). Errors are one line naming file:line and the field."""
    prompts = []
    for where, number, row in jsonl_objects(path, "prompt, instruction_id_list and kwargs"):
        text, ids, kwargs = row.get("prompt"), row.get("instruction_id_list"), row.get("kwargs")
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{where}: prompt: a non-empty string is required")
        if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
            raise ValueError(f"{where}: instruction_id_list: a non-empty list of instruction ids is required")
        if not isinstance(kwargs, list) or len(kwargs) != len(ids) or not all(isinstance(k, dict) for k in kwargs):
            raise ValueError(f"{where}: kwargs: a list of {len(ids)} objects (one per instruction id) is required")
        instructions = tuple(Instruction(i, {k: v for k, v in kw.items() if v is not None})
                             for i, kw in zip(ids, kwargs))
        for index, instruction in enumerate(instructions):
            try:
                _checker_class(instruction.id)
            except ValueError as exc:
                raise ValueError(f"{where}: instruction_id_list[{index}]: {exc}") from None
            try:
                _checker(instruction, text)
            except (TypeError, ValueError) as exc:  # an argument the instruction does not take or accept
                raise ValueError(f"{where}: kwargs[{index}]: {exc}") from None
        prompts.append(IFPrompt(key=str(row.get("key", number)), prompt=text, instructions=instructions))
    return prompts


@functools.cache
def _keywords() -> tuple[str, ...]:
    """IFEval's keyword list, less words that could turn up in a response by accident: short ones (they
    can hide in the word to repeat), those in `follow`'s fixed text, and those inside another keyword."""
    _, util = _ifeval()
    long = [w for w in util.WORD_LIST if len(w) >= 6 and w not in _FIXED_TEXT]
    return tuple(sorted({w for w in long if not any(w != o and w in o for o in long)}))


def _arguments(instruction_id: str, rng: random.Random, words: list[str], base: str) -> dict:
    """Arguments for one synthetic instruction; `words` are this prompt's unused keywords."""
    relation = rng.choice(_RELATIONS)
    match instruction_id:
        case "keywords:existence":
            return {"keywords": [words.pop() for _ in range(rng.randint(1, 2))]}
        case "keywords:frequency":
            return {"keyword": words.pop(), "frequency": rng.randint(1, 3), "relation": relation}
        case "keywords:forbidden_words":
            return {"forbidden_words": [words.pop(), words.pop()]}
        case "startend:end_checker":
            return {"end_phrase": rng.choice(_END_PHRASES)}
        case "detectable_content:postscript":
            return {"postscript_marker": rng.choice(_POSTSCRIPT_MARKERS)}
        case "combination:repeat_prompt":
            return {"prompt_to_repeat": base}
        case "length_constraints:number_words":  # bounds `follow`'s longest response meets either way
            return {"num_words": rng.choice((10, 20, 30) if relation == "at least" else (60, 100)),
                    "relation": relation}
        case "detectable_format:number_bullet_lists":
            return {"num_bullets": rng.randint(1, 3)}
        case "change_case:capital_word_frequency":  # "less than": room for "I" and "P.S." in the response
            return {"capital_frequency": rng.choice((2, 3, 4) if relation == "at least" else (6, 8)),
                    "capital_relation": relation}
        case "detectable_content:number_placeholders":
            return {"num_placeholders": rng.randint(1, 3)}
    return {}


def synthetic_prompts(n: int, seed: int, level: Literal["simple", "hard"], split: Split = "train") -> list[IFPrompt]:
    """`n` prompts "Repeat the word w." (w: 3-5 letters of a-h) with one ("simple") or 2-3 ("hard")
    instructions `follow` can satisfy, pairwise free of IFEval's conflicts; deterministic in the
    arguments, split into train/eval by the prompt text."""
    if level not in ("simple", "hard"):
        raise ValueError(f"level must be 'simple' or 'hard'; got {level!r}")
    registry, _ = _ifeval()
    conflicts = registry.conflict_make({k: set(v) for k, v in registry.INSTRUCTION_CONFLICTS.items()})
    rng = random.Random(f"instructions:{level}:{seed}:{split}")
    prompts = []
    while len(prompts) < n:
        word = "".join(rng.choices("abcdefgh", k=rng.randint(3, 5)))
        base = BASE_TASK.format(w=word)
        ids: list[str] = []
        for _ in range(1 if level == "simple" else rng.randint(2, 3)):
            # Every id conflicts with itself, so none repeats.
            ids.append(rng.choice([i for i in (SIMPLE if level == "simple" else HARD) if not conflicts[i] & set(ids)]))
        words = rng.sample(_keywords(), 6)
        instructions = tuple(Instruction(i, _arguments(i, rng, words, base)) for i in ids)
        descriptions = [_checker_class(i.id)(i.id).build_description(**i.kwargs) for i in instructions]
        text = " ".join([base, *descriptions])
        if in_split(text, split):
            prompts.append(IFPrompt(f"instructions:{level}:{split}:{seed}:{len(prompts)}", text, instructions, word))
    return prompts


def _compose(answer: str, args: dict[str, dict], english: Sequence[str]) -> str:
    """The answer with what each instruction asks for added around it, in an order that keeps each
    addition intact: lines, then commas removed, case, and the JSON or quotation wrapper last."""
    lines = [args["combination:repeat_prompt"]["prompt_to_repeat"]] if "combination:repeat_prompt" in args else []
    if "detectable_format:title" in args:
        lines.append(_TITLE)
    lines += [answer.strip(), *english]
    if "keywords:existence" in args:
        lines.append("Keywords: " + " ".join(args["keywords:existence"]["keywords"]) + ".")
    frequency = args.get("keywords:frequency")
    if frequency and frequency["relation"] == "at least":
        lines.append("Keyword: " + " ".join([frequency["keyword"]] * frequency["frequency"]) + ".")
    placeholders = args.get("detectable_content:number_placeholders")
    if placeholders:
        lines.append("Details: " + " ".join(_PLACEHOLDERS[:placeholders["num_placeholders"]]))
    capitals = args.get("change_case:capital_word_frequency")
    if capitals and capitals["capital_relation"] == "at least":
        lines.append(" ".join(_SHOUTED[:capitals["capital_frequency"]]) + ".")
    if "detectable_format:number_bullet_lists" in args:
        lines += [f"* Point {i}." for i in range(1, args["detectable_format:number_bullet_lists"]["num_bullets"] + 1)]
    tail = []
    if "detectable_content:postscript" in args:
        tail.append(f"{args['detectable_content:postscript']['postscript_marker']} {_POSTSCRIPT}")
    if "startend:end_checker" in args:
        tail.append(args["startend:end_checker"]["end_phrase"])
    words = args.get("length_constraints:number_words")
    if words and words["relation"] == "at least":
        missing = words["num_words"] - _ifeval()[1].count_words("\n".join(lines + tail))
        if missing > 0:
            lines.append(" ".join(_FILLER[i % len(_FILLER)] for i in range(missing)) + ".")
    text = "\n".join(lines + tail)
    if "punctuation:no_comma" in args:
        text = text.replace(",", "")
    if "change_case:english_capital" in args:
        text = text.upper()
    if "change_case:english_lowercase" in args:
        text = text.lower()
    if "detectable_format:json_format" in args:
        text = json.dumps({"answer": text})
    if "startend:quotation" in args:
        text = f'"{text}"'
    return text


# The arguments `_compose` reads, per instruction.
_NEEDS = {"keywords:existence": "keywords", "keywords:frequency": "keyword frequency relation",
          "keywords:forbidden_words": "forbidden_words", "startend:end_checker": "end_phrase",
          "detectable_content:postscript": "postscript_marker", "combination:repeat_prompt": "prompt_to_repeat",
          "length_constraints:number_words": "num_words relation",
          "detectable_format:number_bullet_lists": "num_bullets",
          "change_case:capital_word_frequency": "capital_frequency capital_relation",
          "detectable_content:number_placeholders": "num_placeholders"}


def follow(answer: str, instructions: Sequence[Instruction], prompt: str = "") -> str | None:
    """A response built from `answer` that `check` passes for every instruction, or None when that is
    out of reach: an instruction outside `HARD`, one without the arguments it needs, a repeated id, or an
    answer that breaks an instruction by itself (a forbidden word, more capital words than allowed)."""
    args = {i.id: i.kwargs for i in instructions}
    if len(args) != len(instructions) or any(
            i.id not in HARD or not set(_NEEDS.get(i.id, "").split()) <= set(i.kwargs) for i in instructions):
        return None
    target = IFPrompt("follow", prompt, tuple(instructions))
    for extra in range(len(_ENGLISH) + 1):
        response = _compose(answer, args, _ENGLISH[:extra])
        if all(check(response, target)):
            return response
    return None
