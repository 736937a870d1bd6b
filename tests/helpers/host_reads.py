"""What a training step's forward and backward ask of the host, recorded on the CPU.

On CUDA, reading a tensor's value on the host (``.item()``, ``.tolist()``, ``nonzero()``, a
boolean-mask index, ``.cpu()``) waits for every kernel queued before it, and a copy from the host
in the forward (a kwarg moved by DDP's ``_to_kwargs``, a ``torch.tensor(...)``) is a blocking
copy from pageable memory. On the CPU these are cheap and some are invisible (``.cpu()`` of a CPU
tensor dispatches nothing), so `HostReads` watches two levels: every aten operation (a
TorchDispatchMode: value reads, data-dependent shapes, tensors made from host data, copies across
devices) and the Python methods that move or read tensors without dispatching on the CPU.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# Operations that read a device value on the host or whose output shape depends on values.
READS = {
    aten._local_scalar_dense,  # .item(), int(), float(), bool()
    aten.nonzero,
    aten.nonzero_static,
    aten.masked_select,
    aten._unique2,
    aten.unique_consecutive,
    aten.unique_dim,
    aten.lift_fresh,  # torch.tensor(host data)
    aten.lift_fresh_copy,
}
METHODS = ("tolist", "cpu", "cuda", "numpy", "to")


def _moves(args: tuple, kwargs: dict) -> bool:
    """Whether a ``Tensor.to`` call names a device."""
    return "device" in kwargs or any(isinstance(a, (str, torch.device)) for a in args)


class HostReads(TorchDispatchMode):
    """Records, while active, each host read or host copy (``seen``), except of the tensors in
    ``exempt`` (host tensors that never go to the device)."""

    def __init__(self, exempt: list[torch.Tensor] = ()) -> None:
        super().__init__()
        self.exempt = {id(t) for t in exempt}
        self.seen: list[str] = []
        self.ops = 0  # operations watched
        self._patches = contextlib.ExitStack()

    def _record(self, what: str, tensor: object) -> None:
        if id(tensor) not in self.exempt:
            frame = sys._getframe(2)
            self.seen.append(f"{what} at {frame.f_code.co_filename}:{frame.f_lineno}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        packet = func.overloadpacket
        if packet in READS:
            self._record(str(func), args[0] if args else None)
        elif packet is aten.index and any(
            i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]
        ):
            self._record("boolean-mask index", args[0])
        elif packet is aten._to_copy and kwargs.get("device") not in (None, args[0].device):
            self._record(f"copy to {kwargs['device']}", args[0])
        elif packet is aten.copy_ and args[0].device != args[1].device:
            self._record(f"copy from {args[1].device}", args[1])
        return func(*args, **kwargs)

    def __enter__(self):
        for name in METHODS:
            original = getattr(torch.Tensor, name)

            def watched(tensor, *args, _original=original, _name=name, **kwargs):
                if _name != "to" or _moves(args, kwargs):
                    self._record(f"Tensor.{_name}", tensor)
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, watched)
            self._patches.callback(setattr, torch.Tensor, name, original)
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self._patches.close()


def record_step(trainer, micro_batches) -> list[str]:
    """One optimizer step of ``trainer``, its forwards (the wrapper's own input handling, the
    model, the loss) and backwards watched by `HostReads`; what they read or copied. The plan's
    grids (the CPU kernel reads them on the host: they never leave it) are exempt."""
    import llama_ddp.train.trainer as trainer_module

    exempt = [b.plan.grids for b in micro_batches if b.plan is not None]
    recorder = HostReads(exempt)
    original_loss, original_backward = trainer_module.batch_loss_sum, torch.Tensor.backward

    def loss(*args, **kwargs):
        with recorder:
            return original_loss(*args, **kwargs)

    def backward(tensor, *args, **kwargs):
        with recorder:
            return original_backward(tensor, *args, **kwargs)

    trainer_module.batch_loss_sum, torch.Tensor.backward = loss, backward
    try:
        trainer.step(micro_batches)
    finally:
        trainer_module.batch_loss_sum, torch.Tensor.backward = original_loss, original_backward
    assert recorder.ops > 100, recorder.ops  # the forwards and backwards were watched
    return recorder.seen


# Each mode's step is recorded on batches with documents kept apart (pack) and on padded rows
# whose layers are recomputed in the backward (pad + activation checkpointing).
VARIANTS = {
    "pack": ["--packing", "pack"],
    "pad": ["--packing", "pad", "--activation-checkpointing"],
}


def record_ranks(rank: int, port: int, argv: list[str], folder: str) -> None:
    """One of two gloo processes (torch.multiprocessing): a recorded step (`record_step`) of DDP
    and of FSDP for each of `VARIANTS`, written to ``folder/rank{rank}.json``."""
    import json
    import os
    from pathlib import Path

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE="2", OMP_NUM_THREADS="1",
    )  # fmt: skip
    torch.set_num_threads(1)
    from llama_ddp.distributed import runtime as D
    from llama_ddp.distributed.parallelize import runtime
    from llama_ddp.train.cli import parse_train_args
    from llama_ddp.train.run import build_trainer

    seen = {}
    for mode in ("ddp", "fsdp"):
        rt = runtime(mode, "cpu")
        for name, extra in VARIANTS.items():
            trainer = build_trainer(parse_train_args([*argv, *extra, "--mode", mode]), rt)
            batches = trainer.data.batches(0)
            trainer.step(next(batches))  # the optimizer's state, the wrappers' lazy setup
            seen[f"{mode} {name}"] = record_step(trainer, next(batches))
    Path(folder, f"rank{rank}.json").write_text(json.dumps(seen))
    D.teardown(rt)
