"""The prompt work the sharing schedules run: one prompt forward per chunk of prompts and kind.

A step's prompts are cut into chunks (the mini-batches of its optimizer steps).
A schedule that shares the prompt's work across its samples (serial-prefix,
overlap, overlap-stream) runs these items once per prompt, between or after the
decode steps (rollplex.rl.prompt_work runs them); the memory plan counts the same
items (rollplex.rl.memory), and the scheduler admits them by its estimates.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the options' type only: the memory plan imports this module
    from rollplex.rl.memory.inputs import MemoryOptions


class PromptKind(str, Enum):
    """Whose prompt forward a prompt-work item runs. A str that prints as its value
    ("ref"), so metrics, traces and reports name kinds as before (what
    enum.StrEnum does, which needs Python 3.11)."""

    REF = "ref"  # the reference model's
    ACTOR = "actor"  # the actor's, with its graph
    OLD = "old"  # the actor's without graph, for recomputed old logprobs

    __str__ = str.__str__  # else str() prints PromptKind.REF, and so does format() from Python 3.12
    __format__ = str.__format__

    @classmethod
    def _missing_(cls, value: object) -> PromptKind:
        raise ValueError(f"unknown prefix kind {value!r}; expected one of {', '.join(cls)}")


@dataclass(frozen=True)
class PromptItem:
    """One prompt forward per chunk of prompts (rollplex.rl.prompt_work.PromptWork)."""

    kind: PromptKind
    chunk: int
    keep_graph: bool
    reuses_vision: bool  # reads the rollout's cached vision features instead of running the tower

    def __post_init__(self):
        object.__setattr__(self, "kind", PromptKind(self.kind))  # a kind given by its value ("ref") is parsed


def prompt_work_items(options: MemoryOptions) -> list[PromptItem]:
    """A step's prompt work, in admission order: per chunk (one optimizer step's
    prompts) the reference model's forward, then the actor's with its graph
    (first chunk: later chunks train on weights that do not exist yet during
    rollout) or the old policy's (later chunks, when old logprobs are recomputed).
    Items reuse the rollout's vision features where the tower is the rollout's and
    needs no gradient: the old policy always, the others when the tower is frozen."""
    frozen, items = options.freeze_vision, []
    for chunk in range(options.updates_per_batch):
        if options.ref_model:
            items.append(PromptItem(PromptKind.REF, chunk, False, frozen))
        if chunk == 0:
            items.append(PromptItem(PromptKind.ACTOR, chunk, True, frozen))
        elif options.recompute_old_logprobs:
            items.append(PromptItem(PromptKind.OLD, chunk, False, True))
    return items
