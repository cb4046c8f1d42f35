"""Routing replay on a tiny Qwen3-VL-MoE: the engine records the experts each token went
through (a group's prompt once, at its prefill; each response token at the step that fed
it), those routes are the trainer's own on the same weights, and a training pass that
replays them (R3) routes exactly as the rollout did, which in bf16 makes its
probabilities closer to the rollout's than routing live. R2 records the old pass's routes
and the update replays them. The RL loop carries all of it (tests at the end)."""

from pathlib import Path

import pytest
import torch

from rollplex.engine import Engine, EngineConfig, SamplingParams
from rollplex.metrics import read_metrics
from rollplex.models import build_model
from rollplex.models.moe import UNRECORDED, Routing
from rollplex.models.packing import pack_groups
from rollplex.models import qwen3_5_moe
from rollplex.models.qwen3_vl_moe import tiny_args
from rollplex.train import routes as route_layouts
from rollplex.train.actor import response_logprobs
from test_agent_engine import SAMPLING, TURN_ENDS, ScriptedEpisodes, observation_prompts
from test_qwen3_vl_engine import requests
from test_qwen3_vl_model import image_tokens, pixels
from test_schedules import SCHEDULES, max_difference, train

PARAMS = SamplingParams(temperature=1.0, max_tokens=6, seed=2, ignore_eos=True)


def model(dtype: torch.dtype = torch.float32, seed: int = 3, args=None):
    # init_std=None: every expert moves its tokens' outputs, so a token's route matters.
    return build_model(args or tiny_args(), dtype=dtype, seed=seed, init_std=None).eval()


def generate(m, **config) -> list:
    engine = Engine(m, EngineConfig(**{"block_size": 4, "num_blocks": 256, "record_routes": True, **config}))
    groups = engine.generate(requests(n=2), PARAMS)
    return groups, engine


def live_routes(m, groups) -> torch.Tensor:
    """The trainer's own routes of the groups (pack_groups' shared-prefix order), routing live."""
    routing = Routing()
    with torch.no_grad():
        m.forward_packed(pack_groups(m.args, groups, share_prefix=True).packed, routing=routing)
    return routing.routes()


def assert_same_expert_sets(recorded: torch.Tensor, live: torch.Tensor) -> None:
    rows = recorded[:, :, 0] != UNRECORDED
    assert torch.equal(recorded.sort(-1).values[rows], live.sort(-1).values[rows])


@pytest.mark.parametrize("graphs, args", [(False, tiny_args()), (True, tiny_args()), (True, qwen3_5_moe.tiny_args())],
                         ids=["eager", "graph stand-in", "Qwen3.5-MoE, graph stand-in"])
def test_the_engine_records_the_trainers_routes(graphs, args):
    """Qwen3.5-MoE's DeltaNet layers keep a recurrent state beside the KV cache: its routes too."""
    m = model(args=args)
    engine = Engine(m, EngineConfig(block_size=4, num_blocks=256, record_routes=True))
    engine.runner.use_cuda_graphs = graphs
    groups = engine.generate(requests(n=2), PARAMS)
    for g in groups:
        prompt = g.samples[0].prompt_routes
        assert all(s.prompt_routes is prompt for s in g.samples)  # routed once, at the group's prefill
        layers = args.text.num_hidden_layers
        assert prompt.shape == (len(g.prompt.input_ids), layers, 2)
        for s in g.samples:
            assert s.routes.shape == (len(s.token_ids), layers, 2)
            # Every response token but the last (which nothing fed) has its routes.
            assert (s.routes[:-1] != UNRECORDED).all() and (s.routes[-1] == UNRECORDED).all()
        assert_same_expert_sets(route_layouts.packed([g], share_prefix=True), live_routes(m, [g]))


def test_a_preempted_sequence_keeps_the_routes_of_its_recomputed_tokens():
    m = model()
    groups, engine = generate(m, num_blocks=14, max_num_seqs=8)
    assert engine.stats["preemptions"] > 0
    for g in groups:
        for s in g.samples:
            assert (s.routes[:-1] != UNRECORDED).all()
        assert_same_expert_sets(route_layouts.packed([g], share_prefix=True), live_routes(m, [g]))


