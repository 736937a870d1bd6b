"""Writing and reading the files of a run so that none is ever seen half-written or mixed.

- One writer per run folder: rank 0 holds an advisory lock (``OUT/.lock``, ``flock``) for the
  run's life; the kernel releases it when the process dies, so a killed run never blocks the next.
- Every file is written under a temporary name beside its final one and renamed into place
  (``os.replace`` is atomic on POSIX); a failed or interrupted write removes its temporary and
  leaves the previous file as it was; temporaries of a killed run are removed at the next start.
- A write the disk refuses (full, quota, file size limit, read-only, I/O error) becomes one
  `WriteFailed` line naming the path, the space needed and the space free.
- Reads of torch files accept tensors and plain data only; a pipe or device named as a file to
  read is refused as such (`not_a_file`).
- One rule for a file a user names for a command to write (`check_output`): checked before the
  work, never a folder, never replaced without ``--force``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import pickle
import re
import shutil
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llama_ddp.errors import UserError, WriteFailed

if TYPE_CHECKING:  # torch is imported where used: the token cache's workers never need it
    import torch

LOCK_FILE = ".lock"
# errno values that mean "the disk refused": nothing the program can do but stop and say so.
_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS}
# torch's own writer (torch.save, DCP) and numpy's tofile (the GGUF writer) report a short
# write as this, without the errno.
_SHORT_WRITE = ("inline_container", "unexpected pos", "file write failed", "requested and")
# Rust writers (safetensors) name the errno in their message only.
_RUST_ERRNO = re.compile(r"\(os error (\d+)\)")


def causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and every exception it wraps: its cause, its context, and the errors DCP gathers
    from its writers (``failures``: {rank: (exception, traceback)})."""
    todo: list[BaseException] = [exc]
    seen: set[int] = set()  # an exception re-raised from what wraps it makes a cycle
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [x for x in (e.__cause__, e.__context__) if x is not None]
        todo += [f[0] for f in getattr(e, "failures", {}).values() if isinstance(f, tuple)]


def _refusal(exc: BaseException) -> str | None:
    """Why the disk refused a write, if ``exc`` (or what it wraps) says it did."""
    for e in causes(exc):
        if isinstance(e, OSError) and e.errno in _DISK_ERRNOS:
            return e.strerror or os.strerror(e.errno)
        if isinstance(e, (RuntimeError, OSError)) and any(s in str(e) for s in _SHORT_WRITE):
            return "the write stopped short (a full disk, a quota or a file size limit)"
        code = _RUST_ERRNO.search(str(e))  # safetensors' SafetensorError: "(os error 27)"
        if code and int(code[1]) in _DISK_ERRNOS:
            return os.strerror(int(code[1]))
    return None


def usual_mode(path: Path) -> None:
    """Give ``path`` the mode a new file gets here (0644 under the usual umask): some writers
    (safetensors) create private 0600 files, and every file of a run should read alike."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


def free_bytes(path: Path) -> int:
    """Free space on the disk holding ``path`` (or its nearest existing parent)."""
    return _usage(path).free


def _usage(path: Path) -> Any:
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path)


def _mb(n: int) -> str:
    return f"{n / 2**20:,.1f} MB"


@contextlib.contextmanager
def writing(path: Path, what: str, needed: int | None = None) -> Iterator[None]:
    """Writes of ``what`` at ``path`` in this block: a refusal by the disk becomes one
    WriteFailed line; checked up front when ``needed`` bytes are known."""
    path = Path(path)
    if _usage(path).total == 0:  # /proc, /sys: no disk behind it ("0.0 MB free" would mislead)
        raise WriteFailed(
            f"cannot write {what} {path}: the place cannot hold files, it is a virtual "
            "filesystem with no disk behind it, like /proc (choose another location)"
        )
    free = free_bytes(path)
    if needed is not None and needed > free:
        raise WriteFailed(
            f"cannot write {what} {path}: it needs {_mb(needed)}, the disk has {_mb(free)} "
            "free (free some space or choose another --out-dir; nothing was written)"
        )
    try:
        yield
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        why = _refusal(exc)
        if why is None:
            raise
        need = f"it needs about {_mb(needed)}, " if needed else ""
        raise WriteFailed(
            f"cannot write {what} {path}: {why}; {need}{_mb(free_bytes(path))} free (free some "
            "space or choose another location; the partial write was removed, earlier files "
            "are intact)"
        ) from exc


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
    import torch

    return atomic_write(path, lambda tmp: torch.save(obj, tmp))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def not_a_file(path: Path, what: str, fix: str = "check the path") -> UserError:
    """The error for ``path``, named as a file to read, that is not one: missing, a folder, or a
    pipe, socket or device (which a reader would block on, or read only once)."""
    if path.is_dir():
        return UserError(f"{what} {path} is a folder, not a file ({fix})")
    if path.exists():
        return UserError(
            f"{what} {path} is not a regular file but a pipe, socket or device ({fix})"
        )
    return UserError(f"{what} {path} not found ({fix})")


def read_json(path: str | Path, what: str, fix: str = "check the path") -> dict[str, Any]:
    """A JSON object file's content (a config), or one UserError line if it is missing (with
    ``fix``), damaged, or not an object."""
    path = Path(path)
    if not path.is_file():
        raise not_a_file(path, what, fix)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"{what} {path} is not readable JSON ({_first_line(exc)})") from exc
    if not isinstance(data, dict):
        raise UserError(f"{what} {path} is not a JSON object")
    return data


def read_safetensors(path: str | Path, what: str = "weights") -> dict[str, torch.Tensor]:
    """The tensors of a .safetensors file, or one UserError line if it is damaged (a truncated
    download, a partial copy)."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise not_a_file(path, what)
    try:
        return load_file(path)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise UserError(
            f"{what} {path} is not a readable safetensors file ({_first_line(exc)}) "
            "(export or download it again)"
        ) from exc


