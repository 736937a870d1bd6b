"""train/sizing/law.py, the loss law auto ranks sizes by: the project's fit inside its runs, the
published law (Besiroglu et al. 2024) beyond them, the join between them continuous, repeated
data worth less than new, and what the prediction stands behind."""

import math

import pytest

from llama_ddp.train.sizing.law import (
    FIT_RUNS,
    JOINED,
    LEVEL,
    LOSS_FIT,
    PUBLISHED,
    SCALE,
    calibrate,
    effective_parameters,
    effective_tokens,
    fit_loss,
    fit_parameters,
)
from llama_ddp.train.sizing.rule import Size

LARGEST_N, MOST_TOKENS = 5_533_120, 2_457_101  # FIT_RUNS' d5 and d1 at 600 steps


def test_the_kept_fit_is_the_fit_of_the_kept_runs():
    """LOSS_FIT is fit_loss of FIT_RUNS (bench/bench_size.py fit made both), within 3% of
    every run it was made of."""
    law = fit_loss([(n, d, loss) for _, _, n, d, loss in FIT_RUNS])
    assert len(FIT_RUNS) >= 10
    for depth, _, n, d, loss in FIT_RUNS:
        assert n == Size.of(depth, 8192, 256).non_embedding
        assert fit_parameters(depth, n) == Size.of(depth, 8192, 256).matmul
        assert law(n, d) == pytest.approx(LOSS_FIT(n, d), rel=1e-3)
        assert LOSS_FIT(n, d) == pytest.approx(loss, rel=0.03)


def test_the_published_law_is_mapped_onto_the_runs_scale_and_agrees_with_them():
    """Besiroglu et al.'s constants; LEVEL and SCALE are `calibrate` of FIT_RUNS, and the law so
    mapped is within 5.5% of every run (where the join hands over, the two agree)."""
    assert (PUBLISHED.E, PUBLISHED.A, PUBLISHED.alpha) == (1.82, 482.0, 0.3478)
    assert (PUBLISHED.B, PUBLISHED.beta) == (2085.4, 0.3658)
    assert calibrate() == pytest.approx((LEVEL, SCALE), rel=1e-9)
    for depth, _, n, d, loss in FIT_RUNS:
        mapped = LEVEL + SCALE * PUBLISHED(fit_parameters(depth, n), d)
        assert mapped == pytest.approx(loss, rel=0.055)


def test_inside_the_runs_the_prediction_is_the_fit_and_a_bpb():
    p = JOINED(53_440, 577_728, 1_000_000, None)
    assert (p.source, p.weight, p.beyond()) == ("runs", 1.0, "")
    assert p.loss == p.bpb == LOSS_FIT(53_440, 1_000_000)
    assert p.epochs is None


def test_within_a_decade_a_blend_labelled_beyond_it_the_published_law_and_no_bpb():
    """d1 at 3.9M tokens (10 minutes on 2 CPU cores): 1.59x the most tokens measured, a bpb
    between the two; d12 at 2B tokens: the published law alone, no bpb, its distance said."""
    near = JOINED(53_440, 577_728, 3_900_000, None)
    assert near.source == "blend" and 0.5 < near.weight < 1
    assert near.beyond() == "1.59x the most tokens measured"
    fit, mapped = LOSS_FIT(53_440, 3.9e6), LEVEL + SCALE * PUBLISHED(577_728, 3.9e6)
    assert near.bpb == pytest.approx(near.weight * fit + (1 - near.weight) * mapped)
    d12 = Size.of(12, 8192, 2048)
    far = JOINED(d12.non_embedding, d12.matmul, 2e9, None)
    assert (far.source, far.weight, far.bpb) == ("law", 0.0, None)
    assert far.loss == pytest.approx(LEVEL + SCALE * PUBLISHED(d12.matmul, 2e9))
    assert far.beyond() == "13.4x the largest N measured, 814x the most tokens measured"


@pytest.mark.parametrize("n", [53_440, 1_180_992, LARGEST_N])
def test_the_join_has_no_jump_at_the_seam(n):
    """Across the most tokens measured, and across the largest N, by a relative step of 1e-9:
    the prediction moves by no more than that step's share of it."""
    below = JOINED(n, n + 1_000_000, MOST_TOKENS * (1 - 1e-9), None)
    above = JOINED(n, n + 1_000_000, MOST_TOKENS * (1 + 1e-9), None)
    assert above.loss == pytest.approx(below.loss, rel=1e-8)
    wide = JOINED(LARGEST_N * (1 + 1e-9), LARGEST_N * 3, 1e6, None)
    assert wide.loss == pytest.approx(JOINED(LARGEST_N, LARGEST_N * 3, 1e6, None).loss, rel=1e-8)
    at_band = JOINED(n, n + 1_000_000, MOST_TOKENS * 10, None)
    past = JOINED(n, n + 1_000_000, MOST_TOKENS * 10 * (1 + 1e-9), None)
    assert at_band.weight == past.weight == 0.0 and past.loss == pytest.approx(at_band.loss)


def test_repeated_data_is_worth_less_than_new():
    """Muennighoff et al. 2023: one pass is all new; R repeats of a corpus of U are worth
    U (1 + 15.4 (1 - exp(-R / 15.4))), at most 16.4 U; an unknown corpus: all new."""
    u = 1_000_000
    assert effective_tokens(u, u) == u and effective_tokens(3 * u, None) == 3 * u
    assert effective_tokens(5 * u, u) == pytest.approx(u * (1 + 15.4 * (1 - math.exp(-4 / 15.4))))
    assert effective_tokens(5 * u, u) == pytest.approx(4_522_721, rel=1e-6)
    assert effective_tokens(1e6 * u, u) == pytest.approx(16.4 * u)
    seen = JOINED(53_440, 577_728, 5 * u, u)
    assert seen.effective_tokens == effective_tokens(5 * u, u) and seen.epochs == 5.0
    assert seen.loss > JOINED(53_440, 577_728, 5 * u, None).loss


def test_no_tokens_is_no_prediction():
    p = JOINED(53_440, 577_728, 0, 1_000_000)
    assert p.loss == math.inf and p.bpb is None


def test_parameters_beyond_what_one_pass_feeds_are_worth_less():
    """U_N, the compute-optimal N of one pass of the corpus by the published law's allocation;
    N beyond it worth U_N (1 + 5.309 (1 - exp(-(N / U_N - 1) / 5.309))), at most 6.3 U_N."""
    a, b, big, small = PUBLISHED.alpha, PUBLISHED.beta, PUBLISHED.A, PUBLISHED.B
    g = (a * big / (b * small)) ** (1 / (a + b))
    fed = g * (1e8 * g) ** (b / a)
    assert fed == pytest.approx(3.33e6, rel=0.01)  # 100M tokens feed 3.3M: 30 tokens each
    assert effective_parameters(1e6, 1e8) == 1e6 and effective_parameters(1e9, None) == 1e9
    assert effective_parameters(2 * fed, 1e8) == pytest.approx(
        fed * (1 + 5.309 * (1 - math.exp(-1 / 5.309)))
    )
    assert effective_parameters(1e15, 1e8) == pytest.approx(6.309 * fed)
