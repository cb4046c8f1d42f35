"""Gated DeltaNet ops (Qwen3.5's linear-attention layers): the gated delta rule and the causal conv1d.

Plain PyTorch over packed (varlen) sequences: the CPU path and the reference. On CUDA the gated
delta rule runs flash-linear-attention's kernels (the `fla-core` package, `pip install 'rollplex[gpu]'`)
where it is installed: `resolve_delta_backend` chooses, as rollplex.ops.attention.resolve_backend does
for attention. The convolutions stay torch everywhere (a depthwise conv1d, cheap beside the rule).
A Gated DeltaNet layer keeps no KV cache; per sequence it keeps two states, the recurrent state
S [Hv, Dk, Dv] of the gated delta rule and the last K-1 inputs of its causal depthwise conv.

The gated delta rule (Yang, Kautz, Hatamizadeh 2024, "Gated Delta Networks: Improving Mamba2 with
Delta Rule", arXiv:2412.06464), per value head, token t, in the form transformers' Qwen3.5 computes it
(torch_recurrent_gated_delta_rule):

    S'   = exp(g_t) * S_{t-1}                        decay (g_t <= 0 is the log decay)
    S_t  = S' + k_t (beta_t * (v_t - S'^T k_t))^T    delta-rule write: only what S' mispredicts for k_t
    o_t  = S_t^T (q_t / sqrt(Dk))

Semantics fixed by transformers (5.17 to 5.24, modeling_qwen3_5):
- q and k arrive L2-normalised (transformers normalises them inside its kernel, in fp32, with
  `l2norm` below); the op always scales q by Dk**-0.5 after that.
- grouped heads: key head h serves value heads h*r .. h*r+r-1 (r = Hv // Hk), i.e. transformers'
  `repeat_interleave` over the head dim, not `repeat`.
- all state arithmetic is fp32; the output takes v's dtype (transformers returns q's dtype, the same
  tensor dtype in its layer; v's dtype is the layer's activation dtype even when the caller hands in
  fp32-normalised q and k).
- the conv runs in its weight's dtype with SiLU after, the output in the input's dtype (causal_conv1d_fn).
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from rollplex.device import to_device

Activation = Callable[[torch.Tensor], torch.Tensor] | None

_HAS_FLA = importlib.util.find_spec("fla") is not None
DELTA_BACKENDS = ("auto", "torch", "fla")
INSTALL_FLA = "pip install 'rollplex[gpu]', or pip install fla-core"


def fla_available(device: torch.device) -> bool:
    """Whether flash-linear-attention's kernels can run on `device`: fla installed, and a CUDA device."""
    return _HAS_FLA and device.type == "cuda"


def resolve_delta_backend(name: str, device: torch.device) -> str:
    """Turn a gated-delta-rule backend name (auto / torch / fla) into the one that runs on `device`.

    As rollplex.ops.attention.resolve_backend treats flash-attn: "auto" is fla where it is installed
    on CUDA, else torch, and asking for "fla" where it cannot run is an error. Unlike a missing
    flash-attn, a CUDA device without fla is warned of (once): the torch path scans chunks in a
    Python loop with a host sync per call, far slower than fla's kernels at training lengths.
    """
    if name not in DELTA_BACKENDS:
        raise ValueError(f"unknown gated delta rule backend {name!r}: expected one of {', '.join(DELTA_BACKENDS)}")
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return "torch"
    if fla_available(device):
        return "fla"
    if name == "fla":
        raise RuntimeError("the gated delta rule's 'fla' backend needs flash-linear-attention and a CUDA device "
                           f"({INSTALL_FLA}); use 'auto' or 'torch' otherwise")
    _warn_fla_missing()
    return "torch"


