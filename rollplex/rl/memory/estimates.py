"""One estimator per tensor class, used by the plan and by the run itself: the
prompt-work scheduler admits prompt work by `kept_prompt_state` and `admitted`, the
functions the plan sums. Exact (closed formulas on the model's shape):
parameters, gradients, optimizer state, KV pool (over the layers that keep K/V:
`ModelFamily.kv_layers`), the engine's recurrent-state pool (Qwen3.5's Gated
DeltaNet layers: `ModelFamily.recurrent_state_bytes` per row), prompt K/V and
prompt states, vision embeddings, LoRA's adapters (`count_lora`: counted on a
meta-device model of the family with the adapters apply_lora puts on it), the routed
experts' elements an MoE model's expert parallelism splits (`expert_counts`), and
routing replay's routes (`route_bytes_per_token`).
Estimated, from the tensors the model's code saves for backward (checked against
CPU measurements in tests/test_memory.py): activations, by layer kind (an
attention layer's, or a Gated DeltaNet layer's; its MLP a dense SwiGLU's or a sparse
MoE block's), the prefix graph, and the
transient working memory of the engine and the prompt slices (`workspace`) and of
the logprob and training passes (`activations`).

Not counted in the per-layer estimates: Qwen3.5's zero-centred RMSNorms keep two
float32 copies of their input and a float32 normalised value (the estimate counts
one copy and a normalised value in the model's dtype: 6 bytes per hidden element
and norm short in bfloat16), and its gated attention's gate, q/k norms and gated
output (the estimate counts Qwen2.5-VL's attention); q/k norms of Qwen3-VL likewise.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

import torch

from rollplex.config.sections import LoRAConfig
from rollplex.models.family import FamilyArgs, ParamCounts
from rollplex.models.registry import family_of
from rollplex.rl.memory.inputs import BatchShape, MemoryOptions
from rollplex.rl.schedules.prompt_items import PromptItem, PromptKind
from rollplex.train.logprob_head import logits_chunk_tokens
from rollplex.train.lora import LoRALinear, apply_lora

FP32 = 4  # bytes: RMSNorm and the loss work in float32 whatever the model's dtype
DELTA_CHUNK = 64  # tokens per chunk of the gated delta rule (rollplex.ops.gated_delta's chunk_size, and fla's)
INDEX = 8  # bytes: an int64 index (an MoE block's chosen experts, its token-expert pairs' order and tokens)
ROUTE = 2  # bytes: an expert index as routes are kept, int16 (rollplex.models.moe.LayerRoutes, the route log)


# ----------------------------------------------------------------------------- exact counts


def count_params(args: FamilyArgs) -> ParamCounts:
    """The model's parameter counts, from its family's layer shapes (rollplex.models.family)."""
    return family_of(args).count_params(args)


@dataclass(frozen=True)
class AdaptedLinear:
    """One Linear with a LoRA adapter: A (rank, in_features) and B (out_features, rank)."""

    name: str  # its dotted name in the model
    unit: Literal["decoder", "vision", "root", "vision_root"]  # its FSDP unit: a decoder layer, a vision block,
    # or the root unit (vision_root: the tower's part of it, the merger(s), run once per merged token)
    index: int  # of its decoder layer or vision block (-1 in the root unit)
    in_features: int
    out_features: int
    split: Literal["in", "out", ""]  # the side tensor parallelism splits ("": replicated, as the plan's vision)

    def elements(self, rank: int, tp: int = 1) -> int:
        """A's and B's elements on one of `tp` ranks: a column-parallel layer splits B with its
        output rows, a row-parallel one A with its input columns (rollplex.train.lora)."""
        a, b = rank * self.in_features, rank * self.out_features
        return a + b if self.split == "" else a + b // tp if self.split == "out" else a // tp + b

    def split_elements(self, rank: int) -> int:
        return {"in": rank * self.in_features, "out": rank * self.out_features, "": 0}[self.split]

    def saved_bytes(self, rank: int, dropout: float, size: int, tp: int) -> int:
        """What the adapter adds to what a pass keeps for backward, per token through the layer:
        x A^T (rank wide, B's gradient reads it); with dropout, the dropped input (A's gradient
        reads it) and its mask. Without dropout A's gradient reads the layer's input itself, which
        the estimates count already (a trained base weight's gradient read it too)."""
        width = self.in_features // tp if self.split == "in" else self.in_features
        return rank * size + (width * (size + 1) if dropout > 0 else 0)


@dataclass(frozen=True)
class LoRACounts:
    """A LoRA run's adapters (`count_lora`), and the vision tower's parts the trainer shards
    when lora.train_vision trains it in full."""

    rank: int
    dropout: float
    linears: tuple[AdaptedLinear, ...]
    vision: int  # the vision tower's elements
    vision_root: int  # of which in FSDP's root unit (patch embedding, merger(s))
    vision_block: int  # the largest vision block's (an FSDP unit)

    def adapters(self) -> ParamCounts:
        """The adapters' elements in the base's classes (rollplex.models.family.ParamCounts), so that the
        plan counts their shards, gathered units and gradients as the base's; the layer is the largest
        decoder layer's."""
        r, layers = self.rank, self.linears
        per_layer: dict[int, list[AdaptedLinear]] = {}
        for linear in layers:
            if linear.unit == "decoder":
                per_layer.setdefault(linear.index, []).append(linear)
        largest = max(per_layer.values(), key=lambda ls: sum(lin.elements(r) for lin in ls), default=[])
        root = [lin for lin in layers if lin.unit in ("root", "vision_root")]
        layer_split = sum(lin.split_elements(r) for lin in largest)
        return ParamCounts(total=sum(lin.elements(r) for lin in layers),
                           tp_split=sum(lin.split_elements(r) for lin in layers),
                           vision=sum(lin.elements(r) for lin in layers if lin.unit in ("vision", "vision_root")),
                           root=sum(lin.elements(r) for lin in root),
                           root_tp_split=sum(lin.split_elements(r) for lin in root),
                           layer_tp_split=layer_split,
                           layer_replicated=sum(lin.elements(r) for lin in largest) - layer_split)

    def trained(self, train_vision: bool) -> ParamCounts:
        """What FSDP shards, gathers and trains with LoRA (rollplex.train.parallelize): the adapters,
        and with lora.train_vision the vision tower's weights (its root part in the root unit). The
        layer a pass gathers beside the root is then the larger of a decoder layer's adapters and a
        vision block."""
        a = self.adapters()
        if not train_vision:
            return a
        layer = a.layer_tp_split + a.layer_replicated
        return dataclasses.replace(a, total=a.total + self.vision, vision=a.vision + self.vision,
                                   root=a.root + self.vision_root,
                                   layer_tp_split=a.layer_tp_split if layer >= self.vision_block else 0,
                                   layer_replicated=a.layer_replicated if layer >= self.vision_block else
                                   self.vision_block)

    def decoder_saved(self, size: int, tp: int, largest_layer: bool = False) -> int:
        """Per token, what the decoder's adapters add to a pass's saved tensors: over every layer,
        or the largest layer's (what its backward recomputes under activation checkpointing)."""
        per_layer: dict[int, int] = {}
        for lin in self.linears:
            if lin.unit == "decoder":
                per_layer[lin.index] = per_layer.get(lin.index, 0) + lin.saved_bytes(self.rank, self.dropout, size, tp)
        return max(per_layer.values(), default=0) if largest_layer else sum(per_layer.values())

    def vision_saved(self, size: int, spatial_merge: int, checkpointing: bool) -> int:
        """Per patch, what the vision tower's adapters add to a pass's saved tensors: its blocks'
        (none under checkpointing: a block keeps its input only) and its merger's (run once per
        merged token, spatial_merge**2 patches)."""
        block = 0 if checkpointing else \
            sum(lin.saved_bytes(self.rank, self.dropout, size, 1) for lin in self.linears if lin.unit == "vision")
        merger = sum(lin.saved_bytes(self.rank, self.dropout, size, 1) for lin in self.linears
                     if lin.unit == "vision_root")
        return block + merger // spatial_merge ** 2


# by repr(args), repr(lora), skip_vision: the run asks each step
_LORA_COUNTS: dict[tuple[str, str, bool], LoRACounts] = {}


def count_lora(args: FamilyArgs, lora: LoRAConfig, skip_vision: bool = False) -> LoRACounts:
    """The adapters lora.rank > 0 puts on the model, exactly: apply_lora on a meta-device model
    of the family (no memory; it raises as a run would when the targets select no layer). The
    side tensor parallelism splits is Megatron's (rollplex.models.qwen_vl.tp_plan): a decoder's
    column-parallel layers read the hidden state and split their outputs, its row-parallel ones
    write it and split their inputs, so the side that is not the hidden width splits (both
    sides the hidden width: either, same count); the vision tower counts as replicated, as the
    plan's ParamCounts does. `skip_vision`: parallel.freeze_vision, under which the tower gets none."""
    key = (repr(args), repr(lora), skip_vision)
    if key not in _LORA_COUNTS:
        _LORA_COUNTS[key] = _count_lora(args, lora, skip_vision)
    return _LORA_COUNTS[key]


def _count_lora(args: FamilyArgs, lora: LoRAConfig, skip_vision: bool) -> LoRACounts:
    family = family_of(args)
    with torch.device("meta"):
        model = family.model_class(args)
    tower = family.vision_tower(model)
    in_tower = {id(m) for m in tower.modules()}
    block_of: dict[int, int] = {}  # module id -> the index of its decoder layer or vision block
    vision_blocks = []  # each block's elements, before the adapters join them
    for blocks in family.repeated_blocks(model):
        for index, block in enumerate(blocks):
            block_of.update((id(m), index) for m in block.modules())
            if id(block) in in_tower:
                vision_blocks.append(sum(p.numel() for p in block.parameters()))
    vision = sum(p.numel() for p in tower.parameters())
    apply_lora(model, lora, skip=tower if skip_vision else None)
    hidden, linears = args.text.hidden_size, []
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            in_vision, index = id(module) in in_tower, block_of.get(id(module), -1)
            unit = ("vision" if in_vision else "decoder") if index >= 0 else "vision_root" if in_vision else "root"
            out_features, in_features = module.weight.shape
            split = "" if in_vision else "in" if out_features == hidden else "out"
            linears.append(AdaptedLinear(name, unit, index, in_features, out_features, split))
    return LoRACounts(lora.rank, lora.dropout, tuple(linears), vision, vision - sum(vision_blocks),
                      max(vision_blocks, default=0))


def layer_counts(args: FamilyArgs) -> tuple[int, int]:
    """(attention layers, recurrent layers) of the decoder: those that keep K/V (ModelFamily.kv_layers: every
    layer but in Qwen3.5), and the rest, which carry a recurrent state instead (Qwen3.5's Gated DeltaNet, the
    only such kind so far)."""
    attention = len(family_of(args).kv_layers(args))
    return attention, args.text.num_hidden_layers - attention


def kv_bytes_per_token(args: FamilyArgs, dtype: torch.dtype = torch.bfloat16, tp: int = 1) -> int:
    """Keys and values of one token in every decoder layer that keeps them, on one of `tp` ranks."""
    t = args.text
    if t.num_key_value_heads % tp:
        raise ValueError(f"tp {tp} does not divide num_key_value_heads {t.num_key_value_heads}")
    return 2 * len(family_of(args).kv_layers(args)) * (t.num_key_value_heads // tp) * t.head_dim * dtype.itemsize


def state_pool_bytes(args: FamilyArgs, max_num_seqs: int, tp: int = 1) -> int:
    """The engine's recurrent-state pool (rollplex.engine.recurrent_state), allocated once for the run like
    the KV pool: a row per decode slot and a sink row, each one sequence's state over every recurrent layer
    on one of `tp` ranks (ModelFamily.recurrent_state_bytes: 0 for an attention-only family)."""
    return (max_num_seqs + 1) * family_of(args).recurrent_state_bytes(args, tp)


def kv_pool_need(args: FamilyArgs, batch: BatchShape, prompts: int, options: MemoryOptions, tp: int) -> int:
    """The KV pool a generation of `prompts` prompts could fill: every sample's blocks at
    full length, plus the sink block."""
    blocks = prompts * batch.n * -(-batch.sequence_len // options.block_size)
    return (blocks + 1) * options.block_size * kv_bytes_per_token(args, options.param_dtype, tp)


# ----------------------------------------------------------------------------- experts (MoE)


def moe_of(args: FamilyArgs) -> Any:
    """The decoder's experts (rollplex.models.moe.MoEArgs, the text args' `moe`); None for a dense model."""
    return getattr(args.text, "moe", None)


def sparse_layers(args: FamilyArgs) -> list[bool]:
    """Which decoder layers have a sparse MoE block as their MLP (MoEArgs.is_sparse; none in a dense model)."""
    moe = moe_of(args)
    return [moe is not None and moe.is_sparse(i) for i in range(args.text.num_hidden_layers)]


@dataclass(frozen=True)
class ExpertCounts:
    """The routed experts' elements (each MoE layer's `Experts`: gate_up_proj and down_proj), which expert
    parallelism splits ep ways (rollplex.models.expert_parallel); the router and the shared expert are
    ordinary weights, FSDP-sharded over every dp rank. `count_params` counts every expert in the model's
    total and in its decoder layers' figures: with ep 1 a sparse layer's FSDP unit gathers all of them."""

    per_layer: int  # one MoE layer's experts
    layers: int  # MoE layers
    in_largest_layer: int  # the experts of the decoder layer ParamCounts' layer figures are (the largest unit)

    @property
    def total(self) -> int:
        return self.per_layer * self.layers


def expert_counts(args: FamilyArgs) -> ExpertCounts:
    """The routed experts' elements (`ExpertCounts`); all zero for a dense model. The largest decoder layer is
    a sparse one unless a dense layer's SwiGLU (intermediate_size) outweighs the experts."""
    moe, t = moe_of(args), args.text
    sparse = sum(sparse_layers(args))
    if moe is None or not sparse:
        return ExpertCounts(0, 0, 0)
    per_layer = moe.num_experts * 3 * t.hidden_size * moe.moe_intermediate_size
    dense_mlp = 3 * t.hidden_size * t.intermediate_size if sparse < t.num_hidden_layers else 0
    return ExpertCounts(per_layer, sparse, per_layer if per_layer >= dense_mlp else 0)


def route_bytes_per_token(args: FamilyArgs) -> int:
    """One token's routes over every decoder layer, as routing replay keeps them (int16 per layer and expert
    chosen: the engine's route log, a sample's routes, a pass's replayed routes). 0 for a dense model."""
    moe = moe_of(args)
    return 0 if moe is None else args.text.num_hidden_layers * moe.num_experts_per_tok * ROUTE


def route_log_bytes(args: FamilyArgs, max_num_seqs: int, batch: BatchShape) -> int:
    """The engine's route log during a rollout with routing replay (rollplex.engine.routes.RouteLog): a row per
    decode row (max_num_seqs, or a larger group), each a response's tokens and one more, int16 per layer and
    expert chosen, on the device; freed when the rollout ends (the samples keep their pieces)."""
    return max(max_num_seqs, batch.n) * (batch.response_tokens + 1) * route_bytes_per_token(args)


def sample_routes_bytes(args: FamilyArgs, batch: BatchShape, prompts: int) -> int:
    """The routes `prompts` prompts' samples carry from the pass that recorded them to the end of the step
    (rollplex.models.inputs.Sample: a group's prompt routes once, its samples share them, and each response's),
    on the device."""
    return prompts * (batch.prompt_len + batch.n * batch.response_tokens) * route_bytes_per_token(args)


# ----------------------------------------------------------------------------- activations


def _norm_bytes(width: int, size: int, frozen: bool = False) -> int:
    """What an RMSNorm keeps per token for backward: its input in float32, the
    normalised value and the output, both in the model's dtype (`size` bytes). The
    normalised value is kept for the weight's gradient only: a frozen norm (LoRA's
    base) keeps none."""
    return (FP32 + (1 if frozen else 2) * size) * width


def _attention_bytes(q_dim: int, kv_dim: int, size: int, attention: str) -> int:
    """Per token, what an attention kernel's backward keeps: q, k, v and the output
    (flash-attn varlen). The torch path gathers q, k and v per segment group, so it
    keeps those copies, the kernel's output and the scattered output."""
    return (3 * q_dim + 2 * kv_dim if attention == "torch" else 2 * q_dim + 2 * kv_dim) * size


def sparse_mlp_bytes(t: Any, size: int) -> int:
    """Per token, what a sparse MoE block (rollplex.models.moe.SparseMoE) keeps for backward, read off its code
    and measured on CPU (tests/test_memory.py: exact in float32 and bfloat16, either grouped GEMM backend):
    - the router: softmax's float32 probabilities over the E experts, the k experts chosen (int64: the gather's
      index), with norm_topk_prob the chosen weights and their sum in float32 (the division's operands), and
      the routes the forward's `Routing` records (int16);
    - per routed pair (k per token): the token's row gathered (hidden: the first GEMM's input), gate_up's output
      (2 x moe_intermediate: silu reads its gate half, the product its up half), silu's output and the product
      (the second GEMM's input), the experts' output (hidden: the weighting reads it) and the weighted rows
      (hidden: index_add keeps its source), the pair's weight, and two int64 indices (the pairs' order and
      each pair's token);
    - the shared expert (Qwen3.5-MoE's), as a dense SwiGLU: its four intermediates, its output and its gate.
    Under expert parallelism (rollplex.models.expert_parallel) the rows a rank receives replace the gathered
    rows and the rows sent back replace the experts' output: the same bytes where the ranks receive alike,
    plus two int64 indices (16 bytes) a pair, not counted (about 0.1%). A rank that receives more pairs than
    its tokens send keeps that much more."""
    m = t.moe
    k, h, width = m.num_experts_per_tok, t.hidden_size, m.moe_intermediate_size
    router = m.num_experts * FP32 + k * (INDEX + ROUTE) + ((k + 1) * FP32 if m.norm_topk_prob else 0)
    pair = (3 * h + 4 * width + 1) * size + 2 * INDEX
    shared = m.shared_expert_intermediate_size
    return router + k * pair + ((4 * shared + h + 1) * size if shared else 0)


def sparse_mlp_forward_bytes(t: Any, size: int, ep: int = 1) -> int:
    """Per token, a sparse MoE block's working memory in a forward without a graph (measured on CPU with the
    grouped GEMM, the GPU's backend: tests/test_memory.py): the router's float32 probabilities and three int64
    indices per pair, and the most of, per pair: the gathered row, gate_up's output, the product and the
    experts' output (or silu's output, when wider); the gathered row, the experts' output and the weighted
    rows; or the router's logits and their float32 softmax. With expert parallelism (ep > 1) the rows in
    flight add up: the rows sent, received and regrouped beside the experts' intermediates, then the rows
    sent, received, the experts' output, its reordered copy and the rows it came back as (two more indices a
    pair). The shared expert runs after the routed pairs, on far fewer bytes."""
    m = t.moe
    k, h, width = m.num_experts_per_tok, t.hidden_size, m.moe_intermediate_size
    if ep == 1:
        pair = size * max(2 * h + 3 * width, h + 4 * width, 3 * h)
    else:
        pair = size * max(3 * h + 3 * width + max(width, h), 5 * h) + 2 * INDEX
    shared = size * max(h + 3 * m.shared_expert_intermediate_size, 4 * h)
    return m.num_experts * FP32 + 3 * k * INDEX + max(k * pair, m.num_experts * (size + FP32), shared)


def dispatch_bytes(t: Any, size: int) -> int:
    """Per token, what expert parallelism's token exchange holds beyond a sparse layer's saved tensors at its
    peak in a forward with a graph (the rows sent, received, the experts' output and its reordered copy in
    flight, less the weighted rows not made yet): (3k - 1) rows of hidden (measured on CPU through a
    one-rank group: tests/test_memory.py)."""
    return (3 * t.moe.num_experts_per_tok - 1) * t.hidden_size * size


def _norms_and_mlp_bytes(t: Any, size: int, tp: int, frozen: bool, sparse: bool = False) -> int:
    """Per token, what every decoder layer keeps for backward beside its token mixer: its two norms
    (`frozen`: LoRA's base) and its MLP: the SwiGLU's gate, silu(gate), up and their product, or a
    sparse layer's MoE block (`sparse_mlp_bytes`, which MoE families run at tp 1)."""
    mlp = sparse_mlp_bytes(t, size) if sparse else 4 * (t.intermediate_size // tp) * size
    return 2 * _norm_bytes(t.hidden_size, size, frozen) + mlp


def decoder_layer_bytes(t: Any, size: int, tp: int = 1, attention: str = "torch", frozen: bool = False,
                        sparse: bool = False) -> int:
    """Bytes per token an attention decoder layer keeps for backward: its norms and MLP (`sparse`: an MoE
    block), and its attention."""
    q, kv = t.num_attention_heads * t.head_dim // tp, t.num_key_value_heads * t.head_dim // tp
    return _norms_and_mlp_bytes(t, size, tp, frozen, sparse) + _attention_bytes(q, kv, size, attention)


def _delta_rule_saved_bytes(t: Any, size: int, tp: int, attention: str) -> int:
    """Per token, what the gated delta rule keeps for backward, per value head and chunk of DELTA_CHUNK tokens.
    The plain-torch chunked scan (attention "torch": rollplex.ops.gated_delta) keeps nine key-wide float32
    tensors (q and k expanded to the value heads and their chunked copies, k * beta and its decayed copy,
    the decayed q and k, W), four value-wide ones (v in float32, its chunked copy, v * beta, the corrected
    values), six chunk-wide ones (the decays, K K^T, the system, its inverse, Q K^T, the scores) and the state
    entering each chunk (plus one per sequence; a sequence shorter than a chunk is padded to one: short
    responses keep more per token). fla's kernel (CUDA, the [gpu] extra beside flash-attn; read off fla-core
    0.6's chunk_gated_delta_rule, not measured here) keeps q, k and v in the model's dtype, the cumulated decay,
    beta and its per-chunk triangular solve, and recomputes the states in its backward."""
    heads, key_dim, value_dim = t.linear_num_value_heads // tp, t.linear_key_head_dim, t.linear_value_head_dim
    if attention == "torch":
        return FP32 * heads * (9 * key_dim + 4 * value_dim + 6 * DELTA_CHUNK + key_dim * value_dim // DELTA_CHUNK)
    keys = t.linear_num_key_heads // tp * key_dim
    return (2 * keys + heads * value_dim) * size + heads * (FP32 + size + DELTA_CHUNK * size)


def deltanet_layer_bytes(t: Any, size: int, tp: int = 1, attention: str = "torch", frozen: bool = False,
                         sparse: bool = False) -> int:
    """Bytes per token a Gated DeltaNet decoder layer (rollplex.models.qwen3_5.deltanet) keeps for backward:
    its norms and MLP (`sparse`: an MoE block) as an attention layer's; the convolution's input as in_proj_qkv
    wrote it, its padded copy and its pre-SiLU output; q and k in float32 before their L2 norm; beta and the
    decay (sigmoid's output, softplus's float32 input and output); the delta rule's (`_delta_rule_saved_bytes`);
    the gated norm (an RMSNorm over the value heads, silu(z)'s float32 input and output) and out_proj's input."""
    keys = t.linear_num_key_heads // tp * t.linear_key_head_dim
    values, heads = t.linear_num_value_heads // tp * t.linear_value_head_dim, t.linear_num_value_heads // tp
    convolution = 3 * (2 * keys + values) * size
    gates = 2 * keys * FP32 + heads * (size + 2 * FP32)
    gated_norm = _norm_bytes(values, size, frozen) + 2 * values * FP32 + values * size
    return _norms_and_mlp_bytes(t, size, tp, frozen, sparse) + convolution + gates + \
        _delta_rule_saved_bytes(t, size, tp, attention) + gated_norm


def _keeps_kv(args: FamilyArgs) -> list[bool]:
    """Which decoder layers are attention layers (keep K/V: ModelFamily.kv_layers); the rest are Gated DeltaNet
    layers, which only Qwen3.5's hybrid decoders have."""
    kv = set(family_of(args).kv_layers(args))
    return [i in kv for i in range(args.text.num_hidden_layers)]


def _layer_kinds(args: FamilyArgs, size: int, tp: int, attention: str, frozen: bool) -> list[tuple[int, int, bool]]:
    """(layers, bytes per token each keeps for backward, sparse) of each layer kind the decoder has: its mixer's
    (attention or Gated DeltaNet: `layer_counts`) with its MLP's (a SwiGLU or a sparse MoE block: `sparse_layers`)."""
    kinds = []
    for (kv, sparse), n in Counter(zip(_keeps_kv(args), sparse_layers(args))).items():
        layer = decoder_layer_bytes if kv else deltanet_layer_bytes  # only then do the args have the DeltaNet's sizes
        kinds.append((n, layer(args.text, size, tp, attention, frozen, sparse), sparse))
    return kinds


def vision_patch_bytes(args: FamilyArgs, size: int, checkpointing: bool, attention: str = "torch",
                       frozen: bool = False) -> int:
    """Bytes per patch the vision tower keeps for backward: every block (its input
    alone with checkpointing; else its two norms, its attention and the MLP's
    intermediates, as many as the family's MLP keeps) and the merger (its norm,
    and its two linears' inputs: 4 x width per merged token, a quarter of the
    patches). The patch embedding keeps its input, the prepared pixels, which the
    plan counts with the batch's inputs (not at all). `frozen`: its norms are LoRA's
    frozen base (the graph is there for the tower's adapters)."""
    v = args.vision
    w, kept = v.hidden_size, family_of(args).vision_mlp_widths[0]
    block = w * size if checkpointing else \
        2 * _norm_bytes(w, size, frozen) + _attention_bytes(w, w, size, attention) + kept * v.intermediate_size * size
    return v.depth * block + _norm_bytes(w, size, frozen) + 2 * w * size


def _lora(args: FamilyArgs, options: MemoryOptions) -> LoRACounts | None:
    return count_lora(args, options.lora, options.freeze_vision) if options.lora.rank > 0 else None


def layer_backward_bytes(args: FamilyArgs, size: int, tp: int, options: MemoryOptions, ep: int = 1) -> int:
    """Per token, the largest decoder layer kind's saved tensors (`_layer_kinds`) with its adapters'
    (LoRA): what its backward holds, and under activation checkpointing recomputes; a sparse layer's
    with expert parallelism (ep > 1) also the token exchange's rows in flight (`dispatch_bytes`)."""
    lora = _lora(args, options)
    extra = lora.decoder_saved(size, tp, largest_layer=True) if lora else 0
    return max(per_token + (dispatch_bytes(args.text, size) if sparse and ep > 1 else 0)
               for _, per_token, sparse in _layer_kinds(args, size, tp, options.attention, lora is not None)) + extra


def _decoder_saved(args: FamilyArgs, size: int, tp: int, options: MemoryOptions) -> int:
    """Per token, what the decoder stack and the final norm keep from forward to
    backward: every layer's saved tensors by its kind (and its adapters'), or with
    checkpointing every layer's input."""
    t, lora = args.text, _lora(args, options)
    if options.activation_checkpointing:
        layers = t.num_hidden_layers * t.hidden_size * size
    else:
        layers = sum(n * per_token for n, per_token, _ in _layer_kinds(args, size, tp, options.attention,
                                                                       lora is not None)) + \
            (lora.decoder_saved(size, tp) if lora else 0)
    return layers + (FP32 + size) * t.hidden_size


def _vision_saved(args: FamilyArgs, size: int, options: MemoryOptions) -> int:
    """Per patch, what the vision tower keeps for backward (`vision_patch_bytes`) and its adapters' (LoRA;
    under checkpointing a block keeps its input only, so its adapters' count in no graph)."""
    lora = _lora(args, options)
    extra = lora.vision_saved(size, args.vision.spatial_merge_size, options.activation_checkpointing) if lora else 0
    frozen = options.lora.adapters_only
    return vision_patch_bytes(args, size, options.activation_checkpointing, options.attention, frozen) + extra


def _delta_rule_forward_bytes(t: Any, size: int, tp: int, attention: str) -> int:
    """Per token, a Gated DeltaNet mixer's working memory in a forward without a graph: the convolution's
    output, q and k normalised in float32, the delta rule's peak and its output in the model's dtype. The
    plain-torch scan peaks at its end, per value head: the expanded and chunked q and k, W, the decayed q
    and k (seven key-wide float32 tensors), v chunked, U, the output chunks and their two reshaped copies
    (five value-wide), and the scores (tests/test_memory.py measures the layer within 15%: the states between
    chunks and the scan's temporaries are left out). fla's (read off its code, not measured): its W, U,
    corrected values, output, triangular solve and the states between chunks, in the model's dtype."""
    keys = t.linear_num_key_heads // tp * t.linear_key_head_dim
    heads, key_dim, value_dim = t.linear_num_value_heads // tp, t.linear_key_head_dim, t.linear_value_head_dim
    layer = (2 * keys + 2 * heads * value_dim) * size + 2 * keys * FP32
    if attention == "torch":
        return layer + FP32 * heads * (7 * key_dim + 5 * value_dim + DELTA_CHUNK)
    return layer + size * heads * (key_dim + 3 * value_dim + DELTA_CHUNK + key_dim * value_dim // DELTA_CHUNK)


def _layer_forward_bytes(args: FamilyArgs, size: int, tp: int, attention: str, ep: int = 1) -> int:
    """Per token, the working memory of one decoder layer's forward without a
    graph: the residual, its norm in float32, and the largest of three SwiGLU
    intermediates (where a layer is dense), a sparse MoE block's (where one is:
    `sparse_mlp_forward_bytes`, its token exchange's with ep > 1: the trainer's
    passes; the engine never dispatches) and, in a decoder with recurrent layers,
    a DeltaNet mixer's."""
    t, sparse = args.text, sparse_layers(args)
    mlp = 3 * t.intermediate_size // tp * size if not all(sparse) else 0
    moe = sparse_mlp_forward_bytes(t, size, ep) if any(sparse) else 0
    mixer = _delta_rule_forward_bytes(t, size, tp, attention) if layer_counts(args)[1] else 0
    return (FP32 + size) * t.hidden_size + max(mlp, moe, mixer)


def _vision_forward_bytes(args: FamilyArgs, size: int) -> int:
    """Per patch, the working memory of one vision block's forward without a graph:
    the residual, its norm in float32, and the MLP's intermediates live at once."""
    v = args.vision
    return (FP32 + size) * v.hidden_size + family_of(args).vision_mlp_widths[1] * v.intermediate_size * size


def _logits_bytes(args: FamilyArgs, tokens: int, grad: bool, options: MemoryOptions) -> int:
    """The peak of the logits and the loss over them for `tokens` response tokens: the
    head computes them a chunk of tokens at a time (rollplex.train.logprob_head), so
    for at most one chunk's. Per token (measured with the torch profiler on CPU, in
    float32 and bfloat16 alike): a pass without gradients holds two float32
    vocabulary rows (the logits and their log-softmax); forward and backward hold up
    to six with the entropy bonus, four without it."""
    tokens = min(tokens, options.logits_chunk_tokens or logits_chunk_tokens(args.text.vocab_size))
    rows = (6 if options.entropy else 4) if grad else 2
    return tokens * rows * FP32 * args.text.vocab_size


# ----------------------------------------------------------------------------- prefix state


@dataclass(frozen=True)
class KeptPromptState:
    """What one prompt-work item keeps from its prompt forward to its suffix passes, on one rank."""

    # The K/V of the prompt tokens in every layer that keeps them, each prompt's last hidden state and its
    # final recurrent state (the recurrent layers' convolution tail and delta-rule state) (exact).
    kv: int
    graph: int  # the actor's autograd graph: saved activations, vision tower included when it runs (estimate)

    @property
    def total(self) -> int:
        return self.kv + self.graph


def kept_prompt_state(args: FamilyArgs, item: PromptItem, prompts: int, tokens: int, patches: int,
                 options: MemoryOptions, tp: int = 1) -> KeptPromptState:
    """The estimate the prompt-work scheduler admits by and the plan sums, for `prompts`
    prompts of `tokens` tokens in all and `patches` vision patches. The K/V and the
    prompts' recurrent states are kept once per item; with flash-attn the graph saves
    those same K/V, with the torch path it saves its own gathered copies (`decoder_layer_bytes`)."""
    t, size, family = args.text, options.param_dtype.itemsize, family_of(args)
    kv = tokens * kv_bytes_per_token(args, options.param_dtype, tp) + \
        prompts * (t.hidden_size * size + family.recurrent_state_bytes(args, tp))
    if replays_routes(options.routing_replay, item.kind):  # the prompts' recorded routes, kept with its inputs
        kv += tokens * route_bytes_per_token(args)
    if not item.keep_graph:
        return KeptPromptState(kv, 0)
    shared_kv = 0 if options.attention == "torch" or options.activation_checkpointing else \
        len(family.kv_layers(args)) * 2 * t.num_key_value_heads * t.head_dim // tp * size
    graph = tokens * (_decoder_saved(args, size, tp, options) - shared_kv)
    if not (item.reuses_vision or options.freeze_vision):
        graph += patches * _vision_saved(args, size, options)
    return KeptPromptState(kv, graph)


def replays_routes(routing_replay: str, kind: PromptKind | str) -> bool:
    """Whether a prompt-work item of `kind` replays the samples' recorded routes (rollplex.train.routes.routes_of):
    every pass under rollout replay (R3); the actor's, the update's prompt, under old replay (R2)."""
    return routing_replay == "rollout" or (routing_replay == "old" and kind == PromptKind.ACTOR)


def admitted(estimates: list[int], budget: int | None) -> list[bool]:
    """Which prompt-work items a byte budget admits (None: all): in order, each one whose
    estimate fits beside those admitted before it. The rest take the serial path."""
    used, out = 0, []
    for estimate in estimates:
        fits = budget is None or used + estimate <= budget
        used += estimate if fits else 0
        out.append(fits)
    return out


# ----------------------------------------------------------------------------- micro-batches


@dataclass(frozen=True)
class MicroBatch:
    """The largest micro-batch a token budget lets the actor build (rollplex.train.actor)."""

    tokens: int  # through the decoder
    responses: int  # response tokens: logits
    sequences: int  # responses
    prompts: int  # prompts computed in it (0 over kept prompts)
    patches: int  # through the vision tower: its prompts' and, multi-turn, its responses' observations'


def micro_batch(args: FamilyArgs, batch: BatchShape, budget: int, groups: int, share_prefix: bool,
                kept: bool, observation_vision: bool = False) -> MicroBatch:
    """A budget counts a unit's prompt once with its responses (share_prefix) or once
    per response, and kept prompts too, though a pass over them computes responses
    only. Responses may end early, so units pack tighter than at full length: the
    most response tokens a micro-batch can hold is, over the number g of prompts in
    it, the smaller of g full units and the budget less g prompts.

    `observation_vision` (a multi-turn run): the pass also runs the tower over its
    responses' observation images, per response (rollplex.models.packing,
    rollplex.train.kept_prefix), whose pads are response tokens: at most every
    response token is one, spatial_merge_size**2 patches each. rollout.max_observation_tokens
    does not lower this bound: responses that end early (a call, then an observation
    up to that cap) pack as many as the budget holds, nearly all observation tokens."""
    per_prompt = batch.n if share_prefix else 1  # responses a prompt's tokens are counted once for
    units = groups * (1 if share_prefix else batch.n)
    best = (0, 1)
    for g in range(1, units + 1):
        room = budget - g * batch.prompt_len
        if room < min(batch.response_tokens, budget):
            break
        best = max(best, (min(g * per_prompt * batch.response_tokens, room), g))
    responses, g = best
    sequences = -(-responses // batch.response_tokens)
    prompts = 0 if kept else g if share_prefix else sequences
    observation_patches = responses * args.vision.spatial_merge_size ** 2 if observation_vision else 0
    return MicroBatch(responses + prompts * batch.prompt_len, responses, sequences, prompts,
                      prompts * batch.vision_patches(args) + observation_patches)


def micro_batch_bytes(args: FamilyArgs, mb: MicroBatch, batch: BatchShape, options: MemoryOptions, tp: int,
                      grad: bool, ep: int = 1) -> int:
    """Peak working memory of one micro-batch's pass: with gradients, every token's
    saved activations (the vision tower's too when it trains), then the larger of
    the logits' peak and one layer's backward; without, the larger of one layer's
    forward and the logits. The torch path also keeps, per response and layer, its
    copy of the prompt's K/V (`PrefixedSegments`). An MoE model's pass also keeps
    its routes: every sparse layer's chosen experts (int16; in a pass with gradients,
    with the layer's saved tensors), and with routing replay the replayed routes
    of its tokens. `ep`: expert parallelism's token exchange in its sparse layers."""
    t, size = args.text, options.param_dtype.itemsize
    moe = moe_of(args)
    routes = mb.tokens * route_bytes_per_token(args) if options.routing_replay != "none" else 0
    logits = _logits_bytes(args, mb.responses, grad, options)
    if grad:  # the head's gradient of the response tokens' hidden states, written chunk by chunk
        logits += mb.responses * t.hidden_size * size
    if not grad:
        vision = mb.patches * _vision_forward_bytes(args, size)
        records = mb.tokens * sum(sparse_layers(args)) * moe.num_experts_per_tok * ROUTE if moe else 0
        return max(mb.tokens * _layer_forward_bytes(args, size, tp, options.attention, ep), logits, vision) + \
            mb.tokens * t.hidden_size * size + records + routes
    saved = mb.tokens * _decoder_saved(args, size, tp, options) + routes
    if not options.freeze_vision:
        saved += mb.patches * _vision_saved(args, size, options)
    if options.attention == "torch" and options.share_prefix:
        saved += mb.sequences * batch.prompt_len * len(family_of(args).kv_layers(args)) * \
            2 * t.num_key_value_heads * t.head_dim // tp * size
    return saved + max(logits, mb.tokens * layer_backward_bytes(args, size, tp, options, ep))
