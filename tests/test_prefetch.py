"""The next batch is prepared in a background thread while the step runs."""

import threading
import time

import pytest

from rollplex.data.prefetch import Prefetcher


def counter(delay_s: float = 0.0):
    """A producer of 0, 1, 2, ... that records the thread of each call."""
    calls = []

    def produce() -> int:
        time.sleep(delay_s)
        calls.append(threading.current_thread().name)
        return len(calls) - 1

    return produce, calls


def test_items_come_in_order_one_call_ahead_in_another_thread():
    produce, calls = counter()
    with Prefetcher(produce) as upcoming:
        assert [upcoming.next() for _ in range(3)] == [0, 1, 2]
        assert upcoming.next(ahead=False) == 3
    assert len(calls) == 4  # nothing was prepared after the last item asked for
    assert all(name.startswith("rollplex-data") for name in calls)


def test_the_step_waits_only_for_what_is_not_prepared_yet():
    produce, _ = counter(delay_s=0.2)
    with Prefetcher(produce) as upcoming:
        upcoming.next()
        assert upcoming.wait_s >= 0.1  # nothing was ready: the first batch is prepared while the step waits
        time.sleep(0.6)  # the step's own work, longer than preparing a batch
        upcoming.next(ahead=False)
        assert upcoming.wait_s < 0.15


def test_an_error_preparing_a_batch_is_raised_by_the_call_that_asks_for_it():
    items = iter([[1], [2]])

    def produce() -> list[int]:
        item = next(items)
        if item == [2]:
            raise ValueError("row 7 of train.jsonl is unreadable")
        return item

    with Prefetcher(produce) as upcoming:
        assert upcoming.next() == [1]
        with pytest.raises(ValueError, match="row 7"):
            upcoming.next()


def test_a_run_reports_its_data_wait_and_the_rows_skipped_up_to_its_own_batch(tmp_path):
    """The third row the shuffle visits is unreadable: step 2's batch meets it, step 1's does not, though
    step 2's batch was prepared while step 1 ran."""
    import json

    import numpy as np

    from rollplex.config import load_config
    from rollplex.metrics import read_metrics
    from rollplex.rl.loop import RLTrainer

    rows = [{"problem": f"what colour is row {i} ?", "answer": "red"} for i in range(5)]
    visit = np.random.default_rng([0, 0]).permutation(5)  # epoch 0's order for data.seed 0 (PromptDataset._order)
    rows[visit[2]] = {"problem": "<image> what colour ?", "answer": "red", "images": ["missing.png"]}
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trainer = RLTrainer(load_config([
        "--data.train_files", str(train), "--data.batch_size", "2", "--rollout.n", "2", "--rollout.max_tokens", "2",
        "--trainer.total_steps", "2", "--trainer.save_every", "0", "--trainer.eval_every", "0",
        "--logging.no_console", "--trainer.output_dir", str(tmp_path / "run")]))
    trainer.fit()
    steps = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["data/skipped_total"] for r in steps] == [0, 1]
    assert all(0 <= r["timing_s/data"] <= r["timing_s/step"] for r in steps)
