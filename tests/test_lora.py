"""LoRA (rollplex.train.lora): which layers get adapters, that the model starts as the
base and that an update moves the adapters alone, that data and tensor parallelism
leave the update unchanged, and in the RL loop that the engine reads the base in place
with the adapters on (same logprobs as the trainer, graphs kept across steps) and that
checkpoints hold the adapters only and resume."""

import json

import pytest
import torch

from distributed import run_distributed
from rollplex.config import LoRAConfig, load_config
from rollplex.metrics import read_metrics
from rollplex.models import build_model
from rollplex.rl.loop import RLTrainer
from rollplex.train.actor import Actor, ActorConfig
from rollplex.train.lora import apply_lora, freeze_base, is_adapter, selected_layers
from test_actor import assert_same_update, policy_batch, record_gradients
from test_model import tiny_args
from test_rollout_match import logprobs_from_logits

pytestmark = pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")

DECODER_LINEARS = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                   "mlp.up_proj", "mlp.down_proj"}


def lora_model(rank: int = 4, seed: int = 5, **lora) -> tuple[torch.nn.Module, LoRAConfig]:
    model = build_model(tiny_args(), seed=seed, init_std=None)
    config = LoRAConfig(rank=rank, **lora)
    apply_lora(model, config, seed=0)
    freeze_base(model, torch.float32)
    return model, config


def test_all_linear_means_the_language_models_linears_without_the_head_and_the_vision_tower():
    model = build_model(tiny_args(), seed=5, init_std=None)
    names = {name for name, _ in selected_layers(model, LoRAConfig(rank=4))}
    layers = len(model.language_model.layers)
    assert names == {f"language_model.layers.{i}.{n}" for i in range(layers) for n in DECODER_LINEARS}
    # Without the default exclusion the vision tower's linears are chosen too (not its patch convolution).
    with_vision = {name for name, _ in selected_layers(model, LoRAConfig(rank=4, exclude_modules=""))}
    assert any(n.startswith("visual.blocks.0.attn.") for n in with_vision) and "lm_head" not in with_vision


def test_target_and_exclude_modules_pick_layers_by_name():
    model = build_model(tiny_args(), seed=5, init_std=None)
    config = LoRAConfig(rank=4, target_modules=["q_proj", "mlp.down_proj"], exclude_modules=r"(visual|.*layers\.0)\..*")
    assert {n for n, _ in selected_layers(model, config)} == {"language_model.layers.1.self_attn.q_proj",
                                                               "language_model.layers.1.mlp.down_proj"}
    with pytest.raises(ValueError, match="select no Linear layer"):
        apply_lora(model, LoRAConfig(rank=4, target_modules=["no_such_proj"]))


def test_the_model_starts_as_the_base_and_an_update_moves_only_the_adapters():
    base_model = build_model(tiny_args(), seed=5, init_std=None)
    model, _ = lora_model()
    cfg = ActorConfig(lr=1e-3, kl_coef=0.1, grad_clip=1.0)
    batch = policy_batch(base_model, cfg)
    # B starts at zero: the logprobs are the base model's, to the bit.
    assert all(torch.equal(a, b) for a, b in zip(Actor(model, cfg).logprobs(model, batch.groups), batch.old_logprobs))
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not is_adapter(n)}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if is_adapter(n)}
    actor = Actor(model, cfg)
    grads = record_gradients(actor)
    for _ in range(2):
        actor.update(batch)
    assert set(grads[0]) == set(adapters)  # gradients reach the adapters only
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n], t) for n, t in base.items())  # the base, bitwise
    assert all(not torch.equal(after[n], t) for n, t in adapters.items())
    assert not any(p.requires_grad for n, p in model.named_parameters() if not is_adapter(n))


def parallel_lora_update(rank: int, world: int, tp: int, out: str) -> None:
    from rollplex.dist import ParallelDims, build_mesh
    from rollplex.train.parallelize import parallelize

    torch.set_num_threads(1)
    model = build_model(tiny_args(), seed=5, init_std=None)
    cfg = ActorConfig(lr=1e-3, kl_coef=0.1, grad_clip=0.0, max_tokens_per_micro_batch=120)
    full = policy_batch(model, cfg)
    mesh = build_mesh(ParallelDims.resolve(world, -1, tp), "cpu")
    parallelize(model, mesh, lora=LoRAConfig(rank=4), seed=0)
    dp, dp_rank = mesh["dp_shard"].size(), mesh["dp_shard"].get_local_rank()
    mine = [g for g in range(len(full.groups)) if g % dp == dp_rank]
    firsts = [sum(len(g.responses) for g in full.groups[:i]) for i in range(len(full.groups))]
    ids = [firsts[g] + j for g in mine for j in range(len(full.groups[g].responses))]
    batch = type(full)([full.groups[g] for g in mine], [full.advantages[i] for i in ids],
                       [full.old_logprobs[i] for i in ids], [full.ref_logprobs[i] for i in ids])
    actor = Actor(model, cfg, dp_group=mesh["dp_shard"].get_group())
    grads = record_gradients(actor)
    for _ in range(3):
        actor.update(batch)
    params = {n.replace("._checkpoint_wrapped_module", ""): (p.full_tensor() if hasattr(p, "full_tensor") else p)
              .tolist() for n, p in model.named_parameters() if is_adapter(n)}
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"params": params, "grads": {n: g.tolist() for n, g in grads[0].items()}}, f)


