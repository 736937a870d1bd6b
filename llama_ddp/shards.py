"""Building the token cache (cache.py's layout) in shards, in the background, while training runs.

`Builder` starts one process (spawned) that reads every split of every source in order, cuts it
into shards (`Sharding`), and hands each missing shard to one of ``num_proc`` tokenizer
processes, which writes it under a temporary name and renames it into place. The reader stays at
most one shard per worker ahead of them (memory does not grow with the corpus), and serves the
shards in the order training needs them: each source's first shard, then the validation splits,
then every source's next shards in proportion to its weight.

The layout is cache.py's; the functions here that name a shard's files define it.

One builder per shard, whatever the number of runs or nodes sharing the cache folder: a builder
takes the shard's lock file (``flock``) before tokenizing it, checks again that the shard is
missing, and skips it while another builder holds it. A pass that skipped shards waits for their
locks at its end, and makes another pass if a holder died without finishing. A killed builder's
locks die with it; its temporaries carry its host and PID and are removed by the next builder
there. The builder and its workers exit when their parent does.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import heapq
import json
import multiprocessing
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from llama_ddp import files
from llama_ddp.errors import UserError, WriteFailed
from llama_ddp.tokenizer import SpecialIds, text_encoder

_CHUNK_DOCS = 1000  # documents tokenized at once: memory stays one chunk of encodings deep

SHARDS_ENV = "LLAMA_DDP_SHARDS"


@dataclass(frozen=True)
class Sharding:
    """Where shards are cut: shard k after ``first`` x 2^k characters of text, at most
    ``largest`` (256 Ki, 512 Ki, 1 Mi, 2, 4, 8, then 16 Mi each: the first is small, so that
    training starts soon). ``delay``: seconds a worker waits before each shard (a test knob)."""

    first: int = 1 << 18
    largest: int = 16 << 20
    delay: float = 0.0

    def chars(self, k: int) -> int:
        return min(self.largest, self.first << min(k, 32))

    @classmethod
    def from_env(cls) -> Sharding:
        """The default, or ``LLAMA_DDP_SHARDS="first=4096,largest=8192,delay=0.5"`` (any of
        them): small shards from a slow builder, for tests of training while the cache is built.
        Read once per run, by `cache.token_caches`."""
        spec = os.environ.get(SHARDS_ENV, "")
        values = dict(item.split("=", 1) for item in spec.split(",") if item)
        return cls(
            int(values.get("first", cls.first)),
            int(values.get("largest", cls.largest)),
            float(values.get("delay", cls.delay)),
        )


def shard_stem(folder: Path, split: str, k: int) -> Path:
    return Path(folder) / f"{split}-{k:05d}"


def shard_done(folder: Path, split: str, k: int) -> bool:
    return shard_stem(folder, split, k).with_suffix(".idx").is_file()


def shard_docs(stem: Path) -> int:
    """Documents of a built shard, from the size of its offsets."""
    return stem.with_name(f"{stem.name}.idx").stat().st_size // 8 - 1


def read_total(folder: Path, split: str) -> dict | None:
    """A complete split's totals (shards, tokens, docs), or None while it is being built."""
    path = Path(folder) / f"{split}.json"
    return json.loads(path.read_text()) if path.is_file() else None


@dataclass(frozen=True)
class Job:
    """One split of one source to build into ``folder``; ``weight`` orders its train shards."""

    folder: Path
    split: str
    texts: Iterable[str]  # corpus.TextSplit: picklable, read in order
    dtype: str  # of the tokens: cache.token_dtype
    sharding: Sharding
    weight: float = 1.0


