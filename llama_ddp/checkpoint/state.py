"""Training checkpoints: the run's state as named Stateful parts, saved and resumed atomically.

A checkpoint is a mapping of parts (settings, model, optimizer, train state, RNG, ...), each with
``state_dict()`` / ``load_state_dict()``. Saving walks the parts: their tensors go to
``torch.distributed.checkpoint`` (DCP) files, everything else (numbers, strings, lists) to
``state.json``. Loading walks them in order and reads each part's tensors into the layout this run
has (DCP reshards), so a checkpoint resumes in any mode and at any world size; a part without
tensors (the settings) is compared before any tensor is read.

On disk: ``OUT/checkpoints/step-NNNNNNNN/`` with ``.metadata`` and ``*.distcp`` (DCP),
``state.json`` and ``manifest.json`` (written last: the size and SHA-256 of every file). The
folder is written under a temporary name and renamed when complete (under FSDP by rank 0, once it
sees every rank's shards), so a torn, corrupted or incomplete checkpoint is detected and never
resumed from. DCP's ``.metadata`` is a pickle: every rank reads it as data only
(reader.py), so a crafted checkpoint never runs code.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from llama_ddp.checkpoint.schema import check_finite, check_state
from llama_ddp.distributed import runtime as D
from llama_ddp.errors import Interrupted, UserError, WriteFailed
from llama_ddp.files import safe_io

MANIFEST = "manifest.json"
STATE = "state.json"
FORMAT = 2  # 1: model.pt/optimizer.pt/rng.pt (before the Stateful parts); 2: DCP + state.json


def _dcp() -> Any:
    """torch.distributed.checkpoint, imported on first use: it costs ~0.6 s, which a run pays at
    its first save or resume rather than before its first step."""
    import torch.distributed.checkpoint
    import torch.distributed.checkpoint.state_dict

    return torch.distributed.checkpoint


def _reader() -> Any:
    """reader.py, imported on first use (it imports DCP)."""
    from llama_ddp.checkpoint import reader as checkpoint_reader

    return checkpoint_reader


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# ----------------------------------------------------------------------------- the parts


class ModelState:
    """The weights, keyed by the plain model's names in every mode (DDP, compile, FSDP)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return _dcp().state_dict.get_model_state_dict(self.model)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _dcp().state_dict.set_model_state_dict(self.model, state)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole state dict on the CPU (on rank 0 only when the weights are sharded)."""
        dsd = _dcp().state_dict
        options = dsd.StateDictOptions(full_state_dict=True, cpu_offload=True)
        return dsd.get_model_state_dict(self.model, options=options)


# Implementation choices of this run, not state: a run resumed on another device keeps its own.
_OPTIMIZER_IMPL = ("foreach", "fused", "capturable", "differentiable")


class OptimizerState:
    """The optimizer's state (AdamW's moments and step counts; Muon's momentum), keyed by
    parameter name (so any layout can load them). An optimizer made of several (muon.Optimizers)
    is saved as its ``optimizers``."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.optimizers = getattr(optimizer, "optimizers", optimizer)

    def state_dict(self) -> dict[str, Any]:
        return _dcp().state_dict.get_optimizer_state_dict(self.model, self.optimizers)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        current = self.optimizer.param_groups
        groups = [
            {**saved, **{k: now[k] for k in _OPTIMIZER_IMPL if k in now}}
            for saved, now in zip(state["param_groups"], current)
        ]
        state = {**state, "param_groups": groups}
        _dcp().state_dict.set_optimizer_state_dict(self.model, self.optimizers, state)


class RNGState:
    """The process's random generators. Every rank seeds and draws alike, so any rank's state
    serves all ranks at any world size; CUDA states are restored where the GPU count matches."""

    def state_dict(self) -> dict[str, Any]:
        kind, keys, *rest = np.random.get_state()
        state: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": [kind, keys.tolist(), *rest],
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            state["cuda"] = {str(i): s for i, s in enumerate(torch.cuda.get_rng_state_all())}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        kind, keys, *rest = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
        torch.set_rng_state(state["torch"])
        cuda = state.get("cuda", {})
        if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([cuda[str(i)] for i in range(len(cuda))])


class Settings:
    """What a checkpoint must agree on to resume exactly (model shape, tokenizer, data order,
    optimizer): compared on load, each difference named. ``implied``: the value of a setting that
    checkpoints written before it was recorded had."""

    def __init__(self, settings: dict[str, Any], implied: dict[str, Any] | None = None) -> None:
        self.settings, self.implied = settings, implied or {}

    def state_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(self.settings))  # as it will read back from state.json

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        saved = {**self.implied, **saved}
        ours = self.state_dict()
        diffs = [_difference(k, saved.get(k), ours.get(k)) for k in ours if saved.get(k) != ours[k]]
        if diffs:
            raise UserError(
                f"it was trained with {'; '.join(diffs)} (resume with the settings "
                "it was trained with, or start a new run: another --out-dir, or delete "
                "OUT/checkpoints)"
            )


def _difference(key: str, saved: Any, ours: Any) -> str:
    if isinstance(saved, dict) and isinstance(ours, dict):
        keys = {**saved, **ours}  # a key one side lacks differs too (tie_word_embeddings)
        changed = [
            f"{k} {saved.get(k)} vs {ours.get(k)}" for k in keys if saved.get(k) != ours.get(k)
        ]
        return f"a different {key.replace('_', ' ')} ({', '.join(changed)})"
    if key == "tokenizer":
        return "a different tokenizer"
    return f"a different {key.replace('_', ' ')} ({saved} vs {ours} now)"


# ----------------------------------------------------------------------------- save and load


def _split(tree: Any) -> tuple[Any, Any]:
    """(tensor leaves, other leaves) of a nested dict, each keeping the nesting; None if empty."""
    if isinstance(tree, torch.Tensor):
        return tree, None
    if not isinstance(tree, dict):
        return None, tree
    tensors, plain = {}, {}
    for key, value in tree.items():
        t, p = _split(value)
        if t is not None:
            tensors[key] = t
        if p is not None:
            plain[key] = p
    return tensors or None, plain or None


def _merge(plain: Any, tensors: Any) -> Any:
    if isinstance(plain, dict) and isinstance(tensors, dict):
        return {k: _merge(plain.get(k), tensors.get(k)) for k in {**plain, **tensors}}
    return tensors if plain is None else plain


@contextlib.contextmanager
def _quiet_dcp() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP's notes on single-process use
        yield


def split_parts(parts: dict[str, Stateful]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the tensors, the rest) of every part's state dict, by part name."""
    tensors, plain = {}, {}
    for name, part in parts.items():
        tensors[name], plain[name] = _split(part.state_dict())
    return {k: v for k, v in tensors.items() if v is not None}, plain


