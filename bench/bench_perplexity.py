"""`generate --perplexity` of a short text under a long-context model: wall time and peak memory
of the whole command, for this tree and, with --before, another checkout of llama_ddp (e.g.
`git archive COMMIT | tar -x -C /tmp/before`), run interleaved, round after round, so a slow
spell on a shared machine hits both alike.

The model has random weights (cost does not depend on them): the preset with
max_position_embeddings --positions; the text is the start of a standard-library file cut to
--tokens tokens with BOT and EOT.

    python bench/bench_perplexity.py --before /tmp/before --json bench/results/perplexity.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

from llama_ddp.data.tokenizer import text_encoder
from llama_ddp.data.tokenizer_files import read_tokenizer
from llama_ddp.interop.native import save_model
from llama_ddp.model.config import preset
from llama_ddp.model.llama import LlamaForPretraining

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", type=Path, default=ROOT / "tokenizer" / "tokenizer.json")
    p.add_argument("--preset", default="small")
    p.add_argument("--positions", type=int, default=8192, help="max_position_embeddings")
    p.add_argument("--tokens", type=int, default=716, help="the text, with BOT and EOT")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--before", type=Path, help="another llama_ddp checkout to compare with")
    p.add_argument("--json", type=Path, help="also write the results here")
    return p.parse_args(argv)


def make_inputs(args: argparse.Namespace, folder: Path) -> tuple[Path, Path]:
    """The model folder (llama_model.pth, its json, the tokenizer) and the text file."""
    tok, _ = read_tokenizer(args.tokenizer)
    torch.manual_seed(0)
    config = preset(
        args.preset, vocab_size=tok.get_vocab_size(), max_position_embeddings=args.positions
    )
    save_model(LlamaForPretraining(config), config, folder / "model", args.tokenizer)
    source = Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py"
    ids = text_encoder(tok).encode(source.read_text()).ids[: args.tokens - 2]
    text = folder / "text.py"
    text.write_text(tok.decode(ids))
    return folder / "model", text


def run_once(tree: Path, model: Path, text: Path) -> tuple[float, int, str]:
    """Wall seconds, peak resident MB and the printed line of one `generate --perplexity`."""
    cmd = ["/usr/bin/time", "-f", "%e %M", sys.executable, "-m", "llama_ddp.generate"]
    cmd += ["--model", str(model), "--perplexity", str(text)]
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree, check=True)
    wall, kb = done.stderr.strip().splitlines()[-1].split()
    return float(wall), int(kb) // 1024, done.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    trees = {"now": ROOT, **({"before": args.before.resolve()} if args.before else {})}
    results: dict[str, dict] = {name: {"wall_s": [], "peak_mb": []} for name in trees}
    with tempfile.TemporaryDirectory() as tmp:
        model, text = make_inputs(args, Path(tmp))
        for _ in range(args.rounds):
            for name, tree in trees.items():
                wall, mb, line = run_once(tree, model, text)
                results[name]["wall_s"].append(wall)
                results[name]["peak_mb"].append(mb)
                results[name]["output"] = line
    for name, r in results.items():
        r["median_s"], r["fastest_s"] = statistics.median(r["wall_s"]), min(r["wall_s"])
        print(
            f"{name:>6}: median {r['median_s']:.2f} s, fastest {r['fastest_s']:.2f} s, peak "
            f"{max(r['peak_mb'])} MB | {r['output']}"
        )
    if "before" in results:
        ratio = results["before"]["median_s"] / results["now"]["median_s"]
        print(f"before / now: {ratio:.1f}x (medians)")
    setup = {k: v for k, v in vars(args).items() if k not in ("json", "before", "tokenizer")}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"setup": setup, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
