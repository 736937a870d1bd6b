"""``python -m llama_ddp.export MODEL --gguf OUT.gguf``: any model ``--init-from`` reads (a run or
checkpoint folder, a llama_model.pth, a Hugging Face folder or hub id, a .gguf) as one GGUF file
that llama.cpp and ollama run as it was trained (gguf_export.py writes it)::

    python -m llama_ddp.export out/small --gguf small.gguf [--type f32|f16|bf16|q8_0] [--force]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from llama_ddp.data.tokenizer_files import TOKENIZER_FILE, locate_tokenizer
from llama_ddp.errors import ArgumentParser, UserError, run_command
from llama_ddp.files import hub, safe_io
from llama_ddp.files.gguf import is_gguf
from llama_ddp.interop import gguf_export
from llama_ddp.interop.load import load_model, model_folder, model_path


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
    return run_command(lambda args: print(_export_gguf(build_parser().parse_args(args))), argv)


def _export_gguf(args: argparse.Namespace) -> str:
    """Write args.gguf; the line that says what was written."""
    out = safe_io.check_output(args.gguf, "--gguf", args.force, "model.gguf")
    gguf_export.check_available()
    path, checkpoint = model_path(args.model, "MODEL")
    model = load_model(path)
    own = path if is_gguf(path) else model_folder(path, checkpoint)  # the model's own tokenizer
    source = (
        own
        if args.tokenizer is None
        else hub.local_path(args.tokenizer, hub.TOKENIZER_FILES, "--tokenizer")
    )
    tokenizer = locate_tokenizer(source)
    if not tokenizer.is_file():
        raise UserError(
            f"no {TOKENIZER_FILE} in {source} (pass --tokenizer: the one the model was trained "
            "with)"
        )
    label = gguf_export.gguf_pre_label(source) if is_gguf(source) else None
    name = path.stem if is_gguf(path) else (path if path.is_dir() else path.parent).resolve().name
    if checkpoint is not None:
        name = checkpoint.parent.parent.resolve().name
    gguf_export.export_gguf(
        model.state_dict(), model.config, tokenizer.parent, out, args.type, label=label, name=name
    )
    size = out.stat().st_size
    return f"wrote {out} ({args.type}, {size / 2**20:,.1f} MiB): llama-cli -m {out}"
