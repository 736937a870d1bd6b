"""run.py: what resuming under a changed schedule means (continue_schedule), what the run
folder holds from the start, and its exports as one set."""

import errno
import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from llama_ddp.data.tokenizer_files import TOKENIZER_CONFIG, TOKENIZER_FILE
from llama_ddp.errors import UserError
from llama_ddp.interop import hf
from llama_ddp.interop.load import load_for_evaluation
from llama_ddp.train import run as run_module
from llama_ddp.train.cli import parse_train_args
from llama_ddp.train.config import TrainConfig
from llama_ddp.train.optim import Schedule, ScheduleState, lr_at
from llama_ddp.train.run import continue_schedule, run
from tests.helpers.runs import full_run_args, tiny_args, train_here


def wsd(total: int, warmup: int = 1) -> Schedule:
    return Schedule("wsd", 1e-3, 1e-4, warmup_steps=warmup, total_steps=total, decay_fraction=0.25)


def resumed(saved: Schedule, now: Schedule) -> ScheduleState:
    """The schedule state of a run under ``now`` that loaded a checkpoint trained under
    ``saved``."""
    state = ScheduleState(now)
    state.load_state_dict(ScheduleState(saved).state_dict())
    return state


def kept(*steps: int) -> dict[int, Path]:
    return {s: Path(f"ckpt-{s}") for s in steps}


def test_resuming_an_unchanged_schedule_says_nothing():
    assert continue_schedule(resumed(wsd(12), wsd(12)), 12, kept(12), True) is None


def test_the_checkpoints_warmup_is_kept_unless_given():
    state = resumed(wsd(12, warmup=1), wsd(24, warmup=2))  # a default warmup of a longer run
    continue_schedule(state, 9, kept(9), adopt_warmup=True)
    assert state.current == wsd(24, warmup=1)
    state = resumed(wsd(12, warmup=1), wsd(24, warmup=2))  # --warmup-steps 2 given
    continue_schedule(state, 9, kept(9), adopt_warmup=False)
    assert state.current == wsd(24, warmup=2)


def test_extending_wsd_before_its_decay_continues_the_stable_phase():
    assert wsd(12).decay_start() == 9
    state = resumed(wsd(12), wsd(24))
    note = continue_schedule(state, 9, kept(6, 9), True)
    assert "total_steps 12 -> 24" in note
    assert "step 9 continues the stable phase" in note
    assert "the decay now starts at step 18 (was 9)" in note
    assert state.current(9) == 1e-3


def test_extending_wsd_inside_its_decay_names_the_last_checkpoint_before_it():
    with pytest.raises(UserError) as err:
        continue_schedule(resumed(wsd(12), wsd(24)), 12, kept(6, 9, 12), True)
    message = str(err.value)
    assert "step 12 is inside the WSD decay that began at step 9" in message
    assert "resume from ckpt-9, the last checkpoint before the decay" in message
    with pytest.raises(UserError, match="no checkpoint from before the decay is kept"):
        continue_schedule(resumed(wsd(12), wsd(24)), 12, kept(12), True)


def test_other_schedule_changes_are_a_note_with_the_new_lr():
    cosine = Schedule("cosine", 1e-3, 1e-4, warmup_steps=1, total_steps=12)
    note = continue_schedule(resumed(cosine, replace(cosine, total_steps=24)), 12, {}, True)
    expected = lr_at(12, lr=1e-3, min_lr=1e-4, warmup_steps=1, total_steps=24)
    assert note == (
        f"schedule changed (total_steps 12 -> 24): step 12 runs at lr {expected:.3g} "
        "(the checkpoint's schedule: 0.0001)"
    )


class Stop(Exception):
    """What the test's fault hook raises: a run that stops after a step, as a crash would."""


@pytest.mark.e2e
def test_a_run_stopped_early_has_its_tokenizer_in_its_folder(train_env, tmp_path, monkeypatch):
    """The tokenizer files go into OUT when the run starts: a run that never reached its end
    (here: stopped after its step-2 checkpoint) is evaluated from OUT without --tokenizer."""

    def stop_after_save(point: str, step: int) -> None:
        if point == "after-save":
            raise Stop

    monkeypatch.setenv("LLAMA_DDP_CACHE", train_env["env"]["LLAMA_DDP_CACHE"])
    cfg = parse_train_args(tiny_args(train_env, tmp_path, "--max-steps", "4", "--save-every", "2"))
    with pytest.raises(Stop):
        run(cfg, fault=stop_after_save)
    assert not (tmp_path / "llama_model.pth").exists()  # it never reached its export
    assert (tmp_path / TOKENIZER_FILE).read_bytes() == train_env["tokenizer"].read_bytes()
    assert (tmp_path / TOKENIZER_CONFIG).is_file()
    model, tokenizer, _ = load_for_evaluation(str(tmp_path), None, torch.device("cpu"))
    assert tokenizer.get_vocab_size() == model.config.vocab_size == 320


