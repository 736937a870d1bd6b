"""The trained model's files: ``llama_model.pth`` (the plain state dict), ``llama_model.json`` (its
LlamaConfig), the tokenizer's files (``tokenizer.json``, ``tokenizer_config.json`` with its roles,
and the source's chat template and generation config), and what a finished run says. Reading them
back is weights.py's.

As a command, any model ``--init-from`` reads as one GGUF file for llama.cpp and ollama
(gguf_export.py)::

    python -m llama_ddp.export out/small --gguf small.gguf [--type f32|f16|bf16|q8_0] [--force]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from llama_ddp import gguf_export, hub, safe_io
from llama_ddp.errors import ArgumentParser, UserError, WriteFailed
from llama_ddp.gguf_source import is_gguf, write_tokenizer_folder
from llama_ddp.model_config import LlamaConfig
from llama_ddp.tokenizer import (
    TOKENIZER_FILE,
    SpecialTokens,
    read_tokenizer,
    tokenizer_file,
    write_tokenizer_files,
)
from llama_ddp.weights import CONFIG_FILE, MODEL_FILE, clean_state_dict, load_model


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
    (``tokenizer.write_tokenizer_files``, with the roles ``special``, by default its own) into
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


def run_summary(out_dir: Path, checkpoint: Path | None, hf: bool, gguf: bool = False) -> str:
    """What a finished run wrote, and the next commands."""
    out = Path(out_dir)
    lines = [
        f"saved {out / MODEL_FILE} (with {CONFIG_FILE} and {TOKENIZER_FILE}: the model)",
        f"      {out / 'metrics.jsonl'} (the curves)",
    ]
    if hf:
        lines.append(f"      {out / 'hf'}/ (for transformers)")
    if gguf:
        lines.append(f"      {out / gguf_export.GGUF_FILE} (for llama.cpp and ollama)")
    if checkpoint is not None:
        lines.append(f"      {checkpoint}/ (to resume, or to extend with a larger --max-steps)")
    lines += [
        "next:",
        f'  python -m llama_ddp.generate --model {out / MODEL_FILE} --prompt "..."',
        f"  python -m llama_ddp.plot {out / 'metrics.jsonl'}",
    ]
    if hf:
        lines.append(f'  transformers.AutoModelForCausalLM.from_pretrained("{out / "hf"}")')
    if gguf:
        lines.append(f"  llama-cli -m {out / gguf_export.GGUF_FILE}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    types = "; ".join(f"{name}: {t.help}" for name, t in gguf_export.GGUF_TYPES.items())
    p = ArgumentParser(
        prog="python -m llama_ddp.export",
        description="Write a model as one GGUF file that llama.cpp and ollama run.",
    )
    p.add_argument(
        "model",
        metavar="MODEL",
        help="a run folder, a llama_model.pth (its llama_model.json beside it), a Hugging Face "
        "Llama folder or hub id, or a .gguf file",
    )
    p.add_argument("--gguf", required=True, metavar="OUT.gguf", help="the file to write")
    p.add_argument(
        "--type",
        default=gguf_export.DEFAULT_TYPE,
        choices=list(gguf_export.GGUF_TYPES),
        help=f"how the weight matrices are stored (default: {gguf_export.DEFAULT_TYPE}). {types}",
    )
    p.add_argument("--force", action="store_true", help="replace OUT.gguf if it exists")
    p.add_argument(
        "--tokenizer",
        help="the model's tokenizer (a tokenizer.json or its folder, or a .gguf) when none lies "
        "beside it",
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
        print(_export_gguf(args))
        return 0
    except UserError as exc:
        if "--debug" in argv:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except WriteFailed as exc:  # the disk refused: the old file, if any, is as it was
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


def _export_gguf(args: argparse.Namespace) -> str:
    """Write args.gguf; the line that says what was written."""
    out = Path(args.gguf)
    if out.is_dir():
        raise UserError(f"--gguf {out} is a folder (give a file name, e.g. {out / 'model.gguf'})")
    if out.exists() and not args.force:
        raise UserError(f"--gguf {out} exists (pass --force to replace it)")
    gguf_export.check_available()
    path = hub.local_path(args.model, hub.MODEL_FILES, "MODEL")
    model = load_model(path)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer, label = _tokenizer_source(path, args.tokenizer, Path(tmp))
        name = (
            path.stem if is_gguf(path) else (path if path.is_dir() else path.parent).resolve().name
        )
        gguf_export.export_gguf(
            model.state_dict(), model.config, tokenizer, out, args.type, label=label, name=name
        )
    size = out.stat().st_size
    return f"wrote {out} ({args.type}, {size / 2**20:,.1f} MiB): llama-cli -m {out}"


def _tokenizer_source(
    model_path: Path, tokenizer: str | None, tmp: Path
) -> tuple[Path, str | None]:
    """The tokenizer folder for a model at ``model_path`` (``tokenizer`` if given, else the one
    beside it, or a GGUF file's own made into a folder in ``tmp``) and, for a GGUF tokenizer, the
    pre-tokenizer label it came with."""
    path = model_path if model_path.is_dir() else model_path.parent
    if tokenizer is not None:
        path = hub.local_path(tokenizer, hub.TOKENIZER_FILES, "--tokenizer")
    elif is_gguf(model_path):
        path = model_path
    if is_gguf(path):
        return write_tokenizer_folder(path, tmp / "tokenizer"), gguf_export.gguf_pre_label(path)
    if not tokenizer_file(path).is_file():
        raise UserError(
            f"no {TOKENIZER_FILE} in {path} (pass --tokenizer: the one the model was trained with)"
        )
    return path, None


if __name__ == "__main__":
    sys.exit(main())
