"""parallelize.py: the wrappers each mode gets, and what DataParallel's replica threads compute
in."""

import contextlib
import re
import threading
from collections.abc import Callable

import pytest
import torch
from torch import nn

from llama_ddp.distributed.parallelize import Autocast, build_model, gradient_sync, parallelize
from llama_ddp.distributed.runtime import Runtime
from llama_ddp.errors import UserError
from llama_ddp.model.config import ModelSettings, preset
from llama_ddp.precision import Precision
from llama_ddp.train.config import TrainConfig

CPU = torch.device("cpu")


class DtypeProbe(nn.Module):
    """Records the autocast dtype its forward runs under, and the dtype of a matmul there."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[torch.dtype, torch.dtype]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((torch.get_autocast_dtype("cpu"), (x @ x).dtype))
        return x


def in_replica_thread(module: nn.Module, x: torch.Tensor) -> None:
    """What torch.nn.parallel.parallel_apply does for each replica: a new thread that re-enters
    autocast with ``enabled=`` only (the dtype is per thread, so the thread's default applies)."""

    def work(enabled: bool) -> None:
        with torch.amp.autocast("cpu", enabled=enabled):
            module(x)

    with torch.autocast("cpu", dtype=torch.float16):  # the run's dtype, in the main thread
        thread = threading.Thread(target=work, args=(torch.is_autocast_enabled("cpu"),))
        thread.start()
        thread.join()


def test_every_replica_thread_computes_in_the_runs_dtype():
    x = torch.randn(8, 8)
    bare, wrapped = DtypeProbe(), DtypeProbe()
    in_replica_thread(bare, x)  # what DataParallel replicated before: the thread's default
    in_replica_thread(Autocast(wrapped, Precision(torch.float16, CPU)), x)
    assert bare.seen == [(torch.bfloat16, torch.bfloat16)]  # the bug: not the run's fp16
    assert wrapped.seen == [(torch.float16, torch.float16)]


def test_data_parallel_replicates_the_autocast_wrapper():
    model = build_model(preset("tiny", vocab_size=64), 0, CPU)
    precision = Precision(torch.bfloat16, CPU)
    wrapped = parallelize(model, Runtime("dp", CPU, replicas=2), precision)
    assert isinstance(wrapped, nn.DataParallel)
    assert isinstance(wrapped.module, Autocast) and wrapped.module.module is model
    assert wrapped.module.precision.dtype == torch.bfloat16
    assert parallelize(model, Runtime("dp", CPU), precision) is model  # 1 device


def test_data_parallel_with_compile_is_refused():
    with pytest.raises(UserError, match="--compile does not work with --mode dp"):
        TrainConfig.from_flags(mode="dp", compile=True).validate()


def test_gradient_sync_is_a_no_op_without_a_process_group():
    """A model no DDP wraps accumulates its micro-steps' gradients as autograd does, whether the
    step syncs or not: nothing to hold back, nothing reduced."""
    model = nn.Linear(4, 3)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    model(x).square().sum().backward()
    once = model.weight.grad.clone()
    for sync in (False, True):
        context = gradient_sync(model, sync)
        assert isinstance(context, contextlib.nullcontext)  # not DDP's no_sync
        with context:
            model(x).square().sum().backward()
    assert torch.allclose(model.weight.grad, 3 * once)


# --- torch.compile, each decoder layer (issue 21) ---------------------------------------------

COMPILED = ["--activation-checkpointing", "--micro-batch-size", "2", "--max-steps", "3"]


def compiled_and_eager(argv: list[str], rt, steps: int = 3) -> tuple[dict, dict]:
    """The weights after ``steps`` steps of a run built from ``argv``, with and without
    --compile."""
    from llama_ddp.train.cli import parse_train_args
    from llama_ddp.train.run import build_trainer

    weights = []
    for extra in ([], ["--compile"]):
        trainer = build_trainer(parse_train_args([*argv, *extra]), rt)
        batches = trainer.data.batches(0)
        for _ in range(steps):
            trainer.step(next(batches))
        weights.append(trainer.checkpointer.parts["model"].full_state_dict())
    return weights[0], weights[1]


def test_compiled_layers_equal_eager_in_one_graph_without_breaks(train_env, tmp_path):
    """--compile compiles each decoder layer whole: with documents kept apart, with padded rows,
    both with activation checkpointing, three steps each give eager's weights (1e-5) from one
    graph (every batch, both layouts: the sizes that change are symbolic) and no graph break."""
    from torch._dynamo.utils import counters

    from llama_ddp.distributed import runtime as D
    from tests.helpers.runs import max_diff, tiny_args

    counters.clear()
    argv = tiny_args(
        train_env, tmp_path, *COMPILED, "--cache-dir", str(train_env["root"] / "cache")
    )
    for packing in ("pack", "pad"):
        eager, compiled = compiled_and_eager(
            [*argv, "--packing", packing], D.setup("single", "cpu")
        )
        assert not [k for k in compiled if "_orig_mod" in k or k.startswith("module.")]
        assert max_diff(compiled, eager) < 1e-5, packing
    assert dict(counters["graph_break"]) == {}
    # The layers' code and the final norm: one graph each, never recompiled; the loss's chunk up
    # to three (a batch's first chunk starts at offset 0, a case of its own; tiny's 64-token
    # chunks match its hidden size, which Dynamo first takes for a static size).
    assert counters["stats"]["unique_graphs"] <= 5


def compiled_ranks(rank: int, port: int, argv: list[str], folder: str) -> None:
    """One of two gloo processes: DDP and FSDP, eager and with --compile (Dynamo and AOTAutograd;
    the aot_eager backend leaves out inductor's code generation, which the single-process test
    pays once), the largest weight difference and the graph breaks into folder/rank{rank}.json."""
    import functools
    import json
    import os
    from pathlib import Path

    from torch._dynamo.utils import counters

    import llama_ddp.distributed.parallelize as P
    from tests.helpers.runs import max_diff

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
    )  # fmt: skip
    torch.set_num_threads(1)
    P.compile_layers = functools.partial(P.compile_layers, backend="aot_eager")
    result = {}
    for mode in ("ddp", "fsdp"):
        rt = P.runtime(mode, "cpu")
        eager, compiled = compiled_and_eager([*argv, "--mode", mode], rt)
        result[mode] = max_diff(compiled, eager) if eager else 0.0  # gathered on rank 0
    result["graph_breaks"] = sum(counters["graph_break"].values())
    Path(folder, f"rank{rank}.json").write_text(json.dumps(result))
    P.D.teardown(rt)


