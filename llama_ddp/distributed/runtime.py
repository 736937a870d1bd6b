"""The runtime: which process this is, on which device, in which process group.

``setup`` resolves the device and, for a mode that needs one, joins torchrun's process group;
the collectives below are no-ops in a single process, so callers never test the mode.
What each mode is (and whether it needs a process group) is parallelize.py's business.
"""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from llama_ddp.errors import UserError

# Collectives of a training step: a peer that has not answered in this long is gone
# (LLAMA_DDP_COLLECTIVE_TIMEOUT, in minutes, sets another).
TIMEOUT = datetime.timedelta(minutes=30)
TIMEOUT_ENV = "LLAMA_DDP_COLLECTIVE_TIMEOUT"
# Host-side agreement goes through a gloo group of its own: the preparation (tokenizer training,
# the token cache of a hub corpus), which can take hours on one rank per machine while the others
# wait (hence the timeout, so NCCL's watchdog never aborts a healthy job that is still
# tokenizing), and at every step boundary the stop vote and a time budget's plan, which must not
# wait for the GPU. Beside a gloo default group too: the default's timeout is the training's.
CPU_GROUP_TIMEOUT = datetime.timedelta(days=7)


@dataclass(frozen=True)
class Runtime:
    mode: str  # the resolved mode: single, dp, ddp or fsdp
    device: torch.device
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1  # processes; DataParallel's replicas share one process
    replicas: int = 1  # devices this process computes on: DataParallel's GPUs, else 1
    multiprocess: bool = False  # one of a torchrun process group: collectives are real
    cpu_group: object = field(default=None, compare=False, repr=False)  # gloo, host tensors
    machines: int = 1  # torchrun's nodes: each builds its own token cache
    timeout: datetime.timedelta = TIMEOUT  # of the training collectives

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def num_devices(self) -> int:
        """Devices computing the run, for MFU: processes x replicas per process."""
        return self.world_size * self.replicas


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto``: this process's GPU when CUDA is available, else the CPU."""
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda but no CUDA GPU is visible (use --device cpu or auto)")
    if name == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def setup(mode: str, device: str = "auto", *, process_group: bool = False) -> Runtime:
    """The Runtime of ``mode`` on ``device``; with ``process_group`` (the mode's processes form
    one: `parallelize.MODES`), join torchrun's."""
    torchrun = under_torchrun()
    if process_group and not torchrun:
        raise UserError(
            f"--mode {mode} needs torchrun (run: torchrun --standalone --nproc_per_node=N "
            "train.py ...)"
        )
    if not process_group and torchrun and int(os.environ["WORLD_SIZE"]) > 1:
        raise UserError(
            f"--mode {mode} under torchrun with several processes (use --mode ddp or fsdp)"
        )
    if not process_group:
        dev = resolve_device(device)
        gpus = torch.cuda.device_count() if dev.type == "cuda" else 0
        if mode == "dp" and gpus < 2:
            print(f"--mode dp: {gpus} GPU(s) visible, running unwrapped on {dev}", file=sys.stderr)
        return Runtime(mode=mode, device=dev, replicas=gpus if mode == "dp" and gpus > 1 else 1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    timeout = collective_timeout()
    dev = resolve_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if dev.type == "cuda" else "gloo",
            device_id=dev if dev.type == "cuda" else None,
            timeout=timeout,
            store=_elastic_store(rank, world, timeout),
            rank=rank,
            world_size=world,
        )
    group = dist.new_group(backend="gloo", timeout=CPU_GROUP_TIMEOUT)
    machines = world // int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return Runtime(
        mode, dev, rank, local_rank, world,
        multiprocess=True, cpu_group=group, machines=machines, timeout=timeout,
    )  # fmt: skip


def collective_timeout() -> datetime.timedelta:
    """`TIMEOUT`, or LLAMA_DDP_COLLECTIVE_TIMEOUT minutes."""
    text = os.environ.get(TIMEOUT_ENV)
    if text is None:
        return TIMEOUT
    try:
        minutes = float(text)
    except ValueError:
        minutes = -1.0
    if not minutes > 0:
        raise UserError(f"{TIMEOUT_ENV}={text} is not a positive number of minutes")
    return datetime.timedelta(minutes=minutes)


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
    if rt.multiprocess and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor, rt: Runtime) -> torch.Tensor:
    if rt.multiprocess:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def barrier(rt: Runtime) -> None:
    if rt.multiprocess:
        dist.barrier()


def preparation_barrier(rt: Runtime) -> None:
    """Wait for every rank, however long one spends preparing data (`CPU_GROUP_TIMEOUT`)."""
    if rt.multiprocess:
        dist.barrier(group=rt.cpu_group)


def any_rank(flag: bool, rt: Runtime) -> bool:
    """Whether ``flag`` is true on any rank: a host-side vote (gloo), so it never waits for
    the device's queued work, only for the other ranks to reach the same point."""
    if not rt.multiprocess:
        return flag
    votes = torch.tensor([int(flag)])
    dist.all_reduce(votes, op=dist.ReduceOp.SUM, group=rt.cpu_group)
    return bool(votes.item())


def broadcast_object(obj: object, rt: Runtime) -> object:
    """Rank 0's ``obj`` on every rank (for decisions only rank 0 can make, like which checkpoint
    to resume, or a time budget's plan at every step) on the CPU group: on the default group
    (NCCL on CUDA) broadcast_object_list copies a pageable tensor to the device and reads its
    size back, a sync with the device on every rank."""
    if not rt.multiprocess:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=rt.cpu_group)
    return box[0]