def test_multi_turn_episodes_record_their_observations_routes():
    """An episode's observation is routed by its continuation prefill, a turn's last token by the decode step (run
    ahead) or the prefill that fed it: every response token but the very last has the routes the trainer computes
    over the whole trajectory, and replaying them gives the rollout's probabilities (tests/test_agent_engine.py)."""
    m = model()
    episodes = ScriptedEpisodes(m, observation_prompts(qwen3_vl_image), TURN_ENDS)
    engine = Engine(m, EngineConfig(block_size=4, num_blocks=256, record_routes=True))
    groups = engine.generate(requests(n=2), SAMPLING, episodes=episodes)
    assert sum(len(s.observations) for g in groups for s in g.samples) > 0
    for g in groups:
        for s in g.samples:
            assert (s.routes[:-1] != UNRECORDED).all() and (s.routes[-1] == UNRECORDED).all()
        assert_same_expert_sets(route_layouts.packed([g], share_prefix=True), live_routes(m, [g]))
    assert rollout_probs_diff(m, groups, replay=True)[0] <= 1e-5


def qwen3_vl_image(h: int, w: int, seed: int):
    rows, grid = pixels(1, h, w, seed)
    return rows, grid, image_tokens(grid)


def rollout_probs_diff(m, groups, replay: bool) -> tuple[float, Routing]:
    """The largest |p_trainer - p_rollout| over the tokens the rollout sampled, and the pass's routing."""
    batch = pack_groups(m.args, groups, share_prefix=True)
    routing = Routing(route_layouts.packed(groups, share_prefix=True) if replay else None)
    with torch.no_grad():
        logprobs, _ = response_logprobs(m, batch, routing=routing)
    rollout = torch.tensor([lp for g in groups for s in g.samples for lp in s.logprobs])
    sampled = torch.cat([s.sampled_mask() for g in groups for s in g.samples])  # not observations' (0.0 there)
    return (logprobs.exp() - rollout.exp()).abs()[sampled].max().item(), routing


def test_replaying_the_rollouts_routes_matches_its_probabilities():
    """fp32: the update routes as the rollout did and its probabilities are the rollout's within 1e-5."""
    m = model()
    groups, _ = generate(m)
    diff, routing = rollout_probs_diff(m, groups, replay=True)
    assert diff <= 1e-5
    assert routing.metrics()["agreed"] == routing.metrics()["replayed"] > 0


@pytest.mark.parametrize("seed", [4, 7])
def test_in_bf16_replay_lowers_the_rollout_probs_diff(seed):
    """bf16: the engine's forwards and the trainer's round differently, and where a token's router
    is near a tie its top-k set flips (here 2 of 456 token-layer decisions, on 16 experts of which 4
    go, the router's weights scaled down to make ties likelier; these seeds are two of the four of
    0-7 where a flip moves a probability). Replaying the rollout's routes takes that flip away:
    the largest probability difference drops by more than half (13x and 6x here), and is never larger
    elsewhere (the other seeds give equal differences)."""
    m = build_model(tiny_args(experts=16, top_k=4), dtype=torch.bfloat16, seed=seed, init_std=None).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(0.3)
    engine = Engine(m, EngineConfig(block_size=4, num_blocks=256, record_routes=True))
    groups = engine.generate(requests(n=4), SamplingParams(temperature=1.0, max_tokens=8, seed=2, ignore_eos=True))
    replayed, routing = rollout_probs_diff(m, groups, replay=True)
    live, _ = rollout_probs_diff(m, groups, replay=False)
    metrics = routing.metrics()
    assert metrics["agreed"] < metrics["replayed"]  # the live router disagrees somewhere
    assert replayed < 0.5 * live


