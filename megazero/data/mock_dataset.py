"""Synthetic GPT samples for ``--mock-data``: no files, deterministic from a seed."""

from __future__ import annotations

import numpy as np


class MockGPTDataset:
    """``num_samples`` samples ``{"tokens": int64[seq_length + 1]}`` computed from ``(seed, idx)``.

    Each sample is an arithmetic progression modulo ``vocab_size - 1`` with a random start and a
    random stride in ``[1, 8)``: after two tokens the next one is predictable, so a model trained
    on mock data shows a falling loss (useful to check a training setup end to end). The id
    ``vocab_size - 1`` (the NullTokenizer's eod) is never produced. Sample ``idx`` depends only on
    ``(seed, idx)``, so every rank and every resume sees the same data.
    """

    def __init__(self, vocab_size: int, seq_length: int, num_samples: int, seed: int = 1234,
                 split: str = "train") -> None:
        if vocab_size < 2:
            raise ValueError(f"mock data needs vocab_size >= 2, got {vocab_size}")
        self.vocab_size = int(vocab_size)
        self.seq_length = int(seq_length)
        self.num_samples = int(num_samples)
        # Different splits draw different samples from the same seed.
        self.seed = int(seed)
        self._split_id = {"train": 0, "valid": 1, "test": 2}.get(split, 3)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"mock sample {idx} out of range for {self.num_samples} samples")
        rng = np.random.default_rng([self.seed, self._split_id, int(idx)])
        modulus = self.vocab_size - 1 if self.vocab_size > 2 else 2
        start = int(rng.integers(0, modulus))
        stride = int(rng.integers(1, 8))
        tokens = (start + stride * np.arange(self.seq_length + 1, dtype=np.int64)) % modulus
        return {"tokens": tokens}
