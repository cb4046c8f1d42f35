"""LoRA export (rollplex.train.lora_export, export_hf and tools/export_hf.py on a LoRA
model): the PEFT adapter folder loads with peft onto transformers' model of the same
base and gives our logits; a vision block's q, k and v adapters become one exact
adapter of the fused qkv; the merged export loads as a plain model with our logits;
both come out alike from a sharded model (FSDP, TP) and from a LoRA run's checkpoint.

Only the tests that load with peft need it (the device stack has none): the others
check the files against our own model.
"""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor, distribute_tensor

from distributed import run_distributed
from rollplex.config import Config, LoRAConfig, save_config
from rollplex.dist import ParallelDims, build_mesh
from rollplex.models import from_pretrained
from rollplex.models.registry import family_named
from rollplex.tiny import TinySpec, make_tiny_checkpoint
from rollplex.train.checkpoint import export_hf, save_checkpoint
from rollplex.train.lora import LoRALinear, apply_lora, freeze_base
from rollplex.train.lora_export import ADAPTER_CONFIG, ADAPTER_WEIGHTS, export_peft_adapter, hub_adapters, named_linears
from rollplex.train.parallelize import parallelize

FAMILIES = ("qwen2_5_vl", "qwen3_vl")
WITH_VISION = dict(exclude_modules="")  # all-linear, the vision tower's linears too
TOL = 1e-5  # float32 rounding of the same sums in another order


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """One tiny random checkpoint per family, written by our model."""
    return {f: make_tiny_checkpoint(tmp_path_factory.mktemp(f), TinySpec.of(f)) for f in FAMILIES}