def test_compiled_layers_under_ddp_and_fsdp_equal_eager(train_env, tmp_path):
    """DDP wraps the model whose layers are compiled (its hooks overlap the backward); FSDP
    shards the compiled layers: both give eager's weights, without a graph break."""
    import json

    from tests.helpers.runs import free_port, start_ranks, tiny_args

    argv = tiny_args(
        train_env, tmp_path, *COMPILED, "--cache-dir", str(train_env["root"] / "cache")
    )
    start_ranks(compiled_ranks, (free_port(), argv, str(tmp_path)))
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["graph_breaks"] for r in results] == [0, 0]
    assert results[0]["ddp"] < 1e-5 and results[0]["fsdp"] < 1e-5, results[0]


def graphs_under_ddp(rank: int, port: int, folder: str) -> None:
    """One of two gloo processes: the small preset's layers (each over DDP's 1 MiB first
    bucket) compiled as train.py does, one forward and backward alone, then again wrapped in
    DDP; the graphs the compiler backend was given each time into folder/rank{rank}.json."""
    import functools
    import json
    import os
    from pathlib import Path

    import torch._dynamo

    import llama_ddp.distributed.parallelize as P
    from llama_ddp.data.batch import Batch
    from llama_ddp.model.config import preset
    from llama_ddp.model.llama import LlamaForPretraining
    from llama_ddp.model.loss import batch_loss_sum
    from llama_ddp.precision import Precision

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
    )  # fmt: skip
    torch.set_num_threads(1)
    graphs = []

    def counting(gm, inputs):
        graphs.append(gm)
        return gm.forward

    P.compile_layers = functools.partial(P.compile_layers, backend=counting)
    rt = P.runtime("ddp", "cpu")
    precision = Precision(torch.float32, rt.device)
    x = torch.randint(0, 64, (2, 32))
    counts = {}
    for mode in ("alone", "ddp"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = LlamaForPretraining(preset("small", vocab_size=64))
        if mode == "alone":
            P.compile_layers(model)
            train_model = model
        else:
            train_model = P.parallelize(model, rt, precision, compile=True)
        graphs.clear()
        batch_loss_sum(train_model, Batch.of(x, x.clone(), padded=False), precision).backward()
        counts[mode] = len(graphs)
    Path(folder, f"rank{rank}.json").write_text(json.dumps(counts))
    P.D.teardown(rt)


@pytest.mark.e2e
def test_ddp_does_not_split_the_compiled_layers_graphs(tmp_path):
    """Issue 53, item 5: under DDP with Dynamo's DDPOptimizer on, each of the small preset's
    layer graphs (3 MB of weights, over DDP's 1 MiB first bucket) would be cut in two or more;
    parallelize turns it off: the compiler gets as many graphs as without DDP."""
    import json

    from tests.helpers.runs import free_port, start_ranks

    start_ranks(graphs_under_ddp, (free_port(), str(tmp_path)))
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for counts in results:
        assert counts["ddp"] == counts["alone"] >= 2, counts  # the layers' graph, the norm's


# --- initial weights, each rank its part (issue 21) ---------------------------------------------


def test_the_meta_model_is_free_and_init_gives_the_seeds_weights():
    from llama_ddp.distributed.parallelize import Init, empty_model

    config = preset("tiny", vocab_size=64)
    model = empty_model(config)
    assert all(p.is_meta for p in model.parameters())
    a, b = build_model(config, 3, CPU), build_model(config, 3, CPU)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.lm_head.weight, build_model(config, 4, CPU).lm_head.weight)
    # the rotary tables are the model's own; --init-from's weights are copied as they are
    weights = {k: v for k, v in a.state_dict().items() if "rotary" not in k}
    Init(model, 4, weights).materialize(CPU)
    assert all(
        torch.equal(x, y) for x, y in zip(model.state_dict().values(), a.state_dict().values())
    )


