"""Non-finite values: the engine raises on NaN/inf logits, naming the step, the
samples and where in the model they first appear, and never samples from them;
the trainer skips, on every rank, an optimizer step whose logprobs are not
finite, and counts them in `training/nonfinite_logprobs`."""

import json
import math
import re

import pytest
import torch

import rollplex.cli
from distributed import run_distributed
from rollplex.config import load_config
from rollplex.engine import Engine, EngineConfig, NonFiniteLogitsError, Request, SamplingParams
from rollplex.engine.sampler import sample, uniforms
from rollplex.models import Prompt, build_model
from rollplex.rl.loop import RLTrainer
from rollplex.train.actor import Actor, ActorConfig, PolicyBatch
from test_actor import policy_batch
from test_model import tiny_args
from test_rl_loop import FAST

NAN, INF = float("nan"), float("inf")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]
PARAMS = SamplingParams(temperature=1.0, max_tokens=6, seed=0, ignore_eos=True)
# Prefilled together in step 0 (prompt rows 0-3, then 4-6), then decoding in running
# order: request 0's samples 0 and 1, request 1's sample 0.
REQUESTS = [Request(Prompt(torch.tensor([1, 5, 9, 13])), n=2), Request(Prompt(torch.tensor([3, 4, 11])))]


@pytest.fixture(scope="module")
def model():
    return build_model(tiny_args(), seed=3, init_std=None).eval()


class Poison:
    """A forward hook writing `value` into a module's output at `index` from the
    engine's step `step` on (prefill is step 0), in the engine's rerun of the step
    too, as a bad weight would. `engine`: whose steps count (None: every forward)."""

    def __init__(self, module: torch.nn.Module, index, value: float = NAN, step: int = 0):
        self.index, self.value, self.step = index, value, step
        self.engine: Engine | None = None
        self.handle = module.register_forward_hook(self.hook)

    def hook(self, module, args, output):
        # The engine counts a step before running it.
        if self.engine is None or self.engine.stats["steps"] > self.step:
            output = output.clone()
            output[self.index] = self.value
            return output


def engine(model, graphs: bool = False) -> Engine:
    e = Engine(model, EngineConfig(block_size=4, num_blocks=64, max_num_seqs=4))
    e.runner.use_cuda_graphs = graphs  # on CPU: the runner's eager stand-in for CUDA graphs
    return e


def generate_poisoned(e: Engine, poison: Poison) -> NonFiniteLogitsError:
    poison.engine = e
    try:
        with pytest.raises(NonFiniteLogitsError) as caught:
            e.generate(REQUESTS, PARAMS)
    finally:
        poison.handle.remove()
    return caught.value


def test_sampled_logprob_is_nonfinite_exactly_when_the_row_is_unusable():
    """NaN or +inf anywhere in a row, or a row all -inf, makes the sampled token's
    logprob NaN, whatever the sampling mode; masked -inf logits alone do not.
    Every token stays a valid id (an out-of-range gather is a device-side assert on CUDA)."""
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    logits[0, 7] = NAN
    logits[1, 7] = INF
    logits[2] = -INF
    logits[3, 3:] = -INF  # masked: only tokens 0-2 remain
    logits[4, :] = NAN
    usable = torch.tensor([False, False, False, True, False, True])
    n = len(logits)
    u = uniforms(torch.arange(n), torch.full((n,), 5))
    for truncate in (False, True):
        for temperature in (1.0, 0.0, 0.7):
            for top_k in (-1, 5):
                # One number per parameter, as the engine passes them, or one per row.
                for params in ((temperature, 0.9, top_k),
                               (torch.full((n,), temperature), torch.full((n,), 0.9), torch.full((n,), top_k))):
                    tokens, logprobs = sample(logits, *params, u, truncate=truncate)
                    assert ((0 <= tokens) & (tokens < 50)).all()
                    assert torch.equal(logprobs.isfinite(), usable)
                    assert tokens[3] < 3


@pytest.mark.parametrize("graphs", [False, True])
def test_nan_from_a_decoder_layer_in_decode_names_the_step_sample_and_layer(model, graphs):
    e = engine(model, graphs)
    layers = model.language_model.layers
    error = generate_poisoned(e, Poison(layers[1], 1, step=2))  # running row 1: request 0, sample 1
    assert (error.step_kind, error.step_index, error.samples, error.where) == ("decode", 2, [(0, 1)],
                                                                               "decoder layer 1")
    assert "engine step 2 (decode)" in str(error) and "request 0 (sample 1)" in str(error)
    assert e.runner.use_cuda_graphs == graphs  # the rerun ran eagerly, and put the graphs back


