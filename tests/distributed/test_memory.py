"""--micro-batch-size auto (distributed/memory.py): the search against stated budgets, the probe,
the banner and refusal lines, and runs that choose their micro-batch."""

import signal

import pytest
import torch

from llama_ddp.distributed import memory
from llama_ddp.distributed.memory import (
    GIB,
    OPTIMIZER_BYTES,
    Fit,
    MemoryModel,
    choose_micro_batch,
    estimate,
    host_available,
    measure,
    parse_size,
    probe_batch,
    wants_auto,
)
from llama_ddp.distributed.parallelize import build_model
from llama_ddp.errors import UserError
from llama_ddp.model.config import preset
from llama_ddp.precision import Precision
from llama_ddp.train.cli import main as train_main
from llama_ddp.train.cli import parse_train_args
from tests.helpers.runs import load_weights, max_diff, run_forked, run_train, tiny_args, train_here

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize(
    "per_rank, fixed, per_sample, budget, expected",
    [
        (64, 10, 1, 40, 16),  # 36 GiB usable: up to 26 fit, 16 is the largest divisor
        (48, 10, 1, 40, 24),  # batch 96 over 2 processes: 24 divides 48
        (64, 10, 1, 200, 64),  # everything fits: no accumulation
        (12, 1, 1, 6.7, 4),  # 6.03 usable: 5 would fit but does not divide 12
        (7, 1, 1, 7.8, 1),  # a prime per-rank batch: 1 or 7
        (8, 10, 1, 12.3, 1),  # 11.07 usable: exactly 1 (11 GiB) fits
        (8, 10, 1, 12.2, None),  # 10.98 usable: not even 1
    ],
)
def test_the_largest_dividing_micro_batch_within_the_budget_less_the_margin(
    per_rank, fixed, per_sample, budget, expected
):
    model = MemoryModel(fixed * GIB, per_sample * GIB)
    assert choose_micro_batch(per_rank, model, budget * GIB) == expected


def test_every_choice_divides_the_per_rank_batch_and_the_next_divisor_does_not_fit():
    model = MemoryModel(2 * GIB, 0.3 * GIB)
    for per_rank in range(1, 97):
        for budget in (3, 5, 9, 17, 33):
            m = choose_micro_batch(per_rank, model, budget * GIB)
            assert m is not None and per_rank % m == 0
            larger = [d for d in range(m + 1, per_rank + 1) if per_rank % d == 0]
            assert not larger or model.peak(larger[0]) > 0.9 * budget * GIB


def test_a_line_through_two_probes():
    line = MemoryModel.through(1, 3.0 * GIB, 2, 3.5 * GIB)
    assert (line.fixed, line.per_sample) == (2.5 * GIB, 0.5 * GIB)
    assert line.peak(16) == 10.5 * GIB


def test_the_banner_says_what_auto_chose_and_why():
    measured = Fit(16, MemoryModel(8.1 * GIB, 0.5 * GIB), 79.2 * GIB, "free", measured=True)
    assert measured.describe() == (
        "micro-batch 16 (auto: a step at 2 peaked at 9.10 GiB of 79.20 GiB free, the optimizer's "
        "states counted; 16 needs about 16.10 GiB and fits with a 10% margin)"
    )
    estimated = Fit(2, MemoryModel(1 * GIB, 1 * GIB), 5 * GIB, "available", measured=False)
    assert estimated.describe() == (
        "micro-batch 2 (auto: a step at 1 needs about 2.00 GiB beyond the weights (estimated "
        "from the shape) of 5.00 GiB available; 2 needs about 3.00 GiB and fits with a 10% margin)"
    )


