"""safe_io.py: one writer per run folder, refused writes as one line, no temporaries left."""

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from llama_ddp.errors import UserError, WriteFailed
from llama_ddp.files import safe_io
from tests.helpers.runs import ROOT, tiny_args, train_here


@pytest.mark.e2e
def test_a_second_run_into_a_busy_folder_is_refused_and_a_killed_holder_never_blocks(
    train_env, tmp_path
):
    # stopped long before its 100000 steps, which --compile auto would compile for
    args = tiny_args(
        train_env, tmp_path, "--max-steps", "100000", "--save-every", "0", "--no-compile"
    )
    first = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args],
        env=train_env["env"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        metrics = tmp_path / "metrics.jsonl"
        deadline = time.time() + 120
        while time.time() < deadline and not (metrics.exists() and '"loss"' in metrics.read_text()):
            time.sleep(0.2)
        # The holder trains for 100000 steps: a second run that waited for the lock would hang.
        second = train_here(train_env, tiny_args(train_env, tmp_path, "--max-steps", "2"))
        lines = second.stderr.strip().splitlines()
        assert second.returncode == 2 and len(lines) == 1, second.stderr
        assert f"is in use by another run (PID {first.pid})" in lines[0]
        assert first.poll() is None  # the holder trains on, undisturbed
        first.send_signal(signal.SIGTERM)  # it finishes normally: a checkpoint, exit 143
        out, err = first.communicate(timeout=120)
        assert first.returncode == 143, err[-2000:]
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    holder = subprocess.Popen(  # a run killed while it holds the lock...
        [sys.executable, str(ROOT / "train.py"), *args],
        env=train_env["env"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        lock, deadline = tmp_path / ".lock", time.time() + 120
        while time.time() < deadline and lock.read_text().strip() != str(holder.pid):
            time.sleep(0.05)
        assert lock.read_text().strip() == str(holder.pid)  # it holds the lock now
    finally:
        holder.kill()
        holder.wait()
    after = train_here(train_env, [*args, "--max-steps", "20"])  # ...does not block the next
    assert after.returncode == 0, after.stderr[-3000:]


def test_a_refused_write_is_one_line_naming_the_path_and_space(tmp_path, monkeypatch):
    target = tmp_path / "big.bin"
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    with (
        pytest.raises(WriteFailed, match=r"cannot write checkpoint .*big.bin: No space left"),
        safe_io.writing(target, "checkpoint", needed=1000),
    ):
        raise full
    # torch's own writers lose the errno: a short write is recognized by its message
    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1 vs 2")
    with pytest.raises(WriteFailed, match="the write stopped short"), safe_io.writing(target, "x"):
        raise short
    rust = RuntimeError("Error while serializing: I/O error: File too large (os error 27)")
    with pytest.raises(WriteFailed, match="File too large"), safe_io.writing(target, "x"):
        raise rust  # safetensors' SafetensorError, the errno in its message only
    short = OSError("524288 requested and 445016 written")  # numpy's tofile (the GGUF writer)
    with pytest.raises(WriteFailed, match="the write stopped short"), safe_io.writing(target, "x"):
        raise short
    with pytest.raises(ValueError), safe_io.writing(target, "x"):  # anything else: not the disk
        raise ValueError("a bug")
    monkeypatch.setattr(safe_io, "free_bytes", lambda path: 500)
    with (
        pytest.raises(WriteFailed, match=r"needs 0.0 MB, the disk has 0.0 MB free"),
        safe_io.writing(target, "checkpoint", needed=1000),
    ):
        raise AssertionError("checked before writing anything")


def test_atomic_writes_leave_the_old_file_when_they_fail(tmp_path):
    path = tmp_path / "model.pth"
    safe_io.torch_save({"w": torch.ones(2)}, path)
    before = path.read_bytes()

    def fail(tmp):
        tmp.write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError):
        safe_io.atomic_write(path, fail)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["model.pth"]


def test_temporaries_of_a_killed_run_are_removed_and_set_aside_folders_put_back(tmp_path):
    (tmp_path / "checkpoints" / "step-00000004").mkdir(parents=True)
    (tmp_path / "checkpoints" / ".step-00000008.tmp-123").mkdir()  # a save cut short
    (tmp_path / ".llama_model.pth.tmp-123").write_bytes(b"half")
    (tmp_path / "hf.tmp").mkdir()
    (tmp_path / "hf.old").mkdir()  # killed between replace_dir's two renames: no hf/ yet
    (tmp_path / "hf.old" / "config.json").write_text("{}")
    removed = safe_io.remove_temporaries(tmp_path)
    assert len(removed) == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "hf"]
    assert (tmp_path / "hf" / "config.json").is_file()
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000004"]


def test_damaged_json_and_safetensors_are_one_line(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(1000)}, path)
    path.write_bytes(path.read_bytes()[:100])  # a truncated download
    with pytest.raises(UserError, match="is not a readable safetensors file"):
        safe_io.read_safetensors(path)
    (tmp_path / "c.json").write_text('{"a": ')
    with pytest.raises(UserError, match="is not readable JSON"):
        safe_io.read_json(tmp_path / "c.json", "model config")
    (tmp_path / "c.json").write_text("[1, 2]")
    with pytest.raises(UserError, match="model config .*c.json is not a JSON object"):
        safe_io.read_json(tmp_path / "c.json", "model config")


