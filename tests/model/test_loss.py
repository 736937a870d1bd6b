"""loss.py: the summed fp32 cross-entropy of the real targets, the forward under autocast."""

import pytest
import torch
import torch.nn.functional as F

from llama_ddp.data.batch import Batch
from llama_ddp.model.config import preset
from llama_ddp.model.llama import LlamaForPretraining
from llama_ddp.model.loss import IGNORE_INDEX, batch_loss_sum, token_loss_sum
from llama_ddp.precision import Precision

CPU = torch.device("cpu")


def test_the_sum_is_torchs_cross_entropy_over_the_real_targets_alone():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, dtype=torch.float64)
    labels = torch.tensor([[3, IGNORE_INDEX, 0, 10, IGNORE_INDEX], [IGNORE_INDEX, 7, 7, 1, 2]])
    real = labels != IGNORE_INDEX
    expected = -logits.log_softmax(-1)[real].gather(1, labels[real][:, None]).sum()
    loss = token_loss_sum(logits, labels)
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(expected.item())
    noisy = logits.clone()
    noisy[~real] = 1e4 * torch.randn_like(noisy[~real])  # what ignored targets' rows hold
    assert token_loss_sum(noisy, labels).item() == loss.item()
    assert token_loss_sum(logits, torch.full_like(labels, IGNORE_INDEX)).item() == 0.0
    rows = logits[real].float()  # the computed rows alone, as pad mode gives them
    assert token_loss_sum(rows, labels[real]).item() == pytest.approx(loss.item())


def test_bf16_logits_are_scored_in_fp32():
    torch.manual_seed(0)
    logits = torch.randn(64, 1000).to(torch.bfloat16)
    labels = torch.randint(0, 1000, (64,))
    ours = token_loss_sum(logits, labels).item()
    assert ours == F.cross_entropy(logits.float(), labels, reduction="sum").item()
    assert ours != F.cross_entropy(logits, labels, reduction="sum").item()  # summed in bf16


def test_a_batch_is_scored_where_the_model_computes_under_the_runs_precision():
    """A pad-mode batch: each row's loss is that of its real prefix alone; bf16 autocast
    changes the forward, not the fp32 scoring."""
    torch.manual_seed(0)
    model = LlamaForPretraining(preset("tiny", vocab_size=64)).eval()
    x = torch.randint(0, 64, (3, 16))
    y = torch.randint(0, 64, (3, 16))
    lengths = [16, 5, 9]
    for row, n in enumerate(lengths):
        y[row, n:] = IGNORE_INDEX
    batch = Batch.of(x, y, padded=True)
    with torch.no_grad():
        loss = batch_loss_sum(model, batch, Precision(torch.float32, CPU))
        alone = sum(
            F.cross_entropy(model(x[row : row + 1, :n])[0], y[row, :n], reduction="sum")
            for row, n in enumerate(lengths)
        )
        assert loss.item() == pytest.approx(alone.item())
        bf16 = batch_loss_sum(model, batch, Precision(torch.bfloat16, CPU))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x, plan=batch.plan)
        assert bf16.dtype == torch.float32
        assert bf16.item() == token_loss_sum(logits, batch.labels).item()
        assert bf16.item() != loss.item() and bf16.item() == pytest.approx(loss.item(), rel=0.05)
