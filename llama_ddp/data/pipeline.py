"""The training data, from its settings (`DataSettings`) to batches: sources -> corpora ->
tokenizer -> token caches (built in the background while training runs) -> datasets -> sampler ->
loader, usable without a Trainer. What one item and one batch are: batch.py; how sources mix:
mixture.py.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from torch.utils.data import DataLoader

from llama_ddp.attention_plan.plan import IGNORE_INDEX
from llama_ddp.data.batch import Batch, PackedDataset, PretrainingDataset, make_loader, trim_padding
from llama_ddp.data.cache.build import Sharding
from llama_ddp.data.cache.builder import Builder
from llama_ddp.data.cache.read import Patience, TokenShard, token_caches
from llama_ddp.data.corpus import Corpus, cache_folder, load_splits
from llama_ddp.data.mixture import (
    MixtureDataset,
    MixtureSampler,
    Plan,
    ShardedDataset,
    SourceStream,
)
from llama_ddp.data.sources import DataSettings, Source
from llama_ddp.data.tokenizer import resolve_tokenizer, tokenizer_fingerprint
from llama_ddp.data.tokenizer_files import SpecialIds, SpecialTokens, special_ids
from llama_ddp.errors import UserError
from llama_ddp.files.preparation import ALONE, Preparation

__all__ = [
    "IGNORE_INDEX",
    "Batch",
    "PackedDataset",
    "PretrainingDataset",
    "DataSettings",
    "TrainData",
    "build_data",
    "build_datasets",
    "make_loader",
    "trim_padding",
]


def item_maker(
    packing: str, seq_length: int, pad_id: int, document_mask: bool
) -> Callable[[TokenShard], PackedDataset | PretrainingDataset]:
    """What a shard's items are: pad-mode documents or pack-mode windows."""
    if packing == "pad":
        return functools.partial(PretrainingDataset, seq_length=seq_length, pad_id=pad_id)
    if packing == "pack":
        return functools.partial(PackedDataset, seq_length=seq_length, document_mask=document_mask)
    raise ValueError(f"packing must be 'pad' or 'pack', got {packing!r}")


def build_datasets(
    corpus: Corpus,
    tok: Tokenizer,
    *,
    seq_length: int,
    packing: str,
    cache_dir: Path,
    special: SpecialIds | None = None,
    document_mask: bool = True,
    num_proc: int | None = None,
    sharding: Sharding | None = None,
) -> tuple[ShardedDataset, ShardedDataset]:
    """(train, validation) datasets of one corpus, from its complete token cache (built here if
    absent; see `token_caches` for the other arguments). Items are read by
    flat index: windows (pack) or documents (pad) shard after shard; ``document_mask`` keeps pack
    mode's documents apart (see `PackedDataset`)."""
    special = special or special_ids(tok)
    make = item_maker(packing, seq_length, special.pad, document_mask)
    (pair,), _ = token_caches(
        [corpus], tok, cache_dir, special, num_proc=num_proc, sharding=sharding
    )
    train, validation = (ShardedDataset(split, make) for split in pair)
    if len(train) == 0:
        raise UserError(
            f"the train split has {pair[0].total['tokens']} tokens, fewer than one sequence of "
            f"{seq_length + 1} (use a smaller sequence length or more data)"
        )
    return train, validation


