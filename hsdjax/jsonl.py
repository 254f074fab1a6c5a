"""JSON-lines input files (question sets, training prompts): objects with line-numbered errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hsdjax.errors import HsdjaxError


def read_objects(path: str | Path, what: str) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line; a bad line is named by its number."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise HsdjaxError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise HsdjaxError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
        if not isinstance(item, dict):
            raise HsdjaxError(f"{path}:{n}: expected a JSON object")
        out.append((n, item))
    return out
