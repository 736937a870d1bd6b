"""Writing and reading the files of a run so that none is ever seen half-written.

Every file is written under a temporary name beside its final one and renamed into place
(``os.replace`` is atomic on POSIX); a failed or interrupted write removes its temporary and
leaves the previous file as it was. Reads of torch files accept tensors and plain data only.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from llama_ddp.errors import UserError


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path to write ``path``'s new content to; renamed over ``path`` on success,
    removed on any failure (the old ``path`` is untouched)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)


def atomic_write(path: str | Path, write: Callable[[Path], Any]) -> Path:
    """Call ``write(tmp)`` and rename ``tmp`` to ``path``."""
    path = Path(path)
    with atomic_path(path) as tmp:
        write(tmp)
    return path


def write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def copy_file(src: str | Path, dst: str | Path) -> Path:
    return atomic_write(dst, lambda tmp: shutil.copyfile(src, tmp))


def torch_save(obj: Any, path: str | Path) -> Path:
    return atomic_write(path, lambda tmp: torch.save(obj, tmp))


def safe_load(path: str | Path, what: str = "file") -> Any:
    """``torch.load`` that only accepts tensors and plain data, as a UserError otherwise."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what} {path} not found (check the path)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UserError(
            f"{what} {path} holds objects other than tensors and plain data; refused without "
            "running it (only load files you trust, and re-save them as plain state dicts)"
        ) from exc
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"{what} {path} is not a readable PyTorch file ({first})") from exc


def prepare_run_dir(path: str | Path) -> Path:
    """Create the run folder and check that it is writable."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UserError(
            f"--out-dir {out} is not writable ({exc.strerror}; choose another)"
        ) from exc
    return out