def test_the_refusal_names_the_memory_and_the_flags_that_help():
    fit = Fit(None, MemoryModel(30 * GIB, 2 * GIB), 24 * GIB, "free", measured=True)
    helps = memory.helping_flags(False, "ddp", 2048)
    assert fit.refusal(torch.device("cuda", 0), helps) == (
        "a training step at micro-batch 1 needs 32.00 GiB on cuda:0, more than the 21.60 GiB "
        "usable of its 24.00 GiB free (try --activation-checkpointing, --mode fsdp, a shorter "
        "--seq-length (now 2048))"
    )
    assert memory.helping_flags(True, "fsdp", 1) == []
    # one process has nothing to shard over; a tiny budget is not '0.0 GiB'
    assert memory.helping_flags(True, "single", 48, world_size=1) == [
        "a shorter --seq-length (now 48)"
    ]
    tiny = Fit(None, MemoryModel(20 * 2**20, 1), 1024, "budgeted", measured=False)
    assert tiny.refusal(CPU, []).startswith(
        "a training step at micro-batch 1 needs 20.00 MiB on cpu, more than the 0.90 KiB "
        "usable of its 1.00 KiB budgeted ("
    )


def test_budget_sizes_and_the_hosts_available_memory(tmp_path):
    assert parse_size("20GiB") == 20 * GIB
    assert parse_size("512 MiB") == 512 * 2**20
    assert parse_size("1.5g") == int(1.5 * GIB)
    assert parse_size("1000") == 1000
    with pytest.raises(UserError, match="LLAMA_DDP_MEMORY_BUDGET='lots' is not a memory size"):
        parse_size("lots")
    assert parse_size("1073741824GiB") == 2**60  # 1 EiB, the most
    with pytest.raises(UserError) as error:
        parse_size("9" * 400)  # a float's infinity: an OverflowError before
    assert str(error.value) == (
        f"LLAMA_DDP_MEMORY_BUDGET='{'9' * 20}...' (400 characters) is more memory than any "
        "machine has (give at most 1,073,741,824 GiB, e.g. 20GiB)"
    )
    with pytest.raises(UserError, match="LLAMA_DDP_MEMORY_BUDGET='1073741825 GiB' is more memory"):
        parse_size("1073741825 GiB")
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemAvailable:   12345678 kB\n")
    assert host_available(meminfo) == 12345678 * 1024


def test_auto_is_asked_for_or_the_default_on_cuda_only():
    assert wants_auto("auto", CPU, "single") and wants_auto(None, CUDA, "ddp")
    assert not wants_auto(None, CPU, "single") and not wants_auto(8, CUDA, "single")
    assert not wants_auto(None, CUDA, "dp")  # DataParallel splits the micro-batch: as before
    assert wants_auto("auto", CPU, "dp")  # --mode dp on the CPU runs unwrapped
    with pytest.raises(UserError, match="--micro-batch-size auto does not work with --mode dp"):
        wants_auto("auto", CUDA, "dp")


def test_auto_or_a_number_from_the_flag_and_from_toml(tmp_path, capsys):
    assert parse_train_args(["--micro-batch-size", "auto"]).data.micro_batch_size == "auto"
    assert parse_train_args(["--micro-batch-size", "4"]).data.micro_batch_size == 4
    assert (
        parse_train_args([]).data.micro_batch_size is None
    )  # auto on CUDA, batch / processes else
    for value, expected in (('"auto"', "auto"), ("4", 4)):
        (tmp_path / "run.toml").write_text(f"micro-batch-size = {value}\n")
        cfg = parse_train_args(["--config", str(tmp_path / "run.toml")])
        assert cfg.data.micro_batch_size == expected
        assert cfg.data.micro_batch(world_size=2) == (16 if value == '"auto"' else 4)
    assert train_main(["--micro-batch-size", "-2"]) == 2
    assert capsys.readouterr().err == (
        "error: --micro-batch-size must be a positive integer or auto, got '-2'\n"
    )


def test_the_cpu_estimate_of_the_tiny_shape():
    config = preset("tiny", vocab_size=320)  # hidden 64, MLP 176, 2 layers, kv 2 x 16
    per_token = 2 * (10 * 64 + 3 * 32 + 4 * 176) + 64 + 4 * 320  # 4224 fp32 values
    model = estimate(config, 48, parameters=1000)
    assert model == MemoryModel(12 * 1000, 4 * 48 * per_token)


