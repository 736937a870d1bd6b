"""Pre-tokenization cache, the pad and pack datasets, the global-batch sampler and the loader.

The corpus is tokenized once, in batches, into ``cache_dir/tokens-<key>/``: per split a flat
token array (``<split>.bin``, every document stored as ``[BOT] + tokens + [EOT]``) and the int64
document offsets into it (``<split>.idx``, one more than the number of documents). The key hashes
the corpus and tokenizer fingerprints only, so one cache serves every sequence length and both
packing modes: the datasets cut their items out of the memory-mapped arrays when read.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import tempfile
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from llama_ddp.corpus import Corpus
from llama_ddp.errors import UserError
from llama_ddp.tokenizer import (
    IGNORE_INDEX,
    SpecialIds,
    special_ids,
    text_encoder,
    tokenizer_fingerprint,
)

# Bump when the cache layout or the document framing changes, so old caches are not reused.
CACHE_FORMAT = 1
_CHUNK_DOCS = 1000
_SPLITS = ("train", "validation")


def cache_key(corpus: Corpus, tok: Tokenizer) -> str:
    """The token cache's name: the data and the tokenizer, not the sequence settings."""
    fields = [CACHE_FORMAT, corpus.fingerprint, tokenizer_fingerprint(tok)]
    return hashlib.sha256(json.dumps(fields).encode()).hexdigest()[:20]


def build_datasets(
    corpus: Corpus,
    tok: Tokenizer,
    *,
    seq_length: int,
    packing: str,
    cache_dir: Path,
    is_main: bool = True,
    barrier: Callable[[], None] = lambda: None,
    num_proc: int | None = None,
) -> tuple[Dataset, Dataset]:
    """(train, validation) datasets of ``(x, y)`` pairs, from the token cache (built if absent).

    Under torchrun, pass ``is_main`` true on one process per machine sharing ``cache_dir`` and a
    barrier: that process builds the cache while the others wait, then all memory-map it.
    ``num_proc`` > 1 tokenizes in that many worker processes; the default tokenizes in this
    process, where the Rust tokenizer already uses every core (faster on small machines).
    """
    if packing not in ("pad", "pack"):
        raise UserError(f"packing must be 'pad' or 'pack', got {packing!r}")
    if seq_length < 1:
        raise UserError(f"sequence length must be positive, got {seq_length}")
    ids = special_ids(tok)
    folder = Path(cache_dir) / f"tokens-{cache_key(corpus, tok)}"
    if is_main and not (folder / "meta.json").is_file():
        _build_cache(corpus, tok, ids, folder, num_proc)
    barrier()
    if not (folder / "meta.json").is_file():
        raise UserError(
            f"token cache {folder} is missing after the main process built it "
            "(the cache folder must be shared by all processes of a machine; set --cache-dir)"
        )
    out = []
    for name in _SPLITS:
        split = TokenSplit(folder, name)
        if packing == "pad":
            ds: Dataset = PretrainingDataset(split, seq_length=seq_length, pad_id=ids.pad)
        else:
            ds = PackedDataset(split, seq_length=seq_length)
            if len(ds) == 0:
                raise UserError(
                    f"the {name} split has {split.num_tokens} tokens, fewer than one sequence "
                    f"of {seq_length + 1} (use a smaller sequence length or more data)"
                )
        out.append(ds)
    return out[0], out[1]


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


class PretrainingDataset(Dataset):
    """Pad mode: item i is document i as ``[BOT] + tokens + [EOT]``, clipped to seq_length + 1
    tokens and right-padded with ``[PAD]``; ``x = t[:-1]``, ``y = t[1:]`` with PAD targets set to
    IGNORE_INDEX. A clipped document loses its tail and its ``[EOT]``."""

    def __init__(self, split: TokenSplit, *, seq_length: int, pad_id: int) -> None:
        self.split = split
        self.seq_length = seq_length
        self.pad_id = pad_id

    def __len__(self) -> int:
        return self.split.num_docs

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        offsets = self.split.offsets
        start = int(offsets[i])
        n = min(int(offsets[i + 1]) - start, self.seq_length + 1)
        t = np.full(self.seq_length + 1, self.pad_id, dtype=np.int64)
        t[:n] = self.split.tokens[start : start + n]
        y = t[1:].copy()
        y[n - 1 :] = IGNORE_INDEX  # y[k] is t[k + 1], which is padding from k = n - 1 on
        return torch.from_numpy(t[:-1]), torch.from_numpy(y)


