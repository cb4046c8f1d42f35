"""What a Qwen3.5 decoder's layers mix tokens through: the backend object a packed
forward passes to every layer, as the other families pass an AttentionBackend.

Full-attention layers call it as an AttentionBackend (`backend(layer, q, k, v)`);
Gated DeltaNet layers call `short_convolution` and `gated_delta`. `PackedHybridAttention`
serves packed sequences that each start from nothing (the training and logprob
passes over whole sequences): attention within each sequence, and every
sequence's convolution and recurrence from a zero state, so no state crosses a
sequence boundary. `SharedPrefixHybridAttention` serves GRPO groups whose prompt is
computed once: each response's convolution and recurrence start from its prompt's
final states (the step it shares with the kept-prefix suffix passes, whose backend,
rollplex.ops.attention.KeptPrefixAttention, reads states kept from an earlier prompt
pass: `ResponsesFromPromptStates`). The engine's decode will pass an object with the
same three calls that reads and writes each sequence's state slot.
"""

from __future__ import annotations

import torch

from rollplex.ops.attention import GroupLayout, ResponsesFromPromptStates, SharedPrefixAttention, VarlenAttention
from rollplex.ops.gated_delta import PackedSequences, causal_conv1d, chunk_gated_delta_rule


class PackedHybridAttention:
    """Packed sequences of boundaries `cu_seqlens` (0, l0, l0 + l1, ...), each from a zero
    state. A plain class, not a dataclass: FSDP2 rebuilds dataclass arguments of a module call."""

    def __init__(self, cu_seqlens: list[int], device: torch.device | str, backend: str = "torch"):
        self.attention = VarlenAttention(cu_seqlens, device, backend=backend)
        self.cu_seqlens = PackedSequences([b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])], device)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.attention(layer, q, k, v)

    def short_convolution(self, layer: int, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x (T, channels) through the depthwise causal convolution `weight` (channels, kernel), then SiLU."""
        return causal_conv1d(x, weight, self.cu_seqlens)[0]

    def gated_delta(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor) -> torch.Tensor:
        """The gated delta rule over each sequence (rollplex.ops.gated_delta.chunk_gated_delta_rule's shapes)."""
        return chunk_gated_delta_rule(q, k, v, g, beta, self.cu_seqlens)[0]


class SharedPrefixHybridAttention:
    """GRPO groups laid out [prompt | response_1 | ... | response_n] (`GroupLayout.packed`, groups back
    to back from row 0), each prompt computed once (pack_groups(..., share_prefix=True)).

    Full-attention layers attend as the other families' shared-prefix pass does
    (`SharedPrefixAttention`). DeltaNet layers run every prompt from a zero state, then every
    response as a sequence of its own that starts from its prompt's final states (the
    convolution's last inputs and the recurrent state, repeated per response): what the
    response would see after its prompt in one full sequence (`ResponsesFromPromptStates`). Each
    response's gradient reaches its prompt through those states, so the prompt's is summed over its
    responses, as the per-response full sequences would give it. A plain class for the reason
    PackedHybridAttention is.
    """

    def __init__(self, groups: list[GroupLayout], device: torch.device | str, backend: str = "torch"):
        _check_packed_groups(groups)
        self.attention = SharedPrefixAttention(groups, backend)
        self.num_tokens = groups[-1].end
        # The ops take sequences back to back: every prompt first, then every response; `restore`
        # puts their outputs back in the batch's order. Built on the host, so no layer reads the device.
        prompt_rows = torch.cat([torch.arange(g.prompt_start, g.responses_start) for g in groups])
        response_rows = torch.cat([torch.arange(g.responses_start, g.end) for g in groups])
        self.prompt_rows, self.response_rows = prompt_rows.to(device), response_rows.to(device)
        self.restore = torch.cat([prompt_rows, response_rows]).argsort().to(device)
        self.prompt_cu_seqlens = PackedSequences([g.prompt_len for g in groups], device)
        self.responses = ResponsesFromPromptStates([n for g in groups for n in g.response_lens],
                                                   [i for i, g in enumerate(groups) for _ in g.response_lens], device)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.attention(layer, q, k, v)

    def short_convolution(self, layer: int, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x (T, channels) through the depthwise causal convolution `weight` (channels, kernel), then SiLU;
        each response's window reaches back into its prompt's last inputs."""
        self._check_tokens(x)
        prompt_out, prompt_tail = causal_conv1d(x[self.prompt_rows], weight, self.prompt_cu_seqlens)
        response_out = self.responses.short_convolution(x[self.response_rows], weight, prompt_tail)
        return torch.cat([prompt_out, response_out])[self.restore]

    def gated_delta(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor) -> torch.Tensor:
        """The gated delta rule over each prompt from a zero state, then over each response from its
        prompt's final state (rollplex.ops.gated_delta.chunk_gated_delta_rule's shapes)."""
        self._check_tokens(v)
        inputs = (q, k, v, g, beta)
        prompt_out, prompt_state = chunk_gated_delta_rule(*(x[self.prompt_rows] for x in inputs),
                                                          self.prompt_cu_seqlens)
        response_out = self.responses.gated_delta(*(x[self.response_rows] for x in inputs), prompt_state)
        return torch.cat([prompt_out, response_out])[self.restore]

    def _check_tokens(self, x: torch.Tensor) -> None:
        if x.shape[0] != self.num_tokens:
            raise ValueError(f"the groups cover {self.num_tokens} tokens, the layer got {x.shape[0]}")


def _check_packed_groups(groups: list[GroupLayout]) -> None:
    """The groups must tile the batch from row 0, each prompt followed by its responses: the
    permutation SharedPrefixHybridAttention builds covers exactly those rows."""
    if not groups:
        raise ValueError("a shared-prefix pass needs at least one group")
    expected_start = 0
    for g in groups:
        if g.prompt_start != expected_start or g.responses_start != g.prompt_start + g.prompt_len:
            raise ValueError(f"group {g} is not laid out packed after row {expected_start} "
                             "(GroupLayout.packed, groups back to back)")
        if g.prompt_len == 0 or not g.response_lens or 0 in g.response_lens:
            raise ValueError(f"group {g}: a shared-prefix pass needs a prompt and responses of at least one token")
        expected_start = g.end
