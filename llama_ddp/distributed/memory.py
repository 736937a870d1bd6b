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

The probe's batch is the worst layout the run's attention kernel meets: whole-row documents for
flash varlen (its memory is the tokens'), and for the grid kernels (``cudnn``, ``sdpa``) packed
documents each just over a grid width, which pad their q, k and v by nearly a quarter
(`probe_batch`). A micro-batch 2 probe that runs out of memory after micro-batch 1 fit takes 1.
Each rank probes alone (under DDP through the unwrapped model: no collective a rank that ran
out of memory would miss), then every rank learns every rank's result (`agree`): the same
micro-batch, or the same one line, on all of them. FSDP's probe cannot be alone (each layer's
weights are gathered from the other ranks): a rank that runs out of memory there, at
micro-batch 1 or 2, ends at once with its line, and torchrun ends the other ranks of its
machine; ranks on other machines end when the collective they wait in times out.

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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from llama_ddp.attention_plan import backends
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


def size(nbytes: float) -> str:
    """``nbytes`` in GiB, MiB or KiB, whichever keeps a digit before the point (a tiny budget
    is not '0.0 GiB')."""
    for unit, scale in (("GiB", GIB), ("MiB", 2**20)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes / 2**10:.2f} KiB"


@dataclass(frozen=True)
class Fit:
    """What --micro-batch-size auto chose, and from what."""

    micro_batch: int | None  # None: not even 1 fits
    model: MemoryModel
    budget: float
    budget_source: str  # "free" (CUDA), "available" (the CPU), "budgeted (LLAMA_DDP_...)"
    measured: bool  # probe steps on the device, else the shape's estimate
    margin: float = MARGIN
    out_of_memory: int | None = None  # the probe's micro-batch that ran out of memory

    def describe(self) -> str:
        """The banner's line: ``micro-batch 16 (auto: a step at 2 peaked at ...)``."""
        m, budget = self.micro_batch, f"{size(self.budget)} {self.budget_source}"
        if self.out_of_memory is not None:
            return (
                f"micro-batch {m} (auto: a step at {self.out_of_memory} ran out of memory in the "
                f"probe, a step at 1 peaked at {size(self.model.peak(1))} of {budget}, the "
                f"optimizer's states counted; accumulation keeps the global batch)"
            )
        if self.measured:
            base = max(PROBES)
            seen = f"a step at {base} peaked at {size(self.model.peak(base))} of {budget}"
            seen += ", the optimizer's states counted"
        else:
            seen = f"a step at 1 needs about {size(self.model.peak(1))} beyond the weights"
            seen += f" (estimated from the shape) of {budget}"
        return (
            f"micro-batch {m} (auto: {seen}; {m} needs about {size(self.model.peak(m))} "
            f"and fits with a {self.margin:.0%} margin)"
        )

    def refusal(self, device: torch.device, helps: list[str]) -> str:
        """The one line for a batch that fits at no micro-batch."""
        fix = f"try {', '.join(helps)}" if helps else "lower --seq-length or use a smaller model"
        return (
            f"a training step at micro-batch 1 needs {size(self.model.peak(1))} on {device}, more "
            f"than the {size((1 - self.margin) * self.budget)} usable of its "
            f"{size(self.budget)} {self.budget_source} ({fix})"
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


GRID_KERNELS = ("cudnn", "sdpa")  # attention on padded grids: their memory grows with padding


def padded_documents(seq_length: int) -> list[int]:
    """A row's document lengths that the grid kernels pad the most: 33 tokens each (a grid
    width of 40, attention_plan.plan.bucket_widths), the rest of the row one document."""
    lengths = [33] * (seq_length // 33)
    return lengths + ([seq_length % 33] if seq_length % 33 else [])


def probe_batch(
    micro_batch: int, seq_length: int, packing: str, document_mask: bool, kernel: str = "varlen"
) -> Batch:
    """A throwaway micro-batch of the run's shape, token 0: full rows (one document each), or
    where the run's attention ``kernel`` pads packed documents into grids, `padded_documents`."""
    x = torch.zeros(micro_batch, seq_length, dtype=torch.long)
    documents = None
    if packing == "pack" and document_mask:
        documents = torch.zeros_like(x)
        if kernel in GRID_KERNELS:
            lengths = torch.tensor(padded_documents(seq_length))
            documents[:] = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    return Batch.of(x, x.clone(), padded=packing == "pad", document_ids=documents)


@dataclass(frozen=True)
class Probe:
    """What one rank's probe found: the peak bytes of each of `PROBES` that fit, in order, and
    the micro-batch that ran out of memory (None: both fit)."""

    peaks: tuple[float, ...]
    out_of_memory: int | None = None

    def model(self, parameters: int) -> MemoryModel:
        """The line through the peaks (one peak: flat), the optimizer's states added."""
        if len(self.peaks) < 2:
            line = MemoryModel(self.peaks[0], 0.0)
        else:
            line = MemoryModel.through(PROBES[0], self.peaks[0], PROBES[1], self.peaks[1])
        return MemoryModel(line.fixed + OPTIMIZER_BYTES * parameters, line.per_sample)


def measure(
    train_model: nn.Module,
    model: nn.Module,
    precision: Precision,
    device: torch.device,
    make_batch: Callable[[int], Batch],
) -> Probe:
    """The CUDA peak of a step's forward and backward at each of `PROBES` (eagerly, through
    ``train_model``), until one runs out of memory. The gradients are dropped after: the probe
    leaves no trace."""
    peaks: list[float] = []
    for m in PROBES:
        batch = make_batch(m).to(device)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        try:
            with torch.compiler.set_stance("force_eager"):
                batch_loss_sum(train_model, batch, precision).backward()
            torch.cuda.synchronize(device)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            return Probe(tuple(peaks), m)
        finally:
            for p in model.parameters():
                p.grad = None
            del batch
        peaks.append(torch.cuda.max_memory_allocated(device))
    return Probe(tuple(peaks))


@dataclass(frozen=True)
class Outcome:
    """One rank's side of the choice: its probe (None: estimated), the model, its budget."""

    probe: Probe | None
    model: MemoryModel
    budget: float
    source: str


def decide(
    outcomes: list[Outcome], per_rank: int, device: torch.device, helps: list[str]
) -> tuple[int, str]:
    """(the micro-batch every rank takes, the banner's line) from every rank's `Outcome`, the
    same on each; a UserError (the same line on each) where a rank fits not even 1."""
    choices = []
    for rank, o in enumerate(outcomes):
        where = f" on rank {rank} of {len(outcomes)}" if len(outcomes) > 1 else ""
        fit = Fit(None, o.model, o.budget, o.source, o.probe is not None)
        if o.probe is not None and o.probe.out_of_memory == 1:
            fix = ", ".join(helps) or "a smaller model"
            raise UserError(
                f"a training step at micro-batch 1 ran out of {device}'s memory in "
                f"--micro-batch-size auto's probe{where} (try {fix})"
            )
        if o.probe is not None and o.probe.out_of_memory is not None:
            fit = replace(fit, micro_batch=1, out_of_memory=o.probe.out_of_memory)
        else:
            chosen = choose_micro_batch(per_rank, o.model, o.budget)
            if chosen is None:
                raise UserError(fit.refusal(device, helps) + where)
            fit = replace(fit, micro_batch=chosen)
        choices.append(fit)
    limiting = min(choices, key=lambda f: f.micro_batch)  # the first rank with the least room
    return limiting.micro_batch, limiting.describe()


def agree(rt: D.Runtime, outcome: Outcome) -> list[Outcome]:
    """Every rank's `Outcome`, on every rank (the CPU group: no rank waits in a device
    collective for one that ran out of memory)."""
    if not rt.multiprocess:
        return [outcome]
    everyone: list = [None] * rt.world_size
    dist.all_gather_object(everyone, outcome, group=rt.cpu_group)
    return everyone


def helping_flags(
    activation_checkpointing: bool, mode: str, seq_length: int, world_size: int = 2
) -> list[str]:
    """The flags that lower a step's memory, less those the run already uses (FSDP only where
    there are processes to shard over)."""
    helps = [] if activation_checkpointing else ["--activation-checkpointing"]
    if mode != "fsdp" and world_size > 1:
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


def fit_micro_batch(rt: D.Runtime, data: TrainData, *model_args: Any) -> str:
    """Set ``data``'s micro-batch to `micro_batch_choice`'s (of ``model_args``) before any batch
    is read; the banner's line. A UserError naming the flags that help, on every rank."""
    try:
        chosen, line = micro_batch_choice(rt, data, *model_args)
    except UserError:
        data.close()
        raise
    data.sampler.set_micro_batch(chosen)
    return line


def micro_batch_choice(
    rt: D.Runtime,
    data: TrainData,
    train_model: nn.Module,
    model: nn.Module,
    precision: Precision,
    activation_checkpointing: bool,
) -> tuple[int, str]:
    """(--micro-batch-size auto's micro-batch for ``model`` at ``data``'s shape, the banner's
    line), the same on every rank (`decide` over every rank's `Outcome`); a UserError, the same
    on every rank, when not even 1 fits. Changes nothing (auto's timing asks it of each size)."""
    budget, source = available_memory(rt.device)
    if budget is None:
        raise UserError(
            f"--micro-batch-size auto: this system does not say how much memory is free (set "
            f"{BUDGET_ENV}, e.g. {BUDGET_ENV}=8GiB, or give --micro-batch-size N)"
        )
    helps = helping_flags(activation_checkpointing, rt.mode, data.seq_length, rt.world_size)
    parameters = local_parameters(model)
    if rt.device.type == "cuda":
        shape = (data.seq_length, data.packing, data.document_mask)
        kernel = backends.current_kernel(rt.device)
        alone = model if rt.mode == "ddp" else train_model  # DDP's hooks: no collective
        probe = measure(
            alone, model, precision, rt.device, lambda m: probe_batch(m, *shape, kernel)
        )
        outcome = Outcome(probe, probe.model(parameters) if probe.peaks else MemoryModel(0, 0),
                          budget, source)  # fmt: skip
        if rt.mode == "fsdp" and probe.out_of_memory is not None:
            decide([outcome], 1, rt.device, helps)  # peers wait in its collectives: end now
            raise UserError(
                f"a training step at micro-batch 2 ran out of {rt.device}'s memory in FSDP's "
                f"probe on rank {rt.rank} of {rt.world_size} (give --micro-batch-size 1)"
            )
    else:
        outcome = Outcome(None, estimate(model.config, data.seq_length, parameters), budget, source)
    per_rank = data.sampler.global_batch // rt.world_size
    return decide(agree(rt, outcome), per_rank, rt.device, helps)