def test_r2_records_the_old_pass_and_replays_it():
    """The old pass records its routes into the samples (prompt and responses, in the update's
    layout), and a replaying pass on the same weights agrees with every one of them."""
    m = model()
    groups, _ = generate(m)
    for g in groups:
        for s in g.samples:
            s.prompt_routes = s.routes = None
    routing = Routing()
    with torch.no_grad():
        response_logprobs(m, pack_groups(m.args, groups, share_prefix=False), routing=routing)
    route_layouts.store_packed(groups, False, routing)
    replay = route_layouts.packed(groups, share_prefix=True)
    assert replay is not None and (replay != UNRECORDED).all()
    _, routing = rollout_probs_diff(m, groups, replay=True)
    assert routing.metrics()["agreed"] == routing.metrics()["replayed"] == replay.shape[0] * 2


MOE = ["--model.tiny.family", "qwen3_vl_moe", "--trainer.total_steps", "2"]


@pytest.mark.parametrize("family, replay, schedule", [
    ("qwen3_vl_moe", "rollout", "serial-prefix"), ("qwen3_vl_moe", "old", "serial-prefix"),
    # serial-naive's passes are in the layout test below; Qwen3.5-MoE's engine routes above (time budget)
    pytest.param("qwen3_vl_moe", "rollout", "serial-naive", marks=pytest.mark.slow),
    pytest.param("qwen3_5_moe", "rollout", "serial-prefix", marks=pytest.mark.slow)])
def test_the_rl_loop_replays_routes(tmp_path, family, replay, schedule):
    """Every pass of the loop replays (kept prompt forwards, suffix passes, full passes): the
    first update, on the rollout's weights, matches the rollout's probabilities; the moe/* metrics
    are logged."""
    train(tmp_path, *MOE, "--model.tiny.family", family, *SCHEDULES[schedule], "--algorithm.routing_replay", replay)
    rows = read_metrics(Path(tmp_path) / "metrics.jsonl")
    for row in rows:
        assert row["training/rollout_probs_diff_max"] <= 1e-5
        assert 0.5 < row["moe/routing_agreement"] <= 1.0
        assert row["moe/aux_loss"] > 0 and row["moe/expert_load_max_over_mean"] >= 1.0


def test_the_aux_loss_is_off_at_zero(tmp_path):
    trainer, _ = train(tmp_path, *MOE, "--trainer.total_steps", "1", "--algorithm.moe_aux_loss_coef", "0")
    assert trainer.actor.aux_loss_coef == 0.0
    assert "moe/aux_loss" in read_metrics(Path(tmp_path) / "metrics.jsonl")[0]


def test_replay_trains_alike_in_every_pass_layout_and_under_recompute(tmp_path):
    """With the rollout's routes replayed, per-sample sequences (serial-naive), groups sharing their
    prompt's pass and the kept prompt forward (serial-prefix), and the latter with every decoder
    layer recomputed in the backward (the recompute replays the same routes) make the same updates,
    a load-balancing loss (50x the checkpoint's weight) included: it counts the response tokens
    each layout trains, once each (here every micro-batch holds a whole optimizer step's groups:
    the loss is a product of two means over a micro-batch's tokens, so layouts that cut an optimizer
    step into micro-batches differently weigh it differently, as transformers' per-forward loss)."""
    runs = {}
    for name, extra in {"serial-naive": SCHEDULES["serial-naive"], "serial-prefix": [],
                        "recompute": ["--parallel.activation_checkpointing", "true"]}.items():
        _, params = train(tmp_path / name, *MOE, *extra, "--algorithm.routing_replay", "rollout",
                          "--algorithm.moe_aux_loss_coef", "0.05")
        runs[name] = ({n.replace("_checkpoint_wrapped_module.", ""): p for n, p in params.items()},
                      [r["critic/score/mean"] for r in read_metrics(tmp_path / name / "metrics.jsonl")])
    naive_params, naive_scores = runs.pop("serial-naive")
    for name, (params, scores) in runs.items():  # within test_schedules.check_same_training's bound
        assert scores == naive_scores and max_difference(params, naive_params) <= 2e-5, name