@dataclass
class TrainData:
    """Everything a run reads: the tokenizer and its roles, each source's datasets, this rank's
    sampler and loader, and the builder of the token caches while it runs."""

    tokenizer: Tokenizer
    tokenizer_path: Path
    special: SpecialTokens
    sources: list[Source]
    fingerprints: list[str]  # of each source's corpus
    train: MixtureDataset
    validation: dict[str, ShardedDataset]  # by source name
    sampler: MixtureSampler
    loader: DataLoader
    packing: str
    seq_length: int
    document_mask: bool
    builder: Builder | None = field(default=None, repr=False)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sources]

    def batches(self, start_step: int) -> Iterator[list[Batch]]:
        """Each optimizer step's micro-batches from ``start_step`` on, without end. What stopped
        the cache's builder (a broken data file) stops the run at the next step, not only when
        it would need the shards the builder could not build."""
        self.sampler.seek(start_step)
        it = iter(self.loader)
        while True:
            if self.builder is not None:
                self.builder.check()
            yield [next(it) for _ in range(self.sampler.accum_steps)]

    def source_targets(self, step: int) -> dict[str, int]:
        """The target tokens each source gave optimizer step ``step`` (from 1), whole batch."""
        out = dict.fromkeys(self.names, 0)
        for key in self.sampler.global_keys(step - 1):
            out[self.names[key[0]]] += self.train.targets(key)
        return out

    def count_source_targets(self, step: int, totals: dict[str, int]) -> None:
        """Add each source's targets of step ``step`` to ``totals`` (a mixture's only: known on
        the CPU from the data, the same on every rank)."""
        if len(self.sources) > 1:
            for name, n in self.source_targets(step).items():
                totals[name] = totals.get(name, 0) + n

    def epoch(self, step: int) -> int:
        return self.sampler.epoch(step)

    def describe(self) -> str:
        """How the data is read, for the run's first lines."""
        size = self.sampler.steps_per_epoch
        epoch = f"{size} steps/epoch" if size else "steps/epoch known once the cache is built"
        mix = ", ".join(f"{s.name} {w:.0%}" for s, w in zip(self.sources, self.weights()))
        kind = "packed" if self.packing == "pack" else "padded"
        return f"{kind} sequences of {self.seq_length} from {mix}, {epoch}"

    def weights(self) -> list[float]:
        total = sum(s.weight for s in self.sources)
        return [s.weight / total for s in self.sources]

    def resume_key(self) -> dict:
        """What decides which tokens optimizer step k trains on, and what they attend to: resuming
        needs all of it equal (saved in every checkpoint's settings)."""
        corpus = self.fingerprints[0]
        mixture = {}
        if len(self.sources) > 1:
            parts = [[s.name, s.weight, f] for s, f in zip(self.sources, self.fingerprints)]
            corpus = hashlib.sha256(json.dumps(parts).encode()).hexdigest()
            mixture = {"sources": {s.name: s.weight for s in self.sources}}
        return {
            "corpus": corpus,
            **mixture,
            "tokenizer": tokenizer_fingerprint(self.tokenizer),
            "special_tokens": self.special.names(),
            "seq_length": self.seq_length,
            "packing": self.packing,
            "document_mask": self.document_mask if self.packing == "pack" else None,
            "batch_size": self.sampler.global_batch,
            "seed": self.sampler.seed,
        }

    def close(self) -> None:
        """Stop the cache builder if it still runs (a later run builds the rest)."""
        if self.builder is not None:
            self.builder.stop()


def _item_shares(sources: list[Source], trains: list[ShardedDataset], packing: str) -> list:
    """Each source's share of the items: its weight, over its mean item length in pad mode
    (from its first shard), so that the weights are shares of the tokens."""
    if packing == "pack":
        return [Fraction(s.weight) for s in sources]
    shares = []
    for source, train in zip(sources, trains):
        part = train.part(0)
        lengths = int(np.minimum(np.diff(part.split.offsets), part.seq_length + 1).sum())
        shares.append(Fraction(source.weight) / Fraction(lengths, len(part)))
    return shares


