"""`make pretrain-small`'s recipe chosen by measurement (issue 59): candidate recipes of the
embedded corpus, side by side, each run whole (its tokenizer trained, train.py with its
evaluations, save and exports) as the Makefile runs it, their order rotating from round to round.

    python bench/bench_small.py                                  # the candidates below, 1 round
    python bench/bench_small.py --rounds 2 --only today,d1-v4096-800 --json out.json

A recipe is a vocabulary size (its tokenizer trained on the corpus here, as `make tokenizer`
trains the repo's, into a cache folder of this bench: cold, as on a fresh machine, unless
--warm) and train.py's flags. Per run: the wall seconds of the tokenizer's training and of
train.py (start to exit), the loop's own seconds (metrics.jsonl's last ``time``), the final
validation bits per byte and stdlib-mc's accuracy. Fixed-steps runs are deterministic: their
bpb is the same from round to round on one machine kind; only the times vary with the load.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_run import launch  # noqa: E402

COMMON = (
    "--dataset sample --seq-length 256 --batch-size 16 --lr-schedule wsd "
    "--eval-tasks stdlib-mc --eval-limit 100"
)
# name: (vocabulary, train.py's flags beyond COMMON)
RECIPES = {
    "today": (8192, "--model-size 1 --max-steps 600 --eval-every 300 --save-every 300"),
    "d1-v4096-800": (4096, "--model-size 1 --max-steps 800 --eval-every 400 --save-every 400"),
    "d1-v2048-1200": (2048, "--model-size 1 --max-steps 1200 --eval-every 600 --save-every 600"),
    "d2-v4096-500": (4096, "--model-size 2 --max-steps 500 --eval-every 250 --save-every 250"),
    "d2-v2048-800": (2048, "--model-size 2 --max-steps 800 --eval-every 400 --save-every 400"),
}
TIMEOUT_S = 1800  # a run's: the slowest recipe here takes ~6 minutes on 2 loaded cores


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=None, help="the recipes to run, by name, comma-separated")
    p.add_argument("--extra", action="append", default=[], metavar="NAME=VOCAB:FLAGS",
                   help="a further recipe (repeatable), e.g. 'd1-v4096-700=4096:--model-size 1 "
                        "--max-steps 700 --eval-every 350 --save-every 350'")  # fmt: skip
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--warm", action="store_true", help="build each token cache before timing")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def recipes(args: argparse.Namespace) -> dict[str, tuple[int, str]]:
    chosen = dict(RECIPES)
    for spec in args.extra:
        name, _, rest = spec.partition("=")
        vocab, _, flags = rest.partition(":")
        chosen[name] = (int(vocab), flags)
    if args.only:
        names = [n.strip() for n in args.only.split(",")]
        unknown = [n for n in names if n not in chosen]
        if unknown:
            raise SystemExit(f"error: no recipe {', '.join(unknown)} (have {', '.join(chosen)})")
        chosen = {n: chosen[n] for n in names}
    return chosen


def run(name: str, vocab: int, flags: str, work: Path, warm: bool) -> dict:
    out, cache = work / f"{name}-out", work / f"{name}-cache"
    for folder in (out, cache):
        shutil.rmtree(folder, ignore_errors=True)
    env = {"LLAMA_DDP_CACHE": str(cache)}
    tokenizer = work / f"{name}-tokenizer.json"
    tok_s, _ = launch([sys.executable, str(ROOT / "tokenizer" / "train_tokenizer.py"),
                       "--dataset", "sample", "--vocab-size", str(vocab), "--out", str(tokenizer)],
                      TIMEOUT_S, env)  # fmt: skip
    cmd = [sys.executable, str(ROOT / "train.py"), *shlex.split(COMMON), *shlex.split(flags),
           "--tokenizer", str(tokenizer), "--out-dir", str(out)]  # fmt: skip
    if warm:
        warm_up = [*cmd[:-1], str(work / "warm"), "--max-steps", "1", "--no-export-hf"]
        launch(warm_up, TIMEOUT_S, env)
    wall, _ = launch(cmd, TIMEOUT_S, env)
    records = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    final = [r for r in records if "val_bpb" in r][-1]
    return {
        "tokenizer_s": round(tok_s, 1),
        "train_py_s": round(wall, 1),
        "loop_s": final["time"]["total_s"],
        "step": final["step"],
        "val_bpb": round(final["val_bpb"], 4),
        "stdlib_mc_acc": final["tasks"]["stdlib-mc"]["acc"],
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    chosen = recipes(args)
    names = list(chosen)
    results: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="bench_small-") as tmp:
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]  # rotate: load spreads
            for name in order:
                vocab, flags = chosen[name]
                results[name].append(run(name, vocab, flags, Path(tmp), args.warm))
                print(name, results[name][-1], flush=True)
    print(f"{'recipe':16} {'vocab':>5} {'whole s (min / median)':>22} {'loop s':>7} "
          f"{'val bpb':>8} {'stdlib-mc':>9}")  # fmt: skip
    for name in names:
        rs = results[name]
        whole = [x["tokenizer_s"] + x["train_py_s"] for x in rs]
        fastest, median = min(whole), statistics.median(whole)
        print(f"{name:16} {chosen[name][0]:>5} {fastest:>10.1f} / {median:<9.1f}"
              f" {min(x['loop_s'] for x in rs):>7.1f} {rs[0]['val_bpb']:>8.4f}"
              f" {rs[0]['stdlib_mc_acc']:>9.2f}")  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"recipes": chosen, "runs": results}, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
