"""Routing replay's routes in the layouts of the training passes (MoE models).

Each sample carries its prompt's routes and its response's (rollplex.models.inputs.Sample:
recorded by the rollout engine for R3, by the old-logprob pass for R2). A pass replays
them in its own token order (`Routing.replay`, rollplex.models.moe), and a recording
pass (R2's old pass) stores what it routed back into the samples. The layouts are those
of rollplex.models.packing.pack_groups (each group's prompt once, then its responses;
or prompt + response per sample), of a kept prompt chunk (prompts end to end) and of the
suffix passes over it (responses end to end).

`RouteMode` says what a pass does with them: route live, replay the samples' routes,
or route live and record.
"""

from __future__ import annotations

from enum import Enum

import torch

from rollplex.models.inputs import Group
from rollplex.models.moe import Routing


class RouteMode(Enum):
    LIVE = "live"  # each forward routes itself
    REPLAY = "replay"  # the samples' recorded routes
    RECORD = "record"  # route live, and store the routes in the samples (R2's old pass)


def routes_of(routing_replay: str, pass_kind: str) -> RouteMode:
    """What a pass of `pass_kind` ("old", "ref", "update") does under algorithm.routing_replay:
    rollout (R3) replays the rollout's routes everywhere; old (R2) records them in the old pass and
    replays them in the update; none routes live."""
    if routing_replay == "rollout":
        return RouteMode.REPLAY
    if routing_replay == "old":
        return {"old": RouteMode.RECORD, "update": RouteMode.REPLAY}.get(pass_kind, RouteMode.LIVE)
    return RouteMode.LIVE


def packed(groups: list[Group], share_prefix: bool) -> torch.Tensor | None:
    """The samples' routes in pack_groups' token order (tokens, layers, k); None when a sample has none."""
    samples = [s for g in groups for s in g.samples]
    if not samples or any(s.prompt_routes is None or s.routes is None for s in samples):
        return None
    if share_prefix:
        parts = [r for g in groups for r in (g.samples[0].prompt_routes, *(s.routes for s in g.samples))]
    else:
        parts = [r for s in samples for r in (s.prompt_routes, s.routes)]
    return torch.cat(parts)


def store_packed(groups: list[Group], share_prefix: bool, routing: Routing) -> None:
    """A pass's routes in pack_groups' token order, stored in its samples."""
    routes, offset = routing.routes(), 0

    def take(n: int) -> torch.Tensor:
        nonlocal offset
        offset += n
        return routes[offset - n:offset]

    for g in groups:
        prompt = len(g.prompt.input_ids)
        shared = take(prompt) if share_prefix else None
        for s in g.samples:
            s.prompt_routes = shared if share_prefix else take(prompt)
            s.routes = take(len(s.token_ids))


def responses(groups: list[Group]) -> torch.Tensor | None:
    """The samples' response routes end to end (a suffix pass's order); None when a sample has none."""
    samples = [s for g in groups for s in g.samples]
    if not samples or any(s.routes is None for s in samples):
        return None
    return torch.cat([s.routes for s in samples])


def store_responses(groups: list[Group], routing: Routing) -> None:
    """A suffix pass's routes, stored as its samples' response routes."""
    routes = routing.routes()
    for s, part in zip([s for g in groups for s in g.samples], routes.split([len(s.token_ids) for g in groups
                                                                              for s in g.samples])):
        s.routes = part


def prompts(groups: list[Group]) -> torch.Tensor | None:
    """The groups' prompt routes end to end (a kept prompt chunk's order); None when a group has none."""
    if not groups or any(not g.samples or g.samples[0].prompt_routes is None for g in groups):
        return None
    return torch.cat([g.samples[0].prompt_routes for g in groups])


def store_prompts(groups: list[Group], routing: Routing) -> None:
    """A kept prompt chunk's routes, stored as each group's samples' prompt routes."""
    for g, part in zip(groups, routing.routes().split([len(g.prompt.input_ids) for g in groups])):
        for s in g.samples:
            s.prompt_routes = part
