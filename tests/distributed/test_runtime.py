"""distributed/runtime.py: the runtime of each mode, and waits that must outlive the collective
timeout."""

import datetime
import json
import os
import time

import torch

from llama_ddp.distributed import runtime as D
from llama_ddp.distributed.parallelize import runtime
from tests.helpers.runs import free_port, start_ranks


def _prepare(rank: int, port: int, out: str) -> None:
    """One rank of a 2-process gloo job whose collectives time out after 2 s, where rank 0
    spends 5 s preparing data (as local rank 0 does while it builds the token cache)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
    )  # fmt: skip
    D.TIMEOUT = datetime.timedelta(seconds=2)
    rt = runtime("ddp", "cpu")
    # The stop vote: a signal seen by one rank stops every rank, at the same step boundary.
    result = {"votes": [D.any_rank(rank == 1, rt), D.any_rank(False, rt)]}
    start = time.perf_counter()
    if rank == 0:
        time.sleep(5)
    D.preparation_barrier(rt)
    result["preparation_wait_s"] = time.perf_counter() - start
    if rank == 0:
        time.sleep(5)  # the same wait on the training group times out: what used to happen
    try:
        D.barrier(rt)
        result["plain_barrier"] = "returned"
    except RuntimeError as exc:
        result["plain_barrier"] = f"failed: {str(exc).splitlines()[0][:80]}"
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)


def test_data_preparation_outlives_the_collective_timeout(tmp_path):
    start_ranks(_prepare, (free_port(), str(tmp_path)))
    leader, follower = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert leader["votes"] == follower["votes"] == [True, False]
    assert follower["preparation_wait_s"] > 4.5  # it waited for rank 0, past the 2 s timeout
    assert follower["plain_barrier"].startswith("failed")  # the timeout is real in this setup


def test_data_parallel_counts_its_replicas_for_mfu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    rt = runtime("dp", "auto")
    assert (rt.device, rt.replicas, rt.world_size, rt.num_devices) == (
        torch.device("cuda", 0), 4, 1, 4,
    )  # fmt: skip
    assert runtime("single", "auto").num_devices == 1
    assert D.Runtime("ddp", torch.device("cpu"), world_size=3).num_devices == 3
