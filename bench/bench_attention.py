"""Attention that keeps packed documents apart: the layouts llama_ddp could use, timed alike.

    python bench/bench_attention.py --json bench/results/attention-cpu.json
    python bench/bench_attention.py --seq-length 1024 --batch-size 8 --dataset sample-paragraphs

One attention layer of the preset (forward + backward of RoPE, attention and the layout's own
moves, from flat (N, ...) q, k, v in the order the model's per-token layers have them) on the
document layouts of real packed batches of the cached corpus, by:
  causal    plain causal SDPA on the (B, T) rows: --no-document-mask (documents see each other)
  buckets   llama_ddp's attention plan and operator: each document a grid row, rows grouped by
            width (a quarter octave), one causal CPU flash-attention call per width
  pow2      the same with widths rounded up to powers of two (fewer calls, more padding)
  one-grid  every document a row of one (documents, longest) grid, one SDPA call
  dense     SDPA on the (B, T) rows with a (B, 1, T, T) block-diagonal causal mask, RoPE
            positions restarting per document
The exact ones are checked equal to each other first. The methods take turns, round after round,
the order rotating; each figure is a method's median round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_train import prepare  # noqa: E402

from llama_ddp.attention_plan import plan as layout_mod  # noqa: E402
from llama_ddp.attention_plan.plan import plan_attention, segment_lengths  # noqa: E402
from llama_ddp.distributed import runtime as D  # noqa: E402
from llama_ddp.model.config import LlamaConfig  # noqa: E402
from llama_ddp.model.llama import LlamaAttention, RotaryEmbedding, apply_rope  # noqa: E402
from llama_ddp.train.config import TrainConfig  # noqa: E402
from llama_ddp.train.run import run_data  # noqa: E402


def pow2_widths(lengths: torch.Tensor, limit: int) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(lengths.double()))).long().clamp(16, limit)


def longest_widths(lengths: torch.Tensor, limit: int) -> torch.Tensor:
    return torch.full_like(lengths, int(lengths.max()))


def grid_method(widths):
    """An attention plan whose document rows have these widths (None: llama_ddp's); q, k, v
    enter in its token order, as the model's per-token layers hand them over."""

    def prepare(ids, q, k, v):
        original = layout_mod.bucket_widths
        layout_mod.bucket_widths = widths or original
        try:
            plan = plan_attention(ids.shape, document_ids=ids)
        finally:
            layout_mod.bucket_widths = original
        qkv = [plan.tokens(x.detach().view(*ids.shape, -1)).requires_grad_() for x in (q, k, v)]
        return plan, qkv

    def run(attn, rope, plan, q, k, v):
        return attn._attend_tokens(q, k, v, plan.rope(rope), plan)

    def restore(plan, out):
        return plan.restore(out)

    return prepare, run, restore


def rows_prepare(ids, q, k, v):
    return ids, [x.detach().requires_grad_() for x in (q, k, v)]


def causal(attn, rope, ids, q, k, v):
    b, t = ids.shape
    return attn._attend(q.view(b, t, -1), k.view(b, t, -1), v.view(b, t, -1), rope).flatten(0, 1)


def dense(attn, rope, ids, q, k, v):
    """Block-diagonal causal mask; each token's RoPE position counted from its document's start."""
    b, t = ids.shape
    h, kv, d = attn.n_heads, attn.n_kv_heads, attn.head_dim
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    column = torch.arange(t).expand(b, t)
    first = torch.where(starts, column, 0).cummax(1).values
    cos, sin = (table[column - first].unsqueeze(1) for table in rope)  # (B, 1, T, D)
    q = apply_rope(q.view(b, t, h, d).transpose(1, 2), cos, sin)
    k = apply_rope(k.view(b, t, kv, d).transpose(1, 2), cos, sin)
    v = v.view(b, t, kv, d).transpose(1, 2)
    mask = (ids[:, :, None] == ids[:, None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
    y = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask.unsqueeze(1), enable_gqa=True
    )
    return y.transpose(1, 2).reshape(b * t, h * d)


def as_is(ids, out):
    return out


METHODS = {
    "causal": (rows_prepare, causal, as_is),
    "buckets": grid_method(None),
    "pow2": grid_method(pow2_widths),
    "one-grid": grid_method(longest_widths),
    "dense": (rows_prepare, dense, as_is),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--batches", type=int, default=4, help="distinct batches, cycled")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--dataset", default="sample", help="as bench_train.py's")
    p.add_argument("--tokenizer", default=None, help="default: tokenizer/tokenizer.json if any")
    p.add_argument("--cache-dir", type=Path, default=None, help="default: llama_ddp's cache")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    args.contenders, args.packing, args.device = "", "pack", "cpu"
    prepare(args)  # bench_train's defaults: threads, cache, tokenizer, sample-paragraphs
    return args


def document_ids(args: argparse.Namespace) -> tuple[LlamaConfig, list[torch.Tensor]]:
    """The model's shape and the document ids of the first packed batches, as train.py has them."""
    cfg = TrainConfig.from_flags(
        preset=args.preset, dataset=args.dataset, tokenizer=args.tokenizer,
        seq_length=args.seq_length, max_position_embeddings=max(args.seq_length, 512),
        batch_size=args.batch_size, cache_dir=str(args.cache_dir),
    )  # fmt: skip
    data = run_data(cfg, D.setup("single", "cpu"))
    batches = data.batches(0)
    return cfg.model_config(data.vocab_size), [
        next(batches)[0].document_ids for _ in range(args.batches)
    ]


def measure(config: LlamaConfig, ids: list[torch.Tensor], rounds: int) -> dict[str, list[float]]:
    """Seconds per batch of each method, round by round (the exact methods checked first)."""
    torch.manual_seed(0)
    t = ids[0].shape[1]
    attn, rope = LlamaAttention(config, 0), RotaryEmbedding(config)(0, t)
    n, c = ids[0].numel(), config.hidden_size
    kv = config.num_key_value_heads * config.head_dim
    q, k, v = (torch.randn(n, w) for w in (c, kv, kv))
    grad = torch.randn(n, c)
    # Inputs in each method's order, made before the clock runs; the exact methods must agree.
    inputs = {name: [setup(i, q, k, v) for i in ids] for name, (setup, _, _) in METHODS.items()}
    with torch.no_grad():
        outputs = {
            name: [restore(state, run(attn, rope, state, *qkv)) for state, qkv in inputs[name]]
            for name, (_, run, restore) in METHODS.items()
        }
    for name in ("pow2", "one-grid", "dense"):
        for got, expected in zip(outputs[name], outputs["buckets"]):
            torch.testing.assert_close(got, expected)
    times = {name: [] for name in METHODS}
    names = list(METHODS)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            run = METHODS[name][1]
            start = time.perf_counter()
            for state, qkv in inputs[name]:
                torch.autograd.grad(run(attn, rope, state, *qkv), qkv, grad)
            times[name].append((time.perf_counter() - start) / len(ids))
    return times


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config, ids = document_ids(args)
    times = measure(config, ids, args.rounds)
    start = time.perf_counter()
    for i in ids:
        plan_attention(i.shape, document_ids=i)
    build_ms = 1000 * (time.perf_counter() - start) / len(ids)
    lengths = torch.cat([segment_lengths(i.shape, document_ids=i) for i in ids])
    work = float((lengths * lengths).sum()) / sum(i.shape[0] * i.shape[1] ** 2 for i in ids)
    ms = {name: 1000 * statistics.median(t) for name, t in times.items()}
    ratios = {
        name: statistics.median(a / b for a, b in zip(t, times["causal"]))
        for name, t in times.items()
    }
    print(
        f"{args.preset}, {args.batch_size} x {args.seq_length}, {args.dataset}: "
        f"{len(lengths) / len(ids):.1f} documents per batch, sum L^2 / (B T^2) = {work:.3f}, "
        f"{torch.get_num_threads()} threads, median of {args.rounds} rounds; a plan's build "
        f"(once per batch, in the loader) {build_ms:.2f} ms"
    )
    for name, value in ms.items():
        print(f"  {name:9} {value:8.2f} ms   {ratios[name]:5.2f}x causal (paired by round)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        result = {"args": {k: str(v) for k, v in vars(args).items()}, "ms": ms}
        result.update(ratios=ratios, work=work, layout_build_ms=build_ms, rounds=times)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