def save_checkpoint(
    final: Path,
    step: int,
    parts: dict[str, Stateful],
    *,
    rt: D.Runtime | None = None,
    collective: bool = False,
    staged: tuple[dict[str, Any], dict[str, Any]] | None = None,
    planner: Any = None,
) -> Path:
    """Write the checkpoint of step ``step`` into the folder ``final``, atomically: under a
    temporary name, renamed when complete. This process writes it alone, or, ``collective``
    (sharded weights), every rank of ``rt`` writes its shards and rank 0 completes the folder. A
    refused write, or shards rank 0 cannot see (an --out-dir that is not shared by every node),
    raises WriteFailed on every rank and leaves no temporary behind. ``staged``: the parts'
    state taken earlier (`split_parts`' tensors and other values; a background save's copy),
    else taken now; ``planner``: DCP's save planner (None: its default)."""
    tensors, plain = staged or split_parts(parts)
    final = Path(final)
    root = final.parent
    collective = collective and rt is not None and rt.multiprocess
    main = rt is None or rt.is_main
    needed = sum(_local_bytes(t) for t in _leaves(tensors))
    # One name for all ranks of a collective save; the folder lock keeps it this run's own.
    tmp = root / f".{final.name}.tmp-{'shared' if collective else os.getpid()}"
    with safe_io.writing(final, "checkpoint", needed):
        try:
            if main:
                root.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
            if collective:
                D.barrier(rt)
            with _quiet_dcp():
                dcp = _dcp()
                writer = dcp.FileSystemWriter(tmp)
                dcp.save(tensors, storage_writer=writer, planner=planner, no_dist=not collective)
            missing = _complete(tmp, final, step, plain) if main else []
            if collective:  # every rank waits for the complete folder, or fails with rank 0
                missing = D.broadcast_object(missing, rt)
            if missing:
                raise WriteFailed(
                    f"cannot complete checkpoint {final}: rank 0 does not see "
                    f"{', '.join(missing)}, written by other ranks (checkpoints need an --out-dir "
                    "on a filesystem shared by all nodes; nothing was saved)"
                )
        except BaseException as exc:
            # A second Ctrl-C lands inside DCP, which wraps it in its CheckpointException: the
            # interrupt is what happened (exit 130, one line), not a failed checkpoint.
            interrupt = next((e for e in safe_io.causes(exc) if isinstance(e, Interrupted)), None)
            if interrupt is not None and interrupt is not exc:
                raise interrupt from None
            raise
        finally:
            if main or collective:  # a rank on its own disk removes its own shards
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def _complete(tmp: Path, final: Path, step: int, plain: dict[str, Any]) -> list[str]:
    """state.json, then the manifest of every file the checkpoint needs (all ranks' shards, as
    ``.metadata`` names them), then the rename. Returns the shards that are not in ``tmp``
    (written where rank 0 cannot see them), renaming nothing then."""
    reader = _reader()
    shards = sorted(reader.storage_files(reader.read_metadata(tmp)))
    missing = [name for name in shards if not (tmp / name).is_file()]
    if missing:
        return missing
    text = json.dumps({"format": FORMAT, "step": step, "parts": plain}, indent=1)
    (tmp / STATE).write_text(text + "\n")
    manifest = {
        name: {"size": (tmp / name).stat().st_size, "sha256": reader.sha256(tmp / name)}
        for name in (reader.METADATA, STATE, *shards)
    }
    doc = {"format": FORMAT, "step": step, "files": manifest}
    (tmp / MANIFEST).write_text(json.dumps(doc, indent=1) + "\n")
    safe_io.replace_dir(tmp, final)
    return []


