"""The loop in-process: what a training step asks of the device."""

import json

import pytest
import torch

from llama_ddp.distributed import runtime as D
from llama_ddp.train.cli import parse_train_args
from llama_ddp.train.run import build_trainer
from tests.helpers.host_reads import VARIANTS, HostReads, record_ranks, record_step
from tests.helpers.runs import free_port, start_ranks, tiny_args

# Tensor methods that copy a value to the host, which on CUDA waits for all queued work.
HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


@pytest.fixture
def host_reads(monkeypatch):
    """Counts host reads of tensors, except of two kinds of CPU tensors that never live on the
    device: the optimizer's step counters (foreach AdamW's; on CUDA the fused AdamW keeps them on
    the device and reads none) and the attention plans' grids, which the CPU attention kernel
    reads on the host. (The `gpu` test runs the same steps under CUDA's sync-debug mode.)"""
    calls, exempt = [], set()
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            if id(self) not in exempt:
                calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return calls, exempt


@pytest.mark.parametrize("packing", ["pack", "pad"])
def test_a_training_step_never_waits_for_the_device(train_env, tmp_path, host_reads, packing):
    args = tiny_args(train_env, tmp_path, "--packing", packing, "--micro-batch-size", "4")
    cfg = parse_train_args([*args, "--cache-dir", str(train_env["root"] / "cache")])
    trainer = build_trainer(cfg, D.setup("single", "cpu"))
    batches = trainer.data.batches(0)
    trainer.step(next(batches))  # creates the optimizer state
    steps = [next(batches) for _ in range(3)]  # the loader's work is the CPU's, not the step's
    calls, exempt = host_reads
    exempt.update(id(s["step"]) for s in trainer.optimizer.state.values())
    exempt.update(id(b.plan.grids) for micro in steps for b in micro if b.plan is not None)
    calls.clear()
    results = [trainer.step(micro_batches) for micro_batches in steps]
    assert calls == []  # before: a .tolist() of the gradient norm and counts every step
    stats = [r.stats() for r in results]
    assert all(s.targets > 0 and s.grad_norm > 0 and s.flops > 0 for s in stats)
    assert calls == []  # read back through pinned host copies, not tensor reads


def test_the_recorder_sees_what_would_wait_for_a_device():
    x, keep = torch.arange(6.0), torch.tensor([1, 4])
    with HostReads(exempt=[keep]) as recorder:
        x.sum().item()
        x.cpu()
        x[x > 2]
        x.nonzero()
        torch.tensor([1, 2])
        x.to("cpu")
        keep.tolist()  # exempt
        x.to(torch.float64)  # a cast, not a move
        x.index_select(0, keep)
    seen = [s.split(" at ")[0] for s in recorder.seen]
    assert seen == [
        "aten._local_scalar_dense.default",
        "Tensor.cpu",
        "boolean-mask index",
        "aten.nonzero.default",
        "aten.lift_fresh.default",
        "Tensor.to",
    ]


def test_forward_and_backward_read_nothing_back_in_any_mode(train_env, tmp_path):
    """Every mode's training step, on batches with documents kept apart and on padded rows with
    activation checkpointing: its forwards (the wrapper's input handling included) and backwards
    neither read a value back nor copy from the host (the batch and its attention plan reach
    the device before the model is called). DDP and FSDP: two gloo processes."""

    from llama_ddp.distributed import runtime as D

    argv = tiny_args(train_env, tmp_path, "--micro-batch-size", "2")
    argv += ["--cache-dir", str(train_env["root"] / "cache")]
    seen = {}
    for mode in ("single", "dp"):
        for name, extra in VARIANTS.items():
            trainer = build_trainer(parse_train_args([*argv, *extra]), D.setup(mode, "cpu"))
            batches = trainer.data.batches(0)
            trainer.step(next(batches))
            seen[f"{mode} {name}"] = record_step(trainer, next(batches))
    start_ranks(record_ranks, (free_port(), argv, str(tmp_path)))
    for rank in (0, 1):
        seen.update(json.loads((tmp_path / f"rank{rank}.json").read_text()))
    assert sorted(seen) == sorted(
        f"{m} {v}" for m in ("single", "dp", "ddp", "fsdp") for v in VARIANTS
    )
    assert seen == {key: [] for key in seen}


