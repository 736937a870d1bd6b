"""Files every process of a machine reads, made once: by the process that ``leads`` (local rank 0
under torchrun), while the others ``wait`` at a barrier, then read what it made. A tokenizer
trained on the corpus, a GGUF file's tokenizer folder and the token cache are made this way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Preparation:
    leads: bool = True
    wait: Callable[[], None] = lambda: None


# A process on its own: it makes everything and waits for nobody.
ALONE = Preparation()
