"""The run's evaluation component and its settings (EvalSettings: --eval-every ... --eval-limit):
the validation loss and bits per byte on held-out data (each source's, for a
mixture), the downstream tasks of ``--eval-tasks`` (evaluate.py), and when to score them.

Validation scores held-out tokens the same way whatever the packing: each document alone
(``[BOT] tokens [EOT]``), each token with all of its document's earlier tokens up to the sequence
length, in the windows of `windows.document_windows` (never padded to the sequence length). An
evaluation scores a fixed budget of them (`budget_windows`: the same windows at every evaluation,
world size and resume), or every one.
"""

from __future__ import annotations

import bisect
import itertools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from llama_ddp.attention_plan.plan import IGNORE_INDEX
from llama_ddp.data.batch import Batch
from llama_ddp.data.cache.read import ShardedSplit
from llama_ddp.data.pipeline import TrainData
from llama_ddp.data.tokenizer import token_bytes
from llama_ddp.distributed import runtime as D
from llama_ddp.errors import UserError
from llama_ddp.eval.perplexity import bits_per_byte
from llama_ddp.eval.scoring import TaskEvaluator
from llama_ddp.eval.tasks import TASKS, TaskSpec, parse_tasks
from llama_ddp.eval.windows import document_windows, window_batch
from llama_ddp.model.loss import batch_loss_sum
from llama_ddp.precision import Precision
from llama_ddp.settings import Settings, setting

# --eval-tokens' default and its cost: the windows scoring 32,768 tokens of the sample corpus
# compute ~64k positions forward (their context too) and the lm_head at the scored ones, about
# two training steps of the small preset at batch 32 x 256 (docs/benchmarks-history.md, issue 31).
EVAL_TOKENS = 32768


@dataclass
class EvalSettings(Settings):
    """When the run evaluates and what: the held-out budget and the --eval-tasks."""

    eval_every: int = setting(
        0, "evaluate every N steps (and always at the end); 0: only at the end"
    )
    eval_tokens: str = setting(
        str(EVAL_TOKENS),
        "held-out tokens each evaluation scores: a fixed sample of the validation windows, the "
        "same at every evaluation, world size and resume (`all`: every held-out token, whose "
        "cost grows with the corpus up to 2,000 documents). The default costs about two "
        "training steps of the small preset at batch 32 x 256 (at --eval-every 40: ~5 percent "
        "of the training time)",
    )
    eval_tasks: str | None = setting(
        None,
        f"comma list of multiple-choice tasks scored at each evaluation: {', '.join(TASKS)}, "
        "NAME=PATH (a hub task's local copy) or a .jsonl file (one {context, choices, label} "
        "per line)",
    )
    eval_limit: int = setting(500, "examples of each --eval-tasks task scored (its first N)")

    def check(self) -> None:
        self.positive("eval_limit")
        self.non_negative("eval_every")
        self.budget()
        self.task_specs()  # task names and files exist; their lines are read by build_trainer

    def task_specs(self) -> list[TaskSpec]:
        """The tasks of --eval-tasks (tasks.py), checked without reading their data."""
        return parse_tasks(self.eval_tasks)

    def budget(self) -> int | None:
        """The held-out tokens an evaluation scores (--eval-tokens); None: all of them."""
        if self.eval_tokens == "all":
            return None
        try:
            tokens = int(self.eval_tokens)
        except ValueError:
            tokens = 0
        if tokens <= 0:
            raise UserError(
                f"--eval-tokens must be a positive number or `all`, got {self.eval_tokens!r}"
            )
        return tokens


