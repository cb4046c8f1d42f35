"""What every configuration section is built on: `Section`, whose fields are
checked (Literal choices, each section's ranges) as soon as it is constructed, by
whichever path (YAML, command line, code), and `ConfigError`, the error a bad
configuration raises."""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, ClassVar, Literal


class ConfigError(ValueError):
    """A bad configuration: unknown key, wrong type, invalid choice or missing file."""


class Section:
    """Mixin: validates Literal choices and simple ranges right after construction.

    Runs for every construction path (YAML, tyro, direct), so a bad value can never
    reach the trainer. tyro turns the ValueError into a CLI error message.
    """

    _section: ClassVar[str] = ""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            tp = field_types(type(self))[f.name]
            if typing.get_origin(tp) is Literal:
                choices = typing.get_args(tp)
                value = getattr(self, f.name)
                if value not in choices:
                    raise ConfigError(
                        f"{self._section}.{f.name}: {value!r} is not one of "
                        f"{', '.join(map(str, choices))}"
                    )
        self._check_ranges()

    def _check_ranges(self) -> None:
        """Section-specific range checks; override where needed."""

    def _require(self, ok: bool, name: str, what: str) -> None:
        if not ok:
            raise ConfigError(
                f"{self._section}.{name} must be {what}, got {getattr(self, name)!r}"
            )


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    # Annotations are strings (postponed evaluation); resolve them once per class.
    return typing.get_type_hints(cls)
