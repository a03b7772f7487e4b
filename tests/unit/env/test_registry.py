"""Environment registry: explicit registration, entry-point discovery, module:Class references."""

import logging
import sys
import textwrap

import pytest

from zrl.env.registry import Registry, UnknownEnvironmentError, registry


class Dummy:
    """A dummy environment.

    More text."""

    reward_type = "continuous"


def test_register_get_and_duplicate():
    reg = Registry(group="zrl.test.none")
    reg.register("dummy", Dummy)
    info = reg.get("dummy")
    assert info.factory is Dummy and info.description == "A dummy environment." and info.reward_type == "continuous"
    with pytest.raises(ValueError, match="'dummy' is already registered"):
        reg.register("dummy", Dummy)


def test_unknown_name_lists_valid_names():
    reg = Registry(group="zrl.test.none")
    reg.register("b_env", Dummy)
    reg.register("a_env", Dummy)
    with pytest.raises(UnknownEnvironmentError, match="unknown environment 'c_env'; valid names: a_env, b_env"):
        reg.get("c_env")


def test_module_class_reference():
    info = registry.get("environments.arithmetic:Arithmetic")
    assert info.factory.__name__ == "Arithmetic" and info.source == "reference"
    with pytest.raises(UnknownEnvironmentError, match="cannot import 'no_such_module'"):
        registry.get("no_such_module:X")
    with pytest.raises(UnknownEnvironmentError, match="has no attribute 'Nope'"):
        registry.get("environments.arithmetic:Nope")


def test_builtins_come_from_the_entry_point_group():
    assert {"arithmetic", "reasoning_gym", "math"} <= set(registry.names())
    assert registry.get("arithmetic").source == "entry point zrl"


def test_entry_point_of_a_third_party_package(tmp_path, monkeypatch):
    """A package installed with a `zrl.environments` entry point is discovered without touching zrl."""
    (tmp_path / "thirdparty_env.py").write_text(textwrap.dedent('''
        class Palindromes:
            """Is the word a palindrome?"""
            reward_type = "binary"
    '''))
    dist = tmp_path / "thirdparty_env-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: thirdparty-env\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[zrl.test.plugins]\npalindromes = thirdparty_env:Palindromes\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = Registry(group="zrl.test.plugins")
    assert reg.names() == ["palindromes"]
    info = reg.get("palindromes")
    assert info.description == "Is the word a palindrome?" and info.source == "entry point thirdparty-env"
    sys.modules.pop("thirdparty_env", None)


def test_a_broken_entry_point_is_skipped_with_a_warning_and_the_others_stay(tmp_path, monkeypatch, caplog):
    """One broken third-party package (its module raises at import, or names a missing class) must not
    hide the environments of every other package."""
    (tmp_path / "good_env.py").write_text("class Good:\n    reward_type = 'binary'\n")
    (tmp_path / "broken_env.py").write_text("raise RuntimeError('half-installed')\n")
    dist = tmp_path / "mixed_envs-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mixed-envs\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[zrl.test.broken]\ngood = good_env:Good\nbroken = broken_env:Env\nmissing = good_env:Nope\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = Registry(group="zrl.test.broken")
    with caplog.at_level(logging.WARNING, logger="zrl"):
        assert reg.names() == ["good"]
    warnings = sorted(r.getMessage() for r in caplog.records)
    assert len(warnings) == 2
    assert warnings[0].startswith("skipping environment 'broken': environment 'broken' (entry point of mixed-envs) "
                                  "cannot be loaded: ")
    assert "raised RuntimeError: half-installed" in warnings[0]
    assert warnings[1].startswith("skipping environment 'missing': environment 'missing' (entry point of "
                                  "mixed-envs) cannot be loaded: ")
    assert "has no attribute 'Nope'" in warnings[1]
    with pytest.raises(UnknownEnvironmentError, match="unknown environment 'broken'; valid names: good"):
        reg.get("broken")
    sys.modules.pop("good_env", None)

    # Looked up by name, an entry point imports its own module only, and a broken one says why.
    reg = Registry(group="zrl.test.broken")
    assert reg.get("good").reward_type == "binary"
    assert "good_env" in sys.modules and "broken_env" not in sys.modules
    with pytest.raises(UnknownEnvironmentError, match="environment 'broken' .entry point of mixed-envs. cannot be "
                                                      "loaded: .*raised RuntimeError: half-installed"):
        reg.get("broken")
    sys.modules.pop("good_env", None)


def test_a_reference_whose_module_raises_at_import_is_an_unknown_environment(tmp_path, monkeypatch):
    (tmp_path / "raising_env.py").write_text("import json\njson.loads('{')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UnknownEnvironmentError, match="importing 'raising_env' raised JSONDecodeError"):
        registry.get("raising_env:Env")