def build_data(
    settings: DataSettings,
    *,
    seed: int,
    sized: bool = False,
    rank: int = 0,
    world_size: int = 1,
    prep: Preparation = ALONE,
    pin_memory: bool = False,
    patience: Patience | None = None,
) -> TrainData:
    """sources -> corpora -> tokenizer -> token caches -> datasets -> sampler -> loader, for
    ``rank`` of ``world_size``, in the order ``seed`` draws (``sized``: the run's length is set
    by the sources' sizes, no --max-steps). Caches are per machine: the process that ``prep``
    leads starts their builder while the machine's other ranks wait for the first shards;
    training then reads shards as they are built, waiting for one as ``patience`` says
    (default: report a long wait, never give up). Rank 0 alone prints."""
    patience = patience or Patience(lambda text: print(text, file=sys.stderr, flush=True))
    cache_dir = cache_folder(settings.cache_path())
    sources = settings.mixture()
    corpora = open_corpora(sources, settings.val_fraction, cache_dir)
    tok_corpus = corpora[0] if len(corpora) == 1 else MixedCorpus(corpora, sources)
    tok, special, tok_path = resolve_tokenizer(
        settings.tokenizer,
        tok_corpus,
        settings.vocab_size,
        cache_dir,
        roles=settings.roles(),
        prep=prep,
    )
    # A small local source is tokenized before training and shuffled whole (its order depends
    # on its data alone); without --max-steps the run's length needs every source's size.
    sharding = Sharding.from_env()
    whole = [c.size is not None and c.size <= sharding.whole for c in corpora]
    complete = [w or sized for w in whole]
    splits, builder = token_caches(
        corpora,
        tok,
        cache_dir,
        special.ids,
        weights=[s.weight for s in sources],
        prep=prep,
        num_proc=settings.num_proc,
        background=True,
        whole=complete,
        sharding=sharding,
    )
    if builder is not None and builder.running and rank == 0:
        note = "the token cache is being built in the background: training reads its shards as"
        print(f"{note} they come", flush=True)
    for split in (split for pair in splits for split in pair):
        split.patience = patience
    make = item_maker(
        settings.packing, settings.seq_length, special.ids.pad, settings.document_mask
    )
    trains = [ShardedDataset(train, make) for train, _ in splits]
    validation = {s.name: ShardedDataset(v, make) for s, (_, v) in zip(sources, splits)}
    streams = [SourceStream(t, s.name, seed, w) for t, s, w in zip(trains, sources, whole)]
    sampler = MixtureSampler(
        Plan(_item_shares(sources, trains, settings.packing)),
        streams,
        global_batch=settings.batch_size,
        micro_batch=settings.micro_batch(world_size),
        rank=rank,
        world_size=world_size,
        seed=seed,
        note=(lambda text: print(f"note: {text}", flush=True)) if rank == 0 else None,
    )
    if all(split.complete for split, _ in splits):
        sampler.steps_per_epoch = max(1, sum(s.size() for s in streams) // settings.batch_size)
    train = MixtureDataset(trains)
    padded = settings.packing == "pad"
    loader = make_loader(
        train, sampler, num_workers=settings.num_workers, pin_memory=pin_memory, padded=padded
    )
    return TrainData(
        tok, tok_path, special, sources, [c.fingerprint for c in corpora], train, validation,
        sampler, loader, settings.packing, settings.seq_length, settings.document_mask, builder,
    )  # fmt: skip


def open_corpora(sources: list[Source], val_fraction: float, cache_dir: Path) -> list[Corpus]:
    """Each source's corpus (its train and held-out splits); an empty one is an error now, not
    in the background (`Corpus.check`: a corpus checked by an earlier run is not read again)."""
    corpora = [
        load_splits(
            s.dataset,
            config=s.config,
            split=s.split,
            text_column=s.text_column,
            streaming=s.streaming,
            val_fraction=val_fraction,
            cache_dir=cache_dir,
        )
        for s in sources
    ]
    for corpus in corpora:
        corpus.check()
    return corpora


class MixedCorpus:
    """Several corpora as one for training a tokenizer on them: their documents interleaved by
    weight (`Plan` over documents), and a fingerprint naming them all."""

    def __init__(self, corpora: list[Corpus], sources: list[Source]) -> None:
        self.corpora, self.sources = corpora, sources
        parts = [[s.weight, c.fingerprint] for s, c in zip(sources, corpora)]
        self.fingerprint = hashlib.sha256(json.dumps(parts).encode()).hexdigest()

    @property
    def train(self) -> _Interleaved:
        return _Interleaved([c.train for c in self.corpora], [s.weight for s in self.sources])


@dataclass
class _Interleaved:
    texts: list
    weights: list[float]

    def __iter__(self) -> Iterator[str]:
        its, plan = [iter(t) for t in self.texts], Plan(self.weights)
        for n in itertools.count(0, 1000):
            for s, _ in plan.slots(n, 1000):
                text = next(its[s], None)
                if text is None:
                    return  # the first source to run out ends the sample
                yield text
