"""train/sizing/rule.py, --model-size auto's rule, with step times faked: which sizes it times,
and what it chooses on a faster machine, in a tighter budget, on a device a size does not fit,
and on a rank other than 0 (law.py's predictions: test_law.py; the choices at a GPU node's and
this CPU's step times: test_scale.py)."""

import math
from pathlib import Path

import pytest

from llama_ddp.errors import UserError
from llama_ddp.model import family
from llama_ddp.model.config import member
from llama_ddp.train.sizing.law import Law, LossFit
from llama_ddp.train.sizing.rule import Size, choose, estimate

LAW = LossFit(E=1.0, A=400.0, alpha=0.4, B=400.0, beta=0.35)  # not the kept fit: these tests pin it
FIT_ONLY = Law(fit=LAW, largest_n=math.inf, most_tokens=math.inf)  # the search's tests: LAW alone
SIZES = [Size.of(d, 8192, 256) for d in range(1, 25)]
STEP_TOKENS = 16 * 256


class Machine:
    """A fake machine: a step of ``size`` takes ``overhead + size.flops / speed`` seconds, and
    timing one (a warm-up step and two timed) moves the clock by three of them."""

    def __init__(self, speed: float, overhead: float = 0.01) -> None:
        self.speed, self.overhead, self.now, self.timed = speed, overhead, 0.0, []

    def step_s(self, size: Size) -> float:
        return self.overhead + size.flops * STEP_TOKENS / self.speed

    def measure(self, size: Size) -> float:
        self.timed.append(size.depth)
        self.now += 3 * self.step_s(size)
        return self.step_s(size)

    def clock(self) -> float:
        return self.now


def choice(machine: Machine, seconds: float, allowance: float | None = None, **kw):
    def fit(size: Size, step_s: float) -> int:  # the time left after the timing, 5 s kept
        return math.floor((seconds - machine.now - 5.0) / step_s)

    allowance = 0.1 * seconds if allowance is None else allowance
    return choose(SIZES, kw.pop("measure", machine.measure), fit, STEP_TOKENS, allowance,
                  machine.clock, law=FIT_ONLY, **kw)  # fmt: skip


def test_the_law_is_chinchillas_form_in_non_embedding_parameters_and_tokens():
    assert LAW(1e6, 1e8) == pytest.approx(1 + 400 / 1e6**0.4 + 400 / 1e8**0.35)
    assert LAW(1e6, 0) == math.inf
    d3 = Size.of(3, 8192, 256)
    assert (d3.non_embedding, d3.parameters) == (1_180_992, 4_326_720)  # model/config's count


@pytest.mark.parametrize("tied", [False, True])
def test_a_size_counts_its_parameters_as_llamaconfig_does_a_tied_embedding_once(tied):
    for depth in (1, 2, 5, 12):
        size = Size.of(depth, 8192, 256, tied=tied)
        config = member(depth, vocab_size=8192, tie_word_embeddings=tied)
        assert size.parameters == config.num_parameters()
        embeddings = (1 if tied else 2) * 8192 * 64 * depth
        assert size.non_embedding == config.num_parameters() - embeddings
    assert Size.of(1, 8192, 256, tied=True).parameters == 577_728  # 0.58M, not untied's 1.10M
    assert Size.of(1, 8192, 256, tied=True).flops == Size.of(1, 8192, 256).flops  # lm_head kept


def test_a_faster_machine_chooses_a_larger_model():
    depths = [choice(Machine(speed), 600).best.depth for speed in (2e10, 2e11, 2e12)]
    assert depths == sorted(depths) and depths[0] < depths[-1], depths
    assert depths == [3, 4, 5]


def test_a_tighter_budget_chooses_a_smaller_model():
    depths = [choice(Machine(2e11), seconds).best.depth for seconds in (3600, 600, 60)]
    assert depths == [5, 4, 3]


def test_the_chosen_size_and_its_neighbours_are_timed_and_the_runner_up_is_one():
    machine = Machine(2e11)
    chosen = choice(machine, 600)
    assert machine.timed == [1, 3, 4, 5]  # the smallest, then the best and its neighbours
    assert {chosen.best.depth - 1, chosen.best.depth + 1} <= set(machine.timed)
    assert chosen.runner_up.depth in (chosen.best.depth - 1, chosen.best.depth + 1)
    assert chosen.best.loss < chosen.runner_up.loss
    assert [c.depth for c in chosen.timed] == sorted(machine.timed, key=lambda d: [
        c.loss for c in chosen.timed if c.depth == d][0])  # fmt: skip
    assert chosen.best.tokens == chosen.best.steps * STEP_TOKENS
    assert chosen.measuring_s == pytest.approx(machine.now)


def test_the_timing_stops_at_its_allowance():
    """The smallest is always timed (0.25 s here, the process's first step: not counted); the
    next, depth 3, only where the time it is estimated to take (1.22 s) is left of the
    allowance; of the sizes timed the best."""
    first = 3 * Machine(2e11).step_s(SIZES[0])
    for allowance, timed, best in ((1.2, [1], 1), (1.25, [1, 3], 3), (60.0, [1, 3, 4, 5], 4)):
        machine = Machine(2e11)
        chosen = choice(machine, 600, allowance=allowance)
        assert (machine.timed, chosen.best.depth) == (timed, best)
        assert chosen.measuring_s <= first + allowance
    assert chosen.runner_up is not None and choice(Machine(2e11), 600, 0.5).runner_up is None


def test_a_size_that_does_not_fit_the_device_bounds_the_choice():
    machine = Machine(2e12)

    def measure(size: Size) -> float | None:
        return None if size.depth >= 6 else machine.measure(size)

    chosen = choice(machine, 600, measure=measure)
    assert chosen.best.depth == 5 and max(machine.timed) == 5


def test_no_room_for_the_smallest_is_one_line():
    with pytest.raises(UserError, match="the smallest model of the family"):
        choice(Machine(2e11), 600, measure=lambda size: None)


def test_every_rank_takes_rank_0s_sizes_and_choice():
    """Rank 1's clock and timings differ (a slower rank): it times the sizes rank 0 names and
    takes rank 0's choice, which is what `share` gives every rank."""
    shared = []

    def record(value):
        shared.append(value)
        return value

    rank0 = choice(Machine(2e11), 600, share=record)
    replay = iter(shared)
    slow = Machine(2e10)
    rank1 = choice(slow, 600, share=lambda value: next(replay))
    assert rank1 == rank0 and slow.timed == [1, 3, 4, 5]


def test_a_step_not_timed_is_estimated_from_its_flops():
    one = {1: (SIZES[0], 2.0)}
    assert estimate(SIZES[3], one) == pytest.approx(2.0 * SIZES[3].flops / SIZES[0].flops)

    def line(size: Size) -> float:  # a step's overhead (0.5 s) and 1e-9 s a FLOP per token
        return 0.5 + size.flops * 1e-9

    two = {1: (SIZES[0], line(SIZES[0])), 3: (SIZES[2], line(SIZES[2]))}
    assert estimate(SIZES[4], two) == pytest.approx(line(SIZES[4]))
    noisy = {1: (SIZES[0], 2.0), 3: (SIZES[2], 1.0)}  # the larger timed faster: in proportion
    assert estimate(SIZES[4], noisy) == pytest.approx(1.0 * SIZES[4].flops / SIZES[2].flops)


def test_the_largest_member_is_as_big_as_family_py_says():
    assert Size.of(family.MAX_DEPTH, 32768, 2048).parameters == 11_560_030_208
    assert "11.56B parameters at a 32,768 vocabulary" in Path(family.__file__).read_text()