@functools.cache
def _warn_fla_missing() -> None:
    warnings.warn("Gated DeltaNet layers run their plain-torch gated delta rule on CUDA, much slower than "
                  f"flash-linear-attention's kernels, which are not installed ({INSTALL_FLA})", stacklevel=3)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, computed and returned in fp32.

    Transformers' (and FLA's) q/k normalisation for the gated delta rule, applied in fp32 inside
    its kernel: a caller that matches transformers in bf16 normalises with this and passes the fp32 result.
    """
    x = x.float()
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _expand_key_heads(x: torch.Tensor, value_heads: int) -> torch.Tensor:
    """[..., Hk, D] -> [..., Hv, D]: each key head serves Hv/Hk consecutive value heads (repeat_interleave)."""
    key_heads = x.shape[-2]
    if value_heads % key_heads:
        raise ValueError(f"value heads ({value_heads}) must be a multiple of key heads ({key_heads})")
    return x if key_heads == value_heads else x.repeat_interleave(value_heads // key_heads, dim=-2)


@dataclass
class _ChunkLayout:
    """Where the chunks of packed sequences lie, each sequence right-padded to a multiple of chunk_size.

    Chunks are stored step-major, sequences sorted by chunk count (longest first): the chunks that
    scan step j processes are one contiguous slice, and the sequences still running at step j are the
    first `active[j]` of the sorted order, so the scan slices instead of gathering.
    """

    order: torch.Tensor  # sorted position -> sequence
    active: list[int]  # per scan step: how many sequences still have a chunk
    padded_row: torch.Tensor  # per packed token: its row in the padded [chunks * chunk_size] layout

    @property
    def num_chunks(self) -> int:
        return sum(self.active)


def _chunk_layout(lengths: list[int], chunk_size: int, device: torch.device) -> _ChunkLayout:
    """The step-major chunk layout of sequences of `lengths` (see _ChunkLayout), computed on the host."""
    lengths_t = torch.tensor(lengths, dtype=torch.long)
    chunk_counts = (lengths_t + chunk_size - 1) // chunk_size
    order = chunk_counts.argsort(descending=True, stable=True)
    counts = chunk_counts.tolist()
    active = [sum(count > step for count in counts) for step in range(max(counts, default=0))]
    step_offset = torch.tensor([0, *itertools.accumulate(active)][:-1], dtype=torch.long)
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
    seq_of_token = torch.repeat_interleave(torch.arange(len(lengths)), lengths_t)
    starts = torch.tensor([0, *itertools.accumulate(lengths)][:-1], dtype=torch.long)
    position = torch.arange(int(lengths_t.sum())) - starts[seq_of_token]
    chunk = step_offset[position // chunk_size] + rank[seq_of_token]
    return _ChunkLayout(to_device(order, device), active, to_device(chunk * chunk_size + position % chunk_size, device))


class PackedSequences:
    """Packed sequences' boundaries as the ops index them, built once on the host from their lengths
    (a pass builds one and every layer reuses it), so that no op reads a boundary back from the
    device: a forward issued between decode steps must never make the host wait (rollplex.rl.prompt_work).
    Host-to-device copies happen here, without blocking (rollplex.device.to_device)."""

    def __init__(self, lengths: list[int], device: torch.device | str, chunk_size: int = 64):
        device = torch.device(device)
        self.lengths, self.device = [int(n) for n in lengths], device
        self.num_seqs, self.num_tokens = len(self.lengths), sum(self.lengths)
        self.cu_seqlens = to_device([0, *itertools.accumulate(self.lengths)], device, torch.long)
        self.seq_of_token = to_device(torch.repeat_interleave(torch.arange(self.num_seqs),
                                                              torch.tensor(self.lengths, dtype=torch.long)), device)
        self._chunks = {chunk_size: _chunk_layout(self.lengths, chunk_size, device)}

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor | PackedSequences, device: torch.device) -> PackedSequences:
        """`cu_seqlens` as it is, or boundaries [0, ..., T] read back to the host (a sync on a GPU)."""
        if isinstance(cu_seqlens, PackedSequences):
            return cu_seqlens
        bounds = cu_seqlens.tolist()
        return cls([b - a for a, b in zip(bounds[:-1], bounds[1:])], device)

    def chunks(self, chunk_size: int) -> _ChunkLayout:
        if chunk_size not in self._chunks:
            self._chunks[chunk_size] = _chunk_layout(self.lengths, chunk_size, self.device)
        return self._chunks[chunk_size]


def _to_chunks(x: torch.Tensor, padded_row: torch.Tensor, num_chunks: int, chunk_size: int) -> torch.Tensor:
    """Packed [T, H, ...] -> fp32 [chunks, H, chunk_size, ...], zero rows where sequences are padded.

    Zero padding is inert: k = beta = 0 writes nothing into the state and g = 0 decays nothing,
    so the state after a sequence's last chunk is its state after its last real token.
    """
    padded = x.new_zeros((num_chunks * chunk_size, *x.shape[1:]), dtype=torch.float32)
    padded = padded.index_copy(0, padded_row, x.float())
    padded = padded.reshape(num_chunks, chunk_size, *x.shape[1:])
    return padded.transpose(1, 2).contiguous()  # batched matmuls would each copy a strided operand


def _intra_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, chunk_size: int
) -> tuple[torch.Tensor, ...]:
    """Everything that does not depend on the state entering a chunk, for all chunks at once.

    Per chunk, with G_i the cumulative log decay up to position i and Gamma_ij = exp(G_i - G_j) (j <= i),
    the chunk's delta-rule writes form a unit lower-triangular system (the UT transform of
    DeltaNet, Yang et al. 2024): (I + strictly_lower(diag(beta) K K^T * Gamma)) [U | W] = [diag(beta) V |
    diag(beta) exp(G) K]. Then for the state S entering the chunk:
        V_new = U - W S,   O = (Q exp(G)) S + (Q K^T * Gamma) V_new,
        S_out = exp(G_last) S + (K exp(G_last - G))^T V_new.
    Returns U, W, the decayed queries and keys, the intra-chunk scores and exp(G_last).
    """
    cumulative = g.cumsum(dim=-1)  # [chunks, H, C]
    future = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    # Mask before exp: above the diagonal G_i - G_j > 0 and could overflow.
    decay_between = (cumulative.unsqueeze(-1) - cumulative.unsqueeze(-2)).masked_fill(future, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2)) * decay_between  # diagonal ignored: unitriangular solve
    # Invert once and multiply twice: on CPU a solve against the identity plus two matmuls
    # is about twice as fast as solving for both right-hand sides.
    identity = torch.eye(chunk_size, dtype=q.dtype, device=q.device).expand_as(system)
    inverse = torch.linalg.solve_triangular(system, identity, upper=False, unitriangular=True)
    decay_from_start = cumulative.exp().unsqueeze(-1)
    new_values = inverse @ (v * beta.unsqueeze(-1))
    state_keys = inverse @ (k_beta * decay_from_start)
    scores = (q @ k.transpose(-1, -2)) * decay_between
    q_decayed = q * decay_from_start
    k_decayed = k * (cumulative[..., -1:] - cumulative).exp().unsqueeze(-1)
    chunk_decay = cumulative[..., -1].exp()[..., None, None]
    return new_values, state_keys, q_decayed, k_decayed, scores, chunk_decay


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor | PackedSequences,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over packed sequences, chunked: matrix ops within a chunk, a loop across chunks.

    q, k: [T, Hk, Dk], L2-normalised; v: [T, Hv, Dv]; g (log decay), beta: [T, Hv]; cu_seqlens: [N+1]
    sequence starts in the packed dim (0 first, T last), or their `PackedSequences` (no host read);
    initial_state: [N, Hv, Dk, Dv] or None (zeros).
    Returns out [T, Hv, Dv] in v's dtype and the final states [N, Hv, Dk, Dv] fp32. Each sequence
    starts from its own initial state. Differentiable (autograd), initial_state included.
    `backend` (`resolve_delta_backend`): fla's kernel (chunk_size 16, 32 or 64 there) or the torch scan.
    """
    packed = PackedSequences.of(cu_seqlens, v.device)
    if resolve_delta_backend(backend, v.device) == "fla":
        return _fla_chunk_gated_delta_rule(q, k, v, g, beta, packed, initial_state, chunk_size)
    return _torch_chunk_gated_delta_rule(q, k, v, g, beta, packed, initial_state, chunk_size)


