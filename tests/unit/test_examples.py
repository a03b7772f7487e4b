"""The example environment package (examples/reverse-word-env), installed and used as a user would.

pip builds a wheel of a copy of the package (the README's `pip wheel` command: its own pyproject.toml,
setuptools) and installs it into a scratch directory (`--target`: the module and the `.dist-info` with
the `zrl.environments` entry point, what `pip install` leaves in a virtualenv's site-packages). A fresh
Python process with that directory on PYTHONPATH then finds the environment by its entry-point name and
by its `module:Class` reference, samples, verifies and demonstrates through it, and `zrl validate`
accepts the example's recipe (an sft stage naming it, an rl stage referencing it). The copy keeps pip's
build files out of the checkout.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "reverse-word-env"
ZRL = str(Path(sys.executable).parent / "zrl")
PIP = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
OFFLINE = ["--no-deps", "--no-build-isolation", "--no-index"]  # the venv's setuptools builds it; nothing is fetched

USE = r"""
import json, sys
from pathlib import Path
from zrl.env import registry, safe_verify

info = registry.get("reverse_word")
env = info.factory()
train, held_out = env.sample(200, seed=3), env.sample(200, seed=3, split="eval")
word = lambda p: p.messages[0].content.split()[-1].rstrip(".")
print(json.dumps({
    "source": info.source,
    "file": sys.modules[info.factory.__module__].__file__,
    "by_reference": registry.get("reverse_word_env.envs:ReverseWord").factory is info.factory,
    "deterministic": env.sample(200, seed=3) == train,
    "shared_words": sorted({word(p) for p in train} & {word(p) for p in held_out}),
    "demonstrations": [safe_verify(env, p, env.demonstration(p)).reward for p in train + held_out],
    "wrong": safe_verify(env, train[0], "</think>" + train[0].answer + "x").reward,
}))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(the wheel pip built, the directory pip installed it into)."""
    tmp = tmp_path_factory.mktemp("example")
    source = shutil.copytree(EXAMPLE, tmp / "src")
    subprocess.run([*PIP, "wheel", *OFFLINE, "-w", str(tmp / "dist"), str(source)], check=True, timeout=300)
    [wheel] = (tmp / "dist").glob("*.whl")
    subprocess.run([*PIP, "install", *OFFLINE, "--target", str(tmp / "site"), str(wheel)], check=True, timeout=300)
    return wheel, tmp / "site"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from zrl.assets import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny-zaya")


def with_site(site: Path) -> dict:
    """This process's environment with `site` first on PYTHONPATH."""
    return os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}


def test_the_wheel_is_the_one_the_readme_ships(installed):
    wheel, site = installed
    assert f'"py_modules": ["dist/{wheel.name}"]' in (ROOT / "README.md").read_text()
    [dist_info] = site.glob("*.dist-info")
    entry_points = (dist_info / "entry_points.txt").read_text()
    assert "[zrl.environments]\nreverse_word = reverse_word_env.envs:ReverseWord" in entry_points


def test_the_installed_package_is_found_by_name_and_by_reference_and_works(installed):
    _, site = installed
    proc = subprocess.run([sys.executable, "-c", USE], env=with_site(site), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    facts = json.loads(proc.stdout.splitlines()[-1])
    assert facts["source"] == "entry point zrl-reverse-word-env"
    assert Path(facts["file"]).is_relative_to(site)  # the installed copy, not the checkout's
    assert facts["by_reference"] and facts["deterministic"]
    assert facts["shared_words"] == []  # held-out words never reach training
    assert facts["demonstrations"] == [1.0] * 400 and facts["wrong"] == 0.0


def test_validate_accepts_the_example_recipe_once_the_package_is_installed(installed, tiny_model, tmp_path):
    _, site = installed
    command = [ZRL, "validate", str(EXAMPLE / "recipe.yaml"), "--set", f"model.path={tiny_model}",
               "--set", f"output_dir={tmp_path / 'run'}"]
    proc = subprocess.run(command, env=with_site(site), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if importlib.util.find_spec("reverse_word_env") is not None:
        pytest.skip("the example is installed in this environment: no control without it")
    proc = subprocess.run(command, env=dict(os.environ), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "unknown environment 'reverse_word'" in proc.stderr
    assert "cannot import 'reverse_word_env.envs'" in proc.stderr
