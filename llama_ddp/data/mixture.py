"""Mixing sources by weight: which source, shard and item each sequence of each global batch is.

The global batches are one sequence of slots: optimizer step g (from 0) owns slots g*B to
g*B + B - 1, and micro-batch j of rank r in it the slice at (j * world_size + r) * micro_batch,
so every world size trains on the same global batches. Slot n goes to a source by Webster's
(Sainte-Lague) sequential rule: to the source whose next item has the smallest (c + 1/2) / w,
c being the items it has had and w its share of the items (ties: the first source). Every prefix
of the slots then gives each source its share to within about an item, and the counts after any
number of slots follow directly (`Plan.counts`): a resumed run finds its place by arithmetic.

A share of the items is a share of the tokens: in pack mode every item is a window of
seq_length + 1 tokens; in pad mode an item is one document, and a source's item share is its
weight over the mean length of the items of its first shard (the first the cache builds).

Each source is a stream of its items, epoch after epoch, so a small source repeats while a large
one goes on. Epoch 0 visits the source's shards in order (the cache builds them in that order, so
training starts on the first), each shard's items in a shuffled order; when a source runs out
(its cache is complete by then) its next epoch visits the shards in a shuffled order too. Every
permutation is seeded by the seed, the source's name, the epoch and the shard: the order depends
on the seed and the data alone, never on when a shard was built.
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import itertools
import threading
from collections.abc import Callable, Iterable, Iterator
from fractions import Fraction
from math import floor

import torch
from torch.utils.data import Dataset, Sampler

from llama_ddp.data.cache.read import ShardedSplit, TokenShard
from llama_ddp.errors import UserError


def micro_batch_size(global_batch: int, micro_batch: int | None, world_size: int) -> int:
    """Sequences per process per forward (default: the global batch split over the processes);
    a UserError unless the global batch is micro batch x world size x accumulation steps."""
    micro = micro_batch or global_batch // world_size
    per_pass = micro * world_size
    if micro_batch is None and (micro < 1 or global_batch % per_pass):
        raise UserError(
            f"--batch-size {global_batch} does not split over {world_size} processes (choose a "
            f"global batch that is a multiple of {world_size})"
        )
    if micro < 1 or global_batch % per_pass:
        raise UserError(
            f"--batch-size {global_batch} is not a multiple of --micro-batch-size {micro} x "
            f"{world_size} process(es) = {max(per_pass, 1)} (choose a global batch divisible by "
            "micro batch x world size)"
        )
    return micro


class Plan:
    """Which source each slot goes to, for item shares ``weights`` (normalized here)."""

    def __init__(self, weights: Iterable[Fraction | float]) -> None:
        w = [Fraction(x) for x in weights]
        self.weights = [x / sum(w) for x in w]

    def counts(self, n: int) -> list[int]:
        """Items of each source among the first ``n`` slots."""
        w = self.weights
        if len(w) == 1:
            return [n]
        # Slots go in the order of (2c + 1) / w (then source). Those at most 2n come first...
        c = [max(0, floor(n * x + Fraction(1, 2))) for x in w]
        total = sum(c)
        while total > n:  # ...then drop the latest taken, or take the next, to n exactly
            s = max((s for s in range(len(w)) if c[s]), key=lambda s: ((2 * c[s] - 1) / w[s], s))
            c[s] -= 1
            total -= 1
        while total < n:
            c[self._next(c)] += 1
            total += 1
        return c

    def _next(self, c: list[int]) -> int:
        return min(range(len(c)), key=lambda s: ((2 * c[s] + 1) / self.weights[s], s))

    def slots(self, start: int, count: int) -> list[tuple[int, int]]:
        """(source, its item number) of slots ``start`` to ``start + count - 1``."""
        c = self.counts(start)
        if len(c) == 1:
            return [(0, c[0] + i) for i in range(count)]
        heap = [((2 * n + 1) / w, s) for s, (n, w) in enumerate(zip(c, self.weights))]
        heapq.heapify(heap)
        out = []
        for _ in range(count):
            _, s = heapq.heappop(heap)
            out.append((s, c[s]))
            c[s] += 1
            heapq.heappush(heap, ((2 * c[s] + 1) / self.weights[s], s))
        return out


class ShardedDataset(Dataset):
    """One split of one source: the items of its shards (``make`` turns a shard into a dataset
    of its items: pack-mode windows or pad-mode documents). ``item(k, i)`` reads item i of shard
    k; a complete split also takes flat indices (validation, tests)."""

    def __init__(self, split: ShardedSplit, make: Callable[[TokenShard], Dataset]) -> None:
        self.split, self.make = split, make
        self._parts: dict[int, Dataset] = {}
        self._cum: list[int] | None = None

    def part(self, k: int) -> Dataset:
        if k >= len(self.split.shards):  # a loader worker's copy: built since it was made
            self.split.refresh()
        if k not in self._parts:
            self._parts[k] = self.make(self.split.shards[k])
        self.split.shard(k)  # the shard is in use: keep it mapped
        return self._parts[k]

    def items(self, k: int) -> int:
        return len(self.part(k))

    def fetch(self, k: int, indices: list[int]) -> list[tuple[torch.Tensor, ...]]:
        """Items of shard k as the loader reads them (with document ids where they apply)."""
        part = self.part(k)
        read = getattr(part, "__getitems__", None)
        return read(indices) if read else [part[i] for i in indices]

    def targets(self, k: int, i: int) -> int:
        return self.part(k).targets(i)

    def _cumulative(self) -> list[int]:
        if self._cum is None:
            self.split.wait_complete()
            sizes = (self.items(k) for k in range(len(self.split.shards)))
            self._cum = list(itertools.accumulate(sizes, initial=0))
        return self._cum

    def __len__(self) -> int:
        return self._cumulative()[-1]

    def locate(self, index: int) -> tuple[int, int]:
        cum = self._cumulative()
        if not 0 <= index < cum[-1]:
            raise IndexError(index)
        k = bisect.bisect_right(cum, index) - 1
        return k, index - cum[k]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        k, i = self.locate(index)
        return self.part(k)[i]

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, ...]]:
        return [self.fetch(k, [i])[0] for k, i in map(self.locate, indices)]


class MixtureDataset(Dataset):
    """The training items of every source, keyed ``(source, shard, item)``."""

    def __init__(self, sources: list[ShardedDataset]) -> None:
        self.sources = sources

    def __getitem__(self, key: tuple[int, int, int]) -> tuple[torch.Tensor, ...]:
        s, k, i = key
        return self.sources[s].part(k)[i]

    def __getitems__(self, keys: list[tuple[int, int, int]]) -> list[tuple[torch.Tensor, ...]]:
        return [self.sources[s].fetch(k, [i])[0] for s, k, i in keys]

    def targets(self, key: tuple[int, int, int]) -> int:
        s, k, i = key
        return self.sources[s].targets(k, i)


def _seed(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") >> 1


def _permutation(n: int, *seed: object) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(_seed(*seed)))


class SourceStream:
    """One source's training items, epoch after epoch: item number c -> (epoch, shard, item).
    A ``whole`` source (its cache complete before training, see pipeline.py) is shuffled as one
    every epoch; any other visits its shards in order in epoch 0 (module docstring)."""

    def __init__(self, data: ShardedDataset, name: str, seed: int, whole: bool = False) -> None:
        self.data, self.name, self.seed, self.whole = data, name, seed, whole
        self.cum = [0]  # items before each shard of epoch 0 (as far as built)
        self._orders: dict[int, tuple[list[int], list[int]]] = {}  # epoch >= 1: shards, cum
        self._perms: dict[tuple, torch.Tensor] = {}

    @property
    def split(self) -> ShardedSplit:
        return self.data.split

    def _grow(self) -> bool:
        """Take in the next shard of epoch 0 (waiting for it); False at the source's end."""
        k = len(self.cum) - 1
        if not self.split.wait_for_shard(k):
            return False
        self.cum.append(self.cum[-1] + self.data.items(k))
        return True

    def size(self) -> int:
        """Items in one epoch (the source complete); a UserError when it has none."""
        while self._grow():
            pass
        if self.cum[-1] == 0:
            raise UserError(
                f"source {self.name!r} has {self.split.total['tokens']} tokens, fewer than one "
                "training sequence (use a smaller sequence length or more data)"
            )
        return self.cum[-1]

    def locate(self, c: int) -> tuple[int, int, int]:
        """(epoch, shard, item in shard) of the source's item number ``c``."""
        if self.whole:
            epoch, pos = divmod(c, self.size())
            flat = int(self._permutation(epoch, None, self.cum[-1])[pos])
            k = bisect.bisect_right(self.cum, flat) - 1
            return epoch, k, flat - self.cum[k]
        while c >= self.cum[-1] and self._grow():
            pass
        if c < self.cum[-1]:
            epoch, pos, shards, cum = 0, c, None, self.cum
        else:
            epoch, pos = divmod(c, self.size())
            shards, cum = self._order(epoch)
        j = bisect.bisect_right(cum, pos) - 1
        k = j if shards is None else shards[j]
        return epoch, k, int(self._permutation(epoch, k, self.data.items(k))[pos - cum[j]])

    def _permutation(self, epoch: int, k: int | None, n: int) -> torch.Tensor:
        """The order of shard k's items (None: of all the source's) in ``epoch``."""
        if (epoch, k) not in self._perms:
            if len(self._perms) > 8:
                self._perms.clear()
            self._perms[epoch, k] = _permutation(n, self.seed, self.name, epoch, k)
        return self._perms[epoch, k]

    def _order(self, epoch: int) -> tuple[list[int], list[int]]:
        if epoch not in self._orders:
            shards = _permutation(len(self.cum) - 1, self.seed, self.name, epoch).tolist()
            cum = list(itertools.accumulate((self.data.items(k) for k in shards), initial=0))
            self._orders = {epoch: (shards, cum)}
        return self._orders[epoch]

    def epoch(self, c: int) -> int:
        return self.locate(c)[0] if c else 0