def _fla_chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, packed: PackedSequences,
    initial_state: torch.Tensor | None, chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """chunk_gated_delta_rule through fla's kernel (fla.ops.gated_delta_rule, fla-core 0.6).

    fla takes packed sequences as a batch of one, [1, T, H, D], with int64 cu_seqlens. It takes the
    key heads as they are: it reads key head h // (Hv / Hk) for value head h, our repeat_interleave.
    Its states are ours, [N, Hv, Dk, Dv], returned in fp32, and it differentiates initial_state.
    Its kernels multiply q and k tiles with v's, so q and k go in v's dtype (transformers' Qwen3.5
    hands fla its activations' dtype too); they arrive L2-normalised, so fla's own norm stays off.
    fla reads cu_seqlens back to the host to lay out its chunks, once per tensor (it caches by the
    tensor): a pass that hands every layer the same `PackedSequences` waits on the device once.
    """
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    out, final_state = fla_chunk(
        q.to(v.dtype).unsqueeze(0), k.to(v.dtype).unsqueeze(0), v.unsqueeze(0), g.float().unsqueeze(0),
        beta.unsqueeze(0), scale=k.shape[-1] ** -0.5,
        initial_state=None if initial_state is None else initial_state.float(), output_final_state=True,
        cu_seqlens=packed.cu_seqlens, chunk_size=chunk_size)
    return out[0], final_state


