"""Attention kernels and the backend interface the model calls.

The model never decides *how* attention runs. Every attention layer calls the
`AttentionBackend` its caller passed in, with the layer index and packed
(unpadded) q/k/v of shape (tokens, heads, head_dim). The caller chooses the
backend for the phase at hand: `VarlenAttention` for a packed training forward
or a plain prefill, the engine's paged backends for rollout (they also write
the KV cache), the shared-prefix backend for GRPO groups. That keeps model code
free of scheduling, as in nano-vllm.

Kernels (`resolve_backend`): "torch", PyTorch SDPA, batching segments of equal
length into one call (vision windows are mostly equal-sized, RL responses are not:
then it is about one call per response); "flash", flash-attn's
`flash_attn_varlen_func`; "flex", FlexAttention with a block mask
(rollplex.ops.flex_attention), and "varlen", torch's own `varlen_attn`: one kernel
call per layer whatever the number of segments. The torch path is the reference.
"""

from __future__ import annotations

import importlib.util
import inspect
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.attention.varlen
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from rollplex.device import to_device
from rollplex.ops.flex_attention import FlexPacked, FlexPrefixed
from rollplex.ops.gated_delta import PackedSequences, causal_conv1d, chunk_gated_delta_rule
from rollplex.ops.paged_decode_triton import paged_decode_attention_triton, triton_available

_HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None
_VARLEN_GQA = "enable_gqa" in inspect.signature(torch.nn.attention.varlen.varlen_attn).parameters
BACKENDS = ("auto", "torch", "flash", "flex", "varlen")


def flash_attn_available(device: torch.device) -> bool:
    return _HAS_FLASH_ATTN and device.type == "cuda"


def resolve_backend(name: str, device: torch.device) -> str:
    """Turn a configured backend name (auto / torch / flash / flex / varlen) into the one that runs.

    "auto" is flash-attn where it is installed on CUDA, else "torch": "flex" and "varlen"
    (one kernel call per layer, whatever the number of segments) have not yet run on a GPU,
    so they are asked for by name until the device command has timed them beside torch
    (its packed_train_3b check) and "auto" can pick by that measurement. "flex" runs on CPU
    forward-only (torch has no FlexAttention backward there).
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}: expected one of {', '.join(BACKENDS)}")
    if name == "auto":
        return "flash" if flash_attn_available(device) else "torch"
    if name == "flash" and not flash_attn_available(device):
        raise RuntimeError(
            "attn_backend 'flash' needs the flash-attn package and a CUDA device "
            "(pip install 'rollplex[gpu]'); use 'auto' or 'torch' otherwise"
        )
    if name == "varlen" and device.type != "cuda":
        raise RuntimeError(
            f"attn_backend 'varlen' (torch.nn.attention.varlen.varlen_attn) runs only on CUDA, not on {device.type}: "
            "use 'auto' or 'torch' there"
        )
    return name


class AttentionBackend(Protocol):
    """What a model layer calls: attend q over k/v for layer `layer`.

    q: (tokens, q_heads, head_dim); k, v: (tokens, kv_heads, head_dim), rotary
    already applied. Returns (tokens, q_heads, head_dim). A backend may also
    store k/v (the engine's paged KV cache) before attending.
    """

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class VarlenAttention:
    """Packed sequences, each attending only to itself (causal for text, full for vision),
    in every layer of a forward: the index tensors its kernel reads are built once, from
    host boundaries (`PackedSegments`), so no layer reads a value back from the device.
    A plain class, not a dataclass: FSDP2 rebuilds dataclass arguments of a module call.

    `cu_seqlens` are the cumulative sequence boundaries (0, l0, l0 + l1, ...), as
    flash-attn's varlen API takes them.
    """

    def __init__(self, cu_seqlens: list[int], device: torch.device | str, causal: bool = True,
                 backend: str = "torch"):
        self.segments = PackedSegments(cu_seqlens, causal, backend, torch.device(device))

    @classmethod
    def from_lengths(cls, lengths: list[int], device: torch.device | str, causal: bool = True,
                     backend: str = "auto") -> "VarlenAttention":
        return cls([0, *itertools.accumulate(lengths)], device, causal, resolve_backend(backend, torch.device(device)))

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.segments(q, k, v)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    backend: str = "torch",
) -> torch.Tensor:
    """Segment i of q attends segment i of k/v. With `causal` and a query segment
    shorter than its key segment, the queries are the *last* keys' positions
    (bottom-right alignment, as flash-attn defines it): the usual case of new
    tokens attending a cached prefix plus themselves.
    """
    if backend == "flash":
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      causal=causal)
    if backend == "varlen":
        return _torch_varlen_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal)
    return _varlen_attention_torch(q, k, v, cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), causal)


def _torch_varlen_attn(q, k, v, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int,
                       causal: bool) -> torch.Tensor:
    """torch's own flash kernel (torch.nn.attention.varlen, CUDA, fp16/bf16). Its causal mask is
    bottom-right per segment, as flash-attn's. torch 2.11's takes no `enable_gqa`: K/V are
    expanded to the query's head count there."""
    from torch.nn.attention.varlen import varlen_attn

    window = (-1, 0) if causal else (-1, -1)
    if q.shape[1] == k.shape[1]:
        return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, window_size=window)
    if _VARLEN_GQA:
        return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, window_size=window, enable_gqa=True)
    rows, kv_heads, dim = k.shape
    k, v = (t[:, :, None].expand(rows, kv_heads, q.shape[1] // kv_heads, dim).reshape(rows, q.shape[1], dim)
            for t in (k, v))
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, window_size=window)


