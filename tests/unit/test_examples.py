"""The example environment packages (examples/reverse-word-env, examples/lookup-env), installed and used as a
user would.

pip builds a wheel of a copy of each package (the README's `pip wheel` command: its own pyproject.toml,
setuptools) and installs it into a scratch directory (`--target`: the module and the `.dist-info` with
the `zrl.environments` entry point, what `pip install` leaves in a virtualenv's site-packages). A fresh
Python process with that directory on PYTHONPATH then finds the environment by its entry-point name and
by its `module:Class` reference, samples, verifies and demonstrates through it (a multi-turn
demonstration is played through an episode: the environment must give the replies it shows and reward
its answer), and `zrl validate` accepts the example's recipe. The copy keeps pip's build files out of
the checkout.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ZRL = str(Path(sys.executable).parent / "zrl")
PIP = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
OFFLINE = ["--no-deps", "--no-build-isolation", "--no-index"]  # the venv's setuptools builds it; nothing is fetched


@dataclass(frozen=True)
class Example:
    folder: str          # under examples/
    distribution: str    # the package's project name
    name: str            # its entry-point name
    reference: str       # the entry point's `module:Class`
    unknown: tuple[str, ...]  # what `zrl validate` says of its recipe without the package

    @property
    def path(self) -> Path:
        return ROOT / "examples" / self.folder


REVERSE_WORD = Example("reverse-word-env", "zrl-reverse-word-env", "reverse_word", "reverse_word_env.envs:ReverseWord",
                       ("unknown environment 'reverse_word'", "cannot import 'reverse_word_env.envs'"))
LOOKUP = Example("lookup-env", "zrl-lookup-env", "lookup", "lookup_env.envs:Lookup", ("unknown environment 'lookup'",))
EXAMPLES = {e.folder: e for e in (REVERSE_WORD, LOOKUP)}

# argv: the entry-point name and the `module:Class` reference. A problem's key (what the train/eval split
# partitions) is its prompt's last word.
USE = r"""
import json, sys
from pathlib import Path
from zrl.env import registry, safe_verify
from zrl.env.episode import EpisodicEnvironment

name, reference = sys.argv[1:]
info = registry.get(name)
env = info.factory()
train, held_out = env.sample(200, seed=3), env.sample(200, seed=3, split="eval")
key = lambda p: p.messages[0].content.split()[-1].rstrip(".")

def played(prompt, demo):
    # The reward of a demonstration: a response verified, or a transcript played through an episode (-1
    # when the environment's replies are not the transcript's).
    if not isinstance(env, EpisodicEnvironment):
        return safe_verify(env, prompt, demo).reward
    episode, shown, given, turn = env.episode(prompt), [], [], None
    for message in demo:
        if message["role"] != "assistant":
            shown.append(dict(message))
            continue
        turn = episode.step(message["content"])
        given += [dict(m) for m in turn.messages]
    episode.close()
    return turn.reward if turn.done and shown == given else -1.0

def wrong(demo):  # the demonstration with its final answer spoilt
    if isinstance(demo, str):
        return demo + "x"
    return demo[:-1] + [{"role": "assistant", "content": demo[-1]["content"] + "x"}]

print(json.dumps({
    "source": info.source,
    "file": sys.modules[info.factory.__module__].__file__,
    "by_reference": registry.get(reference).factory is info.factory,
    "deterministic": env.sample(200, seed=3) == train,
    "shared_keys": sorted({key(p) for p in train} & {key(p) for p in held_out}),
    "demonstrations": [played(p, env.demonstration(p)) for p in train + held_out],
    "wrong": played(train[0], wrong(env.demonstration(train[0]))),
}))
"""


@pytest.fixture(scope="module", params=sorted(EXAMPLES))
def installed(request, tmp_path_factory) -> tuple[Example, Path, Path]:
    """(the example, the wheel pip built of it, the directory pip installed it into)."""
    example = EXAMPLES[request.param]
    tmp = tmp_path_factory.mktemp(example.folder)
    source = shutil.copytree(example.path, tmp / "src")
    subprocess.run([*PIP, "wheel", *OFFLINE, "-w", str(tmp / "dist"), str(source)], check=True, timeout=300)
    [wheel] = (tmp / "dist").glob("*.whl")
    subprocess.run([*PIP, "install", *OFFLINE, "--target", str(tmp / "site"), str(wheel)], check=True, timeout=300)
    return example, wheel, tmp / "site"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from zrl.assets import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny-zaya")


def with_site(site: Path) -> dict:
    """This process's environment with `site` first on PYTHONPATH."""
    return os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}


def test_the_wheel_registers_the_entry_point(installed):
    example, wheel, site = installed
    if example is REVERSE_WORD:  # the wheel the README ships to a Ray job
        assert f'"py_modules": ["dist/{wheel.name}"]' in (ROOT / "README.md").read_text()
    [dist_info] = site.glob("*.dist-info")
    entry_points = (dist_info / "entry_points.txt").read_text()
    assert f"[zrl.environments]\n{example.name} = {example.reference}" in entry_points


def test_the_installed_package_is_found_by_name_and_by_reference_and_works(installed):
    example, _, site = installed
    proc = subprocess.run([sys.executable, "-c", USE, example.name, example.reference], env=with_site(site),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    facts = json.loads(proc.stdout.splitlines()[-1])
    assert facts["source"] == f"entry point {example.distribution}"
    assert Path(facts["file"]).is_relative_to(site)  # the installed copy, not the checkout's
    assert facts["by_reference"] and facts["deterministic"]
    assert facts["shared_keys"] == []  # held-out problems never reach training
    assert facts["demonstrations"] == [1.0] * 400 and facts["wrong"] == 0.0


def test_validate_accepts_the_example_recipe_once_the_package_is_installed(installed, tiny_model, tmp_path):
    example, _, site = installed
    command = [ZRL, "validate", str(example.path / "recipe.yaml"), "--set", f"model.path={tiny_model}",
               "--set", f"output_dir={tmp_path / 'run'}"]
    proc = subprocess.run(command, env=with_site(site), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if importlib.util.find_spec(example.reference.partition(".")[0]) is not None:
        pytest.skip("the example is installed in this environment: no control without it")
    proc = subprocess.run(command, env=dict(os.environ), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    for line in example.unknown:
        assert line in proc.stderr
