"""Generation speed: tokens/s with and without the KV cache, and against transformers.generate.

Random weights (speed does not depend on them), greedy, a random prompt. The three methods run
interleaved, round after round, and each reports its median, so a slow spell on a shared machine
hits all of them alike.

    python bench/bench_generate.py                      # small preset, 256 new tokens, 3 rounds
    python bench/bench_generate.py --preset tiny --json bench/results/generate.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from llama_ddp.generation.generate import generate
from llama_ddp.interop.hf import export_hf
from llama_ddp.model.config import preset
from llama_ddp.model.llama import LlamaForPretraining


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--prompt-length", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads (default: torch's; 1 is steadier on a busy box)",
    )
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument("--json", type=Path, help="also write the results here")
    return p.parse_args(argv)


def timed(fn) -> tuple[float, float, list[int]]:
    """Wall seconds, process CPU seconds, and fn's tokens. With one thread, CPU time is the time
    the work itself took even while other processes share the cores: the steadier figure."""
    wall, cpu = time.perf_counter(), time.process_time()
    tokens = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - wall, time.process_time() - cpu, tokens


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = preset(args.preset, vocab_size=args.vocab_size)
    model = LlamaForPretraining(config).to(args.device).eval()
    prompt = torch.randint(0, config.vocab_size, (args.prompt_length,)).tolist()
    n = args.new_tokens

    def ours(use_cache: bool, new: int = n):
        return lambda: list(generate(model, prompt, max_new_tokens=new, use_cache=use_cache))

    methods = {"cache": ours(True), "no_cache": ours(False)}
    if not args.no_hf:
        import transformers

        with tempfile.TemporaryDirectory() as tmp:
            export_hf(model, Path(tmp) / "hf")
            hf = transformers.AutoModelForCausalLM.from_pretrained(Path(tmp) / "hf")
        hf = hf.to(args.device).eval()
        x = torch.tensor([prompt], device=args.device)

        def theirs(new: int = n):
            def run() -> list[int]:
                out = hf.generate(
                    x,
                    attention_mask=torch.ones_like(x),
                    max_new_tokens=new,
                    min_new_tokens=new,  # no eos in the config anyway: always the full count
                    do_sample=False,
                    pad_token_id=0,
                )
                return out[0, len(prompt) :].tolist()

            return run

        methods["transformers"] = theirs()
        warmups = {"cache": ours(True, 8), "no_cache": ours(False, 8), "transformers": theirs(8)}
    else:
        warmups = {"cache": ours(True, 8), "no_cache": ours(False, 8)}
    for fn in warmups.values():
        fn()

    wall: dict[str, list[float]] = {name: [] for name in methods}
    cpu: dict[str, list[float]] = {name: [] for name in methods}
    tokens: dict[str, list[int]] = {}
    for r in range(args.rounds):
        for name, fn in methods.items():
            w, c, tokens[name] = timed(fn)
            assert len(tokens[name]) == n, (name, len(tokens[name]))
            wall[name].append(w)
            cpu[name].append(c)
            print(f"round {r + 1} {name:>12}: {n / w:8.1f} tokens/s", file=sys.stderr)

    rate = {name: n / statistics.median(s) for name, s in wall.items()}
    cpu_rate = {name: n / statistics.median(s) for name, s in cpu.items()}
    result = {
        "preset": args.preset,
        "parameters": model.num_parameters(),
        "vocab_size": config.vocab_size,
        "prompt_length": args.prompt_length,
        "new_tokens": n,
        "rounds": args.rounds,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else cpu_name(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "tokens_per_s": {k: round(v, 1) for k, v in rate.items()},
        "tokens_per_cpu_s": {k: round(v, 1) for k, v in cpu_rate.items()},
        "cache_over_no_cache": round(rate["cache"] / rate["no_cache"], 2),
    }
    if "transformers" in rate:
        result["transformers"] = transformers.__version__
        result["cache_over_transformers"] = round(rate["cache"] / rate["transformers"], 2)
        result["cache_over_transformers_cpu_s"] = round(
            cpu_rate["cache"] / cpu_rate["transformers"], 2
        )
        # Greedy on identical weights: the same tokens, or the comparison is not like for like.
        result["same_tokens_as_transformers"] = tokens["cache"] == tokens["transformers"]
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
