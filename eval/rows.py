"""The experiment runners' row store: one JSON file per finished row under `RESULTS/rows/`, keyed by settings.

A row is stored with the `key` it was measured under (a hash of everything it depends on: inputs, settings,
the code that built and measured it). A later run asks for the row by name and key and gets it back only
if the key matches and the row did not fail, so an interrupted run resumes where it stopped, and a changed
setting or code re-measures exactly the rows it touches. Used by `hf-attn study` and the experiments
(`benchmarks/experiments/runner.py`); the results tables are generated from such rows
(`benchmarks/experiments/results.py`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from hf_attn.tooling.files import write_json


def row_key(*parts) -> str:
    """A short hash of JSON-able parts (dict keys sorted; other objects by str())."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


class RowStore:
    """Finished rows of one results directory, in `directory` (created if missing)."""

    def __init__(self, directory: str | Path, *, fresh: bool = False):
        self.directory, self.fresh = Path(directory), fresh
        self.directory.mkdir(parents=True, exist_ok=True)

    def get(self, name: str, key: str) -> dict | None:
        """The stored row `name` if it was measured under `key` and did not fail (never with `fresh`)."""
        path = self.directory / f"{name}.json"
        if self.fresh or not path.exists():
            return None
        row = json.loads(path.read_text())
        return row if row.get("key") == key and row.get("name") == name and "error" not in row else None

    def put(self, name: str, key: str, row: dict) -> dict:
        """Store `row` as `name` under `key` (atomically: temporary file then rename); return it with both."""
        row = {"key": key, "name": name, **row}
        write_json(self.directory / f"{name}.json", row)
        return row
