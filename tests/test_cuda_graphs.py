"""Decode graphs are captured once per batch-size bucket, at its first use, and
recaptured whenever what they read by address changes: the KV pool's geometry
(base address, shape, strides) or a weight's address.

On CPU the runner's stand-in (`_EagerGraph`) replays what was captured, as a CUDA
graph does: a graph whose pool, weights or rotary table moved is an error, as on
a GPU it would read freed memory. On CUDA the same tests run real graphs.
"""

import contextlib
import json
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rollplex.engine import Engine, EngineConfig, Request, SamplingParams
from rollplex.config import load_config
from rollplex.engine import runner as runner_module
from rollplex.engine.runner import ModelRunner
from rollplex.rl.loop import RLTrainer
from rollplex.models import Prompt, build_model
from test_model import tiny_args
from test_rl_loop import FAST as RL_FAST

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]
PARAMS = SamplingParams(temperature=1.0, max_tokens=6, seed=5, ignore_eos=True)


def requests(n: int) -> list[Request]:
    return [Request(Prompt(torch.tensor([1, 5, 9, 13, 2, 7])), n=n), Request(Prompt(torch.tensor([3, 4, 8])), n=n)]


def graphed_and_eager(device: str) -> tuple[Engine, Engine]:
    model = build_model(tiny_args(), device=device, seed=3, init_std=None).eval()
    graphed = Engine(model, EngineConfig(block_size=4, num_blocks=256, max_num_seqs=8, max_model_len=64))
    graphed.runner.use_cuda_graphs = True  # on CPU: the stand-in
    return graphed, Engine(model, EngineConfig(block_size=4, num_blocks=256, max_model_len=64, enforce_eager=True))


def assert_same_samples(got, want) -> None:
    assert [[s.token_ids for s in o.samples] for o in got] == [[s.token_ids for s in o.samples] for o in want]
    for g, w in zip(got, want):
        for a, b in zip(g.samples, w.samples):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_graphs_are_captured_once_per_bucket_across_generations(device):
    """Generations of other batch sizes run on the same pool and graphs: each bucket is
    captured at its first use, and only a pool allocated elsewhere needs new graphs."""
    graphed, eager = graphed_and_eager(device)
    captures = []
    for n in (2, 1, 3, 3):
        assert_same_samples(graphed.generate(requests(n), PARAMS), eager.generate(requests(n), PARAMS))
        captures.append(graphed.stats["graph_captures"])  # what the RL loop logs per rollout
    assert captures == [1, 1, 1, 0]  # buckets 4 (4 rows), 2 (2 rows), 8 (6 rows), then none
    assert sorted(graphed.runner.graphs) == [2, 4, 8] and graphed.runner.capture_seconds > 0
    old_pool = graphed.cache.data  # kept alive, so the next pool lands elsewhere
    graphed.release_kv()
    assert_same_samples(graphed.generate(requests(1), PARAMS), eager.generate(requests(1), PARAMS))
    assert graphed.cache.data.data_ptr() != old_pool.data_ptr() and graphed.stats["graph_captures"] == 1


@pytest.mark.parametrize("device", DEVICES)
def test_moved_weights_get_new_graphs(device):
    graphed, eager = graphed_and_eager(device)
    graphed.generate(requests(2), PARAMS)
    head = graphed.model.lm_head.weight
    head.data = head.data.clone()  # same values at a new address, as after an FSDP unshard
    assert_same_samples(graphed.generate(requests(2), PARAMS), eager.generate(requests(2), PARAMS))
    assert graphed.runner.captures == 2


def test_the_stand_in_refuses_a_graph_whose_pool_weights_or_rotary_table_moved():
    graphed, _ = graphed_and_eager("cpu")
    graphed.generate([Request(Prompt(torch.tensor([1, 2, 3])))], SamplingParams(temperature=0.0, max_tokens=2))
    graph = graphed.runner.graphs[1]
    graph.replay()
    old_pool = graphed.cache.data  # kept alive, so the next pool lands elsewhere
    graphed.release_kv()
    graphed.cache.allocate()
    with pytest.raises(RuntimeError, match="stale CUDA graph: captured on a KV pool"):
        graph.replay()
    graphed.cache.data = old_pool
    graph.replay()
    norm = graphed.model.language_model.norm.weight
    captured_norm = norm.data
    norm.data = norm.data.clone()
    with pytest.raises(RuntimeError, match="stale CUDA graph: the weights moved"):
        graph.replay()
    norm.data = captured_norm
    graph.replay()
    graphed.runner.rotary_table = graphed.runner.rotary_table.clone()  # as when a prompt needs a longer one
    with pytest.raises(RuntimeError, match="stale CUDA graph: the rotary table moved"):
        graph.replay()


