"""The state pool of layers that carry a recurrent state instead of K/V, and the
backends that read and write it (Qwen3.5's Gated DeltaNet layers; the model says
which layers and what shapes: `VisionLanguageModel.recurrent_state_shapes`).

A sequence's state in such a layer is a fixed size whatever its length: the
short convolution's last kernel - 1 inputs (in the weights' dtype) and the
recurrent state (float32: bf16 drifts over a long response). So the pool is not
paged: it has one slot per decode row of the engine's `DecodeBatch`, and a
running sequence's state lives in its row's slot for as long as it decodes.
One extra slot at the end is a sink, which the padded rows of a CUDA-graph
decode batch update, as their K/V go to the KV pool's sink block.

Prefill runs each packed sequence from a zero state (the chunked rule over the
whole prompt, no state crossing a sequence boundary; a multi-turn episode's next
turn continues from the state it kept while it waited for its observation) and writes its final state
into the slot of every sequence that decodes from it: a GRPO group's prompt is
prefilled once, and each of its n samples starts from a copy of its state (the
fork), as they share its KV blocks. A preempted sequence is prefilled again,
prompt and generated tokens, which recomputes its state into its new row.
Decode updates each row's slot in place: one convolution step and one step of
the gated delta rule per token.

Like the KV pool, the pool is allocated once for the engine's life (the decode
graphs read it by address) and can be released and allocated again, at the same
size; a generation with more rows than it has (a group larger than
max_num_seqs) grows it, which moves it and so recaptures the graphs.
"""

from __future__ import annotations

import copy

import torch

from rollplex.models.protocol import RecurrentStateShapes
from rollplex.ops.gated_delta import (PackedSequences, causal_conv1d, causal_conv1d_step, chunk_gated_delta_rule,
                                      recurrent_gated_delta_step)


class RecurrentStatePool:
    """Per layer with a recurrent state: `conv` (rows + 1, channels, kernel - 1) in the
    model's dtype and `recurrent` (rows + 1, value heads, key dim, value dim) in float32,
    both layers-first in one tensor each; row `sink_row` (the last) is the sink."""

    def __init__(self, shapes: RecurrentStateShapes, rows: int, dtype: torch.dtype, device: torch.device | str):
        self.shapes, self.dtype, self.device = shapes, dtype, torch.device(device)
        self.layer_index = {layer: i for i, layer in enumerate(shapes.layers)}
        self.rows = rows
        self.conv: torch.Tensor | None = None
        self.recurrent: torch.Tensor | None = None
        self.allocate()

    @staticmethod
    def bytes_per_row(shapes: RecurrentStateShapes, dtype: torch.dtype) -> int:
        """One sequence's state, every layer."""
        channels, history = shapes.conv
        heads, key_dim, value_dim = shapes.recurrent
        return len(shapes.layers) * (channels * history * dtype.itemsize + heads * key_dim * value_dim * 4)

    @property
    def sink_row(self) -> int:
        return self.rows

    @property
    def nbytes(self) -> int:
        return 0 if self.conv is None else (self.rows + 1) * self.bytes_per_row(self.shapes, self.dtype)

    def allocate(self) -> None:
        """The pool's memory, unless it holds it. Zeros, as the KV pool: a sink row of
        uninitialised memory could hold NaN, which nothing reads but a check would see."""
        if self.conv is not None:
            return
        layers, slots = len(self.shapes.layers), self.rows + 1
        self.conv = torch.zeros(layers, slots, *self.shapes.conv, dtype=self.dtype, device=self.device)
        self.recurrent = torch.zeros(layers, slots, *self.shapes.recurrent, dtype=torch.float32, device=self.device)

    def release(self) -> None:
        """Free the pool's memory; the next `allocate` makes it anew (elsewhere: new graphs)."""
        self.conv = self.recurrent = None

    def hold_rows(self, rows: int) -> None:
        """At least `rows` slots besides the sink: a larger pool (moved: graphs are captured again)."""
        if rows > self.rows:
            self.rows = rows
            self.release()
            self.allocate()

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv, recurrent) slots of decoder layer `layer`, each indexed by row first."""
        assert self.conv is not None, "the recurrent state pool was released"
        i = self.layer_index[layer]
        return self.conv[i], self.recurrent[i]

    def save(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of row `row`'s state, every layer: (conv (layers, channels, kernel - 1), recurrent
        (layers, value heads, key dim, value dim)), as a multi-turn episode keeps it while it waits for
        its observation without a row (rollplex.engine.scheduler)."""
        return self.conv[:, row].clone(), self.recurrent[:, row].clone()

    def with_data(self, conv: torch.Tensor, recurrent: torch.Tensor) -> RecurrentStatePool:
        """This pool's description over other storage of the same layout: what a CUDA
        graph captured reads (the runner's CPU stand-in replays through it)."""
        view = copy.copy(self)
        view.conv, view.recurrent = conv, recurrent
        return view


