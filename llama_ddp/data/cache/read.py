"""The token cache: each source tokenized once, in shards, memory-mapped when read.

``cache_dir/tokens-<key>/`` holds one source (the key hashes its corpus fingerprint, the
tokenizer's, the roles that frame a document and the shard sizes, not the sequence settings: one
cache serves every sequence length and both packing modes). Per split, shard k is
``<split>-<k>.bin`` (the tokens of its documents, each stored as ``[BOT] + tokens + [EOT]``) and
``<split>-<k>.idx`` (int64 document offsets into it, one more than its documents). Shard k holds
the documents that follow shard k-1's, until their text reaches `Sharding.chars` (k) characters:
the boundaries depend on the data alone, never on who built a shard or when. A shard's ``.idx``
is renamed into place after its ``.bin``, so a shard whose ``.idx`` exists is complete; when a
split's last shard is, ``<split>.json`` (its shards, tokens and documents) says so.

build.py builds the shards (in background processes); this module starts it (`token_caches`),
finds and reads the shards, and waits for the ones a reader needs.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tokenizers import Tokenizer

from llama_ddp.data.cache.build import Job, Sharding, build, read_total, shard_done, shard_stem
from llama_ddp.data.cache.builder import Builder, default_num_proc
from llama_ddp.data.tokenizer import tokenizer_fingerprint
from llama_ddp.data.tokenizer_files import SpecialIds
from llama_ddp.errors import DataWaitTimeout, UserError
from llama_ddp.files.preparation import ALONE, Preparation

if TYPE_CHECKING:  # the builder's workers import this module, never `datasets`
    from llama_ddp.data.corpus import Corpus

# Bump when the cache layout or the document framing changes, so old caches are not reused.
CACHE_FORMAT = 2
SPLITS = ("train", "validation")
OPEN_SHARDS = 16  # memory-mapped shards kept open per split (two file descriptors each)


def cache_key(corpus: Corpus, tok: Tokenizer, special: SpecialIds, sharding: Sharding) -> str:
    """A source's cache name: the data, the tokenizer and its roles, the shard sizes."""
    roles = [special.bot, special.eot, special.pad]
    fields = [CACHE_FORMAT, corpus.fingerprint, tokenizer_fingerprint(tok), roles]
    fields += [sharding.first, sharding.largest]
    return hashlib.sha256(json.dumps(fields).encode()).hexdigest()[:20]


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


class TokenShard:
    """One shard's token and offset arrays, memory-mapped on first use; its sizes come from the
    files' sizes. Pickles as its paths only, so DataLoader workers map the files themselves."""

    def __init__(self, stem: Path, dtype: np.dtype) -> None:
        self.stem, self.dtype = Path(stem), np.dtype(dtype)
        self.num_tokens = self.path("bin").stat().st_size // self.dtype.itemsize
        self.num_docs = self.path("idx").stat().st_size // 8 - 1
        self._tokens: np.ndarray | None = None
        self._offsets: np.ndarray | None = None

    def path(self, kind: str) -> Path:
        return self.stem.with_name(f"{self.stem.name}.{kind}")

    @property
    def tokens(self) -> np.ndarray:
        if self._tokens is None:
            shape = (self.num_tokens,)
            self._tokens = np.memmap(self.path("bin"), dtype=self.dtype, mode="r", shape=shape)
        return self._tokens

    @property
    def offsets(self) -> np.ndarray:
        if self._offsets is None:
            shape = (self.num_docs + 1,)
            self._offsets = np.memmap(self.path("idx"), dtype=np.int64, mode="r", shape=shape)
        return self._offsets

    def close(self) -> None:
        """Unmap the arrays (items already read are copies); they map again when used."""
        self._tokens = self._offsets = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None, "_offsets": None}


@dataclass(frozen=True)
class Patience:
    """How a reader waits for shards still being built, once training began: it says so (``say``)
    every ``report`` seconds of one wait, and after ``limit`` seconds (None: never) raises
    DataWaitTimeout. The limit is for a job across machines, each building its own cache: there
    a rank's wait is its peers' wait in the next collective, which gives up after ``timeout``
    seconds without naming a cause. (On one machine every rank waits for the same shard at the
    same step: no peer is in a collective meanwhile, and nothing times out.)"""

    say: Callable[[str], None]
    report: float = 60.0
    limit: float | None = None
    timeout: float = 1800.0
    who: str = "this process"

    def waited(self, seconds: float, what: str, reports: int) -> int:
        """After ``seconds`` of waiting for ``what`` with ``reports`` said so far: raise at the
        limit, say so when a report is due; the reports said now."""
        if self.limit is not None and seconds > self.limit:
            raise DataWaitTimeout(
                f"{self.who} waited {seconds:.0f} s for {what}, which its machine is still "
                f"building, while its peers wait in a collective that gives up after "
                f"{self.timeout:.0f} s (build the whole cache first: a run without --max-steps "
                "builds it before its first step, and later runs reuse it; or give the builder "
                "more cores with --num-proc; or raise LLAMA_DDP_COLLECTIVE_TIMEOUT, in minutes)"
            )
        if seconds < (reports + 1) * self.report:
            return reports
        self.say(f"waiting {seconds:.0f} s for {what} (the token cache is still being built)")
        return reports + 1


