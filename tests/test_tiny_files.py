"""The tiny offline Qwen2.5-VL checkpoint files load with transformers and agree
with each other (config <-> tokenizer <-> processor <-> transformers' model)."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch
from PIL import Image

from rollplex.tiny import (
    CHAT_TEMPLATE,
    IMAGE_PAD,
    SPECIAL_TOKENS,
    TAG_TOKENS,
    VIDEO_PAD,
    TinySpec,
    hf_config_dict,
    model_vocab_size,
    write_config,
    write_tiny_files,
    write_tokenizer_and_processor,
)

transformers = pytest.importorskip("transformers")

HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """{style: (dir, info)} for both config.json styles."""
    out = {}
    for style in ("nested", "flat"):
        d = tmp_path_factory.mktemp(f"tiny_{style}")
        out[style] = (d, write_tiny_files(d, TinySpec(), style=style))
    return out


@pytest.fixture(scope="module")
def tiny_dir(tiny_dirs):
    return tiny_dirs["nested"][0]


def _messages(text="What colour is the dot?"):
    return [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": text}],
        }
    ]


def test_spec_validation():
    with pytest.raises(ValueError, match="mrope_section"):
        TinySpec(mrope_section=(2, 2, 2))
    with pytest.raises(ValueError, match="divisible by num_heads"):
        TinySpec(hidden_size=66)
    with pytest.raises(ValueError, match="num_kv_heads"):
        TinySpec(num_kv_heads=3)
    with pytest.raises(ValueError, match="vision_window_size"):
        TinySpec(vision_window_size=50)
    with pytest.raises(ValueError, match="fullatt_block_indexes"):
        TinySpec(fullatt_block_indexes=(2,))
    with pytest.raises(ValueError, match="vocab"):
        TinySpec(vocab="bpe")
    # head_dim 32 -> mrope must sum to 16
    TinySpec(hidden_size=128, mrope_section=(4, 6, 6))


def test_tokenizer_loads_with_special_tokens(tiny_dirs):
    d, info = tiny_dirs["nested"]
    tok = transformers.AutoTokenizer.from_pretrained(d)
    assert len(tok) == info["vocab_size"] <= 64 + 8  # "about 64" words
    assert info["model_vocab_size"] >= len(tok) and info["model_vocab_size"] % 64 == 0
    for t in (*SPECIAL_TOKENS, *TAG_TOKENS):
        ids = tok(t, add_special_tokens=False)["input_ids"]
        assert ids == [info["special_token_ids"][t]], t
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == info["special_token_ids"]["<|im_end|>"]
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == info["special_token_ids"]["<|endoftext|>"]


def test_chat_template_renders_pads(tiny_dir):
    from rollplex.data.processor import load_processor

    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    proc = load_processor(tiny_dir)
    expected = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
        "<|vision_start|><|video_pad|><|vision_end|>What colour is the dot?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    for renderer in (tok, proc):
        text = renderer.apply_chat_template(_messages(), tokenize=False, add_generation_prompt=True)
        assert text == expected
    no_gen = tok.apply_chat_template(_messages(), tokenize=False, add_generation_prompt=False)
    assert no_gen == expected[: -len("<|im_start|>assistant\n")]
    # Every token of the template is in the word vocabulary (no <unk>).
    ids = tok(expected, add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids
    assert ids.count(tok.convert_tokens_to_ids(IMAGE_PAD)) == 1
    assert ids.count(tok.convert_tokens_to_ids(VIDEO_PAD)) == 1
    assert (tiny_dir / "chat_template.jinja").read_text() == CHAT_TEMPLATE


def test_encode_decode_round_trip(tiny_dir):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    for text in (
        "what colour is the dot?",
        "<think>\nthe dot is red\n</think>\n<answer>red</answer>",
        "which direction does the dot move? left",
        "how many? 3 7",
    ):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids, text
        assert tok.decode(ids) == text
    # Capitalised words are lowercased into the vocabulary; digits are single tokens.
    ids = tok("What Colour", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == "what colour"
    assert len(tok("12", add_special_tokens=False)["input_ids"]) == 2
    # Special tokens are skipped on request; newlines survive.
    ids = tok("<|im_start|>user\nred<|im_end|>\n", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == "user\nred\n"


def test_bytes_vocab_and_padding(tmp_path):
    spec = TinySpec(vocab="bytes", extra_words=("cube",))
    info = write_tokenizer_and_processor(tmp_path, spec)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == info["vocab_size"] == 256 + len(SPECIAL_TOKENS) + len(TAG_TOKENS) + 1
    assert info["model_vocab_size"] == 320
    text = "Héllo, wörld! 123 ✓\n<answer>cube</answer>"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    for t in SPECIAL_TOKENS:
        assert tok(t, add_special_tokens=False)["input_ids"] == [info["special_token_ids"][t]]
    # Explicit model vocab size, and a too-small one.
    assert model_vocab_size(TinySpec(vocab_size=1000), 270) == 1000
    with pytest.raises(ValueError, match="vocab_size"):
        model_vocab_size(TinySpec(vocab_size=100), 270)
    cfg = hf_config_dict(TinySpec(pad_vocab_multiple=1), info["vocab_size"], info["special_token_ids"])
    assert cfg["text_config"]["vocab_size"] == info["vocab_size"]


def test_extra_words(tmp_path):
    info = write_tokenizer_and_processor(tmp_path, TinySpec(extra_words=("Cube", "moves", "<box>", "10")))
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ids = tok("the Cube moves <box> 10", add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids and len(ids) == 5
    assert tok.decode(ids) == "the cube moves <box> 10"
    assert info["vocab_size"] == len(tok)


def test_image_processor_is_pil(tiny_dir):
    # From its module: transformers 5.17's top-level AutoImageProcessor is a placeholder
    # that demands torchvision even for the PIL backend.
    from transformers.models.auto.image_processing_auto import AutoImageProcessor

    ip = AutoImageProcessor.from_pretrained(tiny_dir)
    assert type(ip).__name__ == "Qwen2VLImageProcessorPil"
    out = ip(images=[Image.new("RGB", (56, 56), (255, 0, 0))], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 4, 4]]  # 4 merged tokens
    assert out["pixel_values"].shape == (16, 3 * 2 * 14 * 14)


@pytest.mark.skipif(not HAS_TORCHVISION, reason="transformers 5's Qwen2-VL video processor needs torchvision")
def test_auto_processor_with_torchvision(tiny_dir):
    proc = transformers.AutoProcessor.from_pretrained(tiny_dir)
    assert isinstance(proc, transformers.Qwen2_5_VLProcessor)


def test_load_processor_gives_qwen_processor(tiny_dir):
    from rollplex.data.processor import load_processor

    proc = load_processor(tiny_dir)
    assert isinstance(proc, transformers.Qwen2_5_VLProcessor)
    assert type(proc.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    assert proc.video_processor.merge_size == 2 and proc.video_processor.temporal_patch_size == 2


def test_configs_load(tiny_dirs):
    for style, (d, info) in tiny_dirs.items():
        cfg = transformers.AutoConfig.from_pretrained(d)
        assert type(cfg).__name__ == "Qwen2_5_VLConfig", style
        t, v = cfg.text_config, cfg.vision_config
        assert t.vocab_size == info["model_vocab_size"]
        assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads) == (64, 2, 4, 2)
        assert t.rope_parameters["mrope_section"] == [2, 3, 3]
        assert t.rope_parameters["rope_theta"] == 10000.0
        assert t.rms_norm_eps == 1e-6
        assert (v.depth, v.hidden_size, v.num_heads, v.out_hidden_size) == (2, 32, 2, 64)
        assert (v.window_size, list(v.fullatt_block_indexes), v.tokens_per_second) == (56, [1], 2)
        ids = info["special_token_ids"]
        assert cfg.image_token_id == ids["<|image_pad|>"] and cfg.video_token_id == ids["<|video_pad|>"]
        assert cfg.vision_start_token_id == ids["<|vision_start|>"]
        assert cfg.tie_word_embeddings is False
    nested = json.loads((tiny_dirs["nested"][0] / "config.json").read_text())
    flat = json.loads((tiny_dirs["flat"][0] / "config.json").read_text())
    assert nested["text_config"]["rope_parameters"]["rope_type"] == "default"
    assert flat["rope_scaling"] == {"type": "mrope", "mrope_section": [2, 3, 3]}
    assert "text_config" not in flat and flat["hidden_size"] == 64


def test_config_dict_accepts_info_or_ids(tiny_dirs):
    _, info = tiny_dirs["nested"]
    a = hf_config_dict(TinySpec(), info["vocab_size"], info)
    b = hf_config_dict(TinySpec(), info["vocab_size"], info["special_token_ids"])
    assert a == b
    assert hf_config_dict(TinySpec(), info["vocab_size"], info, style="flat")["image_token_id"] == a["image_token_id"]
    with pytest.raises(ValueError, match="special_token_ids"):
        hf_config_dict(TinySpec(), 64, {"<|im_end|>": 2})
    with pytest.raises(ValueError, match="style"):
        write_config("/nonexistent-never-written", TinySpec(), info, style="weird")


@pytest.mark.parametrize("style", ["nested", "flat"])
def test_transformers_model_forward(tiny_dirs, style):
    """Config + processor + tokenizer are consistent: transformers' own Qwen2.5-VL
    (random weights) runs on processor output for an image and text."""
    from rollplex.data.processor import load_processor

    d, _ = tiny_dirs[style]
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.from_pretrained(d)
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    proc = load_processor(d)
    text = proc.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the dot?"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (70, 84, 3), dtype=np.uint8))
    inputs = proc(text=[text], images=[image], return_tensors="pt")
    n_pad = int((inputs["input_ids"] == cfg.image_token_id).sum())
    assert n_pad == int(inputs["image_grid_thw"].prod()) // 4
    with torch.no_grad():
        out = model(
            input_ids=inputs["input_ids"],
            attention_mask=inputs["attention_mask"],
            pixel_values=inputs["pixel_values"],
            image_grid_thw=inputs["image_grid_thw"],
        )
    assert out.logits.shape == (1, inputs["input_ids"].shape[1], cfg.text_config.vocab_size)
    assert torch.isfinite(out.logits).all()
