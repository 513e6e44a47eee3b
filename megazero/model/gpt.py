"""GPT model, built as one pipeline chunk (or the whole model).

Forward contract (the pipeline schedules rely on it)::

    forward(tokens [b, s] | None, labels [b, s] | None = None, hidden_states | None = None)

* ``pre_process``: embeds ``tokens`` (positions ``0..s-1``); otherwise consumes
  ``hidden_states`` ``[s, b, h]`` (``[s/t, b, h]`` with sequence parallelism) from the previous
  stage.
* not ``post_process``: returns hidden states ``[s(/t), b, h]``.
* ``post_process``: returns the per-token fp32 loss ``[b, s]`` when ``labels`` are given (the
  caller averages), else this rank's vocab-parallel logits ``[b, s, V_padded/t]`` with the pad
  columns at ``-inf``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from megazero.config import ConfigError, ModelConfig, RecomputeConfig, check_tensor_parallel_split
from megazero.config.rules import check_sequence_split
from megazero.distributed.topology import ParallelTopology
from megazero.model.dropout import dropout
from megazero.model.init import ParamInitializer, declare, initialize_parameters, scope
from megazero.model.materialize import materialize_parameters
from megazero.model.positional import RotaryEmbedding
from megazero.model.recompute import apply_recompute
from megazero.model.transformer import TransformerBlock
from megazero.tensor_parallel.context import ParallelContext
from megazero.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megazero.tensor_parallel.layers import (
    DEFERRED_INIT,
    VocabParallelEmbedding,
    column_parallel_linear,
    mark_vocab_parallel,
    pad_vocab_size,
)
from megazero.tensor_parallel.mappings import (
    reduce_from_tensor_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megazero.tensor_parallel.random import (
    DEFAULT_STREAM,
    MODEL_PARALLEL_STREAM,
    RNGStatesTracker,
)

WORD_EMBEDDING = "embedding.word_embeddings.weight"


def validate(config: ModelConfig, tp: int, sequence_parallel: bool,
             layer_range: tuple[int, int]) -> None:
    """Reject layouts this model cannot be split into (hidden % heads is already a
    :class:`ModelConfig` invariant); every message names the numbers."""
    check_tensor_parallel_split(config, tp, sequence_parallel)
    start, end = layer_range
    # empty: a pipeline stage holding only the embedding or the loss (an uneven split)
    if not 0 <= start <= end <= config.num_layers:
        raise ConfigError(f"layer_range {layer_range} is not a range within "
                          f"[0, --num-layers {config.num_layers})")


class Embedding(nn.Module):
    """Word (vocab-parallel) plus learned absolute position embeddings, then dropout.

    Output ``[s, b, h]``, scattered onto sequence slices with sequence parallelism. Position
    embeddings are added before the scatter, so their gradient is complete on every rank.
    """

    def __init__(self, config: ModelConfig, *, parallel: ParallelContext | None = None):
        super().__init__()
        parallel = parallel or ParallelContext()
        self.parallel = parallel
        self.group, self.sequence_parallel = parallel.tp_group, parallel.sequence_parallel
        self.dropout = config.hidden_dropout
        self.word_embeddings = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, parallel=parallel,
            make_vocab_size_divisible_by=config.make_vocab_size_divisible_by,
            init_method=DEFERRED_INIT)
        self.position_embeddings = None
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(config.max_positions, config.hidden_size,
                                                    dtype=parallel.params_dtype)
            declare(self.position_embeddings.weight, key="position_embeddings.weight")
        declare(self.word_embeddings.weight, key="word_embeddings.weight")
        # Megatron's is_embedding_or_output_parameter: its own rate with --decoupled-lr
        self.word_embeddings.weight.embedding_or_output = True

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None
                ) -> torch.Tensor:
        x = self.word_embeddings(tokens)  # [b, s, h]
        if self.position_embeddings is not None and positions is not None:
            x = x + self.position_embeddings.weight[positions]  # packed documents' own
        elif self.position_embeddings is not None and self.parallel.cp_size > 1:
            x = x + self.position_embeddings.weight[self._cp_positions(tokens)]
        elif self.position_embeddings is not None:
            x = x + self.position_embeddings.weight[: tokens.shape[1]]
        x = x.transpose(0, 1).contiguous()
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.group)
        if self.training and self.dropout > 0:
            stream = MODEL_PARALLEL_STREAM if self.sequence_parallel else DEFAULT_STREAM
            with self.parallel.fork(stream):
                x = dropout(x, self.dropout)
        return x

    def _cp_positions(self, tokens: torch.Tensor) -> torch.Tensor:
        """Global positions of this context-parallel rank's tokens (its two zigzag chunks)."""
        from megazero.context_parallel.split import local_positions

        p = self.parallel
        return local_positions(tokens.shape[1] * p.cp_size, p.cp_rank, p.cp_size, tokens.device)


