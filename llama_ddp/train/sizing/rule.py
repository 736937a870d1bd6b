"""--model-size auto's rule: which member of the model family (model/family.py) should reach the
lowest loss in the time left, from the step times measured on this machine (or stated for a
device: `python -m llama_ddp.plan`). Pure: the steps a time holds (``fit``) and a candidate's
step time (``measure``) are given, so tests fake both.

The prediction is law.py's `JOINED`: the project's fit of its own runs where they reach, the
published compute-optimal law (Besiroglu et al. 2024's re-fit of Chinchilla) beyond them,
joined without a jump, repeated data worth less than new. Within the runs, on 2 CPU cores for
minutes, it is the fit alone: a tokens-per-parameter ratio (Chinchilla's 20) is a compute
optimum of 10^8+ parameter models, and here a step's time is not proportional to the
parameters (the lm_head, attention, the optimizer's step and a step's overheads weigh on small
models): at 60 s on 2 CPU cores the tiny preset, at 0.8 tokens per parameter, beat small. On a
GPU node for hours the candidates lie decades beyond the runs, where the published law ranks
them (15-30 tokens a parameter at an H100's throughput, tests/train/sizing/test_scale.py).

The search (`choose`): the smallest candidate first, timed; the step time of a size not yet
timed is estimated from its FLOPs per token (a line through the sizes timed); the size of
least predicted loss and its two neighbours are timed in turn (in order of cost, while the
measuring time allows), until the best is timed and so are its neighbours. Of the sizes timed
the least predicted loss wins; the next is the runner-up.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llama_ddp.errors import UserError
from llama_ddp.model import family
from llama_ddp.train.budget.budget import TIMED_STEPS
from llama_ddp.train.sizing.law import JOINED, Law, Prediction

MEASURE_SHARE = 0.1  # of the time left: the most the candidates' steps may take
MAX_CANDIDATES = 6


@dataclass(frozen=True)
class Size:
    """A family member as auto weighs it."""

    depth: int
    parameters: int  # all of them, a tied embedding once (LlamaConfig.num_parameters)
    non_embedding: int
    matmul: int  # the non-embedding ones and the lm_head: those 6 x of which is a token's FLOPs
    flops: float  # per token, forward and backward: the step time's estimate before it is timed

    @classmethod
    def of(cls, depth: int, vocab_size: int, seq_length: int, tied: bool = False) -> Size:
        """The member of ``depth`` (its parameters as LlamaConfig.num_parameters counts them:
        a ``tied`` embedding once); counted from its shape, not a LlamaConfig, whose building
        checks the shape against this machine's memory (auto weighs members it cannot hold)."""
        shape = family.member_shape(depth)
        c, layers = shape["hidden_size"], shape["num_hidden_layers"]
        kv = shape["num_key_value_heads"] * family.HEAD_DIM
        layer = 2 * c * c + 2 * c * kv + 3 * c * shape["intermediate_size"]
        matmuls = layers * layer + vocab_size * c  # the lm_head's too
        flops = 6 * matmuls + 6 * layers * c * seq_length  # causal attention: half of 12 L C T
        non_embedding = layers * (layer + 2 * c) + c
        embeddings = (1 if tied else 2) * vocab_size * c
        matmul = non_embedding + vocab_size * c
        return cls(depth, non_embedding + embeddings, non_embedding, matmul, flops)


@dataclass(frozen=True)
class Candidate:
    """A size with its step time (measured or estimated) and what it would reach."""

    size: Size
    step_s: float
    measured: bool
    steps: int  # that fit the time left
    tokens: int
    prediction: Prediction

    @property
    def depth(self) -> int:
        return self.size.depth

    @property
    def loss(self) -> float:
        """What ranks it (val bpb on the runs' scale; `Prediction.bpb` says when it is one to
        print)."""
        return self.prediction.loss


@dataclass(frozen=True)
class Choice:
    best: Candidate
    runner_up: Candidate | None
    timed: list[Candidate]
    measuring_s: float  # the seconds the candidates' steps took


