"""TrainConfig's checks, in one place (`Checked`, which TrainConfig is): each flag alone (its
choices and range), then the flags that must agree with each other, the installed packages and the
model shape; and how a field is named and offered on the command line (flag_name,
literal_choices, field_default).
"""

from __future__ import annotations

import importlib.util
import math
import typing
from dataclasses import MISSING, fields
from typing import Any, Literal

from llama_ddp.errors import UserError
from llama_ddp.interop.gguf_export import check_available
from llama_ddp.train.metrics import SINKS
from llama_ddp.train.speed import parse_steps


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


class Checked:
    """The checks of a TrainConfig, run by its ``validate()`` before any work."""

    def _check_values(self) -> None:
        """Each flag alone: its choices and its range."""
        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            value = getattr(self, f.name)
            choices = literal_choices(hints[f.name])
            if choices and value not in choices and value is not None:
                raise UserError(
                    f"--{flag_name(f.name)} {value!r} is not one of: {', '.join(choices)}"
                )
            if isinstance(value, float) and not math.isfinite(value):
                raise UserError(f"--{flag_name(f.name)} must be a finite number, got {value}")
        positive = ["seq_length", "batch_size", "epochs", "log_every"]
        positive += ["vocab_size", "micro_batch_size", "max_steps", "keep_last", "peak_tflops"]
        positive += ["num_proc"]
        positive += ["eval_limit"]
        for name in positive:
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise UserError(f"--{flag_name(name)} must be positive, got {value}")
        for name in ("save_every", "eval_every", "warmup_steps", "num_workers"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise UserError(f"--{flag_name(name)} must be >= 0, got {value}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise UserError(f"--{name} must be in [0, 1), got {getattr(self, name)}")
        for name in ("weight_decay", "grad_clip"):
            if getattr(self, name) < 0:
                raise UserError(f"--{flag_name(name)} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.decay_fraction <= 1:
            raise UserError(f"--decay-fraction must be in (0, 1], got {self.decay_fraction}")
        if not 0 < self.val_fraction < 1:
            raise UserError(f"--val-fraction must be in (0, 1), got {self.val_fraction}")
        self.eval_budget()

    def _check_optimizer(self) -> None:
        """The learning rates (``peak_lr``: --lr or the optimizer's default)."""
        lr = self.peak_lr()
        if not (lr > 0 and 0 <= self.min_lr <= lr):
            raise UserError(f"need 0 <= --min-lr <= --lr and --lr > 0 (got {self.min_lr}, {lr})")

    def _check_combinations(self) -> None:
        """Flags that must agree with each other, the installed packages and the model shape."""
        self._check_optimizer()
        if self.mode == "dp" and self.compile:
            raise UserError(
                "--compile does not work with --mode dp: DataParallel copies the module on every "
                "forward, which breaks a compiled one (use DDP, which compiles: torchrun "
                "--standalone --nproc_per_node=N train.py --compile)"
            )
        for name in self.loggers():
            if name not in SINKS:
                raise UserError(f"--log-to {name!r} is not one of: {', '.join(SINKS)}")
            package = SINKS[name].package
            if importlib.util.find_spec(package) is None:
                raise UserError(
                    f"--log-to {name} needs the {package} package (pip install "
                    f"'llama_ddp[{package}]')"
                )
        if self.export_gguf is not None:
            check_available()
        if self.profile_steps is not None:
            parse_steps(self.profile_steps)
        self.mixture()  # weights, [[sources]] tables: before any data is read
        self.task_specs()  # task names and files exist; their lines are read by build_trainer
        if self.init_from is None:
            self.model_config(vocab_size=self.vocab_size)  # shape errors before any data is read
        elif self.tokenizer == "auto":
            raise UserError(
                "--init-from needs the tokenizer its model was trained with, not a new one (pass "
                "--tokenizer: the source's folder, or the tokenizer.json beside its .pth)"
            )
