"""The time budget at cluster scale (train/budget/budget.py): SLURM's end is absolute, whatever
restarts and requeues came before (a fake monotonic clock and a fake Unix time), and the plan is
shared on the CPU (gloo) group, never the default one (NCCL on CUDA: a device sync every step)."""

import functools
import sys

import pytest
import torch
import torch.distributed as dist

from llama_ddp.distributed import runtime as D
from llama_ddp.errors import UserError
from llama_ddp.train.budget import budget as budget_module
from llama_ddp.train.budget.budget import Budget, make_budget
from llama_ddp.train.optim import make_schedule
from tests.helpers.runs import ROOT, free_port
from tests.train.budget.test_budget import LR, MIN_LR, Clock, provisional_schedule

END = 20000.0  # the job's end, a Unix time


def make(text: str, age: float, env: dict | None = None) -> Budget:
    return make_budget(
        text, parameters=1_000_000, exports=1, eval_steps=2.0, warmup=None, decay_fraction=None,
        tokens_per_step=0, age=age, env={"SLURM_JOB_END_TIME": str(END)} if env is None else env,
    )  # fmt: skip


@pytest.fixture
def clocks(monkeypatch):
    """The budget's monotonic clock and its Unix time, both fake: (monotonic, wall)."""
    monotonic, wall = Clock(50.0), Clock(1000.0)
    monkeypatch.setattr(budget_module, "CLOCK", monotonic)
    monkeypatch.setattr(budget_module, "WALL", wall)
    return monotonic, wall


def test_a_slurm_budget_ends_at_the_jobs_end_whatever_ran_before(clocks):
    """Issue 58, item 2: `SLURM_JOB_END_TIME - now` is already the time left, yet the process's
    age and the earlier runs' `budget_spent_s` were taken from it again: 6 s of start-up lost
    twice, and after a torchrun restart 4,006 s of a 18,820 s job counted twice over."""
    monotonic, wall = clocks
    first = make("slurm", age=6.0)
    assert first.left() == END - 180 - 1000  # the start-up is already gone from the time left
    assert first.elapsed() == 6.0 and first.seconds == 6.0 + first.left()
    monotonic.now += 4000.0
    wall.now += 4000.0
    assert first.left() == END - 180 - 5000
    saved = first.state_dict()
    assert saved == {"budget_spent_s": 4006.0}
    # torchrun restarts the workers (or SLURM requeues the job): a new process, 12 s of start-up
    monotonic.now, wall.now = 7.0, 5100.0
    again = make("slurm", age=12.0)
    again.load_state_dict(saved)
    assert again.left() == END - 180 - 5100  # before: 14,720 - 12 - 4,006
    assert again.elapsed() == 4018.0  # still counted, for the record
    schedule = provisional_schedule()
    schedule.saved = make_schedule("wsd", lr=LR, min_lr=MIN_LR, warmup_steps=16, total_steps=900)
    assert again.start(schedule, 400) == []
    assert again.banner().startswith("time budget: the SLURM job's end less 180 s (14720 s left)")
    # a duration is the run's total: the runs before it and its start-up count against it
    duration = make("2h", age=12.0)
    duration.load_state_dict(saved)
    assert duration.left() == 7200 - 4006 - 12


def test_a_slurm_job_near_its_end_is_refused_without_asking_for_a_larger_budget(clocks):
    """Issue 58, item 2: the refusal asked for a larger --time-budget, which slurm cannot take;
    a resumed run was told the runs before it took the budget."""
    monotonic, wall = clocks
    wall.now = END - 180 - 2  # 2 s left
    b = make("slurm", age=3.0)
    b.load_state_dict({"budget_spent_s": 30000.0})  # more than the job: counts for nothing
    schedule = provisional_schedule()
    schedule.saved = make_schedule("wsd", lr=LR, min_lr=MIN_LR, warmup_steps=16, total_steps=900)
    with pytest.raises(UserError) as err:
        b.start(schedule, 400)
    assert str(err.value) == (
        "the SLURM job's time left holds no step: 2 s to its end less 180 s, and the end (the "
        "last evaluation, save and exports) needs about 3 s (resubmit the job with a longer --time)"
    )
    wall.now = END - 100
    with pytest.raises(UserError, match=r"^the SLURM job has 100 s left, no more than the 180 s"):
        make("slurm", age=3.0)


# --------------------------------------------------------------------- the CPU group


def test_the_budget_shares_its_plan_on_the_cpu_group(monkeypatch):
    """Issue 58, item 3: the plan went through `broadcast_object_list` on the default group,
    NCCL on CUDA, which copies a pageable tensor to the device and reads its size back: a sync
    every step on every rank. Now the share names the runtime's gloo group."""
    groups = []

    def broadcast_object_list(box, src=0, group=None, device=None):
        groups.append(group)

    monkeypatch.setattr(dist, "broadcast_object_list", broadcast_object_list)
    cpu = object()
    rt = D.Runtime("ddp", torch.device("cpu"), world_size=2, multiprocess=True, cpu_group=cpu)
    b = Budget(100.0, 0.0, 5.0, clock=Clock(), share=functools.partial(D.broadcast_object, rt=rt))
    b.after_step(1, provisional_schedule().current)
    assert groups == [cpu]


