"""The embedded sample corpus: the running Python's standard-library sources, one document per
``.py`` file, written once as parquet under the cache folder, so that `--dataset sample` needs no
network and reads through `datasets` like any local dataset.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from llama_ddp.files import safe_io

# Packages left out of the sample corpus: tests (huge, repetitive), GUI and legacy tools, vendored.
_SAMPLE_EXCLUDE = {
    "test",
    "tests",
    "site-packages",
    "idlelib",
    "tkinter",
    "lib2to3",
    "ensurepip",
    "__pycache__",
}
_SAMPLE_VALIDATION_EVERY = 20
# Bump when the sample's content rules change, so old caches are not reused.
_SAMPLE_VERSION = 1


def _sha256(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode("utf-8")).hexdigest()


def _stdlib_documents() -> list[tuple[str, str]]:
    """(relative path, source) of the standard library's .py files, sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SAMPLE_EXCLUDE]
        for name in filenames:
            if not name.endswith(".py"):
                continue
            path = Path(dirpath, name)
            try:
                text = path.read_bytes().decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            docs.append((path.relative_to(root).as_posix(), text))
    docs.sort()
    return docs


def materialize_sample(cache_dir: Path) -> tuple[Path, dict]:
    """Write the sample corpus once as parquet; return its folder and its identity."""
    docs = _stdlib_documents()
    digest = hashlib.sha256()
    for rel, text in docs:
        digest.update(f"{rel}\0{len(text)}\0".encode())
        digest.update(text.encode("utf-8"))
    identity = {
        "sample": _SAMPLE_VERSION,
        "python": sys.version.split()[0],
        "files": digest.hexdigest(),
    }
    folder = cache_dir / f"sample-{_sha256(identity)[:16]}"
    if folder.is_dir():
        return folder, identity
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".sample-", dir=cache_dir))
    try:
        with safe_io.writing(folder, "the sample corpus"):
            for name, keep in (("train", False), ("validation", True)):
                rows = [
                    d for i, d in enumerate(docs) if (i % _SAMPLE_VALIDATION_EVERY == 0) == keep
                ]
                table = pa.table({"path": [r for r, _ in rows], "text": [t for _, t in rows]})
                pq.write_table(table, tmp / f"{name}.parquet")
        os.rename(tmp, folder)
    except OSError:
        # Another process (a torchrun rank) renamed its copy first: use that one.
        if not folder.is_dir():
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return folder, identity