def test_init_from_weights_that_do_not_fit_the_model_is_one_line():
    from llama_ddp.distributed.parallelize import Init, empty_model

    model = empty_model(preset("tiny", vocab_size=64))
    weights = {k: torch.zeros(v.shape) for k, v in model.state_dict().items()}
    for change, problem in (
        (lambda w: w.pop("lm_head.weight"), "it lacks lm_head.weight"),
        (lambda w: w.update(extra=torch.zeros(1)), "it has extra, which the model lacks"),
        (
            lambda w: w.update({"lm_head.weight": torch.zeros(65, 64)}),
            "lm_head.weight is (65, 64) in it, (64, 64) in the model",
        ),
    ):
        bad = dict(weights)
        change(bad)
        with pytest.raises(
            UserError, match=rf"^SRC does not match its config \({re.escape(problem)}\)$"
        ):
            Init(model, 0, bad, "SRC")


def test_a_tied_model_is_materialized_with_one_matrix():
    """Built on the meta device and materialized: a tied model keeps one matrix (to_empty gives
    each module its own tensor; Init ties them again), its embedding drawn as an untied model
    draws it; --init-from weights whose lm_head is not their embedding are refused for it. A run
    from scratch is untied unless --tie-embeddings."""
    from llama_ddp.model.weights import parameter_count

    config = preset("tiny", vocab_size=64, tie_word_embeddings=True)
    model = build_model(config, 0, CPU)
    embedding = model.base_model.embed_tokens.weight
    assert model.lm_head.weight is embedding and not embedding.is_meta
    assert model.num_parameters() == parameter_count(config)
    untied = build_model(preset("tiny", vocab_size=64), 0, CPU)
    assert torch.equal(embedding, untied.base_model.embed_tokens.weight)
    assert not torch.equal(untied.lm_head.weight, untied.base_model.embed_tokens.weight)
    state = untied.state_dict()
    with pytest.raises(UserError, match="has an lm_head other than its embedding"):
        build_model(config, 0, CPU, state)
    head = torch.randn_like(state["base_model.embed_tokens.weight"])
    tied_state = {**state, "base_model.embed_tokens.weight": head, "lm_head.weight": head}
    loaded = build_model(config, 1, CPU, tied_state)
    assert loaded.lm_head.weight is loaded.base_model.embed_tokens.weight
    assert torch.equal(loaded.lm_head.weight, head)
    assert not ModelSettings().tied() and ModelSettings(tie_embeddings=True).tied()
    assert TrainConfig().model_config(64).tie_word_embeddings is False


