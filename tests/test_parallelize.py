"""parallelize.py: the wrappers each mode gets, and what DataParallel's replica threads compute in."""

import threading

import pytest
import torch
from torch import nn

from llama_ddp.config import TrainConfig
from llama_ddp.distributed import Runtime
from llama_ddp.errors import UserError
from llama_ddp.model_config import preset
from llama_ddp.parallelize import Autocast, build_model, gradient_sync, parallelize
from llama_ddp.precision import Precision

CPU = torch.device("cpu")


class DtypeProbe(nn.Module):
    """Records the autocast dtype its forward runs under, and the dtype of a matmul there."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[torch.dtype, torch.dtype]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((torch.get_autocast_dtype("cpu"), (x @ x).dtype))
        return x


def in_replica_thread(module: nn.Module, x: torch.Tensor) -> None:
    """What torch.nn.parallel.parallel_apply does for each replica: a new thread that re-enters
    autocast with ``enabled=`` only (the dtype is per thread, so the thread's default applies)."""

    def work(enabled: bool) -> None:
        with torch.amp.autocast("cpu", enabled=enabled):
            module(x)

    with torch.autocast("cpu", dtype=torch.float16):  # the run's dtype, in the main thread
        thread = threading.Thread(target=work, args=(torch.is_autocast_enabled("cpu"),))
        thread.start()
        thread.join()


def test_every_replica_thread_computes_in_the_runs_dtype():
    x = torch.randn(8, 8)
    bare, wrapped = DtypeProbe(), DtypeProbe()
    in_replica_thread(bare, x)  # what DataParallel replicated before: the thread's default
    in_replica_thread(Autocast(wrapped, Precision(torch.float16, CPU)), x)
    assert bare.seen == [(torch.bfloat16, torch.bfloat16)]  # the bug: not the run's fp16
    assert wrapped.seen == [(torch.float16, torch.float16)]


def test_data_parallel_replicates_the_autocast_wrapper():
    model = build_model(preset("tiny", vocab_size=64), 0, CPU)
    precision = Precision(torch.bfloat16, CPU)
    wrapped = parallelize(model, Runtime("dp", CPU, replicas=2), TrainConfig(), precision)
    assert isinstance(wrapped, nn.DataParallel)
    assert isinstance(wrapped.module, Autocast) and wrapped.module.module is model
    assert wrapped.module.precision.dtype == torch.bfloat16
    assert parallelize(model, Runtime("dp", CPU), TrainConfig(), precision) is model  # 1 device


def test_data_parallel_with_compile_is_refused():
    with pytest.raises(UserError, match="--compile does not work with --mode dp"):
        TrainConfig(mode="dp", compile=True).validate()


def test_gradient_sync_is_a_no_op_without_a_process_group():
    model = build_model(preset("tiny", vocab_size=64), 0, CPU)
    with gradient_sync(model, False):
        pass  # single process: nothing to hold back
