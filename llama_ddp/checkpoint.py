"""Files: training checkpoints, the final ``llama_model.pth`` export, loading a model back.

A checkpoint is a folder ``OUT/checkpoints/step-NNNNNNNN/`` that appears only complete: it is
written under a temporary name and renamed, and its ``manifest.json`` (written last) records the
size and SHA-256 of every file, so a torn or corrupted one is detected and never resumed from.

Every load goes through ``torch.load(weights_only=True)`` or safetensors: a file holding anything
but tensors and plain data is refused, and no code in it ever runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llama_ddp.config import LlamaConfig
from llama_ddp.errors import UserError
from llama_ddp.model import LlamaForPretraining

MODEL_FILE = "llama_model.pth"
CONFIG_FILE = "llama_model.json"
TOKENIZER_FILE = "tokenizer.json"
CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def safe_load(path: str | Path, what: str = "file") -> Any:
    """``torch.load`` that only accepts tensors and plain data, as a UserError otherwise."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what} {path} not found (check the path)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UserError(
            f"{what} {path} holds objects other than tensors and plain data; refused without "
            "running it (only load files you trust, and re-save them as plain state dicts)"
        ) from exc
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"{what} {path} is not a readable PyTorch file ({first})") from exc


def clean_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip the prefixes DataParallel/DDP (``module.``) and torch.compile (``_orig_mod.``) add."""
    out = {}
    for name, tensor in state.items():
        for prefix in ("module.", "_orig_mod."):
            name = name.replace(prefix, "")
        out[name] = tensor
    return out


def atomic_torch_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_model(
    model: torch.nn.Module,
    config: LlamaConfig,
    out_dir: str | Path,
    tokenizer_path: str | Path | None = None,
) -> Path:
    """Write ``llama_model.pth`` (the plain state dict), ``llama_model.json`` and
    ``tokenizer.json`` into ``out_dir``; each file is replaced atomically."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu() for k, v in clean_state_dict(model.state_dict()).items()}
    atomic_torch_save(state, out_dir / MODEL_FILE)
    tmp = out_dir / (CONFIG_FILE + ".tmp")
    config.save(tmp)
    os.replace(tmp, out_dir / CONFIG_FILE)
    if (
        tokenizer_path is not None
        and Path(tokenizer_path).resolve() != (out_dir / TOKENIZER_FILE).resolve()
    ):
        tmp = out_dir / (TOKENIZER_FILE + ".tmp")
        shutil.copyfile(tokenizer_path, tmp)
        os.replace(tmp, out_dir / TOKENIZER_FILE)
    return out_dir / MODEL_FILE


def load_model(
    path: str | Path,
    *,
    config_path: str | Path | None = None,
    device: str | torch.device = "cpu",
) -> LlamaForPretraining:
    """Load a trained model for inference.

    ``path`` is a ``llama_model.pth`` (its ``llama_model.json`` is found beside it unless
    ``config_path`` says otherwise), a folder holding one, or an exported Hugging Face folder
    (config.json + model.safetensors).
    """
    path = Path(path)
    if path.is_dir() and (path / "model.safetensors").is_file():
        from llama_ddp.hf import import_hf

        return import_hf(path).to(device).eval()
    if path.is_dir():
        path = path / MODEL_FILE
    if not path.is_file():
        raise UserError(f"model {path} not found (train one with train.py, or check the path)")
    config = LlamaConfig.load(config_path or path.with_name(CONFIG_FILE))
    state = safe_load(path, "model")
    if not isinstance(state, dict):
        raise UserError(f"model {path} is not a state dict")
    model = LlamaForPretraining(config)
    try:
        model.load_state_dict(clean_state_dict(state), strict=True)
    except RuntimeError as exc:
        raise UserError(
            f"model {path} does not match its config {config_path or path.with_name(CONFIG_FILE)} "
            f"({_first_mismatch(exc)})"
        ) from exc
    return model.to(device).eval()


def _first_mismatch(exc: RuntimeError) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[1] if len(lines) > 1 else lines[0]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def rng_state() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """This process's RNG states: (JSON-able python/numpy part, tensor part)."""
    np_state = np.random.get_state()
    plain = {
        "python": random.getstate(),
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
    }
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return plain, tensors