def test_the_probe_fits_its_peaks_and_changes_nothing(monkeypatch):
    """The CUDA probe, its memory readings mocked (no GPU here): the line through the two
    peaks plus the optimizer's states; the weights as they were and no gradient left."""
    model = build_model(preset("tiny", vocab_size=64), 0, CPU)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    peaks = iter([3 * GIB, 3.5 * GIB])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: next(peaks))
    shapes = []

    def make_batch(m):
        shapes.append(m)
        return probe_batch(m, 16, "pack", True)

    probe = measure(model, model, Precision(torch.float32, CPU), CPU, make_batch)
    params = sum(p.numel() for p in model.parameters())
    assert shapes == [1, 2] and probe == memory.Probe((3 * GIB, 3.5 * GIB))
    assert probe.model(params) == MemoryModel(2.5 * GIB + OPTIMIZER_BYTES * params, 0.5 * GIB)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_probe_out_of_memory_names_its_micro_batch_and_leaves_no_gradient(monkeypatch):
    model = build_model(preset("tiny", vocab_size=64), 0, CPU)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: GIB)
    real_loss = memory.batch_loss_sum

    def loss_that_runs_out_at_2(train_model, batch, precision):
        loss = real_loss(train_model, batch, precision)
        if batch.x.shape[0] == 2:
            loss.backward()  # gradients held when the device runs out
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return loss

    monkeypatch.setattr(memory, "batch_loss_sum", loss_that_runs_out_at_2)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    probe = measure(
        model, model, Precision(torch.float32, CPU), CPU, lambda m: probe_batch(m, 8, "pad", True)
    )
    assert probe == memory.Probe((GIB,), out_of_memory=2)
    assert all(p.grad is None for p in model.parameters())


def outcome(peaks, out_of_memory=None, budget=80 * GIB):
    probe = memory.Probe(peaks, out_of_memory)
    model = probe.model(0) if peaks else MemoryModel(0, 0)
    return memory.Outcome(probe, model, budget, "free")


def test_a_probe_out_of_memory_at_2_after_1_fit_takes_1_and_says_so():
    """Issue 53, item 3: before, the run stopped with 'try --micro-batch-size 1'."""
    chosen, line = memory.decide([outcome((70 * GIB,), 2)], 64, CUDA, ["--mode fsdp"])
    assert chosen == 1
    assert line == (
        "micro-batch 1 (auto: a step at 2 ran out of memory in the probe, a step at 1 peaked at "
        "70.00 GiB of 80.00 GiB free, the optimizer's states counted; accumulation keeps the "
        "global batch)"
    )


def test_every_rank_takes_the_smallest_choice_and_the_same_line():
    roomy, tight = outcome((2 * GIB, 3 * GIB)), outcome((2 * GIB, 3 * GIB), budget=4 * GIB)
    chosen, line = memory.decide([roomy, tight, roomy], 16, CUDA, [])
    assert chosen == 2 and line.startswith("micro-batch 2 (auto: a step at 2 peaked at 3.00 GiB")
    with pytest.raises(UserError) as err:
        memory.decide([roomy, outcome((), 1)], 16, CUDA, ["--activation-checkpointing"])
    assert str(err.value) == (
        "a training step at micro-batch 1 ran out of cuda's memory in --micro-batch-size auto's "
        "probe on rank 1 of 2 (try --activation-checkpointing)"
    )


def ranks_agreeing(rank: int, port: int, folder: str) -> None:
    """One of two gloo processes: rank 1's probe ran out of memory at 1, rank 0's fit; each
    writes what `agree` and `decide` told it, and when, into folder/rank{rank}.json."""
    import json
    import os
    import time
    from pathlib import Path

    import llama_ddp.distributed.parallelize as P

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
    )  # fmt: skip
    rt = P.runtime("ddp", "cpu")
    mine = outcome((GIB, 2 * GIB)) if rank == 0 else outcome((), 1)
    start = time.monotonic()
    try:
        said = str(memory.decide(memory.agree(rt, mine), 8, CUDA, []))
    except UserError as err:
        said = f"error: {err}"
    result = {"said": said, "seconds": time.monotonic() - start}
    Path(folder, f"rank{rank}.json").write_text(json.dumps(result))
    P.D.teardown(rt)