def test_a_resumed_run_takes_its_checkpoints_optimizer_read_once(monkeypatch, tmp_path):
    """Without --optimizer a resumed run trains with its checkpoint's (one from before the flag:
    AdamW); the checkpoint is read only then, so settling twice (run, then build_trainer) reads
    it once."""
    reads = []
    saved = {"seq_length": 48, "optimizer": "muon"}

    def saved_part(path, part):
        reads.append((path, part))
        return saved

    monkeypatch.setattr(run_module.ckpt, "saved_part", saved_part)
    checkpoint = tmp_path / "checkpoints" / "step-00000008"
    settled = run_module.settle(TrainConfig(), checkpoint)
    assert (settled.optim.optimizer, settled.optim.lr) == ("muon", 4e-3)
    assert reads == [(checkpoint, "settings")]
    assert run_module.settle(settled, checkpoint) == settled and len(reads) == 1
    told = run_module.settle(TrainConfig.from_flags(optimizer="adamw"), checkpoint)
    assert (told.optim.optimizer, told.optim.lr, len(reads)) == ("adamw", 1e-3, 1)
    del saved["optimizer"]  # a checkpoint from before --optimizer
    assert run_module.settle(TrainConfig(), checkpoint).optim.optimizer == "adamw"
    assert run_module.settle(TrainConfig(), None).optim.optimizer == "muon" and len(reads) == 2


def test_a_batch_that_cannot_fit_is_one_line_before_any_data_is_read(train_env, tmp_path):
    """--batch-size 100000000 (one micro-batch: no --micro-batch-size) is refused at once, not
    after cycling the corpus thousands of times to sample its first batch."""
    from tests.helpers.runs import train_here

    result = train_here(train_env, tiny_args(train_env, tmp_path, "--batch-size", "100000000"))
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.startswith("error: a micro-batch of 100,000,000 sequences of 48 tokens")
    assert result.stderr.count("\n") == 1 and not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize(
    "flags",
    [
        ["--micro-batch-size", "3"],  # does not divide the batch of 8
        ["--model-size", "auto", "--time-budget", "1m", "--seq-length", "3000"],  # > positions
    ],
)
def test_a_refused_run_leaves_no_new_out_dir_behind(train_env, tmp_path, flags):
    """Issue 60, item 12: a refusal after the run folder was made and locked left a new
    --out-dir holding only .lock. Now the folder (and those above it the run made) is gone
    again; an existing folder stays."""
    from tests.helpers.runs import train_here

    out = tmp_path / "new" / "out"
    args = ["--dataset", str(train_env["corpus"]), "--tokenizer", str(train_env["tokenizer"])]
    args += ["--batch-size", "8", "--out-dir", str(out)]
    args += [] if "--model-size" in flags else ["--preset", "tiny", "--max-steps", "1"]
    result = train_here(train_env, [*args, *flags])
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr[-2000:]
    assert result.stderr.startswith("error: ")
    assert not (tmp_path / "new").exists()
    out.mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    assert train_here(train_env, [*args, *flags]).returncode == 2
    assert (out / "notes.txt").read_text() == "mine"


def test_a_member_that_cannot_train_in_memory_is_one_line_before_any_data(
    train_env, tmp_path, monkeypatch
):
    """Issue 60, item 12: --model-size 64 where its weights fit the memory but its training
    state does not ended in the allocator's traceback; now one line, exit 2, before any data
    is read (let alone a weight made)."""
    from llama_ddp.model import config as config_module
    from tests.helpers.runs import train_here

    def never(*args, **kwargs):
        raise AssertionError("the data was read")

    monkeypatch.setattr(config_module, "memory_bytes", lambda device="cpu": 50 * 2**30)
    monkeypatch.setattr(run_module, "run_data", never)
    args = ["--model-size", "64", "--max-steps", "1", "--seq-length", "64", "--batch-size", "2"]
    args += ["--dataset", str(train_env["corpus"]), "--tokenizer", str(train_env["tokenizer"])]
    result = train_here(train_env, [*args, "--out-dir", str(tmp_path / "out")])
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr[-2000:]
    assert result.stderr.startswith("error: training a model of this shape (64 layers")
    assert not (tmp_path / "out").exists()


def test_an_attention_backend_the_device_lacks_is_one_line_before_any_data(
    train_env, tmp_path, capsys
):
    """--attention cudnn on the CPU: one line naming why and what runs here, exit 2, before the
    corpus is tokenized; --attention grids (the CPU's) trains and the banner says it was asked."""
    from llama_ddp.train.cli import main

    cache = tmp_path / "cache"
    args = [*tiny_args(train_env, tmp_path / "out", "--max-steps", "1"), "--cache-dir", str(cache)]
    assert main([*args, "--attention", "cudnn"]) == 2
    out, err = capsys.readouterr()
    assert err == "error: --attention cudnn: needs CUDA (available here: grids)\n"
    assert not list(cache.glob("tokens-*"))
    assert main([*args, "--attention", "grids", "--no-export-hf"]) == 0
    assert "attention: grids (--attention grids)" in capsys.readouterr().out


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.e2e
def test_a_full_disk_during_the_final_export_keeps_the_previous_set_whole(
    full_run, train_env, tmp_path, monkeypatch
):
    """A resumed run's exports are one set: the disk full while hf/ is written (after the new
    llama_model.pth was) left llama_model.pth at the new step beside hf/ at the old one. Now one
    line, exit 2, and every export of the previous run as it was, no temporary left."""
    out = tmp_path / "run"
    shutil.copytree(full_run, out, ignore=shutil.ignore_patterns("stdout.txt"))
    exports = ("llama_model.pth", "llama_model.json", "tokenizer.json", "tokenizer_config.json")
    before = {name: (out / name).read_bytes() for name in exports} | {"hf": _files(out / "hf")}

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(hf, "save_file", full)
    result = train_here(train_env, [*full_run_args(train_env, out), "--max-steps", "14"])
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith(f"error: cannot write Hugging Face export {out / 'hf'}: No space")
    after = {name: (out / name).read_bytes() for name in exports} | {"hf": _files(out / "hf")}
    assert after == before
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".") or "tmp" in p.name) == [
        ".lock"
    ]
