"""``python -m llama_ddp.plot`` (``llama-ddp-plot``): draw a run's curves from metrics.jsonl into
a PNG: loss and validation loss (one line per source of a mixture), the accuracies of the
downstream tasks (``--eval-tasks``) when there are any, learning rate.

    python -m llama_ddp.plot out/metrics.jsonl            # writes out/curves.png

Needs matplotlib (``pip install llama_ddp[plot]``).
"""

from __future__ import annotations

from pathlib import Path

from llama_ddp.errors import ArgumentParser, UserError, exit_command, run_command
from llama_ddp.files import safe_io
from llama_ddp.train.metrics import read_metrics


def loss_curves(train: list[dict], evals: list[dict]) -> dict[str, tuple[list, list]]:
    """The loss panel's lines, by label: training loss, validation loss and, for a mixture of
    sources, one validation line per source."""
    curves = {"train loss": ([r["step"] for r in train], [r["loss"] for r in train])}
    val = [r for r in evals if "val_loss" in r]
    if val:
        curves["validation loss"] = ([r["step"] for r in val], [r["val_loss"] for r in val])
    names = dict.fromkeys(n for r in evals for n in r.get("val_loss_by_source", {}))
    for name in names:
        by_source = [(r["step"], r.get("val_loss_by_source", {})) for r in evals]
        points = [(step, losses[name]) for step, losses in by_source if name in losses]
        curves[f"validation loss: {name}"] = ([s for s, _ in points], [v for _, v in points])
    return curves


def task_curves(evals: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    """ "<task> acc" and "<task> acc_norm" -> (steps, values) from the evaluations' "tasks"."""
    curves: dict[str, tuple[list[int], list[float]]] = {}
    for record in evals:
        for task, scores in record.get("tasks", {}).items():
            for key in ("acc", "acc_norm"):
                steps, values = curves.setdefault(f"{task} {key}", ([], []))
                steps.append(record["step"])
                values.append(scores[key])
    return curves


def plot(metrics: Path, out: Path) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise UserError("plotting needs matplotlib (pip install 'llama_ddp[plot]')") from exc
    train, evals = read_metrics(metrics)
    tasks = task_curves(evals)
    ratios = [3, 2, 1] if tasks else [3, 1]
    fig, axes = plt.subplots(
        len(ratios), 1, figsize=(8, sum(ratios) + 2), sharex=True, height_ratios=ratios
    )
    ax_loss, ax_lr = axes[0], axes[-1]
    for label, (steps, values) in loss_curves(train, evals).items():
        ax_loss.plot(steps, values, "-" if label == "train loss" else "o-", label=label)
    ax_loss.set_ylabel("loss (nats/token)")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    if tasks:
        ax_tasks = axes[1]
        for label, (steps, values) in tasks.items():
            ax_tasks.plot(steps, values, "o-", label=label)
        ax_tasks.set_ylabel("accuracy")
        ax_tasks.legend(fontsize="small")
        ax_tasks.grid(alpha=0.3)
    ax_lr.plot([r["step"] for r in train], [r["lr"] for r in train], color="tab:green")
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("optimizer step")
    ax_lr.grid(alpha=0.3)
    fig.suptitle(str(metrics.parent))
    fig.tight_layout()
    with safe_io.writing(out, "plot"):
        safe_io.atomic_write(out, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    return run_command(_plot, argv)


def _plot(argv: list[str]) -> int:
    parser = ArgumentParser(
        prog="python -m llama_ddp.plot",
        description="Draw a run's curves (loss, validation loss by source, task accuracies, "
        "learning rate) from its metrics.jsonl into a PNG; needs matplotlib "
        "(pip install 'llama_ddp[plot]').",
    )
    parser.add_argument("metrics", type=Path, help="a run's metrics.jsonl")
    parser.add_argument("-o", "--out", type=Path, help="PNG to write (default: curves.png beside)")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    args = parser.parse_args(argv)
    out = args.out or args.metrics.with_name("curves.png")
    # The default, curves.png beside the metrics, is the plot's own: replaced without --force,
    # but in a folder this process can write, as every command's output (one line, before work).
    safe_io.check_output(out, "--out", args.force or args.out is None, "curves.png")
    out = plot(args.metrics, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    exit_command(main())
