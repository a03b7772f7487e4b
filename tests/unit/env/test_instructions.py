"""IFEval instruction checks (environments/instructions.py): IFEval's semantics for every registered
instruction, the JSONL reader's errors, the synthetic prompts, `follow`, and offline operation."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from environments.instructions import (HARD, IFPrompt, Instruction, check, follow, read_prompts,
                                       synthetic_prompts)

ROOT = Path(__file__).resolve().parents[3]

# instruction id -> (kwargs, a response that follows it, one that does not); modelled on the examples
# of the IFEval paper's instruction list and lm-eval's checker docstrings.
CASES = {
    "keywords:existence": ({"keywords": ["sleep", "light"]}, "I sleep with the light on.", "I sleep in the dark."),
    "keywords:frequency": ({"keyword": "risk", "frequency": 2, "relation": "at least"},
                           "A risk is a risk worth taking.", "No risk no reward."),
    "keywords:forbidden_words": ({"forbidden_words": ["bad", "evil"]}, "What a good day.", "What a bad day."),
    "keywords:letter_frequency": ({"letter": "z", "let_frequency": 3, "let_relation": "at least"},
                                  "Zany zebras zigzag.", "Plain text only."),
    "language:response_language": ({"language": "de"}, "Das ist ein ganz normaler deutscher Satz über das Wetter.",
                                   "This is a perfectly ordinary English sentence about the weather."),
    "length_constraints:number_sentences": ({"num_sentences": 3, "relation": "less than"},
                                            "The sky is blue. Grass is green.",
                                            "The sky is blue. Grass is green. Snow is white."),
    "length_constraints:number_paragraphs": ({"num_paragraphs": 2}, "First paragraph.\n***\nSecond paragraph.",
                                             "Only one paragraph."),
    "length_constraints:number_words": ({"num_words": 5, "relation": "at least"}, "one two three four five",
                                        "one two"),
    "length_constraints:nth_paragraph_first_word": (
        {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "however"},
        "It rained all day.\n\nHowever, we went out.", "It rained all day.\n\nWe went out anyway."),
    "detectable_content:number_placeholders": ({"num_placeholders": 2}, "Dear [name], see you at [address].",
                                               "Dear John, see you at home."),
    "detectable_content:postscript": ({"postscript_marker": "P.S."}, "Thanks for the letter.\nP.S. See you soon.",
                                      "Thanks for the letter."),
    "detectable_format:number_bullet_lists": ({"num_bullets": 2}, "* This is point 1.\n* This is point 2",
                                              "* This is point 1.\n* This is point 2\n* This is point 3"),
    "detectable_format:constrained_response": ({}, "My answer is yes.", "Yes."),
    "detectable_format:number_highlighted_sections": ({"num_highlights": 2}, "A *highlighted section* and *another*.",
                                                      "Only *one* here."),
    "detectable_format:multiple_sections": ({"section_spliter": "Section", "num_sections": 2},
                                            "Section 1\nThe start.\nSection 2\nThe end.", "Section 1\nEverything."),
    "detectable_format:json_format": ({}, '```json\n{"answer": 1}\n```', "answer: 1"),
    "detectable_format:title": ({}, "<<poem of joy>>\nJoy fills the air.", "poem of joy\nJoy fills the air."),
    "combination:two_responses": ({}, "Yes, it will.\n******\nNo, it will not.", "Yes.\n******\nYes."),
    "combination:repeat_prompt": ({"prompt_to_repeat": "Write a haiku about rain."},
                                  "Write a haiku about rain. Drops on the window.", "Drops on the window."),
    "startend:end_checker": ({"end_phrase": "Any other questions?"}, "That is all. Any other questions?",
                             "Any other questions? That is all."),
    "change_case:capital_word_frequency": ({"capital_frequency": 2, "capital_relation": "at least"},
                                           "This is VERY VERY important.", "This is very important."),
    "change_case:english_capital": ({}, "THIS IS AN ENGLISH SENTENCE ABOUT THE WEATHER TODAY.",
                                    "This is an English sentence about the weather today."),
    "change_case:english_lowercase": ({}, "this is an english sentence about the weather today.",
                                      "This is an English sentence about the weather today."),
    "punctuation:no_comma": ({}, "No commas in this one.", "Yes, one comma."),
    "startend:quotation": ({}, '"Wrapped in quotes."', "Not wrapped in quotes."),
}


def _prompt(*instructions: Instruction, text: str = "Write something.") -> IFPrompt:
    return IFPrompt("test", text, instructions)


def _reference(response: str, prompt: IFPrompt) -> tuple[bool, ...]:
    """lm-eval's own strict IFEval evaluation of the same response."""
    from lm_eval.tasks.ifeval.utils import InputExample, test_instruction_following_strict

    example = InputExample(key=0, instruction_id_list=[i.id for i in prompt.instructions], prompt=prompt.prompt,
                           kwargs=[i.kwargs for i in prompt.instructions])
    return tuple(test_instruction_following_strict(example, response).follow_instruction_list)