def _varlen_attention_torch(q, k, v, cu_q: list[int], cu_k: list[int], causal: bool) -> torch.Tensor:
    return _attend_segment_groups(q, k, v, _segment_groups(cu_q, cu_k, q.device), causal)


def _segment_groups(cu_q: list[int], cu_k: list[int],
                    device: torch.device) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """Segments grouped by (query length, key length), so that each group is one
    batched SDPA call: (lq, lk, query token indices, key token indices) per group."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i in range(len(cu_q) - 1):
        lq, lk = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
        if lq > 0:
            groups.setdefault((lq, lk), []).append(i)
    return [(lq, lk, _segment_index([cu_q[i] for i in segs], lq, device),
             _segment_index([cu_k[i] for i in segs], lk, device)) for (lq, lk), segs in groups.items()]


def _attend_segment_groups(q, k, v, groups: list[tuple[int, int, torch.Tensor, torch.Tensor]],
                           causal: bool) -> torch.Tensor:
    out = torch.empty_like(q)
    for lq, lk, q_idx, k_idx in groups:
        # (segments, len, heads, dim) -> (segments, heads, len, dim)
        qs = q[q_idx].transpose(1, 2)
        ks = k[k_idx].transpose(1, 2)
        vs = v[k_idx].transpose(1, 2)
        # Bottom-right causal: the queries are the last lq of lk positions (a CUDA kernel applies it unmaterialised).
        mask = causal_lower_right(lq, lk) if causal and lq != lk else None
        if mask is not None and qs.device.type == "cuda" and qs.shape[1] != ks.shape[1]:
            # torch's CUDA kernels for this mask (CausalBias._dispatch: flash, memory-efficient) are called
            # without enable_gqa: give them K/V at the query's head count. The CPU kernel takes GQA as it is.
            ks, vs = (t.repeat_interleave(qs.shape[1] // t.shape[1], dim=1) for t in (ks, vs))
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=causal and lq == lk,
                                           enable_gqa=qs.shape[1] != ks.shape[1])
        out[q_idx] = o.transpose(1, 2)
    return out


def _segment_index(starts: list[int], length: int, device: torch.device) -> torch.Tensor:
    """(segments, length) token indices of equal-length segments starting at `starts`."""
    return to_device(starts, device)[:, None] + torch.arange(length, device=device)[None, :]


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    backend: str = "torch",
) -> torch.Tensor:
    """One new query token per sequence over its paged context.

    q: (batch, q_heads, head_dim); k_cache/v_cache: (blocks, block_size, kv_heads,
    head_dim); block_tables: (batch, max_blocks) int32; context_lens: (batch,)
    tokens of context including the new one (already stored). No host sync and
    fixed shapes, so the call can be captured in a CUDA graph.

    The torch path gathers each sequence's pages into a padded tensor: right on
    CPU and as the reference, but it copies the context on every step; flash-attn's
    kernel reads the pages in place (its paged KV needs block_size % 256 == 0).
    On CUDA without flash-attn the torch backend runs Rollplex's Triton kernel
    (rollplex/ops/paged_decode_triton.py), which also reads the pages in place.
    """
    if backend == "flash":
        from flash_attn import flash_attn_with_kvcache

        return flash_attn_with_kvcache(q[:, None], k_cache, v_cache, cache_seqlens=context_lens,
                                       block_table=block_tables, causal=True)[:, 0]
    if q.is_cuda and triton_available(q.device):
        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens)
    batch, max_blocks = block_tables.shape
    block_size, kv_heads, head_dim = k_cache.shape[1:]
    k = k_cache[block_tables].view(batch, max_blocks * block_size, kv_heads, head_dim).transpose(1, 2)
    v = v_cache[block_tables].view(batch, max_blocks * block_size, kv_heads, head_dim).transpose(1, 2)
    visible = torch.arange(max_blocks * block_size, device=q.device)[None, :] < context_lens[:, None]
    out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=visible[:, None, None, :],
                                         enable_gqa=q.shape[1] != kv_heads)
    return out[:, :, 0]


# ----------------------------------------------------------------------------- shared prefix (GRPO groups)


@dataclass(frozen=True)
class GroupLayout:
    """Where one GRPO group sits: its prompt's K/V at rows [prompt_start,
    prompt_start + prompt_len), and its responses back to back from token
    `responses_start` of the batch. In a packed batch (`packed`) the responses
    follow the prompt; in a suffix-only batch the prompt's rows are kept ones."""

    prompt_start: int
    prompt_len: int
    responses_start: int
    response_lens: tuple[int, ...]

    @classmethod
    def packed(cls, start: int, prompt_len: int, response_lens: tuple[int, ...]) -> GroupLayout:
        """A group laid out in the batch itself: prompt from `start`, then the responses."""
        return cls(start, prompt_len, start + prompt_len, response_lens)

    @property
    def end(self) -> int:
        return self.responses_start + sum(self.response_lens)

    def response_segments(self, own_keys_offset: int = 0) -> list[QuerySegment]:
        """Each response, attending to the prompt's K/V then causally to its own."""
        segments, offset = [], self.responses_start
        for n in self.response_lens:
            segments.append(QuerySegment(offset, n, self.prompt_start, self.prompt_len, own_keys_offset))
            offset += n
        return segments


