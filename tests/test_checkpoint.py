"""Training checkpoints: resuming is exact (1 and 2 ranks), a 2-rank checkpoint
loads into 1 process, half-written and damaged saves are never picked, a failed
save raises on every rank and leaves the earlier ones, and the HF export loads
in transformers.

transformers (also pulled in by test_model) is imported inside the tests that
need it: the spawned ranks import this module, and would otherwise spend most
of their time importing it.
"""

import contextlib
import errno
import random
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from distributed import run_distributed
from rollplex.models import Prompt, build_model, from_pretrained, pack_sequences
from rollplex.models.qwen2_5_vl import ModelArgs
from rollplex.dist import ParallelDims, build_mesh
from rollplex.tiny import make_tiny_checkpoint
from rollplex.train.checkpoint import (MARKER, CheckpointSaveError, export_hf, latest_checkpoint, load_checkpoint,
                                       save_checkpoint)
from rollplex.train.parallelize import parallelize

# Text only, so the vision tower gets no gradients and no optimizer state: the
# checkpoint must also restore "no state yet" for those parameters.
TOKENS = torch.tensor([1, 5, 7, 9, 11, 3, 2, 8, 4, 6])


@pytest.fixture
def args() -> ModelArgs:
    from test_model import tiny_args

    return tiny_args()


