"""Greedy tokens of two implementations: the same, except where the model's two best logits tie
within what two fp32 implementations' logits differ by (each may then pick the other)."""

import torch

# Two fp32 implementations of the tiny models (cached and uncached, ours and Hugging Face's or
# llama.cpp's) give logits within 1e-5 of each other: a closer pair may come out either way.
TIE = 2e-5


def tie_gap(logits: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
    """How far below the best of ``logits`` (positions, vocab) lies, at each position, the logit
    of the token ``picks`` (positions,) chose there."""
    return logits.max(-1).values - logits.gather(-1, picks[:, None])[:, 0]


def assert_greedy_agrees(model, prompt: list[int], ours: list[int], theirs: list[int]) -> None:
    """``ours`` and ``theirs`` (greedy tokens after ``prompt``) are equal, or equal up to a token
    where ``model``'s two best logits tie within TIE (the texts then go their own ways)."""
    if ours == theirs:
        return
    i = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    assert i is not None, f"one stopped early: {ours} against {theirs}"
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + ours[:i]]))[0, -1:]
    gap = tie_gap(logits, torch.tensor([theirs[i]]))[0].item()
    assert gap < TIE, f"token {i}: {ours[i]} against {theirs[i]}, {gap:.2e} apart: {ours} {theirs}"
