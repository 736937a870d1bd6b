"""llama_ddp: a small, fast, correct Llama pretraining application.

The names below are imported on first use: a process that needs one module (the token cache's
builder and tokenizer workers, ``python -m llama_ddp.generate``) does not import torch and the
model with the package.
"""

import importlib
import importlib.abc
import importlib.util
import sys

_WHERE = {
    "UserError": "llama_ddp.errors",
    "load_model": "llama_ddp.interop.load",
    "save_model": "llama_ddp.interop.native",
    "KVCache": "llama_ddp.model.llama",
    "LlamaForPretraining": "llama_ddp.model.llama",
    "LlamaModel": "llama_ddp.model.llama",
    "flops_per_token": "llama_ddp.model.llama",
    "PRESETS": "llama_ddp.model.config",
    "LlamaConfig": "llama_ddp.model.config",
    "preset": "llama_ddp.model.config",
    "load_tokenizer": "llama_ddp.data.tokenizer_files",
    "generate_text": "llama_ddp.generation.generate",
}
__all__ = sorted(_WHERE)
__version__ = "0.1.0"
OLDEST_TORCH = (2, 9)  # torch.optim.Muon; pyproject.toml's bound, `make test-oldest-torch`'s


def torch_problem(version: str) -> str | None:
    """Why torch ``version`` cannot run llama_ddp (older than `OLDEST_TORCH`), or None."""
    release = tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())
    if len(release) == 2 and release < OLDEST_TORCH:
        oldest = ".".join(map(str, OLDEST_TORCH))
        return (
            f"llama_ddp needs torch {oldest} or later, this environment has torch {version} "
            f"(pip install 'torch>={oldest}', or TORCH_VERSION=2.13.0 make install)"
        )
    return None


def _check_torch() -> None:
    """An ImportError saying which torch is needed, before an older one fails deep inside (read
    from the installed package's metadata: torch itself is not imported here)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        problem = torch_problem(version("torch"))
    except PackageNotFoundError:
        return
    if problem is not None:
        raise ImportError(problem)


_check_torch()


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'llama_ddp' has no attribute {name!r}")


# ----------------------------------------------------------------------------- MKL's vector math
# The process's first MKL vector-math call (cos, sin, exp, log, erf of a tensor) made by two
# threads at once can run MKL's low-accuracy kernels: the worker thread reads MKL's CPU-type cache
# while the first thread is still writing it (seen on Intel Xeons: RoPE tables off by up to
# 1.5e-4 in 4 of 15 processes with 2 OpenMP threads, never with one). One call from one thread
# first fills that cache: a one-element tensor, below ATen's parallel grain, so no worker runs.
# It is done here, as torch is imported, because every process that computes (train, generate,
# evaluate, export, plot, torchrun's workers, the tests' subprocesses, a library user's) imports
# llama_ddp before its first math; one that never imports torch (the token cache's tokenizer
# workers) pays nothing.
warmed = False  # whether this process's vector math is warmed (a test reads it)


def warm_vector_math() -> None:
    """Fill MKL's CPU-type cache from this thread alone (see above); idempotent."""
    global warmed
    if not warmed:
        import torch

        one = torch.ones(1)
        for op in (torch.cos, torch.sin, torch.exp, torch.log, torch.erf):
            op(one)
        warmed = True


class _WarmAfterTorch(importlib.abc.MetaPathFinder):
    """Warms the vector math once torch's own import has finished (and then leaves)."""

    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            torch_exec = spec.loader.exec_module

            def exec_module(module) -> None:  # type: ignore[no-untyped-def]
                torch_exec(module)
                warm_vector_math()

            spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if "torch" in sys.modules:
    warm_vector_math()
elif not any(isinstance(f, _WarmAfterTorch) for f in sys.meta_path):
    sys.meta_path.insert(0, _WarmAfterTorch())
