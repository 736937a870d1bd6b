"""The token cache's worker processes: each tokenizes whole shards (`write_shard`) with its own
encoder, at a lower priority than training, and exits when its parent does. build.py hands them
the shards; builder.py runs the builder itself in the background the same way.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from llama_ddp.data.tokenizer import text_encoder
from llama_ddp.data.tokenizer_files import SpecialIds
from llama_ddp.files import safe_io

_CHUNK_DOCS = 1000  # documents tokenized at once: memory stays one chunk of encodings deep


# ----------------------------------------------------------------------------- writing a shard

_encoder: tuple[Tokenizer, SpecialIds] | None = None


def init_encoder(tok_json: str, ids: SpecialIds) -> None:
    global _encoder
    _encoder = (text_encoder(tok_json), ids)


def init_worker(tok_json: str, ids: SpecialIds, parent: int) -> None:
    # One process per core already: the tokenizer's own threads would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the run's to handle
    lower_priority()
    exit_with_parent(parent)
    init_encoder(tok_json, ids)


def write_shard(texts: list[str], stem: Path, dtype: str, delay: float = 0.0) -> None:
    """Tokenize ``texts`` (with the encoder of this process) into shard ``stem``: the .bin, then
    the .idx, each written under a temporary name and renamed into place."""
    time.sleep(delay)
    encoder, ids = _encoder
    tmp = f".tmp-{socket.gethostname()}-{os.getpid()}"
    paths = [stem.with_name(f"{stem.name}.{kind}") for kind in ("bin", "idx")]
    temps = [p.with_name(p.name + tmp) for p in paths]
    try:
        with safe_io.writing(paths[0], "token cache"):
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


# ----------------------------------------------------------------------------- processes


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


def lower_priority() -> None:
    """Tokenize at a lower priority than training (nice 10): on a machine short of cores the
    training process keeps its own, and the builder takes what is left."""
    with contextlib.suppress(OSError):
        os.nice(10)