class Evaluator:
    """Scores ``model`` every ``every`` steps (from step 0) and after the last step (``due``):
    the mean token loss over each source's validation windows (`budget_windows`: those scoring
    about ``tokens`` held-out tokens, or all of them with None; `validation_batches`), every rank
    scoring its share of each, and the ``tasks`` (if any), their requests shared out over the
    ranks."""

    def __init__(
        self,
        data: TrainData,
        model: nn.Module,
        precision: Precision,
        rt: D.Runtime,
        *,
        every: int,
        tokens: int | None = None,
        tasks: TaskEvaluator | None = None,
    ) -> None:
        self.data, self.model, self.precision, self.rt = data, model, precision, rt
        self.every, self.tokens, self.tasks = every, tokens, tasks
        self._held_out: dict[str, HeldOut] = {}  # made at the first evaluation
        self._bytes: torch.Tensor | None = None  # of each token id, made then too

    def due(self, step: int, last: bool) -> bool:
        return last or (self.every > 0 and step % self.every == 0)

    def prepare(self) -> None:
        """Wait for each source's held-out split (built in the background) and choose its
        windows, once: the first evaluation's wait for data, apart from its scoring."""
        for name in self.data.names:
            if name not in self._held_out:
                self._held_out[name] = held_out(self.data, name, self.tokens)

    def held_out_targets(self) -> int | None:
        """About the targets that scoring every held-out window takes (--eval-tokens all: the
        validation splits' tokens), once every split is built; None before (it never waits)."""
        total = 0
        for name in self.data.names:
            split = self.data.validation[name].split
            split.refresh()
            if not split.complete:
                return None
            total += split.total["tokens"]
        return total

    def loss(self, source: str | None = None) -> float | None:
        """Mean token loss of the validation windows of ``source`` (default: the first; all
        ranks); None if there are none."""
        return self.scores(source)[0]

    @torch.no_grad()
    def scores(self, source: str | None = None) -> tuple[float | None, float | None]:
        """(mean token loss, bits per byte) of the validation windows of ``source`` (default:
        the first; all ranks): bits per byte is the summed loss in bits over the UTF-8 bytes of
        the targets scored (`tokenizer.token_bytes`: special tokens count none); None if there
        are no targets (bits per byte: no bytes)."""
        source = source or self.data.names[0]
        self.prepare()
        if self._bytes is None:
            self._bytes = torch.as_tensor(token_bytes(self.data.tokenizer))
        self.model.eval()
        totals = torch.zeros(3, dtype=torch.float64, device=self.rt.device)
        batches = validation_batches(self.data, self.rt, self._held_out[source])
        for batch in batches:
            labels = batch.labels[batch.labels != IGNORE_INDEX]
            totals[0] += batch_loss_sum(self.model, batch.to(self.rt.device), self.precision)
            totals[1] += batch.targets
            totals[2] += int(self._bytes[labels].sum())
        self.model.train()
        D.all_reduce_sum(totals, self.rt)
        loss_sum, targets, num_bytes = totals.tolist()
        loss = loss_sum / targets if targets > 0 else None
        return loss, (bits_per_byte(loss_sum, num_bytes) if num_bytes > 0 else None)

    def record(self, step: int) -> dict[str, Any] | None:
        """The evaluation line of metrics.jsonl for ``step``: the validation loss and bits per
        byte (`validation_record`), and with tasks ``"tasks": {task: {"acc", "acc_norm", "n"}}``
        and ``tasks_s``, the seconds they took; None with neither validation data nor tasks."""
        scores = {name: self.scores(name) for name in self.data.names}
        weights = dict(zip(self.data.names, self.data.weights()))
        losses = {name: loss for name, (loss, _) in scores.items()}
        bpb = {name: bpb for name, (_, bpb) in scores.items()}
        record: dict[str, Any] = {"step": step, **(validation_record(losses, weights, bpb) or {})}
        if self.tasks is not None:
            start = time.perf_counter()
            record["tasks"] = self.tasks(self.model, self.rt, self.precision)
            record["tasks_s"] = round(time.perf_counter() - start, 3)
        return record if len(record) > 1 else None