def _torch_chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, packed: PackedSequences,
    initial_state: torch.Tensor | None, chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """chunk_gated_delta_rule in plain PyTorch: the scan batches all sequences that still have a chunk at each step."""
    num_seqs, value_heads = packed.num_seqs, v.shape[1]
    layout = packed.chunks(chunk_size)
    q = _expand_key_heads(q.float() * k.shape[-1] ** -0.5, value_heads)
    k = _expand_key_heads(k.float(), value_heads)
    chunked = [_to_chunks(x, layout.padded_row, layout.num_chunks, chunk_size) for x in (q, k, v, g, beta)]
    new_values, state_keys, q_decayed, k_decayed, scores, chunk_decay = _intra_chunk(*chunked, chunk_size)

    if initial_state is None:
        initial_state = v.new_zeros((num_seqs, value_heads, k.shape[-1], v.shape[-1]), dtype=torch.float32)
    state = initial_state.float()[layout.order]  # sorted: the running sequences come first
    out_chunks, first = [], 0
    for running in layout.active:
        chunks = slice(first, first + running)
        entering = state[:running]
        corrected = new_values[chunks] - state_keys[chunks] @ entering
        out_chunks.append(q_decayed[chunks] @ entering + scores[chunks] @ corrected)
        leaving = entering * chunk_decay[chunks] + k_decayed[chunks].transpose(-1, -2) @ corrected
        state = torch.cat([leaving, state[running:]])
        first += running

    final_state = torch.empty_like(state).index_copy(0, layout.order, state)
    if not out_chunks:
        return v.new_zeros(v.shape), final_state
    out = torch.cat(out_chunks).transpose(1, 2).reshape(layout.num_chunks * chunk_size, value_heads, v.shape[-1])
    return out[layout.padded_row].to(v.dtype), final_state


@torch.no_grad()
def recurrent_gated_delta_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    backend: str = "auto",
) -> torch.Tensor:
    """One decode token per row: S = exp(g) S; S += k (beta (v - S^T k))^T; o = S^T q / sqrt(Dk).

    q, k: [B, Hk, Dk] L2-normalised; v: [B, Hv, Dv]; g, beta: [B, Hv]; state: [B, Hv, Dk, Dv] fp32,
    updated in place. Returns [B, Hv, Dv] in v's dtype. `backend` (`resolve_delta_backend`): fla's
    fused recurrent kernel or torch ops. Neither reads from the device, so CUDA graphs can capture them.
    """
    if resolve_delta_backend(backend, v.device) == "fla":
        return _fla_gated_delta_step(q, k, v, g, beta, state)
    return _torch_gated_delta_step(q, k, v, g, beta, state)