def default_num_proc() -> int:
    """All the cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


# ----------------------------------------------------------------------------- the builder


def build(jobs: list[Job], tok_json: str, ids: SpecialIds, num_proc: int) -> None:
    """Build every missing shard of ``jobs``, here (``num_proc`` <= 1) or in ``num_proc`` spawned
    worker processes; returns when every split is complete."""
    for job in jobs:
        with files.writing(job.folder, "token cache"):
            job.folder.mkdir(parents=True, exist_ok=True)
        _remove_stale(job.folder)
    pending = [job for job in jobs if read_total(job.folder, job.split) is None]
    if not pending:
        return
    pool = None
    if num_proc > 1:
        ctx = multiprocessing.get_context("spawn")  # forking a tokenizer's threads can deadlock
        initargs = (tok_json, ids, os.getpid())
        pool = ProcessPoolExecutor(num_proc, ctx, initializer=_init_worker, initargs=initargs)
    _init_encoder(tok_json, ids)  # first shards are tokenized here, while the workers start
    try:
        while pending:
            held = _one_pass(pending, pool, max(1, num_proc))
            for stem in held:  # built by another builder meanwhile, or left when it died
                with _lock(stem, block=True):
                    pass
            pending = [job for job in pending if read_total(job.folder, job.split) is None]
    finally:
        if pool is not None:  # done, failed or stopped: the workers' shards are not needed now
            for process in list(pool._processes.values()):  # (the executor has no other handle)
                process.terminate()
            pool.shutdown(wait=True, cancel_futures=True)


class _Stream:
    """A job's shards in order: ``next()`` gives (k, its texts) for a missing shard k, (k, None)
    for one already built (its documents are skipped unread), None at the end."""

    def __init__(self, job: Job) -> None:
        self.job, self.k, self.chars_before, self.ended = job, 0, 0, False
        self.texts = iter(job.texts)

    def key(self) -> tuple:
        """When training needs shard k: first shards, then validation, then by weighted text."""
        if self.job.split != "train":
            return (1, self.k)
        return (0, 0.0) if self.k == 0 else (2, self.chars_before / self.job.weight)

    def next(self) -> tuple[int, list[str] | None] | None:
        k, limit = self.k, self.job.sharding.chars(self.k)
        if shard_done(self.job.folder, self.job.split, k):
            stem = shard_stem(self.job.folder, self.job.split, k)
            for _ in islice(self.texts, shard_docs(stem)):
                pass  # read past its documents: the next shard starts after them
            texts = None
        else:
            texts, chars = [], 0
            for text in self.texts:
                texts.append(text)
                chars += len(text)
                if chars >= limit:
                    break
        if texts == []:
            self.ended = True
            return None
        self.k, self.chars_before = k + 1, self.chars_before + limit
        return k, texts


def _one_pass(jobs: list[Job], pool: ProcessPoolExecutor | None, workers: int) -> list[Path]:
    """Read every job once, building its missing shards; the stems other builders held. A
    split's total is written as soon as its last shard is (validation long before the end)."""
    streams = [_Stream(job) for job in jobs]
    heap = [(s.key(), i) for i, s in enumerate(streams)]
    running: dict[Future, tuple[contextlib.ExitStack, _Stream]] = {}
    held: list[Path] = []
    try:
        while heap:
            _, i = heapq.heappop(heap)
            stream = streams[i]
            shard = stream.next()
            if shard is None:
                _finish(stream, running)
                continue
            heapq.heappush(heap, (stream.key(), i))
            k, texts = shard
            job = stream.job
            stem = shard_stem(job.folder, job.split, k)
            if texts is None:
                continue
            lock = contextlib.ExitStack()
            if not lock.enter_context(_lock(stem, block=False)):
                held.append(stem)  # another builder's: waited for after the pass
                lock.close()
            elif shard_done(job.folder, job.split, k):
                lock.close()  # another builder finished it since we looked
            elif pool is None or (k == 0 and job.split == "train"):
                with lock:
                    write_shard(texts, stem, job.dtype, job.sharding.delay)
            else:
                while len(running) > workers:  # one shard queued per worker: bounded memory
                    _collect(running, wait(running, return_when=FIRST_COMPLETED).done)
                args = (texts, stem, job.dtype, job.sharding.delay)
                running[pool.submit(write_shard, *args)] = (lock, stream)
        _collect(running, wait(running).done)
    finally:
        for lock, _ in running.values():
            lock.close()
    return held


def _collect(running: dict[Future, tuple[contextlib.ExitStack, _Stream]], done: set) -> None:
    for future in done:
        lock, stream = running.pop(future)
        with lock:
            future.result()  # a worker's error is the builder's
        _finish(stream, running)


def _finish(stream: _Stream, running: dict) -> None:
    """Write the split's total once it has ended and none of its shards is still being written."""
    if stream.ended and all(s is not stream for _, s in running.values()):
        _write_total(stream.job, stream.k)


def _write_total(job: Job, shards: int) -> None:
    if not all(shard_done(job.folder, job.split, k) for k in range(shards)):
        return
    stems = [shard_stem(job.folder, job.split, k) for k in range(shards)]
    size = sum(stem.with_name(f"{stem.name}.bin").stat().st_size for stem in stems)
    total = {
        "shards": shards,
        "tokens": size // np.dtype(job.dtype).itemsize,
        "docs": sum(map(shard_docs, stems)),
        "dtype": job.dtype,
    }
    with files.writing(job.folder, "token cache"):
        files.write_text(job.folder / f"{job.split}.json", json.dumps(total) + "\n")


@contextlib.contextmanager
def _lock(stem: Path, *, block: bool) -> Iterator[bool]:
    """The shard's lock file, held for the block (True), or False when another process holds
    it and ``block`` is false. Removed once the shard exists (holders check that after locking,
    so a removed file locked by a late comer does no harm)."""
    path = stem.with_name(f"{stem.name}.lock")
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
        if stem.with_name(f"{stem.name}.idx").is_file():
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
    finally:
        os.close(fd)


def _remove_stale(folder: Path) -> None:
    """Remove the temporaries of killed builders of this machine (their PID is gone)."""
    host = socket.gethostname()
    for tmp in folder.glob(f"*.tmp-{host}-*"):
        pid = tmp.name.rsplit(f".tmp-{host}-", 1)[1]
        if pid.isdigit() and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ----------------------------------------------------------------------------- writing a shard

_encoder: tuple[Tokenizer, SpecialIds] | None = None


def _init_encoder(tok_json: str, ids: SpecialIds) -> None:
    global _encoder
    _encoder = (text_encoder(tok_json), ids)