@pytest.mark.e2e
def test_a_rank_out_of_memory_in_the_probe_ends_every_rank_with_its_line(tmp_path):
    """Issue 53, item 9: every rank learns of it and ends with the same line, at once (before,
    the others waited in a collective until the timeout)."""
    import json

    from tests.helpers.runs import free_port, start_ranks

    start_ranks(ranks_agreeing, (free_port(), str(tmp_path)))
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert (
        results[0]["said"]
        == results[1]["said"]
        == (
            "error: a training step at micro-batch 1 ran out of cuda's memory in "
            "--micro-batch-size auto's probe on rank 1 of 2 (try a smaller model)"
        )
    )
    assert max(r["seconds"] for r in results) < 10


def test_fsdps_probe_out_of_memory_at_2_ends_its_rank_before_any_collective(monkeypatch):
    """Issue 58, item 5: FSDP's probe cannot run alone (each layer's weights are gathered from
    the peers), so a rank out of memory at micro-batch 2 ends at once with its line, before
    `agree`'s collective, which peers still inside the probe's collectives would never join.
    DDP's probe runs alone: the same outcome takes 1 on every rank. The CUDA calls mocked."""
    from types import SimpleNamespace

    from llama_ddp.distributed.runtime import Runtime

    model = build_model(preset("tiny", vocab_size=64), 0, CPU)
    monkeypatch.setattr(memory, "available_memory", lambda device: (80 * GIB, "free"))
    monkeypatch.setattr(memory.backends, "current_kernel", lambda device: "sdpa")
    monkeypatch.setattr(memory, "measure", lambda *a: memory.Probe((GIB,), out_of_memory=2))
    monkeypatch.setattr(memory, "agree", lambda rt, o: pytest.fail("a collective peers miss"))
    sampler = SimpleNamespace(global_batch=8)
    data = SimpleNamespace(seq_length=16, packing="pack", document_mask=True, sampler=sampler)
    args = (data, model, model, Precision(torch.float32, CPU), False)
    fsdp = Runtime("fsdp", CUDA, rank=1, world_size=2, multiprocess=True)
    with pytest.raises(UserError) as err:
        memory.micro_batch_choice(fsdp, *args)
    assert str(err.value) == (
        "a training step at micro-batch 2 ran out of cuda's memory in FSDP's probe on rank 1 of "
        "2 (give --micro-batch-size 1)"
    )
    monkeypatch.setattr(memory, "agree", lambda rt, o: [o, o])
    ddp = Runtime("ddp", CUDA, rank=1, world_size=2, multiprocess=True)
    chosen, line = memory.micro_batch_choice(ddp, *args)
    assert chosen == 1 and line.startswith("micro-batch 1 (auto: a step at 2 ran out of memory")


def test_the_grid_kernels_probe_the_layout_they_pad_most():
    """Issue 53, item 7: cudnn's and sdpa's grids pad packed documents (up to ~1.25x the
    tokens); their probe batch is the most padded layout, flash varlen's whole rows."""
    from llama_ddp.attention_plan.plan import bucket_widths

    assert bucket_widths(torch.tensor([33]), 1024).tolist() == [40]
    for kernel, ratio in (("varlen", 1.0), ("cudnn", 1.2), ("sdpa", 1.2)):
        plan = probe_batch(2, 1024, "pack", True, kernel).plan
        padded = int((plan.grids[:, 0] * plan.grids[:, 1]).sum())
        assert padded / 2048 >= ratio, kernel
    assert memory.padded_documents(100) == [33, 33, 33, 1]
    assert probe_batch(2, 64, "pad", True, "cudnn").computed.all()  # pad mode: one grid


def test_the_probe_batch_has_the_runs_shape():
    packed = probe_batch(3, 16, "pack", True)
    assert packed.x.shape == (3, 16) and packed.targets == 48 and packed.plan is not None
    assert probe_batch(2, 16, "pack", False).plan is None  # plain causal rows
    assert probe_batch(2, 16, "pad", True).computed.all()  # every position computed


@pytest.fixture
def stated_estimate(monkeypatch):
    """A stated CPU estimate, 1 GiB + 1 GiB a sequence: with a 5 GiB budget (4.5 usable) the
    tiny run's batch of 8 is 2 x 1 x 4."""
    monkeypatch.setattr(memory, "estimate", lambda *a: MemoryModel(1 * GIB, 1 * GIB))
    monkeypatch.setenv(memory.BUDGET_ENV, "5GiB")


