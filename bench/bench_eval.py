"""The cost of downstream evaluation (``--eval-tasks``) against training, per task and preset.

    python bench/bench_eval.py --presets small,base --limit 20 --json bench/results/eval-cpu.json

For each preset, a trainer is built as train.py builds it (``run.build_trainer``: the sample
corpus, seq 256, global batch 32) and its optimizer steps are timed; then each task is scored
with the evaluator the loop uses (``TaskEvaluator``, a training micro-batch's tokens per forward)
on its first ``--limit`` examples, presets and tasks taking turns round after round. stdlib-mc is
the real task; the hub tasks cannot be downloaded on an offline machine, so they read local
copies in the hub's columns whose texts have about each dataset's mean length in words (random
English words: the token counts, which decide the cost, are printed with the timings).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from llama_ddp.distributed import runtime as D
from llama_ddp.eval.scoring import TaskEvaluator
from llama_ddp.eval.tasks import load_tasks, parse_tasks
from llama_ddp.train.config import TrainConfig
from llama_ddp.train.run import build_trainer

ROOT = Path(__file__).resolve().parents[1]
WORDS = (
    "the a man woman dog cat car house water tree city hand light day night time way year then "
    "and but because when while after before with without over under into onto from about is "
    "was are were has have had will can could should would put take make get go come see use "
    "find give tell work call try ask need feel become leave keep begin seem help show hear play "
    "run move live believe hold bring happen write sit stand lose pay meet include continue set"
).split()
# Mean lengths in words, approximately: (HellaSwag: context, ending x4), (ARC: question,
# choice x4), (PIQA: goal, solution x2), (Winogrande: sentence).
LENGTHS = {"hellaswag": (40, 20), "arc": (22, 4), "piqa": (8, 20), "winogrande": (19, 0)}


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def hub_copies(folder: Path, count: int) -> dict[str, str]:
    """``count`` rows of each hub task, in its dataset's columns: NAME=PATH specs."""
    rng = random.Random(0)
    rows: dict[str, list[dict]] = {k: [] for k in LENGTHS}
    for _ in range(count):
        ctx, end = LENGTHS["hellaswag"]
        rows["hellaswag"].append(
            {"activity_label": words(rng, 2), "ctx_a": words(rng, ctx - 4), "ctx_b": words(rng, 2)}
            | {"endings": [words(rng, end) for _ in range(4)], "label": "0"}
        )
        q, c = LENGTHS["arc"]
        choices = {"text": [words(rng, c) for _ in range(4)], "label": list("ABCD")}
        rows["arc"].append({"question": words(rng, q), "choices": choices, "answerKey": "A"})
        goal, sol = LENGTHS["piqa"]
        piqa = {"goal": words(rng, goal), "sol1": words(rng, sol), "sol2": words(rng, sol)}
        rows["piqa"].append(piqa | {"label": 0})
        n = LENGTHS["winogrande"][0]
        sentence = f"{words(rng, n // 2)} _ {words(rng, n - n // 2 - 1)}"
        rows["winogrande"].append(
            {"sentence": sentence, "option1": "man", "option2": "woman", "answer": "1"}
        )
    specs = {}
    for key, task in (("hellaswag",) * 2, ("arc", "arc_easy"), ("piqa",) * 2, ("winogrande",) * 2):
        path = folder / f"{key}.parquet"
        pq.write_table(pa.Table.from_pylist(rows[key]), path)
        specs[task] = f"{task}={path}"
    specs["stdlib-mc"] = "stdlib-mc"
    return specs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="small,base")
    p.add_argument("--limit", type=int, default=20, help="examples of each task per evaluation")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--train-steps", type=int, default=2, help="timed optimizer steps per preset")
    p.add_argument("--eval-every", type=int, default=40, help="the interval the share is for")
    p.add_argument("--tokenizer", default=str(ROOT / "tokenizer" / "tokenizer.json"))
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--json", type=Path)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rt = D.setup("single", "cpu")
    tmp = Path(tempfile.mkdtemp(prefix="bench_eval-"))
    specs = hub_copies(tmp, args.limit)
    presets = args.presets.split(",")
    built, step_s = {}, {}
    for name in presets:
        cfg = TrainConfig.from_flags(
            preset=name, tokenizer=args.tokenizer, max_steps=args.train_steps + 1,
            out_dir=str(tmp / name), seq_length=256, batch_size=32, optimizer="adamw",
        ).validate()  # fmt: skip
        trainer = build_trainer(cfg, rt)
        batches = trainer.data.batches(0)
        times = []
        for _ in range(args.train_steps + 1):  # the first warms up
            start = time.perf_counter()
            trainer.step(next(batches)).stats()  # waits for the step
            times.append(time.perf_counter() - start)
        step_s[name] = statistics.median(times[1:])
        budget = cfg.data.micro_batch(1) * cfg.data.seq_length
        bot = trainer.data.special.ids.bot
        evaluators = {
            task: TaskEvaluator(
                load_tasks(parse_tasks(spec), args.limit), trainer.data.tokenizer, bot, budget
            )
            for task, spec in specs.items()
        }
        built[name] = (trainer.model, trainer.precision, evaluators)
        print(f"{name}: {step_s[name]:.2f} s per optimizer step (batch 32 x 256)", flush=True)
    seconds: dict[str, dict[str, list[float]]] = {p: {t: [] for t in specs} for p in presets}
    for r in range(args.rounds):
        for name in presets[r % len(presets) :] + presets[: r % len(presets)]:
            model, precision, evaluators = built[name]
            for task, evaluator in evaluators.items():
                start = time.perf_counter()
                evaluator(model, precision=precision)
                seconds[name][task].append(time.perf_counter() - start)
    rows = []
    for name in presets:
        for task, evaluator in built[name][2].items():
            n = len(evaluator.tasks[0].examples)
            tokens = sum(len(c) + len(t) for c, t in evaluator.requests) / n
            median, fastest = statistics.median(seconds[name][task]), min(seconds[name][task])
            share = median / (args.eval_every * step_s[name] + median)
            rows.append(
                {"preset": name, "task": task, "examples": n, "tokens_per_example": tokens,
                 "seconds_median": median, "seconds_fastest": fastest,
                 "ms_per_example": 1000 * median / n, "step_seconds": step_s[name],
                 f"share_at_eval_every_{args.eval_every}": share}
            )  # fmt: skip
            print(
                f"{name:>5} {task:<13} {n:>4} ex, {tokens:6.1f} tokens/ex: {median:7.2f} s "
                f"(fastest {fastest:.2f}), {1000 * median / n:7.1f} ms/ex, "
                f"{100 * share:5.1f}% of training at --eval-every {args.eval_every}",
                flush=True,
            )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"date": datetime.date.today().isoformat(), "machine": platform.processor()}
        meta |= {"threads": args.threads, "torch": torch.__version__, "argv": sys.argv[1:]}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
