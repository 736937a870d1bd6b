"""What a checkpoint's ``state.json`` may hold: every value a resumed run trusts, checked for
type and range when the file is read (`check_state`), so that a damaged or crafted file is one
line naming the field, never a traceback, and never a run that silently resumes at step -5 with
a learning rate of "fast". The manifest's hashes say the file is the one that was written; this
says that what was written is a checkpoint's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from llama_ddp.errors import UserError
from llama_ddp.precision import DTYPES

MAX_STEP = 10**12  # far past any run's steps: a larger one is damage, not progress
MAX_SECONDS = 10**9  # about 32 years: the longest duration a run keeps (budget, seconds spent)
_U32 = 2**32

Check = Callable[[Any], str | None]  # None: fine; else what is wrong with the value


def _integer(low: int, high: int) -> Check:
    def check(x: Any) -> str | None:
        if isinstance(x, bool) or not isinstance(x, int):
            return f"{x!r} is not a whole number"
        return None if low <= x <= high else f"{x} is not in [{low:,}, {high:,}]"

    return check


def _number(low: float, *, above: bool = False, high: float = math.inf) -> Check:
    """A finite number >= ``low`` (> ``low`` with ``above``), at most ``high``."""
    if high < math.inf:
        where = f"in {'(' if above else '['}{low:g}, {high:g}]"
    else:
        where = f"{'>' if above else '>='} {low}"

    def check(x: Any) -> str | None:
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            return f"{x!r} is not a number"
        if not math.isfinite(x) or x < low or (above and x == low) or x > high:
            return f"{x} is not a finite number {where}"
        return None

    return check


def _seconds(x: Any) -> str | None:
    """The seconds a run spent in each phase of its loop (train.py's TimeSpent)."""
    if not isinstance(x, dict):
        return f"{x!r:.40} is not a dict"
    check = _number(0, high=MAX_SECONDS)
    return next((f"{k} {p}" for k, v in x.items() if (p := check(v))), None)


def _fraction(x: Any) -> str | None:
    """WSD's decay fraction, in (0, 1]; None for the kinds without one."""
    return None if x is None else _number(0, above=True, high=1)(x)


def _anchor(x: Any) -> str | None:
    """A re-planned decay's [step, lr] (optim.Schedule's anchor); None for a schedule without."""
    if x is None:
        return None
    if not isinstance(x, list) or len(x) != 2:
        return f"{x!r:.40} is not a [step, lr] pair"
    return _integer(0, MAX_STEP)(x[0]) or _number(0)(x[1])


def _kind(*kinds: type) -> Check:
    names = " or ".join(k.__name__ for k in kinds)
    return lambda x: None if isinstance(x, kinds) else f"{x!r} is not a {names}"


def _choice(names: list[str]) -> Check:
    return lambda x: None if x in names else f"{x!r} is not one of {', '.join(names)}"


def _words(count: int, high: int = _U32) -> Check:
    """A list of ``count`` whole numbers in [0, ``high``) (a Mersenne Twister's state)."""

    def check(x: Any) -> str | None:
        if not isinstance(x, list) or len(x) != count:
            return f"is not a list of {count} numbers"
        bad = next((v for v in x if isinstance(v, bool) or not isinstance(v, int)), None)
        if bad is not None or not all(0 <= v < high for v in x):
            return "holds a value that is not a 32-bit word"
        return None

    return check


def _python_rng(x: Any) -> str | None:
    """random.getstate(): (version, 625 words, gauss or None)."""
    if not isinstance(x, list) or len(x) != 3:
        return f"{x!r:.40} is not Python's random state (version, 625 words, gauss)"
    return _integer(3, 3)(x[0]) or _words(625)(x[1]) or _gauss(x[2])


def _gauss(x: Any) -> str | None:
    return None if x is None else _number(-math.inf)(x)


def _numpy_rng(x: Any) -> str | None:
    """np.random.get_state(): ("MT19937", 624 words, position, has_gauss, cached gauss)."""
    if not isinstance(x, list) or len(x) != 5 or x[0] != "MT19937":
        return f"{x!r:.40} is not numpy's random state (MT19937, 624 words, pos, has_gauss, gauss)"
    return _words(624)(x[1]) or _integer(0, 624)(x[2]) or _integer(0, 1)(x[3]) or _gauss(x[4])


def _param_groups(groups: Any) -> str | None:
    """A list of optimizer groups, each a dict whose numbers (lr, weight decay, betas, ...) are
    finite."""
    if not isinstance(groups, list):
        return f"{groups!r:.40} is not a list"
    for i, group in enumerate(groups):
        if not isinstance(group, dict):
            return f"[{i}] is not an object"
        for key, value in group.items():
            values = value if isinstance(value, list) else [value]
            for v in values:
                if isinstance(v, float) and not math.isfinite(v):
                    return f"[{i}].{key} is {v}, not a finite number"
        problem = _number(0)(group.get("lr", 0.0))
        if problem:
            return f"[{i}].lr {problem}"
    return None


# Where each checked value lives (a path of keys below the file's top level) and its check.
# A part a checkpoint may lack (optional, or from an older version) is checked where present.
_FIELDS: dict[tuple[str, ...], Check] = {
    ("format",): _integer(1, 2),
    ("step",): _integer(0, MAX_STEP),
    ("parts",): _kind(dict),
    ("parts", "settings"): _kind(dict),
    ("parts", "settings", "model_shape"): _kind(dict),
    ("parts", "train"): _kind(dict),
    ("parts", "train", "step"): _integer(0, MAX_STEP),
    ("parts", "train", "tokens"): _integer(0, 2**63 - 1),
    ("parts", "train", "source_tokens"): _kind(dict),
    ("parts", "train", "seconds"): _seconds,
    ("parts", "train", "budget_spent_s"): _number(0, high=MAX_SECONDS),
    ("parts", "schedule"): _kind(dict),
    ("parts", "schedule", "name"): _kind(str),
    ("parts", "schedule", "lr"): _number(0, above=True),
    ("parts", "schedule", "min_lr"): _number(0),
    ("parts", "schedule", "warmup_steps"): _integer(0, MAX_STEP),
    ("parts", "schedule", "total_steps"): _integer(1, MAX_STEP),
    ("parts", "schedule", "decay_fraction"): _fraction,
    ("parts", "schedule", "anchor"): _anchor,
    ("parts", "precision"): _kind(dict),
    ("parts", "precision", "dtype"): _choice(list(DTYPES)),
    ("parts", "rng"): _kind(dict),
    ("parts", "rng", "python"): _python_rng,
    ("parts", "rng", "numpy"): _numpy_rng,
    ("parts", "rng", "cuda"): _kind(dict),
    ("parts", "optimizer"): _kind(dict),
    ("parts", "optimizer", "param_groups"): _param_groups,
}
_ABSENT = object()


def check_state(data: dict[str, Any], source: str) -> None:
    """A UserError naming ``source`` and the first field of ``data`` (a checkpoint's state.json)
    whose value a resumed run could not trust."""
    for keys, check in _FIELDS.items():
        value: Any = data
        for key in keys:
            value = value.get(key, _ABSENT) if isinstance(value, dict) else _ABSENT
        problem = None if value is _ABSENT else check(value)
        if problem:
            raise UserError(
                f"{source}: {'.'.join(keys)} {problem} (the file is damaged or was edited: "
                "resume from another checkpoint)"
            )
    train_step = data.get("parts", {}).get("train", {}).get("step")
    if train_step is not None and train_step != data.get("step"):
        raise UserError(
            f"{source}: parts.train.step {train_step} is not the checkpoint's step "
            f"{data['step']} (the file is damaged or was edited: resume from another checkpoint)"
        )


def check_finite(path: Any, name: str, tensors: Any, vote: Callable[[bool], bool]) -> None:
    """A UserError when a tensor of the part ``name`` as read from the checkpoint at ``path``
    (weights, the optimizer's moments) holds a NaN or an infinity: a run resumed from it would
    fail at its first step and call this checkpoint its last good one. ``vote``: whether any
    rank found one (each checks the shards it holds)."""
    bad = next(_not_finite(tensors), None)
    if vote(bad is not None):
        what = {"model": "weights are", "optimizer": "optimizer state is"}.get(name)
        what = what or f"{name} part is"
        where = f"{bad[0]} holds {bad[1]:,} NaN or infinite values of {bad[2]:,}" if bad else ""
        raise UserError(
            f"checkpoint {path}: its {what} not finite ({where or 'on another rank'}) (use "
            "an earlier checkpoint, e.g. with --resume PATH: this one computes no number)"
        )


def _not_finite(tree: Any, key: str = "") -> Any:
    """(key, count, size) of each floating tensor of a nested dict holding a NaN or an infinity."""
    if isinstance(tree, dict):
        for k, value in tree.items():
            yield from _not_finite(value, f"{key}.{k}" if key else str(k))
    elif isinstance(tree, torch.Tensor) and tree.is_floating_point():
        local = tree.to_local() if hasattr(tree, "to_local") else tree
        count = int((~torch.isfinite(local)).sum())
        if count:
            yield key, count, local.numel()
