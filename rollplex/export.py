"""Export a run's checkpoint as a Hugging Face folder that transformers loads: the `rollplex export` command.

    rollplex export runs/my_run --out hf_model               # the latest complete checkpoint
    rollplex export runs/my_run --step 200 --out hf_model --dtype float32
    rollplex export runs/lora_run --out adapter              # a LoRA run: its PEFT adapter
    rollplex export runs/lora_run --out hf_model --merged    # a LoRA run: the merged model

(`python tools/export_hf.py ...` is the same command.)

It reads the run's config.yaml for the model it started from (model.path, or
the tiny model the run wrote in its folder), loads that model in one process
in `--dtype` (default: the run's model.dtype), overwrites its weights with the
checkpoint's, and writes them with the tokenizer, processor and chat template
files of the model it started from. The one process holds the whole model in
`--dtype` (2 bytes per parameter in bfloat16). `trainer.save_hf` writes the
same folder at the end of a run through the same code (export_hf), where each
rank writes only its own shards. A folder that is not a run's (no config.yaml, no checkpoints/)
is refused with a message that says so, exit status 2.

A LoRA run (lora.rank > 0) checkpoints its adapters only (and the vision tower
under lora.train_vision). The tool builds the model as the run did: the model it
started from, its base in the run's model.dtype, with the run's adapters
(rollplex.train.lora), then loads the checkpoint's. By default it writes them as
a PEFT adapter folder (adapter_config.json and adapter_model.safetensors, in
float32 as trained, which `peft.PeftModel.from_pretrained` loads onto the model
the run started from; `--dtype` does not apply). With `--merged` it writes the
full model folder above instead, each adapted weight W + (alpha / r) B A, in
`--dtype`. A run that trained the vision tower in full (lora.train_vision) has
weights no adapter holds: it exports with `--merged` only.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from rollplex.config import Config, load_config_file
from rollplex.metrics import CONFIG_FILE
from rollplex.models import from_pretrained
from rollplex.models.protocol import VisionLanguageModel
from rollplex.train.checkpoint import export_hf, latest_checkpoint, load_model_weights, step_dir_name
from rollplex.train.lora import add_lora
from rollplex.train.lora_export import export_peft_adapter

CHECKPOINTS_DIR = "checkpoints"  # in a run's folder (rollplex.rl.loop)


def not_a_run(run_dir: Path) -> str | None:
    """Why `run_dir` is not a run's folder with a checkpoint (a trainer.output_dir, holding its config.yaml and
    checkpoints/), or None."""
    if not run_dir.is_dir():
        return f"{run_dir} is not a folder: give a run's (its trainer.output_dir, holding {CONFIG_FILE} and " \
               f"{CHECKPOINTS_DIR}/)"
    if not (run_dir / CONFIG_FILE).is_file():
        checkpoints = "" if (run_dir / CHECKPOINTS_DIR).is_dir() else f" and no {CHECKPOINTS_DIR}/"
        return f"{run_dir} is not a run's folder: it holds no {CONFIG_FILE}{checkpoints} (a run's " \
               f"trainer.output_dir holds {CONFIG_FILE} and {CHECKPOINTS_DIR}/)"
    if not (run_dir / CHECKPOINTS_DIR).is_dir():
        return f"{run_dir} holds no {CHECKPOINTS_DIR}/: the run saved no checkpoint (trainer.save_every 0, or it " \
               "stopped before its first save)"
    return None


def checkpoint_of(run_dir: Path, step: int | None) -> Path:
    root = run_dir / CHECKPOINTS_DIR
    if step is not None:
        return root / step_dir_name(step)  # load_model_weights says if it is not a complete checkpoint
    latest = latest_checkpoint(root)
    if latest is None:
        raise SystemExit(f"no complete checkpoint under {root}")
    return latest


def lora_model(cfg: Config, source: Path) -> VisionLanguageModel:
    """The model as a LoRA run held it (rollplex.rl.loop): the base in model.dtype, frozen, with
    the run's adapters (their values are the checkpoint's); under train_vision the tower in float32."""
    run_dtype = getattr(torch, cfg.model.dtype)
    model = from_pretrained(source, dtype=run_dtype if cfg.lora.adapters_only else torch.float32)
    add_lora(model, cfg.lora, run_dtype, cfg.trainer.seed, cfg.parallel.freeze_vision)
    return model


def main(argv: list[str] | None = None, prog: str | None = None) -> Path:
    """Export as `argv` (default: sys.argv[1:]) asks; returns the folder written. `prog`: the command's name in
    its help and errors."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path, help="a run's trainer.output_dir")
    p.add_argument("--out", type=Path, required=True, help="folder to write")
    p.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the latest complete one)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="dtype of the written weights (default: the run's model.dtype)")
    p.add_argument("--merged", action="store_true",
                   help="a LoRA run: write the full model with its adapters merged, not the PEFT adapter folder")
    a = p.parse_args(argv)
    if problem := not_a_run(a.run_dir):
        p.error(problem)  # exit status 2, after the usage line
    cfg = load_config_file(a.run_dir / CONFIG_FILE)
    source = Path(cfg.model.path) if cfg.model.path else a.run_dir / "tiny_model"
    checkpoint = checkpoint_of(a.run_dir, a.step)
    dtype = getattr(torch, a.dtype or cfg.model.dtype)
    adapter = cfg.lora.rank > 0 and not a.merged
    if adapter and not cfg.lora.adapters_only:  # before loading the model, which export_peft_adapter would refuse
        raise SystemExit(f"{a.run_dir} trained its vision tower in full (lora.train_vision), which no adapter "
                         "holds: export it with --merged")
    model = lora_model(cfg, source) if cfg.lora.rank > 0 else from_pretrained(source, dtype=dtype)
    load_model_weights(checkpoint, model)  # the checkpoint's fp32 weights, rounded to the model's dtype as they load
    if adapter:
        out = export_peft_adapter(model, a.out, cfg.lora, str(source))
    else:
        out = export_hf(model, a.out, source, dtype)
    print(f"wrote {out} from {checkpoint}")
    return out