class PrefillStates:
    """A prefill's recurrent layers: packed sequences of boundaries `cu_seqlens`, each from
    a zero state, or from `initial[i]` where given (a multi-turn episode continuing from the state
    it kept while it waited: `RecurrentStatePool.save`); the final state of sequence `sources[j]`
    goes to slot `rows[j]` (no rows: the states are computed and dropped, as when a failed step is
    run again to locate it)."""

    def __init__(self, pool: RecurrentStatePool, cu_seqlens: list[int], rows: list[int], sources: list[int],
                 initial: list[tuple[torch.Tensor, torch.Tensor] | None] = ()):
        device = pool.device
        self.pool = pool
        self.cu_seqlens = PackedSequences([b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])], device)
        self.rows = torch.tensor(rows, dtype=torch.long, device=device)
        self.sources = torch.tensor(sources, dtype=torch.long, device=device)
        self.initial = None  # (conv (layers, N, ...), recurrent (layers, N, ...)), or None: every sequence from zero
        if any(state is not None for state in initial):
            zeros = tuple(torch.zeros_like(t) for t in next(s for s in initial if s is not None))
            self.initial = tuple(torch.stack([(s or zeros)[part] for s in initial], dim=1) for part in (0, 1))

    def _initial(self, layer: int, part: int) -> torch.Tensor | None:
        return None if self.initial is None else self.initial[part][self.pool.layer_index[layer]]

    def short_convolution(self, layer: int, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        initial = self._initial(layer, 0)
        out, final = causal_conv1d(x, weight, self.cu_seqlens, None if initial is None else initial.to(x.dtype))
        self.pool.layer(layer)[0].index_copy_(0, self.rows, final[self.sources].to(self.pool.dtype))
        return out

    def gated_delta(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor) -> torch.Tensor:
        out, final = chunk_gated_delta_rule(q, k, v, g, beta, self.cu_seqlens, self._initial(layer, 1))
        self.pool.layer(layer)[1].index_copy_(0, self.rows, final[self.sources])
        return out


class DecodeStates:
    """A decode step's recurrent layers: token i continues the sequence whose state is in slot `rows[i]`
    (a CUDA graph's static buffer: padded rows name the sink slot), which it updates."""

    def __init__(self, pool: RecurrentStatePool, rows: torch.Tensor):
        self.pool, self.rows = pool, rows

    def short_convolution(self, layer: int, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        slots = self.pool.layer(layer)[0]
        state = slots[self.rows]
        out = causal_conv1d_step(x, weight, state)
        slots.index_copy_(0, self.rows, state)
        return out

    def gated_delta(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor) -> torch.Tensor:
        slots = self.pool.layer(layer)[1]
        state = slots[self.rows]
        out = recurrent_gated_delta_step(q, k, v, g, beta, state)
        slots.index_copy_(0, self.rows, state)
        return out
