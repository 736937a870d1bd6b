"""bench/bench_train.py: the tiny preset end to end (JSON fields, equal starts), and the article
baseline computing the same function as llama_ddp's model; bench_time_to_loss's reading of a
run's curve."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llama_ddp.model.config import preset
from llama_ddp.model.llama import LlamaForPretraining, flops_per_token

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _load(name: str):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_article_model_matches_ours_on_real_tokens():
    article = _load("article_model")
    config = preset("tiny", vocab_size=97)
    torch.manual_seed(0)
    ours = LlamaForPretraining(config).eval()
    theirs = article.LlamaForPretraining(config).eval()
    state = {k: v for k, v in ours.state_dict().items() if "rotary_emb" not in k}
    theirs.load_state_dict(state, strict=True)
    pad = 2
    x = torch.randint(3, 97, (3, 20))
    x[1, 12:] = pad  # right padding: the explicit mask hides it, the causal mask alone suffices
    with torch.no_grad():
        a, b = ours(x), theirs(x, article.create_attention_mask(x, pad))
    real = x != pad
    torch.testing.assert_close(a[real], b[real], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(b).all()  # no fully masked row: position 0 is never padding


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("packing", ["pack", "pad"])
def test_bench_train_tiny_json(train_env, tmp_path, restore_threads, packing):
    pytest.importorskip("transformers")
    bench = _load("bench_train")
    out = tmp_path / "bench.json"
    argv = [
        "--preset", "tiny", "--seq-length", "32", "--batch-size", "4", "--micro-batch-size", "2",
        "--steps", "1", "--rounds", "2", "--warmup", "1", "--peak-tflops", "1", "--threads", "1",
        "--dataset", str(train_env["corpus"]), "--tokenizer", str(train_env["tokenizer"]),
        "--cache-dir", str(train_env["root"] / "cache"), "--no-train-py", "--json", str(out),
        "--packing", packing,
    ]  # fmt: skip
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())

    config = preset("tiny", vocab_size=result["model_config"]["vocab_size"])
    fpt = flops_per_token(config, 32)
    assert result["flops_per_token"] == fpt
    assert result["peak_flops"] == 1e12
    assert result["positions_per_step"] == 4 * 32
    rows = result["contenders"]
    # In pack mode ours keeps documents apart; ours+causal, transformers and the article train
    # plain causal windows. In pad mode a row is one document for all.
    plain = ["ours+causal", "transformers", "article"] if packing == "pack" else list(rows)
    assert list(rows) == (["ours", *plain] if packing == "pack" else ["ours", *plain[1:]])
    assert set(result["ratios"]) == {f"ours/{name}" for name in rows if name != "ours"}
    for name, r in rows.items():
        assert len(r["rounds"]) == 2, name
        assert r["tokens_per_s"] > 0
        assert r["mfu"] == pytest.approx(r["flops_per_token"] * r["tokens_per_s"] / 1e12)
        # Model FLOPs as train.py counts them: attention per row for causal windows, per
        # document for ours in pack mode and for every contender in pad mode.
        if packing == "pad":
            assert r["flops"] == rows["ours"]["flops"] < r["tokens"] * fpt
        elif name != "ours":
            assert r["flops"] == r["tokens"] * fpt
        assert 0 <= r["data_fraction"] < 1
        assert r["first_step_s"] > 0 and r["setup_s"] > 0
        assert math.isfinite(r["last_step_loss"])
        assert r["max_memory_allocated"] is None  # CPU
        # Same initial weights and same first batch (in pad mode cut after its longest document
        # for ours and transformers, not for the article): the same loss, whatever the path.
        # (The article averages each micro-batch's mean: in pad mode, where micro-batches hold
        # unequal numbers of targets, its loss is another number.)
        if name in plain and (packing == "pack" or name != "article"):
            assert r["first_step_loss"] == pytest.approx(
                rows[plain[0]]["first_step_loss"], rel=1e-5
            )
    if packing == "pack":  # documents apart: less attention, no targets across documents
        ours, causal = rows["ours"], rows["ours+causal"]
        assert ours["flops"] < causal["flops"] and ours["tokens"] < causal["tokens"]
        assert ours["last_step_loss"] != causal["last_step_loss"]
    # Each contender's settings say the attention it ran: ours the CPU kernel on its grids.
    spans = "documents" if packing == "pack" else "rows' real tokens"
    assert f"CPU flash kernel, is_causal on {spans} bucketed into grids" in rows["ours"]["settings"]
    assert packing == "pad" or "is_causal+GQA on whole rows" in rows["ours+causal"]["settings"]
    sdpa = "aten::_scaled_dot_product_flash_attention_for_cpu"
    assert sdpa in rows["ours"]["attention_kernels"]
    assert packing == "pad" or sdpa in rows["ours+causal"]["attention_kernels"]
    assert sdpa in rows["transformers"]["attention_kernels"]
    assert "aten::_softmax" in rows["article"]["attention_kernels"]
    assert not any("scaled_dot_product" in k for k in rows["article"]["attention_kernels"])


@pytest.mark.e2e
def test_train_py_first_step_is_read_from_its_log(train_env, tmp_path):
    bench = _load("bench_train")
    args = bench.parse_args(
        ["--preset", "tiny", "--seq-length", "32", "--batch-size", "4",
         "--dataset", str(train_env["corpus"]), "--cache-dir", str(train_env["root"] / "cache")]
    )  # fmt: skip
    timing = bench.train_py_first_step(args, train_env["tokenizer"], tmp_path / "out")
    assert 0 < timing["first_step_s"] < timing["exit_s"]
    assert "--max-steps" in timing["command"]


def test_memory_bench_counts_parameters_as_the_model_does():
    bench = _load("bench_memory")
    for name in ("tiny", "small"):
        config = preset(name, vocab_size=97)
        expected = LlamaForPretraining(config).num_parameters()
        assert bench.computed(config)["parameters"] == expected
    table = bench.computed(preset("tiny", vocab_size=97))["per_rank"]
    n = LlamaForPretraining(preset("tiny", vocab_size=97)).num_parameters()
    assert table["ddp x8"] == {"weights": 4 * n, "gradients": 4 * n, "AdamW state": 8 * n}
    assert table["fsdp x8"]["AdamW state"] == 8 * n / 8


def test_bench_attention_tiny(train_env, tmp_path, restore_threads):
    """The layouts it compares compute the same attention (it checks), and it reports them all."""
    bench = _load("bench_attention")
    out = tmp_path / "attention.json"
    argv = [
        "--preset", "tiny", "--seq-length", "48", "--batch-size", "4", "--batches", "2",
        "--rounds", "2", "--threads", "1", "--dataset", str(train_env["corpus"]),
        "--tokenizer", str(train_env["tokenizer"]), "--cache-dir", str(train_env["root"] / "cache"),
        "--json", str(out),
    ]  # fmt: skip
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert set(result["ms"]) == {"causal", "buckets", "pow2", "one-grid", "dense"}
    assert result["ratios"]["causal"] == 1.0 and all(v > 0 for v in result["ms"].values())
    assert 0 < result["work"] < 1  # short documents: far less attention than whole rows


def test_time_to_loss_reads_a_runs_own_accounting_and_interpolates(tmp_path):
    """bench_time_to_loss: a recipe's time to L0 is the training seconds (steps and data, not
    evaluation) of its first evaluation at or under L0, and interpolated linearly in loss from
    the one before; an unfinished run (no closing time line) is not read."""
    bench = _load("bench_time_to_loss")
    lines = [
        {"step": 0, "dtype": "fp32", "dtype_reason": "auto"},
        {"step": 0, "val_loss": 9.0, "time": {"train_s": 0.0, "data_s": 0.5, "eval_s": 0.0}},
        {"step": 10, "loss": 5.0},
        {"step": 10, "val_loss": 5.0, "time": {"train_s": 20.0, "data_s": 0.5, "eval_s": 3.0}},
        {"step": 20, "val_loss": 4.0, "time": {"train_s": 40.0, "data_s": 0.5, "eval_s": 6.0}},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert bench.curve(tmp_path) is None  # still running
    end = {"step": 20, "time": {"train_s": 40.0, "eval_s": 9.0, "save_s": 1.0, "data_s": 0.5}}
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(end) + "\n")
    points, spent = bench.curve(tmp_path)
    assert points == [(0, 0.5, 9.0), (10, 20.5, 5.0), (20, 40.5, 4.0)] and spent == end["time"]
    reached = bench.time_to(points, 4.25)
    assert reached["step"] == 20 and reached["seconds"] == 40.5
    assert reached["interpolated_s"] == pytest.approx(20.5 + 0.75 * 20)
    assert reached["interpolated_step"] == pytest.approx(17.5)
    assert bench.time_to(points, 3.0) is None


def test_bench_optim_tiny_json(tmp_path, restore_threads):
    """bench_optim on the tiny preset: every contender timed each round, in the JSON; its
    per-matrix Muon is the same update as the batched one (1e-6, fp32)."""
    bench = _load("bench_optim")
    out = tmp_path / "optim.json"
    argv = ["--preset", "tiny", "--vocab-size", "64", "--device", "cpu", "--dtype", "fp32"]
    assert bench.main([*argv, "--rounds", "2", "--threads", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["contenders"]) == set(bench.EAGER) and doc["dtype"] == "fp32"  # CPU: eager
    assert all(len(c["all_s"]) == 2 and c["fastest_s"] > 0 for c in doc["contenders"].values())
    torch.manual_seed(0)
    models = [LlamaForPretraining(preset("tiny", vocab_size=64)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    start = {k: v.clone() for k, v in models[0].state_dict().items()}
    grads = [torch.randn_like(p) for p in models[0].parameters()]
    for model in models:
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
    batched, per_matrix = (
        bench.build(n, m, torch.float32) for n, m in zip(bench.CONTENDERS, models)
    )
    assert type(per_matrix.optimizers[0]).__name__ == "PerMatrixMuon"
    for opt in (batched, per_matrix):
        opt.step()
    ours, theirs = models[0].state_dict(), models[1].state_dict()
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) < 1e-6
    assert max((ours[k] - start[k]).abs().max().item() for k in ours) > 1e-3  # a step was taken


def test_bench_run_reads_a_runs_figures_from_its_metrics():
    """bench_run.py's figures of one train.py run: steady state from the second half's step
    lines, the first step's excess over a steady step, data wait's share of the loop, the
    mid-run checkpoint's blocking and total seconds, the peak memory."""
    bench = _load("bench_run")
    lines = [
        {"step": s, "loss": 5.0, "tokens": 1000 * s, "tokens_per_s": tps, "mfu": tps / 1e4,
         "max_memory_allocated": 2**30 * s}
        for s, tps in ((5, 500.0), (10, 800.0), (15, 1000.0), (20, 1000.0))
    ]  # fmt: skip
    records = [
        {"step": 0, "dtype": "bf16"},
        {"step": 1, "first_step_s": 3.0, "process_s": 9.0},
        *lines[:2],
        {"step": 10, "checkpoint": "checkpoints/step-00000010", "save_s": 2.0,
         "save_blocked_s": 0.25},
        *lines[2:],
        {"step": 20, "checkpoint": "checkpoints/step-00000020", "save_s": 1.5,
         "save_blocked_s": 1.5},
        {"step": 20, "time": {"train_s": 18.0, "eval_s": 0.5, "save_s": 1.5, "data_s": 0.4,
                              "total_s": 20.4}},
    ]  # fmt: skip
    r = bench.summarize(records, steps=20, wall_s=30.0)
    assert (r["tokens_per_s"], r["mfu"]) == (1000.0, 0.1)  # steps 15 and 20
    assert r["early_tokens_per_s"] == 800.0 and r["early_window"] == [6, 10]
    assert r["step_s"] == 1.0 and r["compile_s"] == 2.0  # 5000 tokens at 1000/s over 5 steps
    assert r["first_step_s"] == 9.0  # since the process started
    assert r["data_wait_share"] == pytest.approx(0.4 / 20.4)
    assert (r["checkpoint_blocked_s"], r["checkpoint_s"], r["final_checkpoint_s"]) == (
        0.25,
        2.0,
        1.5,
    )
    assert r["max_memory_allocated"] == 20 * 2**30
    assert "1,000" in bench.table({"defaults": r})


