"""A data file's rows: JSONL, parsed up front so that a malformed line fails at
once with its file and line, or parquet (the optional `pyarrow`), kept columnar
until a row is asked for. rollplex.data.datasets turns rows into examples."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class JsonlRows:
    """All rows of a JSONL file, parsed up front so a malformed line fails at load."""

    def __init__(self, path: Path):
        self.rows: list[dict[str, Any]] = []
        self.lines: list[int] = []
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}, line {lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{path}, line {lineno}: expected a JSON object, got {type(row).__name__}")
                self.rows.append(row)
                self.lines.append(lineno)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.rows[i]

    def where(self, i: int) -> str:
        return f"line {self.lines[i]}"


class ParquetRows:
    """Rows of a parquet file. The Arrow table stays columnar; a row becomes Python
    objects only when asked for, so image bytes are not all copied at load."""

    def __init__(self, path: Path):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError(
                f"reading the parquet file {path} needs pyarrow, an optional extra: pip install pyarrow"
            ) from None
        try:
            self.table = pq.read_table(path)
        except Exception as e:  # pyarrow raises several types for a broken file
            raise ValueError(f"{path}: cannot read parquet ({type(e).__name__}: {e})") from e

    def __len__(self) -> int:
        return self.table.num_rows

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.table.slice(i, 1).to_pylist()[0]

    def where(self, i: int) -> str:
        return f"row {i}"


def read_rows(path: Path) -> JsonlRows | ParquetRows:
    """The rows of a .jsonl or .parquet data file (an error naming the file when it has none or is of
    another type)."""
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows: JsonlRows | ParquetRows = JsonlRows(path)
    elif suffix == ".parquet":
        rows = ParquetRows(path)
    else:
        raise ValueError(f"{path}: unsupported dataset file type {suffix!r} (use .jsonl or .parquet)")
    if len(rows) == 0:
        raise ValueError(f"{path}: the file holds no rows")
    return rows
