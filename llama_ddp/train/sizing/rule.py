"""--model-size auto's rule: which member of the model family (model/family.py) should reach the
lowest loss in the time left, from the step times measured on this machine. Pure: the steps a
time holds (``fit``) and a candidate's step time (``measure``) are given, so tests fake both.

The prediction is a fit the project made on its own runs (`LOSS_FIT`, of `FIT_RUNS`):
Chinchilla's form L(N, D) = E + A / N^alpha + B / D^beta with Chinchilla's exponents, N the
non-embedding parameters (Kaplan's count: at these sizes the embedding and lm_head are most of
the parameters, and their count says little of what a model learns), D the tokens trained on,
L the final validation bits per byte of a finished WSD run of `make pretrain`'s recipe; E, A
and B fitted to the runs. A tokens-per-parameter ratio (Chinchilla's 20) is
not used: it is a compute optimum of 10^8+ parameter models; here a step's time is not
proportional to the parameters (the lm_head, attention, the optimizer's step and a step's
overheads weigh on small models), and at 60 s on 2 CPU cores the tiny preset, at 0.8 tokens
per parameter, beat small (the ratio would take the smallest member at every CPU budget); nor
does a ratio rank two sizes by a loss the banner can show.

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


@dataclass(frozen=True)
class LossFit:
    """L(N, D) = E + A / N^alpha + B / D^beta (val bits per byte)."""

    E: float
    A: float
    alpha: float
    B: float
    beta: float

    def __call__(self, non_embedding: float, tokens: float) -> float:
        if tokens <= 0:
            return math.inf
        return self.E + self.A / non_embedding**self.alpha + self.B / tokens**self.beta


ALPHA, BETA = 0.34, 0.28  # Chinchilla's exponents (Hoffmann et al. 2022, approach 3)


def fit_loss(
    points: list[tuple[float, float, float]], alpha: float = ALPHA, beta: float = BETA
) -> LossFit:
    """The LossFit of least squares in log L over ``points`` (N, D, L), its exponents given:
    E, A and B (positive) fitted, from a few starts, the best. A dozen runs over a decade or two
    of N and D do not pin five parameters (set free, E goes to 0 and alpha past 1: a law that
    fits them and says nothing beyond); with Chinchilla's exponents the project's runs set the
    rest."""
    import torch

    n, d, loss = (torch.tensor([p[i] for p in points], dtype=torch.float64) for i in range(3))

    def error(theta: torch.Tensor) -> torch.Tensor:
        pred = theta[0].exp() + theta[1].exp() / n**alpha + theta[2].exp() / d**beta
        return ((pred.log() - loss.log()) ** 2).mean()

    best = None
    for start in ((-1.0, 1.0, 3.0), (0.0, 3.0, 1.0), (-3.0, 0.0, 0.0)):
        theta = torch.tensor(start, dtype=torch.float64, requires_grad=True)
        opt = torch.optim.LBFGS([theta], max_iter=200, line_search_fn="strong_wolfe")

        def closure(theta: torch.Tensor = theta, opt: torch.optim.LBFGS = opt) -> torch.Tensor:
            opt.zero_grad()
            err = error(theta)
            err.backward()
            return err

        for _ in range(3):
            opt.step(closure)
        with torch.no_grad():
            err = float(error(theta))
        if best is None or err < best[0]:
            best = (err, theta.detach().clone())
    e, a, b = (float(x) for x in best[1].exp())
    return LossFit(e, a, alpha, b, beta)


# The runs the fit is made of (`python bench/bench_size.py fit`): (depth, steps, non-embedding
# parameters, tokens trained on, final val bits per byte), each a finished WSD run of `make
# pretrain`'s recipe (the embedded corpus, batch 16 x 256, Muon at the family's lr). Fixed-steps
# runs: their losses do not depend on the machine (runs repeated on a busy and an idle one gave
# the same figures to the last digit).
FIT_RUNS = (
    (1, 40, 53_440, 163_809, 1.8327),
    (1, 150, 53_440, 614_281, 1.5174),
    (1, 600, 53_440, 2_457_101, 1.2301),
    (2, 40, 393_856, 163_809, 1.8165),
    (2, 150, 393_856, 614_281, 1.4745),
    (2, 400, 393_856, 1_638_059, 1.2533),
    (3, 40, 1_180_992, 163_809, 1.8361),
    (3, 150, 1_180_992, 614_281, 1.4685),
    (3, 400, 1_180_992, 1_638_059, 1.238),
    (4, 250, 2_820_352, 1_023_792, 1.3189),
    (5, 40, 5_533_120, 163_809, 1.8494),
    (5, 100, 5_533_120, 409_513, 1.5917),
)
# fit_loss of FIT_RUNS: within 2.6% of every run (rms 1.4% in log L)
LOSS_FIT = LossFit(E=0.5946531012604638, A=2.176178287579798, alpha=ALPHA, B=35.25853454867205,
                   beta=BETA)  # fmt: skip
MEASURE_SHARE = 0.1  # of the time left: the most the candidates' steps may take
MAX_CANDIDATES = 6


@dataclass(frozen=True)
class Size:
    """A family member as auto weighs it."""

    depth: int
    parameters: int
    non_embedding: int
    flops: float  # per token, forward and backward: the step time's estimate before it is timed

    @classmethod
    def of(cls, depth: int, vocab_size: int, seq_length: int) -> Size:
        shape = family.member_shape(depth)
        c, layers = shape["hidden_size"], shape["num_hidden_layers"]
        kv = shape["num_key_value_heads"] * family.HEAD_DIM
        layer = 2 * c * c + 2 * c * kv + 3 * c * shape["intermediate_size"]
        matmuls = layers * layer + vocab_size * c  # the lm_head's too
        flops = 6 * matmuls + 6 * layers * c * seq_length  # causal attention: half of 12 L C T
        non_embedding = layers * (layer + 2 * c) + c
        return cls(depth, non_embedding + 2 * vocab_size * c, non_embedding, flops)


@dataclass(frozen=True)
class Candidate:
    """A size with its step time (measured or estimated) and what it would reach."""

    size: Size
    step_s: float
    measured: bool
    steps: int  # that fit the time left
    tokens: int
    loss: float  # predicted val bits per byte

    @property
    def depth(self) -> int:
        return self.size.depth


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
    loss: LossFit = LOSS_FIT,
) -> Choice:
    """The size of ``sizes`` (ascending) of least predicted loss. ``measure(size)``: its step's
    seconds on this machine (None: it does not fit the device), taking 1 + TIMED_STEPS steps,
    the same on every rank; ``fit(size, step_s)``: the steps the time left holds for it;
    ``allowance_s``: the most the timing of the sizes after the first may take, by ``clock``;
    ``share``: rank 0's value on every rank (its decisions: which size to time next, the
    choice)."""
    first, timed = clock(), {}
    too_large = math.inf  # the smallest depth that did not fit

    def candidate(size: Size) -> Candidate:
        step_s = estimate(size, timed)
        steps = max(0, fit(size, step_s))
        tokens = steps * tokens_per_step
        return Candidate(size, step_s, size.depth in timed, steps, tokens,
                         loss(size.non_embedding, tokens))  # fmt: skip

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
