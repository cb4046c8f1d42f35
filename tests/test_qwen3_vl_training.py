"""The RL loop on a tiny Qwen3-VL (model.tiny.family qwen3_vl) with video prompts and
the vision tower training: every schedule makes the same updates (the kept-prompt
passes carry DeepStack's additions, and their backward reaches the tower and the
DeepStack mergers), and two ranks equal one."""

from pathlib import Path

import torch

from distributed import run_distributed
from rollplex.metrics import read_metrics
from rollplex.models import from_pretrained
from rollplex.rl.loop import RLTrainer
from test_schedules import SCHEDULES, check_same_training, max_difference, train
from test_stream import STREAM, check_same_training as check_same_streamed

QWEN3_VIDEO = ["--model.tiny.family", "qwen3_vl", "--data.task", "direction"]


def check_schedules_train_the_same(tmp_path: Path, family_args: list[str], trained_parts: tuple[str, ...]) -> None:
    """Every schedule, streamed groups included, makes the same updates on the family's tiny model
    (`family_args`), and a parameter named *part* moves for each of `trained_parts`."""
    runs = {}
    for name, extra in {**SCHEDULES, "stream": STREAM}.items():
        trainer, params = train(tmp_path / name, *family_args, *extra)
        runs[name] = params, read_metrics(tmp_path / name / "metrics.jsonl")
    streamed = runs.pop("stream")[0]
    check_same_training(runs)
    check_same_streamed(tmp_path, runs["serial-prefix"][0], streamed, reference_name="serial-prefix")
    initial = dict(from_pretrained(tmp_path / "overlap" / "tiny_model", dtype=torch.float32).named_parameters())
    trained = runs["overlap"][0]
    for part in trained_parts:
        moved = [n for n in trained if part in n and not torch.equal(trained[n], initial[n])]
        assert moved, f"no parameter named *{part}* was updated"


def test_schedules_train_the_same(tmp_path):
    check_schedules_train_the_same(tmp_path, QWEN3_VIDEO, ("visual.deepstack_merger_list.0.", "visual.blocks.0.",
                                                           "visual.merger."))


def runs_on_two_ranks(rank: int, world: int, out: str, family_args: list[str], runs: dict[str, list[str]]) -> None:
    torch.set_num_threads(1)
    for name, extra in runs.items():
        _, params = train(Path(out) / name, *family_args, *extra)
        if rank == 0:
            torch.save(params, Path(out) / f"{name}.pt")


def check_two_ranks_equal_one(tmp_path: Path, family_args: list[str], runs: dict[str, list[str]]) -> None:
    """Each of `runs` on 2 gloo ranks gives one process's overlap run: the same scores, parameters within 2e-5."""
    _, single = train(tmp_path / "one", *family_args, *SCHEDULES["overlap"])
    run_distributed(runs_on_two_ranks, 2, str(tmp_path), family_args, runs)
    reference = read_metrics(tmp_path / "one" / "metrics.jsonl")
    for name in runs:
        rows = read_metrics(tmp_path / name / "metrics.jsonl")
        assert [r["critic/score/mean"] for r in rows] == [r["critic/score/mean"] for r in reference], name
        assert max_difference(torch.load(tmp_path / f"{name}.pt"), single) <= 2e-5, name


def test_two_ranks_equal_one(tmp_path):
    """dp_shard 2 with one engine over both ranks (views of the gathered weights), and tensor parallelism 2 in
    the trainer too (Qwen3's per-head q/k norms are replicated weights whose gradients sum over the tp ranks)."""
    check_two_ranks_equal_one(tmp_path, QWEN3_VIDEO, {"dp2": SCHEDULES["overlap"] + ["--rollout.tp", "2"],
                                                      "tp2": SCHEDULES["overlap"] + ["--parallel.tp", "2"]})


def check_the_run_exports_a_folder_transformers_loads(tmp_path: Path, family_args: list[str], family: str) -> None:
    """trainer.save_hf writes the trained weights as a Hugging Face folder of `family`: transformers
    loads it, with the trained parameters under its keys and its logits equal to the trainer's."""
    from rollplex.dist import full_tensor
    from rollplex.models import family_named
    from rollplex.models.packing import pack_sequences

    trainer, _ = train(tmp_path / "run", *family_args, "--trainer.total_steps", "1", "--trainer.save_hf", "true",
                       "--trainer.lr", "0.05")
    hf = family_named(family).transformers_class().from_pretrained(tmp_path / "run" / "hf",
                                                                   dtype=torch.float32).eval()
    final = {name: full_tensor(t) for name, t in trainer.model.state_dict().items()}
    for key, tensor in hf.state_dict().items():
        names = family_named(family).hf_key_to_params(key)
        assert torch.equal(tensor, torch.cat([final[n] for n in names])), key
    prompt = next(trainer._batches(0))[0].prompt
    ids = prompt.input_ids[None]
    args = trainer.model.args
    mm = (ids == args.image_token_id).long() + 2 * (ids == args.video_token_id).long()
    with torch.no_grad():
        theirs = hf(input_ids=ids, mm_token_type_ids=mm, pixel_values_videos=prompt.pixel_values_videos,
                    video_grid_thw=prompt.video_grid_thw).logits[0]
        batch = pack_sequences(args, [prompt])
        ours = trainer.model.logits(trainer.model.forward_packed(batch))
    assert (ours - theirs).abs().max() <= 1e-4


def test_the_run_exports_a_folder_transformers_loads(tmp_path):
    check_the_run_exports_a_folder_transformers_loads(tmp_path, QWEN3_VIDEO, "qwen3_vl")


def check_a_resumed_run_logs_what_an_uninterrupted_one_does(tmp_path: Path, run_args: list[str]) -> RLTrainer:
    """A run of `run_args` cut after step 2 and resumed from its checkpoint ends as the uninterrupted run
    (returned: the resumed run's trainer)."""
    _, whole = train(tmp_path / "whole", *run_args)
    train(tmp_path / "cut", *run_args, "--trainer.total_steps", "2", "--trainer.save_every", "1")
    trainer, resumed = train(tmp_path / "cut", *run_args, "--trainer.save_every", "1")
    assert max_difference(resumed, whole) == 0.0
    rows = read_metrics(tmp_path / "cut" / "metrics.jsonl")
    reference = read_metrics(tmp_path / "whole" / "metrics.jsonl")
    assert [r["critic/score/mean"] for r in rows] == [r["critic/score/mean"] for r in reference]
    return trainer


def test_a_resumed_run_logs_what_an_uninterrupted_one_does(tmp_path):
    check_a_resumed_run_logs_what_an_uninterrupted_one_does(tmp_path, QWEN3_VIDEO)
