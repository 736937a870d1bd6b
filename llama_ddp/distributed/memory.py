"""--micro-batch-size auto: the largest micro-batch whose step fits the device's memory.

A step's peak memory is modelled as ``fixed + m * per_sample`` for a micro-batch of m sequences
(`MemoryModel`): what does not grow with m (weights, gradients, optimizer states) and what each
sequence adds (its activations, its logits). On CUDA both are measured: two probe steps (forward
and backward, at micro-batches 1 and 2, on a throwaway batch of the run's shape, eagerly, then
their gradients dropped: no weight, optimizer state or data read changes), peaks read from
``torch.cuda.max_memory_allocated`` (eager: a compiled step usually keeps less). On the CPU
they are estimated from the model's shape (`estimate`): its allocator's peak cannot be read back.
The optimizer's states are not yet allocated by the probe: 8 bytes a parameter (AdamW's two fp32
moments, the most any optimizer here keeps) are added to ``fixed``.

The choice (`choose_micro_batch`, a pure function) is the largest divisor of batch / processes
whose modelled peak is within the budget less a margin (`MARGIN`): the device's free memory
(CUDA: free plus what torch holds; the CPU: /proc/meminfo's MemAvailable), or
``LLAMA_DDP_MEMORY_BUDGET`` (bytes, or a number with KiB, MiB or GiB) where set. Gradient
accumulation keeps the global batch; under torchrun every rank takes the smallest choice.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from llama_ddp.data.batch import Batch
from llama_ddp.data.pipeline import TrainData
from llama_ddp.distributed import runtime as D
from llama_ddp.errors import UserError
from llama_ddp.model.config import LlamaConfig
from llama_ddp.model.loss import batch_loss_sum
from llama_ddp.precision import Precision

MARGIN = 0.1  # of the budget, kept free: the allocator's fragmentation, the loader's batches
BUDGET_ENV = "LLAMA_DDP_MEMORY_BUDGET"
OPTIMIZER_BYTES = 8  # a parameter's optimizer states, at most (AdamW: two fp32 moments)
PROBES = (1, 2)  # the micro-batches the CUDA probe steps run
GIB = 2**30


@dataclass(frozen=True)
class MemoryModel:
    """A step's peak bytes at micro-batch m: ``fixed + m * per_sample``."""

    fixed: float
    per_sample: float

    def peak(self, micro_batch: int) -> float:
        return self.fixed + micro_batch * self.per_sample

    @classmethod
    def through(cls, a: int, peak_a: float, b: int, peak_b: float) -> MemoryModel:
        """The line through two probes' peaks (micro-batches ``a`` < ``b``)."""
        per_sample = max(0.0, (peak_b - peak_a) / (b - a))
        return cls(peak_a - a * per_sample, per_sample)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def choose_micro_batch(
    per_rank: int, model: MemoryModel, budget: float, margin: float = MARGIN
) -> int | None:
    """The largest divisor of ``per_rank`` (batch / processes) whose modelled peak is within
    ``budget`` less ``margin`` of it; None when not even 1 fits."""
    fits = [d for d in divisors(per_rank) if model.peak(d) <= (1 - margin) * budget]
    return max(fits) if fits else None


@dataclass(frozen=True)
class Fit:
    """What --micro-batch-size auto chose, and from what."""

    micro_batch: int | None  # None: not even 1 fits
    model: MemoryModel
    budget: float
    budget_source: str  # "free" (CUDA), "available" (the CPU), "budgeted (LLAMA_DDP_...)"
    measured: bool  # probe steps on the device, else the shape's estimate
    margin: float = MARGIN

    def describe(self) -> str:
        """The banner's line: ``micro-batch 16 (auto: a step at 2 peaked at ...)``."""
        m, budget = self.micro_batch, f"{self.budget / GIB:.1f} GiB {self.budget_source}"
        if self.measured:
            base = max(PROBES)
            seen = f"a step at {base} peaked at {self.model.peak(base) / GIB:.2f} GiB of {budget}"
            seen += ", the optimizer's states counted"
        else:
            seen = f"a step at 1 needs about {self.model.peak(1) / GIB:.2f} GiB beyond the weights"
            seen += f" (estimated from the shape) of {budget}"
        return (
            f"micro-batch {m} (auto: {seen}; {m} needs about {self.model.peak(m) / GIB:.2f} GiB "
            f"and fits with a {self.margin:.0%} margin)"
        )

    def refusal(self, device: torch.device, helps: list[str]) -> str:
        """The one line for a batch that fits at no micro-batch."""
        fix = f"try {', '.join(helps)}" if helps else "lower --seq-length or use a smaller model"
        return (
            f"a training step at micro-batch 1 needs {self.model.peak(1) / GIB:.2f} GiB on "
            f"{device}, more than the {(1 - self.margin) * self.budget / GIB:.2f} GiB usable of "
            f"its {self.budget / GIB:.1f} GiB {self.budget_source} ({fix})"
        )