def _init_worker(tok_json: str, ids: SpecialIds, parent: int) -> None:
    # One process per core already: the tokenizer's own threads would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the run's to handle
    _lower_priority()
    exit_with_parent(parent)
    _init_encoder(tok_json, ids)


def write_shard(texts: list[str], stem: Path, dtype: str, delay: float = 0.0) -> None:
    """Tokenize ``texts`` (with the encoder of this process) into shard ``stem``: the .bin, then
    the .idx, each written under a temporary name and renamed into place."""
    time.sleep(delay)
    encoder, ids = _encoder
    tmp = f".tmp-{socket.gethostname()}-{os.getpid()}"
    paths = [stem.with_name(f"{stem.name}.{kind}") for kind in ("bin", "idx")]
    temps = [p.with_name(p.name + tmp) for p in paths]
    try:
        with files.writing(paths[0], "token cache"):
            with open(temps[0], "wb") as bin_file, open(temps[1], "wb") as idx_file:
                np.zeros(1, dtype=np.int64).tofile(idx_file)
                total = 0
                for start in range(0, len(texts), _CHUNK_DOCS):
                    chunk = texts[start : start + _CHUNK_DOCS]
                    flat, lengths = encode_chunk(encoder, chunk, ids, np.dtype(dtype))
                    flat.tofile(bin_file)
                    offsets = total + np.cumsum(lengths, dtype=np.int64)
                    offsets.tofile(idx_file)
                    total = int(offsets[-1])
            for temp, path in zip(temps, paths):
                os.replace(temp, path)
    finally:
        for temp in temps:
            temp.unlink(missing_ok=True)


def encode_chunk(
    encoder: Tokenizer, texts: list[str], ids: SpecialIds, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """(framed tokens, document lengths) of ``texts``: each ``[BOT] + tokens + [EOT]``."""
    seqs = [e.ids for e in encoder.encode_batch_fast(texts, add_special_tokens=False)]
    lengths = np.array([len(s) + 2 for s in seqs], dtype=np.int64)
    ends = np.cumsum(lengths)
    flat = np.empty(int(ends[-1]), dtype=dtype)
    flat[ends - lengths] = ids.bot
    flat[ends - 1] = ids.eot
    for end, seq in zip(ends.tolist(), seqs):
        flat[end - 1 - len(seq) : end - 1] = seq
    return flat, lengths


# ----------------------------------------------------------------------------- the process


def exit_with_parent(parent: int) -> None:
    """End this process when ``parent`` does (a killed run must not leave builders behind): as
    if it got SIGTERM, so that it stops its own workers; for good 5 seconds later."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()


def _builder_main(
    jobs: list[Job], tok_json: str, ids: SpecialIds, num_proc: int, parent: int, error_path: str
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the run's to handle
    signal.signal(signal.SIGTERM, _stop)  # `Builder.stop`: end the workers, then leave
    _lower_priority()
    exit_with_parent(parent)
    try:
        build(jobs, tok_json, ids, num_proc)
    except _Stopped:
        return
    except BaseException as exc:  # every failure goes to the run, as one report
        kinds = {UserError: "user", WriteFailed: "write"}
        kind = next((v for k, v in kinds.items() if isinstance(exc, k)), "crash")
        text = "".join(traceback.format_exception(exc)) if kind == "crash" else str(exc)
        Path(error_path).write_text(f"{kind}\n{text}")
        sys.exit(2)


class _Stopped(BaseException):
    pass


def _stop(signum: int, frame: object) -> None:
    raise _Stopped


def _lower_priority() -> None:
    """Tokenize at a lower priority than training (nice 10): on a machine short of cores the
    training process keeps its own, and the builder takes what is left."""
    with contextlib.suppress(OSError):
        os.nice(10)


class Builder:
    """The background process that builds ``jobs``; `check` raises what stopped it, `stop`
    ends it (and its workers)."""

    def __init__(self, jobs: list[Job], tok: Tokenizer, ids: SpecialIds, num_proc: int) -> None:
        fd, self.error_path = tempfile.mkstemp(prefix="llama_ddp-builder-", suffix=".txt")
        os.close(fd)
        ctx = multiprocessing.get_context("spawn")
        args = (jobs, tok.to_str(), ids, num_proc, os.getpid(), self.error_path)
        self.process = ctx.Process(target=_builder_main, args=args, name="llama_ddp-builder")
        self.process.start()
        atexit.register(self.stop)

    @property
    def running(self) -> bool:
        return self.process.exitcode is None

    def check(self) -> None:
        code = self.process.exitcode
        if code in (None, 0):
            return
        kind, _, text = Path(self.error_path).read_text().partition("\n")
        if kind == "user":
            raise UserError(text)
        if kind == "write":
            raise WriteFailed(text)
        raise RuntimeError(f"the token cache builder failed (exit {code}):\n{text}")

    def stop(self) -> None:
        """End the builder now (what it built stays; a later run builds the rest)."""
        atexit.unregister(self.stop)
        if self.process.exitcode is None:
            self.process.terminate()
            self.process.join(10)
            if self.process.exitcode is None:
                self.process.kill()
                self.process.join()
        Path(self.error_path).unlink(missing_ok=True)
