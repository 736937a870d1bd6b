"""checkpoint/state.py: every part saved is read back, in any layout; what is not state stays the
run's."""

import json

import pytest
import torch

from llama_ddp.checkpoint import reader as checkpoint_reader
from llama_ddp.checkpoint import state as ckpt
from llama_ddp.checkpoint.manager import find_resume, step_dir
from llama_ddp.errors import Interrupted, UserError
from llama_ddp.model.config import preset
from llama_ddp.model.llama import LlamaForPretraining
from llama_ddp.precision import Precision
from llama_ddp.train.optim import build_optimizer
from tests.helpers.runs import ROOT, rewrite_manifest, run_torchrun, tiny_args


def trained_model(foreach: bool) -> tuple[LlamaForPretraining, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = LlamaForPretraining(preset("tiny", vocab_size=64))
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    optimizer.param_groups[0]["foreach"] = foreach
    model(torch.randint(0, 64, (2, 8))).sum().backward()
    optimizer.step()
    return model, optimizer


def parts(model, optimizer, scaler) -> dict[str, ckpt.Stateful]:
    return {
        "settings": ckpt.Settings({"model_shape": model.config.to_dict()}),
        "model": ckpt.ModelState(model),
        "optimizer": ckpt.OptimizerState(model, optimizer),
        "scaler": scaler,
        "rng": ckpt.RNGState(),
    }


def test_parts_round_trip_exactly_and_the_scaler_with_them(tmp_path):
    model, optimizer = trained_model(foreach=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.load_state_dict({**scaler.state_dict(), "scale": 37.0, "_growth_tracker": 5})
    path = ckpt.save_checkpoint(step_dir(tmp_path, 3), 3, parts(model, optimizer, scaler))
    assert ckpt.verify_checkpoint(path) is None
    assert json.loads((path / "state.json").read_text())["parts"]["scaler"]["scale"] == 37.0
    assert ckpt.saved_setting(path, "model_shape") == model.config.to_dict()  # before any model
    with pytest.raises(UserError, match="does not record its document mask"):
        ckpt.saved_setting(path, "document_mask")
    expected_rng = torch.get_rng_state()
    torch.rand(5)  # move the generator on: loading must bring it back

    fresh = LlamaForPretraining(preset("tiny", vocab_size=64))
    fresh_opt = build_optimizer(fresh, lr=5e-4, weight_decay=0.1)
    fresh_opt.param_groups[0]["foreach"] = False  # this run's own implementation choice
    fresh_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    assert ckpt.load_checkpoint(path, parts(fresh, fresh_opt, fresh_scaler)) == 3
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    for p, q in zip(model.parameters(), fresh.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optimizer.state[p][key], fresh_opt.state[q][key])
    assert fresh_opt.param_groups[0]["lr"] == 1e-3  # saved state: the checkpoint's
    assert fresh_opt.param_groups[0]["foreach"] is False  # implementation: this run's
    assert fresh_scaler.get_scale() == 37.0 and fresh_scaler._get_growth_tracker() == 5
    assert torch.equal(torch.get_rng_state(), expected_rng)


def test_settings_that_differ_are_named_before_any_tensor_is_read(tmp_path):
    model, _ = trained_model(foreach=True)
    settings = {"model_shape": model.config.to_dict(), "seq_length": 64, "tokenizer": "abc"}
    saved = {"settings": ckpt.Settings(settings), "model": ckpt.ModelState(model)}
    path = ckpt.save_checkpoint(step_dir(tmp_path, 1), 1, saved)
    other = LlamaForPretraining(preset("tiny", vocab_size=64, hidden_size=128))
    changed = {"model_shape": other.config.to_dict(), "seq_length": 32, "tokenizer": "xyz"}
    parts = {"settings": ckpt.Settings(changed), "model": ckpt.ModelState(other)}
    with pytest.raises(UserError) as err:
        ckpt.load_checkpoint(path, parts)
    message = str(err.value)
    assert "a different model shape (hidden_size 64 vs 128)" in message
    assert "a different seq length (64 vs 32 now)" in message
    assert "a different tokenizer" in message
    assert "another --out-dir, or delete OUT/checkpoints" in message
    (path / "state.json").write_text('{"step": ')  # damaged: one line, not a traceback
    with pytest.raises(UserError, match="checkpoint state .*state.json is not readable JSON"):
        ckpt.load_checkpoint(path, parts)


def test_a_save_cut_short_leaves_no_temporary_and_the_last_checkpoint_intact(tmp_path, monkeypatch):
    model, optimizer = trained_model(foreach=True)
    parts = {"model": ckpt.ModelState(model), "optimizer": ckpt.OptimizerState(model, optimizer)}
    first = ckpt.save_checkpoint(step_dir(tmp_path, 1), 1, parts)

    def interrupted(path):  # a second Ctrl-C while the files of step 2 are being checksummed
        raise Interrupted(2, "again")

    monkeypatch.setattr(checkpoint_reader, "sha256", interrupted)
    with pytest.raises(Interrupted):
        ckpt.save_checkpoint(step_dir(tmp_path, 2), 2, parts)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000001"]
    monkeypatch.undo()
    assert ckpt.verify_checkpoint(first) is None


def test_a_tied_model_resumes_with_one_matrix(tmp_path):
    """The embedding and lm_head are one Parameter: DCP saves it under both names, loads it back
    into the one matrix of a fresh tied model, and AdamW's state of it once."""
    torch.manual_seed(0)
    model = LlamaForPretraining(preset("tiny", vocab_size=64, tie_word_embeddings=True))
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    model(torch.randint(0, 64, (2, 8))).sum().backward()
    optimizer.step()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    path = ckpt.save_checkpoint(step_dir(tmp_path, 1), 1, parts(model, optimizer, scaler))
    fresh = LlamaForPretraining(preset("tiny", vocab_size=64, tie_word_embeddings=True))
    fresh_opt = build_optimizer(fresh, lr=1e-3, weight_decay=0.1)
    ckpt.load_checkpoint(path, parts(fresh, fresh_opt, scaler))
    assert fresh.lm_head.weight is fresh.base_model.embed_tokens.weight
    assert torch.equal(fresh.lm_head.weight, model.base_model.embed_tokens.weight)
    assert len(fresh_opt.state) == len(list(fresh.parameters()))
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(optimizer.state[p]["exp_avg"], fresh_opt.state[q]["exp_avg"])
    untied = LlamaForPretraining(preset("tiny", vocab_size=64))  # another shape: refused
    untied_opt = build_optimizer(untied, lr=1e-3, weight_decay=0.1)
    with pytest.raises(UserError, match="tie_word_embeddings True vs None"):
        ckpt.load_checkpoint(path, parts(untied, untied_opt, scaler))


def test_a_checkpoint_missing_a_file_its_metadata_names_is_not_intact(tmp_path):
    model, optimizer = trained_model(foreach=True)
    scaler = Precision(torch.float32, torch.device("cpu")).scaler
    path = ckpt.save_checkpoint(step_dir(tmp_path, 1), 1, parts(model, optimizer, scaler))
    # A shard that never reached this disk (another node wrote it), and a manifest without it.
    (path / "__0_0.distcp").unlink()
    rewrite_manifest(path)
    problem = ckpt.verify_checkpoint(path)
    assert problem is not None and problem.startswith("__0_0.distcp is missing"), problem
    assert "shared by all nodes" in problem
    assert find_resume(tmp_path, "auto") is None
    with pytest.raises(UserError, match="is not usable: __0_0.distcp is missing"):
        find_resume(tmp_path, str(path))


@pytest.mark.parametrize(
    ("saved", "resumed"), [("fp32", "fp16"), ("bf16", "fp16"), ("fp16", "fp32")]
)
def test_a_checkpoint_resumes_in_another_precision(saved, resumed, tmp_path):
    """fp16's loss scale is state only fp16 has: a run without one leaves fp16's fresh scale,
    and a run without loss scaling ignores the saved one."""
    cpu, dtypes = torch.device("cpu"), {"fp32": torch.float32, "bf16": torch.bfloat16}
    dtypes["fp16"] = torch.float16  # GradScaler("cpu") stands in for CUDA's: the same class
    model, optimizer = trained_model(foreach=True)
    scaler = Precision(dtypes[saved], cpu).scaler
    if scaler.is_enabled():
        scaler.load_state_dict({**scaler.state_dict(), "scale": 37.0, "_growth_tracker": 5})
    path = ckpt.save_checkpoint(step_dir(tmp_path, 4), 4, parts(model, optimizer, scaler))
    fresh = LlamaForPretraining(preset("tiny", vocab_size=64))
    fresh_opt = build_optimizer(fresh, lr=1e-3, weight_decay=0.1)
    fresh_scaler = Precision(dtypes[resumed], cpu).scaler
    assert ckpt.load_checkpoint(path, parts(fresh, fresh_opt, fresh_scaler)) == 4
    assert fresh_scaler.is_enabled() == (resumed == "fp16")
    if resumed == "fp16":
        assert fresh_scaler.get_scale() == 65536.0 and fresh_scaler._get_growth_tracker() == 0
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))


