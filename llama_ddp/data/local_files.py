"""Local data files: which files a ``--dataset`` path, folder or glob names (all of one format),
which of a folder's files are held out for validation by their names, and how `datasets` reads
them; or that a folder is one `datasets` wrote with ``save_to_disk``; what a source's note
records of them (its fingerprint, with a checksum).
"""

from __future__ import annotations

import glob
import hashlib
import re
from pathlib import Path

from llama_ddp.errors import UserError
from llama_ddp.files.safe_io import not_a_file

FORMATS = {
    ".txt": "text",
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".tsv": "csv",
}
COMPRESSED = (".gz", ".bz2", ".xz")  # read by `datasets` itself, e.g. data.jsonl.gz
_VALIDATION_NAMES = {"validation", "valid", "val", "dev", "test"}


def looks_local(dataset: str) -> bool:
    path = Path(dataset).expanduser()
    return (
        path.exists()
        or any(c in dataset for c in "*?[")
        or data_format(path) is not None
        or dataset.startswith((".", "/", "~"))
    )


def is_saved_dataset(path: Path) -> bool:
    """A folder written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    return (path / "dataset_dict.json").is_file() or (
        (path / "dataset_info.json").is_file() and (path / "state.json").is_file()
    )


def local_files(dataset: str) -> list[Path]:
    """The data files of a local file, folder or glob, sorted; all of one format."""
    path = Path(dataset).expanduser()
    supported = ", ".join(FORMATS) + " (or " + "/".join(COMPRESSED) + " of them)"
    if path.exists() and not (path.is_file() or path.is_dir()):
        raise not_a_file(path, "--dataset", "give a data file, a folder of them, or a glob")
    if not path.exists() and any(c in dataset for c in "*?["):  # a path that exists is itself
        found = [Path(p) for p in sorted(glob.glob(str(path), recursive=True))]
        files = [p for p in found if p.is_file() and data_format(p) is not None]
        if not files:
            raise UserError(f"no {supported} files match {dataset!r} (check the pattern)")
    elif path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file()
            and data_format(p) is not None
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not files:
            raise UserError(f"folder {dataset!r} holds no {supported} files (add data files)")
    elif path.is_file():
        if data_format(path) is None:
            raise UserError(f"{dataset!r} is not a {supported} file (convert it to one of them)")
        files = [path]
    else:
        raise UserError(f"{dataset!r}: no such file or folder (check the path)")
    # Empty files hold no documents, and `datasets` cannot infer columns from one.
    files = [p for p in files if p.stat().st_size > 0]
    if not files:
        raise UserError(f"{dataset!r} has no documents: its files are empty (add data)")
    formats = sorted({data_format(p) for p in files})
    if len(formats) > 1:
        raise UserError(
            f"{dataset!r} mixes file formats ({', '.join(formats)}) "
            "(keep one format per dataset, or pass a glob such as 'data/*.jsonl')"
        )
    return files


def local_kwargs(files: list[Path], folder: Path | None, cache_dir: Path) -> dict:
    def is_validation(p: Path) -> bool:
        rel = p.relative_to(folder)
        words = [*rel.parts[:-1], re.split(r"[-_.]", rel.name)[0]]
        return any(w.lower() in _VALIDATION_NAMES for w in words)

    held = [p for p in files if folder is not None and is_validation(p)]
    train = [p for p in files if p not in held]
    if not train:
        raise UserError(
            f"every file in {folder} is named as validation data "
            "(name the training files e.g. train.jsonl)"
        )
    data_files = {"train": [str(p) for p in train]}
    if held:
        data_files["validation"] = [str(p) for p in held]
    builder = data_format(files[0])
    kwargs = {"path": builder, "data_files": data_files, "cache_dir": str(cache_dir / "datasets")}
    if builder == "csv":
        kwargs["sep"] = "\t" if data_suffix(files[0]) == ".tsv" else ","
        if len({data_suffix(p) for p in files}) > 1:
            raise UserError("a dataset mixes .csv and .tsv files (keep one separator per dataset)")
    if builder == "text":
        # Files are documents; a lone file is a whole corpus, cut at blank lines (load_splits).
        kwargs["sample_by"] = "paragraph" if len(files) == 1 else "document"
    return kwargs


def data_suffix(path: Path) -> str:
    """The data suffix of ``path``, under a compression suffix: ``.jsonl`` for ``a.jsonl.gz``."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSED:
        suffixes.pop()
    return suffixes[-1] if suffixes else ""


def data_format(path: Path) -> str | None:
    """The `datasets` builder that reads ``path`` (None: not a data file)."""
    return FORMATS.get(data_suffix(path))


def file_identity(path: Path) -> list:
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]


def read_note(path: Path) -> str | None:
    """The fingerprint noted at ``path`` (`note_text`); None: no note, or a damaged one. A digit
    changed, or another note's text, still looks like a fingerprint: taken as this source's,
    a resume was refused as trained with "a different corpus", the note unnamed."""
    text = path.read_text(encoding="ascii", errors="replace") if path.is_file() else ""
    return text[:64] if text == note_text(path, text[:64]) else None


def note_text(path: Path, fingerprint: str) -> str:
    """The text of the note at ``path``: the fingerprint and a checksum of it and the note's
    name (its key)."""
    digest = hashlib.sha256(f"{path.name} {fingerprint}".encode()).hexdigest()
    return f"{fingerprint} {digest[:16]}"
