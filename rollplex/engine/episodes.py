"""What the engine asks of a multi-turn (agentic) rollout: rollplex.agent.Episodes provides it.

A sample's turn ends where the policy samples a stop token or one of `turn_end_ids`
(a tool call's closing tag). The engine then hands the turn to `end_turn`: the episode
either ends there (a finish reason) or waits for an observation, which a later `poll`
returns (or a finish reason instead: a tool that gave up the episode). Meanwhile the
sample holds its KV blocks but no decode row, and the others decode on. `finish`
closes an episode and says how it went (the sample's `EpisodeLog`).

Samples are named by `SampleKey`: (the request's index in `generate`, the sample's index
in its group).
"""

from __future__ import annotations

from typing import Protocol

from rollplex.models.inputs import EpisodeLog, Observation, Sample

SampleKey = tuple[int, int]


class Episodes(Protocol):
    turn_end_ids: frozenset[int]  # token ids that end a turn besides the stop tokens

    def end_turn(self, key: SampleKey, response: list[int]) -> str | None:
        """The sample's turn ended; `response`: its response so far (its earlier observations
        included). None: it waits for an observation (`poll`); else the finish reason it ends with."""

    def poll(self, wait: bool) -> list[tuple[SampleKey, Observation | str]]:
        """The observations ready since the last call (or finish reasons for episodes that end
        instead); with `wait`, block until at least one is ready."""

    def finish(self, key: SampleKey, sample: Sample) -> EpisodeLog:
        """The sample's episode is over (`sample`: as it ended): how it went."""
