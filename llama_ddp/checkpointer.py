"""The run's checkpointing component: when to save, where, by whom, how many to keep, and which
checkpoint a run resumes from. The format itself (parts, DCP + JSON, verification) is
checkpoint.py's; the loop only asks ``due`` and calls ``save``.
"""

from __future__ import annotations

import time
from pathlib import Path

from llama_ddp import checkpoint as ckpt
from llama_ddp import distributed as D


class Checkpointer:
    """Saves the run's ``parts`` every ``every`` steps and after the last one (``due``), into
    ``OUT/checkpoints/step-NNNNNNNN/``, keeping the newest ``keep_last``. With ``collective``
    (sharded weights) every rank writes its shards and rank 0 completes the folder; otherwise
    rank 0 writes it alone. Every rank returns from ``save`` once the checkpoint is complete."""

    def __init__(
        self,
        out_dir: str | Path,
        parts: dict[str, ckpt.Stateful],
        rt: D.Runtime,
        *,
        every: int,
        keep_last: int,
        collective: bool,
    ) -> None:
        self.out_dir, self.parts, self.rt = Path(out_dir), parts, rt
        self.every, self.keep_last, self.collective = every, keep_last, collective

    def due(self, step: int, last: bool) -> bool:
        """Whether optimizer step ``step`` (1-based; ``last``: the run's final one) saves."""
        return step > 0 and (last or (self.every > 0 and step % self.every == 0))

    def save(self, step: int) -> float:
        """Write the checkpoint of step ``step``; the seconds it took (as rank 0 saw them)."""
        start = time.perf_counter()
        if self.collective or self.rt.is_main:
            ckpt.save_checkpoint(
                self.out_dir,
                step,
                self.parts,
                keep_last=self.keep_last,
                rt=self.rt if self.collective else None,
            )
        D.barrier(self.rt)  # every rank goes on only once the checkpoint is complete
        return time.perf_counter() - start

    def load(self, path: Path) -> int:
        """Every part from the checkpoint at ``path`` (all ranks together when collective);
        returns its step."""
        return ckpt.load_checkpoint(path, self.parts, rt=self.rt if self.collective else None)

    def folder(self, step: int) -> Path:
        return ckpt.step_dir(self.out_dir, step)

    def saved(self) -> dict[int, Path]:
        """This run folder's checkpoints by step, oldest first."""
        return {ckpt.step_of(p): p for p in ckpt.list_checkpoints(self.out_dir)}

    def latest(self) -> Path | None:
        saved = self.saved()
        return saved[max(saved)] if saved else None

    @staticmethod
    def resume_point(out_dir: str | Path, resume: str, rt: D.Runtime) -> Path | None:
        """The checkpoint a run continues from (``--resume``: auto, none or a path; see
        `checkpoint.find_resume`): rank 0 decides, every rank gets its answer."""
        path = ckpt.find_resume(out_dir, resume) if rt.is_main else None
        path = D.broadcast_object(path, rt)
        return None if path is None else Path(path)
