"""Downstream evaluation: multiple-choice tasks (tasks.py) scored as lm-evaluation-harness scores
them, in the training loop (``--eval-tasks``) and on any saved model (``python -m
llama_ddp.evaluate``, llama_ddp/evaluate.py).

Each choice is the log-likelihood of its continuation given its context: the harness's
``_encode_pair`` (the context's trailing whitespace moves onto the continuation; context +
continuation is encoded whole and split at the length of the context's own encoding), the
context opened with BOT as training opens every document (the harness's ``add_bos_token=True``),
left-truncated to the model's context. ``acc``: the choice of highest log-likelihood is right;
``acc_norm``: the same after dividing each by its choice's length in characters. Requests are
batched longest first and shared out over the ranks; one all-reduce gathers them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from tokenizers import Tokenizer

from llama_ddp.attention_plan.plan import plan_attention
from llama_ddp.data.tokenizer import text_encoder
from llama_ddp.distributed import runtime as D
from llama_ddp.eval.tasks import Example, Task
from llama_ddp.precision import Precision

Request = tuple[list[int], list[int]]  # (BOT + context ids, continuation ids)
BATCH_TOKENS = 8192  # padded tokens per forward and rank: a training micro-batch's worth or less


def encode_requests(
    tokenizer: Tokenizer, bot: int, pairs: Sequence[tuple[str, str]]
) -> list[Request]:
    """(context, continuation) strings as token ids, split as the harness's ``_encode_pair``."""
    encoder = text_encoder(tokenizer)
    contexts = encoder.encode_batch([c.rstrip() for c, _ in pairs], add_special_tokens=False)
    wholes = encoder.encode_batch([c + t for c, t in pairs], add_special_tokens=False)
    return [
        ([bot, *context.ids], whole.ids[len(context.ids) :])
        for context, whole in zip(contexts, wholes)
    ]


