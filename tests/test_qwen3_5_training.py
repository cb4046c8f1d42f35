"""The RL loop on a tiny Qwen3.5 (model.tiny.family qwen3_5) with video prompts and the
vision tower training: every schedule makes the same updates (the shared-prefix pass
and the kept-prompt passes carry each prompt's Gated DeltaNet state into its
responses, and their backward reaches the DeltaNet parameters and the tower through
it), two ranks equal one, and the run exports a folder transformers loads."""

from test_qwen3_vl_training import (check_schedules_train_the_same, check_the_run_exports_a_folder_transformers_loads,
                                    check_two_ranks_equal_one)
from test_schedules import SCHEDULES

QWEN3_5_VIDEO = ["--model.tiny.family", "qwen3_5", "--data.task", "direction"]


def test_schedules_train_the_same(tmp_path):
    check_schedules_train_the_same(tmp_path, QWEN3_5_VIDEO, (
        ".linear_attn.A_log", ".linear_attn.conv1d", ".linear_attn.in_proj_", ".self_attn.q_proj", "visual.blocks.0.",
        "visual.merger."))


def test_two_ranks_equal_one(tmp_path):
    """dp_shard 2 with one engine over both ranks (its DeltaNet layers split by key heads), tensor parallelism 2
    in the trainer too, and a rollout rank beside a training rank (the engine's state pool on a rank of its own)."""
    check_two_ranks_equal_one(tmp_path, QWEN3_5_VIDEO, {
        "dp2": SCHEDULES["overlap"] + ["--rollout.tp", "2"], "tp2": SCHEDULES["overlap"] + ["--parallel.tp", "2"],
        "disagg": ["--schedule.kind", "disagg", "--schedule.rollout_ranks", "1", "--schedule.share_prefix", "false"]})


def test_the_run_exports_a_folder_transformers_loads(tmp_path):
    """The DeltaNet's q, k and v projections and convolutions go out fused, as the hub's in_proj_qkv and conv1d."""
    check_the_run_exports_a_folder_transformers_loads(tmp_path, QWEN3_5_VIDEO, "qwen3_5")