def randomize_adapters(model: torch.nn.Module, seed: int = 3) -> None:
    """Non-zero B's (and fresh A's), alike on every rank and layout: each drawn whole, then cut to its layout."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in sorted(named_linears(model).items()):  # by name: the same order under any wrapper
            if not isinstance(layer, LoRALinear):
                continue
            for p in (layer.lora_A, layer.lora_B):
                value = torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5 * 0.3
                if isinstance(p, DTensor):
                    value = distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None).to_local()
                    p = p.to_local()
                p.copy_(value)


def lora_model(source: Path, lora: LoRAConfig, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    model = from_pretrained(source, dtype=dtype)
    apply_lora(model, lora, seed=0)
    freeze_base(model, dtype, train=(model.visual,) if lora.train_vision else ())
    randomize_adapters(model)
    return model


def transformers_model(source: Path, family: str) -> torch.nn.Module:
    return family_named(family).transformers_class().from_pretrained(source, dtype=torch.float32).eval()


def image_prompt(model) -> dict[str, torch.Tensor]:
    """Token ids around one image of 4 x 6 patches, with its random pixel rows."""
    a, v = model.args, model.args.vision
    g = torch.Generator().manual_seed(7)
    grid = torch.tensor([[1, 4, 6]])
    pixels = torch.randn(24, v.in_channels * v.temporal_patch_size * v.patch_size**2, generator=g)
    ids = [1, 2, a.vision_start_token_id] + [a.image_token_id] * (24 // v.spatial_merge_size**2) + \
          [a.vision_end_token_id, 4, 5]
    return {"input_ids": torch.tensor([ids]), "pixel_values": pixels, "image_grid_thw": grid}


def assert_same_logits(ours: torch.nn.Module, hf: torch.nn.Module, base: torch.nn.Module | None = None) -> None:
    """hf's logits on the image prompt are ours (and, when `base` is given, not the base model's)."""
    prompt = image_prompt(ours)
    mine = ours.hf_forward(**prompt)
    with torch.no_grad():
        theirs = hf(**prompt, mm_token_type_ids=(prompt["input_ids"] == ours.args.image_token_id).long()).logits
    err = (mine - theirs).abs().max().item()
    assert err <= TOL, f"max abs logit difference {err}"
    if base is not None:
        assert (mine - base.hf_forward(**prompt)).abs().max() > 0.1  # the adapters move the logits


def load_tool():
    spec = importlib.util.spec_from_file_location("export_hf_tool", Path(__file__).parent.parent / "tools/export_hf.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


# ----------------------------------------------------------------------------- the PEFT adapter


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_loads_the_adapter_onto_transformers_model_with_our_logits(sources, family, tmp_path):
    peft = pytest.importorskip("peft")
    lora = LoRAConfig(rank=4, alpha=8.0, dropout=0.05)  # the default layers: the language model's linears
    ours = lora_model(sources[family], lora)
    out = export_peft_adapter(ours, tmp_path / "adapter", lora, str(sources[family]))

    config = json.loads((out / ADAPTER_CONFIG).read_text())
    layers = len(ours.language_model.layers)
    assert sorted(config["target_modules"]) == sorted(
        f"model.language_model.layers.{i}.{n}" for i in range(layers)
        for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                  "mlp.up_proj", "mlp.down_proj"))  # fmt: skip
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["lora_dropout"]) == ("LORA", 4, 8.0, 0.05)
    assert config["rank_pattern"] == config["alpha_pattern"] == {} and config["bias"] == "none"
    assert config["base_model_name_or_path"] == str(sources[family])
    weights = load_file(out / ADAPTER_WEIGHTS)
    layer = ours.language_model.layers[1].mlp.down_proj
    assert torch.equal(weights["base_model.model.model.language_model.layers.1.mlp.down_proj.lora_B.weight"],
                       layer.lora_B)
    assert len(weights) == 2 * len(config["target_modules"])

    hf = peft.PeftModel.from_pretrained(transformers_model(sources[family], family), out).eval()
    assert_same_logits(ours.eval(), hf, base=from_pretrained(sources[family], dtype=torch.float32))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("targets, rank", [(["all-linear"], 12), (["attn.q", "attn.v"], 8)], ids=["q-k-v", "q-v"])
def test_vision_q_k_v_adapters_load_as_one_exact_fused_qkv_adapter(sources, family, targets, rank, tmp_path):
    """q, k and v each with an adapter of rank 4: one of rank 12 on qkv; q and v only: rank 8, k's rows zero."""
    peft = pytest.importorskip("peft")
    lora = LoRAConfig(rank=4, alpha=8.0, target_modules=targets, **WITH_VISION)
    ours = lora_model(sources[family], lora)
    out = export_peft_adapter(ours, tmp_path / "adapter", lora)

    config = json.loads((out / ADAPTER_CONFIG).read_text())
    fused = [f"model.visual.blocks.{i}.attn.qkv" for i in range(len(ours.visual.blocks))]
    assert set(fused) <= set(config["target_modules"])
    assert config["rank_pattern"] == {m: rank for m in fused}
    assert config["alpha_pattern"] == {m: 2.0 * rank for m in fused}  # scaling alpha / r = 2 on every module

    hf = peft.PeftModel.from_pretrained(transformers_model(sources[family], family), out).eval()
    assert_same_logits(ours.eval(), hf, base=from_pretrained(sources[family], dtype=torch.float32))


def test_the_fused_adapter_is_the_parts_stacked(sources):
    """B A of the fused qkv adapter is q's, k's and v's B A stacked by rows, and its scaling theirs."""
    lora = LoRAConfig(rank=4, alpha=8.0, target_modules=["attn.q", "attn.v"], **WITH_VISION)
    ours = lora_model(sources["qwen2_5_vl"], lora)
    a, b, scaling = hub_adapters(ours)["model.visual.blocks.0.attn.qkv"]
    attn = ours.visual.blocks[0].attn
    k_rows = torch.zeros(attn.k.weight.shape)
    assert scaling == 2.0 and a.shape[0] == 8
    torch.testing.assert_close(b @ a, torch.cat([attn.q.lora_B @ attn.q.lora_A, k_rows,
                                                 attn.v.lora_B @ attn.v.lora_A]), rtol=0, atol=1e-6)


