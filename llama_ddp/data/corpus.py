"""Where text comes from: the embedded sample corpus, local files, or a Hugging Face hub dataset.

Every source is read through `datasets.load_dataset`, so the three behave alike: `load_splits`
returns a `Corpus` whose ``train`` and ``validation`` iterate over non-empty document texts in a
fixed order, plus a fingerprint that names that data (the token cache is keyed by it): local files
by their paths, sizes and modification times, not their content; a hub dataset by its revision.
Once a run checked a local source (`Corpus.check`), ``cache_dir/corpus-<key>.txt`` notes its
fingerprint (with a checksum: a damaged note is none), keyed by its settings and its files'
paths, sizes and modification times (what the fingerprint trusts): the same files then open
unread, their texts (and `datasets`) only when first used, so a run on a complete token cache
never imports `datasets`.

- ``"sample"``: the running Python's standard-library sources (one document per ``.py`` file),
  written once to ``cache_dir/sample-<fingerprint>/`` as parquet. No network needed.
- A local ``.txt`` / ``.jsonl`` / ``.json`` / ``.parquet`` / ``.csv`` / ``.tsv`` file (also
  compressed: ``.gz``, ``.bz2``, ``.xz``), a folder of them, or a glob.
  In a folder or glob, a ``.txt`` file is one document (pretraining documents are files: books,
  articles, modules). A single ``.txt`` file on its own (Tiny Shakespeare's ``input.txt``) is cut
  into paragraphs at blank lines, or into lines if it has no blank line, so that it can hold out
  validation data and fill pad-mode sequences. For exact documents in one file, use ``.jsonl``
  with one ``{"text": ...}`` per line.
  In a folder, files named ``validation``/``valid``/``val``/``dev``/``test`` (the folder or the
  file name before its first ``.``, ``-`` or ``_``) form the validation split.
- Anything else is a hub dataset name, e.g. ``HuggingFaceFW/fineweb`` with config ``sample-10BT``.

Validation is the source's own validation (else test) split. A source without one holds out every
k-th document of the train split, k = round(1 / val_fraction), at most `MAX_HOLDOUT_DOCS`
documents (so a 10B-token corpus does not evaluate on 100M tokens), a bounded share of its text
(holdout.py). It reads the stream in order: streaming or not, the same two splits.
"""

from __future__ import annotations

import copy
import functools
import glob
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from itertools import islice, repeat
from pathlib import Path
from typing import TYPE_CHECKING

from llama_ddp.data.embedded_corpus import materialize_sample
from llama_ddp.data.file_check import DataFiles, data_files_of, reading
from llama_ddp.data.holdout import MAX_HOLDOUT_DOCS, holdout
from llama_ddp.data.local_files import (
    file_identity,
    is_saved_dataset,
    local_files,
    local_kwargs,
    looks_local,
    note_text,
    read_note,
)
from llama_ddp.errors import UserError
from llama_ddp.files import safe_io

if TYPE_CHECKING:  # imported where a source is read: a run on a complete cache never reads one
    import datasets

_NOTE_FORMAT = 1  # bump when the fingerprint's recipe changes: notes of the old one are ignored
_VALIDATION_SPLITS = ("validation", "test")
_TEXT_DTYPES = ("string", "large_string")


