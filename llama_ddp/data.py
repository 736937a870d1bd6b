"""The training data: pad and pack datasets, the global-batch sampler, loaders, and the builder
that goes from a TrainConfig to batches (corpus -> tokenizer -> token cache -> datasets ->
sampler -> loader), usable without a Trainer.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from torch.utils.data import DataLoader, Dataset, default_collate

from llama_ddp import distributed as D
from llama_ddp.cache import SPLITS, TokenSplit, token_cache
from llama_ddp.config import TrainConfig
from llama_ddp.corpus import Corpus, default_cache_dir, load_splits
from llama_ddp.errors import UserError
from llama_ddp.layout import AttentionPlan, plan_attention
from llama_ddp.loss import IGNORE_INDEX
from llama_ddp.sampler import GlobalBatchSampler
from llama_ddp.tokenizer import (
    SpecialIds,
    SpecialTokens,
    resolve_tokenizer,
    special_ids,
    tokenizer_fingerprint,
)

__all__ = [
    "Batch",
    "GlobalBatchSampler",
    "PackedDataset",
    "PretrainingDataset",
    "TrainData",
    "build_data",
    "build_datasets",
    "make_loader",
]


def build_datasets(
    corpus: Corpus,
    tok: Tokenizer,
    *,
    seq_length: int,
    packing: str,
    cache_dir: Path,
    special: SpecialIds | None = None,
    document_mask: bool = True,
    is_main: bool = True,
    barrier: Callable[[], None] = lambda: None,
    num_proc: int | None = None,
) -> tuple[Dataset, Dataset]:
    """(train, validation) datasets of ``(x, y)`` pairs, cut from the token cache (built if absent;
    see `token_cache` for ``special``, ``is_main``, ``barrier`` and ``num_proc``);
    ``document_mask`` keeps pack mode's documents apart (see `PackedDataset`)."""
    special = special or special_ids(tok)
    folder = token_cache(
        corpus, tok, cache_dir, special=special, is_main=is_main, barrier=barrier, num_proc=num_proc
    )
    out = []
    for name in SPLITS:
        split = TokenSplit(folder, name)
        if packing == "pad":
            ds: Dataset = PretrainingDataset(split, seq_length=seq_length, pad_id=special.pad)
        elif packing == "pack":
            ds = PackedDataset(split, seq_length=seq_length, document_mask=document_mask)
            if len(ds) == 0:
                raise UserError(
                    f"the {name} split has {split.num_tokens} tokens, fewer than one sequence "
                    f"of {seq_length + 1} (use a smaller sequence length or more data)"
                )
        else:
            raise ValueError(f"packing must be 'pad' or 'pack', got {packing!r}")
        out.append(ds)
    return out[0], out[1]


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
    ``x = w[:-1]``, ``y = w[1:]``.

    With ``document_mask``, the model keeps each window's documents apart (`document_ids`) and a
    target that begins another document (the ``[BOT]`` after an ``[EOT]``) is IGNORE_INDEX: every
    document trains exactly as it would alone, as in pad mode. ``dataset[i]`` stays ``(x, y)``;
    the loader reads through ``__getitems__``, whose items add x's document ids."""

    def __init__(self, split: TokenSplit, *, seq_length: int, document_mask: bool = False) -> None:
        self.split = split
        self.seq_length = seq_length
        self.document_mask = document_mask

    def __len__(self) -> int:
        return self.split.num_tokens // (self.seq_length + 1)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y, *_ = self._item(i)
        return x, y

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, ...]]:
        """The loader's batched read: ``(x, y)``, or ``(x, y, document ids of x)``."""
        return [self._item(i) for i in indices]

    def _item(self, i: int) -> tuple[torch.Tensor, ...]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        width = self.seq_length + 1
        w = self.split.tokens[i * width : (i + 1) * width].astype(np.int64)
        if not self.document_mask:
            return torch.from_numpy(w[:-1]), torch.from_numpy(w[1:])
        ids = self.document_ids(i)
        y = torch.from_numpy(w[1:]).masked_fill(ids[1:] != ids[:-1], IGNORE_INDEX)
        return torch.from_numpy(w[:-1]), y, ids[:-1]

    def document_ids(self, i: int) -> torch.Tensor:
        """(seq_length + 1,) the document number of each token of window i, from 0 at its first
        token: a document cut by the window's start continues here as document 0, one cut by its
        end goes on in the next window. From the cache's document offsets, in O(log documents)."""
        width = self.seq_length + 1
        start = i * width
        offsets = self.split.offsets
        # The documents that begin inside the window, after its first token.
        inside = offsets[
            np.searchsorted(offsets, start, side="right") : np.searchsorted(offsets, start + width)
        ]
        ids = np.zeros(width, dtype=np.int64)
        ids[inside - start] = 1
        return torch.from_numpy(np.cumsum(ids))