class ShardedSplit:
    """One split of one source's cache, as far as it is built: the shards found so far (a
    contiguous run from shard 0) and, once complete, the split's totals. ``check`` is called
    while waiting for a shard (the builder's health: it raises what stopped the builder)."""

    def __init__(self, folder: Path, name: str, dtype: np.dtype, label: str = "") -> None:
        self.folder, self.name, self.dtype = Path(folder), name, np.dtype(dtype)
        self.label = label or f"{name} split"
        self.shards: list[TokenShard] = []
        self.total: dict | None = None
        self.check: Callable[[], None] | None = None
        self.patience: Patience | None = None  # set once training begins
        self._open: OrderedDict[int, None] = OrderedDict()
        self.refresh()

    @property
    def complete(self) -> bool:
        return self.total is not None

    def refresh(self) -> None:
        """Take in the shards built since the last look."""
        if self.complete:
            return
        self.total = read_total(self.folder, self.name)  # read first: then every shard exists
        while shard_done(self.folder, self.name, k := len(self.shards)):
            self.shards.append(TokenShard(shard_stem(self.folder, self.name, k), self.dtype))
        if self.total is not None and len(self.shards) != self.total["shards"]:
            raise UserError(
                f"token cache {self.folder} is damaged: {self.name} has {len(self.shards)} of "
                f"its {self.total['shards']} shards (delete that folder: it is rebuilt)"
            )

    def shard(self, k: int) -> TokenShard:
        """Shard k (it must exist), memory-mapped; the least recently used beyond OPEN_SHARDS
        are unmapped."""
        self._open[k] = None
        self._open.move_to_end(k)
        while len(self._open) > OPEN_SHARDS:
            self.shards[self._open.popitem(last=False)[0]].close()
        return self.shards[k]

    def wait(self, ready: Callable[[], bool], what: str) -> None:
        """Wait until ``ready()``, re-reading the folder (``ready`` must hold once complete);
        ``what`` it waits for, as `patience` reports it."""
        delay, start, reports = 0.005, time.monotonic(), 0
        while not ready():
            if self.check is not None:
                self.check()
            if self.patience is not None:
                reports = self.patience.waited(time.monotonic() - start, what, reports)
            time.sleep(delay)
            delay = min(delay * 2, 0.2)
            self.refresh()

    def wait_for_shard(self, k: int) -> bool:
        """Wait until shard k exists (True) or the split is complete without it (False)."""
        what = f"{self.name} shard {k} {self}"
        self.wait(lambda: len(self.shards) > k or self.complete, what)
        return len(self.shards) > k

    def wait_complete(self) -> None:
        self.wait(lambda: self.complete, f"the whole {self.name} split {self}")

    def __str__(self) -> str:
        return f"of token cache {self.folder}"

    def __getstate__(self) -> dict:
        return {**self.__dict__, "check": None, "patience": None}


def token_caches(
    corpora: list[Corpus],
    tok: Tokenizer,
    cache_dir: Path,
    special: SpecialIds,
    *,
    weights: list[float] | None = None,
    prep: Preparation = ALONE,
    num_proc: int | None = None,
    background: bool = False,
    whole: bool | list[bool] = True,
    sharding: Sharding | None = None,
) -> tuple[list[tuple[ShardedSplit, ShardedSplit]], Builder | None]:
    """(train, validation) splits of each corpus's cache, with the `Builder` building them in
    the background (``background``; None when nothing is left to build, or in a process that
    does not build). Returns once the train splits of the corpora ``whole`` names (a bool for
    each, or one for all) are complete and the others have their first shard: the rest is read
    as it is built.

    Under torchrun, ``prep`` leads on one process per machine sharing ``cache_dir``: that
    process builds the caches while the others wait, then all read them.
    ``num_proc`` worker processes tokenize (default in the background: every core; otherwise
    this process, where the Rust tokenizer already uses every core). ``sharding`` defaults to
    `Sharding.from_env`."""
    dtype = token_dtype(tok.get_vocab_size(with_added_tokens=True))
    weights = weights or [1.0] * len(corpora)
    sharding = sharding or Sharding.from_env()
    folders = [
        Path(cache_dir) / f"tokens-{cache_key(corpus, tok, special, sharding)}"
        for corpus in corpora
    ]
    splits = [
        (ShardedSplit(f, "train", dtype), ShardedSplit(f, "validation", dtype)) for f in folders
    ]
    builder = None
    if prep.leads and not all(s.complete for pair in splits for s in pair):
        # One job per folder and split still to build (two sources of the same data share a
        # cache): a corpus is read only for the splits it has yet to give.
        jobs = {
            (folder, name): Job(folder, name, getattr(corpus, name), dtype.name, sharding, weight)
            for folder, corpus, weight, pair in zip(folders, corpora, weights, splits)
            for name, split in zip(SPLITS, pair)
            if not split.complete
        }
        jobs = list(jobs.values())
        if background:
            builder = Builder(jobs, tok, special, num_proc or default_num_proc())
            for pair in splits:
                for split in pair:
                    split.check = builder.check
        else:
            build(jobs, tok.to_str(), special, num_proc or 1)
    wholes = whole if isinstance(whole, list) else [whole] * len(corpora)
    for (train, _), entire in zip(splits, wholes):
        if prep.leads:
            train.wait_complete() if entire else train.wait_for_shard(0)
    prep.wait()
    for train, _ in splits:
        train.refresh()
        if not train.shards:
            raise UserError(
                f"token cache {train.folder} is missing after the main process built it "
                "(the cache folder must be shared by all processes of a machine; set --cache-dir)"
            )
    return splits, builder