@torch.no_grad()
def loglikelihoods(
    model: torch.nn.Module,
    requests: Sequence[Request],
    *,
    precision: Precision | None = None,
    rt: D.Runtime | None = None,
    batch_tokens: int = BATCH_TOKENS,
) -> list[float]:
    """The summed log-probability of each request's continuation given its context (an empty
    continuation scores 0). Under ``rt`` every rank takes its share of each batch and every
    rank returns all of them; every rank runs the same number of forwards (FSDP needs it)."""
    context = model.config.max_position_embeddings
    rows = []
    for ctx, cont in requests:
        whole = (ctx + cont)[-(context + 1) :]  # left-truncated, as the harness does
        rows.append((whole, min(len(cont), len(whole) - 1)))
    scored = [i for i, (_, n) in enumerate(rows) if n > 0]
    order = sorted(scored, key=lambda i: -len(rows[i][0]))  # longest first
    rank, world = (rt.rank, rt.world_size) if rt is not None else (0, 1)
    device = rt.device if rt is not None else next(model.parameters()).device
    precision = precision or Precision(torch.float32, device)
    out = torch.zeros(len(rows), dtype=torch.float64, device=device)
    start = 0
    while start < len(order):
        per_rank = max(1, batch_tokens // len(rows[order[start]][0]))
        chunk = order[start : start + per_rank * world]
        start += len(chunk)
        mine = chunk[rank * per_rank : (rank + 1) * per_rank]
        sums = _score_rows(model, [rows[i] for i in mine], precision, device)
        if mine:
            out[torch.tensor(mine, device=device)] = sums.double()
    if rt is not None:
        D.all_reduce_sum(out, rt)
    return out.tolist()


def _score_rows(
    model: torch.nn.Module,
    rows: list[tuple[list[int], int]],
    precision: Precision,
    device: torch.device,
) -> torch.Tensor:
    """Summed continuation log-probs of right-padded ``rows`` (tokens, continuation length) in
    one forward; the model computes their real positions only. No rows: a one-token forward,
    so that this rank takes part in the collectives of a sharded model."""
    if not rows:
        with precision.autocast():
            model(torch.zeros((1, 1), dtype=torch.long, device=device))
        return torch.zeros(0, device=device)
    width = max(len(tokens) for tokens, _ in rows) - 1
    inputs = torch.zeros((len(rows), width), dtype=torch.long)
    real = torch.zeros((len(rows), width), dtype=torch.bool)
    positions, targets, owners, offset = [], [], [], 0
    for i, (tokens, n) in enumerate(rows):
        length = len(tokens) - 1
        inputs[i, :length] = torch.tensor(tokens[:-1])
        real[i, :length] = True
        # Logits of the last n inputs predict the continuation (row-major among real positions).
        positions.extend(range(offset + length - n, offset + length))
        targets.extend(tokens[-n:] if n else [])
        owners.extend([i] * n)
        offset += length
    plan = plan_attention(inputs.shape, real).to(device)  # planned on the CPU, as training does
    with precision.autocast():
        logits = model(inputs.to(device), plan=plan)  # (N, V): the real positions only
    chosen = logits[torch.tensor(positions, dtype=torch.long, device=device)]
    logprobs = torch.log_softmax(chosen.float(), dim=-1)
    target = torch.tensor(targets, dtype=torch.long, device=device)
    picked = logprobs.gather(1, target[:, None]).squeeze(1)
    owner = torch.tensor(owners, dtype=torch.long, device=device)
    return torch.zeros(len(rows), device=device).index_add_(0, owner, picked)


def _credit(values: Sequence[float], label: int) -> float:
    """The credit of choosing among ``values`` by the highest: 1 when ``label``'s alone is
    highest, 1/k when k choices share the highest value and ``label`` is one of them (the
    expected score of breaking the tie at random; the harness's argmax gives a tie to the first
    choice, which a model whose scores all tie would win on every task labelled 0)."""
    best = max(values)
    tied = [i for i, v in enumerate(values) if v == best]
    return 1 / len(tied) if label in tied else 0.0


def accuracy(examples: Sequence[Example], lls: Sequence[float]) -> dict[str, float]:
    """acc, acc_norm and n over ``examples`` from the log-likelihoods of their requests, in
    order (the harness's multiple_choice ``process_results``, ties split: `_credit`). A
    log-likelihood that is not finite (a model whose outputs are NaN) makes both NaN: no
    score is given for a model that computed none."""
    if not all(math.isfinite(x) for x in lls):
        return {"acc": math.nan, "acc_norm": math.nan, "n": len(examples)}
    right = right_norm = 0.0
    start = 0
    for ex in examples:
        scores = lls[start : start + len(ex.requests)]
        start += len(ex.requests)
        normed = [s / len(c) if c else -math.inf for s, c in zip(scores, ex.choices)]
        right += _credit(scores, ex.label)
        right_norm += _credit(normed, ex.label)
    n = len(examples)
    return {"acc": right / n, "acc_norm": right_norm / n, "n": n}


class TaskEvaluator:
    """Tasks tokenized once, scored at each evaluation: ``evaluator(model, rt, precision)``
    gives ``{task: {"acc", "acc_norm", "n"}}`` on every rank."""

    def __init__(
        self,
        tasks: Sequence[Task],
        tokenizer: Tokenizer,
        bot: int,
        batch_tokens: int = BATCH_TOKENS,
    ) -> None:
        self.tasks = list(tasks)
        pairs = [pair for task in self.tasks for ex in task.examples for pair in ex.requests]
        self.requests = encode_requests(tokenizer, bot, pairs)
        self.batch_tokens = batch_tokens

    def loglikelihoods(
        self,
        model: torch.nn.Module,
        rt: D.Runtime | None = None,
        precision: Precision | None = None,
    ) -> dict[str, list[float]]:
        """Each task's per-request log-likelihoods, in model.eval() mode."""
        training = model.training
        model.eval()
        try:
            lls = loglikelihoods(
                model,
                self.requests,
                precision=precision,
                rt=rt,
                batch_tokens=self.batch_tokens,
            )
        finally:
            model.train(training)
        out, start = {}, 0
        for task in self.tasks:
            count = sum(len(ex.requests) for ex in task.examples)
            out[task.name], start = lls[start : start + count], start + count
        return out

    def __call__(
        self,
        model: torch.nn.Module,
        rt: D.Runtime | None = None,
        precision: Precision | None = None,
    ) -> dict[str, dict[str, float]]:
        lls = self.loglikelihoods(model, rt, precision)
        return {task.name: accuracy(task.examples, lls[task.name]) for task in self.tasks}
