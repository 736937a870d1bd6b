"""The one place the model to train is made, for each mode (`MODES`).

``runtime`` resolves ``--mode`` and starts what the mode needs (a torchrun process group or not);
``build_model`` makes the plain LlamaForPretraining (the same initial weights in every mode and on
every rank); ``parallelize`` applies, outside the model and in this order, activation
checkpointing, ``torch.compile`` and the mode's wrapper (DataParallel, DDP, FSDP2). The loop asks
``gradient_sync`` whether a micro-step reduces gradients and ``is_sharded`` whether every rank
holds a part of the state; it never tests the mode.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from llama_ddp import distributed as D
from llama_ddp.distributed import Runtime
from llama_ddp.model import LlamaForPretraining
from llama_ddp.model_config import LlamaConfig
from llama_ddp.precision import Precision

if TYPE_CHECKING:
    from llama_ddp.config import TrainConfig


def build_model(config: LlamaConfig, seed: int, device: torch.device) -> LlamaForPretraining:
    """The plain model, initialized from ``seed``: every rank and every mode starts alike."""
    torch.manual_seed(seed)
    return LlamaForPretraining(config).to(device)


class Autocast(nn.Module):
    """Runs ``module`` under the run's autocast, its dtype named explicitly.

    DataParallel runs each replica in a thread of its own and re-enters autocast there with
    ``enabled=`` only; the autocast dtype is per thread, and a new thread's is the device default
    (fp16 on CUDA), so a bf16 run would compute in fp16 without loss scaling. This module is what
    DataParallel replicates: every replica thread enters the run's dtype itself."""

    def __init__(self, module: nn.Module, precision: Precision) -> None:
        super().__init__()
        self.module, self.precision = module, precision

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision.autocast():
            return self.module(*args, **kwargs)


def checkpoint_layers(model: LlamaForPretraining) -> None:
    """Recompute each decoder layer's forward in the backward instead of keeping its activations
    (torch.utils.checkpoint, non-reentrant). The layers' state-dict names gain a
    ``_checkpoint_wrapped_module.`` level, which torch.distributed.checkpoint's state-dict
    functions (checkpoint.py, the export) remove: saved names never change."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    layers = model.base_model.layers
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def parallelize(
    model: LlamaForPretraining, rt: Runtime, cfg: TrainConfig, precision: Precision
) -> nn.Module:
    """The module to run forward/backward through. ``model`` keeps the weights (saving,
    evaluation and export read it, never a wrapper); FSDP shards it in place."""
    if cfg.activation_checkpointing:
        checkpoint_layers(model)
    return MODES[rt.mode].wrap(model, rt, precision, cfg.compile)


def _unwrapped(model: LlamaForPretraining, rt: Runtime, precision: Precision, compile: bool):
    return torch.compile(model) if compile else model


def _data_parallel(
    model: LlamaForPretraining, rt: Runtime, precision: Precision, compile: bool
) -> nn.Module:
    """nn.DataParallel over this process's GPUs (TrainConfig refuses it with --compile); the
    plain model when there is one device."""
    if rt.replicas > 1:
        return nn.DataParallel(Autocast(model, precision))
    return _unwrapped(model, rt, precision, compile)


def _distributed_data_parallel(
    model: LlamaForPretraining, rt: Runtime, precision: Precision, compile: bool
) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    ids = [rt.device.index] if rt.device.type == "cuda" else None
    # The rotary tables are constants: no need to broadcast buffers every forward.
    params = inspect.signature(DistributedDataParallel).parameters
    no_sync = "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
    return DistributedDataParallel(
        _unwrapped(model, rt, precision, compile),
        device_ids=ids,
        gradient_as_bucket_view=True,  # gradients live in the buckets: no copy each step
        **{no_sync: False},
    )


def _fully_shard(
    model: LlamaForPretraining, rt: Runtime, precision: Precision, compile: bool
) -> nn.Module:
    """FSDP2: each decoder layer, then the root (embeddings, final norm, lm_head), sharded over
    the processes. Low-precision runs compute in their dtype and keep fp32 master weights and
    fp32 gradient reduction; fp32 runs use no policy."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(rt.device.type, (rt.world_size,))
    policy = MixedPrecisionPolicy()
    if precision.dtype != torch.float32:
        policy = MixedPrecisionPolicy(param_dtype=precision.dtype, reduce_dtype=torch.float32)
    for layer in model.base_model.layers:
        if compile:
            layer.compile()  # per layer, in place: FSDP's hooks stay outside the graphs
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


@dataclass(frozen=True)
class Mode:
    """One entry of `MODES`: what ``--mode NAME`` means."""

    help: str
    process_group: bool  # its processes form a torchrun process group (collectives are real)
    wrap: Callable[[LlamaForPretraining, Runtime, Precision, bool], nn.Module]  # (..., compile)


# The modes ``--mode`` offers (besides ``auto``); a new one is an entry here, plus its branch of
# ``gradient_sync`` and ``is_sharded`` if it syncs gradients or shards state its own way.
MODES: dict[str, Mode] = {
    "single": Mode("one process on one device", False, _unwrapped),
    "dp": Mode("nn.DataParallel over this machine's GPUs", False, _data_parallel),
    "ddp": Mode("DistributedDataParallel under torchrun", True, _distributed_data_parallel),
    "fsdp": Mode(
        "FSDP2 under torchrun: weights, gradients and optimizer state sharded over the processes",
        True,
        _fully_shard,
    ),
}


def runtime(mode: str = "auto", device: str = "auto") -> Runtime:
    """This process's Runtime for ``--mode`` (``auto``: ddp under torchrun, else single) and
    ``--device``: under torchrun, a mode with a process group joins it."""
    if mode == "auto":
        mode = "ddp" if D.under_torchrun() else "single"
    return D.setup(mode, device, process_group=MODES[mode].process_group)


def is_sharded(model: nn.Module) -> bool:
    """Whether every rank holds only a part of the weights (and so writes a part of each
    checkpoint)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def _fsdp_sync(model: Any, sync: bool) -> Iterator[None]:
    model.set_requires_gradient_sync(sync)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def gradient_sync(train_model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """The context of a micro-step's backward: with ``sync`` false (all but the last micro-step of
    an optimizer step) gradients accumulate locally and are reduced once, on the last."""
    if sync:
        return contextlib.nullcontext()
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(train_model, DistributedDataParallel):
        return train_model.no_sync()
    if is_sharded(train_model):
        return _fsdp_sync(train_model, False)
    return contextlib.nullcontext()
