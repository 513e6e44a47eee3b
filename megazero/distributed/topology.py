"""Process-group topology: the one value that knows every parallel axis.

A :class:`ParallelTopology` is a layout (:class:`megazero.config.layout.ParallelLayout`, the
pure rank arithmetic) plus this process's rank plus the ``torch.distributed`` groups built from
it. It is created once, collectively, and passed explicitly to everything that communicates;
there is no module-level state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import ProcessGroup

from megazero.config.layout import (
    CP_GROUP_KINDS,
    EXPERT_GROUP_KINDS,
    GROUP_KINDS,
    TP_CP_GROUP_KIND,
    Coord,
    ExpertCoord,
    ParallelLayout,
)
from megazero.errors import TopologyError


@dataclass
class ParallelTopology:
    """A layout, this process's rank, and the torch.distributed groups it belongs to.

    Build it with :meth:`build` on every rank at once (group creation is collective), or with
    :meth:`single` for a one-process run without torch.distributed.
    """

    layout: ParallelLayout
    rank: int
    groups: dict[str, ProcessGroup | None] = field(default_factory=dict)

    @classmethod
    def single(cls) -> ParallelTopology:
        return cls(ParallelLayout(world_size=1), rank=0, groups={k: None for k in GROUP_KINDS})

    @classmethod
    def build(
        cls, tp: int = 1, pp: int = 1, vpp: int | None = None, world_size: int | None = None,
        rank: int | None = None, timeout: timedelta | None = None, cp: int = 1, *,
        ep: int = 1, etp: int = 1, expert_groups: bool = False,
    ) -> ParallelTopology:
        """Create every group of the layout. Must be called by all ranks, in the same order.

        ``torch.distributed.new_group`` is collective over the whole world even for ranks that
        are not members, so every rank creates every group and keeps the ones it belongs to.
        ``timeout`` (``--distributed-timeout-minutes``) applies to every group's collectives;
        without it ``new_group`` would not inherit the main group's timeout but take the
        backend default (30 minutes for gloo).
        ``expert_groups`` (a model with MoE layers): also the expert grid's ``ep``, ``etp`` and
        ``edp`` groups of sizes ``ep``, ``etp`` and ``world / (etp * ep * pp)``, and with
        both tp > 1 and cp > 1 the ``tp_cp`` group (:attr:`ParallelTopology.tp_cp_group`).
        """
        kinds = (GROUP_KINDS + (CP_GROUP_KINDS if cp > 1 else ())
                 + (EXPERT_GROUP_KINDS if expert_groups else ())
                 + ((TP_CP_GROUP_KIND,) if expert_groups and cp > 1 and tp > 1 else ()))
        if not dist.is_initialized():
            if (world_size or 1) != 1:
                raise TopologyError("torch.distributed is not initialised; call init first")
            return cls(ParallelLayout(1, tp, pp, vpp, cp, ep=ep, etp=etp), 0,
                       {k: None for k in kinds})
        world_size = dist.get_world_size() if world_size is None else world_size
        rank = dist.get_rank() if rank is None else rank
        layout = ParallelLayout(world_size, tp, pp, vpp, cp, ep=ep, etp=etp)
        mine: dict[str, ProcessGroup | None] = {}
        for kind in kinds:
            for ranks in layout.all_groups(kind):
                group = dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    mine[kind] = group
        return cls(layout, rank, mine)

    def destroy_groups(self) -> None:
        """Destroy the groups :meth:`build` made. Collective: every rank, once the run on this
        layout has finished its last collective. A process that trains one layout after
        another (``tools/check_cluster.py``) would otherwise keep every layout's
        communicators (an NCCL one holds GPU memory) and worker threads to the end."""
        for group in {id(g): g for g in self.groups.values() if g is not None}.values():
            dist.destroy_process_group(group)
        self.groups = dict.fromkeys(self.groups)

    # --- sizes and ranks along each axis -------------------------------------------------------

    @property
    def coord(self) -> Coord:
        return self.layout.coords(self.rank)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def tp_size(self) -> int:
        return self.layout.tp

    @property
    def pp_size(self) -> int:
        return self.layout.pp

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def vpp_size(self) -> int | None:
        return self.layout.vpp

    @property
    def tp_rank(self) -> int:
        return self.coord.tp

    @property
    def pp_rank(self) -> int:
        return self.coord.pp

    @property
    def dp_rank(self) -> int:
        return self.coord.dp

    @property
    def cp_size(self) -> int:
        return self.layout.cp

    @property
    def cp_rank(self) -> int:
        return self.layout.cp_of(self.rank)

    @property
    def cp_group(self) -> ProcessGroup | None:
        return self.groups.get("cp")

    @property
    def grad_size(self) -> int:
        """Ranks holding the same weights (data replicas x context-parallel ranks): the size of
        the group gradients are reduced over and ZeRO shards over (dp at cp = 1)."""
        return self.layout.dp * self.layout.cp

    @property
    def grad_rank(self) -> int:
        """This rank's index in :attr:`grad_group` (its ranks sorted: dp-major, cp-minor)."""
        return self.dp_rank * self.layout.cp + self.cp_rank

    @property
    def grad_group(self) -> ProcessGroup | None:
        """The ``dp_cp`` group (the ``dp`` group itself when cp = 1)."""
        return self.groups.get("dp_cp") if self.layout.cp > 1 else self.groups.get("dp")

    @property
    def tp_group(self) -> ProcessGroup | None:
        return self.groups.get("tp")

    @property
    def tp_cp_group(self) -> ProcessGroup | None:
        """The TP x CP ranks of this rank's data replica and stage (megatron-core's
        tensor-and-context-parallel group): together they hold one micro-batch's tokens. The
        tp group at cp = 1, the cp group at tp = 1; its own group (built for MoE models)
        otherwise. Group rank ``cp * TP + tp``: the shares concatenated in group order are the
        CP ranks' zigzag shares in CP order, each cut into its TP (sequence-parallel) slices."""
        if self.layout.cp == 1:
            return self.tp_group
        if self.layout.tp == 1:
            return self.cp_group
        return self.groups.get(TP_CP_GROUP_KIND)

    @property
    def pp_group(self) -> ProcessGroup | None:
        return self.groups.get("pp")

    @property
    def dp_group(self) -> ProcessGroup | None:
        return self.groups.get("dp")

    @property
    def mp_group(self) -> ProcessGroup | None:
        return self.groups.get("mp")

    @property
    def embedding_group(self) -> ProcessGroup | None:
        return self.groups.get("embedding")

    # --- the expert grid ----------------------------------------------------------------------

    @property
    def expert_coord(self) -> ExpertCoord:
        return self.layout.expert_coords(self.rank)

    @property
    def ep_size(self) -> int:
        return self.layout.ep

    @property
    def ep_rank(self) -> int:
        return self.expert_coord.ep

    @property
    def etp_size(self) -> int:
        return self.layout.etp

    @property
    def etp_rank(self) -> int:
        return self.expert_coord.etp

    @property
    def edp_size(self) -> int:
        return self.layout.edp

    @property
    def edp_rank(self) -> int:
        return self.expert_coord.edp

    @property
    def ep_group(self) -> ProcessGroup | None:
        return self.groups.get("ep")

    @property
    def edp_group(self) -> ProcessGroup | None:
        return self.groups.get("edp")

    @property
    def etp_group(self) -> ProcessGroup | None:
        return self.groups.get("etp")

    def ranks(self, kind: str) -> list[int]:
        """Global ranks of this process's ``kind`` group."""
        return self.layout.group_ranks(kind, self.rank)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def next_pp_rank(self) -> int:
        """Global rank of the next pipeline stage (wraps around)."""
        c = self.coord
        return self.layout.rank((c.pp + 1) % self.pp_size, c.dp, c.tp, self.cp_rank)

    @property
    def prev_pp_rank(self) -> int:
        c = self.coord
        return self.layout.rank((c.pp - 1) % self.pp_size, c.dp, c.tp, self.cp_rank)

    @property
    def in_embedding_group(self) -> bool:
        return self.is_first_stage or self.is_last_stage

    def __repr__(self) -> str:
        c = self.coord
        return (
            f"ParallelTopology(rank={self.rank}, tp={c.tp}/{self.tp_size}, "
            f"dp={c.dp}/{self.dp_size}, pp={c.pp}/{self.pp_size}, vpp={self.vpp_size}"
            + (f", cp={self.cp_rank}/{self.cp_size})" if self.cp_size > 1 else ")")
        )