def parse_size(text: str) -> int:
    """Bytes from ``LLAMA_DDP_MEMORY_BUDGET``: a number of bytes, or with KiB, MiB or GiB, up to
    1 EiB (2^60 bytes: more than any machine has)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMG]i?B?)?\s*", text, re.IGNORECASE)
    shown = repr(text) if len(text) <= 40 else f"{text[:20] + '...'!r} ({len(text)} characters)"
    if not match:
        raise UserError(
            f"{BUDGET_ENV}={shown} is not a memory size (give bytes, or a number with KiB, MiB "
            "or GiB, e.g. 20GiB)"
        )
    unit = (match.group(2) or "B")[0].upper()
    size = float(match.group(1)) * {"B": 1, "K": 2**10, "M": 2**20, "G": 2**30}[unit]
    if not size <= 2**60:  # and infinity, what float() makes of 400 digits
        raise UserError(
            f"{BUDGET_ENV}={shown} is more memory than any machine has (give at most "
            f"{2**30:,} GiB, e.g. 20GiB)"
        )
    return int(size)


def available_memory(device: torch.device) -> tuple[float | None, str]:
    """The bytes a step may use on ``device`` and what they are: ``LLAMA_DDP_MEMORY_BUDGET``
    where set; a GPU's free memory plus what torch's allocator holds; the host's MemAvailable."""
    if os.environ.get(BUDGET_ENV):
        return parse_size(os.environ[BUDGET_ENV]), f"budgeted ({BUDGET_ENV})"
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device), "free"
    return host_available(), "available"


def host_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The host's MemAvailable (Linux), else its free pages (None where neither is said)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def estimate(config: LlamaConfig, seq_length: int, parameters: int) -> MemoryModel:
    """A CPU step's memory beyond the weights already held: gradients and optimizer states
    (4 + 8 bytes a parameter) and, per sequence, what the eager forward keeps for the backward in
    fp32 (each layer's ~10 hidden-wide, 3 kv-wide and 4 MLP-wide values a token; the logits,
    their log-softmax, their gradient and its cast, 4 vocabulary-wide values a token): 11-13%
    above a step's peak RSS growth in fp32 (docs/training.md), more in bf16."""
    c, kv = config.hidden_size, config.num_key_value_heads * config.head_dim
    layer = 10 * c + 3 * kv + 4 * config.intermediate_size
    per_token = config.num_hidden_layers * layer + c + 4 * config.vocab_size
    return MemoryModel((4 + OPTIMIZER_BYTES) * parameters, 4 * seq_length * per_token)


def local_parameters(model: nn.Module) -> int:
    """The parameters this rank holds (a shard's, under FSDP)."""
    return sum(getattr(p, "to_local", lambda p=p: p)().numel() for p in model.parameters())


def probe_batch(micro_batch: int, seq_length: int, packing: str, document_mask: bool) -> Batch:
    """A throwaway micro-batch of the run's shape: full rows (one document each), token 0."""
    x = torch.zeros(micro_batch, seq_length, dtype=torch.long)
    documents = torch.zeros_like(x) if packing == "pack" and document_mask else None
    return Batch.of(x, x.clone(), padded=packing == "pad", document_ids=documents)