# Trimmed batches keep a length that is a multiple of this: GPU kernels like aligned shapes, and
# torch.compile sees few distinct lengths.
TRIM_MULTIPLE = 16


@dataclass
class Batch:
    """One micro-batch. ``real`` (pad mode) is the (B, T) bool mask of the positions with a target,
    a prefix of each row; ``document_ids`` (pack mode with document masking) number each row's
    documents. From them the collate function plans the model's attention on the CPU (``plan``,
    layout.py: which tokens it computes, the segments they attend within); ``Batch.to`` moves it
    with the batch, so the model never plans on the device nor waits for it. ``labels`` are the
    targets of the model's output rows in order (``y[real]`` in pad mode, ``y`` flattened
    otherwise); ``targets`` counts the real ones and ``spans`` the spans the tokens attend within
    (their total length and sum of squared lengths, for the FLOPs), all known without the
    device."""

    x: torch.Tensor  # (B, T) input ids
    y: torch.Tensor  # (B, T) next-token targets, IGNORE_INDEX where there is none
    real: torch.Tensor | None
    labels: torch.Tensor
    targets: int
    document_ids: torch.Tensor | None = None  # (B, T), non-decreasing along each row
    spans: tuple[int, int] = (0, 0)
    plan: AttentionPlan | None = None  # None: plain causal rows, every position computed

    @classmethod
    def of(
        cls,
        x: torch.Tensor,
        y: torch.Tensor,
        *,
        padded: bool,
        document_ids: torch.Tensor | None = None,
    ) -> Batch:
        real = y != IGNORE_INDEX
        labels = y[real] if padded else y.flatten()
        mask = real if padded else None
        plan = None
        if padded or document_ids is not None:
            plan = plan_attention(x.shape, mask, document_ids)
            spans = plan.spans
        else:
            spans = (x.numel(), x.shape[0] * x.shape[1] ** 2)  # whole rows
        return cls(x, y, mask, labels, int(real.sum()), document_ids, spans, plan)

    def to(self, device: torch.device) -> Batch:
        """The tensors the model and the loss read, on ``device``: one non-blocking copy each
        (from pinned memory when the loader pins), before the model is called; the rest (the
        masks the plan was made from) stays here."""
        x, labels = (t.to(device, non_blocking=True) for t in (self.x, self.labels))
        plan = None if self.plan is None else self.plan.to(device)
        return dataclasses.replace(self, x=x, labels=labels, plan=plan)

    def pin_memory(self) -> Batch:
        plan = None if self.plan is None else self.plan.pin_memory()
        return dataclasses.replace(
            self, x=self.x.pin_memory(), labels=self.labels.pin_memory(), plan=plan
        )


def make_loader(
    dataset: Dataset,
    sampler: GlobalBatchSampler,
    *,
    num_workers: int = 0,
    pin_memory: bool = False,
    trim: bool = True,
) -> DataLoader:
    """A DataLoader of ``sampler``'s micro-batches as `Batch`es. Pad-mode batches carry their
    ``real`` mask and, with ``trim``, lose their all-padding tail columns (`trim_padding`): a
    batch of short documents costs what its longest document needs, not seq_length."""
    padded = isinstance(dataset, PretrainingDataset)
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=False,
        collate_fn=functools.partial(_collate, padded=padded, trim=trim),
    )


