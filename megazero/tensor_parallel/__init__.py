"""Tensor (and sequence) parallelism: communication, layers, loss, randomness.

The sums of ``sequence_parallel`` parameters' gradients over the tensor-parallel group are part
of the gradient sync (:meth:`megazero.zero.ZeroOptimizer.finish_grad_sync`)."""

from megazero.tensor_parallel.context import ParallelContext
from megazero.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megazero.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_parallel_linear,
    pad_vocab_size,
    set_tensor_model_parallel_attributes,
)
from megazero.tensor_parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)
from megazero.tensor_parallel.random import RNGStatesTracker, checkpoint
from megazero.tensor_parallel.utils import (
    full_model_state_dict,
    gather_full_param,
    param_is_not_tensor_parallel_duplicate,
    shard_full_param,
)

__all__ = [
    "ColumnParallelLinear", "ParallelContext", "RowParallelLinear", "VocabParallelEmbedding",
    "RNGStatesTracker",
    "checkpoint", "column_parallel_linear",
    "copy_to_tensor_parallel_region", "full_model_state_dict",
    "gather_from_sequence_parallel_region", "gather_from_tensor_parallel_region",
    "gather_full_param", "pad_vocab_size", "param_is_not_tensor_parallel_duplicate",
    "reduce_from_tensor_parallel_region", "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region", "scatter_to_tensor_parallel_region",
    "set_tensor_model_parallel_attributes", "shard_full_param", "vocab_parallel_cross_entropy",
]
