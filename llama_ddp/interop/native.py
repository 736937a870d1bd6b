"""The trained model's files: ``llama_model.pth`` (the plain state dict), ``llama_model.json`` (its
LlamaConfig), the tokenizer's files (``tokenizer.json``, ``tokenizer_config.json`` with its roles,
and the source's chat template and generation config), and what a finished run says. Every other
model format is read by interop/load.py, which reads these files through `read_model`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from llama_ddp.data.tokenizer_files import (
    TOKENIZER_FILE,
    SpecialTokens,
    read_tokenizer,
    write_tokenizer_files,
)
from llama_ddp.errors import UserError
from llama_ddp.files import safe_io
from llama_ddp.interop.gguf_export import GGUF_FILE
from llama_ddp.model.config import LlamaConfig
from llama_ddp.model.weights import clean_state_dict

MODEL_FILE = "llama_model.pth"
CONFIG_FILE = "llama_model.json"


def save_model(
    model: torch.nn.Module | dict[str, torch.Tensor],
    config: LlamaConfig,
    out_dir: str | Path,
    tokenizer_path: str | Path | None = None,
    special: SpecialTokens | None = None,
) -> Path:
    """Write ``llama_model.pth`` (the plain state dict of ``model``, or ``model`` itself when it is
    a state dict; a tied model's embedding and lm_head are one tensor under both names),
    ``llama_model.json`` and, given a tokenizer (a tokenizer.json or its folder), its files
    (``tokenizer_files.write_tokenizer_files``, with the roles ``special``, by default its own) into
    ``out_dir``; each file is replaced atomically."""
    out_dir = Path(out_dir)
    state = model if isinstance(model, dict) else model.state_dict()
    state = {k: v.detach().cpu() for k, v in clean_state_dict(state).items()}
    needed = sum(t.numel() * t.element_size() for t in state.values())
    with safe_io.writing(out_dir / MODEL_FILE, "model", needed):
        out_dir.mkdir(parents=True, exist_ok=True)
        safe_io.torch_save(state, out_dir / MODEL_FILE)
        safe_io.atomic_write(out_dir / CONFIG_FILE, config.save)
        if tokenizer_path is not None:
            special = special or read_tokenizer(tokenizer_path)[1]
            write_tokenizer_files(tokenizer_path, special, out_dir)
    return out_dir / MODEL_FILE


def run_summary(
    out_dir: Path, checkpoint: Path | None, hf: bool, gguf: bool = False, budgeted: bool = False
) -> str:
    """What a finished run wrote, and the next commands (``budgeted``: a --time-budget run,
    which a larger budget does not extend)."""
    out = Path(out_dir)
    lines = [
        f"saved {out / MODEL_FILE} (with {CONFIG_FILE} and {TOKENIZER_FILE}: the model)",
        f"      {out / 'metrics.jsonl'} (the curves)",
    ]
    if hf:
        lines.append(f"      {out / 'hf'}/ (for transformers)")
    if gguf:
        lines.append(f"      {out / GGUF_FILE} (for llama.cpp and ollama)")
    if checkpoint is not None:
        more = "start another with --init-from" if budgeted else "extend with a larger --max-steps"
        lines.append(f"      {checkpoint}/ (to resume, or to {more})")
    lines += [
        "next:",
        f'  python -m llama_ddp.generate --model {out / MODEL_FILE} --prompt "..."',
        f"  python -m llama_ddp.plot {out / 'metrics.jsonl'}",
    ]
    if hf:
        lines.append(f'  transformers.AutoModelForCausalLM.from_pretrained("{out / "hf"}")')
    if gguf:
        lines.append(f"  llama-cli -m {out / GGUF_FILE}")
    return "\n".join(lines)


def read_model(
    path: str | Path, config_path: str | Path | None = None
) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """The config and state dict of a ``llama_model.pth`` (or a folder holding one); its config
    is the ``llama_model.json`` beside it unless ``config_path`` says otherwise."""
    path = Path(path)
    if path.is_dir():
        path = path / MODEL_FILE
    if not path.is_file():
        fix = "train one with train.py, or give a Hugging Face Llama folder, a .gguf file, or "
        raise safe_io.not_a_file(path, "model", fix + "check the path")
    config = LlamaConfig.load(config_path or path.with_name(CONFIG_FILE))
    state = safe_io.safe_load(path, "model", mmap=True)  # read where used: a rank its shards
    if not isinstance(state, dict):
        raise UserError(f"model {path} is not a state dict")
    return config, clean_state_dict(state)
