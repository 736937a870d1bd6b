"""preemption.py: how long a stopping run has, the warning when its saves take longer, and
LLAMA_DDP_FAULT (the fault-injection hook): one point of one step, a kill once per run folder."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest

from llama_ddp.errors import Interrupted, UserError
from llama_ddp.train import preemption as faults
from llama_ddp.train.cli import main as train_main
from llama_ddp.train.preemption import (
    ENV,
    FaultInjector,
    Preemption,
    grace_seconds,
    slow_save_warning,
)


def test_the_grace_period_is_torchruns(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "120")
    assert grace_seconds() is None  # not under torchrun: no SIGKILL follows a signal
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert grace_seconds() == 120.0
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    assert grace_seconds() == 30.0  # torchrun's default --shutdown-timeout


def test_a_save_slower_than_the_grace_period_is_a_warning():
    assert slow_save_warning(29.0, 30.0) is None
    assert slow_save_warning(100.0, None) is None
    warning = slow_save_warning(31.5, 30.0)
    assert warning.startswith("warning: the last checkpoint took 31.5 s, longer than")
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" in warning and "--signal=TERM@" in warning


def test_signals_while_preparing_interrupt_and_while_training_are_recorded():
    with Preemption() as preemption, pytest.raises(Interrupted, match="while preparing"):
        preemption._handle(signal.SIGTERM, None)
    with Preemption() as preemption:
        preemption.training()
        preemption._handle(signal.SIGTERM, None)
        preemption._handle(signal.SIGTERM, None)  # repeats from schedulers are ignored
        assert preemption.signum == signal.SIGTERM
        with pytest.raises(Interrupted, match="again"):
            preemption._handle(signal.SIGINT, None)  # a person's second Ctrl-C aborts


def test_signals_after_the_abort_are_ignored_while_the_run_stops_its_writer():
    """Once a second Ctrl-C aborted, the run is leaving (the checkpointer stops its writer
    thread first): a third Ctrl-C or a SIGTERM must not raise again in the middle of that."""
    with Preemption() as preemption:
        preemption.training()
        preemption._handle(signal.SIGINT, None)
        with pytest.raises(Interrupted, match="again"):
            preemption._handle(signal.SIGINT, None)
        preemption._handle(signal.SIGINT, None)
        preemption._handle(signal.SIGTERM, None)
        assert preemption.signum == signal.SIGINT


@pytest.mark.parametrize(
    "spec, point, step, sleep",
    [
        ("after-step:7", "after-step", 7, 0.0),
        ("after-save:12", "after-save", 12, 0.0),
        ("before-save:any:sleep=3", "before-save", None, 3.0),
        ("after-step:4:sleep=0.25", "after-step", 4, 0.25),
    ],
)
def test_the_environment_names_a_point_a_step_and_a_stall(spec, point, step, sleep, monkeypatch):
    monkeypatch.setenv(ENV, spec)
    monkeypatch.delenv("RANK", raising=False)
    assert FaultInjector.from_env("out") == FaultInjector(point, step, Path("out"), sleep)
    monkeypatch.setenv("RANK", "1")
    assert FaultInjector.from_env("out") is None  # rank 0's hook only
    monkeypatch.delenv(ENV)
    monkeypatch.setenv("RANK", "0")
    assert FaultInjector.from_env("out") is None


@pytest.mark.parametrize(
    "spec",
    [
        "after-step",
        "after-step:",
        "after-step:x",
        "after-stp:3",
        "after-step:3:nap=2",
        "after-step:3:sleep=",
        "after-step:3:sleep=0",
        "after-step:3:sleep=1:x",
        "after-step:3:sleep=1.2.3",
    ],
)
def test_a_bad_spec_is_one_clear_error(spec, monkeypatch):
    monkeypatch.setenv(ENV, spec)
    with pytest.raises(UserError) as error:
        FaultInjector.from_env("out")
    assert str(error.value) == (
        f"LLAMA_DDP_FAULT={spec} is not a fault (give <point>:<step>[:sleep=<seconds>], the point "
        "one of after-step, before-save, after-save, the step a number or any)"
    )


def test_train_py_refuses_a_bad_spec_before_any_work(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(ENV, "after-step:seven")
    monkeypatch.delenv("RANK", raising=False)
    assert train_main(["--out-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: LLAMA_DDP_FAULT=after-step:seven is not") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.fixture
def kills(monkeypatch):
    sent = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))
    return sent


def test_the_kill_comes_once_per_run_folder(tmp_path, kills):
    hook = FaultInjector("after-step", 7, tmp_path)
    hook("after-save", 7)
    hook("after-step", 6)
    assert kills == [] and not list(tmp_path.iterdir())
    hook("after-step", 7)
    assert kills == [(os.getpid(), signal.SIGKILL)]
    assert [p.name for p in tmp_path.iterdir()] == [".fault-after-step-7"]
    hook("after-step", 7)
    FaultInjector("after-step", 7, tmp_path)("after-step", 7)  # the restarted job runs on
    assert len(kills) == 1
    (tmp_path / "other").mkdir()
    FaultInjector("after-step", 7, tmp_path / "other")("after-step", 7)
    assert len(kills) == 2


def test_a_stall_waits_at_every_matching_point_and_kills_nothing(tmp_path, kills, monkeypatch):
    stalls = []
    monkeypatch.setattr(faults.time, "sleep", stalls.append)
    hook = FaultInjector("before-save", None, tmp_path, sleep=3.0)
    for point, step in [
        ("before-save", 2),
        ("after-save", 2),
        ("after-step", 3),
        ("before-save", 4),
    ]:
        hook(point, step)
    assert stalls == [3.0, 3.0] and kills == [] and not list(tmp_path.iterdir())
    FaultInjector("after-save", 5, tmp_path, sleep=0.5)("after-save", 5)
    assert stalls == [3.0, 3.0, 0.5] and kills == []


def test_a_signal_whose_interruption_was_caught_while_preparing_stops_at_training():
    """Issue 60, item 9: an `Interrupted` raised in preparation's code that takes any exception
    for a refusal (a kernel's trial) was lost, and the run trained on until torchrun's SIGKILL."""
    with Preemption() as preemption:
        with contextlib.suppress(Exception):  # what a kernel's trial does with it
            preemption._handle(signal.SIGTERM, None)
        with pytest.raises(Interrupted, match="while preparing") as stopped:
            preemption.training()
        assert stopped.value.signum == signal.SIGTERM


WAITS_IN_CPP = """
import datetime, sys
import torch.distributed as dist
from llama_ddp.train.preemption import Preemption
with Preemption():
    store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, False,
                          timeout=datetime.timedelta(seconds=60))
    print("waiting", flush=True)
    store.wait(["a peer that has left"])
"""


def test_a_worker_waiting_in_cpp_for_a_peer_leaves_soon_after_a_signal(tmp_path):
    """Issue 60, item 9: a torchrun worker signalled while it waits in the rendezvous store
    (C++, where Python runs no signal handler) stayed until the wait timed out or torchrun's
    SIGKILL came (30 s). The watchdog ends it 5 s (LEAVE_S) after the signal, with the line an
    `Interrupted` prints."""
    import subprocess
    import sys
    import time

    import torch.distributed as dist

    from tests.helpers.runs import ROOT

    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHELASTIC_RUN_ID": "test", "RANK": "0"}
    env.pop("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", None)  # torchrun's 30 s
    proc = subprocess.Popen(
        [sys.executable, "-c", WAITS_IN_CPP, str(store.port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline() == "waiting\n"
        time.sleep(0.5)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)  # before: until the store's 60 s timeout
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, err[-2000:]
    assert took < 15  # torchrun's grace period is 30 s
    assert err.strip().splitlines()[-1] == (
        "stopped by signal 15 while preparing, before any training: nothing was saved"
    )
    assert store.num_keys() >= 0  # the store the worker waited on stayed up throughout
