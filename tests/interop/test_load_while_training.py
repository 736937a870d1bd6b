"""interop/load.py and checkpoint/manager.py: a run folder read while its run trains, saves and
prunes: the reader takes the newest checkpoint complete when it looks, and one pruned under it
is skipped for the next newest complete one, never an error."""

import subprocess
import time

import pytest
import torch

from llama_ddp.checkpoint import manager
from llama_ddp.checkpoint import state as ckpt
from llama_ddp.checkpoint.manager import list_checkpoints, prune, step_dir
from llama_ddp.data.tokenizer import tokenizer_fingerprint
from llama_ddp.data.tokenizer_files import save_tokenizer
from llama_ddp.interop import load
from llama_ddp.interop.load import load_for_evaluation, load_model, read
from tests.helpers.runs import tiny_args, train_command

CPU = torch.device("cpu")


def _run_folder(out, tok, tmp_path, steps):
    """A run folder whose checkpoints are ``steps`` (each step's weights: the saved model's
    plus the step), its tokenizer beside them; and a function saving one more."""
    saved = load_model(out)
    settings = {"model_shape": saved.config.to_dict(), "tokenizer": tokenizer_fingerprint(tok)}

    def save(step: int) -> None:
        model = load_model(out)
        with torch.no_grad():
            model.lm_head.weight.add_(step)
        parts = {"settings": ckpt.Settings(settings), "model": ckpt.ModelState(model)}
        ckpt.save_checkpoint(step_dir(tmp_path, step), step, parts)

    for step in steps:
        save(step)
    save_tokenizer(tok, tmp_path / "tokenizer.json")
    return saved, save


def test_a_checkpoint_pruned_while_it_is_read_gives_the_next_newest(
    out, tok, tmp_path, monkeypatch, capsys
):
    """The run prunes step 3 between the reader's check of it and its read of the weights (the
    evaluate and generate failures of issue 60, item 7: `state.json not found`, `.metadata is not
    plain checkpoint metadata`): the reader reads step 2 instead, for every command's loader."""
    saved, save = _run_folder(out, tok, tmp_path, (2, 3))
    real = ckpt.load_checkpoint
    pruned = []

    def racing(path, parts, **kw):
        if not pruned:
            pruned.append(path)
            prune(path)  # the training run, between the listing and the read
        return real(path, parts, **kw)

    monkeypatch.setattr(ckpt, "load_checkpoint", racing)
    model, tokenizer, _ = load_for_evaluation(str(tmp_path), None, CPU)
    assert pruned == [step_dir(tmp_path, 3)]
    assert torch.equal(model.lm_head.weight, saved.lm_head.weight + 2)
    err = capsys.readouterr().err
    assert "reading its checkpoint step-00000002" in err and "warning" not in err, err
    pruned.clear()
    save(4)
    source = read(tmp_path)  # generate's, export's and --init-from's loader
    assert pruned == [step_dir(tmp_path, 4)] and source.checkpoint == step_dir(tmp_path, 2)
    assert torch.equal(source.state["lm_head.weight"], saved.lm_head.weight + 2)


def test_checkpoints_saved_and_pruned_while_the_reader_looks_give_the_newest(
    out, tok, tmp_path, monkeypatch, capsys
):
    """Two saves and their prunes land while the reader checks the newest of what it listed
    (--save-every 5 in issue 60: "holds no model" while two complete checkpoints exist): it
    looks again and reads the newest complete one, step 5, with no warning."""
    saved, save = _run_folder(out, tok, tmp_path, (2, 3))
    real = ckpt.verify_checkpoint
    raced = []

    def racing(path):
        if not raced:
            raced.append(path)
            for step in (4, 5):  # a run saving with --keep-last 2
                save(step)
                prune(step_dir(tmp_path, step - 2))
        return real(path)

    monkeypatch.setattr(ckpt, "verify_checkpoint", racing)
    model, _, _ = load_for_evaluation(str(tmp_path), None, CPU)
    assert raced == [step_dir(tmp_path, 3)]
    assert torch.equal(model.lm_head.weight, saved.lm_head.weight + 5)
    err = capsys.readouterr().err
    assert "reading its checkpoint step-00000005" in err and "warning" not in err, err


def test_a_damaged_checkpoint_is_still_skipped_with_a_warning_and_its_own_failure_raised(
    out, tok, tmp_path, monkeypatch, capsys
):
    """What stays as it was: a checkpoint damaged on disk is skipped with a warning; a read
    that fails while its checkpoint is still complete is that checkpoint's failure, not a
    prune (the error is raised, the reader does not fall back)."""
    saved, _ = _run_folder(out, tok, tmp_path, (2, 3))
    (step_dir(tmp_path, 3) / "state.json").write_text("{}\n")
    assert load.read_newest_checkpoint(tmp_path).checkpoint == step_dir(tmp_path, 2)
    assert "warning: skipping unusable checkpoint" in capsys.readouterr().err

    def failing(path, parts, **kw):
        raise RuntimeError("a read that fails on its own")

    monkeypatch.setattr(ckpt, "load_checkpoint", failing)
    with pytest.raises(RuntimeError, match="on its own"):
        load.read_newest_checkpoint(tmp_path)


def test_prune_takes_a_checkpoint_out_of_the_listing_at_once(tmp_path, monkeypatch):
    """A pruned checkpoint leaves the listing before any of its files is deleted: a reader
    never finds it half deleted under its own name."""
    folder = step_dir(tmp_path, 7)
    folder.mkdir(parents=True)
    for name in ("manifest.json", "state.json", ".metadata"):
        (folder / name).write_text("x")
    seen = []
    real = manager.shutil.rmtree

    def rmtree(path, **kw):
        seen.append((path.name, [p.name for p in list_checkpoints(tmp_path)]))
        return real(path, **kw)

    monkeypatch.setattr(manager.shutil, "rmtree", rmtree)
    prune(folder)
    assert seen and all(name not in listing for name, listing in seen), seen
    assert list((tmp_path / "checkpoints").iterdir()) == []


@pytest.mark.e2e
def test_a_run_folder_is_read_while_its_run_saves_and_prunes_every_step(train_env, tmp_path):
    """A real run saving every step and keeping two checkpoints, read in a loop while it
    trains: every read gives a checkpoint's model, never an error (bounded: 5-20 s of reads;
    the run is stopped by its PID and waited for; eager: --compile auto would compile for its
    100000 steps)."""
    out = tmp_path / "out"
    args = tiny_args(train_env, out, "--max-steps", "100000", "--save-every", "1")
    args += ["--keep-last", "2", "--log-every", "1000", "--eval-every", "0", "--no-compile"]
    run = subprocess.Popen(
        train_command(args), env=train_env["env"], stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while not list_checkpoints(out):
            assert run.poll() is None, run.stderr.read()
            assert time.monotonic() < deadline, "the run saved no checkpoint in 90 s"
            time.sleep(0.05)
        read_from, start = [], time.monotonic()
        # 5 s of reads, longer (up to 20 s) on a loaded machine until they read 3 checkpoints
        while (elapsed := time.monotonic() - start) < 5 or len(set(read_from)) < 3 < 20 - elapsed:
            source = read(out)
            assert source.checkpoint is not None and source.config.num_hidden_layers == 2
            read_from.append(source.checkpoint.name)
            assert run.poll() is None, run.stderr.read()  # it trains throughout
        assert len(set(read_from)) >= 2, read_from  # the reads raced the run's saves and prunes
    finally:
        run.terminate()
        try:
            run.wait(timeout=30)
        except subprocess.TimeoutExpired:
            run.kill()
            run.wait()