def measure(
    train_model: nn.Module,
    model: nn.Module,
    precision: Precision,
    device: torch.device,
    make_batch: Callable[[int], Batch],
) -> MemoryModel:
    """The CUDA peak of a step's forward and backward at each of `PROBES` (eagerly, gradients
    synchronized as on a step's last micro-batch), fitted to a line; the optimizer's states
    added. The gradients are dropped after: the probe leaves no trace. A probe that runs out of
    memory is a `ProbeOutOfMemory` naming its micro-batch."""
    peaks = []
    for m in PROBES:
        batch = make_batch(m).to(device)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        try:
            with torch.compiler.set_stance("force_eager"):
                batch_loss_sum(train_model, batch, precision).backward()
            torch.cuda.synchronize(device)
        except torch.cuda.OutOfMemoryError as exc:
            raise ProbeOutOfMemory(m) from exc
        finally:
            for p in model.parameters():
                p.grad = None
        peaks.append(torch.cuda.max_memory_allocated(device))
        del batch
    line = MemoryModel.through(PROBES[0], peaks[0], PROBES[1], peaks[1])
    return MemoryModel(line.fixed + OPTIMIZER_BYTES * local_parameters(model), line.per_sample)


class ProbeOutOfMemory(Exception):
    """A probe step that did not fit the device (``micro_batch``: its size)."""

    def __init__(self, micro_batch: int) -> None:
        super().__init__(micro_batch)
        self.micro_batch = micro_batch


def helping_flags(activation_checkpointing: bool, mode: str, seq_length: int) -> list[str]:
    """The flags that lower a step's memory, less those the run already uses."""
    helps = [] if activation_checkpointing else ["--activation-checkpointing"]
    if mode != "fsdp":
        helps.append("--mode fsdp")
    if seq_length > 1:
        helps.append(f"a shorter --seq-length (now {seq_length})")
    return helps


def wants_auto(setting: int | str | None, device: torch.device, mode: str) -> bool:
    """Whether the run's micro-batch is --micro-batch-size auto's: asked for, or by default on
    CUDA (not under --mode dp, whose micro-batch DataParallel splits across the GPUs; on the CPU
    it runs unwrapped)."""
    if setting == "auto":
        if mode == "dp" and device.type == "cuda":
            raise UserError(
                "--micro-batch-size auto does not work with --mode dp: DataParallel splits each "
                "micro-batch across the GPUs (use DDP: torchrun --standalone --nproc_per_node=N "
                "train.py, or give --micro-batch-size N)"
            )
        return True
    return setting is None and device.type == "cuda" and mode != "dp"


def fit_micro_batch(
    rt: D.Runtime,
    data: TrainData,
    train_model: nn.Module,
    model: nn.Module,
    precision: Precision,
    activation_checkpointing: bool,
) -> str:
    """Set ``data``'s micro-batch to --micro-batch-size auto's choice, the same on every rank
    (the smallest of theirs), before any batch is read; the banner's line saying why. A
    UserError naming the flags that help when not even 1 fits."""
    budget, source = available_memory(rt.device)
    if budget is None:
        raise UserError(
            f"--micro-batch-size auto: this system does not say how much memory is free (set "
            f"{BUDGET_ENV}, e.g. {BUDGET_ENV}=8GiB, or give --micro-batch-size N)"
        )
    helps = helping_flags(activation_checkpointing, rt.mode, data.seq_length)
    if rt.device.type == "cuda":
        shape = (data.seq_length, data.packing, data.document_mask)
        try:
            memory = measure(
                train_model, model, precision, rt.device, lambda m: probe_batch(m, *shape)
            )
        except ProbeOutOfMemory as exc:
            data.close()
            helps += ["--micro-batch-size 1"] if exc.micro_batch > 1 else []
            raise UserError(
                f"a training step at micro-batch {exc.micro_batch} ran out of {rt.device}'s memory "
                f"in --micro-batch-size auto's probe (try {', '.join(helps) or 'a smaller model'})"
            ) from exc
    else:
        memory = estimate(model.config, data.seq_length, local_parameters(model))
    sampler = data.sampler
    chosen = choose_micro_batch(sampler.global_batch // rt.world_size, memory, budget) or 0
    if rt.multiprocess:
        votes = torch.tensor([chosen])
        dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=rt.cpu_group)
        chosen = int(votes.item())
    fit = Fit(chosen or None, memory, budget, source, rt.device.type == "cuda")
    if not chosen:
        data.close()
        raise UserError(fit.refusal(rt.device, helps))
    sampler.set_micro_batch(chosen)
    return fit.describe()
