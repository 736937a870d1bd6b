"""prefetch.py: the next step's batch is made while this step runs."""

import time

import pytest
import torch

from llama_ddp.data.prefetch import Prefetcher

CPU = torch.device("cpu")


def slow_source(n: int, load_s: float, log: list):
    for i in range(n):
        time.sleep(load_s)  # sampling, collating, planning: host work that releases the GIL
        log.append(i)
        yield [i]


def test_a_step_costs_the_longer_of_loading_and_computing_not_their_sum():
    """Loading takes 0.1 s and a step 0.1 s: with the loader a step ahead, 10 steps take about
    1.1 s (max, plus the first load), not 2 s (their sum); the batches come in order, all of
    them, and the thread never reads more than one step ahead of the loop."""
    n, load_s, compute_s = 10, 0.1, 0.1
    loaded: list[int] = []
    start = time.perf_counter()
    batches = Prefetcher(slow_source(n, load_s, loaded), CPU)
    seen = []
    for micro_batches in batches:
        seen += micro_batches
        time.sleep(compute_s)  # the training step
        assert len(loaded) <= len(seen) + 2  # the batch in the queue and the one being made
    elapsed = time.perf_counter() - start
    batches.close()
    assert seen == list(range(n))
    assert elapsed < 0.75 * (load_s + compute_s) * n


def test_an_error_of_the_loader_is_raised_by_the_loop_in_its_place():
    def broken():
        yield [0]
        raise ValueError("data file broken at line 3")

    batches = Prefetcher(broken(), CPU)
    assert next(batches) == [0]
    with pytest.raises(ValueError, match="line 3"):
        next(batches)
    batches.close()


def test_close_stops_a_thread_that_waits_to_hand_over_a_batch():
    def endless():
        i = 0
        while True:
            yield [i]
            i += 1

    batches = Prefetcher(endless(), CPU)
    assert next(batches) == [0]
    batches.close()
    assert not batches.thread.is_alive()


def test_close_does_not_wait_for_a_loader_that_waits_for_data():
    """A loader waiting for a shard the cache builder has yet to write does not hold up the end
    of the run; the thread stops once its batch is made."""
    import threading

    shard_written = threading.Event()

    def waiting():
        yield [0]
        assert shard_written.wait(timeout=30)
        yield [1]

    batches = Prefetcher(waiting(), CPU)
    assert next(batches) == [0]
    batches.close()
    assert batches.thread.is_alive()  # still inside the loader
    shard_written.set()
    batches.thread.join(timeout=30)
    assert not batches.thread.is_alive()
