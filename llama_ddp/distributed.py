"""The runtime: which process this is, on which device, and how the model is wrapped.

The model knows nothing of distribution: ``wrap`` applies DataParallel or DDP from outside and
``unwrap`` gives the plain LlamaForPretraining back (for saving, evaluation and generation).
"""

from __future__ import annotations

import datetime
import inspect
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from llama_ddp.errors import UserError

MODES = ("auto", "single", "dp", "ddp")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Runtime:
    mode: str  # the resolved mode: single, dp or ddp
    device: torch.device
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1  # processes; DataParallel's replicas share one process

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.mode == "ddp"


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name not in ("auto", "cpu", "cuda"):
        raise UserError(f"unknown --device {name!r} (choose auto, cpu or cuda)")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda but no CUDA GPU is visible (use --device cpu or auto)")
    if name == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def setup(mode: str = "auto", device: str = "auto") -> Runtime:
    """Resolve the mode and device; under torchrun, join the process group."""
    if mode not in MODES:
        raise UserError(f"unknown --mode {mode!r} (choose one of: {', '.join(MODES)})")
    torchrun = under_torchrun()
    if mode == "auto":
        mode = "ddp" if torchrun else "single"
    if mode == "ddp" and not torchrun:
        raise UserError(
            "--mode ddp needs torchrun (run: torchrun --standalone --nproc_per_node=N train.py ...)"
        )
    if mode != "ddp" and torchrun and int(os.environ["WORLD_SIZE"]) > 1:
        raise UserError(f"--mode {mode} under torchrun with several processes (use --mode ddp)")
    if mode != "ddp":
        dev = resolve_device(device)
        if mode == "dp" and (dev.type != "cuda" or torch.cuda.device_count() < 2):
            n = torch.cuda.device_count() if dev.type == "cuda" else 0
            print(f"--mode dp: {n} GPU(s) visible, running unwrapped on {dev}", file=sys.stderr)
        return Runtime(mode=mode, device=dev)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    dev = resolve_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=30)
        dist.init_process_group(
            backend="nccl" if dev.type == "cuda" else "gloo",
            device_id=dev if dev.type == "cuda" else None,
            timeout=timeout,
            store=_elastic_store(rank, world, timeout),
            rank=rank,
            world_size=world,
        )
    return Runtime(mode="ddp", device=dev, rank=rank, local_rank=local_rank, world_size=world)


def _elastic_store(rank: int, world: int, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store, with a namespace per torchrun restart.

    torchrun's agent keeps one store across worker restarts; without a fresh namespace the
    restarted workers can read the addresses their dead predecessors published and wait on
    them forever. Outside torchelastic, the usual env:// store (rank 0 hosts it)."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        host, port, world, is_master=not agent_hosts and rank == 0, timeout=timeout
    )
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"llama_ddp/restart-{restart}", store)


def teardown(rt: Runtime) -> None:
    if rt.distributed and dist.is_initialized():
        dist.destroy_process_group()


def wrap(model: nn.Module, rt: Runtime) -> nn.Module:
    if rt.mode == "ddp":
        ids = [rt.device.index] if rt.device.type == "cuda" else None
        # The rotary tables are constants: no need to broadcast buffers every forward.
        params = inspect.signature(DistributedDataParallel).parameters
        no_sync = (
            "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
        )
        return DistributedDataParallel(model, device_ids=ids, **{no_sync: False})
    if rt.mode == "dp" and rt.device.type == "cuda" and torch.cuda.device_count() > 1:
        return nn.DataParallel(model)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model under DataParallel/DDP (``.module``) and torch.compile (``._orig_mod``)."""
    while True:
        if isinstance(model, (nn.DataParallel, DistributedDataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def all_reduce_sum(t: torch.Tensor, rt: Runtime) -> torch.Tensor:
    if rt.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def barrier(rt: Runtime) -> None:
    if rt.distributed:
        dist.barrier()


def broadcast_object(obj: object, rt: Runtime) -> object:
    """Rank 0's ``obj`` on every rank (for decisions only rank 0 can make, like which checkpoint
    to resume)."""
    if not rt.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name == "fp16" and device.type != "cuda":
        raise UserError("--dtype fp16 needs a CUDA device (use bf16 or fp32 on CPU)")
    return DTYPES[name]


def fault_point(point: str, step: int, out_dir: Path) -> None:
    """Test hook for fault tolerance: ``LLAMA_DDP_FAULT=<point>:<step>`` SIGKILLs rank 0 when it
    reaches that point of that step, once per out_dir (a marker file records it), so a restarted
    job runs on. Points: ``mid-step`` (after the first backward), ``after-save``."""
    if os.environ.get("LLAMA_DDP_FAULT") != f"{point}:{step}" or os.environ.get("RANK", "0") != "0":
        return
    marker = out_dir / f".fault-{point}-{step}"
    if not marker.exists():
        marker.write_text("")
        os.kill(os.getpid(), signal.SIGKILL)


class Preemption:
    """SIGTERM/SIGINT ask for a clean stop: finish the step, checkpoint, exit 128 + signal."""

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> Preemption:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum:  # a second signal: stop now
            raise KeyboardInterrupt
        self.signum = signum
