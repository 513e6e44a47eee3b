"""From a data config to per-rank iterators of token batches.

``build_train_valid_test_datasets`` opens every ``--data-path`` prefix, splits its documents with
``--split``, builds one :class:`GPTDataset` per (prefix, split) and blends prefixes by weight
(with Megatron's ``--train-data-path`` / ``--valid-data-path`` / ``--test-data-path`` each split
is its own corpus, whole);
``build_data_iterator`` serves one dp rank's micro-batches as ``{"tokens": LongTensor[b, s+1]}``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from megazero.data.blended_dataset import BlendedDataset, parse_data_path, sizes_needed
from megazero.data.gpt_dataset import GPTDataset, default_cache_dir
from megazero.data.indexed_dataset import IndexedDataset
from megazero.data.mock_dataset import MockGPTDataset
from megazero.data.sampler import MegatronPretrainingSampler
from megazero.data.split import SPLIT_NAMES, split_document_ranges
from megazero.data.token_range import check_token_ids


@dataclass(frozen=True)
class DataConfig:
    """What determines the datasets. ``data_path`` uses ``--data-path`` syntax.

    ``num_samples`` is ``(train, valid, test)``; see :func:`train_valid_test_num_samples`.
    ``mock=True`` ignores ``data_path`` and serves :class:`MockGPTDataset` of ``vocab_size``;
    otherwise a ``vocab_size`` is checked against every dataset's largest token id.
    """

    seq_length: int
    num_samples: tuple[int, int, int]
    data_path: tuple[str, ...] = ()
    split: str = "969,30,1"
    seed: int = 1234
    cache_dir: str | None = None
    mock: bool = False
    vocab_size: int | None = None
    # each split's own corpus ("[W1] PREFIX1 ..."), instead of data_path with split
    split_paths: tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]] = ((), (), ())
    mmap: bool = True  # False: read the .bin files instead of mapping them

    def __post_init__(self) -> None:
        if self.seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {self.seq_length}")
        if len(self.num_samples) != 3 or any(n < 0 for n in self.num_samples):
            raise ValueError(f"num_samples must be three non-negative counts (train, valid, "
                             f"test), got {self.num_samples}")
        if self.mock and not self.vocab_size:
            raise ValueError("mock data needs vocab_size (from the tokenizer)")
        if not self.mock and not self.data_path and not self.split_paths[0]:
            raise ValueError("no --data-path given (or use --mock-data)")


def train_valid_test_num_samples(train_iters: int, global_batch_size: int, eval_interval: int,
                                 eval_iters: int) -> tuple[int, int, int]:
    """The samples a training run draws from each split (what ``pretrain_gpt.py`` builds).

    Validation runs ``eval_iters`` global batches every ``eval_interval`` iterations and once at
    the end (only at the end when ``eval_interval`` is 0); no validation when ``eval_iters`` is
    0. The test split is never evaluated during training, so it gets no samples.
    """
    evals = (train_iters // eval_interval + 1) if eval_interval > 0 else 1
    valid = evals * eval_iters * global_batch_size if eval_iters > 0 else 0
    return train_iters * global_batch_size, valid, 0


def build_train_valid_test_datasets(config: DataConfig, is_builder: bool | None = None,
                                    barrier: Callable[[], None] | None = None, group=None
                                    ) -> list:
    """``[train, valid, test]``; an entry is ``None`` when it has no samples or no documents."""
    if config.mock:
        return [MockGPTDataset(config.vocab_size, config.seq_length, n, config.seed, name)
                if n > 0 else None for n, name in zip(config.num_samples, SPLIT_NAMES)]
    if config.split_paths[0]:
        return [_whole_corpus(config, s, paths, is_builder, barrier, group)
                for s, paths in enumerate(config.split_paths)]
    weighted = parse_data_path(list(config.data_path))
    indexed = _open(config, [prefix for _, prefix in weighted], is_builder, barrier, group)
    ranges = [split_document_ranges(config.split, ds.num_documents) for ds in indexed]
    weights = [w for w, _ in weighted]
    out: list = []
    for s, (name, n) in enumerate(zip(SPLIT_NAMES, config.num_samples)):
        if n == 0:
            out.append(None)
            continue
        empty = [p for (_, p), r in zip(weighted, ranges) if r[s][1] <= r[s][0]]
        if empty:
            raise ValueError(f"{n} {name} samples requested but --split {config.split} leaves "
                             f"no {name} documents in {', '.join(empty)}")
        per_ds = [n] if len(indexed) == 1 else sizes_needed(weights, n)
        parts = [GPTDataset(ds, r[s], config.seq_length, max(k, 1), config.seed, name,
                            config.cache_dir, is_builder, barrier, group)
                 for ds, r, k in zip(indexed, ranges, per_ds)]
        out.append(parts[0] if len(parts) == 1 else BlendedDataset(parts, weights, n))
    return out


def _open(config: DataConfig, prefixes: list[str], is_builder: bool | None,
          barrier: Callable[[], None] | None, group) -> list[IndexedDataset]:
    """The prefixes' datasets, their token ids checked against the vocabulary."""
    indexed = [IndexedDataset(prefix, mmap=config.mmap) for prefix in prefixes]
    if config.vocab_size:
        for ds in indexed:
            check_token_ids(ds, config.vocab_size,
                            config.cache_dir or default_cache_dir(ds.path_prefix), is_builder,
                            barrier, group)
    return indexed


