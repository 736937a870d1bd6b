"""``python -m llama_ddp.export`` (``llama-ddp-export``): a model as one GGUF file that llama.cpp
and ollama run as it was trained (interop/export.py)::

    python -m llama_ddp.export out/small --gguf small.gguf [--type f32|f16|bf16|q8_0] [--force]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from llama_ddp.errors import ArgumentParser, exit_command, run_command
from llama_ddp.files import safe_io
from llama_ddp.interop import gguf_export
from llama_ddp.interop.export import export_model


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
    export_model(args.model, out, args.type, args.tokenizer)
    size = out.stat().st_size
    return f"wrote {out} ({args.type}, {size / 2**20:,.1f} MiB): llama-cli -m {out}"


if __name__ == "__main__":
    exit_command(main())
