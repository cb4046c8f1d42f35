"""Weight sharing between trainer and engine (gloo, 2 processes): the engine generates
what a plain copy of the trainer's current weights generates, before and after an
optimizer step, while reading the trainer's gathered tensors in place (shared),
slices of them (viewed) or its own buffers (rebuilt), as the report says. After a
rollout every FSDP unit frees (or keeps) its gathered parameters after forward as before."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from distributed import run_distributed
from rollplex.engine import Engine, EngineConfig, SamplingParams
from rollplex.models import build_model
from rollplex.ops.attention import VarlenAttention
from test_engine import mixed_requests
from test_model import tiny_args

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
CONFIG = EngineConfig(block_size=4, num_blocks=128)


def greedy(engine: Engine) -> list[list[list[int]]]:
    return [[s.token_ids for s in o.samples] for o in engine.generate(mixed_requests(n=2), PARAMS)]


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def nbytes(t: torch.Tensor) -> int:
    return local(t).numel() * t.element_size()


def sgd_step(model) -> None:
    """One plain SGD step on next-token loss, through FSDP's forward, backward and sharded update."""
    ids = torch.tensor([1, 5, 9, 13, 2, 7, 3, 4, 8, 6])
    attn = VarlenAttention([0, len(ids)], "cpu")
    logits = model.logits(model(ids, torch.arange(len(ids)).expand(3, -1), attn))
    F.cross_entropy(logits[:-1], ids[1:]).backward()
    torch.optim.SGD(model.parameters(), lr=2.0).step()
    model.zero_grad()


def plain_copy_tokens(rank: int, model) -> list | None:
    """Rank 0: greedy tokens of a single-process engine on a plain copy of the trainer's weights."""
    weights = {n: p.full_tensor() for n, p in model.named_parameters()}  # a collective: every rank gathers
    if rank != 0:
        return None
    plain = build_model(tiny_args(), seed=0, init_std=None)
    plain.load_state_dict(weights)
    return greedy(Engine(plain.eval(), CONFIG))


def dp_sharded(p: torch.Tensor) -> bool:
    """FSDP registers a parameter it holds sharded as a DTensor over dp_shard, and the
    gathered one in its place while unsharded (a plain tensor, or a DTensor over tp)."""
    return isinstance(p, DTensor) and "dp_shard" in p.device_mesh.mesh_dim_names


def storage_relations(model, engine_model, masters: dict[str, torch.Tensor]) -> dict[str, int]:
    """Bytes of the engine's local parameters by how they relate to the trainer's gathered tensor, or to its
    own (sharded) parameter where that is whole on the rank, which the engine reads in place."""
    trainer = dict(model.named_parameters())
    relations = {"same": 0, "view": 0, "own": 0}
    for name, p in engine_model.named_parameters():
        e, t = local(p), local(trainer[name])
        if (e.data_ptr() == t.data_ptr() and e.shape == t.shape) or e.data_ptr() == masters[name].data_ptr():
            relation = "same"
        elif e.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
            assert e.numel() < t.numel(), name
            relation = "view"
        else:
            relation = "own"
        relations[relation] += nbytes(p)
    return relations


def rollouts(rank: int, world: int, trainer_tp: int, engine_tp: int, out: str) -> None:
    """Two rollouts with an optimizer step between; rank 0 writes what each saw."""
    from rollplex.dist import ParallelDims, build_mesh
    from rollplex.rl.weights import SharedWeights
    from rollplex.train.parallelize import parallelize

    torch.set_num_threads(1)
    model = build_model(tiny_args(), seed=3, init_std=None)
    parallelize(model, build_mesh(ParallelDims.resolve(world, -1, trainer_tp), "cpu"))
    shared = SharedWeights(model, trainer_tp, engine_tp)
    masters = {name: local(p) for name, p in model.named_parameters()}  # the trainer's own, sharded
    engine = None
    result = {"engine_is_trainer": shared.engine_model is model, "rounds": [],
              "engine_has_fsdp_hooks": any(isinstance(m, FSDPModule) for m in shared.engine_model.modules())}
    for step in range(2):
        if step:
            sgd_step(model)
        model.eval()
        assert all(dp_sharded(p) for p in model.parameters())
        with shared.for_rollout() as engine_model:
            assert engine_model is shared.engine_model
            # Built in here: it reads the KV head count and dtype off the gathered parameters
            # (outside, FSDP's dp shard of k_proj would give half the heads).
            engine = engine or Engine(engine_model, CONFIG)
            # for_rollout gathered the trainer's parameters: FSDP put its unsharded tensors in place
            assert not any(dp_sharded(p) for p in model.parameters())
            tokens = greedy(engine)
            relations = storage_relations(model, engine_model, masters)
            engine_bytes = sum(nbytes(p) for p in engine_model.parameters())
        engine.release_kv()
        own = {m.untyped_storage().data_ptr() for m in masters.values()}  # the trainer's memory, not the engine's
        held = sum(local(p).untyped_storage().size() for p in engine_model.parameters()
                   if local(p).untyped_storage().data_ptr() not in own)
        result["rounds"].append({"tokens": tokens, "expected": plain_copy_tokens(rank, model),
                                 "relations": relations, "engine_bytes": engine_bytes,
                                 "held_after": held, "report": shared.report.as_metrics()})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)


