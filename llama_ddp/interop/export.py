"""Any model ``--init-from`` reads (a run or checkpoint folder, a llama_model.pth, a Hugging Face
folder or hub id, a .gguf) as one GGUF file that llama.cpp and ollama run as it was trained
(gguf_export.py writes it), with the tokenizer it was trained with. The command is
llama_ddp/export.py (``python -m llama_ddp.export MODEL --gguf OUT.gguf``).
"""

from __future__ import annotations

from pathlib import Path

from llama_ddp.data.tokenizer_files import TOKENIZER_FILE, locate_tokenizer
from llama_ddp.errors import UserError
from llama_ddp.files import hub
from llama_ddp.files.gguf import is_gguf
from llama_ddp.interop import gguf_export
from llama_ddp.interop.load import load_model, model_folder, model_path


def export_model(
    model: str | Path, out: Path, gguf_type: str, tokenizer: str | None = None
) -> None:
    """Write the model at ``model`` into ``out`` as GGUF of ``gguf_type`` (a key of
    gguf_export.GGUF_TYPES), with the tokenizer beside it or ``tokenizer`` (a tokenizer.json or
    its folder, a .gguf, or a hub id). ``out`` is written whatever is there: the caller decides
    whether an existing file may be replaced."""
    gguf_export.check_available()
    path, checkpoint = model_path(model, "MODEL")
    loaded = load_model(path)
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