def estimate(size: Size, timed: dict[int, tuple[Size, float]]) -> float:
    """A step's seconds for ``size``: measured, or from the sizes timed against their FLOPs per
    token: a line through them (a step's overheads are its intercept), or in proportion to the
    largest where there is one, or where a larger size was timed faster (noise)."""
    if size.depth in timed:
        return timed[size.depth][1]
    points = sorted(timed.values(), key=lambda p: p[0].flops)
    xs, ys = [s.flops for s, _ in points], [t for _, t in points]
    if len(points) > 1:
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        if slope > 0:
            return max(my + slope * (size.flops - mx), 1e-6)
    return ys[-1] * size.flops / xs[-1]


def choose(
    sizes: list[Size],
    measure: Callable[[Size], float | None],
    fit: Callable[[Size, float], int],
    tokens_per_step: int,
    allowance_s: float,
    clock: Callable[[], float],
    share: Callable[[Any], Any] = lambda value: value,
    corpus_tokens: int | None = None,
    law: Law = JOINED,
) -> Choice:
    """The size of ``sizes`` (ascending) of least predicted loss. ``measure(size)``: its step's
    seconds on this machine (None: it does not fit the device), taking 1 + TIMED_STEPS steps,
    the same on every rank; ``fit(size, step_s)``: the steps the time left holds for it;
    ``allowance_s``: the most the timing of the sizes after the first may take, by ``clock``;
    ``share``: rank 0's value on every rank (its decisions: which size to time next, the
    choice); ``corpus_tokens``: a pass over the corpus (None: not known, every token new)."""
    first, timed = clock(), {}
    too_large = math.inf  # the smallest depth that did not fit

    def candidate(size: Size) -> Candidate:
        step_s = estimate(size, timed)
        steps = max(0, fit(size, step_s))
        tokens = steps * tokens_per_step
        predicted = law(size.non_embedding, size.matmul, tokens, corpus_tokens)
        return Candidate(size, step_s, size.depth in timed, steps, tokens, predicted)

    overheads = []  # each timing's seconds beyond its steps: building the model, optimizer

    def time_it(size: Size) -> bool:
        began = clock()
        step_s = measure(size)
        if step_s is None:
            nonlocal too_large
            too_large = min(too_large, size.depth)
            return False
        timed[size.depth] = (size, step_s)
        overheads.append(max(0.0, clock() - began - (1 + TIMED_STEPS) * step_s))
        return True

    def next_size() -> Size | None:
        """The size to time next: of the best predicted and its neighbours, the cheapest not
        yet timed, if the time allows (None: the search is over)."""
        if len(timed) >= MAX_CANDIDATES:
            return None
        usable = [s for s in sizes if s.depth < too_large]
        best = min((candidate(s) for s in usable), key=lambda c: c.loss).size
        i = usable.index(best)
        wanted = [s for s in usable[max(0, i - 1) : i + 2] if s.depth not in timed]
        if not wanted:
            return None
        size = min(wanted, key=lambda s: s.flops)
        # a warm-up step and those timed, and the least overhead seen (the first's holds the
        # process's first step: imports, caches)
        cost = (1 + TIMED_STEPS) * estimate(size, timed) + min(overheads)
        return size if clock() - start + cost <= allowance_s else None

    if not time_it(sizes[0]):
        raise UserError(
            f"the smallest model of the family (depth {sizes[0].depth}) does not fit the device's "
            "memory at this batch (lower --batch-size or --micro-batch-size)"
        )
    start = clock()  # the first step of the process (imports, caches) is the run's anyway
    while (size := share(next_size())) is not None:
        time_it(size)

    def decided() -> Choice:
        ranked = sorted((candidate(timed[d][0]) for d in timed), key=lambda c: c.loss)
        return Choice(ranked[0], ranked[1] if len(ranked) > 1 else None, ranked, clock() - first)

    return share(decided())
