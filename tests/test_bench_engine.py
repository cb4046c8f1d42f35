"""tools/bench_engine.py runs end to end on a tiny workload and reports a consistent
structure. No timing assertions: the figures depend on the machine."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import bench_engine  # noqa: E402


def test_report_structure(tmp_path, capsys):
    out = tmp_path / "bench.json"
    report = bench_engine.main(["--prompts", "2", "--output-len", "4", "--batch-size", "2", "--hidden", "64",
                                "--layers", "2", "--image-patches", "4", "--json", str(out)])
    r, t = report["rollplex"], report["transformers"]
    for side in (r, t):
        assert side["output_tokens"] == 2 * 4
        assert side["wall_s"] > 0 and side["tokens_per_s"] > 0
        assert side["tokens_per_s"] == pytest.approx(side["output_tokens"] / side["wall_s"])
    assert report["ratio"] == pytest.approx(r["tokens_per_s"] / t["tokens_per_s"])
    stats = report["engine_stats"]
    assert stats["decode_tokens"] == 2 * 3  # the first token of each sample comes from the prefill
    assert stats["preemptions"] == 0 and stats["steps"] > 0 and stats["prefill_tokens"] > 0
    assert "cuda_decode" not in report
    assert json.loads(out.read_text()) == report
    printed = capsys.readouterr().out
    assert "random" in printed and "ratio rollplex / transformers" in printed
