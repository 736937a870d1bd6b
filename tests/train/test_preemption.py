"""preemption.py: how long a stopping run has, and the warning when its saves take longer."""

import signal

import pytest

from llama_ddp.errors import Interrupted
from llama_ddp.train.preemption import Preemption, grace_seconds, slow_save_warning


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
    with Preemption() as preemption:
        with pytest.raises(Interrupted, match="while preparing"):
            preemption._handle(signal.SIGTERM, None)
        preemption.training()
        preemption._handle(signal.SIGTERM, None)
        preemption._handle(signal.SIGTERM, None)  # repeats from schedulers are ignored
        assert preemption.signum == signal.SIGTERM
        with pytest.raises(Interrupted, match="again"):
            preemption._handle(signal.SIGINT, None)  # a person's second Ctrl-C aborts
