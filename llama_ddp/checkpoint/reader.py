"""Reading a checkpoint folder from anywhere: its files checked against its manifest, and its DCP
metadata read as data, never as code, on every rank that reads it.

A checkpoint is complete when every file it needs (``.metadata``, ``state.json`` and each shard
``.metadata`` names, whichever rank wrote it) is there with the size and SHA-256 its manifest lists.
DCP writes ``.metadata`` as a pickle and its own reader loads it with plain ``pickle.load``: a
crafted file runs any code it names. Here it is read by an unpickler that resolves exact (module,
name) pairs from a fixed table (DCP's metadata dataclasses, ``torch.Size``, dtypes, the strided
layout, path classes as inert pure paths) and nothing else: no import, no dotted name, no other
callable. What it builds is then checked field by field (``_check``), since the pickle opcodes that
build objects (REDUCE, NEWOBJ, BUILD, INST, OBJ) can still put any plain value in any field. Entries
DCP would unpickle while loading (``BytesStorageMetadata``: DCP's planner reads them with
``torch.load(weights_only=False)``) are refused: llama_ddp writes tensors only, and DCP reads
tensors with ``weights_only=True``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import pickle
import re
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as M
from torch.distributed.checkpoint.filesystem import _StorageInfo

METADATA = ".metadata"
# A storage file DCP's FileSystemWriter names (``__<rank>_<n>.distcp``): a plain name in the folder.
_STORAGE_FILE = re.compile(r"[\w-][\w.-]*\.distcp")


class MetadataRefused(ValueError):
    """``.metadata`` is not plain checkpoint metadata; the message says why."""


def _layout(name: str) -> torch.layout:
    """What ``torch.serialization._get_layout`` returns for the one layout DCP writes here."""
    if name != str(torch.strided):
        raise MetadataRefused(f"layout {name!r} (only strided tensors are saved)")
    return torch.strided


_DCP_CLASSES = (
    M.Metadata,
    M.MetadataIndex,
    M.StorageMeta,
    M.TensorStorageMetadata,
    M.BytesStorageMetadata,  # admitted to be refused by name in _check
    M.ChunkStorageMetadata,
    M.TensorProperties,
    M._MEM_FORMAT_ENCODING,
)
_PATHS = {"PosixPath": PurePosixPath, "PurePosixPath": PurePosixPath, "Path": PurePosixPath}
_PATHS |= {"WindowsPath": PureWindowsPath, "PureWindowsPath": PureWindowsPath}
_DTYPES = {name: v for name, v in vars(torch).items() if isinstance(v, torch.dtype)}
# Every global a checkpoint's .metadata may name (exact module and name), and what it stands for.
_GLOBALS: dict[tuple[str, str], Any] = {
    **{("torch.distributed.checkpoint.metadata", c.__name__): c for c in _DCP_CLASSES},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    **{("torch", name): dtype for name, dtype in _DTYPES.items()},
    ("torch.serialization", "_get_layout"): _layout,
    **{(module, n): cls for module in ("pathlib", "pathlib._local") for n, cls in _PATHS.items()},
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return _GLOBALS[module, name]
        except KeyError:
            raise MetadataRefused(f"it names {module}.{name}") from None

    def persistent_load(self, pid: Any) -> Any:
        raise MetadataRefused("it refers to a persistent object")


def read_metadata(folder: str | Path) -> M.Metadata:
    """The checked DCP metadata of the checkpoint in ``folder``, or MetadataRefused saying what is
    wrong with it."""
    try:
        data = (Path(folder) / METADATA).read_bytes()
        metadata = _Unpickler(io.BytesIO(data)).load()
        _check(metadata)
    except Exception as exc:  # noqa: BLE001 - whatever the bytes do, the answer is: refused
        why = str(exc) if isinstance(exc, MetadataRefused) else f"{type(exc).__name__}: {exc}"
        raise MetadataRefused(
            f"{METADATA} is not plain checkpoint metadata ({why}); refused without running it"
        ) from exc
    return metadata


def storage_files(metadata: M.Metadata) -> set[str]:
    """The names of the files holding the checkpoint's tensors (every rank's shards)."""
    return {info.relative_path for info in metadata.storage_data.values()}


def check_files(folder: Path, listed: dict[str, Any]) -> str | None:
    """None if every file of the manifest's ``listed`` ({name: {size, sha256}}) is in ``folder``
    and matches, ``.metadata`` is plain data and every shard it names is listed; else what is
    wrong."""
    for name, meta in listed.items():
        if Path(name).name != name or name in ("", ".", ".."):
            return f"manifest names {name!r}, not a file of the checkpoint"
        p = folder / name
        try:  # a checkpoint pruned while it is checked loses its files between two calls
            if not p.is_file():
                return f"{name} is missing"
            if p.stat().st_size != meta["size"]:
                return f"{name} has {p.stat().st_size} bytes, manifest says {meta['size']}"
            if sha256(p) != meta["sha256"]:
                return f"{name} does not match its checksum"
        except OSError as exc:
            return f"{name} cannot be read ({exc.strerror or type(exc).__name__})"
    try:
        shards = storage_files(read_metadata(folder))
    except MetadataRefused as exc:
        return str(exc)
    unlisted = sorted(shards - listed.keys())
    if unlisted and (folder / unlisted[0]).is_file():
        return f"manifest lacks {unlisted[0]}"
    if unlisted:
        return (
            f"{unlisted[0]} is missing (written by another node? checkpoints need an --out-dir on "
            "a filesystem shared by all nodes)"
        )
    return None


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


class CheckpointReader(dcp.FileSystemReader):
    """DCP's file reader with ``.metadata`` read by `read_metadata` (or given: as read before, so
    that a checkpoint pruned meanwhile fails at its tensors, not at a metadata DCP reports as
    missing in a logged traceback). It takes no ``rank`` argument, so DCP never falls back to
    reading a per-rank ``__N.metadata`` instead."""

    def __init__(self, path: str | Path, metadata: M.Metadata | None = None) -> None:
        super().__init__(path)
        self.given = metadata

    def read_metadata(self) -> M.Metadata:  # type: ignore[override]
        metadata = self.given or read_metadata(self.path)
        metadata.storage_meta = metadata.storage_meta or M.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# ----------------------------------------------------------------------------- the field checks


def _fail(what: str) -> None:
    raise MetadataRefused(what)


def _obj(x: Any, cls: type, what: str) -> None:
    """``x`` is exactly a ``cls``, holding only ``cls``'s fields (defaults fill the others)."""
    if type(x) is not cls:
        _fail(f"{what} is a {type(x).__name__}, not a {cls.__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    if not set(vars(x)) <= names:
        _fail(f"{what} has fields {sorted(map(str, set(vars(x)) - names))}")


def _is(x: Any, kinds: tuple[type, ...], what: str) -> None:
    if type(x) not in kinds:
        _fail(f"{what} is a {type(x).__name__}")


def _size(x: Any, what: str) -> None:
    _is(x, (torch.Size,), what)
    if any(type(n) is not int or n < 0 for n in x):
        _fail(f"{what} is not a size")


def _tensor_entry(fqn: str, md: Any) -> None:
    if type(md) is M.BytesStorageMetadata:
        _fail(
            f"it declares {fqn!r} as a pickled object, which loading would run as code; "
            "llama_ddp saves tensors only"
        )
    _obj(md, M.TensorStorageMetadata, fqn)
    p = md.properties
    _obj(p, M.TensorProperties, f"{fqn}'s properties")
    _is(p.dtype, (torch.dtype,), f"{fqn}'s dtype")
    _is(p.memory_format, (torch.memory_format,), f"{fqn}'s memory format")
    _is(p.requires_grad, (bool,), f"{fqn}'s requires_grad")
    _is(p.pin_memory, (bool,), f"{fqn}'s pin_memory")
    if p.layout is not torch.strided:
        _fail(f"{fqn}'s layout is {p.layout}")
    _size(md.size, f"{fqn}'s size")
    _is(md.chunks, (list,), f"{fqn}'s chunks")
    for chunk in md.chunks:
        _obj(chunk, M.ChunkStorageMetadata, f"a chunk of {fqn}")
        _size(chunk.offsets, f"a chunk offset of {fqn}")
        _size(chunk.sizes, f"a chunk size of {fqn}")
        if not len(chunk.offsets) == len(chunk.sizes) == len(md.size):
            _fail(f"a chunk of {fqn} does not match its size")


def _storage_entry(index: Any, info: Any) -> None:
    _obj(index, M.MetadataIndex, "a storage index")
    _is(index.fqn, (str,), "a storage index's name")
    if index.offset is not None:
        _size(index.offset, f"{index.fqn}'s offset")
    _is(index.index, (int, type(None)), f"{index.fqn}'s index")
    _obj(info, _StorageInfo, f"{index.fqn}'s storage")
    _is(info.relative_path, (str,), f"{index.fqn}'s file")
    if not _STORAGE_FILE.fullmatch(info.relative_path):
        _fail(f"{index.fqn} is stored in {info.relative_path!r}, not a .distcp file of the folder")
    for n in (info.offset, info.length):
        if type(n) is not int or n < 0:
            _fail(f"{index.fqn}'s storage offset or length is not a byte count")
    if info.transform_descriptors:
        _fail(f"{index.fqn} is stored through transforms {info.transform_descriptors!r}")


def _plain(x: Any, what: str) -> None:
    """Nested containers of None, bools, numbers and strings."""
    if type(x) in (list, tuple):
        for item in x:
            _plain(item, what)
    elif type(x) is dict:
        for key, value in x.items():
            _plain(key, what)
            _plain(value, what)
    else:
        _is(x, (type(None), bool, int, float, str), what)


def _check(md: Any) -> None:
    """``md`` is DCP metadata of tensors only, every field of the type DCP writes."""
    _obj(md, M.Metadata, "it")
    _is(md.state_dict_metadata, (dict,), "its entry table")
    for fqn, entry in md.state_dict_metadata.items():
        _is(fqn, (str,), "an entry's name")
        _tensor_entry(fqn, entry)
    _is(md.storage_data, (dict,), "its storage table")
    for index, info in md.storage_data.items():
        _storage_entry(index, info)
    _plain(md.planner_data, "its planner data")
    _is(md.version, (str, type(None)), "its version")
    meta = md.storage_meta
    if meta is not None:
        _obj(meta, M.StorageMeta, "its storage meta")
        _is(meta.checkpoint_id, (str, type(None), *set(_PATHS.values())), "its checkpoint id")
        for value in (meta.save_id, meta.load_id):
            _is(value, (str, type(None)), "its save or load id")
        _plain(meta.modules, "its modules")
