"""The pre-tokenization cache: a corpus tokenized once, in batches, memory-mapped when read.

``cache_dir/tokens-<key>/`` holds per split a flat token array (``<split>.bin``, every document
stored as ``[BOT] + tokens + [EOT]``) and the int64 document offsets into it (``<split>.idx``, one
more than the number of documents). The key hashes the corpus and tokenizer fingerprints and the
tokenizer's roles (which ids frame a document) only, so one cache serves every sequence length
and both packing modes: the datasets (data.py) cut their items out of the memory-mapped arrays
when read.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import socket
import tempfile
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from llama_ddp import files
from llama_ddp.corpus import Corpus
from llama_ddp.errors import UserError
from llama_ddp.tokenizer import SpecialIds, special_ids, text_encoder, tokenizer_fingerprint

# Bump when the cache layout or the document framing changes, so old caches are not reused.
CACHE_FORMAT = 1
_CHUNK_DOCS = 1000
SPLITS = ("train", "validation")


def cache_key(corpus: Corpus, tok: Tokenizer, special: SpecialIds) -> str:
    """The token cache's name: the data, the tokenizer and its roles, not the sequence settings."""
    roles = [special.bot, special.eot, special.pad]
    fields = [CACHE_FORMAT, corpus.fingerprint, tokenizer_fingerprint(tok), roles]
    return hashlib.sha256(json.dumps(fields).encode()).hexdigest()[:20]


def token_cache(
    corpus: Corpus,
    tok: Tokenizer,
    cache_dir: Path,
    *,
    special: SpecialIds | None = None,
    is_main: bool = True,
    barrier: Callable[[], None] = lambda: None,
    num_proc: int | None = None,
) -> Path:
    """The folder of ``corpus`` tokenized by ``tok``, built if absent; documents are framed by
    ``special``'s BOT and EOT (default: our own tokenizers' ``[BOT]``/``[EOT]``).

    Under torchrun, pass ``is_main`` true on one process per machine sharing ``cache_dir`` and a
    barrier: that process builds the cache while the others wait, then all memory-map it.
    ``num_proc`` > 1 tokenizes in that many worker processes; the default tokenizes in this
    process, where the Rust tokenizer already uses every core (faster on small machines).
    """
    special = special or special_ids(tok)
    folder = Path(cache_dir) / f"tokens-{cache_key(corpus, tok, special)}"
    if is_main and not (folder / "meta.json").is_file():
        _build_cache(corpus, tok, special, folder, num_proc)
    barrier()
    if not (folder / "meta.json").is_file():
        raise UserError(
            f"token cache {folder} is missing after the main process built it "
            "(the cache folder must be shared by all processes of a machine; set --cache-dir)"
        )
    return folder


class TokenSplit:
    """One split of the token cache, memory-mapped on first use.

    Pickles as its folder and name only, so DataLoader workers started with spawn map the
    files themselves instead of receiving a copy of every token.
    """

    def __init__(self, folder: Path, name: str) -> None:
        meta = json.loads((folder / "meta.json").read_text())
        self.folder = folder
        self.name = name
        self.dtype = np.dtype(meta["dtype"])
        self.num_tokens: int = meta["splits"][name]["tokens"]
        self.num_docs: int = meta["splits"][name]["docs"]
        self._tokens: np.ndarray | None = None
        self._offsets: np.ndarray | None = None

    @property
    def tokens(self) -> np.ndarray:
        if self._tokens is None:
            path = self.folder / f"{self.name}.bin"
            self._tokens = np.memmap(path, dtype=self.dtype, mode="r", shape=(self.num_tokens,))
        return self._tokens

    @property
    def offsets(self) -> np.ndarray:
        if self._offsets is None:
            path = self.folder / f"{self.name}.idx"
            self._offsets = np.memmap(path, dtype=np.int64, mode="r", shape=(self.num_docs + 1,))
        return self._offsets

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None, "_offsets": None}


