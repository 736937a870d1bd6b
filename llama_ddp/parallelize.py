"""The one place the model to train is made.

``build_model`` makes the plain LlamaForPretraining (the same initial weights in every mode and on
every rank); ``parallelize`` applies, outside the model and in this order, activation
checkpointing, ``torch.compile`` and the mode's wrapper (DataParallel, DDP). The loop asks
``gradient_sync`` whether a micro-step reduces gradients; it never tests the mode.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from llama_ddp.config import LlamaConfig, TrainConfig
from llama_ddp.distributed import Runtime
from llama_ddp.model import LlamaForPretraining
from llama_ddp.precision import Precision


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


def parallelize(model: nn.Module, rt: Runtime, cfg: TrainConfig, precision: Precision) -> nn.Module:
    """The module to run forward/backward through; ``model`` keeps the weights (saving,
    evaluation, export read it, never the wrapper)."""
    train_model = torch.compile(model) if cfg.compile else model
    if rt.mode == "ddp":
        ids = [rt.device.index] if rt.device.type == "cuda" else None
        # The rotary tables are constants: no need to broadcast buffers every forward.
        params = inspect.signature(DistributedDataParallel).parameters
        no_sync = (
            "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
        )
        return DistributedDataParallel(
            train_model,
            device_ids=ids,
            gradient_as_bucket_view=True,  # gradients live in the buckets: no copy each step
            **{no_sync: False},
        )
    if rt.replicas > 1:  # DataParallel (TrainConfig refuses it with --compile)
        return nn.DataParallel(Autocast(train_model, precision))
    return train_model


def gradient_sync(train_model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """The context of a micro-step's backward: with ``sync`` false (all but the last micro-step of
    an optimizer step) gradients accumulate locally and are reduced once, on the last."""
    if not sync and isinstance(train_model, DistributedDataParallel):
        return train_model.no_sync()
    return contextlib.nullcontext()
