"""The experts each token went through in a generation, recorded for rollout routing
replay (R3, arXiv 2510.11370: the trainer replays the routes the rollout chose).

An MoE model's forwards give each token's top-k expert indices per decoder layer
(rollplex.models.moe.Routing). A group's prompt is routed once, by its prefill:
those routes are the group's (`PromptState.routes`), which every sample shares. A
response token's routes are those of the forward that fed it: decode steps (the
token sampled at one step is fed at the next), or the prefill of a sequence
recomputed after a preemption. A response's last token is never fed: its row
stays UNRECORDED, and the trainer routes it live (its hidden state predicts no
response token).

Decode writes into a device buffer with a row per decode row, indexed by response
token: a scatter per step, no host sync, graph or not. A sequence that leaves its
row (finished or preempted) takes a copy of what its row recorded; a recompute's
prefill adds its own piece. `sample_routes` lays the pieces out in response order,
later pieces over earlier ones.
"""

from __future__ import annotations

import torch

from rollplex.engine.sequence import Sequence
from rollplex.models.moe import UNRECORDED, Routing


class RouteLog:
    """One generation's routes (see the module docstring): `num_rows` decode rows, responses of
    up to `max_response` tokens, `num_layers` decoder layers of top-`top_k` routing."""

    def __init__(self, num_rows: int, max_response: int, num_layers: int, top_k: int, device: torch.device):
        # One column more than a response has: a row that finished at one step feeds its last token at the
        # next (the engine runs ahead), which lands there and is never read.
        self.width = max_response + 1
        self.buffer = torch.full((num_rows, self.width, num_layers, top_k), UNRECORDED, dtype=torch.int16,
                                 device=device)
        self.prompt_lens = torch.zeros(num_rows, dtype=torch.long, device=device)
        self.decode_start = [0] * num_rows  # each row's first response index that decode feeds

    def prefilled(self, seqs: list[Sequence], bounds: list[int], routing: Routing) -> None:
        """A prefill's routes, its sequences' new tokens packed at `bounds`: a group's prompt routes,
        a recomputed sequence's response tokens, or a multi-turn episode's tokens past the K/V it
        kept (its observation, and its turn's last token where no decode step fed it)."""
        routes = routing.routes(self.buffer.shape[2])
        for seq, start, end in zip(seqs, bounds, bounds[1:]):
            prompt = seq.num_prompt
            if seq.is_group_prompt:
                seq.prompt.routes = routes[start:start + prompt].clone()
            else:
                first = max(seq.num_cached, prompt)  # the first response token this prefill computed
                seq.route_pieces.append((first - prompt, routes[start + first - seq.num_cached:end].clone()))

    def joined(self, seqs: list[Sequence], rows: list[int]) -> None:
        """Sequences starting to decode in `rows`: decode feeds their response tokens from the one they sample next."""
        for seq, row in zip(seqs, rows):
            self.decode_start[row] = len(seq) - seq.num_prompt
        self.prompt_lens[torch.tensor(rows, device=self.prompt_lens.device)] = torch.tensor(
            [s.num_prompt for s in seqs], device=self.prompt_lens.device)

    def decoded(self, rows: torch.Tensor, lengths: torch.Tensor, routing: Routing) -> None:
        """A decode step's routes of the token each of its `rows` fed (a graph's routing: its first
        rows): token `lengths - 1` of its sequence (lengths: StepInputs.lengths). Device ops only."""
        response_index = (lengths - 1 - self.prompt_lens[rows]).clamp(0, self.width - 1)
        self.buffer[rows, response_index] = routing.routes(self.buffer.shape[2])[:len(rows)]

    def left(self, seq: Sequence, row: int) -> None:
        """`seq` leaves `row` (finished or preempted, its tokens recorded): it keeps what decode fed
        of its response (all but its last token, which nothing fed yet)."""
        start, end = self.decode_start[row], len(seq) - seq.num_prompt - 1
        if end > start:
            seq.route_pieces.append((start, self.buffer[row, start:end].clone()))

    def fed_last(self, seq: Sequence, row: int) -> None:
        """`seq`, which left `row` to wait for its observation, had its last token fed by a decode step
        run ahead (whose routes are in the row still): it keeps them, as its continuation does not feed
        that token again."""
        index = len(seq) - seq.num_prompt - 1
        seq.route_pieces.append((index, self.buffer[row, index:index + 1].clone()))

    def sample_routes(self, seq: Sequence) -> torch.Tensor:
        """The routes of `seq`'s response tokens (response length, layers, k), UNRECORDED where no forward
        fed the token."""
        out = self.buffer.new_full((len(seq) - seq.num_prompt, *self.buffer.shape[2:]), UNRECORDED)
        for start, piece in seq.route_pieces:
            out[start:start + len(piece)] = piece
        return out