def safe_load(path: str | Path, what: str = "file", *, mmap: bool = False) -> Any:
    """``torch.load`` that only accepts tensors and plain data, as a UserError otherwise; with
    ``mmap`` the tensors are mapped from the file, read only where they are used (a file in the
    legacy, non-zip format is read whole: torch maps zip files only)."""
    import torch

    path = Path(path)
    if not path.is_file():
        raise not_a_file(path, what)
    mmap = mmap and zipfile.is_zipfile(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        raise UserError(
            f"{what} {path} holds objects other than tensors and plain data; refused without "
            "running it (only load files you trust, and re-save them as plain state dicts)"
        ) from exc
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise UserError(
            f"{what} {path} is not a readable PyTorch file ({_first_line(exc)})"
        ) from exc


def check_output(path: str | Path, flag: str, force: bool, example: str = "out") -> Path:
    """The one rule for a file a user names for a command to write, checked before any work:
    not a folder, not anything but a plain file, not an existing file unless ``force``
    (``--force``), and in a folder that exists or can be made and is writable. ``flag`` names
    the option in the errors; ``example`` is a file name to suggest inside a folder."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{flag} {path} is a folder (give a file name, e.g. {path / example})")
    if path.exists() and not path.is_file():
        raise UserError(f"{flag} {path} is not a regular file (give a file name)")
    if path.exists() and not force:
        raise UserError(f"{flag} {path} exists (pass --force to replace it)")
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise UserError(f"{flag} {path}: {folder} is a file, not a folder (choose another path)")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {path}: {folder} is not writable (choose another path)")
    return path


def check_name_length(path: str | Path, flag: str) -> None:
    """A UserError when ``path`` is too long for this system (ENAMETOOLONG: a traceback
    wherever it is first used, after the folders above it were made): a name in it longer
    than its filesystem allows (NAME_MAX, 255 bytes on most), or the whole of it longer than a
    path may be (PATH_MAX)."""
    path = Path(path)
    folder = path.parent  # the filesystem it would be on: its nearest existing folder's
    while not os.path.isdir(folder) and folder != folder.parent:
        folder = folder.parent
    longest = max(path.parts, key=lambda part: len(os.fsencode(part)), default="")
    size, limit = len(os.fsencode(longest)), os.pathconf(folder, "PC_NAME_MAX")
    if size > limit:
        raise UserError(
            f"{flag} has a name of {size} bytes ({longest[:20] + '...'!r}), more than the "
            f"{limit} its filesystem allows (choose a shorter {flag})"
        )
    size = len(os.fsencode(str(path)))
    if size >= os.pathconf(folder, "PC_PATH_MAX"):  # the limit counts the final NUL
        raise UserError(
            f"{flag} is {size:,} bytes long, more than this system allows in a path (choose a "
            f"shorter {flag})"
        )


def prepare_run_dir(path: str | Path) -> Path:
    """Create the run folder and check that it is writable."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out-dir {out} is a file, not a folder (choose another --out-dir)")
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


@contextlib.contextmanager
def own_run_dir(path: str | Path) -> Iterator[Path]:
    """The run folder ``path`` created (`prepare_run_dir`) and locked (`run_lock`) for the
    block. A run refused before it wrote anything but the lock (a shape that does not divide, a
    size that cannot fit) leaves no folder behind: one this block created, with the folders
    above it that it created, is removed again when the block fails and it holds only the
    lock."""
    new = []  # the folders prepare_run_dir makes, innermost first
    folder = Path(path)
    while not folder.exists() and folder != folder.parent:
        new.append(folder)
        folder = folder.parent
    out = prepare_run_dir(path)
    with run_lock(out):
        try:
            yield out
        except BaseException:
            if new and [p.name for p in out.iterdir()] == [LOCK_FILE]:
                (out / LOCK_FILE).unlink()
                with contextlib.suppress(OSError):  # another run's file since: it stays
                    for made in new:
                        made.rmdir()
            raise


@contextlib.contextmanager
def run_lock(out_dir: Path) -> Iterator[None]:
    """Hold ``out_dir``'s lock for the block: a second run into the same folder is refused with
    the holder's PID. The kernel drops the lock when this process ends, however it ends."""
    path = Path(out_dir) / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise UserError(
            f"--out-dir {out_dir} is in use by another run (PID {holder}); wait for it to "
            "finish, or choose another --out-dir"
        ) from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


def replace_dir(new: Path, final: Path) -> None:
    """Put the complete folder ``new`` at ``final``, replacing what was there. Between the two
    renames the previous folder waits as ``<final>.old``; `remove_temporaries` puts it back if
    a crash came first."""
    old = final.with_name(final.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    new.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def remove_temporaries(out_dir: Path) -> list[Path]:
    """Remove what killed runs left half-written in ``out_dir`` and its checkpoints folder, and
    put back a folder a crash left set aside by `replace_dir` (call with the run's lock held)."""
    found = []
    for folder in (Path(out_dir), Path(out_dir) / "checkpoints"):
        for path in [*folder.glob(".*.tmp-*"), *folder.glob("*.tmp"), *folder.glob("*.old")]:
            found.append(path)
            final = path.with_name(path.name.removesuffix(".old"))
            if path.suffix == ".old" and not final.exists():
                path.rename(final)  # the new one never arrived: the old one is still good
            elif path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
    return found