def _build_cache(
    corpus: Corpus, tok: Tokenizer, ids: SpecialIds, folder: Path, num_proc: int | None
) -> None:
    """Tokenize both splits into a temporary folder, then rename it into place."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(folder.parent)
    dtype = np.dtype(
        np.uint16 if tok.get_vocab_size(with_added_tokens=True) <= 2**16 else np.uint32
    )
    prefix = f".{folder.name}.tmp-{socket.gethostname()}-{os.getpid()}-"
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=folder.parent))
    try:
        with files.writing(folder, "token cache"):
            splits = {}
            for name, texts in zip(SPLITS, (corpus.train, corpus.validation)):
                chunks = _encoded_chunks(texts, tok, ids, dtype, num_proc)
                splits[name] = _write_split(chunks, tmp / name)
            meta = {
                "format": CACHE_FORMAT,
                "corpus": corpus.fingerprint,
                "tokenizer": tokenizer_fingerprint(tok),
                "dtype": dtype.name,
                "splits": splits,
            }
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any cache
        os.rename(tmp, folder)
    except OSError:
        if not (folder / "meta.json").is_file():  # else a concurrent builder finished first
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def _remove_stale_builds(cache_dir: Path) -> None:
    """Remove the half-built caches of killed processes of this machine (their PID is gone)."""
    host = socket.gethostname()
    for tmp in cache_dir.glob(f".tokens-*.tmp-{host}-*"):
        pid = tmp.name.rsplit(f".tmp-{host}-", 1)[1].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_split(chunks: Iterable[tuple[np.ndarray, np.ndarray]], stem: Path) -> dict[str, int]:
    """Append each chunk's tokens and offsets to disk: memory stays one chunk deep."""
    total = 0
    docs = 0
    with open(f"{stem}.bin", "wb") as bin_file, open(f"{stem}.idx", "wb") as idx_file:
        np.zeros(1, dtype=np.int64).tofile(idx_file)
        for flat, lengths in chunks:
            flat.tofile(bin_file)
            offsets = total + np.cumsum(lengths, dtype=np.int64)
            offsets.tofile(idx_file)
            total = int(offsets[-1])
            docs += len(lengths)
    return {"tokens": total, "docs": docs}


def _encoded_chunks(
    texts: Iterable[str], tok: Tokenizer, ids: SpecialIds, dtype: np.dtype, num_proc: int | None
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(framed tokens, document lengths) per chunk of documents, in corpus order."""
    it = iter(texts)
    chunks = iter(lambda: list(islice(it, _CHUNK_DOCS)), [])
    if not num_proc or num_proc <= 1:
        encoder = text_encoder(tok)
        for chunk in chunks:
            yield _encode_chunk(encoder, chunk, ids, dtype)
        return
    # Spawned workers: forking a process whose tokenizer threads already ran can deadlock.
    ctx = multiprocessing.get_context("spawn")
    initargs = (tok.to_str(), ids, dtype)
    with ctx.Pool(num_proc, initializer=_init_worker, initargs=initargs) as pool:
        pending: deque = deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_encode_in_worker, (chunk,)))
            if len(pending) >= 2 * num_proc:  # bounded: the corpus may not fit in memory
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _encode_chunk(
    encoder: Tokenizer, texts: list[str], ids: SpecialIds, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    seqs = [e.ids for e in encoder.encode_batch_fast(texts, add_special_tokens=False)]
    lengths = np.array([len(s) + 2 for s in seqs], dtype=np.int64)
    ends = np.cumsum(lengths)
    flat = np.empty(int(ends[-1]), dtype=dtype)
    flat[ends - lengths] = ids.bot
    flat[ends - 1] = ids.eot
    for end, seq in zip(ends.tolist(), seqs):
        flat[end - 1 - len(seq) : end - 1] = seq
    return flat, lengths


_worker: tuple[Tokenizer, SpecialIds, np.dtype] | None = None


def _init_worker(tok_json: str, ids: SpecialIds, dtype: np.dtype) -> None:
    global _worker
    # One process per core already: the tokenizer's own threads would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker = (text_encoder(tok_json), ids, dtype)


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    encoder, ids, dtype = _worker
    return _encode_chunk(encoder, texts, ids, dtype)