@pytest.mark.parametrize("device", DEVICES)
def test_a_weight_gone_bad_under_a_decode_graph_is_caught_and_located(device):
    """A weight turned NaN in place between two steps: a captured CUDA graph reads it
    as it is (on CPU, the runner's stand-in does); the eager rerun finds its layer.
    `between_steps` after step 1 runs with step 2 already issued (the engine runs one
    step ahead), so step 3 is the first to read the bad weight."""
    model = build_model(tiny_args(), device=device, seed=3, init_std=None).eval()
    e = engine(model, graphs=True)
    weight = model.language_model.layers[1].mlp.down_proj.weight

    def between_steps(running: int) -> None:
        if e.stats["steps"] == 3:
            with torch.no_grad():
                weight[0, 0] = NAN

    with pytest.raises(NonFiniteLogitsError) as caught:
        e.generate(REQUESTS, PARAMS, between_steps)
    error = caught.value
    assert (error.step_kind, error.step_index, error.samples, error.where) == (
        "decode", 3, [(0, 0), (0, 1), (1, 0)], "decoder layer 1")


def test_nan_in_prefill_names_each_sample_of_the_request_and_the_first_layer(model):
    """NaN from layer 0 is in layer 1's output too: the first is named."""
    error = generate_poisoned(engine(model), Poison(model.language_model.layers[0], slice(0, 4)))
    assert (error.step_kind, error.step_index, error.samples, error.where) == ("prefill", 0, [(0, 0), (0, 1)],
                                                                               "decoder layer 0")
    assert "request 0 (samples 0, 1)" in str(error)


def test_inf_in_the_head_output_is_caught(model):
    error = generate_poisoned(engine(model), Poison(model.lm_head, (1, 7), INF))  # logits row 1: request 1
    assert (error.step_kind, error.samples, error.where) == ("prefill", [(1, 0)], "head")


def test_nan_embedding_is_named(model):
    error = generate_poisoned(engine(model), Poison(model.language_model.embed_tokens, (2, 0), step=1))
    assert (error.step_kind, error.step_index, error.samples, error.where) == ("decode", 1, [(1, 0)], "embedding")


def test_masked_logits_are_sampled_around_not_an_error(model):
    """-inf logits (a mask) are legitimate: the sampled tokens avoid them, their logprobs are finite."""
    mask = Poison(model.lm_head, (slice(None), slice(3, None)), -INF)
    try:
        outputs = engine(model).generate(REQUESTS, PARAMS)
    finally:
        mask.handle.remove()
    samples = [s for o in outputs for s in o.samples]
    assert all(t < 3 for s in samples for t in s.token_ids)
    assert all(math.isfinite(lp) for s in samples for lp in s.logprobs)


def test_the_engine_generates_normally_after_the_error(model):
    """The failed step left NaN K/V in layer 1 at request 0's slot 6, which the same
    sequence's step 1 would read again, masked (0 * NaN), had the pool been kept."""
    clean = [[s.token_ids for s in o.samples] for o in engine(model).generate(REQUESTS, PARAMS)]
    e = engine(model)
    generate_poisoned(e, Poison(model.language_model.layers[0], 0, step=3))
    assert [[s.token_ids for s in o.samples] for o in e.generate(REQUESTS, PARAMS)] == clean


# ----------------------------------------------------------------------------- trainer


def parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def optimizer_state(actor: Actor) -> list[torch.Tensor]:
    return [(v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
            for state in actor.optimizer.state.values() for v in state.values()]


def assert_equal(a, b) -> None:
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def with_reference(batch: PolicyBatch, ref: list[torch.Tensor]) -> PolicyBatch:
    return PolicyBatch(batch.groups, batch.advantages, batch.old_logprobs, ref)


def test_nonfinite_reference_logprob_skips_the_step_and_is_counted():
    """One -inf reference logprob: k3's clamp keeps the loss and gradient finite, so
    only the count stops the step from training on it. Parameters, optimizer state
    and the LR schedule are left as they were, and the next good step goes on."""
    model = build_model(tiny_args(), seed=5, init_std=None)
    actor = Actor(model, ActorConfig(lr=1e-3, kl_coef=0.1))
    good = policy_batch(model, actor.config)
    actor.update(good)
    ref = [lp.clone() for lp in good.ref_logprobs]
    ref[2][0] = -INF
    before, state = parameters(model), optimizer_state(actor)
    metrics = actor.update(with_reference(good, ref))
    assert metrics["training/nonfinite_logprobs"] == 1 and metrics["actor/skipped_steps_total"] == 1
    assert math.isfinite(metrics["actor/grad_norm"])
    assert_equal(list(parameters(model).values()), list(before.values()))
    assert_equal(optimizer_state(actor), state)
    metrics = actor.update(good)
    assert metrics["training/nonfinite_logprobs"] == 0 and metrics["actor/skipped_steps_total"] == 1
    assert not torch.equal(parameters(model)["lm_head.weight"], before["lm_head.weight"])


def skip_on_one_rank(rank: int, world: int, out: str) -> None:
    from rollplex.dist import ParallelDims, build_mesh
    from rollplex.train.parallelize import parallelize

    torch.set_num_threads(1)
    model = build_model(tiny_args(), seed=5, init_std=None)
    cfg = ActorConfig(lr=1e-3, kl_coef=0.1)
    batch = policy_batch(model, cfg)
    if rank == 1:
        batch.ref_logprobs[0][0] = -INF
    mesh = build_mesh(ParallelDims.resolve(world, -1, 1), "cpu")
    parallelize(model, mesh)
    before = parameters(model)
    actor = Actor(model, cfg, dp_group=mesh["dp_shard"].get_group())
    metrics = actor.update(batch)
    unchanged = all(torch.equal(p, before[n]) for n, p in parameters(model).items())
    causes = [actor.skip_cause]
    # Each rank sees only its shards of the gradients: rank 1 an earlier parameter's NaN than rank 0's inf.
    poisoning(actor, {"language_model.layers.1.mlp.up_proj.weight": INF} if rank == 0 else
              {"language_model.layers.0.self_attn.q_proj.weight": NAN})
    batch.ref_logprobs[0][0] = 0.0
    actor.update(batch)
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"nonfinite": metrics["training/nonfinite_logprobs"], "skipped": metrics["actor/skipped_steps_total"],
                   "unchanged": unchanged, "causes": causes + [actor.skip_cause]}, f)


def test_a_nonfinite_logprob_or_gradient_on_one_rank_skips_the_step_on_every_rank_naming_it(tmp_path):
    run_distributed(skip_on_one_rank, 2, str(tmp_path / "rank"))
    causes = ["non-finite logprobs: 1 in the reference logprobs",
              "the gradient of language_model.layers.0.self_attn.q_proj.weight holds NaN (as does one other "
              "parameter's gradient)"]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank.{rank}").read_text())
        assert got == {"nonfinite": 1, "skipped": 1, "unchanged": True, "causes": causes}, rank


def test_rl_step_with_nan_reference_pass_is_skipped_counted_and_the_run_goes_on(tmp_path):
    cfg = load_config(FAST + ["--trainer.output_dir", str(tmp_path), "--algorithm.kl_coef", "0.1",
                              "--algorithm.updates_per_batch", "1"])
    trainer = RLTrainer(cfg)
    batches = trainer._batches(0)

    def step() -> dict[str, float]:
        trainer.step += 1
        return trainer.train_step(next(batches))

    assert step()["training/nonfinite_logprobs"] == 0
    before, state = parameters(trainer.model), optimizer_state(trainer.actor)
    poison = Poison(trainer.ref_model.language_model.layers[1], slice(None))
    try:
        metrics = step()
    finally:
        poison.handle.remove()
    # Every response token's reference logprob, and nothing else.
    responses = cfg.data.batch_size * cfg.rollout.n
    assert metrics["training/nonfinite_logprobs"] == round(metrics["response_length/mean"] * responses) > 0
    assert metrics["actor/skipped_steps_total"] == 1
    assert_equal(list(parameters(trainer.model).values()), list(before.values()))
    assert_equal(optimizer_state(trainer.actor), state)
    metrics = step()
    assert metrics["training/nonfinite_logprobs"] == 0 and metrics["actor/skipped_steps_total"] == 1
    assert math.isfinite(metrics["actor/grad_norm"])
    assert not all(torch.equal(p, before[n]) for n, p in parameters(trainer.model).items())


def poisoning(actor: Actor, poisons: dict[str, float]) -> None:
    """Before each of the actor's optimizer steps, write each value of `poisons` into the first element of this
    rank's share of that parameter's gradient, as a bad kernel would."""
    clip_and_step = actor._clip_and_step

    def poisoned(known_cause: str) -> float:
        for name, p in actor.model.named_parameters():
            if name in poisons:
                (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).view(-1)[0] = poisons[name]
        return clip_and_step(known_cause)

    actor._clip_and_step = poisoned


