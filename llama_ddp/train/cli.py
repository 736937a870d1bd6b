"""The train command's line (train.py, ``python -m llama_ddp.train``, ``llama-ddp-train``): flags
and TOML into a TrainConfig, outcomes into exit codes.

Every setting of a TrainConfig component is a flag (``data.seq_length`` is ``--seq-length``), with
the help text and the choices its dataclass field declares (config.FLAGS, the one flag table),
listed in one group per component; a TOML file names the same settings as flat keys. This
module alone maps what happened to an exit code: 0 done; 2 a user mistake (one line
``error: <what> (<how to fix>)``; ``--debug`` shows the traceback instead); 128 + N stopped by
signal N after a checkpoint; 1 anything else.
"""

from __future__ import annotations

import argparse
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any

from llama_ddp.errors import ArgumentParser, UserError, exit_command, run_command
from llama_ddp.settings import field_default, flag_name, literal_choices
from llama_ddp.train.config import FLAGS, TrainConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _value_type(hint: Any) -> type:
    """The Python type a flag's value converts to: ``int | None`` is int, a Literal its values'."""
    choices = literal_choices(hint)
    if choices:
        return type(choices[0])
    if typing.get_origin(hint) is tuple:  # a repeatable flag: the type of one value
        return typing.get_args(hint)[0]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The flags of train.py, llama-ddp-train and ``python -m llama_ddp.train`` (each named as it
    was called, unless ``prog``)."""
    called = Path(sys.argv[0]).name
    parser = ArgumentParser(
        prog=prog or ("python -m llama_ddp.train" if called == "__main__.py" else called),
        description="Pretrain a Llama model on one device, with DataParallel, or with DDP "
        "under torchrun.",
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--config", help="TOML file of the flags below; flags override it")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    groups: dict[str, Any] = {}
    for name, (part, f, hint) in FLAGS.items():
        if f.metadata.get("toml_only"):
            continue
        if part not in groups:
            groups[part] = parser.add_argument_group(f"{part} settings")
        group, flag, kind = groups[part], "--" + flag_name(name), _value_type(hint)
        help_text = f.metadata["help"]  # which says its own default where the value cannot
        if "default:" not in help_text:
            help_text += f" (default: {field_default(f)})"
        if typing.get_origin(hint) is tuple:
            group.add_argument(flag, type=kind, action="append", help=help_text)
        elif kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            choices = literal_choices(hint)
            alone = {"nargs": "?", "const": f.metadata["const"]} if "const" in f.metadata else {}
            group.add_argument(flag, type=kind, choices=choices, help=help_text, **alone)
    return parser


def load_toml(path: str) -> dict[str, Any]:
    """Settings from a TOML file, typed as their flags would be: flat keys, the flags' names
    (``seq-length = 64``), or the same keys in their component's table (``[data]``)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"config file {p} not found (check --config)")
    try:
        data = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"config file {p} is not valid TOML ({exc})") from exc
    out = {}
    for key, value in _flat(data, p).items():
        name = key.replace("-", "_")
        if name not in FLAGS:
            raise UserError(f"unknown key {key!r} in {p} (see --help for the fields)")
        hint = FLAGS[name].hint
        kind = _value_type(hint)
        if typing.get_origin(hint) is tuple:  # a list (or, for one value, the value)
            values = value if isinstance(value, list) else [value]
            if not values or not all(isinstance(v, kind) for v in values):
                what = "tables ([[" + key + "]])" if kind is dict else f"{kind.__name__}s"
                raise UserError(f"{key} in {p} should be a list of {what}")
            out[name] = tuple(values)
            continue
        if kind in (float, str) and isinstance(value, int) and not isinstance(value, bool):
            value = kind(value)  # eval_tokens = 65536, as --eval-tokens 65536 reads
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise UserError(f"{key} = {value!r} in {p} should be a {kind.__name__}")
        out[name] = value
    return out