def run(tmp_path, trainer_tp: int, engine_tp: int) -> dict:
    out = tmp_path / "result.json"
    run_distributed(rollouts, 2, trainer_tp, engine_tp, str(out))
    result = json.loads(out.read_text())
    first, second = result["rounds"]
    for r in result["rounds"]:
        assert r["tokens"] == r["expected"]
    assert first["tokens"] != second["tokens"]  # the step changed the policy, and the engine saw it
    return result


def test_aligned_engine_reads_the_gathered_parameters(tmp_path):
    """trainer tp=1 dp_shard=2, engine tp=1: the engine runs on a hook-free skeleton whose
    every parameter is the trainer's gathered tensor itself (so decode can be captured)."""
    result = run(tmp_path, trainer_tp=1, engine_tp=1)
    total = sum(nbytes(p) for p in build_model(tiny_args()).parameters())
    assert not result["engine_is_trainer"] and not result["engine_has_fsdp_hooks"]
    for r in result["rounds"]:
        assert r["relations"] == {"same": total, "view": 0, "own": 0}
        assert r["report"]["weights/bytes_shared"] == total
        assert r["report"]["weights/bytes_viewed"] == r["report"]["weights/bytes_rebuilt"] == 0


@pytest.mark.parametrize("trainer_tp,engine_tp,kind", [(1, 2, "view"), (2, 1, "own")])
def test_engine_tp_differs_from_trainer_tp(tmp_path, trainer_tp, engine_tp, kind):
    """Engine tp=2 on trainer tp=1 (dp_shard=2): TP-sharded weights are slices of the gathered
    ones. Engine tp=1 on trainer tp=2: they are rebuilt. Replicated ones (norms) are shared
    either way (at trainer tp=2, dp_shard is 1: the engine reads them in place). Outside
    rollout, the engine's parameters hold no memory of their own."""
    result = run(tmp_path, trainer_tp, engine_tp)
    assert not result["engine_is_trainer"] and not result["engine_has_fsdp_hooks"]
    for r in result["rounds"]:
        report, relations = r["report"], r["relations"]
        assert relations[kind] > 0 and relations["same"] > 0
        assert {"same": report["weights/bytes_shared"], "view": report["weights/bytes_viewed"],
                "own": report["weights/bytes_rebuilt"]} == relations
        assert sum(relations.values()) == r["engine_bytes"]
        assert r["held_after"] == 0


def test_forward_keeps_the_root_gathered_before_and_after_a_rollout():
    """A micro-batch's forward frees the decoder layers' and vision blocks' gathered
    parameters but keeps the root unit's (embedding, head, merger), which the head and
    the backward read next, so they are gathered once per micro-batch. A rollout gives
    every unit its setting back, and forward_packed (which enters the model through
    encode_vision and forward) must not reshard the root at its end either.
    One process: a group and mesh of one, as a single-GPU trainer has."""
    from rollplex.dist import ParallelDims, build_mesh, init_distributed
    from rollplex.models import Prompt, pack_sequences
    from rollplex.rl.weights import SharedWeights
    from rollplex.train.parallelize import parallelize

    init_distributed("cpu")
    mesh = build_mesh(ParallelDims.resolve(1, -1, 1), "cpu")
    model = parallelize(build_model(tiny_args(), seed=3, init_std=None), mesh)
    batch = pack_sequences(model.args, [Prompt(torch.tensor([1, 5, 9, 13, 2, 7]))])
    units = {"root": model, "layer": model.language_model.layers[0], "vision block": model.visual.blocks[0]}

    def sharded_after_forward() -> dict[str, bool]:
        """Which units hold only their shard after a micro-batch's forward (the head, a root
        parameter, is read next: had the root resharded, it would be gathered again)."""
        hidden = model.forward_packed(batch)
        sharded = {name: dp_sharded(next(unit.parameters())) for name, unit in units.items()}
        model.logits(hidden).sum().backward()
        return sharded

    before = sharded_after_forward()
    with SharedWeights(model).for_rollout():
        pass
    assert sharded_after_forward() == before == {"root": False, "layer": True, "vision block": True}
