"""attention_plan/plan.py: the attention plan a batch carries, made on the CPU by the loader."""

import torch

from llama_ddp.attention_plan.plan import bucket_widths, plan_attention, segment_lengths


def documents(lengths_by_row: list[list[int]]) -> torch.Tensor:
    """(B, T) document ids, non-decreasing along each row, from each row's document lengths."""
    return torch.stack(
        [
            torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row))
            for row in lengths_by_row
        ]
    )


def test_bucket_widths_round_up_by_at_most_a_quarter_and_never_past_the_row():
    lengths = torch.tensor([1, 16, 17, 20, 21, 33, 64, 65, 100, 129, 200, 256, 257, 1000])
    assert bucket_widths(lengths, 512).tolist() == [
        16, 16, 20, 20, 24, 40, 64, 80, 112, 160, 224, 256, 320, 512,
    ]  # fmt: skip
    every = torch.arange(1, 2049)
    widths = bucket_widths(every, 2048)
    assert (widths >= every).all() and ((widths < 1.25 * every) | (widths == 16)).all()
    for octave in range(5, 12):  # at most 4 attention calls per doubling of the length
        assert len(widths[(every > 2 ** (octave - 1)) & (every <= 2**octave)].unique()) <= 4
    assert bucket_widths(torch.tensor([200, 10]), 150).tolist() == [150, 16]


def test_document_grids_segments_and_the_tokens_order():
    ids = documents([[5, 20, 15], [40]])
    plan = plan_attention((2, 40), document_ids=ids)
    # widths 16, 20, 16, 40; the padded 16s share a grid, which comes first (padded grids
    # first, then full ones, narrowest first); the full 20 and 40 are views of the tokens, which
    # the layers take in grid order
    assert plan.grids.tolist() == [[2, 16, 20], [1, 20, 20], [1, 40, 40]]
    assert plan.index.tolist() == [*range(0, 5), *range(25, 40), *range(5, 25), *range(40, 80)]
    assert plan.slots.tolist() == [*range(0, 5), *range(16, 31)]  # in the padded grids' region
    assert plan.padding.tolist() == [*range(5, 16), 31]
    # the same segments for the varlen kernel, in the same order
    assert plan.cu_seqlens.tolist() == [0, 5, 20, 40, 80] and plan.max_seqlen == 40
    assert plan.cu_seqlens.dtype == torch.int32
    assert plan.positions.tolist() == [*range(5), *range(15), *range(20), *range(40)]
    assert not plan.subset and plan.spans == (80, 5**2 + 20**2 + 15**2 + 40**2)
    x = torch.arange(80.0)[:, None]
    assert torch.equal(plan.restore(plan.tokens(x.view(2, 40, 1))), x)
    # Two padded grids share one region, grid after grid, each run a row of its grid.
    two = plan_attention((2, 40), document_ids=documents([[5, 20, 15], [38, 2]]))
    assert two.grids.tolist() == [[3, 16, 22], [1, 40, 38], [1, 20, 20]]
    assert two.slots.tolist() == [*range(0, 5), *range(16, 31), 32, 33, *range(48, 86)]
    assert len(two.slots) + len(two.padding) == 3 * 16 + 40
    # Whole-row documents: the plain rows, nothing reordered or copied.
    whole = plan_attention((2, 40), document_ids=torch.tensor([[3] * 40, [4] * 40]))
    assert whole.grids.tolist() == [[2, 40, 80]] and whole.index is None and whole.order is None
    assert whole.slots.numel() == whole.padding.numel() == 0
    assert segment_lengths((2, 40), document_ids=ids).tolist() == [5, 20, 15, 40]
    real = torch.arange(40) < torch.tensor([[22], [3]])
    assert segment_lengths((2, 40), real, ids).tolist() == [5, 17, 3]
    assert segment_lengths((2, 40), real).tolist() == [22, 3]
    assert segment_lengths((2, 40)).tolist() == [40, 40]


def test_right_padded_rows_are_one_grid_of_their_real_prefixes():
    real = torch.arange(8) < torch.tensor([[3], [8], [1]])
    plan = plan_attention((3, 8), real)
    assert plan.subset and plan.grids.tolist() == [[3, 8, 12]]
    assert plan.index.tolist() == [0, 1, 2, *range(8, 16), 16]
    assert plan.positions.tolist() == [0, 1, 2, *range(8), 0]
    assert plan.slots.tolist() == plan.index.tolist()
    assert plan.cu_seqlens.tolist() == [0, 3, 11, 12] and plan.max_seqlen == 8
    assert plan.spans == (12, 9 + 64 + 1)


def test_a_plan_moves_once_and_its_grids_stay_on_the_host():
    real = torch.arange(40) < torch.tensor([[40], [33]])
    plan = plan_attention((2, 40), real, documents([[5, 20, 15], [40]]))
    moved = plan.to(torch.device("meta"))  # a device other than the CPU, on any machine
    for name in ("index", "order", "inverse", "positions", "cu_seqlens", "slots", "padding"):
        assert getattr(moved, name).is_meta, name
    assert moved.grids is plan.grids and not moved.grids.is_meta  # read on the host
    assert moved.max_seqlen == 33 and moved.spans == plan.spans and moved.kernel == "sdpa"
    assert plan.to(torch.device("cpu")) is plan


def test_a_plan_of_some_rows_is_the_plan_of_those_rows_alone():
    real = torch.arange(8) < torch.tensor([[3], [8], [6], [8]])
    ids = documents([[2, 6], [5, 3], [8], [1, 1, 6]])
    part, alone = (
        plan_attention((4, 8), real, ids).rows(1, 3),
        plan_attention((2, 8), real[1:3], ids[1:3]),
    )
    for name in ("index", "order", "positions", "cu_seqlens", "grids", "slots", "padding"):
        a, b = getattr(part, name), getattr(alone, name)
        assert (a is None and b is None) or torch.equal(a, b), name