def test_out_dir_that_is_a_file_is_named_as_such(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError, match="is a file, not a folder"):
        safe_io.prepare_run_dir(tmp_path / "f")


def _resident() -> int:
    lines = Path("/proc/self/status").read_text().splitlines()
    status = dict(line.split(":", 1) for line in lines)
    return int(status["VmRSS"].split()[0]) * 1024


def test_model_weights_are_mapped_and_read_only_where_used(tmp_path):
    """--init-from under FSDP: each rank reads its slices of the source's tensors. A model file
    (ours, or safetensors) is mapped, not read: its pages load when a slice is used."""
    from safetensors.torch import save_file

    torch.save({"w": torch.zeros(16 * 2**20)}, tmp_path / "m.pth")  # 64 MiB
    save_file({"w": torch.zeros(16 * 2**20)}, tmp_path / "m.safetensors")
    for load in (
        lambda: safe_io.safe_load(tmp_path / "m.pth", mmap=True),
        lambda: safe_io.read_safetensors(tmp_path / "m.safetensors"),
    ):
        before = _resident()
        state = load()
        assert _resident() - before < 8 * 2**20  # not 64 MiB
        assert torch.equal(state["w"][: 2**20].clone(), torch.zeros(2**20))
        assert _resident() - before < 16 * 2**20  # the slice's pages only
        del state


def test_one_rule_for_a_file_a_command_writes(tmp_path):
    """A folder, a pipe, an existing file without --force, a path under a file or in a folder
    that cannot be written: refused in one line naming the flag and the path."""
    existing, folder, pipe = tmp_path / "s.json", tmp_path / "d", tmp_path / "p"
    existing.write_text("{}")
    folder.mkdir()
    os.mkfifo(pipe)
    refusals = {
        folder: f"--output {folder} is a folder (give a file name, e.g. {folder / 'out.json'})",
        pipe: f"--output {pipe} is not a regular file",
        existing: f"--output {existing} exists (pass --force to replace it)",
        existing / "x.json": f"{existing} is a file, not a folder",
    }
    for path, message in refusals.items():
        with pytest.raises(UserError) as err:
            safe_io.check_output(path, "--output", False, "out.json")
        assert message in str(err.value)
    assert safe_io.check_output(existing, "--output", True) == existing
    assert safe_io.check_output(tmp_path / "new" / "a.json", "--output", False).name == "a.json"
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(UserError, match="is not writable"):
            safe_io.check_output(locked / "a.json", "--output", False)
    assert existing.read_text() == "{}"


