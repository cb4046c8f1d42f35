"""Prompt passes whose K/V are kept, and the suffix-only passes that read them.

A GRPO group's prompt (its image or video tokens and the question) does not
depend on the sampled responses, so its forward can run before the responses
exist, once per prompt. `prompt_forward` runs a chunk of prompts through the
model one decoder layer at a time and keeps, per attention layer, the K/V of
every prompt token (rotary applied), per layer that carries a recurrent state
instead (a hybrid decoder's Gated DeltaNet: short convolution and gated delta
rule, rollplex.ops.gated_delta) each prompt's final convolution tail and
recurrent state, plus the final hidden state of each prompt's last token (which
predicts the first response token). `suffix_hidden` later runs only the
response tokens: each response attends to its prompt's kept K/V and, causally,
to its own tokens, and continues its prompt's kept recurrent states
(`KeptPrefixAttention`), the same math as the packed shared-prefix forward, so
both paths give the same logprobs. Only a group's initial prompt is kept: a
multi-turn response's observations are its own, computed in its suffix pass
(their images through the vision tower there, with gradients when it trains).

For the actor the prompt forward keeps its autograd graph. The suffix passes
read detached copies of the kept tensors (`KeptPrefix.boundary`), leaves
whose gradients accumulate over all micro-batches; `backward_into_prompt` then
runs the prompt's backward once, into the prompt's layers, the projector and
the vision tower.

`prepare_prompts` builds every device tensor a prompt forward reads (inputs,
positions, attention and vision indices) up front, and `prompt_forward` then
reads nothing back from the device and copies nothing to it: the RL loop
prepares before rollout and runs the forward in slices between decode steps,
which must never wait on the GPU (rollplex.rl.prompt_work). A hybrid decoder's
recurrent layers read the prompts' boundaries from the chunk's `PackedSequences`,
built here too; on CUDA flash-linear-attention's kernel reads them back once per
pass (it caches by the tensor), which the torch ops never do.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterator

import torch

from rollplex.device import to_device
from rollplex.models.inputs import Group, Prompt, VisionEmbeds, VisionSlots
from rollplex.models.moe import Routing, moe_args, with_routing
from rollplex.models.packing import concat_vision, pack_sequences, response_inputs
from rollplex.models.protocol import VisionLanguageModel
from rollplex.ops.attention import GroupLayout, KeptPrefixAttention, PackedSegments
from rollplex.ops.gated_delta import PackedSequences, causal_conv1d, chunk_gated_delta_rule
from rollplex.train.flops import prompt_flops


@dataclass
class KeptPrefix:
    """What a chunk of prompts packed end to end leaves for the passes that continue
    them, per decoder layer by its index: an attention layer's K/V, a recurrent
    layer's final states per prompt; and each prompt's last hidden state."""

    keys: dict[int, torch.Tensor]  # per attention layer: (prompt tokens, kv_heads, head_dim)
    values: dict[int, torch.Tensor]
    last_hidden: torch.Tensor  # (prompts, hidden)
    prompt_lens: list[int]
    rope_deltas: list[int]
    flops: float = 0.0  # forward FLOPs of the prompt pass (its backward costs twice that)
    # Per recurrent layer: the short convolution's last inputs (prompts, channels, kernel - 1), and the
    # gated delta rule's state (prompts, value heads, key dim, value dim) in float32.
    conv_states: dict[int, torch.Tensor] = field(default_factory=dict)
    recurrent_states: dict[int, torch.Tensor] = field(default_factory=dict)
    graph_outputs: list[torch.Tensor] = field(default_factory=list)  # set by boundary(): tensors with the graph
    routing: Routing | None = None  # an MoE model's: how the prompt forward routed (rollplex.models.moe)

    @property
    def starts(self) -> list[int]:
        out, offset = [], 0
        for n in self.prompt_lens:
            out.append(offset)
            offset += n
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        return [*self.keys.values(), *self.values.values(), *self.conv_states.values(),
                *self.recurrent_states.values(), self.last_hidden]

    def boundary(self) -> "KeptPrefix":
        """Detached leaf copies (same storage) that collect the suffix passes'
        gradients; this prefix's graph stays reachable through graph_outputs."""
        leaves = iter([t.detach().requires_grad_(True) for t in self.tensors()])

        def leaves_of(kept: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
            return {layer: next(leaves) for layer in kept}

        # Keyword arguments are evaluated in order: the order of tensors().
        return replace(self, keys=leaves_of(self.keys), values=leaves_of(self.values),
                       conv_states=leaves_of(self.conv_states), recurrent_states=leaves_of(self.recurrent_states),
                       last_hidden=next(leaves), graph_outputs=self.tensors())

    def backward_into_prompt(self) -> None:
        """Backpropagate the gradients gathered at the boundary through the prompt
        forward (once for all the micro-batches that read it), then drop them. A kept
        tensor that no trained parameter produced (a frozen first layer's) has no graph
        to run back through."""
        pairs = [(out, leaf.grad) for out, leaf in zip(self.graph_outputs, self.tensors())
                 if leaf.grad is not None and out.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        for leaf in self.tensors():
            leaf.grad = None


class _CapturePrompt:
    """What a prompt forward's layers mix tokens through, keeping what the suffix
    passes read: an attention layer attends causally within each prompt and keeps
    its K/V; a recurrent layer runs its short convolution and gated delta rule over
    each prompt from a zero state and keeps each prompt's final states.

    Under activation checkpointing the prompt's backward runs each layer again:
    each layer keeps the forward's tensors (the ones the suffix passes read), not
    a second copy. A plain class, not a dataclass: FSDP2 rebuilds dataclass
    arguments of a module call (to cast their tensors), which would give each
    layer a fresh copy of the dicts being filled."""

    def __init__(self, attention: PackedSegments, cu_seqlens: PackedSequences):
        self.attention, self.cu_seqlens = attention, cu_seqlens
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.conv_states: dict[int, torch.Tensor] = {}
        self.recurrent_states: dict[int, torch.Tensor] = {}

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.keys.setdefault(layer, k)
        self.values.setdefault(layer, v)
        return self.attention(q, k, v)

    def short_convolution(self, layer: int, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x (T, channels) through the depthwise causal convolution `weight` (channels, kernel), then SiLU."""
        out, tails = causal_conv1d(x, weight, self.cu_seqlens)
        self.conv_states.setdefault(layer, tails)
        return out

    def gated_delta(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor) -> torch.Tensor:
        """The gated delta rule over each prompt (rollplex.ops.gated_delta.chunk_gated_delta_rule's shapes)."""
        out, states = chunk_gated_delta_rule(q, k, v, g, beta, self.cu_seqlens)
        self.recurrent_states.setdefault(layer, states)
        return out


@dataclass
class PromptChunk:
    """A chunk of prompts packed end to end, with every device tensor its forward reads."""

    lengths: list[int]
    rope_deltas: list[int]
    input_ids: torch.Tensor  # (T,), on the model's device, as every tensor below
    position_ids: torch.Tensor  # (3, T)
    slots: VisionSlots
    attention: PackedSegments  # causal within each prompt
    cu_seqlens: PackedSequences  # the prompts' boundaries, for the recurrent layers' ops
    last: torch.Tensor  # (prompts,) each prompt's last token
    cached_vision: VisionEmbeds | None  # the prompts' cached features, or None: the forward runs the tower
    tower_inputs: Any  # the tower's inputs when it runs (the family's `prepare_vision`), or None
    flops: float
    # MoE models: the routes the forward replays (tokens, layers, k), set once known (rollplex.train.routes); None:
    # it routes live. Either way the forward's `Routing` comes with its KeptPrefix.
    routes: torch.Tensor | None = None


def prepare_prompts(model: VisionLanguageModel, prompts: list[Prompt],
                    vision: VisionEmbeds | None = None) -> PromptChunk:
    """Pack `prompts` and build their device tensors (host reads and
    host-to-device copies happen here). The forward runs the vision tower unless
    `vision` (the prompts' cached embeddings, in order) is given."""
    batch = pack_sequences(model.args, prompts)
    device = model.device
    input_ids = batch.input_ids.to(device)
    cu_seqlens = batch.cu_seqlens.tolist()
    tower = None if vision is not None else model.prepare_vision(
        batch.pixel_values, batch.image_grid_thw, batch.pixel_values_videos, batch.video_grid_thw)
    return PromptChunk(
        batch.lengths, batch.rope_deltas, input_ids, batch.position_ids.to(device),
        slots=VisionSlots.find(model.args, input_ids),
        attention=PackedSegments(cu_seqlens, True, model.attn_backend, device),
        cu_seqlens=PackedSequences(batch.lengths, device),
        last=torch.tensor(cu_seqlens[1:], device=device) - 1, cached_vision=vision, tower_inputs=tower,
        flops=prompt_flops(model.args, batch, with_vision=vision is None))


def prompt_forward(model: VisionLanguageModel, chunk: PromptChunk) -> Iterator[KeptPrefix | None]:
    """The forward of a prepared chunk of prompts in slices: yields None after
    the vision tower (when it runs), after the embedding and after each decoder
    layer, and the `KeptPrefix` last. Grad mode is the caller's."""
    vision = chunk.cached_vision
    if chunk.tower_inputs is not None:
        vision = model.encode_prepared(chunk.tower_inputs)
        yield None
    h = model.embed_prompts(chunk.input_ids, vision, chunk.slots)
    yield None
    capture = _CapturePrompt(chunk.attention, chunk.cu_seqlens)
    routing = Routing(chunk.routes) if moe_args(model) is not None else None
    with_routing(capture, routing)
    for h in model.layer_by_layer(h, chunk.position_ids, capture, vision, chunk.slots):
        yield None
    yield KeptPrefix(capture.keys, capture.values, h[chunk.last], chunk.lengths, chunk.rope_deltas, chunk.flops,
                     conv_states=capture.conv_states, recurrent_states=capture.recurrent_states, routing=routing)


@dataclass
class SuffixUnit:
    """Some responses of one group, and which prompt of the KeptPrefix they follow."""

    prompt: int
    group: Group


def suffix_hidden(model: VisionLanguageModel, kept: KeptPrefix, units: list[SuffixUnit],
                  routing: Routing | None = None) -> torch.Tensor:
    """Hidden states that predict each response token, in response order (a
    response's first token is predicted by its prompt's last hidden state). A
    multi-turn response's observations take their own positions and, where they
    hold images or videos, their vision features (`_suffix_forward`). An MoE
    model's layers route the response tokens through `routing` when given."""
    device = model.device
    starts = kept.starts
    ids, positions, context, observed_vision, groups, rows, offset = [], [], [], [], [], [], 0
    for u in units:
        n_prompt, delta = kept.prompt_lens[u.prompt], kept.rope_deltas[u.prompt]
        groups.append(GroupLayout(starts[u.prompt], n_prompt, offset, tuple(len(r) for r in u.group.responses)))
        for s in u.group.samples:
            response = response_inputs(s.token_ids, s.observations, n_prompt, delta)
            ids.append(response.input_ids)
            positions.append(response.position_ids)
            context.append(response.context_mask)
            observed_vision += response.vision
            rows.append((u.prompt, offset, len(s.token_ids)))
            offset += len(s.token_ids)
    mixing = KeptPrefixAttention(kept.keys, kept.values, groups, model.attn_backend, conv_states=kept.conv_states,
                                 recurrent_states=kept.recurrent_states, group_prompts=[u.prompt for u in units])
    with_routing(mixing, routing)
    hidden = _suffix_forward(model, to_device(torch.cat(ids), device), to_device(torch.cat(positions, dim=1), device),
                             mixing, observed_vision, torch.cat(context))
    return torch.cat([piece for prompt, start, n in rows
                      for piece in (kept.last_hidden[prompt:prompt + 1], hidden[start:start + n - 1])])


def _suffix_forward(model: VisionLanguageModel, input_ids: torch.Tensor, position_ids: torch.Tensor,
                    mixing: KeptPrefixAttention, observed_vision: list[Prompt],
                    context_mask: torch.Tensor) -> torch.Tensor:
    """Final hidden states of a suffix pass's tokens. Text only (every single-turn response, and
    text observations): the decode forward, plain embeddings. When an observation holds images
    or videos: the model's full forward over the same tokens and mixing, with their features
    (encoded here, under the caller's grad mode: the update's pass trains a trainable tower
    through them) at the observations' pad tokens, `context_mask` marking those (a pad id the
    policy sampled stays text). For text tokens both forwards compute the same."""
    if not any(p.has_vision for p in observed_vision):
        return model.forward_generated(input_ids, position_ids, mixing)
    vision = model.encode_vision(**concat_vision(observed_vision))
    return model(input_ids, position_ids, mixing, vision, to_device(context_mask, model.device))