def _flat(data: dict[str, Any], p: Path) -> dict[str, Any]:
    """A TOML file's keys with each component's table (``[data]``) opened into flat keys. Each
    setting once: the same one at the top and in its table, or spelled ``seq-length`` and
    ``seq_length``, is refused (TOML itself refuses only the same spelling twice in a table)."""
    components = {flag.component for flag in FLAGS.values()}
    out: dict[str, Any] = {}
    where: dict[str, str] = {}  # setting -> where the file gave it

    def put(key: str, value: Any, place: str) -> None:
        name = key.replace("-", "_")
        if name in where:
            raise UserError(
                f"{flag_name(name)} is given twice in {p}: {where[name]} and {place} (keep one)"
            )
        where[name], out[key] = place, value

    for key, value in data.items():
        if not isinstance(value, dict):  # a setting, or a list of tables ([[sources]])
            put(key, value, f"as {key!r} at the top")
            continue
        if key not in components:
            raise UserError(
                f"[{key}] in {p} is not a table of settings (use one of "
                + ", ".join(f"[{c}]" for c in dict.fromkeys(f.component for f in FLAGS.values()))
                + ", or give the keys at the top, without a table)"
            )
        for inner, setting in value.items():
            flag = FLAGS.get(inner.replace("-", "_"))
            if flag is None:
                raise UserError(
                    f"unknown key {inner!r} in [{key}] of {p} (see --help for the fields)"
                )
            if flag.component != key:
                raise UserError(
                    f"{inner!r} in [{key}] of {p} is a setting of [{flag.component}] (move it "
                    f"there, or to the top)"
                )
            put(inner, setting, f"as {inner!r} under [{key}]")
    if "dataset" in where and "sources" in where:
        raise UserError(
            f"{p} names its data twice: dataset ({where['dataset']}) and [[sources]] tables "
            "(keep one: [[sources]] for a mixture, or dataset; a --dataset flag replaces the "
            "file's [[sources]])"
        )
    return out


def parse_train_args(argv: list[str] | None = None, prog: str | None = None) -> TrainConfig:
    args = vars(build_parser(prog).parse_args(argv))
    args.pop("debug", None)
    path = args.pop("config", None)
    values = load_toml(path) if path is not None else {}
    if "dataset" in args:  # flags override the file: --dataset replaces its [[sources]]
        values.pop("sources", None)
    values.update(args)
    _check_length(values, set(args), path)
    _check_model(values, set(args), path)
    return TrainConfig.from_flags(**values).validate()


def _check_length(values: dict[str, Any], flags: set[str], path: str | None) -> None:
    """--time-budget plans the run's length: --max-steps or --epochs beside it is one line that
    says where each was given, the command line or the --config file."""
    if values.get("time_budget") is None:
        return
    for name in ("max_steps", "epochs"):
        if values.get(name) is None:
            continue
        budget = "--time-budget" if "time_budget" in flags else f"time-budget in {path}"
        given = f"--{flag_name(name)}" if name in flags else f"{flag_name(name)} from {path}"
        raise UserError(f"{budget} plans the run's length: drop {given}")


def _check_model(values: dict[str, Any], flags: set[str], path: str | None) -> None:
    """--model-size names the model in place of --preset: both given is one line that says
    where each was given."""
    if values.get("model_size") is None or "preset" not in values:
        return
    size = "--model-size" if "model_size" in flags else f"model-size in {path}"
    preset = "--preset" if "preset" in flags else f"preset from {path}"
    raise UserError(
        f"{size} {values['model_size']} and {preset} {values['preset']} both name the model "
        "(keep one: a preset, or a member of the family by its depth)"
    )


def main(argv: list[str] | None = None) -> int:
    return run_command(_train, argv)


def _train(argv: list[str]) -> int:
    cfg = parse_train_args(argv)
    # Our own progress bar is the one a user reads; datasets' bars (a corpus read to build its
    # token cache) would interleave with it. The call where datasets is already imported (a
    # notebook, a test that calls main()); else the variable it reads once imported, so that a
    # run on a complete cache never imports it.
    datasets = sys.modules.get("datasets")
    if datasets is not None:
        datasets.disable_progress_bars()
    else:
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    from llama_ddp.train.preemption import FaultInjector
    from llama_ddp.train.run import run

    signum = run(cfg, fault=FaultInjector.from_env(cfg.checkpoint.out_dir))
    return 128 + signum if signum else 0


if __name__ == "__main__":
    exit_command(main())