def make_trainer(args: ModelArgs, seed: int, parallel: bool = False):
    model = build_model(args, seed=seed, init_std=None)
    if parallel:
        model = parallelize(model, build_mesh(ParallelDims.resolve(2, -1, 1), "cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    return model, optimizer, scheduler


def train_step(model, optimizer, scheduler) -> float:
    """One next-token cross-entropy step on TOKENS; returns the loss."""
    logits = model.logits(model.forward_packed(pack_sequences(model.args, [Prompt(TOKENS)])))
    loss = torch.nn.functional.cross_entropy(logits[:-1], TOKENS[1:])
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return loss.item()


def full_params(model) -> dict[str, torch.Tensor]:
    """Parameters gathered to full tensors (FSDP2 holds DTensor shards). Collective."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def full_optimizer_state(model, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """Optimizer state by parameter name, gathered to full tensors. Collective."""
    state = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))["state"]
    return {fqn: {k: v.clone() for k, v in s.items()} for fqn, s in state.items()}  # "step" is the live tensor


def random_draws() -> tuple:
    return random.random(), np.random.rand(), torch.rand(3).tolist()


def assert_all_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name, value in actual.items():
        if isinstance(value, dict):
            assert_all_equal(value, expected[name])
        else:
            assert torch.equal(value, expected[name]), name


def test_resume_is_exact(tmp_path, args):
    model, optimizer, scheduler = make_trainer(args, seed=0)
    for _ in range(2):
        train_step(model, optimizer, scheduler)
    path = save_checkpoint(tmp_path, 2, model, optimizer, scheduler, extra={"sample": 20})
    draws = random_draws()
    loss = train_step(model, optimizer, scheduler)
    assert len(optimizer.state) < len(list(model.parameters()))  # the vision tower has no state

    # A differently initialised model and a scrambled RNG: the load must restore both.
    model2, optimizer2, scheduler2 = make_trainer(args, seed=1)
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    assert latest_checkpoint(tmp_path) == path and (path / MARKER).is_file()
    state = load_checkpoint(path, model2, optimizer2, scheduler2)
    assert (state.step, state.extra) == (2, {"sample": 20})
    assert random_draws() == draws
    assert train_step(model2, optimizer2, scheduler2) == loss
    assert scheduler2.get_last_lr() == scheduler.get_last_lr()
    assert_all_equal(full_params(model2), full_params(model))
    assert_all_equal(optimizer2.state_dict()["state"], optimizer.state_dict()["state"])


def test_half_written_checkpoints_are_ignored_and_old_ones_pruned(tmp_path, args):
    model, optimizer, scheduler = make_trainer(args, seed=0)
    train_step(model, optimizer, scheduler)
    for step in (1, 2):
        save_checkpoint(tmp_path, step, model, optimizer, keep_last=2)
    (tmp_path / ".tmp-step_00000003").mkdir()  # a save that crashed
    (tmp_path / "step_00000004").mkdir()  # a folder without the marker
    with pytest.warns(UserWarning) as warned:
        assert latest_checkpoint(tmp_path) == tmp_path / "step_00000002"
    messages = " ".join(str(w.message) for w in warned)
    assert ".tmp-step_00000003" in messages and "step_00000004 " in messages

    save_checkpoint(tmp_path, 5, model, optimizer, keep_last=2)
    # Step 1 is beyond keep_last and the crashed save of step 3 can never finish;
    # the unmarked folder is not ours to delete.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002", "step_00000004", "step_00000005"]
    save_checkpoint(tmp_path, 6, model, optimizer, keep_last=0)
    assert len(list(tmp_path.iterdir())) == 4


def test_a_damaged_checkpoint_is_passed_over_for_the_newest_complete_one(tmp_path, args):
    model, optimizer, scheduler = make_trainer(args, seed=0)
    train_step(model, optimizer, scheduler)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model, optimizer, keep_last=0)
    shard = next((tmp_path / "step_00000003").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])  # truncated, say by a full disk or a copy cut short
    (tmp_path / "step_00000002" / MARKER).write_text('{"step": 2')  # the marker itself cut short
    with pytest.warns(UserWarning) as warned:
        assert latest_checkpoint(tmp_path) == tmp_path / "step_00000001"
    messages = " ".join(str(w.message) for w in warned)
    assert f"{shard.name} has" in messages and "step_00000002" in messages
    with pytest.raises(ValueError, match=f"step_00000003 is damaged: {shard.name} has"):
        load_checkpoint(tmp_path / "step_00000003", *make_trainer(args, seed=1)[:2])

    # Pruning counts complete checkpoints only: step 1 stays beside the new step 4,
    # and the damaged ones are left for a person to look at.
    save_checkpoint(tmp_path, 4, model, optimizer, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step_0000000{i}" for i in (1, 2, 3, 4)]


def disk_full():
    return mock.patch("torch.save", side_effect=OSError(errno.ENOSPC, "No space left on device"))


def test_a_failed_save_raises_and_leaves_the_earlier_checkpoints(tmp_path, args):
    model, optimizer, scheduler = make_trainer(args, seed=0)
    train_step(model, optimizer, scheduler)
    save_checkpoint(tmp_path, 1, model, optimizer, keep_last=1)
    with disk_full(), pytest.raises(CheckpointSaveError, match="step 2 .*No space left on device.*step_00000001"):
        save_checkpoint(tmp_path, 2, model, optimizer, keep_last=1)
    # The half-written folder, never published, is gone: a full disk is not kept full by it.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000001"
    assert load_checkpoint(tmp_path / "step_00000001", *make_trainer(args, seed=1)[:2]).step == 1


def test_saving_before_the_first_step_keeps_the_optimizer_stateless(tmp_path, args):
    model, optimizer, scheduler = make_trainer(args, seed=0)
    path = save_checkpoint(tmp_path, 0, model, optimizer, scheduler)
    assert not optimizer.state
    model2, optimizer2, scheduler2 = make_trainer(args, seed=1)
    load_checkpoint(path, model2, optimizer2, scheduler2)
    assert not optimizer2.state
    assert train_step(model2, optimizer2, scheduler2) == train_step(model, optimizer, scheduler)
    assert_all_equal(optimizer2.state_dict()["state"], optimizer.state_dict()["state"])


def resume_on_two_ranks(rank: int, world: int, args: ModelArgs, root: str, out: str) -> None:
    torch.set_num_threads(1)
    model, optimizer, scheduler = make_trainer(args, seed=0, parallel=True)
    for _ in range(2):
        train_step(model, optimizer, scheduler)
    path = save_checkpoint(root, 2, model, optimizer, scheduler)
    saved = {"params": full_params(model), "optimizer": full_optimizer_state(model, optimizer)}
    loss = train_step(model, optimizer, scheduler)

    model2, optimizer2, scheduler2 = make_trainer(args, seed=1, parallel=True)
    load_checkpoint(path, model2, optimizer2, scheduler2)
    resumed_loss = train_step(model2, optimizer2, scheduler2)
    expected, resumed = full_params(model), full_params(model2)  # collectives: every rank gathers
    export_hf(model2, f"{root}/hf", source_dir=None)
    # A save that fails on one rank only, after DCP's collective write succeeded (its RNG file), raises on
    # both: rank 0 neither publishes the checkpoint without rank 1's file nor waits for rank 1 in a collective.
    rng_file_fails = mock.patch("rollplex.train.checkpoint._rng_state",
                                side_effect=OSError(errno.ENOSPC, "No space left on device"))
    with rng_file_fails if rank == 1 else contextlib.nullcontext(), \
            pytest.raises(CheckpointSaveError, match="step 3 .*(on another rank|No space left)"):
        save_checkpoint(root, 3, model2, optimizer2, scheduler2)
    if rank == 0:
        torch.save({"loss": loss, "resumed_loss": resumed_loss, "expected": expected, "resumed": resumed,
                    "saved": saved, "complete": sorted(p.name for p in Path(root).glob("step_*"))}, out)


def test_resume_on_two_fsdp_ranks_and_load_on_one(tmp_path, args):
    out = tmp_path / "result.pt"
    run_distributed(resume_on_two_ranks, 2, args, str(tmp_path / "ckpt"), str(out))
    result = torch.load(out)
    assert result["resumed_loss"] == result["loss"]
    assert result["complete"] == ["step_00000002"]
    assert_all_equal(result["resumed"], result["expected"])
    assert_all_equal(full_params(from_pretrained(tmp_path / "ckpt" / "hf", dtype=torch.float32)), result["resumed"])

    # World size 2 -> 1: DCP reshards into a plain model. Compared at the save,
    # since FSDP and single-process arithmetic may differ in the last bits.
    model, optimizer, scheduler = make_trainer(args, seed=1)
    load_checkpoint(tmp_path / "ckpt" / "step_00000002", model, optimizer, scheduler)
    assert_all_equal(full_params(model), result["saved"]["params"])
    assert_all_equal(full_optimizer_state(model, optimizer), result["saved"]["optimizer"])


def test_export_tool_writes_a_runs_checkpoint_that_transformers_loads(tmp_path):
    """python tools/export_hf.py RUN_DIR --out DIR: the run's checkpointed weights, not those it started from."""
    import importlib.util

    from transformers import Qwen2_5_VLForConditionalGeneration

    from rollplex.config import Config, save_config

    source = make_tiny_checkpoint(tmp_path / "source")
    model = from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():  # weights that differ from the source's
        model.language_model.norm.weight.mul_(1.5)
    run = tmp_path / "run"
    cfg = Config()
    cfg.model.path = str(source)
    run.mkdir()
    save_config(cfg, run / "config.yaml")
    save_checkpoint(run / "checkpoints", 3, model, torch.optim.AdamW(model.parameters()))

    spec = importlib.util.spec_from_file_location("export_hf_tool", Path(__file__).parent.parent / "tools/export_hf.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    with pytest.raises(FileNotFoundError, match="step_00000002 is not a complete checkpoint"):
        tool.main([str(run), "--step", "2", "--out", str(tmp_path / "none")])
    out = tool.main([str(run), "--out", str(tmp_path / "export"), "--dtype", "float32"])

    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json",
                 "generation_config.json"):
        assert (out / name).is_file(), name
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([[13, 20, 25, 30, 33, 40, 41]])  # words of the tiny vocabulary, no special tokens
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    assert (model.hf_forward(ids) - ref).abs().max() <= 1e-5
    assert torch.equal(from_pretrained(out, dtype=torch.float32).hf_forward(ids), model.hf_forward(ids))