def test_a_checkpoint_records_its_dtype_and_one_from_before_that_still_loads(tmp_path):
    """The run's dtype is read from a checkpoint before any model exists (`saved_part`); a
    checkpoint written before the precision part existed loads without it, while a part that
    is not optional stays required."""
    cpu = torch.device("cpu")
    model, optimizer = trained_model(foreach=True)
    precision = Precision(torch.bfloat16, cpu, "auto: the CPU multiplies bf16 natively (AMX)")
    saved = {**parts(model, optimizer, precision.scaler), "precision": precision}
    path = ckpt.save_checkpoint(step_dir(tmp_path, 2), 2, saved)
    assert ckpt.saved_part(path, "precision") == {"dtype": "bf16"}
    older = ckpt.save_checkpoint(
        step_dir(tmp_path, 1), 1, parts(model, optimizer, precision.scaler)
    )
    assert ckpt.saved_part(older, "precision") is None
    fresh = LlamaForPretraining(preset("tiny", vocab_size=64))
    fresh_opt = build_optimizer(fresh, lr=1e-3, weight_decay=0.1)
    now = Precision(torch.float32, cpu)
    loading = {**parts(fresh, fresh_opt, now.scaler), "precision": now}
    assert ckpt.load_checkpoint(older, loading) == 1
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    without_rng = {k: v for k, v in saved.items() if k != "rng"}
    lacking = ckpt.save_checkpoint(step_dir(tmp_path, 3), 3, without_rng)
    with pytest.raises(UserError, match="lacks rng"):
        ckpt.load_checkpoint(lacking, loading)