WORKER = """
import functools, json, sys
import torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from llama_ddp.distributed import runtime as D
from llama_ddp.train.budget.budget import Budget
from tests.train.budget.test_budget import Clock, follow, provisional_schedule

rt = D.setup("ddp", "cpu", process_group=True)
used, broadcast = [], dist.broadcast_object_list

def spy(box, src=0, group=None, device=None):
    used.append([dist.get_backend(group), group is rt.cpu_group])
    return broadcast(box, src=src, group=group, device=device)

dist.broadcast_object_list = spy
clock, schedule = Clock(), provisional_schedule()
b = Budget(100.0, 0.0, 5.0, clock=clock, share=functools.partial(D.broadcast_object, rt=rt))
pace = 0.5 * (1 + rt.rank)  # rank 1's clock runs at half speed: rank 0's plan is followed
lines = follow(b, schedule, clock, [(s, 10.0 + pace * s) for s in range(1, 30)])
with open(f"rank{rt.rank}.json", "w") as f:  # a file each: the ranks' stdout lines interleave
    json.dump({"rank": rt.rank, "used": used, "lines": lines,
               "total": schedule.current.total_steps}, f)
D.teardown(rt)
"""


@pytest.mark.e2e
def test_under_torchrun_the_budget_shares_its_plan_on_a_gloo_group(tmp_path):
    """Two CPU ranks under torchrun, whose clocks disagree: every step's share goes through
    broadcast_object_list on runtime.setup's gloo group (not the default group, NCCL on CUDA),
    and both ranks follow rank 0's plans."""
    import json
    import subprocess

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         f"--master_port={free_port()}", str(script), str(ROOT)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = sorted(
        (json.loads(path.read_text()) for path in tmp_path.glob("rank*.json")),
        key=lambda r: r["rank"],
    )
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["used"] == [["gloo", True]] * 29  # one share a step, on the CPU group
    assert ranks[0]["lines"] == ranks[1]["lines"] and ranks[0]["total"] == ranks[1]["total"]
    assert ranks[0]["lines"][0].startswith("time budget: plan: ")


GPU_WORKER = """
import sys
import torch
sys.path.insert(0, sys.argv[1])
from llama_ddp.distributed import runtime as D
from llama_ddp.distributed.parallelize import runtime
from llama_ddp.train.cli import parse_train_args
from llama_ddp.train.run import build_trainer

cfg = parse_train_args(sys.argv[2:])
rt = runtime(cfg.runtime.mode, cfg.runtime.device)
trainer = build_trainer(cfg, rt)
budget, batches, lines = trainer.state.budget, trainer.data.batches(0), []

def step(micro_batches):
    trainer.step(micro_batches)
    plan = budget.after_step(trainer.state.step, trainer.schedule.current)
    if plan is not None:
        trainer.schedule.current = plan.schedule
        lines.append(plan.line)
    D.any_rank(False, rt)

for _ in range(2):  # optimizer state, caches and the allocator warmed up; the plan's first samples
    step(next(batches))
steps = [next(batches) for _ in range(4)]  # the loader's work is not the step's
torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode("error")
try:
    for micro_batches in steps:
        step(micro_batches)
finally:
    torch.cuda.set_sync_debug_mode("default")
assert lines and lines[0].startswith("time budget: plan: "), lines
print("4 budget steps without a synchronization", flush=True)
D.teardown(rt)
"""


@pytest.mark.gpu
@pytest.mark.e2e
def test_budget_steps_under_nccl_never_synchronize(train_env, tmp_path):
    """DDP under torchrun (one process, NCCL) with --time-budget: four steps, each with the
    budget's share of its plan (the first plan among them) and the stop vote, under
    torch.cuda.set_sync_debug_mode("error"). On the default group the share's
    broadcast_object_list copied a pageable tensor to the GPU: an error here."""
    import subprocess

    from tests.helpers.runs import tiny_args

    args = tiny_args(train_env, tmp_path / "run", "--device", "cuda", "--dtype", "bf16")
    at = args.index("--max-steps")
    args = [*args[:at], *args[at + 2 :], "--time-budget", "10m", "--mode", "ddp"]
    args += ["--micro-batch-size", "4", "--no-compile"]
    script = tmp_path / "worker.py"
    script.write_text(GPU_WORKER)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
         str(script), str(ROOT), *args, "--cache-dir", str(train_env["root"] / "cache")],
        env=train_env["env"], capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "4 budget steps without a synchronization" in result.stdout