def _whole_corpus(config: DataConfig, s: int, paths: tuple[str, ...], is_builder: bool | None,
                  barrier: Callable[[], None] | None, group):
    """Split ``s`` from its own corpus (``--train-data-path`` ...): every document of each
    prefix, blended by weight; None without samples asked or without a path for it."""
    n, name = config.num_samples[s], SPLIT_NAMES[s]
    if n == 0 or not paths:
        return None
    weighted = parse_data_path(list(paths))
    indexed = _open(config, [prefix for _, prefix in weighted], is_builder, barrier, group)
    per_ds = [n] if len(indexed) == 1 else sizes_needed([w for w, _ in weighted], n)
    parts = [GPTDataset(ds, (0, ds.num_documents), config.seq_length, max(k, 1), config.seed,
                        name, config.cache_dir, is_builder, barrier, group)
             for ds, k in zip(indexed, per_ds)]
    return parts[0] if len(parts) == 1 else BlendedDataset(parts, [w for w, _ in weighted], n)


def _collate(samples: Sequence[dict]) -> dict[str, torch.Tensor]:
    tokens = np.stack([s["tokens"] for s in samples]).astype(np.int64, copy=False)
    return {"tokens": torch.from_numpy(tokens)}


def build_data_iterator(dataset, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                        global_batch_size: int | None = None, consumed_samples: int = 0,
                        num_samples: int | None = None, num_workers: int = 0,
                        cyclic: bool = False) -> Iterator[dict[str, torch.Tensor]]:
    """This dp rank's micro-batches ``{"tokens": int64 tensor [micro_batch, seq_length + 1]}``.

    ``consumed_samples`` (over all ranks) resumes exactly where a checkpoint left off.
    ``num_samples`` caps the samples drawn (default: the whole dataset). With ``cyclic=True``
    (validation) the iterator restarts from sample 0 when exhausted.
    """
    total = len(dataset) if num_samples is None else min(num_samples, len(dataset))

    def _loader(consumed: int) -> torch.utils.data.DataLoader:
        sampler = MegatronPretrainingSampler(total, consumed, micro_batch_size, dp_rank, dp_size,
                                             global_batch_size)
        return torch.utils.data.DataLoader(dataset, batch_sampler=sampler,
                                           num_workers=num_workers, collate_fn=_collate,
                                           persistent_workers=False)

    if not cyclic:
        return iter(_loader(consumed_samples))

    def _cycle() -> Iterator[dict[str, torch.Tensor]]:
        batch = global_batch_size or micro_batch_size * dp_size
        consumed = (consumed_samples % max(total, 1)) // batch * batch
        while True:
            loader = _loader(consumed)
            if len(loader.batch_sampler) == 0:
                raise ValueError(f"dataset of {total} samples holds no full global batch")
            yield from loader
            consumed = 0

    return _cycle()