# --- FSDP gradient accumulation: shards, not whole gradients --------------------------------------


def sharded_grad_ranks(rank: int, port: int, argv: list[str], folder: str) -> None:
    """One of two gloo FSDP processes: the first micro-batch's backward of an accumulating
    optimizer step, then what each parameter's gradient is, into folder/rank{rank}.json."""
    import json
    import os
    from pathlib import Path

    import llama_ddp.distributed.parallelize as P
    from llama_ddp.model.loss import batch_loss_sum
    from llama_ddp.train.cli import parse_train_args
    from llama_ddp.train.run import build_trainer

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
    )  # fmt: skip
    torch.set_num_threads(1)
    rt = P.runtime("fsdp", "cpu")
    trainer = build_trainer(parse_train_args([*argv, "--mode", "fsdp"]), rt)
    first, *rest = next(trainer.data.batches(0))
    assert rest  # an accumulating step: the first micro-batch does not end it
    with gradient_sync(trainer.train_model, False):
        batch_loss_sum(trainer.train_model, first.to(rt.device), trainer.precision).backward()
    grads = {
        name: [type(p.grad).__name__, p.grad.to_local().numel(), p.numel()]
        for name, p in trainer.train_model.named_parameters()
        if p.grad is not None
    }
    count = sum(1 for _ in trainer.train_model.parameters())
    Path(folder, f"rank{rank}.json").write_text(json.dumps({"grads": grads, "count": count}))
    P.D.teardown(rt)


