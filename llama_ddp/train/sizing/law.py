"""The loss law --model-size auto ranks sizes by (`JOINED`, asked by rule.py's `choose`): the
project's own fit where its measured runs reach, a published compute-optimal law beyond them,
joined without a jump; repeated data counted as worth less than new. Pure.

- **The project's fit** (`LOSS_FIT`, of `FIT_RUNS`): Chinchilla's form L(N, D) = E + A / N^alpha
  + B / D^beta with Chinchilla's exponents, N the *non-embedding* parameters (Kaplan's count: at
  these sizes the embedding and lm_head are most of the parameters, and their count says little
  of what a model learns), D the tokens trained on, L the final validation bits per byte of a
  finished WSD run of `make pretrain`'s recipe; E, A and B fitted to 12 runs of depths 1-5
  (at most 5.5M non-embedding parameters) and at most 2.5M tokens.
- **The published law** (`PUBLISHED`): Besiroglu et al. 2024 ("Chinchilla Scaling: A
  replication attempt"), Chinchilla's approach 3 re-fitted to Hoffmann et al.'s own data: E
  1.82, A 482.0, alpha 0.3478, B 2085.4, beta 0.3658 in nats per token, D the tokens. Chinchilla
  counted N as all the parameters; here N is the parameters of the model's matmuls, all but the
  input embedding (`Size.matmul`: the non-embedding ones and the lm_head; a tied model's are
  all its parameters). The law's compute-optimal allocation rests on a step costing 6 N D FLOPs,
  and these are the parameters a token's FLOPs are 6x of (`Size.flops`); the input embedding is
  a lookup that costs nothing, and at this family's widths with a large vocabulary it is most
  of the count (depth 6 at 50,257 tokens: 81%): counted as parameters of full worth it tilts the
  choice to models that are mostly a table (49 tokens a parameter on an A100 for an hour at that
  vocabulary, against 19 with this count; at 8,192 tokens the two choose alike). Chosen over
  Chinchilla's own approach-3 fit (E 1.69, A 406.4, B 410.7, alpha 0.34, beta 0.28), whose
  allocation disagrees with Chinchilla's approaches 1 and 2 and which the re-fit shows was a
  failed optimisation of the same data (the re-fit's optimum, about 20 tokens a parameter,
  agrees with them); and over nanochat's tokens:parameters ratio, which ranks no two sizes by a
  loss and so cannot be joined to the project's fit (nor be checked against its runs). Mapped
  onto the project's scale by `LEVEL + SCALE * L` (least squares over `FIT_RUNS`), it is within
  5.5% of every run, LOSS_FIT within 2.6%: the two agree where they meet.
- **The join**: a candidate's distance beyond the measured runs is ``delta``, the larger of
  log10(N / the largest N measured) and log10(D' / the most tokens measured) (0 inside). The
  prediction is ``w * LOSS_FIT + (1 - w) * (LEVEL + SCALE * PUBLISHED)``, w going from 1 at
  delta 0 to 0 at `BAND` decades by a smoothstep: continuous in N and D, so the choice does not
  jump at the seam; far beyond, the ranking is the published law's (an increasing map of it).
  Below the fewest tokens measured (0.16M, a few dozen steps) the fit rules: no published law
  reaches there either.
- **Repeated data** (Muennighoff et al. 2023, "Scaling Data-Constrained Language Models"): D
  tokens of a corpus of U are worth D' = U + U R* (1 - exp(-R / R*)) new ones, R = D / U - 1
  the repeats, R* = 15.4 (`effective_tokens`); in the published law's term, parameters beyond
  U_N, the compute-optimal N of one pass, are worth less alike: R_N = N / U_N - 1, R*_N = 5.309
  (`effective_parameters`), so a small corpus takes more passes of a smaller model, as their
  paper found. An unknown corpus (None) counts every token as new.

**What it can stand behind** (`Prediction.bpb`): inside the runs a val bpb (the runs' fit);
within `BAND` of them a val bpb labelled as an extrapolation; beyond, no bpb at all: the
published law's level on this corpus and tokenizer is a guess (its mapping was made on runs of
a few million parameters), while its ranking of sizes at a given compute is what it was fitted
to give. The banner then says the ranking's basis and how far beyond the runs it reaches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llama_ddp.model import family


@dataclass(frozen=True)
class LossFit:
    """L(N, D) = E + A / N^alpha + B / D^beta."""

    E: float
    A: float
    alpha: float
    B: float
    beta: float

    def __call__(self, n: float, tokens: float) -> float:
        if tokens <= 0:
            return math.inf
        return self.E + self.A / n**self.alpha + self.B / tokens**self.beta


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
# pretrain`'s recipe (the embedded corpus, one pass of it 2.69M tokens, never repeated here; the
# repository's 8192-token tokenizer; batch 16 x 256, Muon at the family's lr). Fixed-steps
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
FIT_VOCAB = 8192  # the runs' tokenizer: their N as the published law counts it
# fit_loss of FIT_RUNS: within 2.6% of every run (rms 1.4% in log L)
LOSS_FIT = LossFit(E=0.5946531012604638, A=2.176178287579798, alpha=ALPHA, B=35.25853454867205,
                   beta=BETA)  # fmt: skip
PUBLISHED = LossFit(E=1.82, A=482.0, alpha=0.3478, B=2085.4, beta=0.3658)  # Besiroglu et al.
# `calibrate` of FIT_RUNS: PUBLISHED (nats/token) on the runs' val bpb scale
LEVEL, SCALE = 0.6472008457203581, 0.03870205378721417
BAND = 1.0  # decades beyond the runs over which the fit hands over to the published law
REPEATS_HALF_LIFE = 15.4  # Muennighoff et al.'s R*_D: repeats past which one is worth 1/e of new
EXCESS_HALF_LIFE = 5.309  # their R*_N: the same for parameters beyond what the corpus can feed


def fit_parameters(depth: int, non_embedding: int) -> int:
    """A run of FIT_RUNS's N as the published law counts it: its matmuls' parameters, the
    non-embedding ones and the lm_head."""
    return non_embedding + FIT_VOCAB * family.WIDTH_PER_LAYER * depth


def calibrate(runs=FIT_RUNS, published: LossFit = PUBLISHED) -> tuple[float, float]:
    """(level, scale) of least squares: run's val bpb ~ level + scale x ``published``(its
    matmuls' parameters, its tokens)."""
    xs = [published(fit_parameters(depth, n), d) for depth, _, n, d, _ in runs]
    ys = [loss for *_, loss in runs]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    scale = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - scale * mx, scale


