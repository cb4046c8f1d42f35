"""Export a run's checkpoint as a Hugging Face folder that transformers loads.

    python tools/export_hf.py runs/my_run --out hf_model               # the latest complete checkpoint
    python tools/export_hf.py runs/my_run --step 200 --out hf_model --dtype float32

It reads the run's config.yaml for the model it started from (model.path, or
the tiny model the run wrote in its folder), loads that model in one process
in `--dtype` (default: the run's model.dtype), overwrites its weights with the
checkpoint's, and writes them with the tokenizer, processor and chat template
files of the model it started from. The one process holds the whole model in
`--dtype` (2 bytes per parameter in bfloat16). `trainer.save_hf` writes the
same folder at the end of a run through the same code (export_hf), where each
rank writes only its own shards.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rollplex.config import load_config_file  # noqa: E402
from rollplex.models import from_pretrained  # noqa: E402
from rollplex.train.checkpoint import export_hf, latest_checkpoint, load_model_weights, step_dir_name  # noqa: E402


def checkpoint_of(run_dir: Path, step: int | None) -> Path:
    root = run_dir / "checkpoints"
    if step is not None:
        return root / step_dir_name(step)  # load_model_weights says if it is not a complete checkpoint
    latest = latest_checkpoint(root)
    if latest is None:
        raise SystemExit(f"no complete checkpoint under {root}")
    return latest


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path, help="a run's trainer.output_dir")
    p.add_argument("--out", type=Path, required=True, help="folder to write")
    p.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the latest complete one)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="dtype of the written weights (default: the run's model.dtype)")
    a = p.parse_args(argv)
    cfg = load_config_file(a.run_dir / "config.yaml")
    source = Path(cfg.model.path) if cfg.model.path else a.run_dir / "tiny_model"
    checkpoint = checkpoint_of(a.run_dir, a.step)
    dtype = getattr(torch, a.dtype or cfg.model.dtype)
    model = from_pretrained(source, dtype=dtype)
    load_model_weights(checkpoint, model)  # the checkpoint's fp32 weights, rounded to dtype as they load
    out = export_hf(model, a.out, source, dtype)
    print(f"wrote {out} from {checkpoint}")
    return out


if __name__ == "__main__":
    main()