def validation_record(
    losses: dict[str, float | None],
    weights: dict[str, float],
    bpb: dict[str, float | None] | None = None,
) -> dict | None:
    """An evaluation's metrics from each source's validation loss (None: nothing to score):
    their mean by weight, its perplexity, the mean by weight of the sources' bits per byte
    (``bpb``, where every scored source has one) and, with several sources, each one's loss."""
    scored = {name: loss for name, loss in losses.items() if loss is not None}
    if not scored:
        return None
    total = sum(map(weights.get, scored))
    val = sum(weights[n] * loss for n, loss in scored.items()) / total
    record = {"val_loss": val, "val_perplexity": math.exp(min(val, 50.0))}
    if bpb and all(bpb.get(n) is not None for n in scored):
        record["val_bpb"] = sum(weights[n] * bpb[n] for n in scored) / total
    return {**record, "val_loss_by_source": scored} if len(losses) > 1 else record


class SplitTokens:
    """A complete split's shards read as one token stream: ``offsets`` of every document and
    slices within one document (documents never cross shards)."""

    def __init__(self, split: ShardedSplit) -> None:
        split.wait_complete()
        self.shards = [split.shard(k) for k in range(len(split.shards))]
        sizes = [shard.num_tokens for shard in self.shards]
        self.starts = list(itertools.accumulate(sizes, initial=0))
        self.offsets = np.concatenate(
            [s.offsets[:-1] + a for s, a in zip(self.shards, self.starts)]
            + [np.asarray([self.starts[-1]], dtype=np.int64)]
        )
        self.num_tokens, self.num_docs = self.starts[-1], len(self.offsets) - 1

    def __getitem__(self, part: slice) -> np.ndarray:
        k = bisect.bisect_right(self.starts, part.start) - 1
        a = self.starts[k]
        return self.shards[k].tokens[part.start - a : part.stop - a]


class HeldOut(NamedTuple):
    """A source's validation tokens and the windows that score them."""

    tokens: SplitTokens
    windows: np.ndarray


def held_out(data: TrainData, source: str | None = None, tokens: int | None = None) -> HeldOut:
    """The validation split of ``source`` (default: the first) and the windows that score about
    ``tokens`` of its targets (`budget_windows`; None: all of them), once the split is built."""
    split = SplitTokens(data.validation[source or data.names[0]].split)
    return HeldOut(split, budget_windows(document_windows(split.offsets, data.seq_length), tokens))


# The sample of windows an evaluation scores is drawn with this seed, not the run's: runs of any
# seed are compared on the same tokens.
SAMPLE_SEED = 0


def budget_windows(windows: np.ndarray, tokens: int | None) -> np.ndarray:
    """The windows (rows of (start, end, first), `windows.document_windows`) an evaluation
    scores: all of them when ``tokens`` is None or covers them, else the fewest of a fixed random
    order of them that score at least ``tokens`` targets, in their document order. A function of
    the windows alone: the same at every evaluation, world size and resume."""
    scored = windows[:, 1] - windows[:, 2]  # the targets of each window
    if tokens is None or scored.sum() <= tokens:
        return windows
    order = np.random.default_rng(SAMPLE_SEED).permutation(len(windows))
    count = int(np.searchsorted(np.cumsum(scored[order]), tokens)) + 1
    return windows[np.sort(order[:count])]


def validation_batches(
    data: TrainData, rt: D.Runtime, scored: HeldOut | None = None
) -> Iterator[Batch]:
    """This rank's share of the validation windows of ``scored`` (default: every window of the
    first source's): global batches of --batch-size windows in document order, each split over
    the ranks as a training batch is (micro-batches of micro_batch windows), the last one too.
    Every rank yields as many batches (FSDP's forwards are collective): one short of windows
    yields a one-token batch with no target. The mean loss is the same at every world size."""
    scored = held_out(data) if scored is None else scored
    spans, sampler = scored.windows, data.sampler
    per_rank = sampler.global_batch // rt.world_size
    steps = -(-len(spans) // sampler.global_batch)
    for step in range(steps):
        mine = step * sampler.global_batch + rt.rank * per_rank
        for micro in range(mine, mine + per_rank, sampler.micro_batch):
            rows = spans[micro : min(micro + sampler.micro_batch, mine + per_rank)]
            yield window_batch(scored.tokens, rows, data.seq_length)