class PackedDataset(Dataset):
    """Pack mode: the split's token stream (documents with their BOT/EOT, back to back) cut into
    non-overlapping windows of seq_length + 1 tokens, the incomplete tail dropped;
    ``x = w[:-1]``, ``y = w[1:]``."""

    def __init__(self, split: TokenSplit, *, seq_length: int) -> None:
        self.split = split
        self.seq_length = seq_length

    def __len__(self) -> int:
        return self.split.num_tokens // (self.seq_length + 1)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        width = self.seq_length + 1
        w = self.split.tokens[i * width : (i + 1) * width].astype(np.int64)
        return torch.from_numpy(w[:-1]), torch.from_numpy(w[1:])


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields this rank's micro-batches so that every world size trains on the same global batches.

    Epoch e visits ``randperm(num_samples, seed + e)``; optimizer step g takes the global batch
    ``order[g*B:(g+1)*B]``; micro-batch j of rank r in that step is the slice starting at
    ``(j*world_size + r) * micro_batch``. The incomplete last global batch is dropped.

    ``set_epoch(e)`` moves to the start of epoch e (a no-op when already in e, so a restored
    position survives the trainer's usual ``set_epoch`` call); a completed pass moves to the next
    epoch. ``state_dict()`` is the next step to hand out. A DataLoader with workers draws ahead of
    training, so a trainer using workers should save its own count of finished steps instead.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        global_batch: int,
        micro_batch: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if micro_batch < 1 or global_batch < 1:
            raise UserError(
                f"batch sizes must be positive, got global {global_batch}, micro {micro_batch}"
            )
        if not 0 <= rank < world_size:
            raise UserError(f"rank {rank} is outside world size {world_size}")
        per_pass = micro_batch * world_size
        if global_batch % per_pass:
            raise UserError(
                f"global batch {global_batch} is not a multiple of micro batch {micro_batch} x "
                f"world size {world_size} = {per_pass} (choose a batch size that is a multiple "
                f"of {per_pass}, or another micro batch size)"
            )
        if num_samples < global_batch:
            raise UserError(
                f"dataset has {num_samples} sequences, fewer than one global batch of "
                f"{global_batch} (lower the batch size or use more data)"
            )
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.accum_steps = global_batch // per_pass
        self.steps_per_epoch = num_samples // global_batch
        self.epoch = 0
        self.step = 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch = epoch
            self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        step = int(state["step"])
        if not 0 <= step <= self.steps_per_epoch:
            raise UserError(
                f"sampler state step {step} is outside an epoch of {self.steps_per_epoch} steps "
                "(resume with the batch size and data the checkpoint was trained with)"
            )
        self.epoch = int(state["epoch"])
        self.step = step
        if step == self.steps_per_epoch:  # saved after an epoch's last step: next epoch
            self.epoch += 1
            self.step = 0

    def global_batch_indices(self, epoch: int, step: int) -> list[int]:
        """The B sample indices of optimizer step ``step`` in ``epoch``, for any rank."""
        order = self._order(epoch)
        return order[step * self.global_batch : (step + 1) * self.global_batch].tolist()

    def _order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=generator)

    def __iter__(self) -> Iterator[list[int]]:
        order = self._order(self.epoch)
        micro = self.micro_batch
        for g in range(self.step, self.steps_per_epoch):
            batch = order[g * self.global_batch : (g + 1) * self.global_batch]
            for j in range(self.accum_steps):
                if j == self.accum_steps - 1:
                    self.step = g + 1  # set before the yield: the caller may save state now
                start = (j * self.world_size + self.rank) * micro
                yield batch[start : start + micro].tolist()
        self.epoch += 1
        self.step = 0

    def __len__(self) -> int:
        return (self.steps_per_epoch - self.step) * self.accum_steps


# Trimmed batches keep a length that is a multiple of this: GPU kernels like aligned shapes, and
# torch.compile sees few distinct lengths.
TRIM_MULTIPLE = 16


def make_loader(
    dataset: Dataset,
    sampler: GlobalBatchSampler,
    *,
    num_workers: int = 0,
    pin_memory: bool = False,
    trim: bool = True,
) -> DataLoader:
    """A DataLoader over ``sampler``'s micro-batches of stacked (x, y). With ``trim``, a batch's
    all-padding tail columns are cut off (`trim_padding`): a pad-mode batch of short documents
    costs what its longest document needs, not seq_length."""
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=False,
        collate_fn=_collate_trimmed if trim else None,
    )


def trim_padding(
    x: torch.Tensor, y: torch.Tensor, multiple: int = TRIM_MULTIPLE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut the columns after the last real target of a right-padded batch (length rounded up to
    ``multiple``). Exact: under causal attention no real token sees a later position, and the cut
    targets are all IGNORE_INDEX, so logits, loss and gradients of the real tokens are unchanged."""
    real = (y != IGNORE_INDEX).any(0)
    if real[-1]:
        return x, y  # pack mode, or a full-length document: nothing to cut
    length = int(real.nonzero().max()) + 1 if real.any() else 1
    length = min(-(-length // multiple) * multiple, y.shape[1])
    return x[:, :length].contiguous(), y[:, :length].contiguous()


def _collate_trimmed(items: list) -> tuple[torch.Tensor, torch.Tensor]:
    return trim_padding(*default_collate(items))


def _build_cache(
    corpus: Corpus, tok: Tokenizer, ids: SpecialIds, folder: Path, num_proc: int | None
) -> None:
    """Tokenize both splits into a temporary folder, then rename it into place."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(
        np.uint16 if tok.get_vocab_size(with_added_tokens=True) <= 2**16 else np.uint32
    )
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        splits = {}
        for name, texts in zip(_SPLITS, (corpus.train, corpus.validation)):
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
