"""What the CLI prints on stdout: a table of results, or one JSON document (zrl/cli.py; logs go to stderr)."""

import json
import math
import sys


def table(header: list[str], rows: list[list]) -> str:
    """Rows under a header, each column as wide as its longest cell; numbers right-aligned."""
    cells = [[cell(v) for v in row] for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    numeric = [bool(rows) and all(isinstance(row[i], (int, float)) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric)).rstrip()
                     for row in cells) + "\n"


def cell(value) -> str:
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.4g}"
    return "-" if value is None else str(value)


def finite(value):
    """`value` with NaN and infinities as None: JSON has no such numbers (json.dumps would write NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def print_json(value) -> None:
    sys.stdout.write(json.dumps(finite(value), allow_nan=False) + "\n")


def flat(value: dict, prefix: str = "") -> list[list]:
    """[key, value] rows of a nested mapping, nested keys joined by dots."""
    rows = []
    for key, item in value.items():
        if isinstance(item, dict):
            rows += flat(item, f"{prefix}{key}.")
        else:
            rows.append([f"{prefix}{key}", item])
    return rows
