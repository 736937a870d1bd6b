"""loss.py: the summed fp32 cross-entropy of the real targets, the forward under autocast, and
the same computed a chunk of tokens at a time (the logits never whole)."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from llama_ddp.data.batch import Batch
from llama_ddp.model import loss as loss_module
from llama_ddp.model.config import preset
from llama_ddp.model.llama import LlamaForPretraining
from llama_ddp.model.loss import (
    IGNORE_INDEX,
    batch_loss_sum,
    chunk_tokens,
    linear_token_loss_sum,
    token_loss_sum,
)
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
        # The chunked loss reads the same bf16 logits in fp32: equal to the order of fp32 sums.
        assert bf16.item() == pytest.approx(token_loss_sum(logits, batch.labels).item(), rel=1e-6)
        assert bf16.item() != loss.item() and bf16.item() == pytest.approx(loss.item(), rel=0.05)


def test_gpu_chunks_hold_about_as_many_logits_as_the_hidden_states_in_whole_tiles():
    """The GPU's rule (issue 53), unchanged: a function of the device type, no GPU needed."""
    assert chunk_tokens(65536, 768, 8192, "cuda") == 6016  # 11 chunks of 5958 -> 6016 rows
    assert chunk_tokens(8192, 768, 8192, "cuda") == 4096  # 11 of 745 would be under the floor
    assert chunk_tokens(100, 64, 64, "cuda") == 128  # one chunk of all 100, in a whole tile
    assert chunk_tokens(10, 768, 128256, "cuda") == 64
    assert chunk_tokens(65536, 768, 128256, "cuda") == 4096  # not 167 chunks of 393: 16 of 4096
    assert chunk_tokens(3000, 768, 128256, "cuda") == 3008  # fewer tokens than the floor: one


