"""Building the token cache (read.py's layout; the functions here that name a shard's files
define it) in shards, while training runs (builder.py runs `build` in a background process).

`build` reads every split of every source in order, cuts it into shards (`Sharding`), and hands
each missing shard to one of ``num_proc`` tokenizer processes, which writes it under a temporary
name and renames it into place. Reading stays at most a shard per worker and per split ahead of
them (memory does not grow with the corpus), and serves the shards in the order training needs
them: each source's first shard, then the validation splits, then every source's next shards in
proportion to its weight.

One builder per shard, whatever the number of runs or nodes sharing the cache folder: a builder
takes the shard's lock file (``flock``) before tokenizing it, checks again that the shard is
missing, and skips it while another builder holds it. A pass that skipped shards waits for their
locks at its end, and makes another pass if a holder died without finishing. A killed builder's
locks die with it; its temporaries carry its host and PID and are removed by the next builder
there. The builder and its workers exit when their parent does.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import multiprocessing
import os
import pickle
import queue
import socket
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import numpy as np

from llama_ddp.data.cache.workers import init_encoder, init_worker, write_shard
from llama_ddp.data.tokenizer_files import SpecialIds
from llama_ddp.files import safe_io

SHARDS_ENV = "LLAMA_DDP_SHARDS"


@dataclass(frozen=True)
class Sharding:
    """Where shards are cut: shard k after ``first`` x 2^k characters of text, at most
    ``largest`` (256 Ki, 512 Ki, 1 Mi, 2, 4, 8, then 16 Mi each: the first is small, so that
    training starts soon). A local source of at most ``whole`` bytes is built whole before
    training (seconds) and shuffled as one (data/pipeline.py). ``delay``: seconds a worker waits
    before each shard from shard ``delay_from`` on (test knobs)."""

    first: int = 1 << 18
    largest: int = 16 << 20
    whole: int = 16 << 20
    delay: float = 0.0
    delay_from: int = 0

    def delay_of(self, k: int) -> float:
        """Seconds shard ``k`` waits before it is written."""
        return self.delay if k >= self.delay_from else 0.0

    def chars(self, k: int) -> int:
        return min(self.largest, self.first << min(k, 32))

    @classmethod
    def from_env(cls) -> Sharding:
        """The default, or ``LLAMA_DDP_SHARDS="first=4096,largest=8192,whole=0,delay=0.5"``
        (any of them): small shards from a slow builder, for tests of training while the cache
        is built. Read once per run (data.build_data, or `cache.token_caches`)."""
        items = (item.split("=", 1) for item in os.environ.get(SHARDS_ENV, "").split(",") if item)
        return cls(**{k: (float if k == "delay" else int)(v) for k, v in items})


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


# ----------------------------------------------------------------------------- the builder


def build(jobs: list[Job], tok_json: str, ids: SpecialIds, num_proc: int) -> None:
    """Build every missing shard of ``jobs``, here (``num_proc`` <= 1) or in ``num_proc`` spawned
    worker processes; returns when every split is complete."""
    for job in jobs:
        with safe_io.writing(job.folder, "token cache"):
            job.folder.mkdir(parents=True, exist_ok=True)
        _remove_stale(job.folder)
    pending = [job for job in jobs if read_total(job.folder, job.split) is None]
    if not pending:
        return
    pool = None
    if num_proc > 1:
        ctx = multiprocessing.get_context("spawn")  # forking a tokenizer's threads can deadlock
        initargs = (tok_json, ids, os.getpid())
        pool = ProcessPoolExecutor(num_proc, ctx, initializer=init_worker, initargs=initargs)
    init_encoder(tok_json, ids)  # first shards are tokenized here, while the workers start
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
    """A job's shards in order: ``take()`` gives (k, its texts) for a missing shard k, (k, None)
    for one already built (its documents are skipped unread), None at the end. With ``ahead``
    (an event it sets when a shard is read), a thread of its own reads the next shard while the
    others are dispatched: a slow read (a hold-out scanning 200,000 documents for its 2,000)
    holds up no other split."""

    def __init__(self, job: Job, ahead: threading.Event | None = None) -> None:
        self.job, self.k, self.chars_before, self.ended = job, 0, 0, False
        # Each stream reads its own copy of the dataset: one `datasets` stream read by two
        # threads at once (a source's train and hold-out sides) sometimes yields no rows at all.
        self.texts = pickle.loads(pickle.dumps(job.texts))
        self._shards, self._ahead, self._stop = self._cut(), ahead, threading.Event()
        self._queue: queue.Queue | None = None
        if ahead is not None:
            self._queue = queue.Queue(maxsize=1)
            threading.Thread(target=self._read_ahead, daemon=True).start()

    def key(self) -> tuple:
        """When training needs shard k: first shards, then validation, then by weighted text."""
        if self.job.split != "train":
            return (1, self.k)
        return (0, 0.0) if self.k == 0 else (2, self.chars_before / self.job.weight)

    def _cut(self) -> Iterator[tuple[int, list[str] | None]]:
        texts, folder, split = iter(self.texts), self.job.folder, self.job.split
        for k in itertools.count():
            if shard_done(folder, split, k):
                for _ in islice(texts, shard_docs(shard_stem(folder, split, k))):
                    pass  # read past its documents: the next shard starts after them
                yield k, None
                continue
            shard, chars = [], 0
            for text in texts:
                shard.append(text)
                chars += len(text)
                if chars >= self.job.sharding.chars(k):
                    break
            if not shard:
                return
            yield k, shard

    def _read_ahead(self) -> None:
        try:
            for shard in self._shards:
                self._put(shard)
            self._put(None)
        except BaseException as exc:  # the dispatcher raises it
            self._put(exc)

    def _put(self, item: object) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(queue.Full):
                self._queue.put(item, timeout=0.2)
                self._ahead.set()
                return

    def ready(self) -> bool:
        return self._queue is None or not self._queue.empty()

    def take(self) -> tuple[int, list[str] | None] | None:
        shard = next(self._shards, None) if self._queue is None else self._queue.get_nowait()
        if isinstance(shard, BaseException):
            raise shard
        if shard is None:
            self.ended = True
            return None
        self.k, self.chars_before = (
            shard[0] + 1,
            self.chars_before + self.job.sharding.chars(shard[0]),
        )
        return shard

    def close(self) -> None:
        self._stop.set()


def _one_pass(jobs: list[Job], pool: ProcessPoolExecutor | None, workers: int) -> list[Path]:
    """Read every job once, building its missing shards; the stems other builders held. A
    split's total is written as soon as its last shard is (validation long before the end)."""
    ahead = threading.Event() if pool is not None else None  # with workers: read ahead
    streams = [_Stream(job, ahead) for job in jobs]
    active = list(streams)
    running: dict[Future, tuple[contextlib.ExitStack, _Stream]] = {}
    held: list[Path] = []
    try:
        while active:
            ready = [s for s in active if s.ready()]
            if not ready:
                ahead.wait(0.2)
                ahead.clear()
                continue
            stream = min(ready, key=_Stream.key)
            shard = stream.take()
            if shard is None:
                active.remove(stream)
                _finish(stream, running)
                continue
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
                    write_shard(texts, stem, job.dtype, job.sharding.delay_of(k))
            else:
                while len(running) > workers:  # one shard queued per worker: bounded memory
                    _collect(running, wait(running, return_when=FIRST_COMPLETED).done)
                args = (texts, stem, job.dtype, job.sharding.delay_of(k))
                running[pool.submit(write_shard, *args)] = (lock, stream)
        _collect(running, wait(running).done)
    finally:
        for stream in streams:
            stream.close()
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
    with safe_io.writing(job.folder, "token cache"):
        safe_io.write_text(job.folder / f"{job.split}.json", json.dumps(total) + "\n")


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
    except PermissionError:  # someone else's process
        pass
    return True
