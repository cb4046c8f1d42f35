"""A run's export, written by `rollplex export`, loaded as docs/RUNNING.md says ("Loading an export without
torchvision"): the snippet itself, run on tiny Qwen3-VL and Qwen2.5-VL exports with torchvision hidden, builds the
inputs Rollplex's processor builds and generates what they generate."""

import contextlib
import io
import re
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from rollplex.cli import main
from rollplex.config import Config, save_config
from rollplex.data.processor import load_processor
from rollplex.models import from_pretrained
from rollplex.tiny import TinySpec, make_tiny_checkpoint
from rollplex.train.checkpoint import save_checkpoint

ROOT = Path(__file__).resolve().parent.parent
MODEL_CLASSES = {"qwen3_vl": "Qwen3VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}


def documented_snippet() -> str:
    """The python block of RUNNING.md's "Loading an export without torchvision"."""
    section = (ROOT / "docs" / "RUNNING.md").read_text().split("### Loading an export without torchvision")[1]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def exported_run(root: Path, family: str) -> Path:
    """A run folder (config.yaml, a checkpoint of weights other than its source's) exported by `rollplex export`."""
    source = make_tiny_checkpoint(root / "source", TinySpec(family=family))
    model = from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    cfg = Config()
    cfg.model.path = str(source)
    run = root / "run"
    run.mkdir()
    save_config(cfg, run / "config.yaml")
    save_checkpoint(run / "checkpoints", 1, model, torch.optim.AdamW(model.parameters()))
    assert main(["export", str(run), "--out", str(root / "export"), "--dtype", "float32"]) == 0
    return root / "export"


@pytest.mark.parametrize("family", sorted(MODEL_CLASSES))
def test_the_documented_way_loads_an_export_without_torchvision(family, tmp_path, monkeypatch):
    folder = exported_run(tmp_path, family)
    shape = Image.new("RGB", (60, 44), "white")
    shape.paste((200, 30, 30), (12, 8, 40, 30))
    shape.save(tmp_path / "shape.png")
    code = documented_snippet().replace('"my_model"', repr(str(folder))).replace('"shape.png"',
                                                                                 repr(str(tmp_path / "shape.png")))
    code = code.replace("Qwen3VLForConditionalGeneration", MODEL_CLASSES[family])
    monkeypatch.setitem(sys.modules, "torchvision", None)  # an import of it fails, installed or not
    printed, names = io.StringIO(), {}
    torch.manual_seed(0)  # the tiny export's generation_config samples
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "RUNNING.md", "exec"), names)

    expected = load_processor(folder)(text=[names["text"]], images=[Image.open(tmp_path / "shape.png").convert("RGB")],
                                      return_tensors="pt")
    inputs, image = names["inputs"], names["image"]
    for key in ("input_ids", "mm_token_type_ids", "attention_mask"):
        assert torch.equal(inputs[key], expected[key]), key
    for key in ("pixel_values", "image_grid_thw"):
        assert torch.equal(image[key], expected[key]), key
    assert int(inputs["mm_token_type_ids"].sum()) == int(expected["image_grid_thw"].prod()) // 4 > 1
    assert names["model"].dtype == torch.float32  # dtype="auto": the dtype the export wrote
    torch.manual_seed(0)
    reference = names["model"].generate(**expected, max_new_tokens=64)
    assert torch.equal(names["output"], reference)
    prompt_length = inputs["input_ids"].shape[1]
    assert printed.getvalue() == names["tokenizer"].decode(reference[0, prompt_length:], skip_special_tokens=True) + "\n"