def set_rng_state(plain: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    version, state, gauss = plain["python"]
    random.setstate((version, tuple(state), gauss))
    kind, keys, *rest = plain["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[k] for k in sorted(tensors) if k.startswith("cuda")]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def save_checkpoint(
    out_dir: str | Path,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    keep_last: int,
) -> Path:
    """Write ``checkpoints/step-NNNNNNNN`` atomically, then prune all but the newest
    ``keep_last`` (only once the new one is complete). ``state`` is JSON-able run state."""
    root = Path(out_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-step-{step:08d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    plain_rng, tensor_rng = rng_state()
    torch.save(clean_state_dict(model.state_dict()), tmp / "model.pt")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(tensor_rng, tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({**state, "rng": plain_rng}, indent=1) + "\n")
    manifest = {
        p.name: {"size": p.stat().st_size, "sha256": _sha256(p)} for p in sorted(tmp.iterdir())
    }
    (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": manifest}, indent=1) + "\n")
    if final.exists():  # the same step saved again (a resumed run that had nothing left to do)
        old = root / f".old-{final.name}-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    # Prune only older checkpoints: a newer one (skipped as damaged, or beyond a --resume PATH)
    # is not this run's to delete.
    older = [p for p in list_checkpoints(out_dir) if p.name < final.name]
    for stale in older[: max(0, len(older) - (keep_last - 1))]:
        shutil.rmtree(stale, ignore_errors=True)
    return final


def list_checkpoints(out_dir: str | Path) -> list[Path]:
    """Checkpoint folders, oldest first (temporary ones are never listed)."""
    root = Path(out_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name))


def verify_checkpoint(path: Path) -> str | None:
    """None if complete and intact, else what is wrong with it."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return "no manifest.json (torn write)"
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return "unreadable manifest.json"
    for name in ("model.pt", "optimizer.pt", "rng.pt", "state.json"):
        if name not in files:
            return f"manifest lacks {name}"
    for name, meta in files.items():
        p = path / name
        if not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != meta["size"]:
            return f"{name} has {p.stat().st_size} bytes, manifest says {meta['size']}"
        if _sha256(p) != meta["sha256"]:
            return f"{name} does not match its checksum"
    return None


def find_resume(out_dir: str | Path, resume: str) -> Path | None:
    """The checkpoint to resume from: ``auto`` takes the newest intact one in ``out_dir`` (warning
    about each damaged one it skips), ``none`` none, anything else is a path that must be intact."""
    if resume == "none":
        intact = [p for p in list_checkpoints(out_dir) if verify_checkpoint(p) is None]
        if intact:
            raise UserError(
                f"{out_dir} already holds checkpoints of a run (newest {intact[-1].name}); "
                "continue it with --resume auto, or choose another --out-dir"
            )
        return None
    if resume != "auto":
        path = Path(resume)
        if not path.is_dir():
            raise UserError(f"checkpoint {path} not found (give a checkpoints/step-* folder)")
        problem = verify_checkpoint(path)
        if problem:
            raise UserError(
                f"checkpoint {path} is damaged: {problem} (resume from another checkpoint)"
            )
        return path
    for path in reversed(list_checkpoints(out_dir)):
        problem = verify_checkpoint(path)
        if problem is None:
            return path
        print(f"warning: skipping damaged checkpoint {path}: {problem}", file=sys.stderr)
    return None


def load_checkpoint(path: Path) -> dict[str, Any]:
    """The checkpoint's contents: model and optimizer state dicts, run state, RNG states."""
    try:
        state = json.loads((path / "state.json").read_text())
    except ValueError as exc:
        raise UserError(f"checkpoint {path} has an unreadable state.json ({exc})") from exc
    return {
        "model": safe_load(path / "model.pt", "checkpoint model"),
        "optimizer": safe_load(path / "optimizer.pt", "checkpoint optimizer"),
        "rng": safe_load(path / "rng.pt", "checkpoint RNG state"),
        "state": state,
    }
