"""The paged KV pool and the attention backend that reads and writes it.

One tensor holds every layer's keys and values, cut into blocks of
`block_size` tokens: shape (layers, 2, blocks, block_size, kv_heads, head_dim).
A sequence owns a list of block ids (its block table, kept by the block
manager); token i of the sequence lives in slot
table[i // block_size] * block_size + i % block_size of every layer.

The pool is sized once, from a byte budget, and stays at one address for the
engine's life (the RL loop's run): the decode CUDA graphs read it by address,
so a pool that moved would need new graphs. It can be released (after
non-finite logits, or to hand its memory back) and is then allocated again, at
the same size, by the next `generate`.

A hybrid decoder (Qwen3.5) keeps K/V in its attention layers only: the pool
holds those (`layers`, the decoder layer indices), and `layer(i)` takes a
decoder layer's index. Its other layers carry a recurrent state instead, in
rollplex.engine.recurrent_state's pool, which `PagedAttention.states` reads.

One extra block at the end is a sink: the padded rows of a CUDA-graph decode
batch write their (discarded) keys there, so the graph never needs a branch.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from rollplex.device import to_device
from rollplex.engine.recurrent_state import DecodeStates, PrefillStates
from rollplex.models.rope import apply_rotary
from rollplex.ops.attention import PackedSegments, paged_decode_attention
from rollplex.ops.fused_decode_triton import FusedLayerOps, rotary_store
from rollplex.ops.paged_decode_triton import paged_decode_attention_triton


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, layers: list[int] | None = None):
        """A pool for `num_layers` layers: decoder layers 0 .. num_layers - 1, or those `layers` name."""
        if num_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, got {num_blocks}")
        layers = list(range(num_layers)) if layers is None else layers
        if len(layers) != num_layers:
            raise ValueError(f"a KV pool of {num_layers} layers cannot hold decoder layers {layers}")
        self.layer_index = {layer: i for i, layer in enumerate(layers)}
        self.num_layers, self.block_size = num_layers, block_size
        self.num_blocks = self.sink_block = num_blocks
        self.kv_heads, self.head_dim, self.dtype, self.device = kv_heads, head_dim, dtype, torch.device(device)
        self.data: torch.Tensor | None = None
        self.allocate()

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * block_size * kv_heads * head_dim * dtype.itemsize

    def allocate(self) -> None:
        """The pool's memory, unless it holds it: `num_blocks` blocks plus the sink block."""
        if self.data is not None:
            return
        # zeros, not empty: the torch decode path multiplies masked-out slots by a zero
        # attention weight, and 0 * NaN from uninitialised memory would poison the output.
        self.data = torch.zeros(self.num_layers, 2, self.num_blocks + 1, self.block_size, self.kv_heads,
                                self.head_dim, dtype=self.dtype, device=self.device)

    def release(self) -> None:
        """Free the pool's memory; the next `allocate` makes it anew (elsewhere: new graphs)."""
        self.data = None

    @property
    def nbytes(self) -> int:
        return 0 if self.data is None else self.data.numel() * self.data.element_size()

    def pool_bytes(self) -> int:
        """Bytes of the pool, sink block included, whether allocated now or not."""
        return (self.num_blocks + 1) * self.bytes_per_block(self.num_layers, self.block_size, self.kv_heads,
                                                            self.head_dim, self.dtype)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of decoder layer `layer`, each (blocks + 1, block_size, kv_heads, head_dim)."""
        assert self.data is not None, "the KV pool was released"
        i = self.layer_index[layer]
        return self.data[i, 0], self.data[i, 1]

    def with_data(self, data: torch.Tensor) -> KVCache:
        """This pool's description over other storage of the same layout: what a CUDA
        graph captured reads (the runner's CPU stand-in replays through it)."""
        view = copy.copy(self)
        view.data = data
        return view

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate the KV of each src block into dst, in every layer."""
        if copies:
            src = to_device([s for s, _ in copies], self.device)
            dst = to_device([d for _, d in copies], self.device)
            self.data[:, :, dst] = self.data[:, :, src]


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write new tokens' k/v (tokens, kv_heads, head_dim) at their flat slots."""
    k_cache.view(-1, *k.shape[1:])[slot_mapping] = k
    v_cache.view(-1, *v.shape[1:])[slot_mapping] = v


@dataclass
class ContextPrefill:
    """A prefill in which some sequence continues K/V its blocks already hold (a multi-turn
    episode: its observation after its earlier turns). Each sequence's new tokens, rows
    [bounds[i], bounds[i + 1]) of the packed batch, attend causally to its whole context, read
    back from the pool at `slots[i]` (the context's flat slots in token order, the new tokens'
    last, stored before this runs). Eager torch: observations are a small share of a rollout's
    tokens, and the K/V copy is one sequence's."""

    bounds: list[int]
    slots: list[torch.Tensor]  # per sequence: (context tokens,) long

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        kv_heads, head_dim = k_cache.shape[2:]
        out = torch.empty_like(q)
        for (a, b), slots in zip(itertools.pairwise(self.bounds), self.slots):
            k = k_cache.view(-1, kv_heads, head_dim)[slots].transpose(0, 1)
            v = v_cache.view(-1, kv_heads, head_dim)[slots].transpose(0, 1)
            if q.shape[1] != kv_heads:  # GQA: torch's kernels take no enable_gqa with a mask on every device
                k, v = (t.repeat_interleave(q.shape[1] // kv_heads, 0) for t in (k, v))
            # Bottom-right causal: new token j sees the context up to its own position.
            visible = torch.ones(b - a, len(slots), dtype=torch.bool, device=q.device).tril(len(slots) - (b - a))
            out[a:b] = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k, v, attn_mask=visible).transpose(0, 1)
        return out


@dataclass
class PagedAttention:
    """Attention backend of the engine's model calls.

    Prefill (`block_tables` is None): the packed new tokens of each sequence
    attend to themselves, causally; their k/v are stored in the pool on the way.
    Decode: one new token per sequence attends to its whole context in the pool
    through its block table; with `shared_prefix`, each group's shared prompt
    blocks are read once for all its rows (rollplex.engine.cascade.CascadeDecodeAttention).

    The layers hand it unrotated q and k with their cos/sin (`rotary_attention`). With
    `layer_ops` (the fused kernels, rollplex.ops.fused_decode_triton: the runner's
    switch) the rotary and the KV write are one kernel, plain decode attention is the
    Triton kernel, and the layer's norms, activation and adds are fused too; without,
    all of it is the torch ops the trainer runs.
    """

    cache: KVCache
    slot_mapping: torch.Tensor  # (tokens,) flat slot of every new token
    # Prefill: the packed new tokens' sequences, each attending causally to itself (built once per prefill,
    # from host boundaries: no layer reads anything back).
    prefill: PackedSegments | None = None
    block_tables: torch.Tensor | None = None  # decode: (batch, max_blocks) int32
    context_lens: torch.Tensor | None = None  # decode: (batch,) int32, including the new token
    backend: str = "torch"
    # Decode: the step's group-shared attention, (q, k_cache, v_cache) -> out (rollplex.engine.cascade).
    shared_prefix: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    layer_ops: FusedLayerOps | None = None  # the decoder layers' fused ops, or None: torch's
    # The step's recurrent layers (rollplex.engine.recurrent_state), where the model has any.
    states: PrefillStates | DecodeStates | None = None
    # Prefill: where some sequence continues K/V its blocks hold, its new tokens attend to all of its context.
    context: ContextPrefill | None = None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of rotated q, k: k and v are stored first."""
        k_cache, v_cache = self.cache.layer(layer)
        store_kv(k_cache, v_cache, k, v, self.slot_mapping)
        return self._attend(q, k, v, k_cache, v_cache)

    def rotary_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, qk_norm: tuple[nn.Module, nn.Module] | None = None) -> torch.Tensor:
        """Attention of q, k before their rotary by cos/sin (tokens, head_dim), and before
        their per-head norms `qk_norm` (Qwen3's q_norm, k_norm) where given. Fused, q and
        k are normalised and rotated in place (they are the layer's temporaries: no grad here)."""
        if self.layer_ops is None:
            if qk_norm is not None:
                q, k = qk_norm[0](q), qk_norm[1](k)
            return self(layer, apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v)
        k_cache, v_cache = self.cache.layer(layer)
        rotary_store(q, k, v, cos, sin, self.slot_mapping, k_cache, v_cache, qk_norm)
        return self._attend(q, k, v, k_cache, v_cache)

    def short_convolution(self, layer: int, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """A recurrent layer's causal convolution, from and into its state slots (`states`)."""
        return self.states.short_convolution(layer, x, weight)

    def gated_delta(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor) -> torch.Tensor:
        """A recurrent layer's gated delta rule, from and into its state slots (`states`)."""
        return self.states.gated_delta(layer, q, k, v, g, beta)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        if self.block_tables is None:
            return self.prefill(q, k, v) if self.context is None else self.context(q, k_cache, v_cache)
        if self.shared_prefix is not None:
            return self.shared_prefix(q, k_cache, v_cache)
        if self.layer_ops is not None and self.backend == "torch":
            # The Triton kernel, as paged_decode_attention picks it on CUDA (here on CPU too, in the interpreter).
            return paged_decode_attention_triton(q, k_cache, v_cache, self.block_tables, self.context_lens)
        return paged_decode_attention(q, k_cache, v_cache, self.block_tables, self.context_lens, self.backend)
