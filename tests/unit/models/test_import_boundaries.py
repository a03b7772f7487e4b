"""Import boundaries of the library, read from the source (ast, every import including those inside
functions): generic code reaches a model family only through the registry, lower layers never import
the pipeline above them, and the built-in environments import each other without a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
LIBRARY = ("zrl", "serving", "environments")

# A family's package, and the files outside it that belong to that family (its own vLLM model).
FAMILIES = {
    "zrl.moepp": ("zrl/moepp/", "serving/zaya_vllm.py", "serving/testing_assets.py"),
    "zrl.qwen3_moe": ("zrl/qwen3_moe/",),
    "zrl.glm4_moe": ("zrl/glm4_moe/",),
}
# Modules that must not import what lies above them: (importer path prefix, imported module prefix).
UPWARD = (
    ("zrl/models/", "zrl.moepp"),
    ("zrl/models/", "zrl.qwen3_moe"),
    ("zrl/models/", "zrl.glm4_moe"),
    ("zrl/modeling/", "zrl.pipeline"),
    ("zrl/modeling/", "zrl.trainer"),
    ("zrl/evaluate.py", "zrl.pipeline"),
    ("zrl/reward_model.py", "zrl.pipeline"),
    ("serving/", "zrl.pipeline"),
)


def library_files() -> list[Path]:
    """Every library module; test modules and conftest files living beside the code are tests."""
    return sorted(p for top in LIBRARY for p in (ROOT / top).rglob("*.py")
                  if not p.name.startswith("test_") and p.name != "conftest.py")


def imported_modules(path: Path) -> set[str]:
    """The absolute module names `path` imports (`from a import b` counts as a and a.b)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_only_a_family_imports_its_package():
    offences = []
    for path in library_files():
        rel = relative(path)
        for package, owners in FAMILIES.items():
            if rel.startswith(owners) or rel == "zrl/models/registry.py":
                continue
            offences += [f"{rel} imports {name}" for name in sorted(imported_modules(path)) if within(name, package)]
    assert not offences, "generic code must reach a family through zrl.models:\n" + "\n".join(offences)


def test_no_upward_imports():
    offences = []
    for path in library_files():
        rel = relative(path)
        imports = imported_modules(path)
        offences += [f"{rel} imports {name}" for prefix, upper in UPWARD if rel.startswith(prefix)
                     for name in sorted(imports) if within(name, upper)]
    assert not offences, "imports that climb back up:\n" + "\n".join(offences)


def test_environments_import_no_cycle():
    modules = {f"environments.{p.stem}": p for p in (ROOT / "environments").glob("*.py")}
    graph = {name: {m for m in imported_modules(path) if m in modules and m != name} for name, path in modules.items()}
    cycles = []

    def visit(name: str, stack: list[str]) -> None:
        for target in sorted(graph[name]):
            if target in stack:
                cycles.append(" -> ".join(stack[stack.index(target):] + [target]))
            elif target not in done:
                visit(target, stack + [target])
        done.add(name)

    done: set[str] = set()
    for name in sorted(graph):
        if name not in done:
            visit(name, [name])
    assert not cycles, "import cycles between environments modules:\n" + "\n".join(cycles)