def test_a_signal_stops_the_run_at_the_next_step_boundary(train_env, tmp_path):
    """SIGTERM during step 3 saves the checkpoint of step 3 and stops: the stop vote is taken at
    every step boundary (before: read back a step late, so up to two more steps ran first)."""
    import json
    import os
    import signal

    from llama_ddp.train.run import run

    def signal_during_step_3(point: str, step: int) -> None:
        if point == "after-step" and step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    args = tiny_args(train_env, tmp_path, "--log-every", "100", "--save-every", "0")
    cfg = parse_train_args([*args, "--cache-dir", str(train_env["root"] / "cache")])
    assert run(cfg, fault=signal_during_step_3) == signal.SIGTERM
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000003"]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [3]  # the stopping step is logged
    (saved,) = [r for r in records if "save_s" in r]
    assert saved["step"] == 3 and saved["checkpoint"] == "checkpoints/step-00000003"
    assert 0 < saved["save_s"] < 60


@pytest.mark.parametrize("where", ["save", "export"])
def test_a_signal_after_the_last_step_says_what_was_finished(where, train_env, tmp_path, capsys):
    """Issue 60, item 8: a SIGTERM during the last step's save (after its stop vote) or during
    the export was absorbed with no word, exit 0. In the save: the run leaves unexported with
    its signal and says so; in the export: everything was done, exit 0, and one line says the
    signal came."""
    import os
    import signal

    import llama_ddp.train.run as R
    from llama_ddp.train.run import run

    def signal_in_the_last_save(point: str, step: int) -> None:
        if where == "save" and point == "before-save" and step == 4:
            os.kill(os.getpid(), signal.SIGTERM)

    def signalled_export(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return export_run(*args, **kwargs)

    export_run = R.export_run
    if where == "export":
        R.export_run = signalled_export
    args = tiny_args(train_env, tmp_path, "--max-steps", "4", "--save-every", "0")
    cfg = parse_train_args([*args, "--cache-dir", str(train_env["root"] / "cache")])
    try:
        code = run(cfg, fault=signal_in_the_last_save)
    finally:
        R.export_run = export_run
    saved = tmp_path / "checkpoints" / "step-00000004"
    last = capsys.readouterr().out.rstrip().splitlines()[-1]
    done = f"trained to step 4, evaluated and saved {saved}"
    if where == "save":
        assert code == signal.SIGTERM and not (tmp_path / "llama_model.pth").exists()
        assert last == (
            f"stopped by signal 15 after the last step: {done}; not exported (the same command "
            "exports it, resuming there)"
        )
    else:
        assert code == 0 and (tmp_path / "llama_model.pth").is_file()
        assert last == f"signal 15 came during the export: the run is complete ({done}, exported)"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [saved.name]


@pytest.mark.parametrize("second", ["before-save", "after-save"])
def test_every_complete_checkpoint_has_its_metrics_line_after_a_second_ctrl_c(
    second, train_env, tmp_path
):
    """Issue 60, item 10: a first Ctrl-C during step 3 of a run saving at every step in the
    background, a second one before the stop save (step 2's background save complete but not yet
    logged) or while the saves were being logged (step 2's line written, step 3's not yet).
    Before, the abort left complete checkpoints on disk without their metrics line; now every
    step whose checkpoint is complete has one."""
    import os
    import signal
    import time

    from llama_ddp.checkpoint.manager import list_checkpoints
    from llama_ddp.checkpoint.state import verify_checkpoint
    from llama_ddp.errors import Interrupted
    from llama_ddp.train.run import run

    def ctrl_c_twice(point: str, step: int) -> None:
        if point == "after-step" and step == 3:
            os.kill(os.getpid(), signal.SIGINT)
        elif point == second and step == (3 if second == "before-save" else 2):
            time.sleep(0.5)  # step 2's background write is complete by now
            os.kill(os.getpid(), signal.SIGINT)

    args = tiny_args(train_env, tmp_path, "--max-steps", "100", "--save-every", "1")
    cfg = parse_train_args([*args, "--cache-dir", str(train_env["root"] / "cache")])
    with pytest.raises(Interrupted, match="again"):
        run(cfg, fault=ctrl_c_twice)
    complete = [p.name for p in list_checkpoints(tmp_path) if verify_checkpoint(p) is None]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [r["checkpoint"].split("/")[-1] for r in records if "checkpoint" in r]
    assert "step-00000002" in complete and sorted(set(logged)) == sorted(logged)
    assert set(complete) <= set(logged), (complete, logged)


def _fp16_trainer(train_env, tmp_path, *extra):
    """A tiny run's trainer computing in fp16 with loss scaling on the CPU (train.py allows fp16
    on CUDA only; a GradScaler("cpu") is the same class as CUDA's)."""
    from llama_ddp.precision import Precision

    args = tiny_args(train_env, tmp_path, "--max-steps", "40", "--log-every", "100", *extra)
    cfg = parse_train_args([*args, "--cache-dir", str(train_env["root"] / "cache")])
    trainer = build_trainer(cfg, D.setup("single", "cpu"))
    fp16 = Precision(torch.float16, torch.device("cpu"))
    fp16.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    trainer.precision, trainer.checkpointer.parts["scaler"] = fp16, fp16.scaler
    return trainer


def _fit(trainer, tmp_path):
    from llama_ddp.train.metrics import Reporter
    from llama_ddp.train.preemption import Preemption

    reporter = Reporter(tmp_path, trainer.total_steps, 0, True, every=100)
    try:
        return trainer.fit(reporter, Preemption())
    finally:
        reporter.close()


def _poison(trainer, steps: range):
    """A fault hook that makes the loss non-finite for the steps in ``steps`` (an infinite
    lm_head weight from the boundary before the first, put back after the last)."""
    weight, saved = trainer.model.lm_head.weight, {}

    def hook(point: str, step: int) -> None:
        if point == "after-step" and step + 1 == steps.start:
            saved["value"] = weight.data[0, 0].item()
            weight.data[0, 0] = float("inf")
        elif point == "after-step" and step + 1 == steps.stop and "value" in saved:
            weight.data[0, 0] = saved["value"]

    return hook


def test_fp16_that_never_recovers_stops_before_saving_anything_newer(train_env, tmp_path):
    from llama_ddp.errors import NonFiniteLoss
    from llama_ddp.precision import MAX_SKIPPED_STEPS

    trainer = _fp16_trainer(train_env, tmp_path, "--save-every", "2", "--keep-last", "5")
    trainer.fault = _poison(trainer, range(5, 10**6))  # steps 5, 6, ...: never finite again
    with pytest.raises(NonFiniteLoss) as err:
        _fit(trainer, tmp_path)
    last = 4 + MAX_SKIPPED_STEPS
    assert f"not finite in {MAX_SKIPPED_STEPS} steps in a row at step {last}" in str(err.value)
    assert "step-00000004" in str(err.value)  # the last good checkpoint, named
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert saved == ["step-00000002", "step-00000004"]  # none of a skipped step's state


def test_fp16_postpones_a_save_over_a_skipped_step(train_env, tmp_path):
    """A step fp16 skips (its gradients overflowed) is not saved: its save comes at the next
    step that trained, and the run goes on."""
    trainer = _fp16_trainer(train_env, tmp_path, "--save-every", "3", "--max-steps", "7")
    trainer.fault = _poison(trainer, range(6, 7))  # step 6, a save step, is skipped
    assert _fit(trainer, tmp_path) == 0
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert saved == ["step-00000003", "step-00000007"]
    assert trainer.skipped == 0 and trainer.precision.scaler.get_scale() == 2.0**7


def test_saves_slower_than_torchruns_grace_period_are_warned_about(
    train_env, tmp_path, monkeypatch, capsys
):
    """Each save's time is logged; under torchrun (its environment stands in here), a save
    longer than the grace period before SIGKILL warns once, and again at the start of a run that
    resumes after one; the end-of-run summary says how long the last save took."""
    import json

    from llama_ddp.train.run import run

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "0")  # any save is longer
    args = tiny_args(train_env, tmp_path, "--save-every", "4", "--log-every", "100")
    args += ["--cache-dir", str(train_env["root"] / "cache")]
    assert run(parse_train_args(args)) == 0
    out = capsys.readouterr().out
    assert out.count("warning: the last checkpoint took") == 1  # at the first slow save only
    assert "the last checkpoint took" in out.splitlines()[-2]  # before where the time went
    assert "s to save (torchrun's grace period: 0 s)" in out.splitlines()[-2]
    assert out.splitlines()[-1].startswith("where the time went")
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "save_s" in r] == [4, 8]
    assert run(parse_train_args([*args, "--max-steps", "9"])) == 0
    resumed = capsys.readouterr().out.split("resuming from")[1]
    assert resumed.count("warning: the last checkpoint took") == 1  # at start-up, not again
