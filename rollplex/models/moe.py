"""Sparse mixture-of-experts MLP blocks (Qwen3-VL-MoE's, Qwen3.5-MoE's), and what a
forward does with its routes besides routing them (`Routing`).

`SparseMoE` is a decoder layer's MLP: a router (`gate`, a linear map to one logit
per expert), softmax in float32, the top-k experts of each token and their
probabilities, renormalised to sum to 1 (`norm_topk_prob`); each token goes
through its k experts (`Experts`, SwiGLU with gate and up fused) and their outputs
are summed by those weights. Qwen3.5-MoE adds a shared expert that every token
goes through, scaled by sigmoid(shared_expert_gate(x)).

`Experts` sorts the token-expert pairs by expert and runs one grouped GEMM per
projection (rollplex.ops.grouped_mm: torch._grouped_mm on CUDA, a loop over
experts on CPU, the reference). With expert parallelism its `dispatcher` moves
the sorted rows to the ranks holding their experts and back
(rollplex.models.expert_parallel). Weights are laid out as the GEMM reads them,
which is the Qwen3-VL-MoE hub checkpoints' layout: gate_up_proj (experts,
hidden, 2 * inter), gate's columns first; down_proj (experts, inter, hidden).

Routes and replay: a forward's caller may give its attention backend a `Routing`
(`with_routing`); every MoE layer then finds it there (`routing_of`), the way
layers find the backend's other per-forward state, so an activation-checkpointed
layer's recompute, which calls the layer again with the same backend, routes
exactly as its forward did. A `Routing` can record each token's top-k expert
indices per layer (the engine's rollout, the old-logprob pass), replay recorded
ones (R3 and R2 routing replay: the indices are fixed, the weights still come
from the live router probabilities, so the router keeps its gradient), and keeps
each layer's load, its router-probability sums (the auxiliary loss) and how often
the live router agrees with the replayed routes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from rollplex.dist import local_tensor
from rollplex.ops.grouped_mm import grouped_mm, resolve_grouped_mm

__all__ = ["Experts", "LayerRoutes", "MoEArgs", "Routing", "SparseMoE", "apply_tp", "check_tp", "moe_args",
           "routing_of", "sort_by_expert", "with_routing"]

UNRECORDED = -1  # a replayed route row of this value: the token was never routed in the recording (route live)


@dataclass
class MoEArgs:
    """A MoE decoder's expert shape, as config.json's text config names it."""

    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.001
    shared_expert_intermediate_size: int = 0  # 0: no shared expert (Qwen3-VL-MoE)
    decoder_sparse_step: int = 1  # every this many layers is sparse ...
    mlp_only_layers: list[int] = field(default_factory=list)  # ... except these, which keep a dense MLP

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


@dataclass
class LayerRoutes:
    """One MoE layer's routing in one forward."""

    chosen: torch.Tensor  # (tokens, k) int16: the experts each token went to
    counted: torch.Tensor  # () float32: the tokens counted in `load` and `prob_sum` (Routing.counted)
    load: torch.Tensor  # (experts,) float32: the counted tokens' token-expert pairs routed to each
    prob_sum: torch.Tensor  # (experts,) float32: router probabilities summed over counted tokens (differentiable)
    agreed: torch.Tensor | None  # () float32: replayed tokens whose live top-k set equals the replayed one
    replayed: torch.Tensor | None  # () float32: tokens with a replayed route