@pytest.mark.parametrize("kind", ["folder", "exists"])
def test_every_command_that_writes_a_users_path_checks_it_before_any_work(tmp_path, capsys, kind):
    """evaluate --output, export --gguf and plot --out: the same refusal, before the model is
    even looked for (a --model that does not exist is never reached), the existing file kept."""
    from llama_ddp.evaluate import main as evaluate
    from llama_ddp.export import main as export
    from llama_ddp.plot import main as plot_main

    target = tmp_path / "target"
    if kind == "folder":
        target.mkdir()
    else:
        target.write_text("kept")
    nowhere = str(tmp_path / "no-model")
    metrics = str(tmp_path / "metrics.jsonl")
    commands = {
        "--output": lambda: evaluate(["--model", nowhere, "--tasks", "x", "--output", str(target)]),
        "--gguf": lambda: export([nowhere, "--gguf", str(target)]),
        "--out": lambda: plot_main([metrics, "--out", str(target)]),
    }
    for flag, command in commands.items():
        assert command() == 2
        err = capsys.readouterr().err
        said = "is a folder" if kind == "folder" else "exists (pass --force to replace it)"
        assert err.startswith(f"error: {flag} {target} {said}") and err.count("\n") == 1, err
    if kind == "exists":
        assert target.read_text() == "kept"


@pytest.mark.parametrize("reader", ["model", "tokenizer", "perplexity", "json", "safetensors"])
def test_a_pipe_where_a_file_is_read_is_named_as_such_not_as_missing(tmp_path, reader):
    """Every reader of a file a user names says a pipe is not a regular file (it would block,
    or be read once), never "not found"; a missing file is "not found"."""
    from llama_ddp.data.tokenizer_files import read_tokenizer
    from llama_ddp.generate import _perplexity_docs
    from llama_ddp.interop.native import read_model

    readers = {
        "model": read_model,
        "tokenizer": read_tokenizer,
        "json": lambda p: safe_io.read_json(p, "config"),
        "safetensors": safe_io.read_safetensors,
        "perplexity": _perplexity_docs,
    }
    pipe = tmp_path / "file.json"
    os.mkfifo(pipe)
    with pytest.raises(UserError, match=r"file.json is not a regular file but a pipe, socket"):
        readers[reader](pipe)
    with pytest.raises(UserError, match=r"nowhere.json not found \("):
        readers[reader](tmp_path / "nowhere.json")


def test_absurd_sizes_in_a_safetensors_header_are_one_line(tmp_path):
    import json
    import struct

    from safetensors.torch import save_file

    good = tmp_path / "good.safetensors"
    save_file({"w": torch.ones(10)}, good)
    data = good.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + length])
    header["w"]["shape"] = [10**12]  # a tensor no file of this size holds
    text = json.dumps(header).encode()
    crafted = {
        "length": struct.pack("<Q", 2**60) + data[8:],
        "shape": struct.pack("<Q", len(text)) + text + data[8 + length :],
    }
    for name, content in crafted.items():
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(content)
        with pytest.raises(UserError, match=f"{name}.safetensors is not a readable safetensors"):
            safe_io.read_safetensors(path)


def test_a_path_too_long_for_the_system_is_named_with_the_part_at_fault(tmp_path):
    safe_io.check_name_length(tmp_path / ("b" * 255) / "run", "--out-dir")  # the most allowed
    with pytest.raises(UserError) as name:
        safe_io.check_name_length(tmp_path / ("b" * 256) / "run", "--out-dir")
    assert str(name.value) == (
        "--out-dir has a name of 256 bytes ('bbbbbbbbbbbbbbbbbbbb...'), more than the 255 its "
        "filesystem allows (choose a shorter --out-dir)"
    )
    deep = Path("/", *["c" * 200] * 25)  # every name allowed, the whole over PATH_MAX (4096)
    with pytest.raises(UserError) as whole:
        safe_io.check_name_length(deep, "--out-dir")
    assert str(whole.value) == (
        "--out-dir is 5,025 bytes long, more than this system allows in a path (choose a shorter "
        "--out-dir)"
    )
