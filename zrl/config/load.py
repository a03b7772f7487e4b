"""Loading recipes: YAML file → overrides (`--set a.b=c`) → validated `Recipe`, with one-line errors.

Every failure a user can cause (missing or unreadable file, text that is not UTF-8, bad YAML, a key
written twice, a malformed override, unknown field, wrong type, out-of-range value, cross-field rule)
becomes a `RecipeError` whose lines each name the file or field path and the reason, so the CLI can
print them without a traceback.

YAML is read with `RecipeLoader`: PyYAML's safe loader that rejects a key repeated in one mapping (plain
PyYAML keeps the last one silently) and reads `1e-5` as a number, as YAML 1.2 does (YAML 1.1 needs a dot:
`1.0e-5`), so the schema's strict number types accept both spellings.
"""

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from zrl.config.schema import Recipe

# Discriminator tags pydantic inserts into error locations; they are not part of the user's path.
_UNION_TAGS = {"rl", "sft", "dppo_binary_tv", "dppo_binary_kl", "ppo_clip"}


class RecipeError(ValueError):
    """A recipe that cannot be used; `lines` holds one human-readable problem per entry."""

    def __init__(self, source: str, lines: list[str]):
        self.source = source
        self.lines = lines
        super().__init__("\n".join(f"{source}: {line}" for line in lines))


class RecipeLoader(yaml.SafeLoader):
    """Safe YAML loading that refuses duplicate keys and reads YAML 1.2 exponent floats (`1e-5`)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` may repeat keys it merges
                continue
            key = self.construct_object(key_node, deep=False)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: SafeConstructor reports it with its position
                continue
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {first})", key_node.start_mark)
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def yaml_value(text: str) -> Any:
    """Parse YAML text the way recipes are parsed (RecipeLoader)."""
    return yaml.load(text, Loader=RecipeLoader)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return f"{where}{problem}"


def format_location(loc: tuple) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in _UNION_TAGS:
            continue
        else:
            path += f".{part}" if path else str(part)
    return path or "<recipe>"


def _describe(error: dict) -> str:
    where = format_location(error["loc"])
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        return f"{where}: unknown field"
    if error["type"] == "missing":
        return f"{where}: required field is missing"
    if error["type"] in {"value_error", "assertion_error"}:
        return f"{where}: {message}"
    return f"{where}: {message} (got {error.get('input')!r})"


def apply_override(data: dict, assignment: str) -> None:
    """Apply one `path.to.field=value` override in place; the value is parsed as YAML.

    List items are addressed by index (`stages.0.steps=3`) or, for stages, by name (`stages.warmup.steps=3`).
    """
    if "=" not in assignment:
        raise RecipeError("--set", [f"{assignment!r}: expected path.to.field=value"])
    path, raw = assignment.split("=", 1)
    keys = path.strip().split(".")
    if not all(keys):
        raise RecipeError("--set", [f"{assignment!r}: the field path {path.strip()!r} has an empty part"])
    try:
        value = yaml_value(raw)
    except yaml.YAMLError as exc:
        raise RecipeError("--set", [f"{path.strip()}: the value is not YAML: {_yaml_problem(exc)}"]) from None
    node: Any = data
    for depth, key in enumerate(keys):
        last = depth == len(keys) - 1
        where = ".".join(keys[: depth + 1])
        if isinstance(node, list):
            index = _list_index(node, key, where)
            if last:
                node[index] = value
            else:
                node = node[index]
        elif isinstance(node, dict):
            if last:
                node[key] = value
            else:
                node = node.setdefault(key, {})
        else:
            raise RecipeError("--set", [f"{where}: cannot descend into a {type(node).__name__}"])


def _list_index(items: list, key: str, where: str) -> int:
    if key.lstrip("-").isdigit():
        index = int(key)
        if not -len(items) <= index < len(items):
            raise RecipeError("--set", [f"{where}: index out of range (list has {len(items)} items)"])
        return index
    names = [item.get("name") if isinstance(item, dict) else None for item in items]
    if key in names:
        return names.index(key)
    raise RecipeError("--set", [f"{where}: no item named {key!r} (names: {[n for n in names if n]})"])


def parse_recipe(data: Any, source: str = "<recipe>") -> Recipe:
    if not isinstance(data, dict):
        raise RecipeError(source, [f"<recipe>: expected a mapping at the top level, got {type(data).__name__}"])
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(source, [_describe(e) for e in exc.errors()]) from None


def read_recipe_data(path: str | Path) -> Any:
    path = Path(path)
    if path.is_dir():
        raise RecipeError(str(path), ["is a directory, not a recipe file"])
    if not path.is_file():
        raise RecipeError(str(path), ["file not found"])
    try:
        text = path.read_bytes().decode("utf-8-sig")  # a UTF-8 byte-order mark is allowed and dropped
    except OSError as exc:
        raise RecipeError(str(path), [f"cannot read: {exc.strerror}"]) from None
    except UnicodeDecodeError as exc:
        raise RecipeError(str(path), [f"not UTF-8 text: byte 0x{exc.object[exc.start]:02x} at offset {exc.start}"]) from None
    try:
        return yaml_value(text)
    except yaml.YAMLError as exc:
        raise RecipeError(str(path), [f"invalid YAML: {_yaml_problem(exc)}"]) from None


def load_recipe(path: str | Path, overrides: list[str] = ()) -> Recipe:
    data = read_recipe_data(path)
    if isinstance(data, dict):
        for assignment in overrides:
            apply_override(data, assignment)
    return parse_recipe(data, str(path))
