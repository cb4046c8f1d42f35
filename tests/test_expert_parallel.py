"""Expert parallelism (rollplex.models.expert_parallel, parallel.ep): on gloo ranks, each
feeding tokens of its own, the split experts give what one process gives on every
rank's tokens at once: outputs, input gradients and every weight's gradient (fp32);
and the configuration and model checks."""

import json

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed
from rollplex.models.moe import MoEArgs, SparseMoE

# record_gradients wraps optimizer.step, which the LR scheduler notices and warns about.
pytestmark = pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")

HIDDEN, INTER, SHARED, EXPERTS, TOP_K = 16, 8, 12, 8, 2


def block(shared: bool) -> SparseMoE:
    torch.manual_seed(0)
    moe = SparseMoE(HIDDEN, MoEArgs(num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=INTER,
                                    shared_expert_intermediate_size=SHARED if shared else 0), layer=0)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, p.shape[-2] ** -0.5 if p.ndim == 3 else p.shape[-1] ** -0.5)
    return moe


def tokens_of(rank: int, world: int) -> list[torch.Tensor]:
    """Every rank's tokens (uneven counts; at 4 ranks, rank 2 has none) and the loss's projection."""
    g = torch.Generator().manual_seed(1)
    counts = [7, 4, 0, 5][:world] if world == 4 else [7, 4]
    return [torch.randn(n, HIDDEN, generator=g) for n in counts] + [torch.randn(HIDDEN, generator=g)]


def reference(world: int, shared: bool) -> dict[str, torch.Tensor]:
    """One process, every rank's tokens at once."""
    *xs, proj = tokens_of(0, world)
    moe = block(shared)
    x = torch.cat(xs).requires_grad_()
    out = moe(x)
    (out @ proj).pow(2).sum().backward()
    grads = {f"grad/{name}": p.grad for name, p in moe.named_parameters()}
    return {"out": out.detach(), "x_grad": x.grad, **grads}


def ep_block(rank: int, world: int, ep: int, shared: bool, out: str) -> None:
    """`world` ranks, experts split over groups of `ep` and FSDP-sharded over the rest (efsdp = world / ep),
    the block's other weights FSDP-sharded over every rank, as rollplex.train.parallelize composes them."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    from rollplex.dist import ParallelDims, build_ep_mesh, build_mesh, full_tensor
    from rollplex.models.expert_parallel import apply_ep
    from rollplex.train.parallelize import apply_experts_fsdp

    torch.set_num_threads(1)
    dims = ParallelDims.resolve(world, -1, 1, ep)
    mesh, ep_mesh = build_mesh(dims, "cpu"), build_ep_mesh(dims, "cpu")
    moe = block(shared)
    apply_ep(moe, ep_mesh)
    local = moe.experts.gate_up_proj.to_local()
    share = EXPERTS // ep
    assert local.shape[0] == share
    assert torch.equal(local, block(shared).experts.gate_up_proj.detach()[rank % ep * share:][:share])
    mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    apply_experts_fsdp(moe, ep_mesh, world, mp)
    fully_shard(moe, mesh=mesh["dp_shard"], mp_policy=mp)
    *xs, proj = tokens_of(rank, world)
    x = xs[rank].clone().requires_grad_()
    y = moe(x)
    # FSDP averages gradients over the dp ranks: each rank's loss times the dp size sums them.
    ((y @ proj).pow(2).sum() * world).backward()
    result = {"out": y.detach(), "x_grad": x.grad / world}
    for name, p in moe.named_parameters():
        assert isinstance(p, DTensor)
        result[f"grad/{name}"] = full_tensor(p.grad)
        result[f"param/{name}"] = full_tensor(p.detach())
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        torch.save(gathered, out)


# 4 ranks (ep 2 x efsdp 2) in the slow suite: the default suite's time budget.
@pytest.mark.parametrize("world,ep,shared", [(2, 2, True), pytest.param(4, 2, False, marks=pytest.mark.slow)])
def test_split_experts_equal_one_process(tmp_path, world, ep, shared):
    """2 ranks (ep 2, each holding half of the experts whole) and 4 ranks (ep 2, each half
    FSDP-sharded over 2 ranks, one rank without tokens): each rank's outputs and input
    gradients are its rows of one process's on the concatenated tokens, and every weight's
    gradient (experts, router, shared expert) is the whole batch's, in fp32."""
    out = tmp_path / "ranks.pt"
    run_distributed(ep_block, world, ep, shared, str(out))
    ranks = torch.load(out)
    ref = reference(world, shared)
    start = 0
    for r in ranks:
        n = r["out"].shape[0]
        torch.testing.assert_close(r["out"], ref["out"][start:start + n], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["x_grad"], ref["x_grad"][start:start + n], rtol=1e-5, atol=1e-6)
        start += n
    whole = block(shared)
    for name, p in whole.named_parameters():
        for r in ranks:
            torch.testing.assert_close(r[f"param/{name}"], p.detach())  # full_tensor gives the whole weight
            torch.testing.assert_close(r[f"grad/{name}"], ref[f"grad/{name}"], rtol=1e-5, atol=1e-5)


