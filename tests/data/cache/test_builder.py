"""builder.py: the cache built in a background process, its failures raised, its stop clean."""

import os
import time
from pathlib import Path

import pytest

from llama_ddp.data.cache.build import Job, Sharding, build
from llama_ddp.data.cache.builder import Builder
from llama_ddp.data.tokenizer_files import special_ids
from llama_ddp.errors import UserError, WriteFailed

SMALL = Sharding(first=100, largest=400)  # shards of 100, 200, then 400 characters


def test_the_test_knobs_are_read_from_the_environment(monkeypatch):
    """LLAMA_DDP_SHARDS: the cuts, and a slow builder's delay from a given shard on."""
    monkeypatch.setenv("LLAMA_DDP_SHARDS", "first=4000,largest=8000,whole=0,delay=2.5,delay_from=1")
    sharding = Sharding.from_env()
    assert [sharding.chars(k) for k in range(3)] == [4000, 8000, 8000] and sharding.whole == 0
    assert [sharding.delay_of(k) for k in range(3)] == [0.0, 2.5, 2.5]
    monkeypatch.setenv("LLAMA_DDP_SHARDS", "delay=0.5")
    assert Sharding.from_env().delay_of(0) == 0.5


class Failing:
    """Texts whose reading raises ``exc`` (in the builder process: picklable)."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __iter__(self):
        raise self.exc
        yield


class Stalled:
    """Texts that stall before their first document, once ``started`` says so."""

    def __init__(self, started: Path) -> None:
        self.started = started

    def __iter__(self):
        self.started.write_text("")
        time.sleep(120)
        yield "never read"


def jobs(folder: Path, texts: list[str]) -> list[Job]:
    return [
        Job(folder, "train", texts[2:], "uint16", SMALL),
        Job(folder, "validation", texts[:2], "uint16", SMALL),
    ]


def test_the_background_builds_what_build_builds_here(tmp_path, tiny_tokenizer, texts):
    ids = special_ids(tiny_tokenizer)
    build(jobs(tmp_path / "here", texts), tiny_tokenizer.to_str(), ids, 1)
    builder = Builder(jobs(tmp_path / "there", texts), tiny_tokenizer, ids, 1)
    builder.process.join(120)
    assert builder.process.exitcode == 0 and not builder.running
    builder.check()
    here = sorted(p.name for p in (tmp_path / "here").iterdir())
    assert len(here) > 6 and sorted(p.name for p in (tmp_path / "there").iterdir()) == here
    for name in here:
        assert (tmp_path / "there" / name).read_bytes() == (tmp_path / "here" / name).read_bytes()
    builder.stop()
    assert not Path(builder.error_path).exists()


def test_what_stopped_the_builder_is_raised_by_check(tmp_path, tiny_tokenizer):
    """A user's mistake and a refused write as themselves, anything else as a crash with its
    traceback (three builders, started at once)."""
    failures = {
        "user": UserError("column 'text' not found (pass --text-column)"),
        "write": WriteFailed("the disk is full (free some space)"),
        "crash": ValueError("a bug"),
    }
    ids = special_ids(tiny_tokenizer)
    builders = {
        kind: Builder(
            [Job(tmp_path / kind, "train", Failing(exc), "uint16", SMALL)], tiny_tokenizer, ids, 1
        )
        for kind, exc in failures.items()
    }
    for builder in builders.values():
        builder.process.join(120)
        assert builder.process.exitcode == 2
    for kind in ("user", "write"):
        with pytest.raises(type(failures[kind])) as error:
            builders[kind].check()
        assert str(error.value) == str(failures[kind])
    with pytest.raises(RuntimeError) as error:
        builders["crash"].check()
    crash = str(error.value)
    assert crash.startswith("the token cache builder failed (exit 2):\nTraceback (most recent")
    assert crash.endswith("\nValueError: a bug\n")
    for builder in builders.values():
        builder.stop()
        assert not Path(builder.error_path).exists()


def test_a_stopped_builder_ends_its_work_cleanly_and_ran_below_the_run(tmp_path, tiny_tokenizer):
    started = tmp_path / "started"
    job = Job(tmp_path / "cache", "train", Stalled(started), "uint16", SMALL)
    builder = Builder([job], tiny_tokenizer, special_ids(tiny_tokenizer), 1)
    deadline = time.monotonic() + 120
    while not started.exists() and builder.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert started.exists() and builder.running
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    assert os.getpriority(os.PRIO_PROCESS, builder.process.pid) == min(19, ours + 10)
    builder.stop()
    assert builder.process.exitcode == 0  # its SIGTERM handler ended the build, not the signal
    builder.check()  # a stop is no failure
    assert not Path(builder.error_path).exists()
