"""Whether a run compiles its layers (``--compile`` auto), and why: the start-up line's reason.

On CUDA, fused kernels pay back a compile of seconds within a few steps: on. On the CPU a cold
compile (an empty inductor cache) costs tens of seconds and saves a share of every eager step
that falls with the width (compiling fuses the elementwise work: the norms, SwiGLU, the loss's
softmax; the matmuls, whose share grows with the width, are the same): on where the planned run
is long enough for that share of it to repay the compile three times over (`REPAY`, issue 59),
off for short runs (the tests' tiny ones among them) and wherever the run's length is unknown.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llama_ddp.model.config import LlamaConfig
from llama_ddp.model.llama import flops_per_token

# A cold compile (an empty inductor cache) of the decoder layers, the final norm and the loss's
# chunks, forward and backward: the CPU seconds of a first step over an eager first step's, on a
# 2-core AMD EPYC (BENCHMARKS.md, issue 59): family member d1 ~50 s, d2 ~60 s (one batch of
# make pretrain-small's 16 x 256, bf16 auto). CPU seconds rather than wall: the machine they
# were measured on was shared; on an idle one the wall time is about the same (the compile
# runs on one core, its C++ builds beside it).
COMPILE_S = 40.0
COMPILE_S_PER_LAYER = 10.0
# The share of an eager CPU step compiling saves at width 64 (d1: 1.3x eager tokens/s, issue
# 59, before its faster eager loss; 2.0 against 3.0 CPU seconds a step here, after it),
# falling as 64 / width: the elementwise work it fuses grows as the width, the matmuls as its
# square (the small preset, width 256: 1.04-1.06x, BENCHMARKS.md).
SAVED_AT_WIDTH_64 = 0.23
# Training FLOP/s of an eager CPU step of make pretrain-small's member (d1, 16 x 256 tokens):
# issue 59's 530 ms a step on an idle 2-core AVX2 EPYC in fp32, its loss then the slower one: a
# --max-steps run's planned seconds on the CPU. A faster step (bf16, the new loss, a wider
# member's better use of the products) makes the run shorter than planned, so auto compiles a
# little early there rather than never.
CPU_EAGER_FLOPS = 28e9
# How many times a cold compile's cost the estimated saving must be: --model-size auto compiles
# each candidate it times as well as the run (its timing is the run's step: typically d1 and d2,
# then the size chosen), and the constants above are one machine's, two of them the issue's, not
# measured end to end: at 1x make pretrain-small's recipe (~74 s saved of a ~50-s compile) would
# compile on an estimate within its own error, and `make pretrain`'s 10 minutes would pay three
# compiles for one saving.
REPAY = 3.0


@dataclass(frozen=True)
class PlannedRun:
    """What auto weighs on the CPU: the model's layers and width, and the run's eager training
    time as planned (None: unknown), with ``how`` it is known, for the start-up line."""

    layers: int
    width: int
    seconds: float | None
    how: str = ""

    @classmethod
    def of_steps(cls, config: LlamaConfig, steps: int, batch: int, seq_length: int) -> PlannedRun:
        """A run of ``steps`` steps of ``batch`` x ``seq_length`` tokens at `CPU_EAGER_FLOPS`."""
        step_s = flops_per_token(config, seq_length) * batch * seq_length / CPU_EAGER_FLOPS
        how = f"{steps} steps of ~{step_s:.2g} s"
        return cls(config.num_hidden_layers, config.hidden_size, steps * step_s, how)

    def compile_s(self) -> float:
        """A cold compile's estimated seconds."""
        return COMPILE_S + COMPILE_S_PER_LAYER * self.layers

    def saved_share(self) -> float:
        """The share of the eager run's time compiling saves."""
        return SAVED_AT_WIDTH_64 * min(1.0, 64 / self.width)


def compile_choice(
    asked: bool | None, device: torch.device, mode: str, run: PlannedRun | None = None
) -> tuple[bool, str]:
    """Whether a run compiles its layers, and why: --compile / --no-compile (``asked``) when
    given, else off for DataParallel (its replicas cannot run a compiled module), on for CUDA,
    and on the CPU on where ``run``'s eager time times its `PlannedRun.saved_share` is at least
    `REPAY` times a cold compile's seconds (`PlannedRun.compile_s`)."""
    if asked is not None:
        return asked, "--compile" if asked else "--no-compile"
    if mode == "dp":
        return False, "auto: DataParallel copies the module every step, which breaks a compiled one"
    if device.type == "cuda":
        return True, "auto: on for CUDA, one graph per decoder layer (--no-compile turns it off)"
    if run is None or run.seconds is None:
        return False, "auto: off on the CPU for a run of unknown length (--compile turns it on)"
    cost, saved = run.compile_s(), run.saved_share() * run.seconds
    estimate = (
        f"a cold compile of {run.layers} layer{'s' * (run.layers != 1)} ~{cost:.0f} s, "
        f"saving ~{saved:.0f} s ({run.saved_share():.0%} at width {run.width}) of {run.how}"
    )
    if saved >= REPAY * cost:
        return True, f"auto: on for the CPU: {estimate} (--no-compile turns it off)"
    return False, f"auto: off for the CPU: {estimate} (--compile turns it on)"