def _fla_gated_delta_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> torch.Tensor:
    """recurrent_gated_delta_step through fla's fused_recurrent_gated_delta_rule: each row a sequence of
    one token ([B, 1, H, D]), grouped key heads and state layout as in `_fla_chunk_gated_delta_rule`.
    The kernel reads q and k in fp32 whatever v's dtype. fla 0.6's kernel neither updates a state in
    place nor takes per-row slot indices (vLLM's copy of it does), so its new state is copied back:
    one more read and write of the state than an in-place kernel, and still fewer than the torch
    step's. It autotunes nothing: compiled on its first call, it can be captured (not yet run on a GPU)."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    out, new_state = fused_recurrent_gated_delta_rule(
        q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), g.float().unsqueeze(1), beta=beta.unsqueeze(1),
        scale=k.shape[-1] ** -0.5, initial_state=state, output_final_state=True)
    state.copy_(new_state)
    return out[:, 0]


def _torch_gated_delta_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> torch.Tensor:
    """recurrent_gated_delta_step in torch ops, in fp32."""
    value_heads = v.shape[1]
    q = _expand_key_heads(q.float() * k.shape[-1] ** -0.5, value_heads)
    k = _expand_key_heads(k.float(), value_heads)
    state.mul_(g.float().exp()[..., None, None])
    predicted = torch.einsum("bhkv,bhk->bhv", state, k)
    correction = (v.float() - predicted) * beta.float().unsqueeze(-1)
    state.add_(k.unsqueeze(-1) * correction.unsqueeze(-2))
    return torch.einsum("bhkv,bhk->bhv", state, q).to(v.dtype)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor | PackedSequences,
    initial_state: torch.Tensor | None = None,
    activation: Activation = F.silu,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over packed sequences: out[t, c] = act(sum_j weight[c, j] x[t - K + 1 + j, c]).

    x: [T, C]; cu_seqlens: [N+1] (0 first, T last) or their `PackedSequences`; weight: [C, K], no bias. Inputs before a sequence's
    start come from its initial_state [N, C, K-1] (the previous K-1 inputs, oldest first; None: zeros),
    never from the previous sequence.
    Returns out [T, C] in x's dtype (computed in weight's dtype, as transformers' causal_conv1d_fn) and
    final_state [N, C, K-1] in x's dtype: each sequence's last K-1 inputs, its initial ones included
    when it is shorter than K-1.
    """
    channels, kernel = weight.shape
    history = kernel - 1
    device = x.device
    packed = PackedSequences.of(cu_seqlens, device)
    num_seqs, cu_seqlens, seq_of_token = packed.num_seqs, packed.cu_seqlens, packed.seq_of_token
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    # One stream of [history | x_i] per sequence, back to back: a single conv1d call covers all of
    # them, and the windows that straddle two sequences are computed but never read.
    token = torch.arange(x.shape[0], device=device)
    stream_row = token + (seq_of_token + 1) * history
    seq_stream_start = cu_seqlens[:-1] + torch.arange(num_seqs, device=device) * history
    history_rows = (seq_stream_start.unsqueeze(1) + torch.arange(history, device=device)).reshape(-1)
    if initial_state is None:
        initial_state = x.new_zeros((num_seqs, channels, history))
    stream = x.new_zeros((x.shape[0] + num_seqs * history, channels))
    stream = stream.index_copy(0, history_rows, initial_state.to(x.dtype).transpose(1, 2).reshape(-1, channels))
    stream = stream.index_copy(0, stream_row, x)

    conv = F.conv1d(stream.to(weight.dtype).t().unsqueeze(0), weight.unsqueeze(1), groups=channels)[0]
    out = conv.t()[stream_row - history]  # conv row r is the window ending at stream row r + history
    if activation is not None:
        out = activation(out)
    final_rows = (seq_stream_start + lengths).unsqueeze(1) + torch.arange(history, device=device)
    final_state = stream[final_rows].permute(0, 2, 1)
    return out.to(x.dtype), final_state


@torch.no_grad()
def causal_conv1d_step(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, activation: Activation = F.silu
) -> torch.Tensor:
    """One decode token per row of causal_conv1d: x [B, C], state [B, C, K-1] (the previous inputs,
    oldest first) shifted in place with x appended. Returns [B, C] in x's dtype."""
    window = torch.cat([state, x.to(state.dtype).unsqueeze(-1)], dim=-1)
    state.copy_(window[..., 1:])
    out = (window.to(weight.dtype) * weight).sum(dim=-1)
    if activation is not None:
        out = activation(out)
    return out.to(x.dtype)