class SharedPrefixAttention:
    """A group's prompt is computed once; each response attends to the prompt's
    keys/values plus its own tokens (causally).

    Every prompt and every response is one query segment of the packed batch,
    attended by a kernel (`PrefixedSegments`): a prompt causally over itself, a
    response over [its prompt's K/V | its own K/V] with a bottom-right causal
    mask. Gradients reach the prompt's K/V (and through them the vision tower)
    from every response. A plain class, not a dataclass: FSDP2 rebuilds dataclass
    arguments of a module call, which would drop the segments built on the first
    layer's call.
    """

    def __init__(self, groups: list[GroupLayout], backend: str = "torch"):
        self.groups, self.backend = groups, backend
        self.segments: PrefixedSegments | None = None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.segments is None:  # built once per forward: every layer attends the same segments
            self.segments = PrefixedSegments(shared_prefix_segments(self.groups), self.backend, q.device)
        return self.segments(q, k, v)


def shared_prefix_segments(groups: list[GroupLayout]) -> list[QuerySegment]:
    """SharedPrefixAttention's query segments: per group its prompt, then its responses."""
    segments = []
    for g in groups:
        # The prompt: causal over itself.
        segments.append(QuerySegment(g.prompt_start, g.prompt_len, g.prompt_start, 0))
        segments += g.response_segments()
    return segments


