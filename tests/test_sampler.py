"""sampler.py: GlobalBatchSampler: the same global batches at every world size."""

import pytest
import torch

from llama_ddp.data import (
    GlobalBatchSampler,
)
from llama_ddp.errors import UserError


def micro_batches_by_step(num_samples, world_size, *, global_batch, micro_batch, seed=0, epoch=0):
    """{step: [indices of all ranks' micro-batches]} for one epoch."""
    steps: dict[int, list[int]] = {}
    for rank in range(world_size):
        s = GlobalBatchSampler(
            num_samples,
            global_batch=global_batch,
            micro_batch=micro_batch,
            rank=rank,
            world_size=world_size,
            seed=seed,
        )
        s.seek(epoch, 0)
        assert len(s) == s.steps_per_epoch * s.accum_steps
        for k, mb in enumerate(s):
            assert len(mb) == micro_batch
            steps.setdefault(k // s.accum_steps, []).extend(mb)
    return steps


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_every_world_size_trains_on_the_same_global_batches(world_size):
    reference = micro_batches_by_step(103, 1, global_batch=8, micro_batch=8)
    steps = micro_batches_by_step(103, world_size, global_batch=8, micro_batch=2)
    assert len(steps) == len(reference) == 103 // 8
    for g, indices in steps.items():
        assert sorted(indices) == sorted(reference[g])


def test_two_ranks_cover_the_epoch_once():
    n, b = 50, 8
    steps = micro_batches_by_step(n, 2, global_batch=b, micro_batch=2)
    seen = [i for g in sorted(steps) for i in steps[g]]
    assert len(seen) == len(set(seen)) == (n // b) * b
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    assert set(seen) == set(order[: (n // b) * b].tolist())


def test_epochs_reshuffle_and_unshuffled_is_in_order():
    first = micro_batches_by_step(40, 1, global_batch=8, micro_batch=4, epoch=0)
    second = micro_batches_by_step(40, 1, global_batch=8, micro_batch=4, epoch=1)
    assert first != second and sorted(sum(first.values(), [])) == sorted(sum(second.values(), []))
    plain = GlobalBatchSampler(40, global_batch=8, micro_batch=4, shuffle=False)
    assert sum(list(plain), []) == list(range(40))


def test_seeking_to_a_step_equals_continuing():
    kwargs = dict(global_batch=8, micro_batch=2, rank=1, world_size=2, seed=3)
    s = GlobalBatchSampler(100, **kwargs)
    s.seek(2, 0)
    whole = list(s)
    assert len(whole) == s.steps_per_epoch * 2  # two micro-batches per step on each rank
    s.seek(2, 3)  # three optimizer steps in: nothing before them is read
    assert len(s) == len(whole) - 3 * s.accum_steps
    assert list(s) == whole[3 * s.accum_steps :]
    with pytest.raises(ValueError, match="outside an epoch of 12 steps"):
        s.seek(0, 12)


def test_sampler_shape_errors():
    with pytest.raises(
        UserError, match=r"--batch-size 10 is not a multiple of --micro-batch-size 2 x 4 "
    ):
        GlobalBatchSampler(100, global_batch=10, micro_batch=2, world_size=4)
    with pytest.raises(
        UserError, match="dataset has 5 sequences, fewer than one global batch of 8"
    ):
        GlobalBatchSampler(5, global_batch=8, micro_batch=4)
    with pytest.raises(UserError, match="outside world size"):
        GlobalBatchSampler(100, global_batch=8, micro_batch=4, rank=2, world_size=2)