def default_cache_dir() -> Path:
    """$LLAMA_DDP_CACHE, else $XDG_CACHE_HOME/llama_ddp, else ~/.cache/llama_ddp."""
    if os.environ.get("LLAMA_DDP_CACHE"):
        return Path(os.environ["LLAMA_DDP_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "llama_ddp"


def cache_folder(cache_dir: Path | None = None) -> Path:
    """The data cache's folder: ``cache_dir`` (--cache-dir), else `default_cache_dir`; a
    UserError when it, or a folder above it, is a file."""
    path = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    above = path
    while not above.exists() and above != above.parent:
        above = above.parent
    if not above.is_dir():
        raise UserError(
            f"cache folder {path} (--cache-dir or $LLAMA_DDP_CACHE): {above} is a file, not a "
            "folder (choose another --cache-dir)"
        )
    return path


@dataclass(frozen=True)
class TextSplit:
    """The non-empty texts of one split, read lazily in dataset order.

    With ``holdout_every=k`` the split is one side of the deterministic hold-out (holdout.py):
    every k-th document, at most MAX_HOLDOUT_DOCS, a bounded share of the text, is the validation
    side (``held_out=True``), all others the train side.
    """

    dataset: datasets.Dataset | datasets.IterableDataset
    column: str
    name: str
    holdout_every: int = 0
    held_out: bool = False
    files: DataFiles | None = None  # local files: a break in one is named (file_check.py)

    def __iter__(self) -> Iterator[str]:
        k = self.holdout_every
        end = k * MAX_HOLDOUT_DOCS
        count = 0
        column = self._column()
        texts = holdout(column, k, MAX_HOLDOUT_DOCS) if k else zip(column, repeat(False))
        for i, (text, held) in enumerate(texts):
            if k:
                if self.held_out and i >= end:
                    break  # a stream must not be read to its end for a bounded hold-out
                if held != self.held_out:
                    continue
            if text:
                count += 1
                yield text
        if count == 0:
            raise UserError(
                f"the {self.name} has no non-empty documents in column {self.column!r} "
                "(check the dataset, its split and --text-column)"
            )

    def _column(self) -> Iterator[str | None]:
        # Batched reads: Arrow hands out a thousand strings at a time instead of one dict per row.
        with reading(self.files):
            for batch in self.dataset.select_columns([self.column]).iter(batch_size=1000):
                yield from batch[self.column]


@dataclass
class Corpus:
    """One source: the fingerprint that names its data, the bytes its files take (None: a hub
    dataset), and its train and validation texts, opened by ``open`` when first read."""

    fingerprint: str
    size: int | None
    open: Callable[[], tuple[TextSplit, TextSplit]] = field(repr=False)
    note: Path | None = field(default=None, repr=False)  # where `check` notes the fingerprint
    checked: bool = False  # by this run, or by the run that wrote the note it came from
    splits: tuple[TextSplit, TextSplit] | None = field(default=None, repr=False)  # once opened

    @property
    def train(self) -> TextSplit:
        self.splits = self.splits or self.open()
        return self.splits[0]

    @property
    def validation(self) -> TextSplit:
        self.splits = self.splits or self.open()
        return self.splits[1]

    def check(self) -> None:
        """Raise now if a split has no documents (not later, in the background); then note the
        fingerprint, so that a later run on the same files need not read them."""
        if self.checked:
            return
        next(iter(self.train)), next(iter(self.validation))
        if self.note is not None:
            with safe_io.writing(self.note.parent, "the corpus note"):
                self.note.parent.mkdir(parents=True, exist_ok=True)
                safe_io.write_text(self.note, note_text(self.note, self.fingerprint))
        self.checked = True


def load_splits(
    dataset: str,
    *,
    config: str | None = None,
    split: str = "train",
    text_column: str = "text",
    streaming: bool = False,
    val_fraction: float = 0.01,
    cache_dir: Path | None = None,
) -> Corpus:
    """Open ``dataset`` ("sample", a local path or glob, or a hub name) as a `Corpus`: read now,
    or, when a run has checked the same files before, from its note (read when first used)."""
    cache_dir = cache_folder(cache_dir)
    if dataset == "sample":
        folder, identity = materialize_sample(cache_dir)
        load_kwargs = local_kwargs(local_files(str(folder)), folder, cache_dir)
    elif is_saved_dataset(Path(dataset).expanduser()):
        folder = Path(dataset).expanduser()
        load_kwargs = {"saved": folder}
        identity = {"saved": [file_identity(f) for f in sorted(folder.rglob("*")) if f.is_file()]}
    elif looks_local(dataset):
        data_files = local_files(dataset)
        folder = Path(dataset).expanduser() if Path(dataset).expanduser().is_dir() else None
        load_kwargs = local_kwargs(data_files, folder, cache_dir)
        identity = {"files": [file_identity(f) for f in data_files]}
    else:
        load_kwargs, identity = _hub_kwargs(dataset, config)
    label = "sample corpus" if dataset == "sample" else repr(dataset)
    files = [f for group in load_kwargs.get("data_files", {}).values() for f in group]
    files += [entry[0] for entry in identity.get("saved", [])]
    size = sum(map(os.path.getsize, files)) if files else None  # None: a hub dataset
    source = (load_kwargs, identity, label, split, text_column, streaming, val_fraction)
    reopen = functools.partial(_reopen, copy.deepcopy(source))
    key = _sha256([_NOTE_FORMAT, MAX_HOLDOUT_DOCS, str(source)])[:20]
    # A hub dataset's revision is known only by asking `datasets`: it is read every time.
    note = None if "hub" in identity else cache_dir / f"corpus-{key}.txt"
    noted = read_note(note) if note is not None else None
    if noted is not None:
        return Corpus(noted, size, reopen, note, checked=True)
    fingerprint, splits = _open_splits(*source)
    return Corpus(fingerprint, size, reopen, note, splits=splits)


def _reopen(source: tuple) -> tuple[TextSplit, TextSplit]:
    return _open_splits(*copy.deepcopy(source))[1]  # it completes load_kwargs and identity


def _open_splits(
    load_kwargs: dict,
    identity: dict,
    label: str,
    split: str,
    text_column: str,
    streaming: bool,
    val_fraction: float,
) -> tuple[str, tuple[TextSplit, TextSplit]]:
    """Read a source's splits through `datasets`: its fingerprint and its (train, validation)."""
    # Local files are read as streams: nothing is converted before tokenization starts (a
    # sliced split, train[:10%], only loads whole).
    streaming = streaming or ("data_files" in load_kwargs and "[" not in split)
    train_ds = _open(load_kwargs, split, streaming, label)
    train_files = data_files_of(load_kwargs, split)
    with reading(train_files):  # a break in the first rows: one line naming it
        if load_kwargs.get("sample_by") == "paragraph" and _rows(train_ds) < 2:
            load_kwargs["sample_by"] = "line"  # one paragraph: no blank line anywhere
            train_ds = _open(load_kwargs, split, streaming, label)
        _check_column(train_ds, text_column, label)
        val_ds = _validation_split(load_kwargs, split, streaming, label, text_column)
        every = 0 if val_ds is not None else max(1, round(1 / val_fraction))
        if every and _rows(train_ds) < 2:
            raise UserError(
                f"{label} has one document, too few to hold out validation data "
                "(add documents, or a validation file)"
            )
    if "sample_by" in load_kwargs:
        identity["sample_by"] = load_kwargs["sample_by"]
    fingerprint = _sha256(
        {
            "source": identity,
            "split": split,
            "text_column": text_column,
            "holdout_every": every,
            "max_holdout_docs": MAX_HOLDOUT_DOCS if every else 0,
        }
    )
    train = TextSplit(train_ds, text_column, f"train split of {label}", every, files=train_files)
    if val_ds is None:
        validation = replace(train, name=f"hold-out of {label}", held_out=True)
    else:
        name, val_files = f"validation split of {label}", data_files_of(load_kwargs, "validation")
        validation = TextSplit(val_ds, text_column, name, files=val_files)
    return fingerprint, (train, validation)


def _validation_split(
    load_kwargs: dict, split: str, streaming: bool, label: str, text_column: str
) -> datasets.Dataset | datasets.IterableDataset | None:
    """The source's own validation (else test) split, if it has one besides ``split``."""
    for name in _VALIDATION_SPLITS:
        if name == split:
            continue
        val_ds = _open(load_kwargs, name, streaming, label, missing_ok=True)
        if val_ds is not None:
            with reading(data_files_of(load_kwargs, name)):
                _check_column(val_ds, text_column, f"{label} ({name} split)")
            return val_ds
    return None


def _literal(load_kwargs: dict) -> dict:
    """``load_kwargs`` with its files' names escaped: `datasets` reads data_files as glob
    patterns, and a file named ``[draft] v1.jsonl`` is that file, not a pattern."""
    if "data_files" not in load_kwargs:
        return load_kwargs
    files = {
        split: [glob.escape(f) for f in group] for split, group in load_kwargs["data_files"].items()
    }
    return {**load_kwargs, "data_files": files}


def _open(
    load_kwargs: dict,
    split: str,
    streaming: bool,
    label: str,
    *,
    missing_ok: bool = False,
) -> datasets.Dataset | datasets.IterableDataset | None:
    import datasets

    if "saved" in load_kwargs:
        return _open_saved(load_kwargs["saved"], split, streaming, label, missing_ok=missing_ok)
    cache = Path(load_kwargs.get("cache_dir") or datasets.config.HF_DATASETS_CACHE)
    files = data_files_of(load_kwargs, split)
    try:
        with safe_io.writing(cache, "the datasets cache"), reading(files):
            return datasets.load_dataset(**_literal(load_kwargs), split=split, streaming=streaming)
    except ValueError as e:
        # `datasets` reports an unknown split as ValueError("Unknown split ..."/"Bad split ...").
        if missing_ok and "split" in str(e).lower():
            return None
        raise UserError(f"cannot load split {split!r} of {label}: {e} (check --split)") from e
    except (ConnectionError, FileNotFoundError) as e:
        raise UserError(f"cannot load {label}: {e} (check the name, or your network)") from e
    except datasets.exceptions.DatasetGenerationError as e:
        raise UserError(
            f"cannot read {label}: {e.__cause__ or e} (fix or remove the malformed file)"
        ) from e


def _open_saved(
    folder: Path, split: str, streaming: bool, label: str, *, missing_ok: bool
) -> datasets.Dataset | datasets.IterableDataset | None:
    """A split of a ``save_to_disk`` folder through ``datasets.load_from_disk``; a single saved
    Dataset is the train split (``--split`` names it)."""
    import datasets

    try:
        saved = datasets.load_from_disk(str(folder))
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read the saved dataset {label}: {e} (save it again)") from e
    if isinstance(saved, datasets.DatasetDict):
        if split not in saved:
            if missing_ok:
                return None
            raise UserError(
                f"{label} has no split {split!r}; its splits are {', '.join(saved)} (check --split)"
            )
        ds = saved[split]
    elif missing_ok:
        return None  # one saved Dataset has no validation split of its own
    else:
        ds = saved
    return ds.to_iterable_dataset() if streaming else ds


def _check_column(ds: datasets.Dataset | datasets.IterableDataset, column: str, label: str) -> None:
    import datasets

    features = ds.features
    if features is None:  # some streamed sources only know their columns once read
        first = next(iter(ds), None)
        if first is None:
            raise UserError(f"{label} has no documents (check the dataset and its split)")
        names = list(first)
    else:
        names = list(features)
    if column not in names:
        raise UserError(
            f"{label} has no text column {column!r}; its columns are {', '.join(names)} "
            "(pass --text-column with one of them)"
        )
    if features is not None and getattr(features[column], "dtype", None) not in _TEXT_DTYPES:
        raise UserError(
            f"column {column!r} of {label} holds {features[column]}, not text "
            f"(pass --text-column naming a string column of {', '.join(names)})"
        )
    if isinstance(ds, datasets.Dataset) and ds.num_rows == 0:
        raise UserError(f"{label} has no documents (check the dataset and its split)")


def _hub_kwargs(name: str, config: str | None) -> tuple[dict, dict]:
    """Load arguments and identity of a hub dataset; the identity includes its revision."""
    import datasets

    try:
        builder = datasets.load_dataset_builder(name, config)
    except (ConnectionError, FileNotFoundError) as e:
        raise UserError(
            f"{name!r} is neither a local file or folder nor a reachable hub dataset: {e} "
            "(check the path or the dataset name; offline, only cached hub datasets load)"
        ) from e
    except ValueError as e:  # e.g. a missing or unknown config name
        raise UserError(f"cannot load hub dataset {name!r}: {e} (check --dataset-config)") from e
    # For a hub dataset the builder hash is the commit sha of the dataset repository, so a new
    # revision of the data gets a new fingerprint (and a new token cache).
    return {"path": name, "name": config}, {"hub": name, "config": config, "revision": builder.hash}


def _rows(ds: datasets.Dataset | datasets.IterableDataset) -> int:
    """Rows of a loaded dataset; of a stream, at most 2 are counted (as many as the checks
    need)."""
    import datasets

    return ds.num_rows if isinstance(ds, datasets.Dataset) else sum(1 for _ in islice(ds, 2))


def _sha256(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode("utf-8")).hexdigest()
