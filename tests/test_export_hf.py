"""Hugging Face export of a sharded model: on 2 ranks (FSDP, and TP), each rank
writes its own shards and none gathers the model, and transformers loads the
folder with the weights the ranks hold. `trainer.save_hf` writes one at the
end of a tiny run, and tools/export_hf.py one from a run's checkpoint.

transformers and the RL loop are imported inside the tests: the spawned ranks
import this module.
"""

import json
from pathlib import Path
from unittest import mock

import torch
from torch.distributed.tensor import DTensor

from distributed import run_distributed
from rollplex.dist import ParallelDims, build_mesh, full_tensor
from rollplex.models import from_pretrained
from rollplex.models.qwen2_5_vl.hf import SPLIT_QKV, hf_key_to_params
from rollplex.tiny import make_tiny_checkpoint
from rollplex.train.checkpoint import export_hf
from rollplex.train.parallelize import parallelize

REWARD = Path(__file__).with_name("length_reward.py")  # scores that differ within a group: the weights move
LAYOUTS = {"fsdp": (2, 1), "tp": (1, 2)}  # name: (dp_shard, tp)
ASSETS = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json",
          "generation_config.json")


def export_sharded(rank: int, world: int, source: str, root: str) -> None:
    torch.set_num_threads(1)
    for layout, (dp_shard, tp) in LAYOUTS.items():
        model = from_pretrained(source, dtype=torch.float32)
        with torch.no_grad():  # weights of its own, alike on both ranks
            torch.manual_seed(0)
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p))
        parallelize(model, build_mesh(ParallelDims.resolve(world, dp_shard, tp), "cpu"), activation_checkpointing=True)
        with mock.patch.object(DTensor, "full_tensor", autospec=True, side_effect=DTensor.full_tensor) as gathers:
            # Small files, so that the weights span several.
            export_hf(model, f"{root}/{layout}", source, torch.float32, max_file_bytes=64 << 10)
        # Only the parts of each vision block's fused qkv (weight and bias) are gathered.
        fused_parts = [name for name in model.state_dict() if any(part in name for part in SPLIT_QKV)]
        assert gathers.call_count == len(fused_parts) == 6 * len(model.visual.blocks), gathers.call_count
        held = {name: full_tensor(p) for name, p in model.state_dict().items()}
        if rank == 0:
            torch.save(held, f"{root}/{layout}.pt")


def test_each_rank_writes_its_shards_and_transformers_loads_the_weights(tmp_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    source = make_tiny_checkpoint(tmp_path / "source")
    run_distributed(export_sharded, 2, str(source), str(tmp_path))
    for layout in LAYOUTS:
        out, held = tmp_path / layout, torch.load(tmp_path / f"{layout}.pt")
        weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(set(weight_map.values()))
        assert len(set(weight_map.values())) > 1 and not (out / "sharded").exists()
        for name in ASSETS:
            assert (out / name).is_file(), name
        hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(out)
        assert hf.dtype == torch.float32  # config.json names the dtype written
        covered = set()
        for key, tensor in hf.state_dict().items():
            names = hf_key_to_params(key)
            assert torch.equal(tensor, torch.cat([held[n] for n in names])), (layout, key)
            covered.update(names)
        assert covered == set(held), layout


def test_save_hf_writes_the_final_weights_at_the_end_of_a_run(tmp_path, capsys):
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    from rollplex.config import load_config
    from rollplex.rl.loop import RLTrainer

    out = tmp_path / "run"
    trainer = RLTrainer(load_config([
        "--trainer.total_steps", "1", "--data.batch_size", "2", "--rollout.n", "2", "--rollout.max_tokens", "4",
        "--data.val_size", "0", "--trainer.save_every", "0", "--trainer.lr", "0.05",
        "--trainer.output_dir", str(out), "--trainer.save_hf", "true", "--model.dtype", "bfloat16",
        "--data.reward", f"{REWARD}:reward"]))
    trainer.fit()
    assert f"step 1: wrote the Hugging Face model {out / 'hf'} (" in capsys.readouterr().out
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(out / "hf")
    assert hf.dtype == torch.bfloat16
    final = {name: full_tensor(t) for name, t in trainer.model.state_dict().items()}  # a mesh of one: DTensors
    started = from_pretrained(out / "tiny_model", dtype=torch.float32).state_dict()
    assert not torch.equal(final["language_model.norm.weight"], started["language_model.norm.weight"])
    for key, tensor in hf.state_dict().items():
        names = hf_key_to_params(key)
        assert torch.equal(tensor, torch.cat([final[n] for n in names]).to(torch.bfloat16)), key
    AutoTokenizer.from_pretrained(out / "hf")


def test_export_tool_writes_the_runs_dtype_over_an_earlier_export(tmp_path):
    """python tools/export_hf.py RUN_DIR --out DIR, by default in the run's model.dtype,
    into a folder that holds another model's weights: only the new ones remain."""
    import importlib.util
    import shutil

    from transformers import Qwen2_5_VLForConditionalGeneration

    from rollplex.config import Config, save_config
    from rollplex.train.checkpoint import save_checkpoint

    source = make_tiny_checkpoint(tmp_path / "source")
    model = from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    run, out = tmp_path / "run", tmp_path / "export"
    cfg = Config()
    cfg.model.path, cfg.model.dtype = str(source), "bfloat16"
    run.mkdir()
    save_config(cfg, run / "config.yaml")
    save_checkpoint(run / "checkpoints", 1, model, torch.optim.AdamW(model.parameters()))
    out.mkdir()
    shutil.copy(source / "model.safetensors", out)  # the source's weights, which transformers would pick first

    spec = importlib.util.spec_from_file_location("export_hf_tool", Path(__file__).parent.parent / "tools/export_hf.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    tool.main([str(run), "--out", str(out)])

    assert not (out / "model.safetensors").exists()
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(out)
    assert hf.dtype == torch.bfloat16
    held = model.state_dict()
    for key, tensor in hf.state_dict().items():
        assert torch.equal(tensor, torch.cat([held[n] for n in hf_key_to_params(key)]).to(torch.bfloat16)), key


def test_an_export_into_its_own_model_folder_is_refused_before_anything_is_deleted(tmp_path):
    import pytest

    source = make_tiny_checkpoint(tmp_path / "source")
    weights = sorted(p.name for p in source.glob("*.safetensors"))
    with pytest.raises(ValueError, match="is the model folder it reads"):
        export_hf(from_pretrained(source, dtype=torch.float32), source / ".", source)
    assert sorted(p.name for p in source.glob("*.safetensors")) == weights and weights
