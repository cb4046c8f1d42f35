"""Reading back what wandb and SwanLab wrote in offline mode (tests only)."""

import json
import struct
import time
from pathlib import Path


def leveldb_records(path: Path) -> list[bytes]:
    """The records of a wandb or SwanLab run file: LevelDB's log format (32 KiB blocks of chunks, each
    behind a 7-byte header: crc32, length, type 1 whole / 2 first / 3 middle / 4 last) after a 7-byte file header."""
    raw, block, pos, records, pending = path.read_bytes(), 32768, 7, [], b""
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # too little room for a header: the block's tail is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        pending += raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(pending)
            pending = b""
    return records


def _wandb_records(run_file: Path, timeout_s: float = 30.0) -> list:
    """The run file's records once its exit record is in: wandb's service process writes the file, and may still
    be writing it when run.finish() returns (it is done by the time the process exits)."""
    from wandb.proto.wandb_internal_pb2 import Record

    deadline = time.monotonic() + timeout_s
    while True:
        records = []
        for data in leveldb_records(run_file):
            records.append(Record())
            records[-1].ParseFromString(data)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


def wandb_run(output_dir: Path) -> tuple[dict[int, dict], dict]:
    """({step: metrics}, config) of the one offline wandb run under `output_dir`/wandb."""
    (run_file,) = output_dir.glob("wandb/offline-run-*/run-*.wandb")
    history, config = {}, {}
    for record in _wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[record.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
        elif record.WhichOneof("record_type") == "run":
            config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
    return history, config


def swanlab_history(output_dir: Path) -> dict[int, dict]:
    """{step: metrics} of the one offline SwanLab run under `output_dir`/swanlog."""
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record

    (run_file,) = output_dir.glob("swanlog/run-*/run-*.swanlab")
    history: dict[int, dict] = {}
    for data in leveldb_records(run_file):
        record = Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "scalar":
            history.setdefault(record.scalar.step, {})[record.scalar.key] = record.scalar.value.number
    return history
