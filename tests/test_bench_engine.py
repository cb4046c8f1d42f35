"""tools/bench_engine.py runs end to end on a tiny workload and reports a consistent
structure. No timing assertions: the figures depend on the machine."""

import json
import statistics
import sys
from pathlib import Path

import pytest
import torch

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


def test_useful_tokens_stop_at_the_first_stop_token():
    generated = torch.tensor([[7, 3, 9, 9],   # stops at its 2nd token, then padding
                              [7, 7, 7, 7],   # no stop token: the whole row
                              [3, 0, 3, 0],   # the first stop token counts, not a later one
                              [9, 7, 5, 3]])  # any of the stop ids
    assert bench_engine.useful_tokens(generated, [3, 5]) == 2 + 4 + 1 + 3
    assert bench_engine.useful_tokens(generated, []) == 16


def test_rl_workload_counts_useful_tokens(capsys):
    # Many stop ids, so that some of the 8 samples stop well before the 16-token cap.
    report = bench_engine.main(["--prompts", "2", "--n", "4", "--batch-size", "2", "--hidden", "64", "--layers", "1",
                                "--image-patches", "4", "--stop-tokens", "64", "--output-len", "16"])
    samples, cap = 2 * 4, 16
    assert report["stop_token_ids"] == [4 * i for i in range(64)]
    r, t = report["rollplex"], report["transformers"]
    # Each sample's first token comes from the prefill, each later one from a decode step.
    assert r["output_tokens"] == r["computed_tokens"] == report["engine_stats"]["decode_tokens"] + samples
    assert samples <= r["output_tokens"] < samples * cap
    # generate keeps finished rows in its one batch until the longest ends: rows x the longest.
    assert t["computed_tokens"] % samples == 0 and t["computed_tokens"] // samples <= cap
    assert samples <= t["output_tokens"] < t["computed_tokens"]
    assert report["ratio"] == pytest.approx(r["tokens_per_s"] / t["tokens_per_s"])
    assert "mean len" in capsys.readouterr().out


def test_host_overhead_fits_step_time_against_depth(capsys):
    report = bench_engine.main(["--prompts", "2", "--n", "2", "--batch-size", "2", "--hidden", "64",
                                "--image-patches", "4", "--output-len", "4", "--repeats", "2", "--host-overhead",
                                "--host-overhead-layers", "1", "3"])
    h = report["host_overhead"]
    assert [m["layers"] for m in h["models"]] == h["layers"] == [1, 3]
    # 3 decode steps per generate (the prefill samples the first token); the first one's interval holds the
    # second's model run too (run-ahead), and the last has no callback after it: one is timed.
    assert all(s["decode_steps"] == 3 and s["timed_steps"] == 1 and s["mean_decode_batch"] == 4 for s in h["steps"])
    (s1, s3) = [s["decode_step_ms"] for s in h["steps"]]
    # Two points: the line passes through both.
    assert h["slope_ms_per_layer"] == pytest.approx((s3 - s1) / 2)
    assert h["intercept_ms"] == pytest.approx(s1 - h["slope_ms_per_layer"])
    # On CPU the layers are timed within the same steps: each statistic is a per-step minimum,
    # so the parts need not add up exactly, but neither exceeds the whole.
    for s in h["steps"]:
        assert 0 < s["layers_ms"] < s["decode_step_ms"] and 0 < s["outside_layers_ms"] < s["decode_step_ms"]
        # What is outside the layers: the rest of the model, the sampler and the engine's host work.
        assert all(0 < s[k] < s["outside_layers_ms"] for k in ("model_outside_layers_ms", "sampler_ms", "host_ms"))
        assert len(s["all_step_ms"]) == 2 and min(s["all_step_ms"]) >= s["decode_step_ms"]
    assert h["outside_layers_ms"] == pytest.approx(statistics.median(s["outside_layers_ms"] for s in h["steps"]))
    printed = capsys.readouterr().out
    assert "rollplex" not in report and "depth-independent" in printed and "outside the decoder layers" in printed
    assert "the engine's host work" in printed


def test_step_time_is_each_steps_minimum_over_the_repeats():
    # Load on the machine slowed step 1 of the first run and step 0 of the second: neither counts.
    runs = [[0.001, 0.009, 0.003], [0.008, 0.002, 0.003]]
    assert bench_engine.per_step_minimum_ms(runs) == pytest.approx((1 + 2 + 3) / 3)


def test_shared_prefix_compares_groups_with_distinct_prompts(capsys):
    report = bench_engine.main(["--shared-prefix", "--prompts", "2", "--n", "3", "--batch-size", "2", "--hidden", "64",
                                "--layers", "1", "--images", "0", "--prompt-len", "20", "--output-len", "4"])
    s = report["shared_prefix"]
    steps = list(s["steps"].values())
    assert list(s["steps"]) == list(bench_engine.SHARED_PREFIX_CASES) and s["prompt_tokens"] == 20
    # Every case decodes its 6 sequences at once: 2 groups of 3, or 6 distinct prompts.
    assert all(step["mean_decode_batch"] == 6 and step["decode_steps"] == 3 for step in steps)
    assert s["shared_over_distinct"] == pytest.approx(steps[0]["decode_step_ms"] / steps[2]["decode_step_ms"])
    assert s["plain_over_distinct"] == pytest.approx(steps[1]["decode_step_ms"] / steps[2]["decode_step_ms"])
    assert "groups / distinct prompts" in capsys.readouterr().out
