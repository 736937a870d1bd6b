"""The run's evaluation component: the validation loss on held-out data (each source's, for a
mixture), and when to score it."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from llama_ddp import distributed as D
from llama_ddp.data import TrainData
from llama_ddp.loss import batch_loss_sum
from llama_ddp.precision import Precision


class Evaluator:
    """Scores ``model`` every ``every`` steps (from step 0) and after the last step (``due``):
    the mean token loss over the first ``batches`` validation batches of each source, every rank
    scoring its share of each."""

    def __init__(
        self,
        data: TrainData,
        model: nn.Module,
        precision: Precision,
        rt: D.Runtime,
        *,
        every: int,
        batches: int,
    ) -> None:
        self.data, self.model, self.precision, self.rt = data, model, precision, rt
        self.every, self.batches = every, batches

    def due(self, step: int, last: bool) -> bool:
        return last or (self.every > 0 and step % self.every == 0)

    @torch.no_grad()
    def loss(self, source: str | None = None) -> float | None:
        """Mean token loss of the validation batches of ``source`` (default: the first; all
        ranks); None if there are none."""
        self.model.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.rt.device)
        for batch in self.data.validation_batches(self.rt, self.batches, source):
            totals[0] += batch_loss_sum(self.model, batch.to(self.rt.device), self.precision)
            totals[1] += batch.targets
        self.model.train()
        D.all_reduce_sum(totals, self.rt)
        return (totals[0] / totals[1]).item() if totals[1] > 0 else None

    def record(self, step: int) -> dict[str, Any] | None:
        """The evaluation line of metrics.jsonl for ``step``; None without validation data."""
        losses = {name: self.loss(name) for name in self.data.names}
        record = validation_record(losses, dict(zip(self.data.names, self.data.weights())))
        return None if record is None else {"step": step, **record}


def validation_record(losses: dict[str, float | None], weights: dict[str, float]) -> dict | None:
    """An evaluation's metrics from each source's validation loss (None: nothing to score):
    their mean by weight, its perplexity and, with several sources, each one's."""
    scored = {name: loss for name, loss in losses.items() if loss is not None}
    if not scored:
        return None
    val = sum(weights[n] * loss for n, loss in scored.items()) / sum(map(weights.get, scored))
    record = {"val_loss": val, "val_perplexity": math.exp(min(val, 50.0))}
    return {**record, "val_loss_by_source": scored} if len(losses) > 1 else record
