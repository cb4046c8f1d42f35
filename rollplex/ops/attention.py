"""Attention kernels and the backend interface the model calls.

The model never decides *how* attention runs. Every attention layer calls the
`AttentionBackend` its caller passed in, with the layer index and packed
(unpadded) q/k/v of shape (tokens, heads, head_dim). The caller chooses the
backend for the phase at hand: `VarlenAttention` for a packed training forward
or a plain prefill, the engine's paged backends for rollout (they also write
the KV cache), the shared-prefix backend for GRPO groups. That keeps model code
free of scheduling, as in nano-vllm.

Kernels: flash-attn's `flash_attn_varlen_func` on CUDA when it is installed,
else PyTorch SDPA. The torch path batches segments of equal length into one
SDPA call (vision windows are mostly equal-sized), so it does not loop over
thousands of windows one by one.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from rollplex.ops.paged_decode_triton import paged_decode_attention_triton, triton_available

_HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None


def flash_attn_available(device: torch.device) -> bool:
    return _HAS_FLASH_ATTN and device.type == "cuda"


def resolve_backend(name: str, device: torch.device) -> str:
    """Turn a configured backend name (auto / torch / flash) into the one that runs."""
    if name == "auto":
        return "flash" if flash_attn_available(device) else "torch"
    if name == "flash" and not flash_attn_available(device):
        raise RuntimeError(
            "attn_backend 'flash' needs the flash-attn package and a CUDA device "
            "(pip install 'rollplex[gpu]'); use 'auto' or 'torch' otherwise"
        )
    if name not in ("torch", "flash"):
        raise ValueError(f"unknown attention backend {name!r}: expected auto, torch or flash")
    return name


class AttentionBackend(Protocol):
    """What a model layer calls: attend q over k/v for layer `layer`.

    q: (tokens, q_heads, head_dim); k, v: (tokens, kv_heads, head_dim), rotary
    already applied. Returns (tokens, q_heads, head_dim). A backend may also
    store k/v (the engine's paged KV cache) before attending.
    """

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


@dataclass
class VarlenAttention:
    """Packed sequences, each attending only to itself (causal for text, full for vision).

    `cu_seqlens` are the cumulative sequence boundaries (int32, starting at 0),
    as flash-attn's varlen API takes them.
    """

    cu_seqlens: torch.Tensor
    max_seqlen: int
    causal: bool = True
    backend: str = "torch"

    @classmethod
    def from_lengths(cls, lengths: list[int], device: torch.device | str, causal: bool = True,
                     backend: str = "auto") -> "VarlenAttention":
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
        return cls(cu, max(lengths), causal, resolve_backend(backend, torch.device(device)))

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return varlen_attention(q, k, v, self.cu_seqlens, self.cu_seqlens, self.max_seqlen, self.max_seqlen,
                                causal=self.causal, backend=self.backend)


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
    return _varlen_attention_torch(q, k, v, cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), causal)


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
        mask = None
        if causal and lq != lk:
            mask = causal_mask(lq, lk, q.device)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=causal and lq == lk,
                                           enable_gqa=qs.shape[1] != ks.shape[1])
        out[q_idx] = o.transpose(1, 2)
    return out


def _segment_index(starts: list[int], length: int, device: torch.device) -> torch.Tensor:
    """(segments, length) token indices of equal-length segments starting at `starts`."""
    return torch.tensor(starts, device=device)[:, None] + torch.arange(length, device=device)[None, :]


def causal_mask(len_q: int, len_k: int, device: torch.device) -> torch.Tensor:
    """Boolean (len_q, len_k) mask, True where query i may see key j (bottom-right aligned)."""
    offset = len_k - len_q
    return torch.arange(len_k, device=device)[None, :] <= (torch.arange(len_q, device=device)[:, None] + offset)


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
    """Where one GRPO group sits in a packed batch: its prompt tokens at
    [start, start + prompt_len), then its responses back to back."""

    start: int
    prompt_len: int
    response_lens: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.start + self.prompt_len + sum(self.response_lens)


@dataclass
class SharedPrefixAttention:
    """A group's prompt is computed once; each response attends to the prompt's
    keys/values plus its own tokens (causally).

    Per layer and group: causal attention within the prompt; one attention of
    every response query of the group over the prompt (non-causal: the whole
    prompt precedes every response); one causal attention within each response;
    the last two merged by log-sum-exp. The prompt's K/V are never copied per
    response, and gradients reach the prompt (and through it the vision tower)
    from every response.
    """

    groups: list[GroupLayout]
    backend: str = "torch"

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        parts = []
        for g in self.groups:
            p0, p1 = g.start, g.start + g.prompt_len
            parts.append(prompt_attention(q[p0:p1], k[p0:p1], v[p0:p1], [0, g.prompt_len], self.backend))
            parts.append(responses_over_prefix(q[p1:g.end], k[p1:g.end], v[p1:g.end], k[p0:p1], v[p0:p1],
                                               g.response_lens))
        return torch.cat(parts)


@dataclass(frozen=True)
class SuffixGroup:
    """Responses of one group in a suffix-only batch, and where their prompt's
    kept K/V rows are: prompt rows [prompt_start, prompt_start + prompt_len) of
    the kept tensors, response tokens from `start` in the batch."""

    prompt_start: int
    prompt_len: int
    start: int
    response_lens: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.start + sum(self.response_lens)


@dataclass
class KeptPrefixAttention:
    """Suffix-only passes: the batch holds response tokens only; their prompts
    were computed earlier and left their per-layer K/V (`keys[layer]`,
    `values[layer]`, rotary applied). Same math as SharedPrefixAttention's
    response part, so the two paths agree; gradients flow into the kept K/V."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    groups: list[SuffixGroup]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kept_k, kept_v = self.keys[layer], self.values[layer]
        parts = []
        for g in self.groups:
            p0, p1 = g.prompt_start, g.prompt_start + g.prompt_len
            parts.append(responses_over_prefix(q[g.start:g.end], k[g.start:g.end], v[g.start:g.end],
                                               kept_k[p0:p1], kept_v[p0:p1], g.response_lens))
        return torch.cat(parts)


class PackedSegments:
    """Attention within each segment of packed sequences (each attends only to
    itself), with every index tensor its kernel reads built once, on `device`, at
    construction: from host boundaries, so building it reads nothing back from the
    device, and calling it (once per layer or vision block) issues no host-device
    transfer. A plain class, not a dataclass: FSDP2 rebuilds dataclass arguments
    of a module call."""

    def __init__(self, cu_seqlens: list[int], causal: bool, backend: str, device: torch.device):
        self.causal, self.backend = causal, backend
        if backend == "flash":
            self.cu_seqlens = torch.tensor(cu_seqlens, dtype=torch.int32, device=device)
            self.max_seqlen = max(b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]))
        else:
            self.groups = _segment_groups(cu_seqlens, cu_seqlens, device)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.backend == "flash":
            return varlen_attention(q, k, v, self.cu_seqlens, self.cu_seqlens, self.max_seqlen, self.max_seqlen,
                                    causal=self.causal, backend=self.backend)
        return _attend_segment_groups(q, k, v, self.groups, self.causal)


def prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int],
                     backend: str) -> torch.Tensor:
    """Causal attention within each prompt of packed prompts (no log-sum-exp
    needed): the kernel path (flash-attn varlen, or SDPA), which keeps no
    prompt_len^2 scores for backward, unlike attention_with_lse. The boundaries
    come as a host list, so no device round trip; a forward that attends the same
    prompts in every layer builds one `PackedSegments` instead."""
    return PackedSegments(cu_seqlens, True, backend, q.device)(q, k, v)


def responses_over_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_k: torch.Tensor,
                          prefix_v: torch.Tensor, response_lens: tuple[int, ...]) -> torch.Tensor:
    """Attention of a group's responses (packed back to back in q/k/v) over their
    shared prefix plus, causally, their own tokens: one non-causal call of all
    response queries over the prefix, one causal call per response, merged by
    log-sum-exp."""
    prefix_out, prefix_lse = attention_with_lse(q, prefix_k, prefix_v, causal=False)
    own_out, own_lse = [], []
    offset = 0
    for n in response_lens:
        o, lse = attention_with_lse(q[offset:offset + n], k[offset:offset + n], v[offset:offset + n], causal=True)
        own_out.append(o)
        own_lse.append(lse)
        offset += n
    return merge_attention(prefix_out, prefix_lse, torch.cat(own_out), torch.cat(own_lse, dim=1))


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one segment that also returns the log-sum-exp of its scores.

    q: (Lq, Hq, D), k/v: (Lk, Hkv, D) -> out (Lq, Hq, D), lse (Hq, Lq) in float32.
    Computed in float32 with explicit scores (differentiable through both
    outputs); causal masks are bottom-right aligned.
    """
    rep = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(rep, dim=1)
    vf = v.float().repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * q.shape[-1] ** -0.5
    if causal:
        scores = scores.masked_fill(~causal_mask(q.shape[0], k.shape[0], q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("hqk,khd->qhd", torch.exp(scores - lse[..., None]), vf)
    return out.to(q.dtype), lse


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                    lse_b: torch.Tensor) -> torch.Tensor:
    """Combine attention over two disjoint key sets: each part weighted by its
    share of the total softmax mass, exp(lse_part - lse_total)."""
    lse = torch.logaddexp(lse_a, lse_b)
    wa = torch.exp(lse_a - lse).transpose(0, 1)[..., None]  # (L, H, 1)
    wb = torch.exp(lse_b - lse).transpose(0, 1)[..., None]
    return (out_a.float() * wa + out_b.float() * wb).to(out_a.dtype)