def test_bench_run_warms_the_cache_with_one_tiny_step_at_the_runs_length(tmp_path):
    """The cache-warming run takes the measured runs' data flags (the same cache) but one step of
    the tiny preset, with positions for their sequence length (make bench-gpu's 1024 > tiny's)."""
    bench = _load("bench_run")
    args = bench.parse_args(["--device", "cuda", "--seq-length", "1024", "--batch-size", "64"])
    warm, run = bench.warm_command(args, tmp_path / "w"), bench.command(args, tmp_path / "r", [])
    flags = {f: warm[warm.index(f) + 1] for f in ("--preset", "--max-steps", "--seq-length")}
    assert flags == {"--preset": "tiny", "--max-steps": "1", "--seq-length": "1024"}
    assert warm[warm.index("--max-position-embeddings") + 1] == "1024"
    assert run[run.index("--preset") + 1] == "base" and "--max-position-embeddings" not in run


def test_bench_loss_tiny_json(tmp_path):
    """bench_loss on a small shape: each contender's peak (a process of its own) and times in the
    JSON; the chunked loss's peak is well under the whole logits' (128 MiB of fp32 logits here,
    held with their log-softmax and their gradient; the chunks, 512 tokens each on the CPU, hold
    8 MiB at a time); before issue 59's chunks, 4096 tokens each, side by side."""
    bench = _load("bench_loss")
    out = tmp_path / "loss.json"
    argv = ["--device", "cpu", "--tokens", "8192", "--hidden", "64", "--vocab", "4096"]
    argv += ["--contenders", "whole,before,chunked"]  # compiled: a compile (test_loss.py)
    assert bench.main([*argv, "--rounds", "2", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    (run,) = doc["runs"]
    assert run["shape"] == {"tokens": 8192, "hidden": 64, "vocab": 4096}
    figures = run["contenders"]
    assert set(figures) == {"whole-fp32", "before-fp32", "chunked-fp32"}
    assert all(len(c["all_s"]) == 2 and c["fastest_s"] > 0 for c in figures.values())
    assert all(0 < c["outside_products_s"] < c["median_s"] for c in figures.values())
    assert figures["whole-fp32"]["peak_bytes"] > 256 * 2**20
    assert figures["chunked-fp32"]["peak_bytes"] < figures["whole-fp32"]["peak_bytes"] / 2
    assert figures["chunked-fp32"]["peak_bytes"] < figures["before-fp32"]["peak_bytes"]


def test_emulate_avx2_hook_turns_bf16_off_where_asked(tmp_path):
    """bench/emulate_avx2.py's hook, run at a new interpreter's start as its .pth runs it: with
    its variable, torch's bf16 probes are the hook's and say no, and oneDNN is off."""
    emulate = _load("emulate_avx2")
    (tmp_path / f"{emulate.MODULE}.py").write_text(emulate.HOOK)
    probe = (
        f"import {emulate.MODULE}, torch; "
        "print(torch.cpu._is_avx512_bf16_supported(), torch.cpu._is_amx_tile_supported(), "
        "torch.backends.mkldnn.enabled, torch.cpu._is_avx512_bf16_supported.__module__)"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path), **emulate.ENV}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["False", "False", "False", emulate.MODULE], out.stderr
    assert emulate.main(["bad"]) == 2
