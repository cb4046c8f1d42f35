"""Safe output folders: a run started in a folder that holds another run resumes it only when nothing that changes
the run differs (trainer.resume auto), starts fresh only in an empty one (never), or takes the checkpoint it is
given (a path); the tiny model follows model.tiny; a finished run says so."""

import shutil

import pytest

from rollplex.config import load_config, load_config_file
from rollplex.rl.loop import RLTrainer
from rollplex.rl.setup import ResumeRefused
from rollplex.train.checkpoint import latest_checkpoint
from test_rl_loop import FAST, run


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A 2-step run with a checkpoint after each step."""
    out = tmp_path_factory.mktemp("finished")
    run(out, "--trainer.save_every", "1")
    return out


@pytest.fixture
def old_run(finished_run, tmp_path):
    shutil.copytree(finished_run, tmp_path / "run")
    return tmp_path / "run"


def trainer(out, *extra):
    return RLTrainer(load_config(FAST + ["--trainer.output_dir", str(out), "--trainer.save_every", "1", *extra]))


def test_another_config_is_refused_with_the_differing_keys(old_run):
    with pytest.raises(ResumeRefused) as refused:
        trainer(old_run, "--trainer.total_steps", "3", "--rollout.temperature", "0.5", "--data.batch_size", "8")
    message = str(refused.value)
    assert "rollout.temperature: 1.0 -> 0.5" in message and "data.batch_size: 4 -> 8" in message
    assert "total_steps" not in message  # a longer run is the same run
    assert "trainer.output_dir" in message and "trainer.resume" in message  # the ways on
    assert load_config_file(old_run / "config.yaml").rollout.temperature == 1.0  # the saved config is kept


def test_the_same_run_resumes_with_other_length_and_reporting(old_run, capsys):
    resumed, rows = run(old_run, "--trainer.save_every", "2", "--trainer.total_steps", "3", "--trainer.eval_every",
                        "0", "--logging.log_every", "3")
    assert "resumed from" in capsys.readouterr().out
    assert resumed.step == 3 and [r["step"] for r in rows if "actor/pg_loss" in r] == [1, 2, 3]


def test_an_explicit_checkpoint_accepts_the_new_config(old_run, capsys):
    checkpoint = old_run / "checkpoints" / "step_00000001"
    trainer(old_run, "--trainer.total_steps", "2", "--rollout.temperature", "0.5",
            "--trainer.resume", str(checkpoint)).fit()
    assert f"resumed from {checkpoint} at step 1" in capsys.readouterr().out
    assert load_config_file(old_run / "config.yaml").rollout.temperature == 0.5  # written once accepted


def test_never_refuses_a_folder_with_checkpoints_and_deletes_nothing(old_run):
    before = sorted(p.name for p in (old_run / "checkpoints").iterdir())
    with pytest.raises(ResumeRefused, match="step_00000001, step_00000002.*trainer.resume auto"):
        trainer(old_run, "--trainer.resume", "never")
    assert sorted(p.name for p in (old_run / "checkpoints").iterdir()) == before


def test_a_new_tiny_spec_rebuilds_the_model_of_a_run_without_checkpoints(tmp_path):
    run(tmp_path)  # save_every 0: only the tiny model and the logs
    wider = trainer(tmp_path, "--trainer.save_every", "0", "--model.tiny.hidden_size", "128")
    assert wider.model.args.text.hidden_size == 128


def test_a_new_tiny_spec_is_refused_for_a_run_with_checkpoints(old_run):
    with pytest.raises(ResumeRefused, match="model.tiny.hidden_size: 64 -> 128"):
        trainer(old_run, "--trainer.total_steps", "3", "--model.tiny.hidden_size", "128",
                "--trainer.resume", str(old_run / "checkpoints" / "step_00000002"))


def test_a_finished_run_says_so(old_run, capsys):
    again = trainer(old_run)
    again.fit()
    assert f"run already complete at step 2 in {old_run}" in capsys.readouterr().out
    assert not hasattr(again, "model")  # nothing was built for it


def refused_on_every_rank(rank, world, out):
    with pytest.raises(ResumeRefused, match="trainer.resume is never"):
        RLTrainer(load_config(FAST + ["--trainer.output_dir", out, "--trainer.num_threads", "1",
                                      "--trainer.resume", "never"]))


def test_every_rank_gets_rank_zeros_refusal(old_run):
    """Rank 0 reads the folder; its refusal reaches rank 1 too, which would otherwise wait for it."""
    from distributed import run_distributed

    run_distributed(refused_on_every_rank, 2, str(old_run))


def test_a_minimal_config_file_leaves_the_final_weights_in_a_checkpoint(tmp_path):
    """A file naming only what it changes gets a checkpoint at the last step (trainer.save_every's default
    saves every 50 steps and at the end): the run's final weights, which a rerun takes as complete."""
    out = tmp_path / "run"
    config = tmp_path / "mine.yaml"
    config.write_text(f"data:\n  batch_size: 4\n  val_size: 0\nrollout:\n  n: 2\n  max_tokens: 2\n"  # 4: one per update
                      f"trainer:\n  output_dir: {out}\n  total_steps: 2\n  eval_every: 0\nlogging:\n  console: false\n")
    RLTrainer(load_config(["--config", str(config)])).fit()
    assert latest_checkpoint(out / "checkpoints") == out / "checkpoints" / "step_00000002"
    assert RLTrainer(load_config(["--config", str(config)])).complete
