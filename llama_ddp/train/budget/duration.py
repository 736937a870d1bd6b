"""--time-budget's value in seconds: a duration (``90s``, ``10m``, ``2h``) or ``slurm``, the SLURM
job's time left. Every one is finite and at most `MAX_SECONDS`, what a checkpoint keeps
(checkpoint/schema.py): a longer one is one line, never a plan of 10^24 steps.

A duration counts from the process's start, and a resumed run's earlier runs count against it;
``slurm`` is absolute: it ends at a wall-clock time (`slurm_end`), the job's end less
`SLURM_MARGIN`, however many times torchrun restarted the workers before."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from llama_ddp.checkpoint.schema import MAX_SECONDS
from llama_ddp.errors import UserError

UNITS = {"s": 1, "m": 60, "h": 3600}
# Seconds before the job's end: train.sbatch's SIGTERM comes 120 s before it (--signal=B:TERM@120),
# and the budget's run is over a minute before that signal (its exit, the nodes' clocks).
SLURM_MARGIN = 180.0
SLURM_END = "SLURM_JOB_END_TIME"
YEARS = MAX_SECONDS / (365.25 * 86400)
LONGEST = f"{MAX_SECONDS} s (about {YEARS:.0f} years), the longest a run keeps"


def parse_duration(text: str, env: Mapping[str, str], now: float) -> float:
    """Seconds of ``90s``, ``10m``, ``2h`` (or ``1.5h``); ``slurm``: the seconds from ``now`` (a
    Unix time) to `slurm_end`."""
    if text == "slurm":
        return slurm_end(env, now) - now
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smh])", text.strip())
    seconds = float(match[1]) * UNITS[match[2]] if match else 0.0
    if seconds <= 0:
        raise UserError(f"--time-budget must be a duration such as 90s, 10m or 2h, got {text!r}")
    if seconds > MAX_SECONDS:  # 400 nines are an infinity
        shown = text if len(text) <= 24 else text[:20] + "..."
        raise UserError(
            f"--time-budget {shown} is longer than {LONGEST} (give a duration such as 90s, 10m "
            "or 2h)"
        )
    return seconds


def slurm_end(env: Mapping[str, str], now: float) -> float:
    """The Unix time a ``slurm`` budget ends: the job's end (``SLURM_JOB_END_TIME``) less
    `SLURM_MARGIN`; one line where it is no time, or no later than ``now``."""
    end = env.get(SLURM_END, "").strip()
    if not end:
        raise UserError(
            f"--time-budget slurm needs {SLURM_END}, which is not set (run it inside a SLURM "
            "job, or give a duration such as 2h)"
        )
    try:
        end_time = float(end)
    except ValueError:
        end_time = math.nan
    if not math.isfinite(end_time):
        raise UserError(
            f"{SLURM_END}={end:.40} is not a Unix time in seconds (run inside a SLURM job, which "
            "sets it, or give a duration such as 2h)"
        )
    left = end_time - now
    if left <= SLURM_MARGIN:
        raise UserError(
            f"the SLURM job has {left:.0f} s left, no more than the {SLURM_MARGIN:.0f} s kept "
            "before its end: too little to train (resubmit it with a longer --time)"
        )
    if left - SLURM_MARGIN > MAX_SECONDS:
        raise UserError(
            f"the SLURM job's time left, {left:.0f} s, is longer than {LONGEST} (check "
            f"{SLURM_END}, or give a duration such as 2h)"
        )
    return end_time - SLURM_MARGIN