@pytest.mark.e2e
def test_auto_accumulates_to_the_explicit_micro_batchs_weights(
    stated_estimate, train_env, tmp_path
):
    explicit, auto = tmp_path / "explicit", tmp_path / "auto"
    args = tiny_args(train_env, explicit, "--micro-batch-size", "2")
    assert train_here(train_env, args).returncode == 0
    result = train_here(train_env, tiny_args(train_env, auto, "--micro-batch-size", "auto"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "batch 8 = 2 x 1 x 4 accumulation" in result.stdout
    assert (
        "micro-batch 2 (auto: a step at 1 needs about 2.00 GiB beyond the weights (estimated "
        "from the shape) of 5.00 GiB budgeted (LLAMA_DDP_MEMORY_BUDGET); 2 needs about 3.00 GiB "
        "and fits with a 10% margin)" in result.stdout
    )
    # The same micro-batches, accumulated in the same order: equal up to fp32 rounding.
    assert max_diff(load_weights(auto), load_weights(explicit)) < 1e-6


@pytest.mark.e2e
def test_a_batch_that_fits_at_no_micro_batch_is_one_line(monkeypatch, train_env, tmp_path):
    monkeypatch.setenv(memory.BUDGET_ENV, "1KiB")
    result = train_here(train_env, tiny_args(train_env, tmp_path, "--micro-batch-size", "auto"))
    assert result.returncode == 2
    assert result.stderr.startswith("error: a training step at micro-batch 1 needs ")
    assert result.stderr.endswith(
        "usable of its 1.00 KiB budgeted (LLAMA_DDP_MEMORY_BUDGET) (try "
        "--activation-checkpointing, a shorter --seq-length (now 48))\n"
    )
    assert result.stderr.count("\n") == 1
    assert not list(tmp_path.glob("step-*"))


@pytest.mark.e2e
def test_a_run_resumes_exactly_at_another_micro_batch(stated_estimate, train_env, tmp_path):
    """The global batches are what a checkpoint keeps: a run saved at micro-batch 8 resumes at
    auto's 2 x 4 accumulation to the uninterrupted run's weights."""
    steps = ["--max-steps", "8", "--save-every", "4"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert train_here(train_env, tiny_args(train_env, whole, *steps)).returncode == 0
    env = {**train_env, "env": {**train_env["env"], "LLAMA_DDP_FAULT": "after-save:4"}}
    assert run_forked(env, tiny_args(train_env, resumed, *steps)).returncode == -signal.SIGKILL
    result = train_here(
        train_env, tiny_args(train_env, resumed, *steps, "--micro-batch-size", "auto")
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step-00000004" in result.stdout and "= 2 x 1 x 4 accumulation" in result.stdout
    # Accumulation sums the batch's gradients in another order: fp32 rounding apart.
    assert max_diff(load_weights(resumed), load_weights(whole)) < 1e-5


@pytest.mark.e2e
def test_every_rank_takes_the_same_choice_under_torchrun(train_env, tmp_path):
    """Two DDP processes on the CPU, the shape's own estimate, a budget between its steps at 2
    and at 4: each rank's share of the batch of 8 (4) is read 2 x 2 ranks x 2 accumulation."""
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(train_env["tokenizer"])).get_vocab_size()
    config = preset("tiny", vocab_size=vocab)
    line = estimate(config, 48, config.num_parameters())
    budget = (line.peak(2) + line.peak(4)) / 2 / (1 - memory.MARGIN)
    env = {**train_env, "env": {**train_env["env"], memory.BUDGET_ENV: str(int(budget))}}
    args = tiny_args(train_env, tmp_path, "--micro-batch-size", "auto", "--mode", "ddp")
    result = run_train(env, args, ["--standalone", "--nproc_per_node=2"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "batch 8 = 2 x 2 x 2 accumulation" in result.stdout
    assert result.stdout.count("micro-batch 2 (auto: ") == 1  # rank 0 says it
