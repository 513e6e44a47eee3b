"""What every tensor-parallel layer needs to know, as one value passed to its constructor.

Megatron hands each layer a ``ModelParallelConfig`` / ``TransformerConfig`` plus process groups
looked up from module globals; here one small frozen :class:`ParallelContext` carries the TP
group (with its size and this rank's index), whether sequence parallelism is on, the RNG
tracker whose streams dropout draws from, the core-attention backend and the dtype parameters
are created in. It is built once per rank from the config and the topology
(:meth:`ParallelContext.from_topology`) and handed down unchanged, so a layer never re-derives
"is SP active?" on its own.

``ParallelContext()`` is the single-process context (no group, fp32, no tracker): layers built
with it, or with no context at all, work in a test without any process group.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from megazero.config.rules import sequence_parallel_active
from megazero.distributed.topology import ParallelTopology
from megazero.errors import ConfigError, MegazeroError
from megazero.tensor_parallel.mappings import Group, group_rank, group_size
from megazero.tensor_parallel.overlap import TPCommOverlap
from megazero.tensor_parallel.random import RNGStatesTracker

#: Core-attention implementations; ``auto`` is flash-attn when usable, else SDPA.
ATTENTION_BACKENDS = ("auto", "unfused", "sdpa", "flash")


@dataclass(frozen=True)
class ParallelContext:
    """``tp_size`` / ``tp_rank`` come from ``tp_group`` when one is given; without a group they
    are as passed (1 and 0 by default: a topology built without processes may still say tp=4).
    ``sequence_parallel`` is stored as it takes effect: only with ``tp_size > 1``."""

    tp_group: Group = None
    sequence_parallel: bool = False
    rng_tracker: RNGStatesTracker | None = None
    attention_backend: str = "auto"
    params_dtype: torch.dtype = torch.float32
    tp_size: int = 1
    tp_rank: int = 0
    # Context parallelism: the group this rank splits each sequence with, and how attention
    # crosses the split (see megazero.context_parallel); size and rank as tp's.
    cp_group: Group = None
    cp_comm_type: str = "p2p"
    cp_size: int = 1
    cp_rank: int = 0

    # expert parallelism (MoE layers only): the group of ranks that split a layer's experts
    ep_group: Group = None
    ep_size: int = 1
    ep_rank: int = 0
    # expert tensor parallelism: the group that splits each expert's fc1 (columns) and fc2 (rows)
    etp_group: Group = None
    etp_size: int = 1
    etp_rank: int = 0
    # TP x CP (MoE routers count one micro-batch over it); None: the tp or the cp group alone
    tp_cp_group: Group = None
    # --tp-comm-overlap: which sequence-parallel collectives run inside the linear layers'
    # GEMMs (megazero.tensor_parallel.overlap); None, or without sequence parallelism: none
    tp_comm_overlap: TPCommOverlap | None = None

    def __post_init__(self) -> None:
        if self.cp_group is not None:
            object.__setattr__(self, "cp_size", group_size(self.cp_group))
            object.__setattr__(self, "cp_rank", group_rank(self.cp_group))
        if self.ep_group is not None:
            object.__setattr__(self, "ep_size", group_size(self.ep_group))
            object.__setattr__(self, "ep_rank", group_rank(self.ep_group))
        if self.etp_group is not None:
            object.__setattr__(self, "etp_size", group_size(self.etp_group))
            object.__setattr__(self, "etp_rank", group_rank(self.etp_group))
        if self.tp_group is not None:
            size, rank = group_size(self.tp_group), group_rank(self.tp_group)
            if (self.tp_size, self.tp_rank) not in ((1, 0), (size, rank)):
                raise ValueError(f"tp_size {self.tp_size} / tp_rank {self.tp_rank} disagree with "
                                 f"the tp_group (size {size}, rank {rank}); pass the group alone")
            object.__setattr__(self, "tp_size", size)
            object.__setattr__(self, "tp_rank", rank)
        object.__setattr__(self, "sequence_parallel",
                           sequence_parallel_active(bool(self.sequence_parallel), self.tp_size))
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"attention_backend {self.attention_backend!r}: expected one of "
                              f"{ATTENTION_BACKENDS}")

    @classmethod
    def from_topology(cls, topo: ParallelTopology, *, sequence_parallel: bool = False,
                      rng_tracker: RNGStatesTracker | None = None,
                      attention_backend: str = "auto",
                      params_dtype: torch.dtype = torch.float32,
                      cp_comm_type: str = "p2p",
                      tp_comm_overlap: TPCommOverlap | None = None) -> ParallelContext:
        """This rank's context: ``topo``'s TP (and CP) group, size and rank, and the given
        settings."""
        return cls(tp_group=topo.tp_group, sequence_parallel=sequence_parallel,
                   rng_tracker=rng_tracker, attention_backend=attention_backend,
                   params_dtype=params_dtype, tp_size=topo.tp_size, tp_rank=topo.tp_rank,
                   cp_group=topo.cp_group if topo.cp_size > 1 else None,
                   cp_comm_type=cp_comm_type, cp_size=topo.cp_size, cp_rank=topo.cp_rank,
                   ep_group=topo.ep_group, ep_size=topo.ep_size if topo.ep_group is None else 1,
                   ep_rank=topo.ep_rank if topo.ep_group is None else 0,
                   etp_group=topo.etp_group,
                   etp_size=topo.etp_size if topo.etp_group is None else 1,
                   etp_rank=topo.etp_rank if topo.etp_group is None else 0,
                   tp_cp_group=topo.tp_cp_group if topo.cp_size > 1 and topo.tp_size > 1
                   else None, tp_comm_overlap=tp_comm_overlap)

    @property
    def overlap(self) -> TPCommOverlap | None:
        """The TP communication overlap in effect: only with sequence parallelism."""
        return self.tp_comm_overlap if self.sequence_parallel else None

    def fork(self, stream: str) -> contextlib.AbstractContextManager[None]:
        """Draw random numbers from ``stream`` of the tracker (dropout); see
        :mod:`megazero.tensor_parallel.random` for which stream suits which activation."""
        if self.rng_tracker is None:
            raise MegazeroError(
                "dropout needs an RNG tracker, and this ParallelContext has none: pass "
                "rng_tracker=RNGStatesTracker.for_tensor_parallel(seed, tp_rank) to "
                "ParallelContext, or build the layer inside a GPTModel (which makes one)")
        return self.rng_tracker.fork(stream)
