"""Decode graphs are recaptured whenever what they read by address changes: the KV
pool's geometry (base address, shape, strides) or a weight's address.

On CPU the runner's stand-in (`_EagerGraph`) replays what was captured, as a CUDA
graph does: a graph kept across a pool of another block count at the same address
reads the wrong slots, as it would on a GPU. On CUDA the same tests run real graphs.
"""

import pytest
import torch

from rollplex.engine import Engine, EngineConfig, Request, SamplingParams
from rollplex.engine.kv_cache import KVCache
from rollplex.models import Prompt, build_model
from test_model import tiny_args

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]
PARAMS = SamplingParams(temperature=1.0, max_tokens=6, seed=5, ignore_eos=True)


def requests(n: int) -> list[Request]:
    return [Request(Prompt(torch.tensor([1, 5, 9, 13, 2, 7])), n=n), Request(Prompt(torch.tensor([3, 4, 8])), n=n)]


def graphed_and_eager(device: str) -> tuple[Engine, Engine]:
    model = build_model(tiny_args(), device=device, seed=3, init_std=None).eval()
    graphed = Engine(model, EngineConfig(block_size=4, num_blocks=256, max_num_seqs=8, max_model_len=64))
    graphed.runner.use_cuda_graphs = True  # on CPU: the stand-in
    return graphed, Engine(model, EngineConfig(block_size=4, num_blocks=256, max_model_len=64, enforce_eager=True))


def carve_pools_at_one_address(cache: KVCache, monkeypatch) -> None:
    """Every new pool of `cache` starts where its first one does, as when CUDA's
    caching allocator hands a freed block back out for a pool of another size."""
    arena = cache.data.view(-1)
    allocate = KVCache.allocate

    def allocate_in_arena(self: KVCache, num_blocks: int | None = None) -> None:
        before = self.data
        allocate(self, num_blocks)
        if self is cache and self.data is not before:
            self.data = arena[:self.data.numel()].view(self.data.shape).zero_()

    monkeypatch.setattr(KVCache, "allocate", allocate_in_arena)


def assert_same_samples(got, want) -> None:
    assert [[s.token_ids for s in o.samples] for o in got] == [[s.token_ids for s in o.samples] for o in want]
    for g, w in zip(got, want):
        for a, b in zip(g.samples, w.samples):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_a_pool_of_another_size_at_the_same_address_gets_new_graphs(device, monkeypatch):
    graphed, eager = graphed_and_eager(device)
    carve_pools_at_one_address(graphed.cache, monkeypatch)
    # A smaller pool, then a larger one, then the same one again.
    pools, captures = [], []
    for n in (2, 1, 3, 3):
        assert_same_samples(graphed.generate(requests(n), PARAMS), eager.generate(requests(n), PARAMS))
        pools.append((graphed.cache.data.data_ptr(), graphed.cache.num_blocks))
        captures.append(graphed.stats["graph_captures"])  # what the RL loop logs per rollout
    assert len({address for address, _ in pools}) == 1
    assert len({blocks for _, blocks in pools}) == 3
    assert graphed.runner.captures == 3 and captures == [1, 1, 1, 0]  # the same pool again keeps its graphs
    assert graphed.runner.capture_seconds > 0


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
