"""A data file's rows: JSONL (or a .json array), parsed up front so that a
malformed line fails at once with its file and line, or parquet (the optional
`pyarrow`), kept columnar until a row is asked for. rollplex.data.datasets turns rows into examples."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class _ParsedRows:
    """Rows parsed up front into a list; `where` names a row in its file."""

    rows: list[dict[str, Any]]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.rows[i]


class JsonlRows(_ParsedRows):
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

    def where(self, i: int) -> str:
        return f"line {self.lines[i]}"


class JsonArrayRows(_ParsedRows):
    """The rows of a .json file that holds one JSON array of objects."""

    def __init__(self, path: Path):
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: malformed JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
        if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
            raise ValueError(f"{path}: a .json data file holds one array of objects, [{{...}}, {{...}}], or an "
                             f"object per line (JSON Lines)")
        self.rows = rows

    def where(self, i: int) -> str:
        return f"item {i}"


def _json_rows(path: Path) -> JsonlRows | JsonArrayRows:
    """A .json file's rows: an array of objects, or (as Hugging Face datasets write .json files) JSON Lines."""
    with path.open(encoding="utf-8") as f:
        first = next((char for line in f for char in line if not char.isspace()), "")
    return JsonArrayRows(path) if first == "[" else JsonlRows(path)


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


# The data file types read_rows reads; a folder named as a data file stands for its files of these types.
DATA_FILE_EXTENSIONS = (".jsonl", ".json", ".parquet")


def read_rows(path: Path) -> JsonlRows | JsonArrayRows | ParquetRows:
    """The rows of a .jsonl, .json or .parquet data file (an error naming the file when it has none or is of
    another type)."""
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows: JsonlRows | JsonArrayRows | ParquetRows = JsonlRows(path)
    elif suffix == ".json":
        rows = _json_rows(path)
    elif suffix == ".parquet":
        rows = ParquetRows(path)
    else:
        raise ValueError(f"{path}: unsupported dataset file type {suffix!r} (use {', '.join(DATA_FILE_EXTENSIONS)})")
    if len(rows) == 0:
        raise ValueError(f"{path}: the file holds no rows")
    return rows