def _local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank writes for ``t``: its own shard of a sharded (DTensor) tensor."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _leaves(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _leaves(value)
    else:
        yield tree


def _read_state(path: Path) -> dict[str, Any]:
    """The checkpoint's state.json, every value a resumed run trusts checked (schema.py)."""
    data = safe_io.read_json(path / STATE, "checkpoint state", "resume from another checkpoint")
    check_state(data, f"checkpoint state {path / STATE}")
    return data


def saved_setting(path: Path, key: str) -> Any:
    """One of the settings (``Settings``) the checkpoint at ``path`` was trained with, e.g. its
    ``model_shape``, read before any model exists."""
    try:
        return _read_state(path)["parts"]["settings"][key]
    except (KeyError, TypeError) as exc:
        raise UserError(
            f"checkpoint {path} does not record its {key.replace('_', ' ')} (resume from another)"
        ) from exc


def saved_part(path: Path, name: str) -> Any:
    """What the checkpoint at ``path`` saved of part ``name`` outside of tensors (None: nothing,
    e.g. an optional part it predates), read before any model exists."""
    return _read_state(path)["parts"].get(name)


def _optional(part: Stateful) -> bool:
    """A part that checkpoints written before it lack: they load without it."""
    return getattr(part, "optional", False)


def load_checkpoint(
    path: Path, parts: dict[str, Stateful], *, rt: D.Runtime | None = None, collective: bool = False
) -> int:
    """Load every part from the checkpoint at ``path``, in order, into this run's layout
    (``collective``, sharded weights: every rank of ``rt`` loads together); returns its step."""
    saved = _read_state(path)
    missing = [name for name in parts if name not in saved["parts"]]
    parts = {n: p for n, p in parts.items() if n not in missing or not _optional(p)}
    missing = [name for name in missing if name in parts]
    if missing:
        raise UserError(f"checkpoint {path} lacks {', '.join(missing)} (resume from another)")
    reader = _reader()
    try:  # on every rank, before DCP reads it (find_resume checked it on rank 0 only)
        metadata = reader.read_metadata(path)
    except reader.MetadataRefused as exc:
        raise UserError(f"checkpoint {path}: {exc} (resume from another checkpoint)") from exc
    collective = collective and rt is not None and rt.multiprocess
    for name, part in parts.items():
        template, _ = _split(part.state_dict())
        if template is not None:  # read into this run's own tensors, in this run's layout
            with _quiet_dcp():
                storage = reader.CheckpointReader(path, metadata)
                _dcp().load({name: template}, storage_reader=storage, no_dist=not collective)
            vote = (lambda bad: D.any_rank(bad, rt)) if collective else (lambda bad: bad)
            check_finite(path, name, template, vote)  # weights and the optimizer's state
        try:
            part.load_state_dict(_merge(saved["parts"][name], template))
        except UserError as exc:
            raise UserError(f"checkpoint {path}: {exc}") from exc
        except (KeyError, TypeError, ValueError, IndexError) as exc:  # a shape schema.py misses
            raise UserError(
                f"checkpoint {path}: its {name} part does not load ({type(exc).__name__}: "
                f"{exc}) (the file is damaged or was edited: resume from another checkpoint)"
            ) from exc
    return int(saved["step"])


# ----------------------------------------------------------------------------- checking them


def verify_checkpoint(path: Path) -> str | None:
    """None if complete, intact and of this version's format, else what is wrong with it
    (``checkpoint_reader.check_files``: every file it needs is there and matches the manifest,
    and its ``.metadata`` is plain data)."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return "no manifest.json (torn write)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        if not all(isinstance(m, dict) and {"size", "sha256"} <= m.keys() for m in files.values()):
            raise ValueError
    except (ValueError, KeyError, TypeError, AttributeError, OSError):  # OSError: pruned meanwhile
        return "unreadable manifest.json"
    if manifest.get("format", 1) != FORMAT:
        return (
            f"written in checkpoint format {manifest.get('format', 1)} by an older llama_ddp; "
            f"this version reads format {FORMAT} only (its llama_model.pth export still loads)"
        )
    for name in (".metadata", STATE):
        if name not in files:
            return f"manifest lacks {name}"
    return _reader().check_files(path, files)
