"""The engine on tensor-parallel weights: TP=2 on gloo gives TP=1's greedy tokens."""

import json

import torch

from distributed import run_distributed
from rollplex.engine import Engine, EngineConfig, SamplingParams
from rollplex.models import build_model
from test_engine import mixed_requests
from test_model import tiny_args

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def generate_tp(rank: int, world: int, out_file: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from rollplex.train.parallelize import apply_tp

    torch.set_num_threads(1)
    model = apply_tp(build_model(tiny_args(), seed=3, init_std=None).eval(), init_device_mesh("cpu", (world,)))
    engine = Engine(model, EngineConfig(block_size=4, num_blocks=128))
    assert engine.cache.kv_heads == 1  # 2 kv heads split over 2 ranks
    outputs = engine.generate(mixed_requests(n=2), PARAMS)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump([[s.token_ids for s in o.samples] for o in outputs], f)


def test_tp2_equals_tp1(tmp_path):
    single = Engine(build_model(tiny_args(), seed=3, init_std=None).eval(), EngineConfig(block_size=4, num_blocks=128))
    expected = [[s.token_ids for s in o.samples] for o in single.generate(mixed_requests(n=2), PARAMS)]
    out = tmp_path / "tp.json"
    run_distributed(generate_tp, 2, str(out))
    assert json.loads(out.read_text()) == expected
