"""The project's documentation stands on its own (docs/design.md, style rule 11).

No shipped file may cite material that does not ship with zrl: the notes and source documents that were
kept beside the repository while it was written. What a reader needs lives in docs/ and the package
READMEs; papers are cited by title, section and arXiv id (docs/algorithms.md, sources).
"""

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Generated or local-only directories (see .gitignore): not part of what ships.
SKIPPED_DIRS = {".git", ".venv", ".cache", "runs", "assets", "wandb", "__pycache__", ".pytest_cache", ".hypothesis"}
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".ini", ".json", ".sh"}

# The names are assembled from parts so that this file does not cite them itself.
_NOTE_FILES = [name + "." + "md" for name in ("ALGORITHMS", "DESIGN", "MODEL", "CPU_" + "STACK")]
_SHARED = "shar" + "ed"
NOT_SHIPPED = re.compile("|".join([
    *(re.escape(name) for name in _NOTE_FILES),
    r"\bCPU_" + "STACK",                                    # the CPU notes without their suffix
    r"\b" + "seed" + r"s/",                                 # the source documents' folder
    r"(?<![\w.-])" + _SHARED + "/",                         # the folder that held all of the above
    r"\b" + _SHARED + r" (?:CPU|MODEL|ALGORITHMS|DESIGN|seed)",  # "<that folder> X" prose citations
]))


def shipped_text_files():
    for directory, subdirs, files in os.walk(ROOT):
        subdirs[:] = [d for d in subdirs if d not in SKIPPED_DIRS and not d.endswith(".egg-info")]
        for name in files:
            path = Path(directory) / name
            if path.suffix in TEXT_SUFFIXES or path.parent.name == ".ci":
                yield path


def test_the_detector_finds_each_kind_of_citation():
    cited = ["see " + _NOTE_FILES[0] + " §3", "(" + "seed" + "s/003 §IV-B1)", "(" + _SHARED + " CPU_"
             + "STACK.md)", "../" + _SHARED + "/MODEL", "(" + _SHARED + " " + "MODEL" + ".md)"]
    for text in cited:
        assert NOT_SHIPPED.search(text), text
    for text in ["docs/algorithms.md §3", "docs/design.md", "a seed of 0", "shared memory", "zrl/moepp/README.md"]:
        assert not NOT_SHIPPED.search(text), text


def test_no_shipped_file_cites_material_that_does_not_ship():
    files = list(shipped_text_files())
    assert len(files) > 100 and ROOT / "docs" / "algorithms.md" in files  # the walk sees the project
    hits = []
    for path in files:
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError:
            continue
        hits += [f"{path.relative_to(ROOT)}:{i}: {line.strip()}" for i, line in enumerate(lines, 1)
                 if NOT_SHIPPED.search(line)]
    assert not hits, "cite docs/ or a public source instead:\n" + "\n".join(hits)
