"""The global-batch sampler: the same global batches at every world size, resumed by index
arithmetic."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

from llama_ddp.config import micro_batch_size
from llama_ddp.errors import UserError


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields this rank's micro-batches so that every world size trains on the same global batches.

    Epoch e visits ``randperm(num_samples, seed + e)``; optimizer step g takes the global batch
    ``order[g*B:(g+1)*B]``; micro-batch j of rank r in that step is the slice starting at
    ``(j*world_size + r) * micro_batch``. The incomplete last global batch is dropped. Iterating
    yields the micro-batches of ``epoch`` from optimizer step ``step`` on (``seek`` sets both), so
    a resumed run's position is index arithmetic: nothing before it is read.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        global_batch: int,
        micro_batch: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if not 0 <= rank < world_size:
            raise UserError(f"rank {rank} is outside world size {world_size}")
        micro_batch_size(global_batch, micro_batch, world_size)  # a UserError on a bad shape
        if num_samples < global_batch:
            raise UserError(
                f"dataset has {num_samples} sequences, fewer than one global batch of "
                f"{global_batch} (lower the batch size or use more data)"
            )
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.accum_steps = global_batch // (micro_batch * world_size)
        self.steps_per_epoch = num_samples // global_batch
        self.epoch = 0
        self.step = 0

    def seek(self, epoch: int, step: int) -> None:
        """Start the next iteration at optimizer step ``step`` of ``epoch``."""
        if not 0 <= step < self.steps_per_epoch:
            raise ValueError(f"step {step} is outside an epoch of {self.steps_per_epoch} steps")
        self.epoch, self.step = epoch, step

    def _order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=generator)

    def __iter__(self) -> Iterator[list[int]]:
        order = self._order(self.epoch)
        micro = self.micro_batch
        for g in range(self.step, self.steps_per_epoch):
            batch = order[g * self.global_batch : (g + 1) * self.global_batch]
            for j in range(self.accum_steps):
                start = (j * self.world_size + self.rank) * micro
                yield batch[start : start + micro].tolist()

    def __len__(self) -> int:
        return (self.steps_per_epoch - self.step) * self.accum_steps
