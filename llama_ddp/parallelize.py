"""The one place the model to train is made.

``build_model`` makes the plain LlamaForPretraining (the same initial weights in every mode and on
every rank); ``parallelize`` applies, outside the model and in this order, activation
checkpointing, ``torch.compile`` and the mode's wrapper (DataParallel, DDP). The loop asks
``gradient_sync`` whether a micro-step reduces gradients; it never tests the mode.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from llama_ddp.config import LlamaConfig, TrainConfig
from llama_ddp.distributed import Runtime
from llama_ddp.model import LlamaForPretraining


def build_model(config: LlamaConfig, seed: int, device: torch.device) -> LlamaForPretraining:
    """The plain model, initialized from ``seed``: every rank and every mode starts alike."""
    torch.manual_seed(seed)
    return LlamaForPretraining(config).to(device)


def parallelize(model: nn.Module, rt: Runtime, cfg: TrainConfig) -> nn.Module:
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
        return DistributedDataParallel(train_model, device_ids=ids, **{no_sync: False})
    if rt.mode == "dp" and rt.device.type == "cuda" and torch.cuda.device_count() > 1:
        return nn.DataParallel(train_model)
    return train_model


def gradient_sync(train_model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """The context of a micro-step's backward: with ``sync`` false (all but the last micro-step of
    an optimizer step) gradients accumulate locally and are reduced once, on the last."""
    if not sync and isinstance(train_model, DistributedDataParallel):
        return train_model.no_sync()
    return contextlib.nullcontext()
