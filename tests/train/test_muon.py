"""muon.py: our step is torch.optim.Muon's (its update, state and format), Newton-Schulz batched
by shape equals it matrix by matrix and runs in the run's precision, the hidden matrices go to
Muon and the rest to AdamW, and ranks that share the work (DDP's mesh, FSDP's DTensors) each
orthogonalize a share and reach one process's update."""

import json

import pytest
import torch

from llama_ddp.model.config import preset
from llama_ddp.model.llama import LlamaForPretraining
from llama_ddp.train import muon as muon_module
from llama_ddp.train.muon import Muon, orthogonalize
from llama_ddp.train.optim import build_optimizer, set_lr

# Wide, tall, square; several of a shape (one stack), one alone; rows that 2 ranks split
# unevenly, and fewer matrices of a shape than ranks.
SHAPES = [(64, 176), (176, 64), (64, 64), (32, 64), (64, 64), (176, 64), (64, 176), (5, 3)]
SHAPES += [(5, 3), (5, 3), (7, 9)]
SETTINGS = dict(lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
NS = torch.optim._muon.DEFAULT_A, torch.optim._muon.DEFAULT_B, torch.optim._muon.DEFAULT_C
# AdamW's step on gradients that differ in their last bits (see the test that uses it).
ADAMW_AFTER_MUON = 5e-6


def native(monkeypatch, answer: bool) -> None:
    """torch's probe of this CPU's bf16 units, answering as told."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: answer)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)


def torchs_step(monkeypatch, optimizer: torch.optim.Muon, dtype: torch.dtype) -> None:
    """torch.optim.Muon's own step, its Newton-Schulz in ``dtype``: torch's code casts with
    ``.bfloat16()``, which in fp32 is made a copy."""
    with monkeypatch.context() as m:
        if dtype == torch.float32:
            m.setattr(torch.Tensor, "bfloat16", lambda self: self.clone())
        optimizer.step()


def stepped(params: list[torch.Tensor], steps: int = 3, seed: int = 1) -> list[list[torch.Tensor]]:
    """The same ``steps`` random gradients for ``params``' shapes."""
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(steps)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_step_is_torchs_muon_step(monkeypatch, dtype):
    """Three steps (decay, Nesterov momentum, match_rms_adamw's lr of each shape) of ours and of
    torch.optim.Muon, Newton-Schulz in the same dtype: in fp32 the weights agree to 1e-6 (only
    the batched products' summation order differs); in bf16 to bf16's rounding (an update of
    RMS 0.2 x lr moves a weight by ~5e-3 a step here; its bf16 rounding, 2^-8, is ~2e-5). The
    state is torch's: one momentum_buffer per matrix, the same values, the same state_dict."""
    torch.manual_seed(0)
    theirs = [torch.randn(s, requires_grad=True) for s in SHAPES]
    ours = [p.detach().clone().requires_grad_() for p in theirs]
    reference, optimizer = (
        torch.optim.Muon(theirs, **SETTINGS),
        Muon(ours, ns_dtype=dtype, **SETTINGS),
    )
    start = [p.detach().clone() for p in theirs]
    for grads in stepped(theirs):
        for params in (theirs, ours):
            for p, g in zip(params, grads):
                p.grad = g.clone()
        torchs_step(monkeypatch, reference, dtype)
        optimizer.step()
    tolerance = 1e-6 if dtype == torch.float32 else 2e-4
    for a, b, p0 in zip(theirs, ours, start):
        assert (a - b).abs().max() < tolerance
        assert (a - p0).abs().max() > 1e-3  # the steps moved it
    assert optimizer.state_dict()["state"].keys() == reference.state_dict()["state"].keys()
    for a, b in zip(theirs, ours):
        (key,) = optimizer.state[b].keys()
        assert key == "momentum_buffer"
        assert torch.equal(reference.state[a][key], optimizer.state[b][key])  # elementwise
    assert optimizer.state_dict()["param_groups"] == reference.state_dict()["param_groups"]


def test_a_step_with_compiled_newton_schulz_is_torchs_muon_step(monkeypatch):
    """Newton-Schulz through torch.compile (one cold compile per stack shape, ~15 s of CPU each:
    one stack of two wide matrices here; the tall ones' transposes are the eager path's, tested
    above, and tests/test_gpu.py compiles a model's every shape) gives torch.optim.Muon's
    weights to 1e-6 in fp32 after three steps, as the eager path does: the fused kernels change
    only the order of fp32 sums."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    theirs = [torch.randn(s, requires_grad=True) for s in [(64, 176), (64, 176)]]
    ours = [p.detach().clone().requires_grad_() for p in theirs]
    reference = torch.optim.Muon(theirs, **SETTINGS)
    optimizer = Muon(ours, ns_dtype=torch.float32, compiled=True, **SETTINGS)
    graphs = counters["stats"]["unique_graphs"]
    for grads in stepped(theirs):
        for params in (theirs, ours):
            for p, g in zip(params, grads):
                p.grad = g.clone()
        torchs_step(monkeypatch, reference, torch.float32)
        optimizer.step()
    assert counters["stats"]["unique_graphs"] - graphs == 1  # one graph for the stack, reused
    for a, b in zip(theirs, ours):
        assert (a - b).abs().max() < 1e-6


def test_batched_newton_schulz_is_each_matrix_alone_and_orthogonalizes():
    """A stack of wide (and of tall) matrices gives each matrix's own result to 1e-6 in fp32;
    its singular values land where Muon's quintic puts them (about 0.7 to 1.2, not the input's
    spread), in bf16 too."""
    torch.manual_seed(0)
    for shape in ((4, 64, 176), (3, 176, 64)):
        stack = torch.randn(shape) * torch.logspace(-2, 1, shape[0]).reshape(-1, 1, 1)
        together = orthogonalize(stack, torch.float32, NS, 5, 1e-7)
        alone = torch.cat([orthogonalize(m[None], torch.float32, NS, 5, 1e-7) for m in stack])
        assert together.shape == stack.shape and (together - alone).abs().max() < 1e-6
        for dtype, result in ((torch.float32, together), (torch.bfloat16, None)):
            result = orthogonalize(stack, dtype, NS, 5, 1e-7) if result is None else result
            assert result.dtype == dtype
            singular = torch.linalg.svdvals(result.float())
            assert singular.min() > 0.6 and singular.max() < 1.25, (dtype, singular)


@pytest.mark.parametrize(
    "run_dtype, native_cpu, expected",
    [
        (torch.float32, True, torch.float32),  # an fp32 run: fp32, exact in every mode
        (torch.float32, False, torch.float32),
        (torch.bfloat16, True, torch.bfloat16),  # torch's choice where bf16 is native
        (torch.bfloat16, False, torch.float32),  # emulated bf16 is many times slower
    ],
)
def test_newton_schulz_follows_the_runs_precision(monkeypatch, run_dtype, native_cpu, expected):
    native(monkeypatch, native_cpu)
    model = LlamaForPretraining(preset("tiny", vocab_size=50))
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.1, name="muon", dtype=run_dtype)
    assert opt.optimizers[0].ns_dtype == expected


@pytest.mark.parametrize("tied", [False, True])
def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(tied):
    model = LlamaForPretraining(preset("tiny", vocab_size=50, tie_word_embeddings=tied))
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.1, name="muon")
    muon, adamw = opt.optimizers
    assert isinstance(muon, Muon) and isinstance(adamw, torch.optim.AdamW)
    assert muon.ns_dtype == torch.float32 and muon.mesh is None  # an fp32 run, one process
    names = {id(p): n for n, p in model.named_parameters()}
    (matrices,) = muon.param_groups
    projections = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    kinds = sorted(names[id(p)].split(".")[-2] for p in matrices["params"])
    assert kinds == sorted(list(projections) * model.config.num_hidden_layers)
    assert matrices["adjust_lr_fn"] == "match_rms_adamw" and matrices["weight_decay"] == 0.1
    assert matrices["momentum"] == 0.95 and matrices["nesterov"]
    decay, no_decay = adamw.param_groups
    expected = {"base_model.embed_tokens.weight"} | ({"lm_head.weight"} if not tied else set())
    assert {names[id(p)] for p in decay["params"]} == expected and decay["weight_decay"] == 0.1
    assert all(names[id(p)].endswith("norm.weight") for p in no_decay["params"])
    everything = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(everything) == sorted(id(p) for p in model.parameters())  # each once
    set_lr(opt, 5e-4)  # the schedule sets one lr for both halves
    assert [g["lr"] for g in opt.param_groups] == [5e-4] * 3


def test_a_muon_step_is_torchs_muon_and_adamw_stepped_apart(monkeypatch):
    """The model's optimizer (an fp32 run) is torch.optim.Muon on the hidden matrices (its
    Newton-Schulz in fp32) and torch's AdamW on the rest, stepped apart. The first step's AdamW
    half is the same kernels on the same gradients: equal to the bit. Its hidden matrices agree
    to 1e-6 (batched products against one matrix at a time: on an Intel CPU, MKL's batched and
    single kernels differ by ~1e-7). So the second step's gradients differ in their last bits
    and its AdamW half agrees to ADAMW_AFTER_MUON (a 1e-7 difference in the hidden matrices
    moves it by ~3e-7 here; betas (0.95, 0.99) instead of (0.9, 0.99) move it by 2.7e-5)."""
    torch.manual_seed(0)
    model = LlamaForPretraining(preset("tiny", vocab_size=50))
    twin = LlamaForPretraining(preset("tiny", vocab_size=50))
    twin.load_state_dict(model.state_dict())
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.1, name="muon")
    hidden = [p for n, p in twin.named_parameters() if ".layers." in n and p.dim() == 2]
    rest = [p for n, p in twin.named_parameters() if not (".layers." in n and p.dim() == 2)]
    muon = torch.optim.Muon(hidden, lr=1e-3, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(
        [{"params": [p for p in rest if p.dim() == 2], "weight_decay": 0.1},
         {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
        lr=1e-3, betas=(0.9, 0.99), eps=1e-8, foreach=True,
    )  # fmt: skip
    ids = torch.randint(0, 50, (2, 12))
    names = [n for n, _ in model.named_parameters()]
    for step in range(2):
        for m in (model, twin):
            m(ids).logsumexp(-1).mean().backward()
        opt.step()
        torchs_step(monkeypatch, muon, torch.float32)
        adamw.step()
        opt.zero_grad()
        twin.zero_grad()
        for name, a, b in zip(names, model.parameters(), twin.parameters()):
            if ".layers." in name and a.dim() == 2:
                assert (a - b).abs().max() < 1e-6, (step, name)
            elif step == 0:
                assert torch.equal(a, b), name  # the same AdamW kernels on equal gradients
            else:  # gradients of hidden matrices that two implementations stepped
                assert (a - b).abs().max() < ADAMW_AFTER_MUON, name


def test_the_checkpoint_holds_torchs_muon_state_by_parameter_name():
    """What a checkpoint saves of Muon (checkpoint.state.OptimizerState, DCP's optimizer state
    dict): a momentum_buffer per hidden matrix keyed by its name, which torch.optim.Muon itself
    loads, and which loads back into ours exactly."""
    from llama_ddp.checkpoint.state import OptimizerState

    torch.manual_seed(0)
    model = LlamaForPretraining(preset("tiny", vocab_size=50))
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.1, name="muon")
    model(torch.randint(0, 50, (2, 12))).logsumexp(-1).mean().backward()
    opt.step()
    saved = OptimizerState(model, opt).state_dict()
    hidden = {n for n, p in model.named_parameters() if ".layers." in n and p.dim() == 2}
    muon_state = {k: v for k, v in saved["state"].items() if k in hidden}
    assert muon_state.keys() == hidden
    assert all(set(v) == {"momentum_buffer"} for v in muon_state.values())
    twin = LlamaForPretraining(preset("tiny", vocab_size=50))
    twin.load_state_dict(model.state_dict())
    theirs = torch.optim.Muon([p for n, p in twin.named_parameters() if n in hidden])
    fresh = build_optimizer(twin, lr=1e-3, weight_decay=0.1, name="muon")
    fresh.optimizers = (theirs, fresh.optimizers[1])  # torch's Muon where ours was
    OptimizerState(twin, fresh).load_state_dict(saved)
    names = {p: n for n, p in twin.named_parameters()}
    for p, state in theirs.state.items():
        assert torch.equal(state["momentum_buffer"], muon_state[names[p]]["momentum_buffer"])
    again = build_optimizer(model, lr=1e-3, weight_decay=0.1, name="muon")
    OptimizerState(model, again).load_state_dict(saved)
    assert all(
        torch.equal(again.optimizers[0].state[p]["momentum_buffer"], s["momentum_buffer"])
        for p, s in opt.optimizers[0].state.items()
    )


def shared_ranks(rank: int, port: int, folder: str) -> None:
    """One of two gloo processes: `SHAPES` stepped three times by one process's Muon, by Muon
    sharing the work over DDP's mesh, and by Muon on row-sharded DTensors (FSDP2's layout), with
    Newton-Schulz in fp32 and in bf16; the largest differences, the momentum's layout, the
    matrices this rank orthogonalized and the mesh `replica_mesh` finds for a DDP module into
    folder/rank{rank}.json."""
    import os
    from pathlib import Path

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.nn.parallel import DistributedDataParallel

    from llama_ddp.distributed.parallelize import replica_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2,))
    counted: list[int] = []
    whole = muon_module.orthogonalize

    def counting(stack, *args):
        counted.append(len(stack))
        return whole(stack, *args)

    def compare(dtype: torch.dtype) -> dict:
        torch.manual_seed(0)
        start = [torch.randn(s) for s in SHAPES]
        single = [p.clone().requires_grad_() for p in start]
        replicated = [p.clone().requires_grad_() for p in start]
        sharded = [torch.nn.Parameter(distribute_tensor(p, mesh, [Shard(0)])) for p in start]
        optimizers = {
            "single": Muon(single, ns_dtype=dtype, **SETTINGS),
            "ddp": Muon(replicated, ns_dtype=dtype, mesh=mesh, **SETTINGS),
            "fsdp": Muon(sharded, ns_dtype=dtype, **SETTINGS),
        }
        work = {}
        for grads in stepped(start):
            for p, q, r, g in zip(single, replicated, sharded, grads):
                p.grad, q.grad = g.clone(), g.clone()
                r.grad = distribute_tensor(g, mesh, [Shard(0)])
            for name, opt in optimizers.items():
                counted.clear()
                muon_module.orthogonalize = counting
                opt.step()
                muon_module.orthogonalize = whole
                work[name] = sum(counted)
        full = [p.full_tensor() for p in sharded]
        buffers = [optimizers["fsdp"].state[p]["momentum_buffer"] for p in sharded]
        assert all(isinstance(b, DTensor) for b in buffers)
        ours = [optimizers["single"].state[p]["momentum_buffer"] for p in single]
        return {
            "ddp": max((a - b).abs().max().item() for a, b in zip(single, replicated)),
            "fsdp": max((a - b).abs().max().item() for a, b in zip(single, full)),
            "moved": min((a - b).abs().max().item() for a, b in zip(single, start)),
            "buffers": sorted({f"{type(b).__name__} {b.placements}" for b in buffers}),
            "buffer_diff": max(
                (b.full_tensor() - o).abs().max().item() for b, o in zip(buffers, ours)
            ),
            "work": work,
        }

    result = {"fp32": compare(torch.float32), "bf16": compare(torch.bfloat16)}
    ddp = DistributedDataParallel(torch.nn.Linear(3, 3))
    result["replica_mesh"] = [replica_mesh(ddp).size(), replica_mesh(ddp.module)]
    Path(folder, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def test_ranks_share_the_orthogonalizations_and_reach_one_processs_update(tmp_path):
    """Under DDP (whole gradients on every rank) and FSDP2 (row shards, uneven ones included),
    each of 2 ranks orthogonalizes about half of each shape's matrices, and the weights after
    three steps are one process's to 1e-6 in fp32, to bf16's rounding in bf16 (smaller stacks
    may sum in another order); FSDP's momentum stays sharded like its parameter (what DCP saves
    and reshards), equal to one process's."""
    from tests.helpers.runs import free_port, start_ranks

    start_ranks(shared_ranks, (free_port(), str(tmp_path)))
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    counts = {shape: SHAPES.count(shape) for shape in SHAPES}
    shares = [sum(-(-n // 2) for n in counts.values()), sum(n // 2 for n in counts.values())]
    for dtype, tolerance in (("fp32", 1e-6), ("bf16", 2e-4)):
        for r in (result[dtype] for result in results):
            assert r["ddp"] < tolerance and r["fsdp"] < tolerance, (dtype, r)
            assert r["buffer_diff"] < 1e-6 and r["moved"] > 1e-3, (dtype, r)
            assert r["buffers"] == ["DTensor (Shard(dim=0),)"]
            assert r["work"]["single"] == len(SHAPES)  # every matrix, in one stack per shape
        for mode in ("ddp", "fsdp"):  # a rank: half of each shape's stack (rounded up or down)
            assert sorted(r[dtype]["work"][mode] for r in results) == sorted(shares), mode
    assert [r["replica_mesh"] for r in results] == [[2, None]] * 2  # run.py's: DDP's ranks