class Routing:
    """What one forward's MoE layers do with their routes besides routing (see the module
    docstring). `replay` (tokens, decoder layers, k): recorded expert indices, in the
    forward's token order, that each layer routes by; a token whose row is UNRECORDED
    routes live. Every layer's chosen indices are kept (`routes`: the recording). `counted`
    (tokens,) bool: the tokens whose routing the load and the auxiliary loss count (an
    update's response tokens); None: all. A plain class, not a dataclass: FSDP2 rebuilds
    dataclass arguments of a module call.

    Each layer's `LayerRoutes` is stored by layer, so an activation-checkpoint
    recompute overwrites it with the same values rather than counting it twice."""

    def __init__(self, replay: torch.Tensor | None = None, counted: torch.Tensor | None = None):
        self.replay, self.counted = replay, counted
        self.layers: dict[int, LayerRoutes] = {}

    def routes(self, num_layers: int | None = None) -> torch.Tensor:
        """The recorded routes (tokens, decoder layers, k) int16, UNRECORDED at the dense layers;
        `num_layers` columns (default: up to the last MoE layer)."""
        if not self.layers:
            raise ValueError("no MoE layer recorded its routes in this forward")
        first = next(iter(self.layers.values())).chosen
        num_layers = num_layers or max(self.layers) + 1
        out = torch.full((first.shape[0], num_layers, first.shape[1]), UNRECORDED, dtype=torch.int16,
                         device=first.device)
        for layer, routes in self.layers.items():
            out[:, layer] = routes.chosen
        return out

    def aux_loss(self, num_experts: int) -> torch.Tensor:
        """Switch Transformer's load-balancing loss (Fedus et al. 2021, arXiv 2101.03961, eqs. 4-6),
        over every MoE layer of the forward as transformers' `load_balancing_loss_func` sums it:

            aux = E * sum_e f_e * P_e,  f_e = (sum_l load_le) / (T * L),  P_e = (sum_l prob_sum_le) / (T * L)

        with E experts, T counted tokens, L MoE layers, load_le the token-expert pairs layer l
        sent to expert e (so sum_e f_e = k) and prob_sum_le the router probabilities of e summed
        over the tokens. Its gradient reaches the router through P only."""
        layers = list(self.layers.values())
        if not layers:
            return torch.zeros(())
        rows = torch.stack([r.counted for r in layers]).sum().clamp(min=1)
        load = torch.stack([r.load for r in layers]).sum(0) / rows
        probs = torch.stack([r.prob_sum for r in layers]).sum(0) / rows
        return num_experts * (load * probs).sum()

    def metrics(self) -> dict[str, torch.Tensor]:
        """Sums for `moe/*` metrics, as tensors (no host sync): the routes the live router
        agreed with and those replayed, and max / mean expert load summed over layers."""
        layers = list(self.layers.values())
        if not layers:
            return {}
        load = torch.stack([r.load for r in layers])
        out = {"load_max_over_mean": (load.max(-1).values / load.mean(-1).clamp(min=1e-9)).sum(),
               "layers": torch.tensor(float(len(layers)))}
        compared = [r for r in layers if r.replayed is not None]
        if compared:
            out["agreed"] = torch.stack([r.agreed for r in compared]).sum()
            out["replayed"] = torch.stack([r.replayed for r in compared]).sum()
        return out


def check_tp(args: Any, tp: int) -> None:
    """An MoE family's `ModelFamily.check_tp`: no TP plan splits the experts yet (the dense plans would split
    the attention and leave every rank all the experts, most of the weights), so any size but 1 is refused."""
    if tp != 1:
        # The caller names the setting and its value (rollplex.rl.setup: "parallel.tp 2: ...").
        raise ValueError("MoE families run at tensor parallel 1 for now: split the experts over ranks with parallel.ep")


def apply_tp(model: nn.Module, tp_mesh: Any) -> nn.Module:
    """An MoE family's `ModelFamily.apply_tp`: `model` as it is on a TP mesh of one rank (the only size
    `check_tp` lets through)."""
    check_tp(model.args, tp_mesh.size())
    return model


def moe_args(model: Any) -> MoEArgs | None:
    """An MoE model's expert shape (its text args' `moe`); None for a dense model."""
    return getattr(model.args.text, "moe", None)


def with_routing(attn: Any, routing: Routing | None) -> Any:
    """`attn` (an attention backend, a plain object) carrying `routing` for the MoE layers it reaches."""
    attn.routing = routing
    return attn


def routing_of(attn: Any) -> Routing | None:
    return getattr(attn, "routing", None)