def test_permutation_regroups_by_local_expert():
    from rollplex.models.expert_parallel import _by_local_expert

    received = torch.tensor([[2, 0, 1], [1, 3, 0]])  # 2 source ranks, 3 local experts
    # arrived rows: s0e0 s0e0 s0e2 | s1e0 s1e1 s1e1 s1e1 -> e0: 0 1 3, e1: 4 5 6, e2: 2
    assert _by_local_expert(received, 7).tolist() == [0, 1, 3, 4, 5, 6, 2]


def test_ep_config_errors():
    from rollplex.config import Config, ConfigError
    from rollplex.config.sections import LoRAConfig, ParallelConfig, ScheduleConfig
    from rollplex.dist import ParallelDims

    with pytest.raises(ConfigError, match="parallel.ep must be >= 1"):
        ParallelConfig(ep=0)
    with pytest.raises(ConfigError, match="divisor of dp_shard"):
        ParallelConfig(dp_shard=3, ep=2)
    with pytest.raises(ConfigError, match="tp > 1"):
        ParallelConfig(tp=2, ep=2)
    ParallelConfig(dp_shard=4, ep=2)
    with pytest.raises(ConfigError, match="disagg"):
        Config(parallel=ParallelConfig(ep=2), schedule=ScheduleConfig(kind="disagg")).validate()
    with pytest.raises(ConfigError, match="lora"):
        Config(parallel=ParallelConfig(ep=2), lora=LoRAConfig(rank=4)).validate()
    Config(parallel=ParallelConfig(ep=2)).validate()
    # The world size is known when the mesh is built.
    with pytest.raises(ValueError, match="does not divide the data-parallel size"):
        ParallelDims.resolve(6, -1, 1, 4)
    with pytest.raises(ValueError, match="ep=2 with tp=2"):
        ParallelDims.resolve(4, -1, 2, 2)
    assert ParallelDims.resolve(4, -1, 1, 2) == ParallelDims(4, 4, 1, 2)


def test_ep_model_errors():
    """A model without MoE layers, and experts that ep does not divide, are refused when split."""
    from rollplex.models.expert_parallel import check_ep
    from rollplex.models.loader import build_model
    from rollplex.models.qwen2_5_vl import tiny_args

    with pytest.raises(ValueError, match="no MoE layers"):
        check_ep(build_model(tiny_args()), 2)
    assert check_ep(build_model(tiny_args()), 1) == []
    with pytest.raises(ValueError, match="does not divide the MoE layers' 8 experts"):
        check_ep(block(shared=False), 3)
    assert len(check_ep(block(shared=False), 4)) == 1


# --------------------------------------------------------------------------- a whole MoE model

def text_groups() -> list:
    """Four text-only groups (the MoE families' towers differ from the dense ones' test images)."""
    from rollplex.models.inputs import Prompt
    from test_shared_prefix import group

    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(1, 99, (n,), generator=g).tolist()  # noqa: E731
    return [group(Prompt(torch.tensor(rand(p))), [rand(r) for r in responses])
            for p, responses in ((5, (3, 5, 1)), (7, (4, 2)), (3, (2, 6, 3, 2)), (6, (5, 4)))]


def actor_config():
    from rollplex.train.actor import ActorConfig

    # grad_clip well under the gradient norm: the update depends on the norm over every expert
    return ActorConfig(lr=1e-3, kl_coef=0.1, entropy_coef=0.01, grad_clip=0.05, max_tokens_per_micro_batch=4096)


def policy_batch(model):
    from rollplex.train.actor import Actor, PolicyBatch
    from rollplex.train.loss import group_advantages

    gs = text_groups()
    counts = [len(g.samples) for g in gs]
    rewards = torch.linspace(0.0, 1.0, sum(counts)).flip(0)
    index = torch.tensor([g for g, n in enumerate(counts) for _ in range(n)])
    old = Actor(model, actor_config()).logprobs(model, gs)
    return PolicyBatch(gs, group_advantages(rewards, index).tolist(), old, ref_logprobs=[o - 0.1 for o in old])