@pytest.mark.e2e
def test_fsdp_on_disks_not_shared_fails_in_one_line_and_leaves_nothing(train_env, tmp_path):
    """Rank 1 writes its shards to its own disk, as a node with a local --out-dir does: rank 0
    does not complete the checkpoint, the run stops with one line (the ranks exit 2, torchrun 1),
    no folder is left half-written on either disk, and what a killed run left on rank 1's disk
    is removed."""
    out, node = tmp_path / "out", tmp_path / "node1"
    leftover = node / "checkpoints" / ".step-00000007.tmp-shared"
    leftover.mkdir(parents=True)
    (leftover / "__1_0.distcp").write_bytes(b"shard")
    args = tiny_args(train_env, out, "--max-steps", "2", "--save-every", "1", "--mode", "fsdp")
    env = {**train_env, "env": {**train_env["env"], "NODE_OUT_DIR": str(node)}}
    script = str(ROOT / "tests" / "helpers" / "own_disk_train.py")
    result = run_torchrun(env, ["--standalone", "--nproc_per_node=2"], [script, *args])
    assert result.returncode == 1, result.stderr[-3000:]  # torchrun's: a worker failed
    assert "(exitcode: 2)" in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: cannot complete checkpoint {out}/checkpoints/step-00000001: rank 0 does not see "
        "__1_0.distcp, written by other ranks (checkpoints need an --out-dir on a filesystem "
        "shared by all nodes; nothing was saved)"
    ], result.stderr[-3000:]
    assert "llama_ddp/" not in result.stderr  # torchrun reports the exit code; ours no traceback
    assert list((out / "checkpoints").iterdir()) == []
    assert list((node / "checkpoints").iterdir()) == []


def test_a_second_ctrl_c_inside_dcp_is_the_interrupt_and_the_last_checkpoint_intact(
    tmp_path, monkeypatch
):
    """DCP wraps whatever its writer raises in a CheckpointException: a second Ctrl-C landing
    there comes out as the Interrupted it is (exit 130, one line), with no temporary left."""
    from torch.distributed.checkpoint import FileSystemWriter

    model, optimizer = trained_model(foreach=True)
    parts = {"model": ckpt.ModelState(model), "optimizer": ckpt.OptimizerState(model, optimizer)}
    first = ckpt.save_checkpoint(step_dir(tmp_path, 1), 1, parts)

    def interrupted(self, *args, **kwargs):
        raise Interrupted(2, "again: stopped at once")

    monkeypatch.setattr(FileSystemWriter, "write_data", interrupted)
    with pytest.raises(Interrupted) as err:
        ckpt.save_checkpoint(step_dir(tmp_path, 2), 2, parts)
    assert err.value.signum == 2
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000001"]
    assert ckpt.verify_checkpoint(first) is None


