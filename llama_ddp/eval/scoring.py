"""Downstream evaluation: multiple-choice tasks (tasks.py) scored as lm-evaluation-harness scores
them, in the training loop (``--eval-tasks``) and on any saved model:

    python -m llama_ddp.evaluate --model out/small --tasks stdlib-mc,hellaswag --output scores.json

Each choice is the log-likelihood of its continuation given its context: the harness's
``_encode_pair`` (the context's trailing whitespace moves onto the continuation; context +
continuation is encoded whole and split at the length of the context's own encoding), the
context opened with BOT as training opens every document (the harness's ``add_bos_token=True``),
left-truncated to the model's context. ``acc``: the choice of highest log-likelihood is right;
``acc_norm``: the same after dividing each by its choice's length in characters. Requests are
batched longest first and shared out over the ranks; one all-reduce gathers them.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer

from llama_ddp.attention_plan.plan import plan_attention
from llama_ddp.data.tokenizer import text_encoder
from llama_ddp.distributed import runtime as D
from llama_ddp.errors import ArgumentParser, UserError, run_command
from llama_ddp.eval.tasks import Example, Task
from llama_ddp.files import safe_io
from llama_ddp.precision import DTYPES, Precision

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


def format_table(scores: dict[str, dict[str, float]]) -> str:
    width = max([len("task"), *map(len, scores)])
    lines = [f"{'task':<{width}}  {'n':>6}  {'acc':>7}  {'acc_norm':>8}"]
    for name, s in scores.items():
        lines.append(f"{name:<{width}}  {s['n']:>6}  {s['acc']:>7.4f}  {s['acc_norm']:>8.4f}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the CLI


def build_parser() -> argparse.ArgumentParser:
    from llama_ddp.eval.tasks import TASKS

    p = ArgumentParser(
        prog="python -m llama_ddp.evaluate",
        description="Score a saved model on multiple-choice tasks as lm-evaluation-harness does.",
    )
    p.add_argument(
        "--model",
        required=True,
        help="a run folder, llama_model.pth, an hf/ folder, a checkpoints/step-N folder, or a "
        "hub repository id",
    )
    p.add_argument(
        "--tasks",
        required=True,
        help=f"comma list of {', '.join(TASKS)}, NAME=PATH (a hub task's local copy) or .jsonl "
        "files",
    )
    p.add_argument("--output", type=Path, help="write {task: {acc, acc_norm, n}} as JSON here")
    p.add_argument("--force", action="store_true", help="replace --output if it exists")
    p.add_argument("--limit", type=int, help="the first N examples of each task (default: all)")
    p.add_argument("--tokenizer", help="tokenizer.json or its folder (default: the model's)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument(
        "--dtype",
        choices=("auto", *DTYPES),
        default="auto",
        help="compute dtype (autocast); auto: bf16 on CUDA, fp32 on every CPU (train.py's auto "
        "also takes bf16 on CPUs that multiply it natively)",
    )
    p.add_argument(
        "--batch-tokens", type=int, default=BATCH_TOKENS, help="padded tokens per forward"
    )
    p.add_argument("--cache-dir", type=Path, help="where the sample corpus lives (stdlib-mc)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(lambda args: _run(build_parser().parse_args(args)), argv)


def _run(args: argparse.Namespace) -> int:
    from llama_ddp.distributed.runtime import resolve_device
    from llama_ddp.eval.tasks import load_tasks, parse_tasks
    from llama_ddp.interop.load import load_for_evaluation
    from llama_ddp.precision import emulation_warning, resolve_dtype

    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit {args.limit} must be >= 1")
    if args.batch_tokens < 1:
        raise UserError(f"--batch-tokens {args.batch_tokens} must be >= 1")
    if args.output is not None:  # before any scoring, which may take hours
        safe_io.check_output(args.output, "--output", args.force, "scores.json")
    specs = parse_tasks(args.tasks, "--tasks")
    if not specs:
        raise UserError("--tasks names no task (give a comma list)")
    device = resolve_device(args.device)
    precision = Precision(resolve_dtype(args.dtype, device), device)
    warning = emulation_warning(precision.dtype, device)
    if warning:
        print(warning, file=sys.stderr)
    model, tokenizer, special = load_for_evaluation(args.model, args.tokenizer, device)
    tasks = load_tasks(specs, args.limit, args.cache_dir)
    evaluator = TaskEvaluator(tasks, tokenizer, special.bot, args.batch_tokens)
    scores = evaluator(model, precision=precision)
    invalid = [name for name, s in scores.items() if not math.isfinite(s["acc"])]
    if invalid:
        raise UserError(
            f"model {args.model}: its log-likelihoods on {', '.join(invalid)} are not finite, "
            "so it has no score (its weights or its --dtype overflow: try --dtype fp32, or "
            "another checkpoint)"
        )
    print(format_table(scores))
    if args.output is not None:
        text = json.dumps(scores, indent=2) + "\n"
        with safe_io.writing(args.output, "scores"):
            args.output.parent.mkdir(parents=True, exist_ok=True)
            safe_io.write_text(args.output, text)
        print(f"wrote {args.output}")
    return 0
