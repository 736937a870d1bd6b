"""Time to the first optimizer step on a cold token cache, and the host memory of the run.

    python bench/bench_first_step.py --tokenizer tok.json c4mb.jsonl c400mb.jsonl c4gb.jsonl
    python bench/bench_first_step.py --root /path/to/another/checkout ...   # another version

Each corpus gets a fresh cache folder and run folder: ``train.py --max-steps N --log-every 1``
(from ``--root``, with it on PYTHONPATH) starts, and the seconds to its ``step 1:`` line are the
time to the first optimizer step (imports, corpus, token cache and the step itself); to its first
line (``N layers, ...``), when its data is ready. The run is
then left to train for ``--watch`` seconds more (or until ``--timeout`` before its first step),
while the resident memory of its whole process tree (train.py, the cache builder and its workers)
is sampled from /proc every half second; then the run is stopped by its PID (SIGKILL, as a crash
would) and waited for. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def tree_memory(pid: int) -> dict[str, int]:
    """RssAnon and RssFile (bytes) summed over ``pid`` and its descendants, and their count."""
    tree, todo, total = _children(), [pid], {"anon": 0, "file": 0, "processes": 0}
    while todo:
        p = todo.pop()
        todo += tree.get(p, [])
        try:
            status = Path(f"/proc/{p}/status").read_text().splitlines()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status if ":" in line)
        total["anon"] += int(fields.get("RssAnon", "0 kB").split()[0]) * 1024
        total["file"] += int(fields.get("RssFile", "0 kB").split()[0]) * 1024
        total["processes"] += 1
    return total


def run_one(args: argparse.Namespace, corpus: Path, tmp: Path) -> dict:
    cmd = [
        sys.executable, str(args.root / "train.py"), "--preset", args.preset,
        "--dataset", str(corpus), "--tokenizer", str(args.tokenizer),
        "--seq-length", str(args.seq_length), "--batch-size", str(args.batch_size),
        "--max-steps", str(args.max_steps), "--log-every", "1", "--no-export-hf",
        "--out-dir", str(tmp / "out"), "--cache-dir", str(tmp / "cache"),
        *shlex.split(args.train_args),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(args.root), "HF_HUB_OFFLINE": "1"}
    env["HF_DATASETS_OFFLINE"] = "1"
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    samples: list[dict] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.5):
            samples.append({"t": time.perf_counter() - start, **tree_memory(proc.pid)})

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    first, ready, steps, lines = None, None, 0, []
    deadline = start + args.timeout

    def watchdog() -> None:
        while proc.poll() is None:
            now = time.perf_counter()
            if (first is None and now > deadline) or (first and now > start + first + args.watch):
                proc.send_signal(signal.SIGKILL)
                return
            time.sleep(0.2)

    threading.Thread(target=watchdog, daemon=True).start()
    for line in proc.stdout:
        lines.append(line.rstrip())
        if ready is None and " parameters | mode " in line:  # the run's first line: data ready
            ready = time.perf_counter() - start
        if line.startswith("step "):
            steps += 1
            if first is None:
                first = time.perf_counter() - start
    proc.wait()
    done.set()
    sampler.join()
    end = time.perf_counter() - start
    return {
        "corpus": str(corpus),
        "corpus_bytes": corpus.stat().st_size,
        "data_ready_s": ready,
        "first_step_s": first,
        "steps_logged": steps,
        "seconds": end,
        "timed_out": first is None,
        "exit": proc.returncode,
        "peak_anon_bytes": max((s["anon"] for s in samples), default=0),
        "peak_file_bytes": max((s["file"] for s in samples), default=0),
        "max_processes": max((s["processes"] for s in samples), default=0),
        "memory_samples": samples,
        "tail": lines[-3:],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("corpora", type=Path, nargs="+")
    p.add_argument("--tokenizer", type=Path, required=True)
    p.add_argument("--root", type=Path, default=ROOT, help="the checkout whose train.py runs")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-steps", type=int, default=1000)
    p.add_argument("--watch", type=float, default=0.0, help="seconds to keep training after step 1")
    p.add_argument(
        "--timeout", type=float, default=600.0, help="give up on a first step after this"
    )
    p.add_argument("--tmp", type=Path, default=None, help="where the caches go (default: $TMPDIR)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--train-args", default="", help="more train.py flags, as one string")
    args = p.parse_args()
    args.root = args.root.resolve()
    results = []
    for corpus in args.corpora:
        with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
            r = run_one(args, corpus.resolve(), Path(tmp))
        results.append(r)
        first = f"{r['first_step_s']:.1f} s" if r["first_step_s"] else f"> {args.timeout:.0f} s"
        ready = f"{r['data_ready_s']:.1f} s" if r["data_ready_s"] else "-"
        print(
            f"{corpus.name}: {r['corpus_bytes'] / 1e6:,.0f} MB, data ready {ready}, "
            f"first step {first}, "
            f"{r['steps_logged']} steps in {r['seconds']:.0f} s, peak memory "
            f"{r['peak_anon_bytes'] / 2**20:,.0f} MiB anonymous + "
            f"{r['peak_file_bytes'] / 2**20:,.0f} MiB file-backed over {r['max_processes']} "
            "processes",
            flush=True,
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {"root": str(args.root), "cpu_count": os.cpu_count(), "results": results}
        args.json.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