def effective_tokens(tokens: float, corpus_tokens: float | None) -> float:
    """What ``tokens`` trained on a corpus of ``corpus_tokens`` are worth in new ones
    (Muennighoff et al. 2023; None: unknown, all new)."""
    if not corpus_tokens or tokens <= corpus_tokens:
        return tokens
    return _decayed(corpus_tokens, tokens / corpus_tokens - 1, REPEATS_HALF_LIFE)


def _decayed(unique: float, excess: float, half_life: float) -> float:
    return unique + unique * half_life * (1 - math.exp(-excess / half_life))


def effective_parameters(n: float, corpus_tokens: float | None, law: LossFit = PUBLISHED) -> float:
    """What ``n`` parameters are worth on a corpus of ``corpus_tokens`` (Muennighoff et al.
    2023): those beyond the compute-optimal N of one pass of it (by ``law``'s allocation) are
    worth less, as repeated tokens are (None: unknown, all of them)."""
    if not corpus_tokens:
        return n
    a, b = law.alpha, law.beta
    g = (a * law.A / (b * law.B)) ** (1 / (a + b))  # N_opt = g (C/6)^(b/(a+b)), D_opt its twin
    fed = g * (corpus_tokens * g) ** (b / a)  # the N whose optimal tokens are one pass
    return n if n <= fed else _decayed(fed, n / fed - 1, EXCESS_HALF_LIFE)


@dataclass(frozen=True)
class Prediction:
    """What a size would reach: ``loss`` ranks (val bpb on the runs' scale), ``weight`` is the
    project's fit's share of it, ``n_times`` and ``d_times`` the candidate's N and D' against
    the largest measured, ``epochs`` the passes over the corpus (None: its size unknown)."""

    loss: float
    weight: float
    n_times: float
    d_times: float
    effective_tokens: float
    epochs: float | None

    @property
    def source(self) -> str:
        """``runs`` (inside the measured runs), ``blend`` (within BAND of them) or ``law``."""
        if self.weight >= 1.0:
            return "runs"
        return "blend" if self.weight > 0.0 else "law"

    @property
    def bpb(self) -> float | None:
        """The val bpb it stands behind: none beyond the runs' band, none for no tokens."""
        return self.loss if self.source != "law" and math.isfinite(self.loss) else None

    def beyond(self) -> str:
        """How far beyond the measured runs, in words ('' inside them)."""
        parts = [f"{_times(self.n_times)} the largest N measured"] if self.n_times > 1 else []
        if self.d_times > 1:
            parts.append(f"{_times(self.d_times)} the most tokens measured")
        return ", ".join(parts)


def _times(x: float) -> str:
    return f"{x:.3g}x" if x < 1000 else f"{x:,.0f}x"


def _smoothstep(x: float) -> float:
    x = min(max(x, 0.0), 1.0)
    return x * x * (3 - 2 * x)


@dataclass(frozen=True)
class Law:
    """The joined law (see the module's docstring): ``fit`` up to ``largest_n`` non-embedding
    parameters and ``most_tokens`` tokens, ``published`` (as ``level + scale * L``) beyond."""

    fit: LossFit = LOSS_FIT
    published: LossFit = PUBLISHED
    level: float = LEVEL
    scale: float = SCALE
    largest_n: float = float(max(run[2] for run in FIT_RUNS))
    most_tokens: float = float(max(run[3] for run in FIT_RUNS))
    band: float = BAND

    def __call__(
        self, non_embedding: int, matmul: int, tokens: float, corpus_tokens: float | None
    ) -> Prediction:
        """The prediction for a model of ``non_embedding`` parameters (the fit's N) and
        ``matmul`` (the published law's) trained on ``tokens`` of a corpus of
        ``corpus_tokens``."""
        seen = effective_tokens(tokens, corpus_tokens)
        epochs = None if not corpus_tokens else tokens / corpus_tokens
        n_times, d_times = non_embedding / self.largest_n, seen / self.most_tokens
        if seen <= 0:
            return Prediction(math.inf, 1.0, n_times, 0.0, 0.0, epochs)
        delta = math.log10(max(1.0, n_times, d_times))
        weight = 1.0 - _smoothstep(delta / self.band) if self.band > 0 else float(delta == 0)
        ours = self.fit(non_embedding, seen) if weight > 0 else 0.0
        worth = effective_parameters(matmul, corpus_tokens, self.published)
        theirs = self.level + self.scale * self.published(worth, seen) if weight < 1 else 0.0
        loss = weight * ours + (1 - weight) * theirs
        return Prediction(loss, weight, n_times, d_times, seen, epochs)


JOINED = Law()