def test_an_adapter_export_of_a_vision_tower_trained_in_full_is_refused(sources, tmp_path):
    lora = LoRAConfig(rank=4, train_vision=True)
    with pytest.raises(ValueError, match="train_vision.*--merged"):
        export_peft_adapter(lora_model(sources["qwen2_5_vl"], lora), tmp_path / "adapter", lora)
    assert not (tmp_path / "adapter").exists()


# ----------------------------------------------------------------------------- the merged export


@pytest.mark.parametrize("family", FAMILIES)
def test_the_merged_export_loads_in_transformers_as_a_plain_model_with_our_logits(sources, family, tmp_path):
    lora = LoRAConfig(rank=4, alpha=8.0, **WITH_VISION)
    ours = lora_model(sources[family], lora)
    out = export_hf(ours, tmp_path / "merged", sources[family], torch.float32)
    keys = set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"])
    assert keys and not any("lora" in key for key in keys)  # the weights it lacks would fail the logits below
    assert_same_logits(ours.eval(), transformers_model(out, family), base=from_pretrained(sources[family],
                                                                                          dtype=torch.float32))


def test_the_merged_weights_are_rounded_to_the_export_dtype_once(sources, tmp_path):
    """bfloat16: W + (alpha / r) B A summed in float32, then rounded, not B A rounded first."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    lora = LoRAConfig(rank=4, alpha=8.0)
    ours = lora_model(sources["qwen2_5_vl"], lora, dtype=torch.bfloat16)
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(export_hf(ours, tmp_path / "merged", dtype=torch.bfloat16))
    layer = ours.language_model.layers[0].self_attn.q_proj
    expected = (layer.weight.float() + 2.0 * layer.lora_B @ layer.lora_A).to(torch.bfloat16)
    assert torch.equal(hf.state_dict()["model.language_model.layers.0.self_attn.q_proj.weight"], expected)
    assert torch.equal(hf.state_dict()["model.language_model.norm.weight"], ours.language_model.norm.weight)


# ----------------------------------------------------------------------------- sharded models

LAYOUTS = {"fsdp": (2, 1), "tp": (1, 2)}  # name: (dp_shard, tp)
SHARDED_LORA = LoRAConfig(rank=4, alpha=8.0, **WITH_VISION)


def export_sharded(rank: int, world: int, source: str, root: str) -> None:
    torch.set_num_threads(1)
    for layout, (dp_shard, tp) in LAYOUTS.items():
        model = from_pretrained(source, dtype=torch.float32)
        parallelize(model, build_mesh(ParallelDims.resolve(world, dp_shard, tp), "cpu"), activation_checkpointing=True,
                    lora=SHARDED_LORA, seed=0)
        randomize_adapters(model)
        assert any(isinstance(p, DTensor) for n, p in model.named_parameters() if "lora" in n)
        export_peft_adapter(model, f"{root}/{layout}/adapter", SHARDED_LORA)
        export_hf(model, f"{root}/{layout}/merged", source, torch.float32)
        # Every rank is past the barriers with the files written.
        assert Path(f"{root}/{layout}/adapter/{ADAPTER_WEIGHTS}").is_file()


def test_a_sharded_model_exports_the_adapter_and_the_merged_model_of_one_process(sources, tmp_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    source = sources["qwen2_5_vl"]
    run_distributed(export_sharded, 2, str(source), str(tmp_path))
    ours = lora_model(source, SHARDED_LORA)
    export_peft_adapter(ours, tmp_path / "adapter", SHARDED_LORA)
    expected = load_file(tmp_path / "adapter" / ADAPTER_WEIGHTS)
    merged = Qwen2_5_VLForConditionalGeneration.from_pretrained(export_hf(ours, tmp_path / "merged")).state_dict()
    for layout in LAYOUTS:
        assert json.loads((tmp_path / layout / "adapter" / ADAPTER_CONFIG).read_text()) == \
            json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
        written = load_file(tmp_path / layout / "adapter" / ADAPTER_WEIGHTS)
        assert written.keys() == expected.keys()
        for key, tensor in written.items():
            assert torch.equal(tensor, expected[key]), (layout, key)
        hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / layout / "merged").state_dict()
        for key, tensor in hf.items():
            torch.testing.assert_close(tensor, merged[key], rtol=0, atol=1e-6, msg=f"{layout} {key}")


# ----------------------------------------------------------------------------- tools/export_hf.py


def lora_run(source: Path, run: Path, lora: LoRAConfig) -> torch.nn.Module:
    """A run folder as a LoRA run leaves it: config.yaml and a checkpoint of the trained parameters only
    (the adapters, and under lora.train_vision the vision tower, moved off the source's weights here)."""
    cfg = Config()
    cfg.model.path, cfg.model.dtype, cfg.lora = str(source), "float32", lora
    run.mkdir()
    save_config(cfg, run / "config.yaml")
    model = lora_model(source, lora)
    trained = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        for p in model.visual.parameters() if lora.train_vision else ():
            p.add_(0.01)
    save_checkpoint(run / "checkpoints", 1, model, torch.optim.AdamW(trained))
    return model.eval()


@pytest.fixture(scope="module")
def tool_exports(sources, tmp_path_factory) -> tuple[torch.nn.Module, Path, Path]:
    """(our model, the adapter folder, the merged folder) the tool wrote from a LoRA run's checkpoint."""
    root = tmp_path_factory.mktemp("tool")
    lora = LoRAConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "attn.q", "attn.k", "attn.v"],
                      **WITH_VISION)
    ours = lora_run(sources["qwen2_5_vl"], root / "run", lora)
    tool = load_tool()
    adapter = tool.main([str(root / "run"), "--out", str(root / "adapter")])
    merged = tool.main([str(root / "run"), "--out", str(root / "merged"), "--merged"])
    return ours, adapter, merged