def test_every_registered_instruction_has_a_case():
    from lm_eval.tasks.ifeval.instructions_registry import INSTRUCTION_DICT

    assert set(CASES) == set(INSTRUCTION_DICT)


@pytest.mark.parametrize("instruction_id", sorted(CASES))
def test_check_follows_ifeval(instruction_id):
    kwargs, following, violating = CASES[instruction_id]
    prompt = _prompt(Instruction(instruction_id, kwargs))
    assert check(following, prompt) == (True,)
    assert check(violating, prompt) == (False,)
    assert check(following, prompt) == _reference(following, prompt)
    assert check(violating, prompt) == _reference(violating, prompt)


def test_empty_response_fails_every_instruction():
    prompt = _prompt(Instruction("keywords:forbidden_words", {"forbidden_words": ["bad"]}),
                     Instruction("punctuation:no_comma"))
    assert check("no bad words, one comma", prompt) == (False, False)
    assert check("fine words", prompt) == (True, True)
    assert check("", prompt) == check(" \n ", prompt) == (False, False)


def test_check_is_one_verdict_per_instruction_in_order():
    prompt = _prompt(Instruction("startend:quotation"), Instruction("punctuation:no_comma"),
                     Instruction("detectable_format:title"))
    assert check('"<<t>> a, b"', prompt) == (True, False, True)
    assert check("<<t>> a b", prompt) == (False, True, True)


def _row(**overrides) -> str:
    row = {"key": 1000, "prompt": "Write a poem about the sea. Do not use any commas.",
           "instruction_id_list": ["punctuation:no_comma", "keywords:existence"],
           "kwargs": [{}, {"keywords": ["wave"], "num_words": None}]}
    return json.dumps({**row, **overrides})


def test_read_prompts_round_trip(tmp_path):
    path = tmp_path / "ifeval.jsonl"
    second_row = _row(key=1001, instruction_id_list=["detectable_format:title"], kwargs=[{}])
    path.write_text(_row() + "\n\n" + second_row + "\n")
    first, second = read_prompts(path)
    assert first == IFPrompt("1000", "Write a poem about the sea. Do not use any commas.",
                             (Instruction("punctuation:no_comma", {}),
                              Instruction("keywords:existence", {"keywords": ["wave"]})))
    assert second.key == "1001" and second.instructions == (Instruction("detectable_format:title", {}),)
    assert check("Every wave returns", first) == (True, True)
    assert check("Every wave, returns", first) == (False, True)