def sort_by_expert(chosen: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """chosen (tokens, k) -> the token-expert pairs sorted by expert (stable: by token within an
    expert): `order` (pairs,) into chosen.flatten(), `token_of` (pairs,) each pair's token, and
    `ends` (experts,) int32, the cumulative pair count per expert. No host sync."""
    flat = chosen.flatten().long()
    order = flat.argsort(stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    return order, order // chosen.shape[1], counts.cumsum(0).to(torch.int32)


class Experts(nn.Module):
    """Every expert's SwiGLU, stacked: gate_up_proj (experts, hidden, 2 * inter), gate's columns
    first, and down_proj (experts, inter, hidden). `backend`: rollplex.ops.grouped_mm's, resolved
    for the input's device at each call. `dispatcher`: expert parallelism's token exchange (None:
    every expert is on this rank)."""

    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden, 2 * inter))
        self.down_proj = nn.Parameter(torch.empty(num_experts, inter, hidden))
        self.backend = "auto"
        self.dispatcher: Any = None

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x (tokens, hidden), chosen (tokens, k) expert indices, weights (tokens, k) -> the weighted sum of
        each token's experts' outputs (tokens, hidden), summed in ascending expert order."""
        order, token_of, ends = sort_by_expert(chosen, self.num_experts)
        rows = x[token_of]
        if self.dispatcher is None:
            out = self.swiglu(rows, ends)
        else:
            out = self.dispatcher(self, rows, ends)
        out = out * weights.flatten()[order, None]
        return torch.zeros_like(x).index_add(0, token_of, out.to(x.dtype))

    def swiglu(self, rows: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """Rows sorted by expert, with their experts' cumulative `ends` -> each row through its expert. Under
        expert parallelism the weights are DTensors split by expert: this rank's experts are their local tensors,
        and `ends` counts those experts' rows."""
        backend = resolve_grouped_mm(self.backend, rows.device)
        gate, up = grouped_mm(rows, local_tensor(self.gate_up_proj), ends, backend).chunk(2, dim=-1)
        return grouped_mm(F.silu(gate) * up, local_tensor(self.down_proj), ends, backend)


class SharedExpert(nn.Module):
    """down(silu(gate(x)) * up(x)), as the dense MLP, for every token."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    """A decoder layer's MoE MLP (see the module docstring); `layer` is its decoder layer's index,
    which a `Routing` keys its routes by. Module names are the checkpoints'."""

    def __init__(self, hidden: int, args: MoEArgs, layer: int):
        super().__init__()
        self.layer, self.top_k, self.norm_topk_prob = layer, args.num_experts_per_tok, args.norm_topk_prob
        self.gate = nn.Linear(hidden, args.num_experts, bias=False)
        self.experts = Experts(args.num_experts, hidden, args.moe_intermediate_size)
        if args.shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(hidden, args.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        else:
            self.shared_expert = None

    def forward(self, x: torch.Tensor, routing: Routing | None = None) -> torch.Tensor:
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        live = probs.topk(self.top_k, dim=-1).indices
        chosen = live if routing is None or routing.replay is None else self._replayed(routing.replay, live)
        weights = probs.gather(-1, chosen)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        out = self.experts(x, chosen, weights.to(x.dtype))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if routing is not None:
            routing.layers[self.layer] = self._routes(routing, probs, chosen, live)
        return out

    def _replayed(self, replay: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        if replay.shape[0] != live.shape[0] or replay.shape[-1] != self.top_k:
            raise ValueError(f"layer {self.layer}: replayed routes of shape {tuple(replay.shape)} do not match the "
                             f"forward's {live.shape[0]} tokens and top-{self.top_k} routing")
        rows = replay[:, self.layer].long()
        return torch.where(rows[:, :1] == UNRECORDED, live, rows)

    def _routes(self, routing: Routing, probs: torch.Tensor, chosen: torch.Tensor,
                live: torch.Tensor) -> LayerRoutes:
        # Weights, not a boolean index: no host sync (a forward in the decode window must never wait).
        weight = (torch.ones(chosen.shape[0], device=probs.device) if routing.counted is None
                  else routing.counted.to(torch.float32))
        load = torch.zeros(probs.shape[-1], dtype=torch.float32, device=probs.device).index_add_(
            0, chosen.flatten(), weight.repeat_interleave(chosen.shape[1]))
        agreed = replayed = None
        if routing.replay is not None:
            recorded = routing.replay[:, self.layer, 0] != UNRECORDED
            same = (live.sort(-1).values == chosen.sort(-1).values).all(-1)
            agreed, replayed = (same & recorded).sum().float(), recorded.sum().float()
        return LayerRoutes(chosen.detach().to(torch.int16), weight.sum(), load, (probs * weight[:, None]).sum(0),
                           agreed, replayed)