def fail_captures_of(monkeypatch, bucket: int, error: Exception) -> list[int]:
    """Make every capture of `bucket`'s graph raise `error` from inside the capture: on CUDA
    from the decode run while the stream is capturing (the warm-up before it runs), on CPU
    from the stand-in's capture. Returns the list the attempts are appended to."""
    attempts = []
    decode = ModelRunner._decode_eager

    def decode_failing_in_capture(self, ids, *args, **kwargs):
        if ids.shape[0] == bucket and ids.is_cuda and torch.cuda.is_current_stream_capturing():
            attempts.append(bucket)
            raise error
        return decode(self, ids, *args, **kwargs)

    class FailingStandIn(runner_module._EagerGraph):
        def __init__(self, runner, inputs, groups, routing=None):
            if inputs[0].shape[0] == bucket:
                attempts.append(bucket)
                raise error
            super().__init__(runner, inputs, groups, routing)

    monkeypatch.setattr(ModelRunner, "_decode_eager", decode_failing_in_capture)
    monkeypatch.setattr(runner_module, "_EagerGraph", FailingStandIn)
    return attempts


@pytest.mark.parametrize("device", DEVICES)
def test_a_capture_out_of_memory_leaves_its_bucket_eager(device, monkeypatch):
    """A bucket first used mid-rollout may not find the memory to capture its graph. The run
    goes on: a warning names the bucket, the step's batch size and the free memory, and the
    bucket decodes eagerly, the same tokens, without capturing again; other buckets capture."""
    graphed, eager = graphed_and_eager(device)
    attempts = fail_captures_of(monkeypatch, 4, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    free = "GiB of [0-9.]+ GiB was free" if device == "cuda" else "not measured on CPU"
    with pytest.warns(UserWarning, match=rf"bucket 4 \(first used by a step of 4 sequences\) ran out of memory while "
                                         rf"capturing \(CUDA out of memory.*\); .*{free}.*Bucket 4 now decodes eagerly"):
        got = graphed.generate(requests(2), PARAMS)  # 4 rows: bucket 4
    assert_same_samples(got, eager.generate(requests(2), PARAMS))
    assert attempts == [4] and graphed.runner.eager_buckets == {4} and 4 not in graphed.runner.graphs
    assert graphed.stats["graph_capture_failures"] == 1 and graphed.stats["graph_captures"] == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second try, no second warning
        assert_same_samples(graphed.generate(requests(2), PARAMS), eager.generate(requests(2), PARAMS))
        assert_same_samples(graphed.generate(requests(1), PARAMS), eager.generate(requests(1), PARAMS))
    assert attempts == [4] and graphed.stats["graph_capture_failures"] == 0
    assert sorted(graphed.runner.graphs) == [2] and graphed.stats["graph_captures"] == 1  # 2 rows: bucket 2


@pytest.mark.parametrize("device", DEVICES)
def test_a_capture_error_not_for_memory_propagates(device, monkeypatch):
    graphed, _ = graphed_and_eager(device)
    error = RuntimeError("not a memory error")
    fail_captures_of(monkeypatch, 4, error)
    with pytest.raises(RuntimeError, match="not a memory error") as raised:
        graphed.generate(requests(2), PARAMS)
    assert raised.value is error and not graphed.runner.eager_buckets and graphed.runner.capture_failures == 0


def test_an_interrupted_capture_is_ended_and_its_error_kept():
    """After a failed capture, ending it fails too (the capture was invalidated): the first
    error is the one raised, the second a note on it."""
    class InvalidatedCapture:
        def capture_end(self):
            raise RuntimeError("operation failed due to a previous error during capture")

    error = torch.OutOfMemoryError("CUDA out of memory")
    runner_module._end_interrupted_capture(InvalidatedCapture(), error)
    assert error.__notes__ == ["ending the interrupted CUDA graph capture failed too: RuntimeError: operation failed "
                               "due to a previous error during capture"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_decode_runs_on_a_stream_of_the_highest_priority():
    graphed, eager = graphed_and_eager("cuda")
    assert graphed.decode_stream.priority == min(torch.cuda.Stream.priority_range()) < 0
    streams = []
    decode = graphed.runner.decode

    def decode_recording_its_stream(seqs, slots):
        streams.append(torch.cuda.current_stream())
        return decode(seqs, slots)

    graphed.runner.decode = decode_recording_its_stream
    assert_same_samples(graphed.generate(requests(2), PARAMS), eager.generate(requests(2), PARAMS))
    assert streams and all(s == graphed.decode_stream for s in streams)
    assert torch.cuda.current_stream() != graphed.decode_stream  # the caller's stream is back


def test_every_device_operation_of_a_step_is_on_the_decode_stream(monkeypatch):
    """A step's writes to the decode batch (rows joining and leaving, new blocks), its
    inputs, the model and the sampler go on the decode stream: on the caller's stream
    they would queue behind the RL loop's prompt work. Only a prefill's forward runs on
    the caller's stream, and `between_steps` after the step. CPU has no streams, so the
    test records, for every torch operation of a generation, which of the runner's
    stream contexts it ran in."""
    graphed, eager = graphed_and_eager("cpu")
    where = ["caller"]

    def marking(name: str, context):
        @contextlib.contextmanager
        def entered(self):
            where.append(name)
            try:
                with context(self):
                    yield
            finally:
                where.pop()
        return entered

    monkeypatch.setattr(ModelRunner, "on_decode_stream", marking("decode", ModelRunner.on_decode_stream))
    monkeypatch.setattr(ModelRunner, "on_caller_stream", marking("prefill", ModelRunner.on_caller_stream))
    seen: list[tuple[str, str]] = []

    class Recording(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "decode" in where or seen:  # from the first step on
                seen.append((str(func), where[-1]))
            return func(*args, **(kwargs or {}))

    def between_steps(running: int) -> None:
        where.append("between_steps")
        torch.ones(2).add_(1)  # the caller's work, as the prompt-work slices
        where.pop()

    # Samples that stop at different lengths leave the batch at different steps; 4-token blocks fill up.
    mixed = [Request(Prompt(torch.tensor([1, 5, 9, 13, 2, 7])), n=3, max_tokens=2),
             Request(Prompt(torch.tensor([3, 4, 8])), n=2, max_tokens=9)]
    with Recording():
        got = graphed.generate(mixed, PARAMS, between_steps=between_steps)
    assert_same_samples(got, eager.generate(mixed, PARAMS))
    places = {place for _, place in seen}
    assert places == {"decode", "prefill", "between_steps"}, [op for op, place in seen if place == "caller"][:5]
    assert any("index_put" in op for op, place in seen if place == "decode")  # rows leaving, blocks added


def test_the_rl_loop_captures_each_decode_graph_once(tmp_path):
    """RL steps of other prompt lengths and response limits run on one KV pool and on the
    trainer's own parameters (whole on one rank, fp32: the engine reads them in place, and
    the optimizer updates them there), so no graph is captured twice. Weights moved as
    FSDP's gather moves them get new graphs at the next rollout."""
    data = tmp_path / "prompts.jsonl"  # prompts of 1 to 12 words: every batch's lengths differ
    data.write_text("".join(json.dumps({"problem": " ".join(["two plus two"] * (1 + i % 4) + ["?"] * (i // 4)),
                                        "answer": "4"}) + "\n" for i in range(12)))
    trainer = RLTrainer(load_config(RL_FAST + ["--trainer.output_dir", str(tmp_path / "run"), "--data.train_files",
                                               str(data), "--rollout.min_tokens", "1", "--rollout.max_tokens", "8"]))
    trainer.engine.runner.use_cuda_graphs = True  # on CPU: the stand-in, which refuses a stale graph
    batches = trainer._batches(0)
    captures, failures, prompt_lengths, pools = [], [], set(), set()
    for step in range(1, 4):
        trainer.step = step
        examples = next(batches)
        prompt_lengths.add(tuple(sorted(len(e.prompt.input_ids) for e in examples)))
        metrics = trainer.train_step(examples)
        captures.append(metrics["perf/cuda_graph_captures"])
        failures.append(metrics["perf/cuda_graph_capture_failures"])
        pools.add(trainer.engine.cache.data.data_ptr())
    assert len(prompt_lengths) == 3 and len(pools) == 1 and failures == [0, 0, 0]
    # Each bucket once, at its first use (a later step's batch may shrink through one the first did not).
    assert captures[0] > 0 and sum(captures) == len(trainer.engine.runner.graphs)
    norm = trainer.weights.engine_model.language_model.norm.weight
    norm.data = norm.data.clone()  # same values at a new address
    trainer.rollout(next(batches), step=4)
    assert trainer.engine.stats["graph_captures"] > 0
