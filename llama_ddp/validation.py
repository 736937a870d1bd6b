"""The run's evaluation component: the validation loss on held-out data, the downstream tasks of
``--eval-tasks`` (evaluate.py), and when to score them."""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from torch import nn

from llama_ddp import distributed as D
from llama_ddp.data import TrainData
from llama_ddp.evaluate import TaskEvaluator
from llama_ddp.loss import batch_loss_sum
from llama_ddp.precision import Precision


class Evaluator:
    """Scores ``model`` every ``every`` steps (from step 0) and after the last step (``due``):
    the mean token loss over the first ``batches`` validation batches, every rank scoring its
    share of each, and the ``tasks`` (if any), their requests shared out over the ranks."""

    def __init__(
        self,
        data: TrainData,
        model: nn.Module,
        precision: Precision,
        rt: D.Runtime,
        *,
        every: int,
        batches: int,
        tasks: TaskEvaluator | None = None,
    ) -> None:
        self.data, self.model, self.precision, self.rt = data, model, precision, rt
        self.every, self.batches, self.tasks = every, batches, tasks

    def due(self, step: int, last: bool) -> bool:
        return last or (self.every > 0 and step % self.every == 0)

    @torch.no_grad()
    def loss(self) -> float | None:
        """Mean token loss of the validation batches (all ranks); None if there are none."""
        self.model.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.rt.device)
        for batch in self.data.validation_batches(self.rt, self.batches):
            totals[0] += batch_loss_sum(self.model, batch.to(self.rt.device), self.precision)
            totals[1] += batch.targets
        self.model.train()
        D.all_reduce_sum(totals, self.rt)
        return (totals[0] / totals[1]).item() if totals[1] > 0 else None

    def record(self, step: int) -> dict[str, Any] | None:
        """The evaluation line of metrics.jsonl for ``step``: the validation loss, and with tasks
        ``"tasks": {task: {"acc", "acc_norm", "n"}}`` and ``tasks_s``, the seconds they took;
        None with neither validation data nor tasks."""
        record: dict[str, Any] = {"step": step}
        val = self.loss()
        if val is not None:
            record.update(val_loss=val, val_perplexity=math.exp(min(val, 50.0)))
        if self.tasks is not None:
            start = time.perf_counter()
            record["tasks"] = self.tasks(self.model, self.rt, self.precision)
            record["tasks_s"] = round(time.perf_counter() - start, 3)
        return record if len(record) > 1 else None
