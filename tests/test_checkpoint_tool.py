"""tools/make_tiny_checkpoint.py end to end: transformers loads what it writes,
and Rollplex matches transformers on real processor output."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

from rollplex.data.processing import prepare_prompt
from rollplex.data.processor import load_processor
from rollplex.models import from_pretrained

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", params=["nested", "flat"])
def checkpoint(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"tiny_{request.param}")
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_tiny_checkpoint.py"), "--out", str(out),
                    "--style", request.param], check=True, capture_output=True)
    return out


def test_transformers_loads_the_tool_output(checkpoint):
    config = AutoConfig.from_pretrained(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert config.model_type == "qwen2_5_vl" and len(tokenizer) <= config.text_config.vocab_size
    for token in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>"):
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1
    assert config.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint)


def test_parity_on_processor_output(checkpoint):
    rng = np.random.default_rng(0)
    image = rng.integers(0, 255, (70, 98, 3), dtype=np.uint8)
    frames = [rng.integers(0, 255, (56, 84, 3), dtype=np.uint8) for _ in range(4)]
    processor = load_processor(checkpoint)
    prompt = prepare_prompt(processor, "<image> what colour is the shape ? <video> which direction ?",
                            images=[image], videos=[frames], video_fps=2.0)
    kw = dict(pixel_values=prompt.pixel_values, image_grid_thw=prompt.image_grid_thw,
              pixel_values_videos=prompt.pixel_values_videos, video_grid_thw=prompt.video_grid_thw,
              second_per_grid_ts=prompt.second_per_grid_ts)
    ids = prompt.input_ids[None]
    ours = from_pretrained(checkpoint, dtype=torch.float32)
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    from rollplex.models.packing import pack_padded

    positions = pack_padded(ours.args, ids, None, **kw).position_ids[:, None]  # see test_model.test_video
    mm = (ids == ours.args.image_token_id).long() + 2 * (ids == ours.args.video_token_id).long()
    with torch.no_grad():
        ref = hf(input_ids=ids, mm_token_type_ids=mm, position_ids=positions, **kw).logits
    err = (ours.hf_forward(ids, **kw) - ref).abs().max().item()
    assert err <= 1e-4, err
