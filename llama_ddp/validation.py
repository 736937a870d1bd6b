"""The run's evaluation component: the validation loss on held-out data, and when to score it.

Validation scores every held-out token, whatever the packing: each document alone
(``[BOT] tokens [EOT]``), each token with all of its document's earlier tokens up to the sequence
length, in the windows of `windows.document_windows` (never padded to the sequence length).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from llama_ddp import distributed as D
from llama_ddp.data import Batch, TrainData
from llama_ddp.loss import IGNORE_INDEX, batch_loss_sum
from llama_ddp.precision import Precision
from llama_ddp.windows import document_windows, window_rows


class Evaluator:
    """Scores ``model`` every ``every`` steps (from step 0) and after the last step (``due``):
    the mean token loss over the validation windows (`validation_batches`: all of them, or the
    first ``batches`` global batches), every rank scoring its share of each."""

    def __init__(
        self,
        data: TrainData,
        model: nn.Module,
        precision: Precision,
        rt: D.Runtime,
        *,
        every: int,
        batches: int | None = None,
    ) -> None:
        self.data, self.model, self.precision, self.rt = data, model, precision, rt
        self.every, self.batches = every, batches
        self._windows: np.ndarray | None = None  # made at the first evaluation

    def due(self, step: int, last: bool) -> bool:
        return last or (self.every > 0 and step % self.every == 0)

    @torch.no_grad()
    def loss(self) -> float | None:
        """Mean token loss of the validation batches (all ranks); None if there are none."""
        self.model.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.rt.device)
        if self._windows is None:
            self._windows = validation_windows(self.data)
        for batch in validation_batches(self.data, self.rt, self.batches, self._windows):
            totals[0] += batch_loss_sum(self.model, batch.to(self.rt.device), self.precision)
            totals[1] += batch.targets
        self.model.train()
        D.all_reduce_sum(totals, self.rt)
        return (totals[0] / totals[1]).item() if totals[1] > 0 else None

    def record(self, step: int) -> dict[str, Any] | None:
        """The evaluation line of metrics.jsonl for ``step``; None without validation data."""
        val = self.loss()
        if val is None:
            return None
        return {"step": step, "val_loss": val, "val_perplexity": math.exp(min(val, 50.0))}


def validation_windows(data: TrainData) -> np.ndarray:
    """(W, 3) the windows scoring the validation split (`windows.document_windows`)."""
    return document_windows(data.validation.split.offsets, data.train.seq_length)


def validation_batches(
    data: TrainData,
    rt: D.Runtime,
    limit: int | None = None,
    spans: np.ndarray | None = None,
) -> Iterator[Batch]:
    """This rank's share of the validation windows (``spans``, by default
    `validation_windows`): global batches of --batch-size windows in document order (the first
    ``limit`` of them; all by default), each split over the ranks as a training batch is
    (micro-batches of micro_batch windows), the last one too. Every rank yields as many batches
    (FSDP's forwards are collective): one short of windows yields a one-token batch with no
    target. The mean loss is the same at every world size."""
    spans = validation_windows(data) if spans is None else spans
    sampler, tokens = data.sampler, data.validation.split.tokens
    per_rank = sampler.global_batch // rt.world_size
    steps = -(-len(spans) // sampler.global_batch)
    for step in range(min(steps, limit) if limit else steps):
        mine = step * sampler.global_batch + rt.rank * per_rank
        for micro in range(mine, mine + per_rank, sampler.micro_batch):
            rows = spans[micro : min(micro + sampler.micro_batch, mine + per_rank)]
            yield window_batch(tokens, rows, data.train.seq_length)


def window_batch(tokens: np.ndarray, spans: np.ndarray, seq_length: int) -> Batch:
    """Windows as rows computed on their real positions only, each attending within itself
    (a one-token row without a target when there are none)."""
    if len(spans) == 0:
        x, y = torch.zeros(1, 1, dtype=torch.long), torch.full((1, 1), IGNORE_INDEX)
        real = torch.ones(1, 1, dtype=torch.bool)
    else:
        x, y, real = window_rows(tokens, spans, limit=seq_length)
    rows = torch.zeros(x.shape, dtype=torch.long)  # one document per row
    return Batch.of(x, y, padded=True, document_ids=rows, real=real)
