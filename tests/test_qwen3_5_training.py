"""The RL loop on a tiny Qwen3.5 (model.tiny.family qwen3_5) with video prompts and the
vision tower training: every schedule makes the same updates (the shared-prefix pass
and the kept-prompt passes carry each prompt's Gated DeltaNet state into its
responses, and their backward reaches the DeltaNet parameters and the tower through
it), two ranks equal one, and the run exports a folder transformers loads."""

from pathlib import Path

import torch

from distributed import run_distributed
from rollplex.metrics import read_metrics
from rollplex.models import from_pretrained
from test_schedules import SCHEDULES, check_same_training, max_difference, train
from test_stream import STREAM, check_same_training as check_same_streamed

QWEN3_5_VIDEO = ["--model.tiny.family", "qwen3_5", "--data.task", "direction"]


def test_schedules_train_the_same(tmp_path):
    runs = {}
    for name, extra in {**SCHEDULES, "stream": STREAM}.items():
        trainer, params = train(tmp_path / name, *QWEN3_5_VIDEO, *extra)
        runs[name] = params, read_metrics(tmp_path / name / "metrics.jsonl")
    streamed = runs.pop("stream")[0]
    check_same_training(runs)
    check_same_streamed(tmp_path, runs["serial-prefix"][0], streamed, reference_name="serial-prefix")
    initial = dict(from_pretrained(tmp_path / "overlap" / "tiny_model", dtype=torch.float32).named_parameters())
    trained = runs["overlap"][0]
    for part in (".linear_attn.A_log", ".linear_attn.conv1d", ".linear_attn.in_proj_", ".self_attn.q_proj",
                 "visual.blocks.0.", "visual.merger."):
        moved = [n for n in trained if part in n and not torch.equal(trained[n], initial[n])]
        assert moved, f"no parameter named *{part}* was updated"


def two_ranks(rank: int, world: int, out: str) -> None:
    torch.set_num_threads(1)
    for name, extra in RUNS.items():
        _, params = train(Path(out) / name, *QWEN3_5_VIDEO, *extra)
        if rank == 0:
            torch.save(params, Path(out) / f"{name}.pt")


# dp_shard 2 with one engine over both ranks (its DeltaNet layers split by key heads), tensor parallelism 2 in the
# trainer too, and a rollout rank beside a training rank (the engine's state pool on a rank of its own).
RUNS = {"dp2": SCHEDULES["overlap"] + ["--rollout.tp", "2"], "tp2": SCHEDULES["overlap"] + ["--parallel.tp", "2"],
        "disagg": ["--schedule.kind", "disagg", "--schedule.rollout_ranks", "1", "--schedule.share_prefix", "false"]}


def test_two_ranks_equal_one(tmp_path):
    _, single = train(tmp_path / "one", *QWEN3_5_VIDEO, *SCHEDULES["overlap"])
    run_distributed(two_ranks, 2, str(tmp_path))
    reference = read_metrics(tmp_path / "one" / "metrics.jsonl")
    for name in RUNS:
        rows = read_metrics(tmp_path / name / "metrics.jsonl")
        assert [r["critic/score/mean"] for r in rows] == [r["critic/score/mean"] for r in reference], name
        assert max_difference(torch.load(tmp_path / f"{name}.pt"), single) <= 2e-5, name


def test_the_run_exports_a_folder_transformers_loads(tmp_path):
    """trainer.save_hf writes the trained weights as a Hugging Face Qwen3.5 folder: transformers
    loads it, and its logits equal the trainer's."""
    from transformers import Qwen3_5ForConditionalGeneration

    from rollplex.models.packing import pack_sequences

    trainer, _ = train(tmp_path / "run", *QWEN3_5_VIDEO, "--trainer.total_steps", "1", "--trainer.save_hf", "true",
                       "--trainer.lr", "0.05")
    hf = Qwen3_5ForConditionalGeneration.from_pretrained(tmp_path / "run" / "hf", dtype=torch.float32).eval()
    prompt = next(trainer._batches(0))[0].prompt
    ids = prompt.input_ids[None]
    args = trainer.model.args
    mm = (ids == args.image_token_id).long() + 2 * (ids == args.video_token_id).long()
    with torch.no_grad():
        theirs = hf(input_ids=ids, mm_token_type_ids=mm, pixel_values_videos=prompt.pixel_values_videos,
                    video_grid_thw=prompt.video_grid_thw).logits[0]
        ours = trainer.model.logits(trainer.model.forward_packed(pack_sequences(args, [prompt])))
    assert (ours - theirs).abs().max() <= 1e-4
