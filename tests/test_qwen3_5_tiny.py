"""Qwen3.5's random initialisation and tiny checkpoint folder: build_model starts every
RMSNorm at the identity scale (the decoder's zero-centred norms at w = 0, the DeltaNet's
gated norm at w = 1), and the folder rollplex.tiny writes for the family loads in
transformers and in Rollplex with equal
logits on its own processor's output."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3_5ForConditionalGeneration

from rollplex.data.processing import prepare_prompt
from rollplex.models import build_model, from_pretrained
from rollplex.models.qwen3_5 import FAMILY, FULL_ATTENTION, LINEAR_ATTENTION, tiny_args
from rollplex.models.qwen3_5.decoder import ZeroCenteredRMSNorm
from rollplex.models.qwen3_5.deltanet import GatedRMSNorm
from rollplex.tiny import TinySpec, make_tiny_checkpoint

ROOT = Path(__file__).resolve().parent.parent
LIN, FULL = LINEAR_ATTENTION, FULL_ATTENTION


def unit_scale_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("init_std", [None, 0.02])
def test_build_model_starts_every_rms_norm_at_the_identity_scale(init_std):
    """Each norm's output on random inputs is x / rms(x) (times silu(gate) for the gated norm):
    a zero-centred norm started at 1, as the other families' norms are, would double it."""
    model = build_model(tiny_args(layer_types=(LIN, FULL, LIN)), seed=0, init_std=init_std, family=FAMILY)
    g = torch.Generator().manual_seed(0)
    zero_centred = [m for m in model.modules() if isinstance(m, ZeroCenteredRMSNorm)]
    gated = [m for m in model.modules() if isinstance(m, GatedRMSNorm)]
    # Two per layer, q_norm and k_norm in the full-attention layer, the final norm; one per DeltaNet.
    assert (len(zero_centred), len(gated)) == (2 * 3 + 2 + 1, 2)
    with torch.no_grad():
        for norm in zero_centred:
            x = 3 * torch.randn(5, norm.weight.numel(), generator=g)
            assert torch.allclose(norm(x), unit_scale_rms_norm(x, norm.eps), atol=1e-6)
        for norm in gated:
            x, gate = (3 * torch.randn(5, 4, norm.weight.numel(), generator=g) for _ in range(2))
            assert torch.allclose(norm(x, gate), unit_scale_rms_norm(x, norm.eps) * F.silu(gate), atol=1e-6)
    tower_norms = [m for m in model.visual.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert tower_norms and all(torch.equal(m.weight, torch.ones_like(m.weight)) for m in tower_norms)


# ----------------------------------------------------------------------------- the tiny folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen3_5"), TinySpec.of(FAMILY), seed=0)


def test_tiny_config_has_both_layer_kinds_and_a_partial_rotary(folder):
    text = json.loads((folder / "config.json").read_text())["text_config"]
    spec = TinySpec.of(FAMILY)
    assert text["layer_types"] == [LIN, FULL] and text["head_dim"] == spec.head_dim == 32
    assert text["rope_parameters"]["partial_rotary_factor"] == 0.25
    assert text["rope_parameters"]["mrope_section"] == [2, 1, 1]  # half of 32 * 0.25
    assert (text["linear_num_key_heads"], text["linear_num_value_heads"]) == (2, 4)


def test_tiny_folder_loads_in_transformers_and_rollplex_with_equal_logits(folder):
    rng = np.random.default_rng(0)
    image = rng.integers(0, 255, (70, 98, 3), dtype=np.uint8)
    frames = [rng.integers(0, 255, (64, 96, 3), dtype=np.uint8) for _ in range(4)]
    processor = FAMILY.load_processor(folder)
    prompt = prepare_prompt(processor, "<image> what colour is the shape ? <video> which direction ?",
                            images=[image], videos=[frames], video_fps=2.0)
    ours = from_pretrained(folder, dtype=torch.float32, attn_backend="torch", family=FAMILY)
    args = ours.args
    ids = prompt.input_ids[None]
    assert int((ids == args.image_token_id).sum()) == int(prompt.image_grid_thw.prod()) // 4
    assert int((ids == args.video_token_id).sum()) > 0
    kw = dict(pixel_values=prompt.pixel_values, image_grid_thw=prompt.image_grid_thw,
              pixel_values_videos=prompt.pixel_values_videos, video_grid_thw=prompt.video_grid_thw)
    hf = Qwen3_5ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    mm_types = (ids == args.image_token_id).long() + 2 * (ids == args.video_token_id).long()
    with torch.no_grad():
        reference = hf(input_ids=ids, mm_token_type_ids=mm_types, **kw).logits
        logits = ours.hf_forward(ids, **kw)
    assert reference.std() > 0.1  # every layer moves the output (build_model(init_std=None))
    err = (logits - reference).abs().max().item()
    assert err <= 1e-4, err


def test_layer_kinds_follow_the_layers():
    """The tiny pattern ends in full attention (three DeltaNet layers, then one, as the hub's);
    layer_types given are kept, checked against num_layers."""
    for layers, kinds in ((1, [FULL]), (3, [LIN, LIN, FULL]), (6, [LIN, LIN, LIN, FULL, LIN, LIN])):
        spec = TinySpec.of(FAMILY, num_layers=layers)
        assert FAMILY.tiny_hf_config(spec, 64, _token_ids(), "nested", "float32")["text_config"]["layer_types"] \
            == kinds
    spec = TinySpec.of(FAMILY, num_layers=2, layer_types=(FULL, LIN))
    assert FAMILY.tiny_hf_config(spec, 64, _token_ids(), "nested", "float32")["text_config"]["layer_types"] \
        == [FULL, LIN]
    with pytest.raises(ValueError, match="layer_types has 1 entries for num_layers 2"):
        TinySpec.of(FAMILY, layer_types=(LIN,))
    with pytest.raises(ValueError, match="multiple of linear_num_key_heads"):
        TinySpec.of(FAMILY, linear_num_value_heads=3)
    with pytest.raises(ValueError, match="nested style only"):
        FAMILY.tiny_hf_config(TinySpec.of(FAMILY), 64, _token_ids(), "flat", "float32")


def _token_ids() -> dict[str, int]:
    """Stand-in token ids by config key (what rollplex.tiny passes a family's tiny_hf_config)."""
    keys = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id", "bos_token_id",
            "eos_token_id", "pad_token_id")
    return {key: 50 + i for i, key in enumerate(keys)}


def test_the_tool_writes_a_qwen3_5_folder(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_tiny_checkpoint.py"), "--out", str(tmp_path),
                    "--family", "qwen3_5", "--layers", "4"], check=True, capture_output=True)
    model = Qwen3_5ForConditionalGeneration.from_pretrained(tmp_path)
    assert model.config.text_config.layer_types == [LIN, LIN, LIN, FULL]
    from_pretrained(tmp_path, family=FAMILY)
