"""The data settings of a run (DataSettings: its --dataset ... --micro-batch-size flags) and the
sources it trains on with their weights: ``--dataset`` (repeated) with ``--dataset-weights``, or
one ``[[sources]]`` table per source in a ``--config`` TOML file.

A weight is the share of the training tokens a source supplies (normalized over the sources).
Every check here needs no data: it runs in ``DataSettings.validate``, before anything is read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from llama_ddp.data.mixture import micro_batch_size
from llama_ddp.errors import UserError
from llama_ddp.settings import Settings, setting

_DATA_SUFFIXES = {".txt", ".jsonl", ".json", ".parquet", ".csv", ".tsv", ".gz", ".bz2", ".xz"}


@dataclass(frozen=True)
class Source:
    """One source of training text: a ``--dataset`` value, its weight and how to read it."""

    dataset: str
    weight: float = 1.0
    name: str = ""  # default: the file stem or the hub id (`source_name`)
    config: str | None = None
    split: str = "train"
    text_column: str = "text"
    streaming: bool = False


TABLE_KEYS = tuple(f.name for f in fields(Source))


def source_name(dataset: str) -> str:
    """The name a source is logged under: ``sample``, a hub id as it is, else the file or folder
    name without its data suffixes (``data/code.jsonl.gz`` -> ``code``), for a glob the folder's
    (``data/prose/*.jsonl`` -> ``prose``)."""
    if dataset == "sample" or not _looks_like_path(dataset):
        return dataset
    path = Path(dataset.rstrip("/"))
    while any(c in path.name for c in "*?[") and path.parent != path:
        path = path.parent
    name = path.name
    while Path(name).suffix.lower() in _DATA_SUFFIXES:
        name = Path(name).stem
    return name or dataset


def _looks_like_path(dataset: str) -> bool:
    path = Path(dataset).expanduser()
    return (
        path.exists()
        or dataset.startswith((".", "/", "~"))
        or any(c in dataset for c in "*?[")
        or Path(dataset).suffix.lower() in _DATA_SUFFIXES
    )


def parse_weights(text: str | None, count: int) -> list[float] | None:
    """``--dataset-weights`` as numbers, one per ``--dataset``; None when not given."""
    if text is None:
        return None
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        raise UserError(
            f"--dataset-weights {text!r} is not a comma list of numbers (e.g. 0.7,0.3)"
        ) from None
    if len(weights) != count:
        raise UserError(
            f"--dataset-weights gives {len(weights)} weight(s) for {count} --dataset source(s) "
            "(give one weight per --dataset, in order)"
        )
    return weights


def resolve_sources(
    datasets: tuple[str, ...],
    weights: str | None,
    tables: tuple[dict[str, Any], ...],
    defaults: dict[str, Any],
) -> list[Source]:
    """The run's sources, from ``--dataset``/``--dataset-weights`` or the ``[[sources]]``
    ``tables``; ``defaults`` (config, split, text_column, streaming) are the flags' values,
    which a table may override. Every mistake is one UserError."""
    if tables:
        if weights is not None:
            raise UserError(
                "--dataset-weights applies to --dataset sources, not to [[sources]] tables "
                "(give each table a weight)"
            )
        sources = [_from_table(i, t, defaults) for i, t in enumerate(tables)]
        given = [t for t in tables if "weight" in t]
        if given and len(given) != len(tables):
            raise UserError(
                "some [[sources]] tables have a weight and others none (give every table a "
                "weight, or none for equal weights)"
            )
    else:
        if not datasets:
            raise UserError("no --dataset given (pass --dataset PATH or a hub name)")
        values = parse_weights(weights, len(datasets)) or [1.0] * len(datasets)
        sources = [Source(d, w, source_name(d), **defaults) for d, w in zip(datasets, values)]
    for s in sources:
        if not (math.isfinite(s.weight) and s.weight > 0):
            raise UserError(
                f"source {s.name!r} has weight {s.weight}; weights must be positive numbers "
                "(drop the source instead of giving it weight 0)"
            )
    names = [s.name for s in sources]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UserError(
            f"two sources are named {twice[0]!r} (give each a distinct name: a `name` key in "
            "its [[sources]] table)"
        )
    return sources


def _from_table(i: int, table: Any, defaults: dict[str, Any]) -> Source:
    where = f"[[sources]] table {i + 1}"
    if not isinstance(table, dict):
        raise UserError(f"{where} is not a table (write [[sources]] followed by key = value lines)")
    unknown = sorted(set(table) - set(TABLE_KEYS))
    if unknown:
        raise UserError(
            f"{where} has unknown key {unknown[0]!r} (its keys are: {', '.join(TABLE_KEYS)})"
        )
    if "dataset" not in table:
        raise UserError(f'{where} has no dataset (add dataset = "PATH or hub name")')
    types = {"dataset": str, "name": str, "config": str, "split": str, "text_column": str}
    types |= {"weight": (int, float), "streaming": bool}
    for key, value in table.items():
        kind = types[key]
        if not isinstance(value, kind) or (key == "weight" and isinstance(value, bool)):
            wanted = "number" if key == "weight" else "boolean" if kind is bool else "string"
            raise UserError(f"{where}: {key} = {value!r} should be a {wanted}")
    values = {**defaults, **table}
    values["weight"] = float(values.get("weight", 1.0))
    values.setdefault("name", source_name(values["dataset"]))
    return Source(**values)


@dataclass
class DataSettings(Settings):
    """What a run trains on and how it is cut into batches: the sources, the tokenizer, the
    sequences (length, packing, document masking), the batch shape and the token cache."""

    dataset: tuple[str, ...] = setting(
        ("sample",),
        "`sample` (embedded, offline), a local file/folder/glob, or a hub dataset name; repeat "
        "the flag to train on a mixture of sources",
    )
    dataset_weights: str | None = setting(
        None,
        "comma list, one weight per --dataset: the share of the training tokens each source "
        "supplies (default: equal)",
    )
    sources: tuple[dict, ...] = setting(
        (),
        "TOML only: one [[sources]] table per source, keys dataset, weight, name, config, split, "
        "text_column, streaming (a --dataset flag replaces them)",
        toml_only=True,
    )
    dataset_config: str | None = setting(
        None, "hub dataset configuration, e.g. sample-10BT for HuggingFaceFW/fineweb"
    )
    split: str = setting("train", "the split to train on")
    text_column: str = setting("text", "the column holding the documents")
    streaming: bool = setting(False, "stream a hub dataset instead of downloading it whole")
    val_fraction: float = setting(
        0.01, "held out for validation when the dataset has no validation split"
    )
    tokenizer: str = setting(
        "auto",
        "a tokenizer.json, a folder with one (and its tokenizer_config.json), a hub repository "
        "id, or `auto`: train one on the corpus (cached) the first time",
    )
    vocab_size: int = setting(
        8192, "vocabulary of the tokenizer `auto` trains; a given tokenizer decides its own"
    )
    bot_token: str | None = setting(
        None, "the special token (name or id) that opens each document (default: the BOS)"
    )
    eot_token: str | None = setting(
        None, "the special token (name or id) that ends each document (default: the EOS)"
    )
    pad_token: str | None = setting(
        None, "the special token (name or id) pad mode pads with (default: the pad token)"
    )
    seq_length: int = setting(256, "tokens per training sequence")
    packing: Literal["pack", "pad"] = setting(
        "pack", "`pack`: documents concatenated into full windows; `pad`: one document per sequence"
    )
    document_mask: bool = setting(
        True,
        "pack mode: each token attends only to its own document, which trains as if alone "
        "(--no-document-mask: plain causal windows that see across documents)",
    )
    cache_dir: str | None = setting(
        None, "where tokenized data and the embedded corpus live (default ~/.cache/llama_ddp)"
    )
    num_workers: int = setting(
        0, "DataLoader worker processes; reading cached tokens is cheap, so 0 is usually fastest"
    )
    num_proc: int | None = setting(
        None,
        "tokenizer processes that build the token cache in the background while training runs "
        "(default: all cores)",
    )
    batch_size: int = setting(
        32, "global batch in sequences per optimizer step, the same at every world size"
    )
    micro_batch_size: str | int | None = setting(
        None,
        "sequences per process per forward, or auto: the largest whose step fits the device's "
        "free memory (measured on CUDA, estimated on the CPU; docs/training.md), gradient "
        "accumulation keeping the global batch; default: auto on CUDA (not --mode dp), batch "
        "size / processes on the CPU",
    )

    def __post_init__(self) -> None:
        if isinstance(self.dataset, str):  # one source, as a Python caller writes it
            self.dataset = (self.dataset,)
        self.dataset, self.sources = tuple(self.dataset), tuple(self.sources)
        if isinstance(self.micro_batch_size, str) and self.micro_batch_size.isdigit():
            self.micro_batch_size = int(self.micro_batch_size)  # --micro-batch-size 8

    def check(self) -> None:
        if isinstance(self.micro_batch_size, str) and self.micro_batch_size != "auto":
            raise UserError(
                f"--micro-batch-size must be a positive integer or auto, got "
                f"{self.micro_batch_size!r}"
            )
        sized = [] if self.micro_batch_size == "auto" else ["micro_batch_size"]
        self.positive("seq_length", "batch_size", "vocab_size", *sized, "num_proc")
        self.non_negative("num_workers")
        if not 0 < self.val_fraction < 1:
            raise UserError(f"--val-fraction must be in (0, 1), got {self.val_fraction}")
        self.mixture()  # weights, [[sources]] tables: before any data is read

    def mixture(self) -> list[Source]:
        """The sources to train on, with their weights."""
        defaults = {"config": self.dataset_config, "split": self.split}
        defaults |= {"text_column": self.text_column, "streaming": self.streaming}
        return resolve_sources(self.dataset, self.dataset_weights, self.sources, defaults)

    def roles(self) -> dict[str, str | None]:
        """--bot-token, --eot-token, --pad-token (None: the tokenizer's own)."""
        return {"bot": self.bot_token, "eot": self.eot_token, "pad": self.pad_token}

    def micro_batch(self, world_size: int) -> int:
        """Sequences per process per forward at ``world_size`` processes (`micro_batch_size`);
        for auto, batch size / processes until the run measures the device (run.py)."""
        given = None if self.micro_batch_size == "auto" else self.micro_batch_size
        return micro_batch_size(self.batch_size, given, world_size)

    def cache_path(self) -> Path | None:
        return Path(self.cache_dir) if self.cache_dir else None
