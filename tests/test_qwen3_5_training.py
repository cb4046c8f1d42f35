"""The RL loop on a tiny Qwen3.5 (model.tiny.family qwen3_5) with video prompts and the
vision tower training: every schedule makes the same updates (the shared-prefix pass
and the kept-prompt passes carry each prompt's Gated DeltaNet state into its
responses, and their backward reaches the DeltaNet parameters and the tower through
it), two ranks equal one, and the run exports a folder transformers loads."""

from test_qwen3_vl_training import (check_a_resumed_run_logs_what_an_uninterrupted_one_does,
                                    check_schedules_train_the_same, check_the_run_exports_a_folder_transformers_loads,
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


def test_lora_with_activation_checkpointing_resumes_as_an_uninterrupted_run(tmp_path):
    """Adapters on every Linear (the DeltaNet's in_proj_q/k/v/z/b/a and out_proj too), the decoder layers
    recomputed in the backward (the kept prompt's DeltaNet states kept from the forward), overlap's kept-prefix
    passes: a run cut after step 2 resumes from its checkpoint to the uninterrupted run's adapters."""
    from rollplex.train.lora import LoRALinear

    trainer = check_a_resumed_run_logs_what_an_uninterrupted_one_does(tmp_path, [
        *QWEN3_5_VIDEO, *SCHEDULES["overlap"], "--lora.rank", "4", "--lora.alpha", "32",
        "--parallel.activation_checkpointing", "true"])
    adapted = {name.split(".")[-1] for name, m in trainer.model.named_modules() if isinstance(m, LoRALinear)}
    assert {"in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z", "out_proj", "q_proj", "o_proj"} <= adapted
