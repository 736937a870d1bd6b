"""errors.py: run_command, the one entry of every command line: exit codes, --debug, pipes; and
exit_command, the end of every command's process."""

import os
import subprocess
import sys

import pytest

from llama_ddp.errors import (
    ArgumentParser,
    Interrupted,
    NonFiniteLoss,
    UserError,
    WriteFailed,
    run_command,
)
from tests.helpers.runs import ROOT


def raising(exc: BaseException):
    def body(argv: list[str]) -> int:
        raise exc

    return body


@pytest.mark.parametrize(
    "exc, code, line",
    [
        (UserError("bad flag (fix it)"), 2, "error: bad flag (fix it)"),
        (NonFiniteLoss("loss is nan"), 1, "error: loss is nan"),
        (WriteFailed("disk full"), 2, "error: disk full"),
        (Interrupted(15, "before training"), 143, "stopped by signal 15 before training"),
        (KeyboardInterrupt(), 130, ""),
    ],
)
def test_every_command_ends_the_same_way(exc, code, line, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert run_command(raising(exc), ["--x"]) == code
    captured = capsys.readouterr()
    assert captured.err == line + "\n" and captured.out == ""
    monkeypatch.setenv("RANK", "1")  # other ranks stay quiet
    assert run_command(raising(exc), []) == code
    assert capsys.readouterr().err == ""


def test_debug_shows_the_traceback_and_a_body_returns_its_code():
    with pytest.raises(UserError, match="bad"):
        run_command(raising(UserError("bad")), ["--debug"])
    assert run_command(lambda argv: None, []) == 0
    assert run_command(lambda argv: len(argv), ["a", "b", "c"]) == 3
    with pytest.raises(ZeroDivisionError):  # a bug is a traceback, not a quiet exit code
        run_command(lambda argv: 1 // 0, [])


@pytest.mark.parametrize(
    "command, line",
    [
        ("llama_ddp.generate", "required: --model (see llama-ddp-generate --help)"),
        (
            "llama_ddp.evaluate",
            "required: --model, --tasks (see python -m llama_ddp.evaluate --help)",
        ),
        ("llama_ddp.plot", "required: metrics (see python -m llama_ddp.plot --help)"),
        ("llama_ddp.export", "required: MODEL, --gguf (see python -m llama_ddp.export --help)"),
        ("llama_ddp.plan", "required: --time-budget (see python -m llama_ddp.plan --help)"),
    ],
)
def test_each_command_module_maps_a_mistake_to_one_line_and_exit_2(command, line, tmp_path):
    """The module commands users type keep working and share the runner (plot had no --debug)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    cmd = [sys.executable, "-m", command, "--no-such-flag"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [f"error: the following arguments are {line}"]
    missing = tmp_path / "none.jsonl"
    if command == "llama_ddp.plot":
        for debug in ([], ["--debug"]):
            done = subprocess.run(
                [sys.executable, "-m", command, str(missing), *debug],
                capture_output=True, text=True, cwd=ROOT, env=env, timeout=120,
            )  # fmt: skip
            assert done.returncode == (1 if debug else 2)
            assert ("Traceback" in done.stderr) == bool(debug)


def test_a_command_process_ends_with_its_code_and_its_objects_frozen():
    """Every command's __main__ ends through exit_command: its exit code, its exit handlers
    run, and the objects it made frozen, so that Python's last collections skip them."""
    code = (
        "import atexit, gc, sys; from llama_ddp.errors import exit_command; "
        "atexit.register(lambda: print('frozen', gc.get_freeze_count() > 0)); exit_command(3)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 3 and done.stdout == "frozen True\n", done.stderr
    commands = ["train.py", "llama_ddp/train/__main__.py", "llama_ddp/train/cli.py"]
    commands += [
        f"llama_ddp/{name}.py" for name in ("generate", "evaluate", "export", "plot", "plan")
    ]
    assert [c for c in commands if "exit_command(main())" not in (ROOT / c).read_text()] == []


def test_a_value_that_starts_with_a_minus_is_the_flags_value():
    """``--profile-steps -1:2`` and ``--lr -1e-3`` reach our checks (argparse alone reads them
    as unknown flags: "expected one argument"); a flag after a flag is still a flag."""
    parser = ArgumentParser(prog="cmd")
    parser.add_argument("--steps")
    parser.add_argument("--lr", type=float)
    parser.add_argument("--go", action="store_true")
    args = parser.parse_args(["--steps", "-1:2", "--lr", "-1e-3", "--go"])
    assert (args.steps, args.lr, args.go) == ("-1:2", -1e-3, True)
    with pytest.raises(UserError, match=r"--steps: expected one argument \(see cmd --help\)"):
        parser.parse_args(["--steps", "--go"])
