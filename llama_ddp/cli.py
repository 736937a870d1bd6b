"""train.py's command line: flags and TOML into a TrainConfig, errors into exit codes.

Every TrainConfig field is a flag (``seq_length`` is ``--seq-length``); its help is the field's
docstring. A user mistake prints one line ``error: <what> (<how to fix>)`` and exits 2; ``--debug``
shows the traceback instead.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import os
import sys
import types
import typing
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from llama_ddp.config import PRESETS, TrainConfig
from llama_ddp.errors import UserError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CHOICES = {
    "preset": tuple(PRESETS),
    "packing": ("pad", "pack"),
    "mode": ("auto", "single", "dp", "ddp"),
    "device": ("auto", "cpu", "cuda"),
    "dtype": ("auto", "fp32", "bf16", "fp16"),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        raise UserError(f"{message} (see {self.prog} --help)")


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each dataclass field, read from the source: one place for the docs."""
    docs, previous = {}, None
    for node in ast.parse(inspect.getsource(cls)).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            previous = node.target.id
        elif previous and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            docs[previous] = " ".join(str(node.value.value).split())
            previous = None
        else:
            previous = None
    return docs


def _base_type(annotation: Any) -> type:
    hint = eval(annotation, vars(typing)) if isinstance(annotation, str) else annotation  # noqa: S307
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def build_parser(prog: str = "train.py") -> argparse.ArgumentParser:
    parser = _Parser(
        prog=prog,
        description="Pretrain a Llama model on one device, with DataParallel, or with DDP "
        "under torchrun.",
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--config", help="TOML file of TrainConfig fields; flags override it")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    docs = field_docs(TrainConfig)
    for f in fields(TrainConfig):
        kind = _base_type(f.type)
        flag = "--" + f.name.replace("_", "-")
        default = None if f.default is MISSING else f.default
        help_text = docs.get(f.name, "")
        help_text = f"{help_text} (default: {default})" if help_text else f"default: {default}"
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            parser.add_argument(
                flag, type=kind, choices=CHOICES.get(f.name), help=help_text, metavar=None
            )
    return parser


def load_toml(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"config file {p} not found (check --config)")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"config file {p} is not valid TOML ({exc})") from exc
    known = {f.name: f for f in fields(TrainConfig)}
    out = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in known:
            raise UserError(f"unknown key {key!r} in {p} (see train.py --help for the fields)")
        kind = _base_type(known[name].type)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise UserError(f"{key} = {value!r} in {p} should be a {kind.__name__}")
        if name in CHOICES and value not in CHOICES[name]:
            raise UserError(f"{key} = {value!r} in {p} (choose one of: {', '.join(CHOICES[name])})")
        out[name] = value
    return out


def parse_train_args(argv: list[str] | None = None) -> TrainConfig:
    args = vars(build_parser().parse_args(argv))
    args.pop("debug", None)
    values = load_toml(args.pop("config")) if "config" in args else {}
    values.update(args)
    cfg = TrainConfig(**values)
    validate(cfg)
    return cfg


def validate(cfg: TrainConfig) -> None:
    """Checks that need no data or devices; the rest happen where the facts are known."""
    positive = ["seq_length", "batch_size", "epochs", "eval_batches", "log_every", "vocab_size"]
    positive += ["micro_batch_size", "max_steps", "keep_last"]
    for name in positive:
        value = getattr(cfg, name)
        if value is not None and value <= 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive, got {value}")
    for name in ("save_every", "eval_every", "warmup_steps", "num_workers"):
        value = getattr(cfg, name)
        if value is not None and value < 0:
            raise UserError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
    if cfg.lr <= 0 or cfg.min_lr < 0 or cfg.min_lr > cfg.lr:
        raise UserError(f"need 0 <= --min-lr <= --lr and --lr > 0 (got {cfg.min_lr}, {cfg.lr})")
    if not 0 < cfg.val_fraction < 1:
        raise UserError(f"--val-fraction must be in (0, 1), got {cfg.val_fraction}")


def rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    try:
        cfg = parse_train_args(argv)
        # Our own progress bar is the one a user reads; datasets' bars would interleave with it.
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
        from llama_ddp.trainer import run

        return run(cfg)
    except UserError as exc:
        if debug:
            raise
        if rank_zero():
            print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
