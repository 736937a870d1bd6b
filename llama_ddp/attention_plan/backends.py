"""The attention backends a run can take for packed documents, and the one it takes (issue 45).

Each backend is one of model/attention.py's kernels, on one implementation:

- ``fa4``: torch's flash varlen op on FlashAttention 4 (``flash-attn-4``, CuTe; SM 9.0 and 10.0),
  activated through torch's own registry (``torch.nn.attention.activate_flash_attention_impl``);
- ``fa3``: the same op on FlashAttention 3 (a ``flash_attn_3`` build; SM 9.0), likewise;
- ``flash-varlen``: the same op on torch's built-in FlashAttention 2 (SM 8.0 and newer);
- ``cudnn``: the plan's grids through cuDNN's attention (SDPA's cuDNN backend, its own backward);
- ``sdpa``: the grids through whichever SDPA kernel, the backward recomputed in fp32: any CUDA
  device and dtype, the fallback;
- ``grids``: the CPU's flash kernel on the grids: the CPU.

`available` says which of them this device, dtype and head size can run, and why the others
cannot. train.py's ``--attention auto`` (the default) takes, among the available fast ones, the
one that measures fastest on the run's shape after proving it exact (model/kernel_choice.py);
the fallbacks (``sdpa``, ``grids``) are taken only where nothing faster is available. A run takes
its backend with `use` before its model runs; everything else (generation, evaluation, a model
loaded in a notebook) gets `default`, the first available in ORDER, nothing activated.
Imports only torch and this package's attention_plan.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from importlib.util import find_spec

import torch

from llama_ddp.attention_plan import varlen

# The order of preference where nothing is measured, and the order in which ties are broken.
ORDER = ("flash-varlen", "fa3", "fa4", "cudnn", "sdpa", "grids")
FALLBACKS = ("sdpa", "grids")  # slower: taken only where none of the others is available


@dataclass(frozen=True)
class Backend:
    """A backend: the kernel of model/attention.py it runs, and torch's flash implementation it
    activates for that kernel (None: torch's own)."""

    name: str
    kernel: str
    impl: str | None
    probe: Callable[[torch.device], str | None]  # None where the device runs it, else why not
    takes: Callable[[torch.dtype, int], str | None]  # None where it takes the shape, else why not

    @property
    def device_type(self) -> str:
        return "cpu" if self.kernel == "grids" else "cuda"


def _module(name: str) -> bool:
    try:
        return find_spec(name) is not None
    except Exception:  # a parent package missing, or one whose import fails (a broken build)
        return False


def _torch_impl(impl: str) -> str | None:
    """Why this torch cannot activate flash implementation ``impl``, or None."""
    try:
        attention = importlib.import_module("torch.nn.attention")
        importlib.import_module(f"torch.nn.attention._{impl.lower()}")  # registers it
    except ImportError:
        return f"torch {torch.__version__} cannot activate {impl} (torch 2.11 or later can)"
    if impl not in attention.list_flash_attention_impls():
        return f"torch {torch.__version__} has no {impl} registration"
    return None


def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _varlen_probe(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "needs CUDA"
    problem = varlen.device_problem(device)
    return None if problem is None else problem.why


def _flash_impl_probe(impl: str, module: str, package: str, majors: tuple[int, ...]):
    def probe(device: torch.device) -> str | None:
        if device.type != "cuda":
            return "needs CUDA"
        major, minor = _capability(device)
        if major not in majors:
            wanted = " or ".join(f"{m}.0" for m in majors)
            return f"needs compute capability {wanted}, not {major}.{minor}"
        if not _module(module):
            return f"not installed (pip install {package})"
        return _varlen_probe(device) or _torch_impl(impl)

    return probe


def _cudnn_probe(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "needs CUDA"
    major, minor = _capability(device)
    if major < 9:
        return f"cuDNN attention here needs compute capability 9.0 or newer, not {major}.{minor}"
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if not version or version < 90000:
        return f"needs cuDNN 9 (this torch has {version or 'none'})"
    return None


def _half(dtype: torch.dtype, head_dim: int) -> str | None:
    if not varlen.fits(dtype, head_dim) and dtype in varlen.HALF:
        return f"takes a head dim that is a multiple of 8, at most 256 (not {head_dim})"
    if dtype not in varlen.HALF:
        return f"computes in bf16 or fp16, not {str(dtype).removeprefix('torch.')}"
    return None


CUDNN_MAX_HEAD_DIM = 128


def _cudnn_takes(dtype: torch.dtype, head_dim: int) -> str | None:
    if dtype in varlen.HALF and (head_dim % 8 or head_dim > CUDNN_MAX_HEAD_DIM):
        limit = CUDNN_MAX_HEAD_DIM
        return f"takes a head dim that is a multiple of 8, at most {limit} (not {head_dim})"
    return _half(dtype, head_dim)


def kernel_fits(kernel: str, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether model/attention.py's CUDA ``kernel`` takes ``dtype`` and ``head_dim`` (``sdpa``
    takes any; ``grids``, the CPU's, none)."""
    if kernel == "cudnn":
        return _cudnn_takes(dtype, head_dim) is None
    if kernel == "varlen":
        return varlen.fits(dtype, head_dim)
    return kernel == "sdpa"


def _on(device_type: str) -> Callable[[torch.device], str | None]:
    return lambda device: None if device.type == device_type else f"needs {device_type.upper()}"


def _any(dtype: torch.dtype, head_dim: int) -> None:
    return None


BACKENDS = {
    b.name: b
    for b in (
        Backend("flash-varlen", "varlen", None, _varlen_probe, _half),
        Backend("fa3", "varlen", "FA3", _flash_impl_probe("FA3", "flash_attn_interface",
                                                         "flash_attn_3", (9,)), _half),
        Backend("fa4", "varlen", "FA4", _flash_impl_probe("FA4", "flash_attn.cute.interface",
                                                         "flash-attn-4", (9, 10)), _half),
        Backend("cudnn", "cudnn", None, _cudnn_probe, _cudnn_takes),
        Backend("sdpa", "sdpa", None, _on("cuda"), _any),
        Backend("grids", "grids", None, _on("cpu"), _any),
    )
}  # fmt: skip


def available(device: torch.device, dtype: torch.dtype, head_dim: int) -> tuple[list, dict]:
    """(the backends that run here, in ORDER; {name: why not} of the others)."""
    ok, why = [], {}
    for name in ORDER:
        backend = BACKENDS[name]
        problem = backend.probe(device) or backend.takes(dtype, head_dim)
        if problem is None:
            ok.append(backend)
        else:
            why[name] = problem
    return ok, why


def undoable() -> bool:
    """Whether this torch can undo an activated flash implementation (torch 2.10 activates FA3
    and FA4 but has no ``restore_flash_attention_impl``: 2.11 and later have it)."""
    attention = importlib.import_module("torch.nn.attention")
    return hasattr(attention, "restore_flash_attention_impl")


def candidates(device: torch.device, dtype: torch.dtype, head_dim: int) -> tuple[list, dict]:
    """The backends ``--attention auto`` chooses among (the fast ones that run here; where there is
    none, the first available fallback), and why the others are left out. FA3 and FA4 are tried
    only where torch can undo their activation: a trial must never leave the process running a
    backend the choice did not take (``--attention fa3`` or ``fa4`` still takes them)."""
    ok, why = available(device, dtype, head_dim)
    if not undoable():
        for backend in [b for b in ok if b.impl is not None]:
            ok.remove(backend)
            why[backend.name] = (
                f"torch {torch.__version__} cannot undo its activation, so auto does not try it "
                f"(torch 2.11 or later can; --attention {backend.name} takes it)"
            )
    fast = [b for b in ok if b.name not in FALLBACKS]
    if fast:
        why |= {b.name: "a fallback, slower" for b in ok if b.name in FALLBACKS}
        return fast, why
    return ok[:1], why


def activate(backend: Backend) -> None:
    """Make torch's flash op run ``backend``'s implementation (FA3, FA4), or torch's own for
    every other backend."""
    if backend.device_type != "cuda":
        return
    attention = importlib.import_module("torch.nn.attention")
    if backend.impl is not None:
        attention.activate_flash_attention_impl(backend.impl)
    elif getattr(attention, "current_flash_attention_impl", lambda: None)() is not None:
        if not undoable():  # never reached by a choice (`candidates`): said, not an AttributeError
            raise RuntimeError(f"torch {torch.__version__} cannot undo an activated flash kernel")
        attention.restore_flash_attention_impl()


_IN_USE: dict[str, Backend] = {}  # device type -> the backend a run took (`use`)


def use(backend: Backend, device: torch.device) -> None:
    """From now on plans moved to ``device``'s type run ``backend`` (train.py, once, at start)."""
    activate(backend)
    _IN_USE[device.type] = backend


def default(device: torch.device) -> Backend:
    """The backend of a process that chose none (generation, evaluation, a model in a notebook):
    nothing activated, nothing measured: torch's flash varlen where it runs, else the fallback
    (the model falls back per call where a dtype or head size does not fit)."""
    if device.type == "cpu":
        return BACKENDS["grids"]
    return BACKENDS["flash-varlen" if _varlen_probe(device) is None else "sdpa"]


def current_kernel(device: torch.device) -> str:
    """The kernel plans moved to ``device`` run: the one `use` took, else `default`'s."""
    if device.type == "cpu":
        return "grids"
    backend = _IN_USE.get(device.type)
    return (backend or default(device)).kernel
