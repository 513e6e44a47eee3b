"""Resumable data-parallel batch sampler (Megatron's ``MegatronPretrainingSampler``)."""

from __future__ import annotations

from collections.abc import Iterator


class MegatronPretrainingSampler:
    """Yields this dp rank's micro-batches of sample indices, in order, from ``consumed_samples``.

    Samples are taken sequentially (the dataset's shuffle index already randomises them). Every
    ``micro_batch_size * dp_size`` consecutive samples form one step of micro-batches: rank ``r``
    takes the ``r``-th slice of ``micro_batch_size``. A global batch is
    ``global_batch_size // (micro_batch_size * dp_size)`` such steps, i.e. the samples
    ``[consumed + b * G, consumed + (b + 1) * G)``, so the union over ranks of one global batch is
    exactly that range. A trailing incomplete global batch is dropped so every rank runs the same
    number of micro-batches. Resuming with the ``consumed_samples`` a checkpoint recorded continues
    with the next sample: nothing is repeated or skipped.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int, global_batch_size: int | None = None) -> None:
        if micro_batch_size < 1 or dp_size < 1:
            raise ValueError(f"micro_batch_size ({micro_batch_size}) and dp_size ({dp_size}) "
                             "must be >= 1")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
        step = micro_batch_size * dp_size
        if global_batch_size is None:
            global_batch_size = step
        # Imported here: the config package imports megazero.data (the tokenizer names).
        from megazero.config.rules import num_microbatches

        num_microbatches(global_batch_size, micro_batch_size, dp_size)
        if consumed_samples % step:
            raise ValueError(f"consumed_samples {consumed_samples} is not a multiple of "
                             f"micro_batch_size x dp_size = {step}; it must be a sample count "
                             "recorded at a step boundary")
        if consumed_samples > total_samples:
            raise ValueError(f"consumed_samples {consumed_samples} exceeds the {total_samples} "
                             "samples in the dataset")
        self.total_samples = int(total_samples)
        self.consumed_samples = int(consumed_samples)
        self.micro_batch_size = int(micro_batch_size)
        self.dp_rank = int(dp_rank)
        self.dp_size = int(dp_size)
        self.global_batch_size = int(global_batch_size)

    def _end(self) -> int:
        """One past the last sample served: whole global batches only."""
        full = (self.total_samples - self.consumed_samples) // self.global_batch_size
        return self.consumed_samples + full * self.global_batch_size

    def __len__(self) -> int:
        """Micro-batches this rank will yield."""
        step = self.micro_batch_size * self.dp_size
        return (self._end() - self.consumed_samples) // step

    def __iter__(self) -> Iterator[list[int]]:
        step = self.micro_batch_size * self.dp_size
        offset = self.dp_rank * self.micro_batch_size
        for start in range(self.consumed_samples, self._end(), step):
            first = start + offset
            yield list(range(first, first + self.micro_batch_size))
