"""The next step's batch ready before this step ends: `Prefetcher` takes each optimizer step's
micro-batches from the loader in a thread of its own (sampling, collating, planning the attention:
batch.py) and, on CUDA, copies them to the device from pinned memory on a side stream, while the
training step runs on the default stream.

What the loop consumes is exactly what the loader yields, in order: the data position a
checkpoint saves is the trainer's step (the batches consumed), never how far the thread has read
ahead, so a run resumed from a checkpoint sees the same batches.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator

import torch

from llama_ddp.data.batch import Batch


class _Failed:
    """What the thread hands over in place of a batch when the loader raised."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class Prefetcher:
    """Iterates over ``batches`` (each step's micro-batches) ``depth`` steps ahead of the loop, on
    ``device``. An error of the loader (a broken data file, a stopped cache builder) is raised by
    the ``next`` that would have returned its batch. ``close`` stops the thread."""

    def __init__(
        self, batches: Iterator[list[Batch]], device: torch.device, depth: int = 1
    ) -> None:
        self.batches, self.device = batches, torch.device(device)
        cuda = self.device.type == "cuda"
        if cuda and self.device.index is None:  # the thread sets it as its current device
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stopping = threading.Event()
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self.thread = threading.Thread(target=self._fill, name="llama_ddp-prefetch", daemon=True)
        self.thread.start()

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> list[Batch]:
        item = self.queue.get()
        if isinstance(item, _Failed):
            raise item.error
        micro_batches, ready = item
        if ready is not None:  # the copies were queued on the side stream: wait there, not here
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(ready)
            for batch in micro_batches:  # memory the side stream allocated, used on this one
                batch.record_stream(stream)
        return micro_batches

    def close(self) -> None:
        """Stop the thread. One still inside the loader (waiting for a shard the cache builder
        has yet to write) is not waited for: it stops once its batch is made, and dies with the
        process, which it never holds up (a daemon)."""
        self.stopping.set()
        with contextlib.suppress(queue.Empty):  # a thread waiting to hand over a batch sees it
            self.queue.get_nowait()
        self.thread.join(timeout=1.0)

    def _fill(self) -> None:
        if self.stream is not None:
            torch.cuda.set_device(self.device)  # the loader pins memory in this thread
        try:
            for micro_batches in self.batches:
                if not self._hand_over(self._moved(micro_batches)):
                    return
            self._hand_over(_Failed(StopIteration()))
        except BaseException as exc:  # handed to the loop, which raises it
            self._hand_over(_Failed(exc))

    def _hand_over(self, item: object) -> bool:
        """Put ``item`` in the queue once there is room; False if the loop stopped first."""
        while not self.stopping.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _moved(self, micro_batches: list[Batch]) -> tuple[list[Batch], torch.cuda.Event | None]:
        """The micro-batches on the device, and the event their copies complete at (None on the
        CPU, where there is nothing to copy)."""
        if self.stream is None:
            return micro_batches, None
        with torch.cuda.stream(self.stream):
            moved = [b.pin_memory().to(self.device) for b in micro_batches]
            ready = torch.cuda.Event()
            ready.record(self.stream)
        return moved, ready