@pytest.mark.parametrize("line, message", [
    ("{not json", "not JSON"),
    ("[1, 2]", "expected an object"),
    (_row(prompt=""), "prompt:"),
    (_row(instruction_id_list=[]), "instruction_id_list:"),
    (_row(instruction_id_list=["punctuation:no_coma", "keywords:existence"]),
     "instruction_id_list[0]: unknown instruction 'punctuation:no_coma'; did you mean ['punctuation:no_comma']"),
    (_row(kwargs=[{}]), "kwargs: a list of 2 objects"),
    (_row(kwargs=[{}, {"keyword": ["wave"]}]), "kwargs[1]:"),
    (_row(instruction_id_list=["length_constraints:number_words"], kwargs=[{"num_words": 5, "relation": "about"}]),
     "kwargs[0]:"),
])
def test_read_prompts_errors_name_line_and_field(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(_row() + "\n" + line + "\n")
    with pytest.raises(ValueError) as error:
        read_prompts(path)
    assert str(error.value).startswith(f"{path}:2: {message}")
    assert "\n" not in str(error.value)


def test_synthetic_prompts_are_deterministic_and_split():
    assert synthetic_prompts(20, 3, "hard") == synthetic_prompts(20, 3, "hard")
    assert synthetic_prompts(20, 3, "hard") != synthetic_prompts(20, 4, "hard")
    train = {p.prompt for p in synthetic_prompts(300, 0, "simple", "train")}
    evals = {p.prompt for p in synthetic_prompts(100, 0, "simple", "eval")}
    assert train and evals and not train & evals


@pytest.mark.parametrize("level", ["simple", "hard"])
def test_synthetic_prompts_shape(level):
    from lm_eval.tasks.ifeval.instructions_registry import INSTRUCTION_CONFLICTS

    prompts = synthetic_prompts(200, 1, level)
    counts = {len(p.instructions) for p in prompts}
    assert counts == ({1} if level == "simple" else {2, 3})
    for p in prompts:
        word = p.base_answer
        assert p.prompt.startswith(f"Repeat the word {word}.") and 3 <= len(word) <= 5 and set(word) <= set("abcdefgh")
        ids = [i.id for i in p.instructions]
        assert set(ids) <= set(HARD) and len(set(ids)) == len(ids)
        assert not any(b in INSTRUCTION_CONFLICTS[a] for a in ids for b in ids if a != b)
    assert len({i.id for p in prompts for i in p.instructions}) >= 8  # the pool is used, not one instruction


@pytest.mark.parametrize("level", ["simple", "hard"])
@pytest.mark.parametrize("courtesy", ["", "\nHope this helps."])
def test_follow_satisfies_every_synthetic_prompt(level, courtesy):
    prompts = synthetic_prompts(300, 7, level)
    for p in prompts:
        response = follow(p.base_answer + courtesy, p.instructions, p.prompt)
        assert response is not None, p
        assert all(check(response, p)), (p, response)
        assert p.base_answer in response.lower()
    violated = sum(not all(check(p.base_answer, p)) for p in prompts) / len(prompts)
    assert violated > 0.5, violated


def test_follow_matches_lm_eval_reference():
    for p in synthetic_prompts(40, 11, "hard"):
        response = follow(p.base_answer, p.instructions, p.prompt)
        assert _reference(response, p) == check(response, p) == (True,) * len(p.instructions)


def test_follow_refuses_what_it_cannot_satisfy():
    assert follow("abc", [Instruction("language:response_language", {"language": "de"})]) is None
    assert follow("abc", [Instruction("keywords:existence")]) is None  # no keywords given
    assert follow("a bad word", [Instruction("keywords:forbidden_words", {"forbidden_words": ["bad"]})]) is None
    assert follow("abc", [Instruction("startend:quotation"), Instruction("startend:quotation")]) is None


def test_checks_run_offline_and_say_how_to_get_the_data(tmp_path):
    """No NLTK_DATA, no home directory data, and any download attempt fails: sentence counting works from
    the environment's nltk_data (`sys.prefix/nltk_data`, on NLTK's default path), and without it the first
    check names the setup command."""
    script = f"""
import nltk
def refuse(*args, **kwargs):
    raise OSError("network disabled in this test")
nltk.download = refuse
import environments.instructions as ins
p = ins.IFPrompt("k", "Write.", (ins.Instruction("length_constraints:number_sentences",
                                                 {{"num_sentences": 3, "relation": "less than"}}),))
default = list(nltk.data.path)
nltk.data.path[:] = [d for d in default if d != str(ins.NLTK_DATA)]
try:
    ins.check("One.", p)
except RuntimeError as exc:
    print("ERROR", exc)
nltk.data.path[:] = default
print(ins.check("The sky is blue. Grass is green.", p), ins.check("The sky is blue. Grass is green. Snow is white.", p))
print(nltk.data.find("tokenizers/punkt_tab/english/"))
"""
    env = {k: v for k, v in os.environ.items() if k != "NLTK_DATA"} | {"HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    error, verdicts, found = out.stdout.strip().splitlines()
    assert error.startswith("ERROR NLTK's punkt_tab data") and "run `python3 zrl/bootstrap.py setup`" in error
    assert verdicts == "(True,) (False,)"
    assert found.startswith(str(Path(sys.prefix) / "nltk_data"))
