"""``python -m llama_ddp.plan`` (``llama-ddp-plan``): what ``train.py --model-size auto`` would
choose for a time budget and a run's shape, without training. The step times are this
machine's, timed as auto times them (train/sizing/auto.py), or a stated device's
(``--peak-tflops``, ``--mfu``, ``--devices``: train/sizing/stated.py); either way the choice is
rule.py's `choose`::

    python -m llama_ddp.plan --time-budget 10m --seq-length 256 --batch-size 16
    python -m llama_ddp.plan --time-budget 8h --peak-tflops 989 --devices 8 --seq-length 2048 \\
        --batch-size 256 --vocab-size 32768 --json plan.json
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path

from llama_ddp.errors import ArgumentParser, UserError, exit_command, run_command
from llama_ddp.files import safe_io

PROG = "python -m llama_ddp.plan"
MFU = 0.4  # --mfu's default: what a well-tuned dense training run reaches on a modern GPU


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog=PROG,
        description="Say what --model-size auto would choose for a time budget and a run's "
        "shape, without training: the candidates, their parameters (all of them: the embedding "
        "and lm_head included, a tied embedding once, as auto's banner counts them), tokens, "
        "tokens per parameter, predicted val bpb and epochs of the corpus, and the choice.",
    )
    p.add_argument("--time-budget", required=True, help="the run's budget: 90s, 10m, 2h, or slurm")
    p.add_argument(
        "--peak-tflops",
        type=float,
        help="a stated device instead of this machine: its dense peak TFLOPS at the run's "
        "precision (H100 SXM bf16: 989); the step time is the FLOPs per token x tokens per "
        "step / (peak x --mfu x --devices). Without it, each candidate is timed here as auto "
        "times it",
    )
    p.add_argument(
        "--mfu", type=float, help=f"with --peak-tflops: the model FLOPs utilization (default {MFU})"
    )
    p.add_argument("--devices", type=int, help="with --peak-tflops: how many (default 1)")
    p.add_argument("--seq-length", type=int, default=256, help="tokens per sequence (256)")
    p.add_argument(
        "--batch-size", type=int, default=32, help="global batch in sequences per step (32)"
    )
    p.add_argument(
        "--tokenizer",
        help="the run's tokenizer.json (or folder, hub id, .gguf): its vocabulary (default: "
        "auto, trained on --dataset, of --vocab-size tokens)",
    )
    p.add_argument(
        "--vocab-size", type=int, default=8192, help="the vocabulary without --tokenizer (8192)"
    )
    p.add_argument(
        "--dataset",
        help="the run's corpus, read whole to count its tokens (the repetition the plan counts): "
        "sample, a local file/folder/glob or a hub dataset; with --peak-tflops optional (none: "
        "its size unknown, every token counted as new); without it the candidates are timed on "
        "it (default: sample)",
    )
    p.add_argument("--tie-embeddings", action="store_true", help="the run ties its lm_head")
    p.add_argument("--cache-dir", help="where the corpus and its token cache live")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where to time the candidates (without --peak-tflops)")  # fmt: skip
    p.add_argument(
        "--json",
        type=Path,
        metavar="FILE",
        help='write {"choice": {depth, parameters, tokens, tokens_per_parameter, predicted_bpb, '
        'source}, "candidates": [...]} to FILE (predicted_bpb null where the plan predicts no '
        "bpb: beyond the measured runs; source runs, blend or law: law.py)",
    )
    p.add_argument("--force", action="store_true", help="replace --json's FILE if it exists")
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(lambda args: _run(build_parser().parse_args(args)), argv)


def _positive(name: str, value: float | None, most: float = math.inf) -> None:
    if value is not None and not (0 < value <= most and math.isfinite(value)):
        bound = f"from above 0 to {most:g}" if math.isfinite(most) else "above 0"
        raise UserError(f"{name} {value:g} must be a number {bound} (see {PROG} --help)")


def _check(args: argparse.Namespace) -> None:
    for name in ("--peak-tflops", "--devices", "--seq-length", "--batch-size", "--vocab-size"):
        _positive(name, getattr(args, name[2:].replace("-", "_")))
    _positive("--mfu", args.mfu, 1.0)
    for name, value in (("--mfu", args.mfu), ("--devices", args.devices)):
        if value is not None and args.peak_tflops is None:
            raise UserError(f"{name} describes a stated device (add --peak-tflops, or drop {name})")


def train_config(args: argparse.Namespace):
    """The TrainConfig of the run the plan is for: --model-size auto with the plan's flags,
    checked as train.py checks them."""
    from llama_ddp.train.cli import parse_train_args

    flags = ["--model-size", "auto", "--time-budget", args.time_budget,
             "--seq-length", str(args.seq_length), "--batch-size", str(args.batch_size),
             "--vocab-size", str(args.vocab_size), "--device", args.device]  # fmt: skip
    for flag, value in (("--tokenizer", args.tokenizer), ("--dataset", args.dataset),
                        ("--cache-dir", args.cache_dir)):  # fmt: skip
        if value is not None:
            flags += [flag, value]
    if args.tie_embeddings:
        flags.append("--tie-embeddings")
    return parse_train_args(flags, prog=PROG)


def _run(args: argparse.Namespace) -> int:
    _check(args)
    if args.json is not None:  # before any timing
        safe_io.check_output(args.json, "--json", args.force, "plan.json")
    cfg = train_config(args)
    if args.peak_tflops is None:
        choice, corpus, basis = _measured(cfg)
    else:
        choice, corpus, basis = _stated(cfg, args)
    from llama_ddp.train.sizing.auto import describe

    print(format_table(choice, basis))
    stated_only = args.dataset is None and args.peak_tflops is not None  # measured reads sample
    why = "no --dataset given" if stated_only else "its token cache is being built"
    for line in describe(choice, corpus, why, stated=args.peak_tflops is not None):
        print(line)
    if args.json is not None:
        text = json.dumps(as_json(choice, basis), indent=2) + "\n"
        with safe_io.writing(args.json, "plan"):
            args.json.parent.mkdir(parents=True, exist_ok=True)
            safe_io.write_text(args.json, text)
        print(f"wrote {args.json}")
    return 0


def _data(cfg):
    from llama_ddp.data.pipeline import build_data

    return build_data(cfg.data, seed=cfg.runtime.seed, sized=True)  # sized: its tokens counted


def _measured(cfg):
    """auto's own timing and choice on this machine (one process)."""
    from llama_ddp.distributed import runtime as D
    from llama_ddp.distributed.parallelize import runtime
    from llama_ddp.train.sizing.auto import choose_size, corpus_tokens

    rt = runtime("single", cfg.runtime.device)
    try:
        sized = choose_size(cfg, rt, None, _data)
    finally:
        D.teardown(rt)
    if sized.data is not None:
        sized.data.close()
    if sized.choice is None or sized.choice.best.steps <= 0:
        raise UserError(
            f"--time-budget {cfg.schedule.time_budget} holds no step of the smallest member on "
            "this machine once its end is kept (give a longer --time-budget or a smaller "
            "--batch-size)"
        )
    step_tokens = cfg.data.batch_size * cfg.data.seq_length
    basis = f"step times measured on this machine ({rt.device.type})"
    return sized.choice, corpus_tokens(sized.data, step_tokens), basis


