"""Rollplex entry point: config -> model -> run.

    python train.py                                   # the built-in default (configs/tiny.yaml)
    python train.py --config configs/x.yaml --rollout.n 4
    python train.py --help                            # every option

The RL loop (rollout, rewards, GRPO update) is being built; until it lands this
runs the model smoke: it builds (or loads) the model, renders a synthetic image
prompt with the chat template, and samples a GRPO group with the engine.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

from rollplex.config import Config, load_config
from rollplex.data.processing import load_processor, prepare_prompt
from rollplex.engine import Engine, EngineConfig, Request, SamplingParams
from rollplex.models import from_pretrained
from rollplex.models.tiny import TinySpec, default_mrope_section, make_tiny_checkpoint


def model_dir(cfg: Config) -> Path:
    """The checkpoint to load: model.path, or the tiny model built on first use."""
    if cfg.model.path:
        return Path(cfg.model.path)
    out = Path(cfg.trainer.output_dir) / "tiny_model"
    if not (out / "config.json").exists():
        t = cfg.model.tiny
        head_dim = t.hidden_size // t.num_heads
        spec = TinySpec(hidden_size=t.hidden_size, num_layers=t.num_layers, num_heads=t.num_heads,
                        num_kv_heads=t.num_kv_heads, intermediate_size=t.intermediate_size,
                        vision_hidden_size=t.vision_hidden_size, vision_depth=t.vision_depth,
                        vision_num_heads=t.vision_num_heads, vision_intermediate_size=2 * t.vision_hidden_size,
                        vocab=t.vocab, mrope_section=default_mrope_section(head_dim))
        make_tiny_checkpoint(out, spec, seed=t.seed)
        print(f"built the tiny model into {out}")
    return out


def colour_image(seed: int) -> np.ndarray:
    """A red square on a noisy background."""
    rng = np.random.default_rng(seed)
    img = rng.integers(0, 80, (56, 56, 3), dtype=np.uint8)
    img[14:42, 14:42] = (220, 30, 30)
    return img


def main(argv: list[str] | None = None) -> None:
    cfg = load_config(argv)
    if cfg.trainer.num_threads:
        torch.set_num_threads(cfg.trainer.num_threads)
    device = "cuda" if cfg.trainer.device == "auto" and torch.cuda.is_available() else (
        "cpu" if cfg.trainer.device == "auto" else cfg.trainer.device)
    path = model_dir(cfg)
    model = from_pretrained(path, dtype=getattr(torch, cfg.model.dtype), device=device,
                            attn_backend=cfg.model.attn_backend)
    processor = load_processor(path)
    prompt = prepare_prompt(processor, "<image> what colour is the shape ?", images=[colour_image(cfg.data.seed)])
    engine = Engine(model, EngineConfig(block_size=cfg.rollout.block_size, max_num_seqs=cfg.rollout.max_num_seqs,
                                        kv_cache_memory=cfg.rollout.kv_cache_memory,
                                        enforce_eager=cfg.rollout.enforce_eager))
    request = Request(prompt.input_ids.tolist(), pixel_values=prompt.pixel_values,
                      image_grid_thw=prompt.image_grid_thw, n=cfg.rollout.n)
    params = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                            max_tokens=cfg.rollout.max_tokens, seed=cfg.trainer.seed)
    start = time.perf_counter()
    out = engine.generate([request], params)[0]
    seconds = time.perf_counter() - start
    print(f"prompt ({len(request.prompt_ids)} tokens): {prompt.text!r}")
    for i, s in enumerate(out.samples):
        text = processor.tokenizer.decode(s.token_ids, skip_special_tokens=False)
        print(f"sample {i}: {text!r}  [{s.finish_reason}, mean logprob {np.mean(s.logprobs):.2f}]")
    print(f"engine: {engine.stats}, {seconds:.2f} s")
    print("model smoke done (the RL training loop is not implemented yet)")


if __name__ == "__main__":
    main(sys.argv[1:])
