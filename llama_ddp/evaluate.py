"""``python -m llama_ddp.evaluate`` (``llama-ddp-evaluate``): score a saved model on
multiple-choice tasks as lm-evaluation-harness does (eval/scoring.py), print the table and
optionally write the scores as JSON::

    python -m llama_ddp.evaluate --model out/small --tasks stdlib-mc,hellaswag --output scores.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from llama_ddp.errors import ArgumentParser, UserError, exit_command, run_command
from llama_ddp.eval.scoring import BATCH_TOKENS, TaskEvaluator
from llama_ddp.files import safe_io
from llama_ddp.precision import DTYPES, Precision


def format_table(scores: dict[str, dict[str, float]]) -> str:
    width = max([len("task"), *map(len, scores)])
    lines = [f"{'task':<{width}}  {'n':>6}  {'acc':>7}  {'acc_norm':>8}"]
    for name, s in scores.items():
        lines.append(f"{name:<{width}}  {s['n']:>6}  {s['acc']:>7.4f}  {s['acc_norm']:>8.4f}")
    return "\n".join(lines)


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


if __name__ == "__main__":
    exit_command(main())
