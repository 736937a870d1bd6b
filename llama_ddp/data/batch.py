"""What training reads, one sequence at a time and one micro-batch at a time: the pad-mode and
pack-mode items of a token cache shard, the `Batch` they collate into, the loader, and the
`Prefetcher` that reads it a step ahead.

The next step's batch ready before this step ends: `Prefetcher` takes each optimizer step's
micro-batches from the loader in a thread of its own (sampling, collating, planning the
attention) and, on CUDA, copies them to the device from pinned memory on a side stream, while the
training step runs on the default stream.

What the loop consumes is exactly what the loader yields, in order: the data position a
checkpoint saves is the trainer's step (the batches consumed), never how far the thread has read
ahead, so a run resumed from a checkpoint sees the same batches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from llama_ddp.attention_plan.plan import IGNORE_INDEX, AttentionPlan, plan_attention
from llama_ddp.data.cache.read import TokenShard


class PretrainingDataset(Dataset):
    """Pad mode: item i is the shard's document i as ``[BOT] + tokens + [EOT]``, clipped to
    seq_length + 1 tokens and right-padded with ``[PAD]``; ``x = t[:-1]``, ``y = t[1:]`` with PAD
    targets set to IGNORE_INDEX. A clipped document loses its tail and its ``[EOT]``."""

    def __init__(self, split: TokenShard, *, seq_length: int, pad_id: int) -> None:
        self.split = split
        self.seq_length = seq_length
        self.pad_id = pad_id

    def __len__(self) -> int:
        return self.split.num_docs

    def length(self, i: int) -> int:
        """Tokens of item i before its padding."""
        offsets = self.split.offsets
        return min(int(offsets[i + 1] - offsets[i]), self.seq_length + 1)

    def targets(self, i: int) -> int:
        """Targets the loss counts in item i."""
        return self.length(i) - 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        start, n = int(self.split.offsets[i]), self.length(i)
        t = np.full(self.seq_length + 1, self.pad_id, dtype=np.int64)
        t[:n] = self.split.tokens[start : start + n]
        y = t[1:].copy()
        y[n - 1 :] = IGNORE_INDEX  # y[k] is t[k + 1], which is padding from k = n - 1 on
        return torch.from_numpy(t[:-1]), torch.from_numpy(y)


class PackedDataset(Dataset):
    """Pack mode: the shard's token stream (documents with their BOT/EOT, back to back) cut into
    non-overlapping windows of seq_length + 1 tokens, the incomplete tail dropped;
    ``x = w[:-1]``, ``y = w[1:]``.

    With ``document_mask``, the model keeps each window's documents apart (`document_ids`) and a
    target that begins another document (the ``[BOT]`` after an ``[EOT]``) is IGNORE_INDEX: every
    document trains exactly as it would alone, as in pad mode. ``dataset[i]`` stays ``(x, y)``;
    the loader reads through ``__getitems__``, whose items add x's document ids."""

    def __init__(self, split: TokenShard, *, seq_length: int, document_mask: bool = False) -> None:
        self.split = split
        self.seq_length = seq_length
        self.document_mask = document_mask

    def __len__(self) -> int:
        return self.split.num_tokens // (self.seq_length + 1)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y, *_ = self._item(i)
        return x, y

    def targets(self, i: int) -> int:
        """Targets the loss counts in window i: all but those that begin another document."""
        if not self.document_mask:
            return self.seq_length
        width, offsets = self.seq_length + 1, self.split.offsets
        start = i * width  # documents beginning at its positions 1 .. seq_length
        inside = np.searchsorted(offsets, start + width) - np.searchsorted(offsets, start, "right")
        return self.seq_length - int(inside)

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
    """One micro-batch. ``computed`` (pad mode) is the (B, T) bool mask of the positions the model
    computes (those with a target, unless `Batch.of` is told otherwise), a prefix of each row;
    ``document_ids`` (pack mode with document masking) number each row's documents. From them the
    collate function plans the model's attention on the CPU (``plan``, plan.py: which tokens it
    computes, the segments they attend within); ``Batch.to`` moves it with the batch, so the model
    never plans on the device nor waits for it. ``labels`` are the targets of the model's output
    rows in order (``y[computed]`` in pad mode, ``y`` flattened otherwise); ``targets`` counts those
    that are not IGNORE_INDEX and ``spans`` the spans the tokens attend within (their total length
    and sum of squared lengths, for the FLOPs), all known without the device. A batch made
    ``scored_only`` (evaluation's) also carries ``rows``, the output rows with a target: the
    model computes the logits of those only, and ``labels`` are theirs."""

    x: torch.Tensor  # (B, T) input ids
    y: torch.Tensor  # (B, T) next-token targets, IGNORE_INDEX where there is none
    computed: torch.Tensor | None
    labels: torch.Tensor
    targets: int
    document_ids: torch.Tensor | None = None  # (B, T), non-decreasing along each row
    spans: tuple[int, int] = (0, 0)
    plan: AttentionPlan | None = None  # None: plain causal rows, every position computed
    rows: torch.Tensor | None = None  # (R,) the output rows the loss scores; None: all

    @classmethod
    def of(
        cls,
        x: torch.Tensor,
        y: torch.Tensor,
        *,
        padded: bool,
        document_ids: torch.Tensor | None = None,
        computed: torch.Tensor | None = None,
        scored_only: bool = False,
    ) -> Batch:
        """A padded batch computes the positions with a target, or ``computed`` when given (a
        validation window's context has inputs but no scored target); ``scored_only``: the
        logits of the positions with a target only (``rows``)."""
        targets = y != IGNORE_INDEX
        mask = (targets if computed is None else computed) if padded else None
        labels = y[mask] if padded else y.flatten()
        rows = (labels != IGNORE_INDEX).nonzero().flatten() if scored_only else None
        labels = labels if rows is None else labels[rows]
        plan = None
        if padded or document_ids is not None:
            plan = plan_attention(x.shape, mask, document_ids)
            spans = plan.spans
        else:
            spans = (x.numel(), x.shape[0] * x.shape[1] ** 2)  # whole rows
        return cls(x, y, mask, labels, int(targets.sum()), document_ids, spans, plan, rows)

    def to(self, device: torch.device) -> Batch:
        """The tensors the model and the loss read, on ``device``: one non-blocking copy each
        (from pinned memory when the loader pins), before the model is called; the rest (the
        masks the plan was made from) stays here."""
        x, labels = (t.to(device, non_blocking=True) for t in (self.x, self.labels))
        plan = None if self.plan is None else self.plan.to(device)
        rows = None if self.rows is None else self.rows.to(device, non_blocking=True)
        return dataclasses.replace(self, x=x, labels=labels, plan=plan, rows=rows)

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Mark the device tensors `to` made as used on ``stream`` (they were copied on
        another): the caching allocator then reuses their memory only once ``stream`` is done."""
        for t in (self.x, self.labels, self.rows):
            if t is not None:
                t.record_stream(stream)
        if self.plan is not None:
            self.plan.record_stream(stream)

    def pin_memory(self) -> Batch:
        plan = None if self.plan is None else self.plan.pin_memory()
        rows = None if self.rows is None else self.rows.pin_memory()
        return dataclasses.replace(
            self, x=self.x.pin_memory(), labels=self.labels.pin_memory(), plan=plan, rows=rows
        )


def make_loader(
    dataset: Dataset,
    sampler: Sampler,
    *,
    num_workers: int = 0,
    pin_memory: bool = False,
    trim: bool = True,
    padded: bool | None = None,
) -> DataLoader:
    """A DataLoader of ``sampler``'s micro-batches as `Batch`es. Pad-mode batches (``padded``;
    default: ``dataset`` is a `PretrainingDataset`) carry their ``computed`` mask and, with
    ``trim``, lose their all-padding tail columns (`trim_padding`): a batch of short documents costs
    what its longest document needs, not seq_length."""
    if padded is None:
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
    has_target = (y != IGNORE_INDEX).any(0)
    if has_target[-1]:
        return x, y  # a full-length document: nothing to cut
    length = int(has_target.nonzero().max()) + 1 if has_target.any() else 1
    length = min(-(-length // multiple) * multiple, y.shape[1])
    return x[:, :length].contiguous(), y[:, :length].contiguous()


def _collate(items: list, *, padded: bool, trim: bool) -> Batch:
    x, y, *document_ids = default_collate(items)
    if padded and trim:
        x, y = trim_padding(x, y)
    return Batch.of(x, y, padded=padded, document_ids=document_ids[0] if document_ids else None)


class _Failed:
    """What the thread hands over in place of a batch when the loader raised."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class Prefetcher:
    """Iterates over ``batches`` (each step's micro-batches) ``depth`` steps ahead of the loop, on
    ``device``. An error of the loader (a broken data file, a stopped cache builder) is raised by
    the ``next`` that would have returned its batch. ``close`` stops the thread."""

    def __init__(
        self, batches: Iterator[list[Batch]], device: torch.device, depth: int = 1
    ) -> None:
        self.batches, self.device = batches, torch.device(device)
        cuda = self.device.type == "cuda"
        if cuda and self.device.index is None:  # the thread sets it as its current device
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stopping = threading.Event()
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self.thread = threading.Thread(target=self._fill, name="llama_ddp-prefetch", daemon=True)
        self.thread.start()

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> list[Batch]:
        item = self.queue.get()
        if isinstance(item, _Failed):
            raise item.error
        micro_batches, ready = item
        if ready is not None:  # the copies were queued on the side stream: wait there, not here
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(ready)
            for batch in micro_batches:  # memory the side stream allocated, used on this one
                batch.record_stream(stream)
        return micro_batches

    def close(self) -> None:
        """Stop the thread. One still inside the loader (waiting for a shard the cache builder
        has yet to write) is not waited for: it stops once its batch is made, and dies with the
        process, which it never holds up (a daemon)."""
        self.stopping.set()
        with contextlib.suppress(queue.Empty):  # a thread waiting to hand over a batch sees it
            self.queue.get_nowait()
        self.thread.join(timeout=1.0)

    def _fill(self) -> None:
        if self.stream is not None:
            torch.cuda.set_device(self.device)  # the loader pins memory in this thread
        try:
            for micro_batches in self.batches:
                if not self._hand_over(self._moved(micro_batches)):
                    return
            self._hand_over(_Failed(StopIteration()))
        except BaseException as exc:  # handed to the loop, which raises it
            self._hand_over(_Failed(exc))

    def _hand_over(self, item: object) -> bool:
        """Put ``item`` in the queue once there is room; False if the loop stopped first."""
        while not self.stopping.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _moved(self, micro_batches: list[Batch]) -> tuple[list[Batch], torch.cuda.Event | None]:
        """The micro-batches on the device, and the event their copies complete at (None on the
        CPU, where there is nothing to copy)."""
        if self.stream is None:
            return micro_batches, None
        with torch.cuda.stream(self.stream):
            moved = [b.pin_memory().to(self.device) for b in micro_batches]
            ready = torch.cuda.Event()
            ready.record(self.stream)
        return moved, ready