class MixtureSampler(Sampler[list[tuple[int, int, int]]]):
    """This rank's micro-batches of keys ``(source, shard, item)``, from optimizer step ``step``
    on (``seek``), without end: the sources repeat as they run out (``note`` says so)."""

    def __init__(
        self,
        plan: Plan,
        streams: list[SourceStream],
        *,
        global_batch: int,
        micro_batch: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        note: Callable[[str], None] | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise UserError(f"rank {rank} is outside world size {world_size}")
        micro_batch_size(global_batch, micro_batch, world_size)  # a UserError on a bad shape
        self.plan, self.streams, self.note = plan, streams, note
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.accum_steps = global_batch // (micro_batch * world_size)
        self.step = 0
        self.steps_per_epoch: int | None = None  # known once every source's cache is complete
        self._keys: dict[int, list[tuple[int, int, int]]] = {}
        self._noted: set[tuple[int, int]] = set()
        # The loader reads ahead in the prefetch thread while the loop asks about past steps.
        self._lock = threading.Lock()

    def set_micro_batch(self, micro_batch: int) -> None:
        """Read ``micro_batch`` sequences per forward (--micro-batch-size auto's choice, made
        before the first batch is read): the global batches stay the same, accumulation covers
        the rest."""
        micro_batch_size(self.global_batch, micro_batch, self.world_size)
        self.micro_batch = micro_batch
        self.accum_steps = self.global_batch // (micro_batch * self.world_size)

    def seek(self, step: int) -> None:
        self.step = step

    def global_keys(self, g: int) -> list[tuple[int, int, int]]:
        """The keys of global batch g (optimizer step g + 1), in slot order."""
        with self._lock:
            return self._global_keys(g)

    def _global_keys(self, g: int) -> list[tuple[int, int, int]]:
        if g not in self._keys:
            if len(self._keys) > 64:
                self._keys.clear()
            keys = []
            for s, c in self.plan.slots(g * self.global_batch, self.global_batch):
                epoch, k, i = self.streams[s].locate(c)
                if epoch and self.note and (s, epoch) not in self._noted:
                    self._noted.add((s, epoch))
                    self.note(
                        f"source {self.streams[s].name!r} ran out: its epoch {epoch} begins "
                        f"(reshuffled) at step {g + 1}"
                    )
                keys.append((s, k, i))
            self._keys[g] = keys
        return self._keys[g]

    def epoch(self, step: int) -> int:
        """The epoch optimizer step ``step`` (from 1) starts in: with several sources, that of
        the most repeated one."""
        counts = self.plan.counts((step - 1) * self.global_batch)
        with self._lock:  # the streams grow their shard lists as the cache is built
            return max(stream.epoch(c) for stream, c in zip(self.streams, counts))

    def __iter__(self) -> Iterator[list[tuple[int, int, int]]]:
        return self._from(self.step)

    def _from(self, step: int) -> Iterator[list[tuple[int, int, int]]]:
        micro = self.micro_batch
        for g in itertools.count(step):
            keys = self.global_keys(g)
            for j in range(self.accum_steps):
                start = (j * self.world_size + self.rank) * micro
                yield keys[start : start + micro]