def test_fsdp_accumulates_sharded_gradients_between_micro_batches(train_env, tmp_path):
    """After a micro-batch that does not end the optimizer step, FSDP has reduce-scattered its
    gradients: every parameter holds a sharded gradient (half of it on each of two ranks), not an
    unsharded one held until the last micro-batch (4 bytes per parameter more on every rank)."""
    import json

    from tests.helpers.runs import free_port, start_ranks, tiny_args

    argv = tiny_args(
        train_env, tmp_path, "--micro-batch-size", "2", "--cache-dir",
        str(train_env["root"] / "cache"),
    )  # fmt: skip
    start_ranks(sharded_grad_ranks, (free_port(), argv, str(tmp_path)))
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(result["grads"]) == result["count"] > 0  # every parameter has its gradient
        for kind, local, whole in result["grads"].values():
            assert kind == "DTensor" and local <= -(-whole // 2), (kind, local, whole)


def varied_batches(n: int, vocab: int, seed: int = 0) -> list:
    """``n`` batches whose shapes and documents all differ: packed rows of 1 to 6 documents of
    random lengths (document masking), and right-padded rows of random lengths, trimmed."""
    from llama_ddp.attention_plan.plan import IGNORE_INDEX
    from llama_ddp.data.batch import Batch, trim_padding

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        rows, t = 2 + i % 3, 32
        x = torch.randint(0, vocab, (rows, t), generator=g)
        y = torch.randint(0, vocab, (rows, t), generator=g)
        if i % 2:  # pad mode: each row a document of its own length
            for r in range(rows):
                y[r, int(torch.randint(2, t, (1,), generator=g)) :] = IGNORE_INDEX
            x, y = trim_padding(x, y, multiple=4)
            out.append(Batch.of(x, y, padded=True))
        else:  # pack mode: documents boundaries anywhere
            cuts = [
                sorted(torch.randperm(t - 1, generator=g)[: r % 6].add(1).tolist())
                for r in range(rows)
            ]
            ids = torch.tensor([[sum(p >= c for c in row) for p in range(t)] for row in cuts])
            out.append(Batch.of(x, y, padded=False, document_ids=ids))
    return out


def test_compiled_layers_compile_at_most_twice_over_twenty_varied_batches():
    """Documents' lengths (cu_seqlens, max_seqlen), the token count and the batch's layout change
    with every batch; the compiled layers keep their graph: over 20 such batches (forward and
    backward), Dynamo compiles the layers' code and the final norm at most twice each (the loss's
    chunk three times: see the test above), and the compiled model computes eager's loss."""
    import copy

    from llama_ddp.distributed.parallelize import compile_layers
    from llama_ddp.model.loss import batch_loss_sum

    torch._dynamo.reset()
    graphs = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        names = " ".join(n.name for n in gm.graph.nodes if n.op == "placeholder")
        graphs.append("loss" if "l_h_" in names else "layer" if "self_attn" in names else "norm")
        return gm.forward

    eager = build_model(preset("tiny", vocab_size=64), 0, CPU)
    model = copy.deepcopy(eager)
    compile_layers(model, backend=counting)
    precision = Precision(torch.float32, CPU)
    for batch in varied_batches(20, vocab=64):
        loss = batch_loss_sum(model, batch, precision)
        loss.backward()
        assert torch.allclose(loss, batch_loss_sum(eager, batch, precision), rtol=1e-5)
    # What is compiled: the decoder layers' code (one for all), the final norm, the loss's chunk.
    assert set(graphs) == {"layer", "norm", "loss"}
    assert graphs.count("layer") <= 2 and graphs.count("norm") <= 2 and graphs.count("loss") <= 3
    assert all(p.grad is not None for p in model.parameters())


# --- DDP's gradients as views into its buckets (issue 58, item 6) -----------------------------


def bucket_view_ranks(rank: int, port: int, argv: list[str], folder: str) -> None:
    """One of two gloo processes: three optimizer steps of the trainer under DDP, each of two
    micro-steps (the first under no_sync); after each micro-step's backward, the bytes of
    gradients that lie outside every all-reduce bucket of the previous synced backward (the
    buckets are rebuilt once, after the first step), into folder/rank{rank}.json."""
    import json
    import os
    from pathlib import Path

    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    import llama_ddp.distributed.parallelize as P
    import llama_ddp.train.trainer as T
    from llama_ddp.train.cli import parse_train_args
    from llama_ddp.train.run import build_trainer

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
    )  # fmt: skip
    torch.set_num_threads(1)
    rt = P.runtime("ddp", "cpu")
    trainer = build_trainer(parse_train_args(argv), rt)
    synced: list[list[tuple[int, int]]] = []  # each synced backward's buckets: [start, end)
    seen: list[tuple[int, int]] = []

    def recording(group, bucket):
        buffer = bucket.buffer()
        start = buffer.data_ptr()
        seen.append((start, start + buffer.numel() * buffer.element_size()))
        return allreduce_hook(group, bucket)

    trainer.train_model.register_comm_hook(None, recording)
    outside, grads = [], []
    sync = T.gradient_sync

    @contextlib.contextmanager
    def watched(model, on):
        with sync(model, on):
            yield
        buckets = synced[-1] if synced else []
        kept = [p.grad for p in trainer.model.parameters() if p.grad is not None]
        grads.append(len(kept))
        outside.append(
            sum(
                g.numel() * g.element_size()
                for g in kept
                if not any(a <= g.data_ptr() < b for a, b in buckets)
            )
        )
        if on:
            synced.append(list(seen))
            seen.clear()

    T.gradient_sync = watched
    batches = trainer.data.batches(0)
    for _ in range(3):
        trainer.step(next(batches))
    params = len(list(trainer.model.parameters()))
    result = {"outside": outside, "grads": grads, "params": params}
    Path(folder, f"rank{rank}.json").write_text(json.dumps(result))
    P.D.teardown(rt)


def test_ddp_gradients_are_views_into_its_buckets_during_no_sync_too(train_env, tmp_path):
    """Before: zero_grad(set_to_none=True) gave each backward fresh gradients, which under
    no_sync sat beside the buckets (every byte of them: 4 bytes a parameter more) and which the
    reducer copied into the buckets on the synced micro-step. Now, once the buckets are rebuilt
    (after the first step), every gradient lies inside one after every micro-step."""
    import json

    from tests.helpers.runs import free_port, start_ranks, tiny_args

    argv = tiny_args(
        train_env, tmp_path, "--micro-batch-size", "2", "--batch-size", "8",
        "--cache-dir", str(train_env["root"] / "cache"),
    )  # fmt: skip
    start_ranks(bucket_view_ranks, (free_port(), argv, str(tmp_path)))
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(result["outside"]) == 6, result  # 3 steps of 2 micro-steps
        assert result["grads"][4:] == [result["params"]] * 2, result
        assert result["outside"][4:] == [0, 0], result  # step 3's micro-steps, no_sync's too
