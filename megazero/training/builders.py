"""Building what the training loop runs on: tokenizer, datasets, model chunks, optimizer.

Kept apart from :mod:`megazero.training.loop` so the loop reads as the loop. Every function takes
the validated :class:`~megazero.config.MegazeroConfig` and the topology explicitly.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from megazero.config import ConfigError, MegazeroConfig
from megazero.config.rules import check_rampup, num_microbatches, rampup_batch_size
from megazero.distributed.host_resident import mark
from megazero.distributed.topology import ParallelTopology
from megazero.errors import DataError, MegazeroError


@dataclass(frozen=True)
class Batching:
    """The batch arithmetic of one run (Megatron's names). With ``rampup`` (Megatron's
    ``--rampup-batch-size``) the global batch of an iteration depends on the samples consumed
    before it (:func:`megazero.config.rules.rampup_batch_size`); ``global_batch_size`` and
    ``num_microbatches`` are then the full size the ramp reaches."""

    micro_batch_size: int
    global_batch_size: int
    num_microbatches: int
    train_iters: int
    dp: int = 1
    rampup: tuple[int, int, int] | None = None
    # Megatron-DeepSpeed's --train-tokens: training also stops once this many tokens (samples
    # x seq_length) are consumed
    train_tokens: int | None = None
    seq_length: int = 1

    @classmethod
    def from_config(cls, cfg: MegazeroConfig, dp: int) -> Batching:
        t = cfg.train
        gbs = t.global_batch_size or t.micro_batch_size * dp
        count = num_microbatches(gbs, t.micro_batch_size, dp)
        rampup = t.rampup_batch_size
        if rampup is not None:
            check_rampup(rampup, gbs, t.micro_batch_size, dp)
        seq = cfg.model.seq_length
        probe = cls(t.micro_batch_size, gbs, count, 1, dp, rampup, t.train_tokens, seq)
        iters = t.train_iters
        if iters is None and t.train_samples is not None:
            iters = probe.iters_for(t.train_samples)
        if iters is None and t.train_tokens is not None:
            iters = probe.iters_until(-(-t.train_tokens // seq))
        if not iters:
            raise ConfigError("set --train-iters (or --train-samples, or --train-tokens) to say "
                              "how long to train")
        return cls(t.micro_batch_size, gbs, count, iters, dp, rampup, t.train_tokens, seq)

    def tokens_done(self, consumed_samples: int) -> bool:
        """``--train-tokens`` is reached (Megatron-DeepSpeed's stop: tokens consumed >= it)."""
        return self.train_tokens is not None and (
            consumed_samples * self.seq_length >= self.train_tokens)

    def samples_after(self, iterations: int) -> int:
        """Samples consumed by the first ``iterations`` iterations."""
        consumed = 0
        for done in range(iterations):
            if self.global_batch_at(consumed) == self.global_batch_size:
                return consumed + (iterations - done) * self.global_batch_size
            consumed += self.global_batch_at(consumed)
        return consumed

    def tokens_at(self, iterations: int) -> int:
        """Tokens consumed by the first ``iterations`` iterations."""
        return self.samples_after(iterations) * self.seq_length

    def iters_until(self, samples: int) -> int:
        """Iterations until at least ``samples`` are consumed (the last batch may pass it)."""
        consumed = iters = 0
        while consumed < samples:
            if self.global_batch_at(consumed) == self.global_batch_size:
                return iters + -(-(samples - consumed) // self.global_batch_size)
            consumed += self.global_batch_at(consumed)
            iters += 1
        return iters

    def global_batch_at(self, consumed_samples: int) -> int:
        if self.rampup is None:
            return self.global_batch_size
        return rampup_batch_size(self.rampup, self.global_batch_size, consumed_samples)

    def microbatches_at(self, consumed_samples: int) -> int:
        return self.global_batch_at(consumed_samples) // (self.micro_batch_size * self.dp)

    def iters_for(self, samples: int) -> int:
        """Iterations until ``samples`` are consumed (Megatron: whole batches only)."""
        if self.rampup is None:
            return samples // self.global_batch_size
        consumed = iters = 0
        while consumed + self.global_batch_at(consumed) <= samples:
            if self.global_batch_at(consumed) == self.global_batch_size:
                return iters + (samples - consumed) // self.global_batch_size
            consumed += self.global_batch_at(consumed)
            iters += 1
        return iters

    @property
    def sampler_batch(self) -> int:
        """The unit the sampler serves whole: the global batch, or with a ramp one micro-batch
        per data-parallel rank (iterations then draw as many as their batch needs)."""
        return self.global_batch_size if self.rampup is None else self.micro_batch_size * self.dp


def build_tokenizer_and_data_path(cfg: MegazeroConfig, topo: ParallelTopology,
                                  log: Callable[..., None] = print
                                  ) -> tuple[Any, MegazeroConfig]:
    """The tokenizer, and the config with ``model.vocab_size`` (and the demo's data path) set.

    ``--mock-data``: NullTokenizer over ``--vocab-size``, or the tokenizer ``--tokenizer-type``
    names, whose vocabulary then sizes the synthetic tokens (as in Megatron). ``--data-path``
    (or ``--train-data-path``...): the tokenizer the flags name. Neither: the built-in demo
    corpus (:mod:`megazero.data.demo`) with its own tokenizer.
    """
    import torch.distributed as dist

    from megazero.data.tokenizers import NullTokenizer, SentencePieceTokenizer

    d = cfg.data
    if d.mock_data and d.tokenizer_type in (None, "NullTokenizer"):
        tok: Any = NullTokenizer(cfg.model.vocab_size)
    elif d.mock_data:
        tok = _named_tokenizer(cfg)
    elif d.data_path or d.per_split_paths:
        if not d.tokenizer_type and d.vocab_file and d.merge_file:
            # Megatron's default tokenizer: GPT-2's BPE from --vocab-file and --merge-file.
            d = replace(d, tokenizer_type="GPT2BPETokenizer")
            cfg = replace(cfg, data=d)
            log("> tokenizer: GPT2BPETokenizer (Megatron's default, from --vocab-file and "
                "--merge-file)")
        if not d.tokenizer_type:
            raise ConfigError("--data-path needs a tokenizer: --vocab-file and --merge-file "
                              "(GPT-2 BPE, Megatron's default), or --tokenizer-type "
                              "(SentencePieceTokenizer with --tokenizer-model, "
                              "HuggingFaceTokenizer with --tokenizer-model, or NullTokenizer "
                              "with --vocab-size)")
        tok = _named_tokenizer(cfg)
    else:
        from megazero.data.demo import prepare_demo_data

        # One builder per node (the cache may be node-local); the others wait at the barrier.
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        data = None
        if local_rank == 0:
            data = prepare_demo_data(d.data_cache_path, log=log if topo.rank == 0 else _quiet)
        dist.barrier()
        if data is None:
            data = prepare_demo_data(d.data_cache_path, log=_quiet)
        tok = SentencePieceTokenizer(data.tokenizer_model)
        cfg = replace(cfg, data=replace(d, data_path=(data.data_prefix,),
                                        tokenizer_type="SentencePieceTokenizer",
                                        tokenizer_model=data.tokenizer_model))
    cfg = replace(cfg, model=replace(cfg.model, vocab_size=tok.vocab_size))
    return tok, cfg


def _named_tokenizer(cfg: MegazeroConfig) -> Any:
    """The tokenizer ``--tokenizer-type`` names, built from its files."""
    from megazero.data.tokenizers import build_tokenizer

    d = cfg.data
    assert d.tokenizer_type is not None
    try:  # --vocab-size sizes a NullTokenizer; TikTokenizer reads its file (up to 2**17 ids)
        return build_tokenizer(d.tokenizer_type, tokenizer_model=d.tokenizer_model,
                               vocab_file=d.vocab_file, merge_file=d.merge_file,
                               vocab_size=cfg.model.vocab_size
                               if d.tokenizer_type == "NullTokenizer" else None,
                               tiktoken_pattern=d.tiktoken_pattern,
                               tiktoken_num_special_tokens=d.tiktoken_num_special_tokens)
    except (OSError, ValueError) as e:  # a missing or unreadable tokenizer file
        raise DataError(f"--tokenizer-type {d.tokenizer_type}: {e}") from e


def _quiet(*_: Any, **__: Any) -> None:
    pass


def build_datasets(cfg: MegazeroConfig, batching: Batching,
                   resume: tuple[int, int] | None = None) -> tuple[Any, Any]:
    """``(train, valid)`` datasets (valid may be None when --eval-iters is 0). ``resume``: the
    checkpoint's (iteration, consumed samples): a run resumed at another global batch draws
    its remaining iterations after the samples consumed at the old one, so the training set
    holds at least that many."""
    from megazero.data.builder import (
        DataConfig,
        build_train_valid_test_datasets,
        train_valid_test_num_samples,
    )

    t = cfg.train
    train_n, valid_n, test_n = train_valid_test_num_samples(
        batching.train_iters, batching.global_batch_size, t.eval_interval, t.eval_iters)
    if resume is not None and batching.rampup is None:
        iteration, consumed = resume
        left = max(0, batching.train_iters - iteration)
        train_n = max(train_n, consumed + left * batching.global_batch_size)
    dc = DataConfig(seq_length=cfg.model.seq_length, num_samples=(train_n, valid_n, test_n),
                    data_path=tuple(cfg.data.data_path), split=cfg.data.split, seed=t.seed,
                    cache_dir=cfg.data.data_cache_path, mock=cfg.data.mock_data,
                    vocab_size=cfg.model.vocab_size,
                    split_paths=(cfg.data.train_data_path, cfg.data.valid_data_path,
                                 cfg.data.test_data_path),
                    mmap=cfg.data.mmap_bin_files)
    try:
        train, valid_ds, _ = build_train_valid_test_datasets(dc)
    except (FileNotFoundError, ValueError) as e:  # a missing prefix, a split with no samples
        if isinstance(e, MegazeroError):  # IndexFormatError names the file already
            raise
        raise DataError(f"--data-path: {e}") from e
    return train, valid_ds


def batch_iterator(dataset: Any, batching: Batching, topo: ParallelTopology,
                   consumed_samples: int = 0, cyclic: bool = False
                   ) -> Iterator[dict[str, Any]]:
    from megazero.data.builder import build_data_iterator

    return build_data_iterator(dataset, batching.micro_batch_size, topo.dp_rank, topo.dp_size,
                               batching.sampler_batch, consumed_samples, cyclic=cyclic)


def get_batch(data_iterator: Iterator[dict[str, Any]], device: torch.device | None = None,
              eod_mask: int | None = None, cp: tuple[int, int] = (0, 1),
              mtp_layers: int = 0, documents: tuple[int | None, bool, bool] = (None, False, False)
              ) -> dict[str, torch.Tensor]:
    """``tokens [b, s+1]`` from the dataset -> model input ``tokens [b, s]`` and shifted
    ``labels [b, s]``, on ``device``. With ``eod_mask`` (the end-of-document id,
    ``--eod-mask-loss``) also ``loss_mask [b, s]``: 0 where the input token is that id, so no
    loss is taken on predicting a new document's first token from the previous one's end
    (Megatron's rule).

    The batch is moved once, here, where it is drawn: on CUDA from pinned host memory with a
    non-blocking copy, so the transfer overlaps the work already queued on the GPU.

    ``cp``: ``(cp_rank, cp_size)``; with context parallelism the rank keeps its share of the
    sequence (:func:`megazero.context_parallel.batch.split_batch`). ``mtp_layers``: also the
    multi-token-prediction depths' masks, ``mtp_loss_mask [b, s, N]``
    (:func:`megazero.model.mtp.mtp_loss_masks`), built before the split. ``documents``:
    ``(end-of-document id, --reset-position-ids, --reset-attention-mask)``: also
    ``doc_position_ids`` / ``document_ids`` (:mod:`megazero.model.packed`), before the split.
    """
    tokens = next(data_iterator)["tokens"]
    if device is not None and device.type != "cpu":
        tokens = mark(tokens.pin_memory()).to(device, non_blocking=True)  # pinned staging
    batch = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
    if eod_mask is not None:
        batch["loss_mask"] = (batch["tokens"] != eod_mask).float()
    eod, reset_positions, reset_mask = documents
    if eod is not None and (reset_positions or reset_mask):
        from megazero.model.packed import document_ids, document_positions

        docs = document_ids(batch["tokens"], eod)
        if reset_positions:
            batch["doc_position_ids"] = document_positions(docs)
        if reset_mask:
            batch["document_ids"] = docs
    if mtp_layers:
        from megazero.model.mtp import mtp_loss_masks

        batch["mtp_loss_mask"] = mtp_loss_masks(batch.get("loss_mask"), batch["tokens"],
                                                mtp_layers)
    if cp[1] > 1:
        from megazero.context_parallel.batch import split_batch

        batch = split_batch(batch, *cp)
    return batch


def build_model_chunks_on(cfg: MegazeroConfig, topo: ParallelTopology, device: torch.device
                          ) -> tuple[list[torch.nn.Module], Any]:
    """This rank's model chunks, fp32, with the weights every layout shares; and, at ZeRO
    stage 3, the initializer the engine materialises its partitions with (else ``None``).

    The chunks are built on the meta device. At stages 0-2 each parameter is then created on
    ``device`` and initialised there, one at a time (``GPTModel.materialize``): the host never
    holds the rank's shard. At stage 3 the parameters stay on the meta device for the engine,
    which materialises only this rank's partition of each unit."""
    from megazero.config.schema import layer_counts
    from megazero.pipeline.partition import build_model_chunks
    from megazero.pipeline.zero_bubble import placement_of
    from megazero.tensor_parallel.context import ParallelContext
    from megazero.tensor_parallel.overlap import tp_comm_overlap_of

    parallel = ParallelContext.from_topology(topo,
                                             sequence_parallel=cfg.parallel.sequence_parallel,
                                             cp_comm_type=cfg.parallel.cp_comm_type,
                                             tp_comm_overlap=tp_comm_overlap_of(cfg.parallel))
    with torch.device("meta"):
        chunks = build_model_chunks(
            cfg.model, topo, cfg.parallel.num_layers_per_virtual_pipeline_stage,
            parallel=parallel, recompute=cfg.parallel.recompute, seed=cfg.train.seed,
            placement=placement_of(cfg.parallel.pipeline_schedule),
            layer_counts=layer_counts(cfg))
    if cfg.zero.stage == 3:
        for c in chunks:
            c.materialize_buffers(device)
        return chunks, chunks[0].param_initializer(device)
    for c in chunks:
        c.materialize(device)
    return chunks, None


def build_model_and_optimizer(cfg: MegazeroConfig, topo: ParallelTopology,
                              device: torch.device) -> tuple[list[torch.nn.Module], Any]:
    """Model chunks for this rank (:func:`build_model_chunks_on`: fp32, identical at every
    layout, created on ``device`` without a host copy of the shard), then the ZeRO engine,
    which casts them to the training dtype and keeps fp32 masters. With ZeRO stage 3 a model
    larger than one rank's memory can start: only this rank's partitions are materialised."""
    from megazero.zero import build_zero_optimizer

    chunks, param_init = build_model_chunks_on(cfg, topo, device)
    pr = cfg.precision
    apart: frozenset[int] = frozenset()
    if pr.fp8_format is not None and pr.fp8_param_gather and cfg.zero.stage in (1, 2):
        from megazero.fp8.apply import bf16_layer_indices, fp8_weights

        bf16 = bf16_layer_indices(cfg.model.num_layers, pr.first_last_layers_bf16,
                                  pr.num_layers_at_start_in_bf16, pr.num_layers_at_end_in_bf16)
        apart = frozenset(id(w) for w in fp8_weights(chunks, bf16))
    engine = build_zero_optimizer(chunks, cfg.optimizer, cfg.zero, cfg.precision, topo,
                                  sequence_parallel=cfg.parallel.sequence_parallel_active,
                                  param_init=param_init, gather_apart=apart)
    return chunks, engine


def build_fp8(cfg: MegazeroConfig, topo: ParallelTopology, chunks: list[torch.nn.Module],
              device: torch.device) -> Any:
    """``--fp8-format``: FP8 GEMMs in the chunks' transformer layers (a
    :class:`megazero.fp8.apply.FP8Layers`), or None without it. A delayed-scaling step's
    amaxes are reduced over the stage's tp, cp and dp ranks (every rank holding its layers)."""
    pr = cfg.precision
    if pr.fp8_format is None:
        return None
    from megazero.fp8 import FP8Recipe
    from megazero.fp8.apply import apply_fp8, bf16_layer_indices

    recipe = FP8Recipe(pr.fp8_format, pr.fp8_recipe, pr.fp8_amax_history_len,
                       pr.fp8_amax_compute_algo, pr.fp8_margin,
                       pow2_weight_scales=pr.fp8_param_gather)
    bf16 = bf16_layer_indices(cfg.model.num_layers, pr.first_last_layers_bf16,
                              pr.num_layers_at_start_in_bf16, pr.num_layers_at_end_in_bf16)
    return apply_fp8(chunks, recipe, bf16_layers=bf16, cp_group=topo.cp_group,
                     step_groups=(topo.tp_group, topo.cp_group, topo.dp_group), device=device)


def gather_fp8_params(fp8: Any, engine: Any) -> int:
    """``--fp8-param-gather``: the FP8 GEMM weights are gathered as e4m3 bytes
    (:mod:`megazero.fp8.param_gather`): at ZeRO-3 the units holding one such weight, at ZeRO
    1-2 the buckets of them after the step. Returns how many units (ZeRO-3) or weights are."""
    from megazero.fp8.param_gather import FP8BucketCodec, FP8ParamCodec
    from megazero.zero.buffers import GradBuffer
    from megazero.zero.stage3 import ParamCodec, Stage3Params

    groups = {id(w): g for w, g in fp8.weights}
    codecs: dict[int, ParamCodec] = {key: FP8ParamCodec(g) for key, g in groups.items()}

    def bucket_codec(params: list[torch.nn.Parameter]) -> FP8BucketCodec | None:
        if not all(id(p) in groups for p in params):
            return None
        return FP8BucketCodec([groups[id(p)] for p in params])

    count = 0
    for store in engine.stores:
        if isinstance(store, Stage3Params):
            count += store.gather_with(codecs)
        elif isinstance(store, GradBuffer):
            count += store.gather_with(bucket_codec)
    return count


class ChunkTrackers:
    """The TP-aware RNG trackers of all model chunks, saved and restored as one."""

    def __init__(self, chunks: list[torch.nn.Module]) -> None:
        self.trackers = [getattr(c, "rng_tracker", None) for c in chunks]

    def get_states(self) -> list[Any]:
        return [t.get_states() if t is not None else None for t in self.trackers]

    def set_states(self, states: list[Any]) -> None:
        for t, s in zip(self.trackers, states):
            if t is not None and s is not None:
                t.set_states(s)