def test_cpu_chunks_hold_8_mib_of_fp32_logits_whatever_the_width():
    """The CPU's rule (issue 59): the logits of a chunk within the last-level cache, no floor of
    4096 rows: 256 rows at a vocabulary of 8192, 512 at make pretrain-small's 4096, 64 from 32768
    up."""
    assert loss_module.CPU_LOGITS_BYTES == 8 * 2**20
    assert chunk_tokens(4096, 64, 8192, "cpu") == 256
    assert chunk_tokens(4096, 768, 8192, "cpu") == 256  # the width does not count
    assert chunk_tokens(4096, 64, 4096, "cpu") == 512
    assert chunk_tokens(4096, 64, 6000, "cpu") == 320  # 349 rows, down to whole tiles
    assert chunk_tokens(65536, 768, 32768, "cpu") == 64
    assert chunk_tokens(65536, 768, 128256, "cpu") == 64  # 16 rows' worth: the 64-row tile
    assert chunk_tokens(100, 64, 8192, "cpu") == 128  # fewer tokens: one chunk, a whole tile
    assert chunk_tokens(8192, 768, 8192, "cuda") == 4096  # the same shape on a GPU


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_chunks_give_cross_entropys_loss_and_gradients_on_the_whole_logits(dtype):
    """The CPU's default chunks (128 rows at this vocabulary: 300 tokens, the last chunk of 44),
    ignored targets among them and logits up to ~±200 (exp of the max-shifted logits alone stays
    finite): the loss and both gradients as F.cross_entropy's on the whole logits, fp32 to 1e-5
    of the largest (the order of fp32 sums: 1.2e-6 seen on an Intel AVX-512 Xeon, whose MKL
    blocks the products otherwise), bf16 autocast within one bf16 step (2^-7: the
    whole path rounds one bf16 weight gradient, the chunks add three in fp32)."""
    torch.manual_seed(0)
    tokens, width, vocab = 300, 16, 16384
    assert chunk_tokens(tokens, width, vocab, "cpu") == 128
    hidden = torch.randn(tokens, width)
    hidden[:20] *= 400  # rows whose logits reach the hundreds
    weight = 0.1 * torch.randn(vocab, width)
    labels = torch.randint(0, vocab, (tokens,))
    labels[::7] = IGNORE_INDEX
    labels[-3:] = IGNORE_INDEX  # in the short last chunk
    results = []
    for chunked in (False, True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            if chunked:
                loss = linear_token_loss_sum(h, w, labels)
            else:
                logits = F.linear(h, w).float()
                loss = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
        loss.backward()
        results.append((loss.item(), h.grad, w.grad))
    (whole, *whole_grads), (chunked, *chunked_grads) = results
    assert chunked == pytest.approx(whole, rel=1e-6 if dtype == torch.float32 else 1e-5)
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7
    for got, expected in zip(chunked_grads, whole_grads):
        assert got.dtype == torch.float32 and torch.isfinite(got).all()
        assert (got - expected).abs().max() <= tolerance * expected.abs().max()
    assert (chunked_grads[0][labels == IGNORE_INDEX] == 0).all()  # their softmax dropped


class _WeightGradientWrites(TorchDispatchMode):
    """Counts the products whose output is a (vocab, hidden) matrix: the weight gradient's."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.count = tuple(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "addmm_") and tuple(out.shape) == self.shape:
            self.count += 1
        return out


@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1000, 8192, 9000])
def test_the_weight_gradient_is_written_once_per_chunk_whatever_the_vocabulary(
    tokens, dtype, device
):
    """A vocabulary 256 times the width (Liger's rule alone: 256 chunks, each writing the whole
    (V, C) gradient: traffic ~ V^2): the weight gradient is written once per chunk of the
    device's rule, the GPU's ceil(tokens / 4096) times, the CPU's once per 1024 tokens (run here
    on the CPU with the GPU's chunks)."""
    torch.manual_seed(0)
    vocab, width = 2048, 8
    hidden = torch.randn(tokens, width, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab, width, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    chunk = chunk_tokens(tokens, width, vocab, device)
    with _WeightGradientWrites(weight.shape) as writes:
        linear_token_loss_sum(hidden, weight, labels, chunk).backward()
    rows = loss_module.WEIGHT_GRAD_ROWS if device == "cuda" else 1024
    assert writes.count == -(-tokens // rows)
    expected = F.linear(hidden.detach().float(), weight.detach().float())
    expected = (
        torch.autograd.grad(token_loss_sum(expected.requires_grad_(), labels), expected)[0].T
        @ hidden.detach().float()
    )
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (weight.grad.float() - expected).abs().max() <= tolerance * expected.abs().max()


@pytest.mark.parametrize("bad", [-1, 96, 1000])
def test_labels_outside_the_vocabulary_are_an_error_as_in_torch(bad):
    """nanoGPT's ignore value -1, or a token the lm_head has no row for: torch's cross_entropy
    refuses both (IndexError 'Target -1 is out of bounds'); so does the model's loss."""
    model = LlamaForPretraining(preset("tiny", vocab_size=96))
    x = torch.randint(0, 96, (2, 8))
    y = torch.randint(0, 96, (2, 8))
    y[1, ::2] = bad
    with pytest.raises(IndexError, match="out of bounds"):
        F.cross_entropy(torch.randn(16, 96), y.flatten())
    with pytest.raises(IndexError, match=f"Target {bad} is out of bounds"):
        model(x, labels=y)
    y[1, ::2] = IGNORE_INDEX
    assert torch.isfinite(model(x, labels=y))


def whole_and_chunked(model, batch, precision, monkeypatch, chunk):
    """(loss, {parameter: gradient}) from today's logits and from the chunked loss."""
    results = []
    for chunked in (False, True):
        model.zero_grad(set_to_none=True)
        if chunked:
            monkeypatch.setattr(loss_module, "chunk_tokens", lambda *shape: chunk)
            loss = batch_loss_sum(model, batch, precision)
        else:
            with precision.autocast():
                logits = model(batch.x, plan=batch.plan)
            loss = token_loss_sum(logits, batch.labels)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((loss.detach(), grads))
    return results


def pad_and_pack_batches() -> dict[str, Batch]:
    """A pad batch (rows of 16, 5, 9 real targets) and a packed one whose documents' first
    tokens are PAD targets too: 48 output rows in each, 30 in the pad one."""
    torch.manual_seed(1)
    x, y = torch.randint(0, 96, (3, 16)), torch.randint(0, 96, (3, 16))
    pad_y = y.clone()
    for row, n in enumerate([16, 5, 9]):
        pad_y[row, n:] = IGNORE_INDEX
    ids = torch.tensor([[0] * 7 + [1] * 9, [0] * 16, [0] * 3 + [1] * 5 + [2] * 8])
    pack_y = y.clone()
    pack_y[0, 6], pack_y[2, 2], pack_y[2, 7] = IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX
    return {
        "pad": Batch.of(x, pad_y, padded=True),
        "pack": Batch.of(x, pack_y, padded=False, document_ids=ids),
    }


@pytest.mark.parametrize("kind", ["pad", "pack"])
@pytest.mark.parametrize("chunk", [8, 10, 48, 1000])  # 30 and 48 rows: divides, or not
def test_the_chunked_loss_and_gradients_equal_the_whole_logits_ones_in_fp32(
    kind, chunk, monkeypatch
):
    """fp32 on the CPU: the same loss and every parameter's gradient to 1e-6 of the largest,
    the order of fp32 sums (the chunks add the lm_head's gradient in another order)."""
    torch.manual_seed(0)
    model = LlamaForPretraining(preset("tiny", vocab_size=96))
    batch = pad_and_pack_batches()[kind]
    (whole, whole_grads), (chunked, chunked_grads) = whole_and_chunked(
        model, batch, Precision(torch.float32, CPU), monkeypatch, chunk
    )
    assert chunked.dtype == torch.float32
    assert chunked.item() == pytest.approx(whole.item(), rel=1e-6)
    for name, grad in whole_grads.items():
        error = (chunked_grads[name] - grad).abs().max().item()
        assert error <= 1e-6 * grad.abs().max().item(), name


def test_the_chunked_loss_under_bf16_autocast_is_within_bf16s_error(monkeypatch):
    """The matmuls in bf16 as the lm_head's under autocast, the softmax in fp32: the loss as
    today's to fp32 sums, the gradients within bf16's rounding of the largest: today's lm_head
    gradient is one bf16 matmul's output, the chunks' are added in fp32, so up to one bf16 step
    (2^-7 of a value) apart."""
    torch.manual_seed(0)
    model = LlamaForPretraining(preset("tiny", vocab_size=96))
    batch = pad_and_pack_batches()["pack"]
    (whole, whole_grads), (chunked, chunked_grads) = whole_and_chunked(
        model, batch, Precision(torch.bfloat16, CPU), monkeypatch, 10
    )
    assert chunked.item() == pytest.approx(whole.item(), rel=1e-5)
    for name, grad in whole_grads.items():
        assert chunked_grads[name].dtype == torch.float32
        error = (chunked_grads[name] - grad).abs().max().item()
        assert error <= 2**-7 * grad.abs().max().item(), name


class Products(TorchDispatchMode):
    """Counts the matrix products run under it (mm, addmm, their in-place and out= forms)."""

    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.__name__.split(".")[0].rstrip("_") in ("mm", "addmm", "matmul", "bmm")
        return func(*args, **(kwargs or {}))


def test_without_gradients_nothing_but_the_loss_is_computed():
    """Evaluation (no_grad) or a frozen lm_head: no gradient is made in the forward for what
    needs none, and the loss is the same; an all-ignored batch scores 0."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(20, 8), torch.randn(30, 8, requires_grad=True)
    labels = torch.randint(0, 30, (20,))
    expected = token_loss_sum(hidden @ weight.T, labels).item()
    with torch.no_grad(), Products() as products:
        assert linear_token_loss_sum(hidden, weight, labels, 7).item() == pytest.approx(expected)
    assert products.count == 3  # each chunk's logits only, though the weight wants gradients
    with Products() as products:
        linear_token_loss_sum(hidden, weight, labels, 7)
    assert products.count == 6  # and each chunk's part of the weight's gradient
    loss = linear_token_loss_sum(hidden, weight, labels, 7)
    saved_h, saved_w = loss.grad_fn.saved_tensors
    assert saved_h is None and saved_w.shape == weight.shape
    ignored = torch.full_like(labels, IGNORE_INDEX)
    assert linear_token_loss_sum(hidden, weight, ignored, 7).item() == 0.0


def test_compiled_chunks_give_eagers_loss_and_gradients_from_one_fused_kernel():
    """Where the run compiles, each chunk's softmax, loss and gradient run through inductor:
    the same loss and gradients as eager (fp32: 1e-6 of the largest; bf16 autocast: the same bf16
    logits, the gradients within one bf16 step), with gradients and (fp32, evaluation's) without,
    over chunks of two sizes (the last one shorter: symbolic sizes, no recompile): two fp32
    graphs, one bf16 (each cold compile ~10 s of CPU)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    hidden, weight = torch.randn(70, 16), torch.randn(96, 16)
    labels = torch.randint(0, 96, (70,))
    labels[::6] = IGNORE_INDEX
    for dtype, tolerance in ((torch.float32, 1e-6), (torch.bfloat16, 2**-7)):
        fp32 = dtype == torch.float32
        results = []
        for backend in (None, "inductor"):
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            with torch.autocast("cpu", dtype=dtype, enabled=not fp32):
                loss = linear_token_loss_sum(h, w, labels, 32, backend=backend)
            loss.backward()
            results.append((loss.item(), h.grad, w.grad))
            if fp32:  # evaluation's graph, without gradients
                with torch.no_grad():
                    scored = linear_token_loss_sum(h, w, labels, 32, backend=backend).item()
                assert scored == pytest.approx(results[0][0], rel=1e-6)  # eager's loss
                if backend is None:
                    assert scored == results[0][0]  # the same eager kernels
                else:
                    assert counters["stats"]["unique_graphs"] == 2  # with gradients, and without
        (eager, *eager_grads), (compiled, *compiled_grads) = results
        assert compiled == pytest.approx(eager, rel=1e-6)
        for got, expected in zip(compiled_grads, eager_grads):
            assert (got - expected).abs().max() <= tolerance * expected.abs().max()
    assert counters["stats"]["unique_graphs"] == 3  # bf16's with gradients


def test_training_puts_the_targets_in_the_plans_order_not_the_hidden_states_in_theirs(
    monkeypatch,
):
    """Packed documents run in the plan's order (grids by width); the loss, a sum, takes the
    targets in that order rather than the (N, C) hidden states back in row-major order: no
    reordering pass forward or backward, the same loss as the logits' (test above)."""
    from llama_ddp.attention_plan import plan as plan_module

    torch.manual_seed(0)
    model = LlamaForPretraining(preset("tiny", vocab_size=96))
    batch = pad_and_pack_batches()["pack"]
    assert batch.plan.order is not None
    reorders = []
    reorder = plan_module._Reorder.apply
    monkeypatch.setattr(
        plan_module._Reorder, "apply", lambda *args: reorders.append(1) or reorder(*args)
    )
    loss = batch_loss_sum(model, batch, Precision(torch.float32, CPU))
    loss.backward()
    assert reorders == []
    logits = model(batch.x, plan=batch.plan)  # the logits themselves: in row-major order
    assert reorders == [1]
    assert token_loss_sum(logits, batch.labels).item() == pytest.approx(loss.item(), rel=1e-6)