def test_the_tool_writes_a_lora_runs_adapter_by_default(sources, tool_exports):
    ours, adapter, _ = tool_exports
    assert sorted(p.name for p in adapter.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    written = load_file(adapter / ADAPTER_WEIGHTS)
    for module, (a, b, _) in hub_adapters(ours).items():
        assert torch.equal(written[f"base_model.model.{module}.lora_A.weight"], a), module
        assert torch.equal(written[f"base_model.model.{module}.lora_B.weight"], b), module
    assert json.loads((adapter / ADAPTER_CONFIG).read_text())["base_model_name_or_path"] == str(sources["qwen2_5_vl"])


def test_peft_loads_the_tools_adapter_with_our_logits(sources, tool_exports):
    peft = pytest.importorskip("peft")
    ours, adapter, _ = tool_exports
    assert_same_logits(ours, peft.PeftModel.from_pretrained(transformers_model(sources["qwen2_5_vl"], "qwen2_5_vl"),
                                                            adapter).eval())


def test_the_tool_writes_a_lora_runs_merged_model_with_merged(tool_exports):
    ours, _, merged = tool_exports
    assert (merged / "tokenizer.json").is_file()
    assert_same_logits(ours, transformers_model(merged, "qwen2_5_vl"))


def test_a_run_that_trained_its_vision_tower_exports_merged_only(sources, tmp_path):
    ours = lora_run(sources["qwen2_5_vl"], tmp_path / "run", LoRAConfig(rank=4, train_vision=True))
    tool = load_tool()
    with pytest.raises(SystemExit, match="--merged"):
        tool.main([str(tmp_path / "run"), "--out", str(tmp_path / "adapter")])
    assert not (tmp_path / "adapter").exists()
    merged = tool.main([str(tmp_path / "run"), "--out", str(tmp_path / "merged"), "--merged"])
    assert_same_logits(ours, transformers_model(merged, "qwen2_5_vl"))  # with the tower as trained
