"""Reading the JSON a run leaves behind (summaries, metrics, sweep indexes), as a killed writer leaves it.

A JSON-lines file written by appending can end in a torn line (or hold one where a resumed writer
appended after it): such lines are skipped. A whole JSON file that does not parse is named.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json_lines(path: str | Path) -> list[Any]:
    """The records of a JSON-lines file; blank and torn lines skipped."""
    records = []
    with open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
    return records


def read_json_file(path: str | Path) -> Any:
    """A JSON file's content; ValueError naming the file when it is torn or not JSON."""
    try:
        return json.loads(Path(path).read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not readable JSON ({err}); torn by an interrupted write?") from None