def moe_model(family: str, seed: int = 5):
    from rollplex.models import build_model
    from rollplex.models.registry import family_named

    args = family_named(family).tiny_args()
    # The load-balancing loss is a product of batch means, which a batch split over ranks does not keep.
    args.text.moe.router_aux_loss_coef = 0.0
    return build_model(args, seed=seed, init_std=None)


def whole(model) -> dict[str, torch.Tensor]:
    from rollplex.dist import full_tensor

    return {n.replace("._checkpoint_wrapped_module", ""): full_tensor(p.detach()).clone()
            for n, p in model.named_parameters()}


GREEDY_PROMPTS = ([1, 5, 9, 13, 2, 7], [3, 11, 12], [4, 8, 6, 6, 10])


def greedy(model) -> list[list[int]]:
    from rollplex.engine import Engine, EngineConfig, Request, SamplingParams
    from rollplex.models.inputs import Prompt

    engine = Engine(model, EngineConfig(block_size=4, num_blocks=64))
    requests = [Request(Prompt(torch.tensor(p))) for p in GREEDY_PROMPTS]
    out = engine.generate(requests, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    engine.release_kv()
    return [o.samples[0].token_ids for o in out]


def ep_model_step(rank: int, world: int, family: str, folder: str, ep: int = 2) -> None:
    """dp 2 x ep 2: one policy update on this rank's half of the groups, then what reads the split experts:
    the engine's rebuilt experts (and its greedy tokens), a DCP checkpoint loaded into a model without EP, and
    the hub export."""
    from pathlib import Path

    from rollplex.dist import ParallelDims, build_ep_mesh, build_mesh, full_tensor
    from rollplex.models.expert_parallel import experts_of
    from rollplex.models.loader import from_pretrained, save_pretrained
    from rollplex.rl.weights import SharedWeights
    from rollplex.train.actor import Actor, PolicyBatch
    from rollplex.train.checkpoint import load_model_weights, save_checkpoint
    from rollplex.train.parallelize import parallelize
    from test_actor import record_gradients

    torch.set_num_threads(1)
    folder = Path(folder)
    model = moe_model(family)
    full = policy_batch(model)  # before sharding: the single process's numbers
    dims = ParallelDims.resolve(world, -1, 1, ep)
    mesh = build_mesh(dims, "cpu")
    parallelize(model, mesh, activation_checkpointing=True, ep_mesh=build_ep_mesh(dims, "cpu"))
    mine = [g for g in range(len(full.groups)) if g % world == rank]
    firsts = [sum(len(g.samples) for g in full.groups[:i]) for i in range(len(full.groups))]
    ids = [firsts[g] + j for g in mine for j in range(len(full.groups[g].samples))]
    batch = PolicyBatch([full.groups[g] for g in mine], [full.advantages[i] for i in ids],
                        [full.old_logprobs[i] for i in ids], [full.ref_logprobs[i] for i in ids])
    actor = Actor(model, actor_config(), dp_group=mesh["dp_shard"].get_group())
    grads = record_gradients(actor)
    metrics = actor.update(batch)
    weights = whole(model)
    result = {"grads": grads[0], "weights": weights, "grad_norm": metrics["actor/grad_norm"]}

    # The engine: every expert whole, rebuilt at each rollout and freed after it.
    model.eval()
    shared = SharedWeights(model)
    with shared.for_rollout() as engine_model:
        engine_experts = experts_of(engine_model)
        for e in engine_experts:
            assert e.dispatcher is None and not isinstance(e.gate_up_proj, torch.distributed.tensor.DTensor)
        rebuilt = {n: p.detach().clone() for n, p in engine_model.named_parameters() if ".experts." in n}
        result["tokens"] = greedy(engine_model)
    assert all(e.gate_up_proj.untyped_storage().size() == 0 for e in engine_experts)
    result["rebuilt"] = rebuilt
    result["report"] = shared.report.as_metrics()

    # DCP: the split experts saved, loaded into a model sharded without expert parallelism.
    path = save_checkpoint(folder / "ckpt", 1, model, actor.optimizer)
    plain = moe_model(family, seed=9)
    parallelize(plain, mesh)
    load_model_weights(path, plain)
    result["loaded"] = whole(plain)
    # The hub export gathers every expert.
    save_pretrained(model, folder / "hf")
    dist.barrier()
    result["exported"] = {n: p.detach() for n, p in from_pretrained(folder / "hf", dtype=torch.float32,
                                                                       device="cpu").named_parameters()}
    for n, p in model.named_parameters():
        if ".experts." in n:
            assert tuple(full_tensor(p).shape) == tuple(p.shape) and p.to_local().shape[0] < p.shape[0]
    if rank == 0:
        torch.save(result, folder / "rank0.pt")


def single_process_step(family: str) -> dict:
    from rollplex.train.actor import Actor
    from test_actor import record_gradients

    torch.manual_seed(0)
    model = moe_model(family)
    batch = policy_batch(model)
    actor = Actor(model, actor_config())
    grads = record_gradients(actor)
    metrics = actor.update(batch)
    model.eval()
    return {"grads": grads[0], "weights": whole(model), "grad_norm": metrics["actor/grad_norm"],
            "tokens": greedy(model)}


@pytest.mark.parametrize("family", ["qwen3_vl_moe", pytest.param("qwen3_5_moe", marks=pytest.mark.slow)])
def test_ep_model_update_equals_one_process(tmp_path, family):
    """A tiny MoE model (Qwen3-VL-MoE; Qwen3.5-MoE, with its shared expert and Gated DeltaNet
    layers), dp 2 x ep 2 on 2 gloo ranks (activation checkpointing on, so each MoE layer
    dispatches again in the recompute), one policy update on half of the groups
    each: the first step's gradients (experts, router and the rest), the clipped gradient
    norm and the updated weights are one process's on every group. The engine's experts,
    rebuilt whole for the rollout, are the updated weights, and its greedy tokens a single
    process's; the DCP checkpoint loads into a model without expert parallelism; the hub
    export holds every expert."""
    from test_actor import assert_same_update

    run_distributed(ep_model_step, 2, family, str(tmp_path))
    got = torch.load(tmp_path / "rank0.pt")
    ref = single_process_step(family)
    assert_same_update((got["grads"], got["weights"]), (ref["grads"], ref["weights"]))
    assert got["grad_norm"] > 10 * actor_config().grad_clip  # clipping was active
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    assert got["rebuilt"] and all(torch.equal(t, got["weights"][n]) for n, t in got["rebuilt"].items())
    assert got["tokens"] == ref["tokens"]
    expert_bytes = sum(t.numel() * t.element_size() for t in got["rebuilt"].values())
    assert got["report"]["weights/bytes_rebuilt_experts"] == expert_bytes == got["report"]["weights/bytes_rebuilt"]
    for n, t in got["weights"].items():
        assert torch.equal(got["loaded"][n], t), n
        assert torch.equal(got["exported"][n], t), n


# --------------------------------------------------------------------------- the RL loop

@pytest.mark.slow  # the model update above holds the same equality in the default suite
def test_rl_loop_with_ep_equals_without(tmp_path):
    """Two RL steps of the tiny Qwen3-VL-MoE on 2 gloo ranks, overlap schedule with streamed
    groups and a reference model: ep 2 (the actor's and the reference model's experts split, the
    prompt work dispatching between decode steps, no streamed pass since a forward now issues
    all-to-alls, the engine's experts rebuilt) logs what ep 1 logs."""
    from rollplex.metrics import read_metrics
    from test_rl_loop import distributed_run

    args = ["--model.tiny.family", "qwen3_vl_moe", "--algorithm.kl_coef", "0.1", "--schedule.kind", "overlap",
            "--schedule.stream_groups"]
    run_distributed(distributed_run, 2, str(tmp_path / "ep1"), *args)
    run_distributed(distributed_run, 2, str(tmp_path / "ep2"), *args, "--parallel.ep", "2")
    ep1, ep2 = (read_metrics(tmp_path / name / "metrics.jsonl") for name in ("ep1", "ep2"))
    assert [r["step"] for r in ep2] == [r["step"] for r in ep1] == [1, 2]
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "critic/score/mean",
                "response_length/mean", "val/score"):
        for a, b in zip(ep1, ep2):
            assert (a.get(key) is None) == (b.get(key) is None), key
            if a.get(key) is not None:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    for r in ep2:
        assert r["weights/bytes_rebuilt_experts"] == r["weights/bytes_rebuilt"] > 0


def test_no_pass_streams_under_ep():
    """A streamed finished-group pass runs in each rank's own order, where an all-to-all would not line up."""
    from types import SimpleNamespace

    from rollplex.config import load_config
    from rollplex.rl.schedules.overlap_stream import StreamPlan
    from rollplex.rl.schedules.prompt_items import PromptKind

    prefix = SimpleNamespace(budget_left=None, admitted=[SimpleNamespace(kind=PromptKind.ACTOR)])
    flags = ["--algorithm.kl_coef", "0.1", "--algorithm.recompute_old_logprobs"]
    dense = StreamPlan.of(load_config(flags), 2, prefix, 0, 0)
    assert dense.ref and dense.old and dense.update
    split = StreamPlan.of(load_config(flags + ["--parallel.ep", "2"]), 2, prefix, 0, 0)
    assert not (split.ref or split.old or split.update or split.gather_ref)