@pytest.mark.parametrize(
    "where, value, message",
    [  # one of each kind of check; every field's checks and ranges: test_schema.py
        (("step",), -5, "step -5 is not in [0, 1,000,000,000,000]"),
        (("parts", "train", "step"), 7, "parts.train.step 7 is not the checkpoint's step 3"),
        (("parts", "schedule", "lr"), "fast", "parts.schedule.lr 'fast' is not a number"),
        (("parts", "rng", "python", 1, 0), 2**40, "parts.rng.python holds a value that is not"),
        (("parts", "optimizer", "param_groups", 0, "lr"), float("nan"), "[0].lr is nan, not a"),
        (("parts", "precision"), {"dtype": "fp8"}, "parts.precision.dtype 'fp8' is not one of"),
    ],
)
def test_every_value_read_from_state_json_is_checked(tmp_path, where, value, message):
    """state.json edited and its manifest re-hashed to match (the checksums agree): a value of
    the wrong type or out of range is one line naming the field, on every read of the file
    (schema.check_state, which test_schema.py tests field by field)."""
    from tests.helpers.runs import rewrite_manifest

    model, optimizer = trained_model(foreach=True)
    saved = {
        **parts(model, optimizer, torch.amp.GradScaler("cpu")),
        "train": _Plain({"step": 3, "tokens": 100}),
        "schedule": _Plain({"name": "cosine", "lr": 1e-3, "warmup_steps": 1, "total_steps": 9}),
    }
    path = ckpt.save_checkpoint(step_dir(tmp_path, 3), 3, saved)
    assert ckpt.load_checkpoint(path, saved) == 3
    state = json.loads((path / "state.json").read_text())
    node = state
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = value
    (path / "state.json").write_text(json.dumps(state))
    rewrite_manifest(path)
    assert ckpt.verify_checkpoint(path) is None  # intact as far as the checksums go
    for read in (lambda: ckpt.load_checkpoint(path, saved), lambda: ckpt.saved_part(path, "rng")):
        with pytest.raises(UserError) as err:
            read()
        assert message in str(err.value) and "resume from another checkpoint" in str(err.value)
        assert "state.json" in str(err.value)


class _Plain:
    """A part of plain values (the trainer's progress, the schedule), as state.json holds them."""

    def __init__(self, values: dict) -> None:
        self.values = dict(values)

    def state_dict(self) -> dict:
        return dict(self.values)

    def load_state_dict(self, state: dict) -> None:
        self.values = dict(state)


@pytest.mark.parametrize("part", ["model", "optimizer"])
def test_a_checkpoint_whose_state_is_not_finite_is_refused_on_load(part, tmp_path):
    """A NaN in the optimizer's moments loaded, and the run's first step then called that same
    checkpoint "the last good checkpoint": the weights and the optimizer's state are checked as
    they are read, one line naming the tensor."""
    model, optimizer = trained_model(foreach=True)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    with torch.no_grad():
        if part == "model":
            model.lm_head.weight[1, 2] = float("nan")
        else:
            optimizer.state[model.lm_head.weight]["exp_avg_sq"][1, 2:4] = float("inf")
    path = ckpt.save_checkpoint(step_dir(tmp_path, 3), 3, parts(model, optimizer, scaler))
    fresh = LlamaForPretraining(preset("tiny", vocab_size=64))
    fresh_opt = build_optimizer(fresh, lr=1e-3, weight_decay=0.1)
    what, key, count = {
        "model": ("weights are", "lm_head.weight", 1),
        "optimizer": ("optimizer state is", "state.lm_head.weight.exp_avg_sq", 2),
    }[part]
    with pytest.raises(UserError) as err:
        ckpt.load_checkpoint(path, parts(fresh, fresh_opt, scaler))
    assert str(err.value) == (
        f"checkpoint {path}: its {what} not finite ({key} holds {count} NaN or infinite "
        f"values of {64 * 64:,}) (use an earlier checkpoint, e.g. with --resume PATH: this one "
        "computes no number)"
    )
