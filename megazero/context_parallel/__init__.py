"""Context parallelism: the sequence split over a group of ranks, attention across the split.

* :mod:`~megazero.context_parallel.split`: the load-balanced (zigzag) split of a sequence into
  ``2·CP`` chunks, rank ``r`` holding chunks ``r`` and ``2·CP-1-r``.
* :mod:`~megazero.context_parallel.blockwise`: block attention with its log-sum-exp, the fp32
  merge rule and the block backward (pure PyTorch).
* :mod:`~megazero.context_parallel.ring`, :mod:`~megazero.context_parallel.all_gather`,
  :mod:`~megazero.context_parallel.ulysses`: the three ``--cp-comm-type`` schemes as autograd
  functions (``p2p``, ``all_gather``, ``a2a``).
* :mod:`~megazero.context_parallel.attention`: the entry point the model calls.
"""

from megazero.context_parallel.attention import COMM_TYPES, context_parallel_attention

__all__ = ["COMM_TYPES", "context_parallel_attention"]
