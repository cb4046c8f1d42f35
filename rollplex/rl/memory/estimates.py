"""One estimator per tensor class, used by the plan and by the run itself: the
prompt-work scheduler admits prompt work by `kept_prompt_state` and `admitted`, the
functions the plan sums. Exact (closed formulas on the model's shape):
parameters, gradients, optimizer state, KV pool, prompt K/V, vision embeddings.
Estimated, from the tensors the model's code saves for backward (checked against
CPU measurements in tests/test_memory.py): activations, the prefix graph, and
the transient working memory of the engine and the prompt slices (`workspace`)
and of the logprob and training passes (`activations`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rollplex.models.family import FamilyArgs, ParamCounts
from rollplex.models.registry import family_of
from rollplex.rl.memory.inputs import BatchShape, MemoryOptions
from rollplex.rl.schedules.prompt_items import PromptItem
from rollplex.train.logprob_head import logits_chunk_tokens

FP32 = 4  # bytes: RMSNorm and the loss work in float32 whatever the model's dtype


# ----------------------------------------------------------------------------- exact counts


def count_params(args: FamilyArgs) -> ParamCounts:
    """The model's parameter counts, from its family's layer shapes (rollplex.models.family)."""
    return family_of(args).count_params(args)


def kv_bytes_per_token(args: FamilyArgs, dtype: torch.dtype = torch.bfloat16, tp: int = 1) -> int:
    """Keys and values of one token in every decoder layer, on one of `tp` ranks."""
    t = args.text
    if t.num_key_value_heads % tp:
        raise ValueError(f"tp {tp} does not divide num_key_value_heads {t.num_key_value_heads}")
    return 2 * t.num_hidden_layers * (t.num_key_value_heads // tp) * t.head_dim * dtype.itemsize


def kv_pool_need(args: FamilyArgs, batch: BatchShape, prompts: int, options: MemoryOptions, tp: int) -> int:
    """The KV pool a generation of `prompts` prompts could fill: every sample's blocks at
    full length, plus the sink block."""
    blocks = prompts * batch.n * -(-batch.sequence_len // options.block_size)
    return (blocks + 1) * options.block_size * kv_bytes_per_token(args, options.param_dtype, tp)


# ----------------------------------------------------------------------------- activations


def _norm_bytes(width: int, size: int) -> int:
    """What an RMSNorm keeps per token for backward: its input in float32, the
    normalised value and the output, both in the model's dtype (`size` bytes)."""
    return (FP32 + 2 * size) * width


def _attention_bytes(q_dim: int, kv_dim: int, size: int, attention: str) -> int:
    """Per token, what an attention kernel's backward keeps: q, k, v and the output
    (flash-attn varlen). The torch path gathers q, k and v per segment group, so it
    keeps those copies, the kernel's output and the scattered output."""
    return (3 * q_dim + 2 * kv_dim if attention == "torch" else 2 * q_dim + 2 * kv_dim) * size


