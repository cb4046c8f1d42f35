"""The model-family seam (rollplex.models.family and .registry): a checkpoint's
config.json picks its family, the rest of Rollplex names no family, and what a
family declares (its FSDP entries, its parameter counts, its tiny checkpoint)
holds for every registered family."""

import ast
import json
from pathlib import Path

import pytest
import torch

from rollplex.models import FAMILIES, Prompt, build_model, family_of, from_pretrained, pack_sequences
from rollplex.models.protocol import CheckpointError, VisionLanguageModel, fsdp_entry_methods
from rollplex.models.registry import NOT_SUPPORTED_YET
from rollplex.ops.attention import PackedSegments
from rollplex.ops.gated_delta import causal_conv1d, chunk_gated_delta_rule
from rollplex.models.inputs import VisionSlots

ROOT = Path(__file__).resolve().parents[1] / "rollplex"
FAMILY_NAMES = sorted(FAMILIES)


def test_nothing_outside_a_family_package_imports_it():
    """The engine, the trainer, the RL loop and the data side reach a family only through
    rollplex.models.family: the registry is the one module that imports the packages. A family
    package (one that defines a FAMILY, registered or not yet) may build on another's code."""
    packages = {init.parent.name for init in (ROOT / "models").glob("*/__init__.py")
                if "\nFAMILY = " in init.read_text()}  # a ModelFamily, or another family's with changes
    assert set(FAMILIES) <= packages
    offenders = []
    for path in ROOT.rglob("*.py"):
        inside = path.relative_to(ROOT).parts
        if inside[:1] == ("models",) and (len(inside) > 2 and inside[1] in packages or inside[1] == "registry.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names
                          if any(n.startswith(f"rollplex.models.{package}") for package in packages)]
    assert not offenders, offenders


def test_config_json_picks_the_family(tmp_path):
    for name in FAMILY_NAMES:
        family = FAMILIES[name]
        folder = tmp_path / name
        from rollplex.models import save_pretrained

        save_pretrained(build_model(family.tiny_args(), seed=0), folder)
        model = from_pretrained(folder, dtype=torch.float32)
        assert type(model) is family.model_class and family_of(model) is family


def test_an_unknown_model_type_names_the_supported_families(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=f"'llava' is not a family Rollplex supports .supported: "
                                              f"{', '.join(FAMILIES)}"):
        from_pretrained(tmp_path)
    for model_type, why in NOT_SUPPORTED_YET.items():
        (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
        with pytest.raises(CheckpointError, match="not supported yet"):
            from_pretrained(tmp_path)


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_param_counts_match_the_built_model(name):
    family = FAMILIES[name]
    for tie in (False, True):
        model = build_model(family.tiny_args(tie=tie))
        counts = family.count_params(model.args)
        assert counts.total == sum(p.numel() for p in model.parameters())
        assert counts.vision == sum(p.numel() for p in family.vision_tower(model).parameters())
        blocks = sum(p.numel() for b in family.repeated_blocks(model) for p in b.parameters())
        assert counts.root == counts.total - blocks


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_linear_params_are_the_matmuls_torch_counts(name):
    """FLOP counts (rollplex.train.flops) take 2 x linear_params per token and per patch: torch's
    FlopCounterMode, counting the matmuls a vision forward and a decoder forward run, agrees exactly."""
    from torch.utils.flop_counter import FlopCounterMode

    family = FAMILIES[name]
    model = build_model(family.tiny_args())
    linear = family.linear_params(model.args)
    prompt = _image_prompt(model.args)
    inputs = model.prepare_vision(prompt.pixel_values, prompt.image_grid_thw)
    ids = torch.tensor([1, 5, 7, 9, 11])
    mixing = _OneSequence(len(ids))
    for run, units, expected in ((lambda: model.encode_prepared(inputs), len(prompt.pixel_values), linear.vision),
                                 (lambda: model.forward_generated(ids, torch.arange(5).expand(3, -1), mixing),
                                  len(ids), linear.decoder)):
        with FlopCounterMode(display=False) as counter:
            run()
        counts = counter.get_flop_counts()["Global"]
        matmuls = sum(n for op, n in counts.items() if str(op) in ("aten.mm", "aten.addmm"))
        assert matmuls == 2 * expected * units


class _OneSequence:
    """What a decoder's layers mix one whole sequence through: causal attention, and (for
    layers with a recurrent state) the convolution and the gated delta rule from zero."""

    def __init__(self, length: int):
        self.attention = PackedSegments([0, length], True, "torch", torch.device("cpu"))
        self.cu_seqlens = torch.tensor([0, length])

    def __call__(self, layer, q, k, v):
        return self.attention(q, k, v)

    def short_convolution(self, layer, x, weight):
        return causal_conv1d(x, weight, self.cu_seqlens)[0]

    def gated_delta(self, layer, q, k, v, g, beta):
        return chunk_gated_delta_rule(q, k, v, g, beta, self.cu_seqlens)[0]


def _image_prompt(args) -> Prompt:
    v = args.vision
    grid = torch.tensor([[1, 4, 4]])
    row = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
    n = 16 // v.spatial_merge_size ** 2
    ids = [1, 5, args.vision_start_token_id, *[args.image_token_id] * n, args.vision_end_token_id, 7, 9]
    return Prompt(torch.tensor(ids), pixel_values=torch.randn(16, row, generator=torch.Generator().manual_seed(0)),
                  image_grid_thw=grid)


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_every_entry_gathers_the_root(name):
    """FSDP2 gathers the root unit only in forward and in the methods the model class
    marks `fsdp_entry` (rollplex.train.parallelize registers them). Every call the
    engine and trainer make from outside, each with the root resharded first, gives
    the unsharded model's result: a call that reads root parameters without being
    an entry would meet them sharded and fail. One process, a mesh of one."""
    from rollplex.dist import ParallelDims, build_mesh, init_distributed
    from rollplex.train.parallelize import parallelize

    family = FAMILIES[name]
    assert {"embed_prompts", "encode_prepared", "forward_generated", "logits"} <= set(
        fsdp_entry_methods(family.model_class))
    init_distributed("cpu")
    plain = build_model(family.tiny_args(), seed=3, init_std=None)
    sharded = parallelize(build_model(family.tiny_args(), seed=3, init_std=None),
                          build_mesh(ParallelDims.resolve(1, -1, 1), "cpu"))
    prompt = _image_prompt(plain.args)
    batch = pack_sequences(plain.args, [prompt], [[4, 8, 3]])

    def calls(model: VisionLanguageModel) -> list[torch.Tensor]:
        out = []

        def fresh():
            if model is sharded:
                model.reshard()
            return model

        vision = fresh().encode_vision(prompt.pixel_values, prompt.image_grid_thw)
        out += vision.tensors()
        ids = prompt.input_ids
        slots = VisionSlots.find(model.args, ids)
        h = fresh().embed_prompts(ids, vision, slots)
        positions = pack_sequences(model.args, [prompt]).position_ids
        for h in model.layer_by_layer(h, positions, _OneSequence(len(ids)), vision, slots):
            pass
        out.append(fresh().logits(h))
        generated = torch.tensor([4, 8])
        out.append(fresh().forward_generated(generated, torch.arange(2).expand(3, -1), _OneSequence(2)))
        out.append(fresh().logits(fresh().forward_packed(batch)))
        return out

    with torch.no_grad():
        for ours, reference in zip(calls(sharded), calls(plain), strict=True):
            torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
