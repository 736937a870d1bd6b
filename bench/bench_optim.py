"""The optimizer step alone: Muon (ours, on the hidden matrices, with AdamW on the rest) against
AdamW on everything, on the `base` preset's parameters (vocab 8192: 110M parameters).

    python bench/bench_optim.py --json bench/results/optim-cpu.json
    python bench/bench_optim.py --device cuda --json bench/results/optim-cuda.json

Contenders (``--contenders``, each built as train.py builds it, `build_optimizer`):
- ``muon``: train.py's Muon: same-shaped matrices orthogonalized together (one batched product
  per Newton-Schulz iteration), Newton-Schulz in the run's dtype (``--dtype``);
- ``muon-per-matrix``: the same update, each matrix orthogonalized by its own loop of products
  (how torch.optim.Muon, and this project before the batching, computes it);
- ``muon-compiled``: train.py's Muon with its Newton-Schulz through torch.compile (train.py's
  where it compiles its layers: on CUDA by default); a contender by default on CUDA only (a cold
  compile costs about a minute on a CPU; ``--contenders`` names it there);
- ``adamw-foreach`` and ``adamw-fused``: torch's AdamW implementations (fused: train.py's on CUDA).
Every parameter gets a fixed random gradient; each contender takes one untimed step, then the
contenders take turns for ``--rounds`` rounds (a shared machine's load falls on all alike); the
fastest and the median step of each are reported. One process: under DDP and FSDP each rank
orthogonalizes only its share of each stack of matrices (muon.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_generate import cpu_name  # noqa: E402

from llama_ddp.model.config import preset  # noqa: E402
from llama_ddp.model.llama import LlamaForPretraining  # noqa: E402
from llama_ddp.precision import DTYPE_NAMES, DTYPES, training_dtype  # noqa: E402
from llama_ddp.train import muon  # noqa: E402
from llama_ddp.train.optim import build_optimizer  # noqa: E402

EAGER = ("muon", "muon-per-matrix", "adamw-foreach", "adamw-fused")
CONTENDERS = (*EAGER, "muon-compiled")


class PerMatrixMuon(muon.Muon):
    """Our Muon with each matrix orthogonalized alone: the loop this project ran before."""

    def _orthogonalized(self, updates, param, group):
        ns = (group["ns_coefficients"], group["ns_steps"], group["eps"])
        return [muon.orthogonalize(u[None], self.ns_dtype, *ns)[0] for u in updates]


def build(name: str, model: torch.nn.Module, dtype: torch.dtype):
    if name.startswith("adamw"):
        fused = name == "adamw-fused"
        return build_optimizer(model, lr=1e-3, weight_decay=0.1, name="adamw", fused=fused)
    compiled = name == "muon-compiled"
    opt = build_optimizer(
        model, lr=4e-3, weight_decay=0.1, name="muon", dtype=dtype, compiled=compiled
    )
    if name == "muon-per-matrix":
        matrices = opt.optimizers[0]
        matrices.__class__ = PerMatrixMuon  # the same optimizer, its step per matrix
    return opt


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="base")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPES],
        help="the run's compute dtype, which Muon's Newton-Schulz follows (auto: train.py's)",
    )
    p.add_argument("--rounds", type=int, default=5, help="timed steps of each contender")
    p.add_argument("--contenders", default=None, help="default: all on CUDA, all eager on CPU")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype, why = training_dtype(args.dtype, device)
    names = (args.contenders or ",".join(CONTENDERS if device.type == "cuda" else EAGER)).split(",")
    torch.manual_seed(0)
    config = preset(args.preset, vocab_size=args.vocab_size)
    models, optimizers = {}, {}
    for name in names:
        model = LlamaForPretraining(config).to(device)
        for param in model.parameters():
            param.grad = torch.randn_like(param) * 1e-3
        models[name], optimizers[name] = model, build(name, model, dtype)
    for opt in optimizers.values():  # the warm-up: state allocated, kernels chosen (compiled)
        opt.step()
    sync(device)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name, opt in optimizers.items():
            start = time.perf_counter()
            opt.step()
            sync(device)
            seconds[name].append(time.perf_counter() - start)
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    params = sum(p.numel() for p in next(iter(models.values())).parameters())
    print(
        f"{args.preset} preset ({params / 1e6:.0f}M parameters), {machine}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}; run dtype "
        f"{DTYPE_NAMES[dtype]} ({why}); {args.rounds} interleaved rounds"
    )
    figures = {}
    for name in names:
        fastest, median = min(seconds[name]), statistics.median(seconds[name])
        figures[name] = {"fastest_s": fastest, "median_s": median, "all_s": seconds[name]}
        print(f"  {name:16s} fastest {fastest * 1e3:9.1f} ms   median {median * 1e3:9.1f} ms")
    if args.json:
        doc = {
            "machine": machine,
            "threads": torch.get_num_threads(),
            "load_average": os.getloadavg(),
            "torch": torch.__version__,
            "preset": args.preset,
            "parameters": params,
            "dtype": DTYPE_NAMES[dtype],
            "rounds": args.rounds,
            "contenders": figures,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