def trim_padding(
    x: torch.Tensor, y: torch.Tensor, multiple: int = TRIM_MULTIPLE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut the columns after the last real target of a right-padded batch (length rounded up to
    ``multiple``). Exact: under causal attention no real token sees a later position, and the cut
    targets are all IGNORE_INDEX, so logits, loss and gradients of the real tokens are unchanged."""
    real = (y != IGNORE_INDEX).any(0)
    if real[-1]:
        return x, y  # a full-length document: nothing to cut
    length = int(real.nonzero().max()) + 1 if real.any() else 1
    length = min(-(-length // multiple) * multiple, y.shape[1])
    return x[:, :length].contiguous(), y[:, :length].contiguous()


def _collate(items: list, *, padded: bool, trim: bool) -> Batch:
    x, y, *document_ids = default_collate(items)
    if padded and trim:
        x, y = trim_padding(x, y)
    return Batch.of(x, y, padded=padded, document_ids=document_ids[0] if document_ids else None)


@dataclass
class TrainData:
    """Everything a run reads: the tokenizer and its roles, the datasets, this rank's sampler and
    loader."""

    tokenizer: Tokenizer
    tokenizer_path: Path
    special: SpecialTokens
    corpus_fingerprint: str
    train: Dataset
    validation: Dataset
    sampler: GlobalBatchSampler
    loader: DataLoader

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def batches(self, start_step: int) -> Iterator[list[Batch]]:
        """Each optimizer step's micro-batches from ``start_step`` on, cycling epochs."""
        epoch, pos = divmod(start_step, self.sampler.steps_per_epoch)
        while True:
            self.sampler.seek(epoch, pos)
            it = iter(self.loader)
            for _ in range(self.sampler.steps_per_epoch - pos):
                yield [next(it) for _ in range(self.sampler.accum_steps)]
            epoch, pos = epoch + 1, 0

    def validation_batches(self, rt: D.Runtime, limit: int) -> Iterator[Batch]:
        """This rank's share of the first ``limit`` validation batches (each of micro batch x
        world size sequences, in order); nothing when the split is smaller than one per rank."""
        per_rank = min(self.sampler.micro_batch, len(self.validation) // rt.world_size)
        if per_rank == 0:
            return iter(())
        sampler = GlobalBatchSampler(
            len(self.validation),
            global_batch=per_rank * rt.world_size,
            micro_batch=per_rank,
            rank=rt.rank,
            world_size=rt.world_size,
            shuffle=False,
        )
        return itertools.islice(make_loader(self.validation, sampler), limit)

    def resume_key(self) -> dict:
        """What decides which tokens optimizer step k trains on, and what they attend to: resuming
        needs all of it equal (saved in every checkpoint's settings)."""
        packed = isinstance(self.train, PackedDataset)
        return {
            "corpus": self.corpus_fingerprint,
            "tokenizer": tokenizer_fingerprint(self.tokenizer),
            "special_tokens": self.special.names(),
            "seq_length": self.train.seq_length,
            "packing": "pack" if packed else "pad",
            "document_mask": self.train.document_mask if packed else None,  # pad: not a choice
            "batch_size": self.sampler.global_batch,
            "seed": self.sampler.seed,
        }


def build_data(cfg: TrainConfig, rt: D.Runtime) -> TrainData:
    """corpus -> tokenizer -> token cache -> datasets -> sampler -> loader, for this rank.
    Caches are per machine: local rank 0 builds them while the machine's other ranks wait."""
    cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
    corpus = load_splits(
        cfg.dataset,
        config=cfg.dataset_config,
        split=cfg.split,
        text_column=cfg.text_column,
        streaming=cfg.streaming,
        val_fraction=cfg.val_fraction,
        cache_dir=cache_dir,
    )
    is_main, barrier = rt.local_rank == 0, functools.partial(D.preparation_barrier, rt)
    tok, special, tok_path = resolve_tokenizer(
        cfg.tokenizer, corpus, cfg.vocab_size, cache_dir, is_main=is_main, barrier=barrier
    )
    train, validation = build_datasets(
        corpus,
        tok,
        seq_length=cfg.seq_length,
        packing=cfg.packing,
        cache_dir=cache_dir,
        special=special.ids,
        document_mask=cfg.document_mask,
        is_main=is_main,
        barrier=barrier,
    )
    sampler = GlobalBatchSampler(
        len(train),
        global_batch=cfg.batch_size,
        micro_batch=cfg.micro_batch(rt.world_size),
        rank=rt.rank,
        world_size=rt.world_size,
        seed=cfg.seed,
    )
    pin = rt.device.type == "cuda"
    loader = make_loader(train, sampler, num_workers=cfg.num_workers, pin_memory=pin)
    return TrainData(tok, tok_path, special, corpus.fingerprint, train, validation, sampler, loader)