def _stated(cfg, args):
    from llama_ddp.train.sizing.auto import corpus_tokens, family_sizes
    from llama_ddp.train.sizing.stated import Device, choose_stated

    device = Device(args.peak_tflops, args.mfu or MFU, args.devices or 1)
    corpus = None
    if args.dataset is not None:
        data = _data(cfg)
        vocab = data.vocab_size
        corpus = corpus_tokens(data, cfg.data.batch_size * cfg.data.seq_length)
        data.close()
    elif args.tokenizer not in (None, "auto"):  # auto: one trained on --dataset, --vocab-size
        from llama_ddp.data.tokenizer_files import locate_tokenizer, read_tokenizer

        vocab = read_tokenizer(locate_tokenizer(args.tokenizer))[0].get_vocab_size()
    else:
        vocab = args.vocab_size
    choice = choose_stated(cfg, family_sizes(cfg, vocab), device, corpus)
    basis = (
        f"step times stated: {device.devices} x {device.peak_tflops:g} TFLOPS at "
        f"{device.mfu:.0%} MFU"
    )
    return choice, corpus, basis


def candidate_json(c) -> dict:
    p = c.prediction
    return {
        "depth": c.depth,
        "parameters": c.size.parameters,
        "non_embedding": c.size.non_embedding,
        "tokens": c.tokens,
        "steps": c.steps,
        "step_s": c.step_s,
        "tokens_per_parameter": c.tokens / c.size.parameters,
        "predicted_bpb": p.bpb,
        "source": p.source,
        "epochs": p.epochs,
    }


def as_json(choice, basis: str) -> dict:
    return {
        "choice": candidate_json(choice.best),
        "runner_up": None if choice.runner_up is None else choice.runner_up.depth,
        "step_times": basis,
        "candidates": [candidate_json(c) for c in sorted(choice.timed, key=lambda c: c.depth)],
    }


def format_table(choice, basis: str) -> str:
    """The candidates auto weighed (each with its step time), by depth; the choice marked."""
    from llama_ddp.train.sizing.auto import count

    head = (
        f"{'':2}{'depth':>5}  {'parameters':>10}  {'tokens':>10}  {'tokens/param':>12}  "
        f"{'predicted bpb':>13}  {'epochs':>6}  {'step s':>8}  source"
    )
    lines = [f"candidates ({basis}):", head]
    for c in sorted(choice.timed, key=lambda c: c.depth):
        p = c.prediction
        bpb = "-" if p.bpb is None else f"{p.bpb:.3f}"
        epochs = "?" if p.epochs is None else f"{p.epochs:.2f}"
        mark = "*" if c.depth == choice.best.depth else ""
        lines.append(
            f"{mark:2}{c.depth:>5}  {count(c.size.parameters):>10}  {count(c.tokens):>10}  "
            f"{c.tokens / c.size.parameters:>12.2f}  {bpb:>13}  {epochs:>6}  {c.step_s:>8.3f}  "
            f"{p.source}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    exit_command(main())
