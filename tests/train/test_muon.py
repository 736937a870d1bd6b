"""train/muon.py: Newton-Schulz orthogonalizes a matrix in the dtype it is given."""

import pytest
import torch

from llama_ddp.train.muon import newton_schulz


@pytest.mark.parametrize("shape", [(96, 32), (32, 96)], ids=["tall", "wide"])
def test_newton_schulz_keeps_the_singular_vectors_and_brings_the_values_near_one(shape):
    """Muon's update is the momentum with its singular values replaced by about 1: five
    quintic iterations take a Gaussian matrix's (spread over 3x) into [0.68, 1.07], in fp32
    when asked, and leave its singular vectors as they were."""
    grad = 3 * torch.randn(shape, generator=torch.Generator().manual_seed(0))
    u, s, vh = torch.linalg.svd(grad, full_matrices=False)
    assert s.max() / s.min() > 3
    x = newton_schulz(grad, torch.float32, steps=5, eps=1e-7)
    assert x.shape == grad.shape and x.dtype == torch.float32
    values = torch.linalg.svdvals(x)
    assert values.min() > 0.65 and values.max() < 1.1
    # In the input's singular bases, the result is diagonal: the same directions, rescaled.
    inner = u.T @ x @ vh.T
    assert torch.allclose(inner, torch.diag(torch.diagonal(inner)), atol=1e-4)
