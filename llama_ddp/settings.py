"""What every component's settings share (torchtitan's per-component ``Config``): a field with
its default and help text (`setting`), the flag it is on the command line (`flag_name`), its
choices from a ``Literal`` type (`literal_choices`), and the checks of each value alone
(`Settings.validate`). Each component declares its own dataclass beside its code (the model's in
model/config.py, the data's in data/sources.py, ...); train/config.py composes them, and
train/cli.py turns their fields into flags, TOML keys and ``--help``.
"""

from __future__ import annotations

import math
import typing
from dataclasses import MISSING, field, fields
from typing import Any, Literal

from llama_ddp.errors import UserError

# The largest float32: a float setting becomes a tensor's scalar (an lr, a decay), which a larger
# one overflows (float(torch.finfo(torch.float32).max), without importing torch).
FLOAT32_MAX = 3.4028234663852886e38


def setting(default: Any, help: str, **metadata: Any) -> Any:
    """A settings field: its default and the help text its flag shows (``metadata``: more of
    what the flag needs, e.g. ``const``, the value of the flag alone)."""
    return field(default=default, metadata={"help": help, **metadata})


def choices_help(registry: dict[str, Any]) -> str:
    """``name: help`` of each entry of a registry, for a flag's help text."""
    return "; ".join(f"{name}: {entry.help}" for name, entry in registry.items())


def flag_name(name: str) -> str:
    return name.replace("_", "-")


def literal_choices(hint: Any) -> tuple | None:
    """The allowed values of a ``Literal[...]`` (or ``Literal | None``) type hint, else None."""
    for arg in (hint, *typing.get_args(hint)):
        if typing.get_origin(arg) is Literal:
            return typing.get_args(arg)
    return None


def field_default(f: Any) -> Any:
    if isinstance(f.default, tuple):  # a repeatable flag's values
        return ",".join(map(str, f.default)) or None
    return None if f.default is MISSING else f.default


class Settings:
    """A component's settings (a dataclass): ``validate()`` checks each value alone (its choices,
    a finite number that fits a float32), then the component's own rules (``check``), naming
    the flag."""

    def validate(self) -> Settings:
        hints = typing.get_type_hints(type(self))
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            choices = literal_choices(hints[f.name])
            if choices and value not in choices and value is not None:
                raise UserError(
                    f"--{flag_name(f.name)} {value!r} is not one of: {', '.join(choices)}"
                )
            if isinstance(value, float) and not math.isfinite(value):
                raise UserError(f"--{flag_name(f.name)} must be a finite number, got {value}")
            if isinstance(value, float) and abs(value) > FLOAT32_MAX:
                raise UserError(
                    f"--{flag_name(f.name)} {value:g} does not fit a float32, in which the run "
                    f"computes (give a value of magnitude at most {FLOAT32_MAX:.3g})"
                )
        self.check()
        return self

    def check(self) -> None:
        """The component's own rules beyond each value's type (none by default)."""

    def positive(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise UserError(f"--{flag_name(name)} must be positive, got {value}")

    def non_negative(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if value is not None and value < 0:
                raise UserError(f"--{flag_name(name)} must be >= 0, got {value}")