def test_two_tensor_parallel_ranks_train_the_adapters_as_one(tmp_path):
    """tp=2, each adapter split as the layer it wraps: one process's gradients and adapters (dp_shard=2, the
    base whole on each rank and the adapters sharded, is the RL loop's two-rank test below)."""
    model, _ = lora_model()
    cfg = ActorConfig(lr=1e-3, kl_coef=0.1, grad_clip=0.0, max_tokens_per_micro_batch=120)
    batch = policy_batch(model, cfg)
    actor = Actor(model, cfg)
    grads = record_gradients(actor)
    for _ in range(3):
        actor.update(batch)
    run_distributed(parallel_lora_update, 2, 2, str(tmp_path / "out.json"))
    got = json.loads((tmp_path / "out.json").read_text())
    theirs = ({n: torch.tensor(g) for n, g in got["grads"].items()}, {n: torch.tensor(p) for n, p in got["params"].items()})
    ours = (grads[0], {n: p.detach() for n, p in model.named_parameters() if is_adapter(n)})
    assert set(theirs[0]) == set(ours[0])
    assert_same_update(theirs, ours)


FAST = ["--trainer.total_steps", "2", "--data.batch_size", "4", "--rollout.n", "4", "--rollout.max_tokens", "4",
        "--data.val_size", "4", "--trainer.eval_every", "0", "--trainer.save_every", "0", "--logging.no_console",
        "--lora.rank", "8", "--trainer.lr", "1e-2"]


@torch.no_grad()
def test_the_engine_runs_the_adapters_on_the_base_in_place(tmp_path):
    """After an update (adapters no longer zero) the engine's logprobs are the trainer's;
    the base is the same tensors bitwise, read by the engine where they are, and in bfloat16 (adapters
    gathered from fp32 masters) the weights the decode graphs read stay at one address across steps."""
    trainer = RLTrainer(load_config(FAST + ["--trainer.output_dir", str(tmp_path), "--model.dtype", "bfloat16"]))
    examples = next(trainer._batches(0))
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not is_adapter(n)}
    with torch.enable_grad():
        trainer.train_step(examples)
    addresses = trainer.engine.runner.weight_addresses()
    assert all(torch.equal(p, base[n]) for n, p in trainer.model.named_parameters() if n in base)
    assert any(p.abs().max() > 0 for n, p in trainer.model.named_parameters() if n.endswith("lora_B"))
    result = trainer.rollout(examples, step=2)
    rollout = result.rollout
    engine = torch.cat(rollout.logprobs).double()
    direct = logprobs_from_logits(trainer.model, rollout.groups, trainer.cfg.rollout.temperature)
    torch.testing.assert_close(engine, direct, rtol=0, atol=2e-2)  # bf16: same ops, same weights
    assert trainer.engine.runner.weight_addresses() == addresses
    report = trainer.weights.report
    adapter_bytes = sum(p.numel() * 2 for n, p in trainer.model.named_parameters() if is_adapter(n))
    assert report.bytes_rebuilt == adapter_bytes and report.bytes_viewed == 0
    assert report.bytes_shared == sum(p.numel() * p.element_size() for p in base.values())


def test_fp32_engine_logprobs_equal_the_trainers_with_adapters_on(tmp_path):
    RLTrainer(load_config(FAST + ["--trainer.output_dir", str(tmp_path), "--algorithm.updates_per_batch", "2"])).fit()
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "actor/pg_loss" in r]
    # Step 2's rollout ran on adapters the first step trained; its first mini-batch is measured on them.
    assert rows[1]["training/rollout_probs_diff_max"] < 1e-5


def test_checkpoints_hold_the_adapters_and_a_resumed_run_logs_what_one_run_logs(tmp_path):
    import torch.distributed.checkpoint as dcp

    RLTrainer(load_config(FAST + ["--trainer.output_dir", str(tmp_path / "whole"), "--trainer.total_steps", "3"])).fit()
    whole = read_metrics(tmp_path / "whole" / "metrics.jsonl")
    split = FAST + ["--trainer.output_dir", str(tmp_path / "split"), "--trainer.save_every", "1"]
    RLTrainer(load_config(split)).fit()
    saved = dcp.FileSystemReader(tmp_path / "split" / "checkpoints" / "step_00000002").read_metadata()
    models = {k for k in saved.state_dict_metadata if k.startswith("model.")}
    assert models and all(is_adapter(k) for k in models)
    RLTrainer(load_config(split + ["--trainer.total_steps", "3"])).fit()
    resumed = read_metrics(tmp_path / "split" / "metrics.jsonl")
    assert [r["step"] for r in resumed if "actor/pg_loss" in r] == [1, 2, 3]
    for key in ("actor/pg_loss", "critic/score/mean"):
        assert [r[key] for r in resumed if key in r] == pytest.approx([r[key] for r in whole if key in r]), key