class GPTModel(nn.Module):
    #: ``megazero.zero.Init`` builds it on the meta device and computes each parameter's shard
    #: (:meth:`param_initializer`), never a full tensor
    mz_meta_init = True

    def __init__(self, config: ModelConfig, topo: ParallelTopology, *,
                 parallel: ParallelContext | None = None,
                 layer_range: tuple[int, int] | None = None,
                 pre_process: bool = True, post_process: bool = True,
                 recompute: RecomputeConfig | None = None, seed: int = 1234):
        """``parallel``: TP group, sequence parallelism, attention backend, parameter dtype and
        RNG tracker (default: :meth:`ParallelContext.from_topology` of ``topo``). Without a
        tracker the chunk makes its own (:meth:`default_rng_tracker`); with ``auto`` attention
        and ``config.use_flash_attn`` off, SDPA. ``recompute``: the activation recomputation
        policy (default none; see :func:`apply_recompute`)."""
        super().__init__()
        tp = topo.tp_size
        layer_range = tuple(layer_range) if layer_range is not None else (0, config.num_layers)
        parallel = parallel or ParallelContext.from_topology(topo)
        if (parallel.tp_size, parallel.tp_rank) != (tp, topo.tp_rank):
            raise ValueError(f"the ParallelContext (tp size {parallel.tp_size}, rank "
                             f"{parallel.tp_rank}) is not this topology's (tp size {tp}, rank "
                             f"{topo.tp_rank}); build it with ParallelContext.from_topology")
        validate(config, tp, parallel.sequence_parallel, layer_range)
        if parallel.rng_tracker is None:
            parallel = dataclasses.replace(
                parallel, rng_tracker=self.default_rng_tracker(seed, topo, layer_range[0]))
        if parallel.attention_backend == "auto" and not config.use_flash_attn:
            parallel = dataclasses.replace(parallel, attention_backend="sdpa")
        self.config, self.topo, self.parallel = config, topo, parallel
        self.sequence_parallel = parallel.sequence_parallel
        self.layer_range = layer_range
        self.pre_process, self.post_process = pre_process, post_process
        self.seed = seed
        self.vocab_size = config.vocab_size
        self.padded_vocab_size = pad_vocab_size(config.vocab_size,
                                                config.make_vocab_size_divisible_by, tp)
        self.rng_tracker = parallel.rng_tracker
        params_dtype = parallel.params_dtype

        self.embedding = (scope(Embedding(config, parallel=parallel), "embedding")
                          if pre_process else None)
        self.rotary = (RotaryEmbedding(config.rotary_dim, config.max_positions, config.rotary_base,
                                       config.yarn)
                       if config.position_embedding_type == "rope" else None)
        self.decoder = TransformerBlock(config, layer_range, parallel=parallel,
                                        post_process=post_process)
        scope(self.decoder, "decoder")
        self.output_layer = None
        tied = not config.untie_embeddings_and_output_weights
        if post_process and not (tied and pre_process):
            self.output_layer = nn.Module()
            weight = nn.Parameter(torch.empty(self.padded_vocab_size // tp, config.hidden_size,
                                              dtype=params_dtype))
            mark_vocab_parallel(weight, config.vocab_size, self.padded_vocab_size)
            declare(weight, key=WORD_EMBEDDING if tied else "output_layer.weight")
            if tied:  # the last stage's copy of the word embedding
                weight.init_name = WORD_EMBEDDING
                weight.shared_embedding = True
                weight.shared = True
            weight.embedding_or_output = True
            self.output_layer.weight = weight
        if pre_process and not post_process and (tied or config.mtp_num_layers):
            self.embedding.word_embeddings.weight.shared_embedding = True
        self.mtp = None
        if config.mtp_num_layers and post_process:  # multi-token prediction (model.mtp)
            from megazero.model.mtp import MultiTokenPrediction

            if not tied and not pre_process:
                # MTP embeds tokens here: a copy of the word embedding, kept equal to the
                # first stage's as a tied output layer is (summed gradients, saved once)
                self.mtp_embedding = nn.Module()
                copy = nn.Parameter(torch.empty(self.padded_vocab_size // tp,
                                                config.hidden_size, dtype=params_dtype))
                mark_vocab_parallel(copy, config.vocab_size, self.padded_vocab_size)
                declare(copy, key=WORD_EMBEDDING)
                copy.init_name = WORD_EMBEDDING
                copy.shared_embedding = copy.shared = copy.embedding_or_output = True
                self.mtp_embedding.weight = copy
            self.mtp = scope(MultiTokenPrediction(config, parallel), "mtp")
            if pre_process:  # read outside its module's forward (ZeRO-3 gathers it for all)
                self.embedding.word_embeddings.weight.zero_external = True
        initialize_parameters(self, config, topo, seed)
        self.recompute = recompute or RecomputeConfig()
        apply_recompute(self, self.recompute)

    def materialize_buffers(self, device: torch.device) -> None:
        """Recompute buffers left on the meta device by a build under ``torch.device("meta")``
        (the rotary tables: computed on the host, as a host build computes them, then moved;
        parameters are materialised by :meth:`materialize` or by ZeRO stage 3)."""
        if self.rotary is not None and self.rotary.cos.is_meta:
            c = self.config
            with torch.device("cpu"):
                rotary = RotaryEmbedding(c.rotary_dim, c.max_positions, c.rotary_base, c.yarn)
            self.rotary = rotary.to(device)
        for module in self.modules():  # MoE routers' expert-bias buffers (zeros at start)
            if module is not self and hasattr(module, "materialize_buffers"):
                module.materialize_buffers(device)

    def materialize(self, device: torch.device) -> None:
        """Finish a build on the meta device on ``device``: buffers, then every parameter
        created there and initialised in place, one at a time, never the whole model on the
        host (:mod:`megazero.model.materialize`). Same values as a host build."""
        self.materialize_buffers(device)
        materialize_parameters(self, device, self.seed, self.topo.tp_rank, self.topo.tp_size)

    def param_initializer(self, device: torch.device) -> ParamInitializer:
        """What computes any element of this model's parameters (for ZeRO-3 to materialise
        partitions of a build on the meta device), placing them on ``device``."""
        return ParamInitializer(self.config, self.seed, self.topo.tp_rank, self.topo.tp_size,
                                device)

    @staticmethod
    def default_rng_tracker(seed: int, topo: ParallelTopology, first_layer: int = 0
                            ) -> RNGStatesTracker:
        """Dropout streams as in Megatron: ``seed + 100 * pp_rank`` per pipeline stage (plus the
        chunk's first global layer, so two chunks of one rank never replay the same masks), and
        ``+ 2718 + tp_rank`` for the model-parallel stream. Weight init uses ``seed`` alone."""
        return RNGStatesTracker.for_tensor_parallel(seed + 100 * topo.pp_rank + first_layer,
                                                    topo.tp_rank)

    def shared_embedding_or_output_weight(self) -> nn.Parameter | None:
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        return self.output_layer.weight if self.output_layer is not None else None

    def _output_weight(self) -> torch.Tensor:
        if self.output_layer is not None:
            return self.output_layer.weight
        return self.embedding.word_embeddings.weight

    def forward(self, tokens: torch.Tensor | None, labels: torch.Tensor | None = None,
                hidden_states: torch.Tensor | None = None, *,
                doc_position_ids: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``doc_position_ids`` / ``document_ids`` ``[b, s]``: packed documents kept apart
        (:mod:`megazero.model.packed`; this rank's CP share, as the tokens)."""
        tp = self.topo.tp_size
        for core in self._core_attentions():
            core.documents = document_ids
        if self.pre_process:
            if tokens is None:
                raise ValueError("the first pipeline chunk (pre_process=True) needs tokens")
            check_sequence_split(tokens.shape[1], tp, self.sequence_parallel)
            x = self.embedding(tokens, doc_position_ids)
        else:
            if hidden_states is None:
                raise ValueError("a pipeline chunk without pre_process needs hidden_states")
            x = hidden_states
        seq_len = x.shape[0] * (tp if self.sequence_parallel else 1)
        rotary = self.rotary(seq_len, x.dtype) if self.rotary is not None else None
        if rotary is not None and doc_position_ids is not None:
            rotary = self._rows_rotary(doc_position_ids, x.dtype)
        elif rotary is not None and self.parallel.cp_size > 1:
            rotary = self._cp_rotary(seq_len, x.dtype)
        x = self.decoder(x, rotary)
        if not self.post_process:
            return x
        if self.mtp is not None and labels is not None:
            self.mtp(x, labels, self._embed_ids, self._token_losses, rotary)
        logits = self._logits(x)  # [s, b, V/t]
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        # in place: the logits are ours, and the output layer's backward does not read them
        loss = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1), self.topo.tp_group,
                                            inplace=True)
        return loss.transpose(0, 1).contiguous()

    def _core_attentions(self) -> list[nn.Module]:
        cores = getattr(self, "_cores", None)
        if cores is None:
            from megazero.model.attention import CoreAttention

            cores = [m for m in self.modules() if isinstance(m, CoreAttention)]
            self._cores = cores
        return cores

    def _rows_rotary(self, positions: torch.Tensor, dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary rows ``[s, b, 1, d]`` of per-token positions ``[b, s]``."""
        assert self.rotary is not None
        cos, sin = self.rotary(self.config.max_positions, dtype)
        d = cos.shape[-1]
        return tuple(t.reshape(-1, d)[positions].transpose(0, 1).unsqueeze(2)  # type: ignore
                     for t in (cos, sin))

    def _embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Word embeddings of ``ids [b, s]`` as the model's input ``[s(/t), b, h]`` (no
        positions: MTP's input is the token alone), from whichever copy this chunk holds."""
        weight = (self.embedding.word_embeddings.weight if self.pre_process
                  else self.mtp_embedding.weight if hasattr(self, "mtp_embedding")
                  else self._output_weight())
        group = self.topo.tp_group
        if self.topo.tp_size == 1:
            x = torch.nn.functional.embedding(ids, weight)
        else:
            start = self.topo.tp_rank * weight.shape[0]
            outside = (ids < start) | (ids >= start + weight.shape[0])
            local = torch.nn.functional.embedding((ids - start).masked_fill(outside, 0), weight)
            x = reduce_from_tensor_parallel_region(local.masked_fill(outside.unsqueeze(-1), 0.0),
                                                   group)
        x = x.transpose(0, 1).contiguous()
        return scatter_to_sequence_parallel_region(x, group) if self.sequence_parallel else x

    def _token_losses(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token cross entropy ``[b, s]`` of the output head on hidden states ``x``."""
        loss = vocab_parallel_cross_entropy(self._logits(x), labels.transpose(0, 1),
                                            self.topo.tp_group, inplace=True)
        return loss.transpose(0, 1).contiguous()

    def _cp_rotary(self, local_len: int, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables' rows of this context-parallel rank's positions."""
        from megazero.context_parallel.split import local_positions

        p = self.parallel
        pos = local_positions(local_len * p.cp_size, p.cp_rank, p.cp_size,
                              self.rotary.cos.device)
        cos, sin = self.rotary(local_len * p.cp_size, dtype)
        return cos.index_select(0, pos), sin.index_select(0, pos)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        weight = self._output_weight()
        logits = column_parallel_linear(x, weight, None, self.topo.tp_group,
                                        self.sequence_parallel)
        local = weight.shape[0]
        start = self.topo.tp_rank * local
        if start + local > self.vocab_size:  # padded columns: never a target, zero probability
            pad = torch.arange(start, start + local, device=logits.device) >= self.vocab_size
            logits = logits.masked_fill(pad, float("-inf"))
        return logits
