"""Any model ``--init-from`` reads (a run or checkpoint folder, a llama_model.pth, a Hugging Face
folder or hub id, a .gguf) as one GGUF file that llama.cpp and ollama run as it was trained
(gguf_export.py writes it), with the tokenizer it was trained with. The command is
llama_ddp/export.py (``python -m llama_ddp.export MODEL --gguf OUT.gguf``). And a finished
run's exports, written as one set (`export_run`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from llama_ddp.data.tokenizer_files import TOKENIZER_FILE, SpecialTokens, locate_tokenizer
from llama_ddp.errors import UserError, WriteFailed
from llama_ddp.files import hub, safe_io
from llama_ddp.files.gguf import is_gguf
from llama_ddp.interop import gguf_export
from llama_ddp.interop.hf import export_hf
from llama_ddp.interop.load import model_folder, open_model
from llama_ddp.interop.native import save_model
from llama_ddp.model.config import LlamaConfig


def export_run(
    state: dict[str, torch.Tensor],
    config: LlamaConfig,
    out: Path,
    tokenizer_path: Path,
    special: SpecialTokens,
    *,
    hf: bool,
    gguf_type: str | None,
) -> None:
    """A run's exports in its folder ``out``, as one set: llama_model.pth, llama_model.json and
    the tokenizer's files (`save_model`), hf/ with ``hf``, model.gguf with ``gguf_type``. They
    are written together beside the previous set (``out/.export.tmp-PID/``), then moved into
    place by renames, which need no space: a write the disk refuses (one line, exit 2) leaves
    the previous set whole, never a llama_model.pth of one step beside an hf/ of another. Once
    the new set is in place, an hf/ or model.gguf of the previous set that this one does not
    write is removed (it is of another step), with a line saying so. A run killed while it
    renames leaves a mix, which the same command, run again, exports anew."""
    staging = out / f".export.tmp-{os.getpid()}"
    unwritten = [("hf", not hf), (gguf_export.GGUF_FILE, gguf_type is None)]
    stale = [out / name for name, dropped in unwritten if dropped]
    try:
        save_model(state, config, staging, tokenizer_path, special)
        if hf:
            export_hf(state, staging / "hf", staging / TOKENIZER_FILE, config=config)
        if gguf_type is not None:
            tokenizer, name = staging / TOKENIZER_FILE, out.resolve().name
            gguf_export.export_gguf(
                state, config, tokenizer, staging / gguf_export.GGUF_FILE, gguf_type, name=name
            )
        for path in staging.iterdir():
            if path.is_dir():
                safe_io.replace_dir(path, out / path.name)
            else:
                os.replace(path, out / path.name)
        for path in (p for p in stale if p.exists()):
            path.rename(staging / path.name)  # out of sight at once, deleted with the staging
            print(f"removed {path}: an earlier export, of another step (this run writes none)")
    except WriteFailed as exc:  # named as the export the user knows, not as its staging place
        raise WriteFailed(str(exc).replace(str(staging), str(out))) from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def export_model(
    model: str | Path, out: Path, gguf_type: str, tokenizer: str | None = None
) -> None:
    """Write the model at ``model`` into ``out`` as GGUF of ``gguf_type`` (a key of
    gguf_export.GGUF_TYPES), with the tokenizer beside it or ``tokenizer`` (a tokenizer.json or
    its folder, a .gguf, or a hub id). ``out`` is written whatever is there: the caller decides
    whether an existing file may be replaced."""
    gguf_export.check_available()
    loaded, read = open_model(model, "MODEL")
    path, checkpoint = read.path, read.checkpoint
    own = path if is_gguf(path) else model_folder(path, checkpoint)  # the model's own tokenizer
    source = (
        own if tokenizer is None else hub.local_path(tokenizer, hub.TOKENIZER_FILES, "--tokenizer")
    )
    tokenizer_path = locate_tokenizer(source)
    if not tokenizer_path.is_file():
        raise UserError(
            f"no {TOKENIZER_FILE} in {source} (pass --tokenizer: the one the model was trained "
            "with)"
        )
    label = gguf_export.gguf_pre_label(source) if is_gguf(source) else None
    name = path.stem if is_gguf(path) else (path if path.is_dir() else path.parent).resolve().name
    if checkpoint is not None:
        name = checkpoint.parent.parent.resolve().name
    gguf_export.export_gguf(
        loaded.state_dict(),
        loaded.config,
        tokenizer_path.parent,
        out,
        gguf_type,
        label=label,
        name=name,
    )