def decoder_layer_bytes(t: Any, size: int, tp: int = 1, attention: str = "torch") -> int:
    """Bytes per token one decoder layer keeps for backward: its two norms, its
    attention, and the SwiGLU's gate, silu(gate), up and their product."""
    q, kv, inter = (t.num_attention_heads * t.head_dim // tp, t.num_key_value_heads * t.head_dim // tp,
                    t.intermediate_size // tp)
    return 2 * _norm_bytes(t.hidden_size, size) + _attention_bytes(q, kv, size, attention) + 4 * inter * size


def vision_patch_bytes(args: FamilyArgs, size: int, checkpointing: bool, attention: str = "torch") -> int:
    """Bytes per patch the vision tower keeps for backward: every block (its input
    alone with checkpointing; else its two norms, its attention and the MLP's
    intermediates, as many as the family's MLP keeps) and the merger (its norm,
    and its two linears' inputs: 4 x width per merged token, a quarter of the
    patches). The patch embedding keeps its input, the prepared pixels, which the
    plan counts with the batch's inputs (not at all)."""
    v = args.vision
    w, kept = v.hidden_size, family_of(args).vision_mlp_widths[0]
    block = w * size if checkpointing else \
        2 * _norm_bytes(w, size) + _attention_bytes(w, w, size, attention) + kept * v.intermediate_size * size
    return v.depth * block + _norm_bytes(w, size) + 2 * w * size


def _decoder_saved(t: Any, size: int, tp: int, options: MemoryOptions) -> int:
    """Per token, what the decoder stack and the final norm keep from forward to
    backward: every layer's saved tensors, or with checkpointing every layer's input."""
    layer = t.hidden_size * size if options.activation_checkpointing else \
        decoder_layer_bytes(t, size, tp, options.attention)
    return t.num_hidden_layers * layer + (FP32 + size) * t.hidden_size


def _layer_forward_bytes(t: Any, size: int, tp: int) -> int:
    """Per token, the working memory of one decoder layer's forward without a
    graph: the residual, its norm in float32, and three SwiGLU intermediates."""
    return (FP32 + size) * t.hidden_size + 3 * t.intermediate_size // tp * size


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

    kv: int  # every layer's K/V of the prompt tokens and each prompt's last hidden state (exact)
    graph: int  # the actor's autograd graph: saved activations, vision tower included when it runs (estimate)

    @property
    def total(self) -> int:
        return self.kv + self.graph


def kept_prompt_state(args: FamilyArgs, item: PromptItem, prompts: int, tokens: int, patches: int,
                 options: MemoryOptions, tp: int = 1) -> KeptPromptState:
    """The estimate the prompt-work scheduler admits by and the plan sums, for `prompts`
    prompts of `tokens` tokens in all and `patches` vision patches. The K/V are
    kept once per item; with flash-attn the graph saves those same tensors, with
    the torch path it saves its own gathered copies (`decoder_layer_bytes`)."""
    t, size = args.text, options.param_dtype.itemsize
    kv = tokens * kv_bytes_per_token(args, options.param_dtype, tp) + prompts * t.hidden_size * size
    if not item.keep_graph:
        return KeptPromptState(kv, 0)
    shared_kv = 0 if options.attention == "torch" or options.activation_checkpointing else \
        t.num_hidden_layers * 2 * t.num_key_value_heads * t.head_dim // tp * size
    graph = tokens * (_decoder_saved(t, size, tp, options) - shared_kv)
    if not (item.reuses_vision or options.freeze_vision):
        graph += patches * vision_patch_bytes(args, size, options.activation_checkpointing, options.attention)
    return KeptPromptState(kv, graph)


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
    patches: int  # through the vision tower


def micro_batch(args: FamilyArgs, batch: BatchShape, budget: int, groups: int, share_prefix: bool,
                kept: bool) -> MicroBatch:
    """A budget counts a unit's prompt once with its responses (share_prefix) or once
    per response, and kept prompts too, though a pass over them computes responses
    only. Responses may end early, so units pack tighter than at full length: the
    most response tokens a micro-batch can hold is, over the number g of prompts in
    it, the smaller of g full units and the budget less g prompts."""
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
    return MicroBatch(responses + prompts * batch.prompt_len, responses, sequences, prompts,
                      prompts * batch.vision_patches(args))


def micro_batch_bytes(args: FamilyArgs, mb: MicroBatch, batch: BatchShape, options: MemoryOptions, tp: int,
                      grad: bool) -> int:
    """Peak working memory of one micro-batch's pass: with gradients, every token's
    saved activations (the vision tower's too when it trains), then the larger of
    the logits' peak and one layer's backward; without, the larger of one layer's
    forward and the logits. The torch path also keeps, per response and layer, its
    copy of the prompt's K/V (`PrefixedSegments`)."""
    t, size = args.text, options.param_dtype.itemsize
    logits = _logits_bytes(args, mb.responses, grad, options)
    if grad:  # the head's gradient of the response tokens' hidden states, written chunk by chunk
        logits += mb.responses * t.hidden_size * size
    if not grad:
        vision = mb.patches * _vision_forward_bytes(args, size)
        return max(mb.tokens * _layer_forward_bytes(t, size, tp), logits, vision) + mb.tokens * t.hidden_size * size
    saved = mb.tokens * _decoder_saved(t, size, tp, options)
    if not options.freeze_vision:
        saved += mb.patches * vision_patch_bytes(args, size, options.activation_checkpointing,
                                                 options.attention)
    if options.attention == "torch" and options.share_prefix:
        saved += mb.sequences * batch.prompt_len * t.num_hidden_layers * \
            2 * t.num_key_value_heads * t.head_dim // tp * size
    return saved + max(logits, mb.tokens * decoder_layer_bytes(t, size, tp, options.attention))