class KeptPrefixAttention:
    """Suffix-only passes: the batch holds response tokens only; their prompts
    were computed earlier and left, per layer (by decoder layer index), their
    K/V (`keys[layer]`, `values[layer]`, rotary applied). Same kernels and
    segments as SharedPrefixAttention's responses, so the two paths agree;
    gradients flow into the kept K/V.

    In a hybrid decoder (Qwen3.5) the layers that carry a recurrent state call
    `short_convolution` and `gated_delta` instead: each response runs as a
    sequence of its own from its prompt's kept final states (`conv_states[layer]`,
    `recurrent_states[layer]`, one row per kept prompt; group i follows kept
    prompt `group_prompts[i]`; the groups' responses lie back to back from row
    0), as the shared-prefix pass runs its responses (`ResponsesFromPromptStates`);
    gradients flow into the kept states. A plain class for the reason
    SharedPrefixAttention is."""

    def __init__(self, keys: Mapping[int, torch.Tensor] | Sequence[torch.Tensor],
                 values: Mapping[int, torch.Tensor] | Sequence[torch.Tensor], groups: list[GroupLayout],
                 backend: str = "torch", conv_states: Mapping[int, torch.Tensor] | None = None,
                 recurrent_states: Mapping[int, torch.Tensor] | None = None, group_prompts: Sequence[int] = ()):
        self.keys, self.values, self.groups, self.backend = keys, values, groups, backend
        self.conv_states, self.recurrent_states = conv_states or {}, recurrent_states or {}
        self.group_prompts = group_prompts
        self.segments: PrefixedSegments | None = None
        self.responses: ResponsesFromPromptStates | None = None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kept_k, kept_v = self.keys[layer], self.values[layer]
        if self.segments is None:
            segments = [s for g in self.groups for s in g.response_segments(own_keys_offset=kept_k.shape[0])]
            self.segments = PrefixedSegments(segments, self.backend, q.device)
        # Keys are read from [kept prompt rows | this batch's rows]; the segments index that concatenation.
        return self.segments(q, torch.cat([kept_k, k]), torch.cat([kept_v, v]))

    def short_convolution(self, layer: int, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x (T, channels) through the depthwise causal convolution `weight` (channels, kernel), then SiLU,
        each response's window reaching back into its prompt's kept last inputs."""
        return self._responses(x.device).short_convolution(x, weight, self.conv_states[layer])

    def gated_delta(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor) -> torch.Tensor:
        """The gated delta rule over each response from its prompt's kept recurrent state
        (rollplex.ops.gated_delta.chunk_gated_delta_rule's shapes)."""
        return self._responses(v.device).gated_delta(q, k, v, g, beta, self.recurrent_states[layer])

    def _responses(self, device: torch.device) -> ResponsesFromPromptStates:
        if self.responses is None:  # built once per forward: every recurrent layer runs the same responses
            if len(self.group_prompts) != len(self.groups):
                raise ValueError(f"{len(self.groups)} groups but {len(self.group_prompts)} group_prompts: a recurrent "
                                 "layer needs the kept prompt each group follows")
            expected_start = 0
            for g in self.groups:
                if g.responses_start != expected_start:
                    raise ValueError(f"group {g}: the responses must lie back to back from row 0")
                expected_start = g.end
            self.responses = ResponsesFromPromptStates(
                [n for g in self.groups for n in g.response_lens],
                [p for g, p in zip(self.groups, self.group_prompts) for _ in g.response_lens], device)
        return self.responses


class ResponsesFromPromptStates:
    """Responses packed back to back, each a sequence of its own whose short convolution and
    gated delta rule (Qwen3.5's Gated DeltaNet layers, rollplex.ops.gated_delta) start from its
    prompt's final states: what the response sees after its prompt in one full sequence. The
    prompt's states are repeated per response, so each response's gradient reaches them and the
    prompt's is summed over its responses. The shared-prefix pass (prompt states computed in the
    same layer) and the kept-prefix suffix passes (states kept from an earlier prompt pass) both
    run their responses through it. Index tensors are built once, from host lists, on `device`."""

    def __init__(self, response_lens: Sequence[int], prompt_of_response: Sequence[int],
                 device: torch.device | str):
        self.cu_seqlens = PackedSequences(response_lens, device)
        self.prompt_of_response = torch.tensor(prompt_of_response, dtype=torch.long, device=device)

    def short_convolution(self, x: torch.Tensor, weight: torch.Tensor, prompt_tails: torch.Tensor) -> torch.Tensor:
        """x (response tokens, channels) through the depthwise causal convolution `weight` (channels,
        kernel), then SiLU; `prompt_tails` (prompts, channels, kernel - 1): each prompt's last inputs."""
        return causal_conv1d(x, weight, self.cu_seqlens, initial_state=prompt_tails[self.prompt_of_response])[0]

    def gated_delta(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    prompt_states: torch.Tensor) -> torch.Tensor:
        """The gated delta rule over each response (chunk_gated_delta_rule's shapes) from
        `prompt_states` (prompts, value heads, key dim, value dim), each prompt's final state."""
        return chunk_gated_delta_rule(q, k, v, g, beta, self.cu_seqlens,
                                      initial_state=prompt_states[self.prompt_of_response])[0]


@dataclass(frozen=True)
class QuerySegment:
    """Queries [start, start + length) of a packed batch, attending to key rows
    [prefix_start, prefix_start + prefix_len) then, causally, to their own key rows
    [own_keys_offset + start, ...): the causal mask is bottom-right aligned, so
    every query sees the whole prefix."""

    start: int
    length: int
    prefix_start: int
    prefix_len: int
    own_keys_offset: int = 0

    def key_rows(self) -> list[int]:
        own = self.own_keys_offset + self.start
        return [*range(self.prefix_start, self.prefix_start + self.prefix_len), *range(own, own + self.length)]


class PrefixedSegments:
    """Attention of query segments that cover a packed batch in order, each over
    its prefix plus itself (`QuerySegment`), on kernels: flash-attn varlen or torch's
    varlen_attn, whose causal mask is bottom-right, or SDPA with segments of equal
    (length, prefix) batched into one call, GQA without copying K/V per head. On
    those each segment's keys are gathered into a run of their own, so a prompt's
    K/V are copied once per response reading them (small beside the scores a kernel
    never stores), and the gather sums every response's gradient back into them.
    "flex" reads the key rows in place through a block mask (`FlexPrefixed`).
    Index tensors and masks are built once, on `device`, at construction."""

    def __init__(self, segments: list[QuerySegment], backend: str, device: torch.device):
        self.backend = backend
        if backend == "flex":
            self.flex = FlexPrefixed(segments, device)
        elif backend in ("flash", "varlen"):
            key_lens = [s.prefix_len + s.length for s in segments]
            self.key_index = to_device([r for s in segments for r in s.key_rows()], device)
            self.cu_seqlens_q = _cumulative([s.length for s in segments], device)
            self.cu_seqlens_k = _cumulative(key_lens, device)
            self.max_seqlen_q = max(s.length for s in segments)
            self.max_seqlen_k = max(key_lens)
        else:
            self.groups = _prefixed_segment_groups(segments, device)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: the packed queries; k/v: the key rows the segments index."""
        if self.backend == "flex":
            return self.flex(q, k, v)
        if self.backend in ("flash", "varlen"):
            return varlen_attention(q, k[self.key_index], v[self.key_index], self.cu_seqlens_q, self.cu_seqlens_k,
                                    self.max_seqlen_q, self.max_seqlen_k, causal=True, backend=self.backend)
        return _attend_segment_groups(q, k, v, self.groups, causal=True)


def _prefixed_segment_groups(segments: list[QuerySegment],
                             device: torch.device) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """Segments grouped by (length, prefix length): (lq, lk, query indices, key
    indices) per group, as `_attend_segment_groups` takes them."""
    groups: dict[tuple[int, int], list[QuerySegment]] = {}
    for s in segments:
        groups.setdefault((s.length, s.prefix_len), []).append(s)
    return [(lq, lq + lp, _segment_index([s.start for s in segs], lq, device),
             to_device([s.key_rows() for s in segs], device)) for (lq, lp), segs in groups.items()]


def _cumulative(lengths: list[int], device: torch.device) -> torch.Tensor:
    return to_device([0, *itertools.accumulate(lengths)], device, torch.int32)


class PackedSegments:
    """Attention within each segment of packed sequences (each attends only to
    itself), with every index tensor or block mask its kernel reads built once, on `device`, at
    construction: from host boundaries, so building it reads nothing back from the
    device, and calling it (once per layer or vision block) issues no host-device
    transfer. A plain class, not a dataclass: FSDP2 rebuilds dataclass arguments
    of a module call."""

    def __init__(self, cu_seqlens: list[int], causal: bool, backend: str, device: torch.device):
        self.causal, self.backend = causal, backend
        if backend == "flex":
            self.flex = FlexPacked(cu_seqlens, causal, device)
        elif backend in ("flash", "varlen"):
            self.cu_seqlens = to_device(cu_seqlens, device, torch.int32)
            self.max_seqlen = max(b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]))
        else:
            self.groups = _segment_groups(cu_seqlens, cu_seqlens, device)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.backend == "flex":
            return self.flex(q, k, v)
        if self.backend in ("flash", "varlen"):
            return varlen_attention(q, k, v, self.cu_seqlens, self.cu_seqlens, self.max_seqlen, self.max_seqlen,
                                    causal=self.causal, backend=self.backend)
        return _attend_segment_groups(q, k, v, self.groups, self.causal)
