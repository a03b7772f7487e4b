"""The README's claims that a unit test can check stay true.

- Its sample error message is what `zrl validate` prints, verbatim, for the mistake the README describes
  (a copy of recipes/tiny-cpu.yaml saved as recipes/x.yaml with `group_size` misspelt), with exit status 2.
- Its layout lists the test directories that exist, and every top-level directory it names exists.
"""

import re
from pathlib import Path

from zrl.cli import main

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_the_sample_error_message_is_the_one_validate_prints(tmp_path, monkeypatch, capsys):
    [line] = re.findall(r"`(zrl: error: recipes/x\.yaml: [^`]+)`", README)
    recipe = (ROOT / "recipes" / "tiny-cpu.yaml").read_text()
    assert recipe.count("group_size:") == 1
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "x.yaml").write_text(recipe.replace("group_size:", "group_sise:"))
    monkeypatch.chdir(tmp_path)
    assert main(["validate", "recipes/x.yaml"]) == 2
    assert capsys.readouterr().err.strip() == line


def layout() -> dict[str, str]:
    """The README's layout block: top-level directory -> its description (continuation lines joined)."""
    block = re.search(r"## Layout\n\n```\n(.*?)```", README, re.S).group(1)
    entries, name = {}, None
    for text in block.splitlines():
        if not text.startswith(" "):
            name, text = text.split(maxsplit=1)
            entries[name] = ""
        entries[name] += " " + text.strip()
    return entries


def test_the_layout_names_directories_that_exist():
    entries = layout()
    assert {"zrl/", "tests/", "examples/", "docs/"} <= set(entries)
    for name in entries:
        assert (ROOT / name).is_dir(), name
    listed = set(re.findall(r"(\w+)/", entries["tests/"].split(";")[0]))
    present = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert listed == present
    for doc in re.findall(r"(\w[\w-]*\.md)", entries["docs/"]):
        assert (ROOT / "docs" / doc).is_file(), doc


def test_the_health_block_shows_the_schema_defaults():
    import yaml

    from zrl.config.schema import Health

    block = re.search(r"```yaml\n(    evaluation: .*?    health: .*?)```", README, re.S).group(1)
    shown = yaml.safe_load(block.replace("\n    ", "\n").strip())["health"]
    defaults = Health().model_dump()
    assert shown == {k: defaults[k] for k in shown}


def test_every_zrl_command_in_the_readme_parses():
    """Commands in blocks the README-commands e2e test does not run (```sh: they need a long run first)
    still name real subcommands and flags."""
    import shlex

    from zrl.cli import build_parser

    blocks = "\n".join(re.findall(r"^```(?:bash|sh)\n(.*?)^```", README, re.S | re.M))
    lines = [line.split(" #")[0] for line in re.findall(r"^(?:\.venv/bin/)?zrl [^\n]*$", blocks, re.M)]
    assert len(lines) >= 10
    for line in lines:
        args = shlex.split(line.replace("$RUN", "runs/x").replace("$JOB_RUN", "runs/x"))[1:]
        if not args or args[0].startswith("-"):
            continue
        build_parser().parse_args(args)
