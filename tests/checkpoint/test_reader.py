"""checkpoint/reader.py: no file of a checkpoint runs code, whoever crafted it and however.

Each attack is crafted as an attacker would: a real checkpoint, its files changed, its manifest
rewritten to match. The payloads create a marker file; it must never appear.
"""

import io
import json
import pickle
import shutil
import struct

import pytest
import torch
from torch.distributed.checkpoint import metadata as M
from torch.distributed.checkpoint.filesystem import _StorageInfo

from llama_ddp.checkpoint import reader as reader
from llama_ddp.checkpoint import state as ckpt
from llama_ddp.checkpoint.manager import find_resume, step_dir
from llama_ddp.errors import UserError
from llama_ddp.model.config import preset
from llama_ddp.model.llama import LlamaForPretraining
from llama_ddp.train.optim import build_optimizer
from tests.helpers.runs import rewrite_manifest, run_train, tiny_args, train_here

DCP_METADATA = "torch.distributed.checkpoint.metadata"  # it imports os: os.mkdir is reachable


def parts(model: LlamaForPretraining) -> dict[str, ckpt.Stateful]:
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    return {"model": ckpt.ModelState(model), "optimizer": ckpt.OptimizerState(model, optimizer)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("saved")
    return ckpt.save_checkpoint(
        step_dir(out, 1), 1, parts(LlamaForPretraining(preset("tiny", vocab_size=64)))
    )


# ----------------------------------------------------------------------------- pickle opcodes


def _str(s: str) -> bytes:
    data = s.encode()
    return b"X" + struct.pack("<I", len(data)) + data  # BINUNICODE


def stack_global(module: str, name: str) -> bytes:
    return _str(module) + _str(name) + b"\x93"  # STACK_GLOBAL: protocol 4 resolves dotted names


def call(func: bytes, *args: str) -> bytes:
    return func + b"(" + b"".join(map(_str, args)) + b"tR"  # MARK args TUPLE REDUCE


def pickle4(body: bytes) -> bytes:
    return b"\x80\x04" + body + b"."  # PROTO 4 ... STOP


class CreatesAFile:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


# ----------------------------------------------------------------------------- the attacks


def dotted_name(path, marker) -> bytes:
    """The allowlisted module's ``os`` attribute: ``os.mkdir`` through a dotted name."""
    return pickle4(call(stack_global(DCP_METADATA, "os.mkdir"), str(marker)))


def global_opcode(path, marker) -> bytes:
    return b"cposix\nmkdir\n(" + f"V{marker}\n".encode() + b"tR."  # protocol 0 GLOBAL


def inst_opcode(path, marker) -> bytes:
    return b"(" + f"V{marker}\n".encode() + f"i{DCP_METADATA}\nos.mkdir\n.".encode()


def obj_opcode(path, marker) -> bytes:
    return pickle4(b"(" + stack_global("builtins", "exec") + _str(f"open('{marker}', 'w')") + b"o")


def persistent_id(path, marker) -> bytes:
    return pickle4(_str(str(marker)) + b"Q")  # BINPERSID


def reduce_on_an_allowed_class(path, marker) -> bytes:
    """An allowed class called with anything: ``Metadata(state_dict_metadata=<str>)``."""
    return pickle4(call(stack_global(DCP_METADATA, "Metadata"), str(marker)))


def real(path) -> M.Metadata:
    return pickle.loads((path / ".metadata").read_bytes())  # our own file: trusted here


def build_with_extra_fields(path, marker) -> bytes:
    """BUILD puts any attribute on an allowed object (``__setstate__``, ``__reduce__``)."""
    md = real(path)
    entry = next(iter(md.state_dict_metadata.values()))
    entry.__dict__["__setstate__"] = torch.Size
    return pickle.dumps(md)


def wrong_field_type(path, marker) -> bytes:
    md = real(path)
    next(iter(md.state_dict_metadata.values())).properties.__dict__["dtype"] = str(marker)
    return pickle.dumps(md)


def a_file_outside_the_folder(path, marker) -> bytes:
    md = real(path)
    next(iter(md.storage_data.values())).relative_path = "../../outside.distcp"
    return pickle.dumps(md)


def not_a_pickle(path, marker) -> bytes:
    return b'{"state_dict_metadata": {}}'


def truncated(path, marker) -> bytes:
    data = (path / ".metadata").read_bytes()
    return data[: len(data) // 2]


def not_metadata(path, marker) -> bytes:
    return pickle.dumps({"state_dict_metadata": {}})


ATTACKS = {
    dotted_name: "names torch.distributed.checkpoint.metadata.os.mkdir",
    global_opcode: "names posix.mkdir",
    inst_opcode: "os.mkdir",
    obj_opcode: "names builtins.exec",
    persistent_id: "persistent object",
    reduce_on_an_allowed_class: "its entry table is a str",
    build_with_extra_fields: "has fields ['__setstate__']",
    wrong_field_type: "dtype is a str",
    a_file_outside_the_folder: "'../../outside.distcp', not a .distcp file of the folder",
    not_a_pickle: "UnpicklingError",
    truncated: "pickle data was truncated",
    not_metadata: "it is a dict, not a Metadata",
}


def crafted_copy(saved, tmp_path, craft) -> tuple:
    path = tmp_path / "checkpoints" / "step-00000002"
    shutil.copytree(saved, path)
    marker = tmp_path / "pwned"
    payload = craft(saved, marker)
    (path / ".metadata").write_bytes(payload)
    (path / "__0.metadata").write_bytes(payload)  # DCP's per-rank fallback must not read it
    rewrite_manifest(path)
    return path, marker


@pytest.mark.parametrize("craft", ATTACKS, ids=lambda f: f.__name__)
def test_a_crafted_metadata_is_refused_on_every_path_without_running(
    craft, saved, tmp_path, capsys
):
    path, marker = crafted_copy(saved, tmp_path, craft)
    problem = ckpt.verify_checkpoint(path)
    assert problem is not None and ATTACKS[craft] in problem, problem
    assert problem.endswith("refused without running it")
    assert find_resume(tmp_path, "auto") is None  # skipped, with one line saying why
    assert (
        capsys.readouterr().err.strip()
        == f"warning: skipping unusable checkpoint {path}: {problem}"
    )
    with pytest.raises(UserError, match="is not usable: .metadata is not plain checkpoint"):
        find_resume(tmp_path, str(path))
    model = LlamaForPretraining(preset("tiny", vocab_size=64))
    with pytest.raises(UserError, match="refused without running it"):
        ckpt.load_checkpoint(path, parts(model))  # every rank reads it so, verified or not
    with pytest.raises(reader.MetadataRefused):
        reader.CheckpointReader(path).read_metadata()
    # DCP's own load fails too (its words are torch's: 2.13 'global metadata read failed', 2.9
    # an assertion that the metadata is missing), and never falls back to __0.metadata
    with pytest.raises(BaseException) as err:
        ckpt._dcp().load(model.state_dict(), storage_reader=reader.CheckpointReader(path))
    assert "rank local metadata" not in str(err.value)
    assert not marker.exists()


def test_the_payloads_are_live_where_nothing_guards(saved, tmp_path):
    """A control: plain pickle runs the dotted name (DCP's own reader does exactly this)."""
    marker = tmp_path / "control"
    pickle.loads(dotted_name(saved, marker))
    assert marker.exists()


def bytes_entry(saved, path, marker):
    """A copy of ``saved`` at ``path`` whose .metadata declares a model buffer as a bytes entry,
    stored in a new .distcp as a pickled object with a __reduce__."""
    shutil.copytree(saved, path)
    buffer = io.BytesIO()
    torch.save(CreatesAFile(marker), buffer)
    (path / "__9_0.distcp").write_bytes(buffer.getvalue())
    md = real(saved)
    fqn = "model.base_model.rotary_emb.cos"
    md.state_dict_metadata[fqn] = M.BytesStorageMetadata()
    info = _StorageInfo("__9_0.distcp", 0, len(buffer.getvalue()))
    md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != fqn}
    md.storage_data[M.MetadataIndex(fqn)] = info
    (path / ".metadata").write_bytes(pickle.dumps(md))
    rewrite_manifest(path)
    return path


def test_a_bytes_entry_is_refused_before_anything_is_read(saved, tmp_path):
    marker = tmp_path / "pwned"
    path = bytes_entry(saved, tmp_path / "checkpoints" / "step-00000003", marker)
    problem = ckpt.verify_checkpoint(path)
    assert "declares 'model.base_model.rotary_emb.cos' as a pickled object" in problem
    with pytest.raises(UserError, match="as a pickled object"):
        ckpt.load_checkpoint(path, parts(LlamaForPretraining(preset("tiny", vocab_size=64))))
    assert not marker.exists()
    # The control: DCP's own reader runs it (torch.load(weights_only=False) of the bytes).
    model = LlamaForPretraining(preset("tiny", vocab_size=64))
    state = {"model": ckpt.ModelState(model).state_dict()}
    ckpt._dcp().load(state, storage_reader=ckpt._dcp().FileSystemReader(path))
    assert marker.exists()


def test_a_manifest_must_list_every_shard_and_name_files_of_the_folder_only(saved, tmp_path):
    path = tmp_path / "step-00000001"
    shutil.copytree(saved, path)
    rewrite_manifest(path, drop=("__0_0.distcp",))  # there, but its checksum is not
    assert ckpt.verify_checkpoint(path) == "manifest lacks __0_0.distcp"
    rewrite_manifest(path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["../step-00000001/state.json"] = manifest["files"]["state.json"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    problem = ckpt.verify_checkpoint(path)
    assert problem == "manifest names '../step-00000001/state.json', not a file of the checkpoint"
    for files in ([], {"state.json": 5}, {"state.json": {"size": 5}}):
        (path / "manifest.json").write_text(json.dumps({**manifest, "files": files}))
        assert ckpt.verify_checkpoint(path) == "unreadable manifest.json"


def test_what_dcp_writes_in_every_layout_reads_back(saved):
    """The table admits what DCP 2.13 pickles (single, DDP and FSDP checkpoints name the same
    globals: tests/train/test_resume.py resumes all of them through this reader)."""
    md = reader.read_metadata(saved)
    assert md == real(saved)
    assert reader.storage_files(md) == {"__0_0.distcp"}
    assert ckpt.verify_checkpoint(saved) is None


@pytest.mark.e2e
def test_torchrun_resume_skips_crafted_checkpoints_and_runs_nothing(train_env, tmp_path):
    """Two processes resume with --resume auto over the two payloads of the issue: both are
    skipped with a line saying why, the intact checkpoint before them is resumed."""
    first = train_here(train_env, tiny_args(train_env, tmp_path, "--max-steps", "2"))
    assert first.returncode == 0, first.stderr[-3000:]
    root, marker = tmp_path / "checkpoints", tmp_path / "pwned"
    good = root / "step-00000002"
    shutil.copytree(good, root / "step-00000003")
    (root / "step-00000003" / ".metadata").write_bytes(dotted_name(good, marker))
    rewrite_manifest(root / "step-00000003")
    bytes_entry(good, root / "step-00000004", marker)
    args = tiny_args(train_env, tmp_path, "--max-steps", "3", "--mode", "ddp")
    result = run_train(train_env, args, ["--standalone", "--nproc_per_node=2"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming from {good} (step 2)" in result.stdout
    skipped = [line for line in result.stderr.splitlines() if "skipping unusable" in line]
    assert len(skipped) == 2, result.stderr[-3000:]
    assert "step-00000004: .metadata" in skipped[0] and "as a pickled object" in skipped[0]
    assert "step-00000003: .metadata" in skipped[1] and "metadata.os.mkdir" in skipped[1]
    assert not marker.exists()
