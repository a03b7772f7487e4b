"""Aggregation prompts through `zrl run` on the tiny model: an SFT stage on aggregation demonstrations,
then an RL stage with expert- and self-aggregation entries next to the plain problems.

Self-aggregation rollouts come from the model's own samples (`zrl eval --split train --save-rollouts`),
expert ones from a file of hand-made solutions (one right, three wrong per problem). The tiny model's
rewards are ~0, so zero-signal groups are kept (`dynamic_sampling: false`); the stages must generate,
verify, train and report each entry's reward apart."""

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest
from e2e_testlib import ROOT, ZRL, read_rows, recipe, rl_stage, run_to_completion, write_recipe

from environments.strings import StringTask
from zrl.assets import build_tiny_model, is_checkpoint_dir

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
WORDS = {"tasks": "copy", "min_letters": 3, "max_letters": 5}


def _expert_rollouts(path: Path) -> Path:
    rows = []
    for prompt in StringTask(**WORDS).sample(40, seed=11):
        word = prompt.answer
        responses = [f"{' '.join(w)}\n</think>\n{w}" for w in (word, word[::-1], word[:-1], word + "a")]
        rows.append(json.dumps({"prompt": dataclasses.asdict(prompt), "responses": responses,
                                "rewards": [1.0, 0.0, 0.0, 0.0]}))
    path.write_text("\n".join(rows) + "\n")
    return path


def test_sft_and_rl_stages_train_on_expert_and_self_aggregation_prompts(tmp_path, tmp_path_factory):
    model = tmp_path_factory.getbasetemp() / "tiny-model"
    if not is_checkpoint_dir(model):
        build_tiny_model(model, seed=3)
    self_rollouts = tmp_path / "self.jsonl"
    out = subprocess.run([ZRL, "eval", str(model), "--env", "strings", "--options", json.dumps(WORDS), "--split",
                          "train", "--num-prompts", "24", "--samples", "4", "--temperature", "1.0",
                          "--max-response-tokens", "16", "--save-rollouts", str(self_rollouts)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(line) for line in self_rollouts.read_text().splitlines()]
    assert len(rows) == 24 and all(len(r["responses"]) == len(r["rewards"]) == 4 for r in rows)

    def aggregation(key: str, rollouts: Path) -> dict:
        return {"name": "aggregation", "key": key,
                "options": {"env": "strings", "env_options": WORDS, "rollouts": str(rollouts), "tokenizer": str(model),
                            "num_aggregated": 2, "tail_tokens": 8}}

    expert = _expert_rollouts(tmp_path / "expert.jsonl")
    sft = {"name": "sft_aggregation", "kind": "sft", "steps": 2, "examples_per_step": 8, "max_sequence_tokens": 160,
           "environments": [aggregation("agg_expert", expert)]}
    rl = rl_stage(steps=3, env="strings")
    rl["environments"] = [{"name": "strings", "options": WORDS}, aggregation("agg_expert", expert),
                          aggregation("agg_self", self_rollouts)]
    rl["sampling"].update(max_prompt_tokens=160, max_response_tokens=16)
    rl["algorithm"]["dynamic_sampling"] = False
    run_dir = tmp_path / "run"
    path = write_recipe(tmp_path / "recipe.yaml", recipe(run_dir, model, stages=[sft, rl]))
    run_to_completion(path, tmp_path / "run.log")
    logged = read_rows(run_dir)
    assert [r["step"] for r in logged if "loss/sft" in r][-1] == 2
    rl_rows = [r for r in logged if "reward/mean" in r]
    assert [r["step"] for r in rl_rows][-1] == 5
    seen = {key for r in rl_rows for key in r if key.startswith("reward/")}
    assert {"reward/strings", "reward/agg_expert", "reward/agg_self"} <= seen, sorted(seen)