@pytest.mark.parametrize("fields, message", [
    ({"rank": -1}, "lora.rank must be >= 0"),
    ({"rank": 8, "exclude_modules": "visual("}, "lora.exclude_modules: not a regular expression"),
])
def test_bad_lora_values_are_named(fields, message):
    from rollplex.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        LoRAConfig(**fields)


@pytest.mark.parametrize("args, message", [
    (["--lora.rank", "8", "--schedule.kind", "disagg", "--schedule.rollout_ranks", "1"], "disagg"),
    (["--lora.rank", "8", "--lora.train_vision", "--parallel.freeze_vision"], "both set"),
])
def test_lora_settings_that_contradict_others_are_named(args, message):
    from rollplex.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_config(args)


def lora_run(rank, world, out, *extra):
    RLTrainer(load_config(FAST + ["--trainer.output_dir", out, "--trainer.num_threads", "1", *extra])).fit()


@pytest.mark.parametrize("layout, both", [(["--rollout.tp", "2"], []),
                                          (["--schedule.kind", "overlap"], ["--algorithm.kl_coef", "0.1"]),
                                          (["--parallel.tp", "2", "--rollout.tp", "2"], [])])
def test_two_ranks_sample_and_train_what_one_rank_does(tmp_path, layout, both):
    """Two ranks as dp_shard=2 with one engine over both (rollout.tp 2: its adapters rebuilt on its own TP
    layout, the base's engine shards views of the base), as dp_shard=2 with the overlap schedule's prompt
    work and the base as the reference, or as parallel.tp=2 (the base and the adapters split; the engine
    reads the base in place): the same samples and step-1 loss as one serial process."""
    lora_run(0, 1, str(tmp_path / "one"), *both)
    run_distributed(lora_run, 2, str(tmp_path / "two"), *layout, *both)
    single = read_metrics(tmp_path / "one" / "metrics.jsonl")
    double = read_metrics(tmp_path / "two" / "metrics.jsonl")
    assert abs(double[0]["actor/pg_loss"] - single[0]["actor/pg_loss"]) < 1e-5
    for key in ("critic/score/mean", "response_length/mean"):
        assert [r.get(key) for r in double] == [r.get(key) for r in single], key
    if layout == ["--rollout.tp", "2"]:
        assert double[0]["weights/bytes_viewed"] > 0 and double[0]["weights/bytes_rebuilt"] > 0


@pytest.mark.parametrize("schedule", [["--schedule.kind", "serial"], ["--schedule.kind", "overlap"],
                                      ["--schedule.kind", "overlap", "--schedule.stream_groups", "true"]])
def test_the_reference_model_is_the_base_on_the_same_tensors(tmp_path, schedule):
    """kl_coef > 0: the reference model reads the trainer's frozen base parameters themselves (no
    second copy); the KL is zero while the adapters are, and grows once they have trained."""
    trainer = RLTrainer(load_config(FAST + ["--trainer.output_dir", str(tmp_path), "--algorithm.kl_coef", "0.1",
                                            "--algorithm.updates_per_batch", "1", *schedule]))
    actor = {n.replace("._checkpoint_wrapped_module", ""): p for n, p in trainer.model.named_parameters()}
    ref = dict(trainer.ref_model.named_parameters())
    assert set(ref) == {n for n in actor if not is_adapter(n)}
    assert all(p is actor[n] for n, p in ref.items())
    trainer.fit()
    kl = [r["actor/kl_loss"] for r in read_metrics(tmp_path / "metrics.jsonl") if "actor/kl_loss" in r]
    assert abs(kl[0]) < 1e-7 and kl[1] > 1e-6, kl


def test_a_frozen_vision_tower_gets_no_adapters(tmp_path):
    """parallel.freeze_vision keeps the tower free of adapters even where lora.exclude_modules lets
    the targets reach it (the tiny preset's "")."""
    trainer = RLTrainer(load_config(FAST + ["--trainer.output_dir", str(tmp_path), "--parallel.freeze_vision"]))
    adapters = [n for n, _ in trainer.model.named_parameters() if is_adapter(n)]
    assert adapters and not any(n.startswith("visual.") for n in adapters)
    assert not any(p.requires_grad for n, p in trainer.model.named_parameters() if n.startswith("visual."))
    assert trainer.memory.options.freeze_vision
    engine = {n for n, _ in trainer.weights.engine_model.named_parameters() if is_adapter(n)}
    assert engine == {n.replace("._checkpoint_wrapped_module", "") for n in adapters}  # the engine mirrors them
    trainer.fit()


def test_save_hf_writes_the_adapters_as_a_peft_folder(tmp_path):
    from safetensors import safe_open

    RLTrainer(load_config(FAST + ["--trainer.output_dir", str(tmp_path), "--trainer.save_hf", "true"])).fit()
    config = json.loads((tmp_path / "hf" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 8, 128.0)
    with safe_open(tmp_path / "hf" / "adapter_model.safetensors", "pt") as f:
        keys = list(f.keys())
    assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys)