def test_a_skipped_step_names_its_cause_and_a_taken_step_ends_the_run_of_skips():
    model = build_model(tiny_args(), seed=5, init_std=None)
    actor = Actor(model, ActorConfig(lr=1e-3, kl_coef=0.1))
    good = policy_batch(model, actor.config)
    # Advantages of 1e30 (Dr.GRPO on rewards of 1e30): every gradient finite, their squares not.
    actor.update(PolicyBatch(good.groups, [a * 1e30 for a in good.advantages], good.old_logprobs, good.ref_logprobs))
    assert re.fullmatch(r"every gradient is finite but their norm overflows float32: the largest \|gradient\| is "
                        r"\d\.\d+e\+\d\d, in [\w.]+", actor.skip_cause), actor.skip_cause
    poisoning(actor, {"language_model.layers.1.mlp.up_proj.weight": INF, "lm_head.weight": NAN})
    actor.update(good)
    assert actor.skip_cause == ("the gradient of language_model.layers.1.mlp.up_proj.weight holds inf (as does one "
                                "other parameter's gradient)")
    del actor._clip_and_step
    ref = [lp.clone() for lp in good.ref_logprobs]
    ref[2][0] = -INF
    actor.update(with_reference(good, ref))
    assert actor.skip_cause == "non-finite logprobs: 1 in the reference logprobs" and actor.skipped_in_a_row == 3
    actor.update(good)
    assert (actor.skip_cause, actor.skipped_in_a_row, actor.skipped_steps) == ("", 0, 3)


# 16 responses a step (FAST: 4 prompts x 4), every other one 1e30 (so every group mixes 1e30 and 0), but in step 2,
# where the rewards are 0.5 and 0. Scored in the trainer's process, in order: `calls` counts the step's responses.
HUGE_REWARDS_BUT_STEP_2 = """
calls = 0

def reward(response, answer):
    global calls
    calls += 1
    return (0.5 if (calls - 1) // 16 + 1 == 2 else 1e30) * (calls % 2)
"""


def test_rewards_that_overflow_the_gradients_stop_the_run_with_its_last_good_checkpoint(tmp_path, capsys):
    """Dr.GRPO on rewards of 1e30 overflows the gradient norm: every optimizer step is skipped, each with a line
    saying why; a good step (step 2) ends the run of skips, and the third skip in a row (step 4's first update)
    stops the run before it saves, its one line naming the reward range. Steps 1 and 3, skipped, are not saved:
    step 1's save waits for step 2, which trained, and stays the last checkpoint."""
    (tmp_path / "reward.py").write_text(HUGE_REWARDS_BUT_STEP_2)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as stopped:
        rollplex.cli.train([*FAST, "--trainer.total_steps", "10", "--trainer.save_every", "1", "--trainer.eval_every",
                            "0", "--trainer.val_before_train", "false", "--logging.console", "true",
                            "--algorithm.adv_estimator", "drgrpo", "--algorithm.updates_per_batch", "2",
                            "--data.reward", f"{tmp_path / 'reward.py'}:reward", "--data.reward_workers", "0",
                            "--trainer.output_dir", str(out)])
    assert stopped.value.code == 1
    console = capsys.readouterr()
    skips = [line for line in console.out.splitlines() if " skipped (" in line]
    overflow = "every gradient is finite but their norm overflows float32: the largest |gradient| is "
    ranges = "; the step's rewards lie in [0, 1e+30], its advantages in [-5e+29, 5e+29]"
    assert [line.split(overflow)[0] for line in skips] == [
        f"step {step}: optimizer step {update} of 2 skipped ({in_a_row} in a row; trainer.max_skipped_steps 3 stops "
        f"the run): " for step, update, in_a_row in ((1, 1, 1), (1, 2, 2), (3, 1, 1), (3, 2, 2), (4, 1, 3))]
    assert all(line.endswith(ranges) for line in skips)
    [end] = console.err.splitlines()[-1:]
    assert end.startswith("rollplex: 3 optimizer steps in a row were skipped for non-finite values "
                          "(trainer.max_skipped_steps 3; 0 never stops), the last at step 4: " + overflow)
    assert f"{ranges}. Try data.reward_clip" in end and "The run stopped before saving this step" in end
    assert end.endswith(f"Last checkpoint: step 2 ({out / 'checkpoints' / 'step_00000002'}); run the same command to "
                        f"resume. The traceback is in {out / 'error.log'}.")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000002"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["actor/skipped_steps_total"]) for r in rows] == [(1, 2), (2, 2), (3, 4)]
