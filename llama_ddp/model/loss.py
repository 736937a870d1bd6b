"""The training objective: the summed next-token cross-entropy of a batch's real targets.

A target equal to IGNORE_INDEX (padding, the first token of another document in a packed window,
the padding of a perplexity window) adds nothing to the loss and is not counted. The trainer
divides the sum by the real targets of the whole global batch (see trainer.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from llama_ddp.attention_plan.plan import IGNORE_INDEX

if TYPE_CHECKING:
    from llama_ddp.precision import Precision


class Scored(Protocol):
    """What the loss reads of a batch (batch.Batch; a target is attention_plan/plan.py's
    IGNORE_INDEX where there is none): the inputs, their attention plan, and the targets of the
    rows the model outputs."""

    x: torch.Tensor
    plan: Any
    labels: torch.Tensor
    rows: torch.Tensor | None  # the output rows scored (evaluation); None: every row


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of ``logits`` (..., V), in fp32, against ``labels`` (one per logits
    row, IGNORE_INDEX where there is no target)."""
    logits = logits.flatten(0, -2)  # (N, V): one row per label
    return F.cross_entropy(
        logits.float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def batch_loss_sum(model: nn.Module, batch: Scored, precision: Precision) -> torch.Tensor:
    """Summed next-token loss of a batch's real targets, the forward under the run's autocast.
    The batch's attention plan, already on the model's device, tells the model which positions
    it computes (pad mode: the real ones) and the spans they attend within (documents); its
    ``rows``, where given, the positions that get logits (those with a target)."""
    scored = {} if batch.rows is None else {"rows": batch.rows}  # training: the wrapper's call
    with precision.autocast():
        logits = model(batch.x, plan=batch.plan, **scored)
    return token_loss_sum(logits, batch.labels)
