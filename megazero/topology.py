"""Process-group topology: the one value that knows every parallel axis.

A :class:`ParallelLayout` is pure rank arithmetic (no torch.distributed needed): it maps a
global rank to its ``(pp, dp, tp)`` coordinates and lists the ranks of every group. Ranks are
ordered "tp fastest, then dp, then pp": tensor-parallel groups are neighbouring ranks (one node,
NVLink), pipeline groups stride across the whole world (they carry the least traffic, so they
may cross nodes).

Context parallelism (``cp``, the sequence split over ranks) sits between tp and dp, as in
megatron-core: ``rank = tp + TP·(cp + CP·(dp + DP·pp))``. Its coordinate is
:meth:`ParallelLayout.cp_of` (``Coord`` keeps its three fields, so code written before CP is
unchanged at ``cp = 1``). Weights are replicated over CP, so gradients are reduced and ZeRO
shards over the ``dp_cp`` group (``grad_group``); the ``dp`` group is the data replicas alone
(the sampler's, which CP ranks share).

A :class:`ParallelTopology` is a layout plus this process's rank plus the
``torch.distributed`` groups built from it. It is created once, collectively, and passed
explicitly to everything that communicates; there is no module-level state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import NamedTuple

import torch.distributed as dist
from torch.distributed import ProcessGroup

from megazero.config.rules import check_expert_grid, check_vpp_needs_pp, check_world_size

GROUP_KINDS = ("tp", "dp", "pp", "mp", "embedding")
#: Built only when cp > 1 (at cp = 1 they are single ranks and the dp groups).
CP_GROUP_KINDS = ("cp", "dp_cp")
#: the expert grid's groups, built only for models with MoE layers
EXPERT_GROUP_KINDS = ("ep", "etp", "edp")
#: TP x CP: the ranks holding the tokens of one micro-batch of one data replica (an MoE
#: router counts over it); built only for MoE models with tp > 1 and cp > 1 (otherwise it is
#: the tp or the cp group)
TP_CP_GROUP_KIND = "tp_cp"


class TopologyError(ValueError):
    """A layout that cannot be built from the sizes given."""


class Coord(NamedTuple):
    pp: int
    dp: int
    tp: int


class ExpertCoord(NamedTuple):
    pp: int
    edp: int
    ep: int
    etp: int


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of the process grid and the rank arithmetic over it.

    ``vpp`` is the number of virtual pipeline chunks per stage (interleaved 1F1B); it does not
    change the grid, only how many model chunks each pipeline rank holds.
    """

    world_size: int
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    ep: int = 1  # expert-parallel size (the expert grid)
    etp: int = 1  # expert-tensor-parallel size

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "cp", "ep", "etp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise TopologyError(f"{name} must be a positive integer, got {value!r}")
        if self.vpp is not None:
            if not isinstance(self.vpp, int) or isinstance(self.vpp, bool) or self.vpp < 1:
                raise TopologyError(f"vpp must be a positive integer or None, got {self.vpp!r}")
        check_vpp_needs_pp(self.pp, self.vpp, error=TopologyError)
        check_world_size(self.world_size, self.tp, self.pp, error=TopologyError, cp=self.cp)
        check_expert_grid(self.world_size, self.ep, self.etp, self.pp, error=TopologyError)

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: the replicas of each expert."""
        return self.world_size // (self.etp * self.ep * self.pp)

    @property
    def num_chunks(self) -> int:
        """Model chunks per pipeline rank (1 without interleaving)."""
        return self.vpp or 1

    # --- coordinates -------------------------------------------------------------------------

    def coords(self, rank: int) -> Coord:
        self._check_rank(rank)
        tp = rank % self.tp
        dp = (rank // (self.tp * self.cp)) % self.dp
        pp = rank // (self.tp * self.cp * self.dp)
        return Coord(pp=pp, dp=dp, tp=tp)

    def cp_of(self, rank: int) -> int:
        """The context-parallel coordinate of ``rank`` (0 when cp = 1)."""
        self._check_rank(rank)
        return (rank // self.tp) % self.cp

    def rank(self, pp: int, dp: int, tp: int, cp: int = 0) -> int:
        if not (0 <= pp < self.pp and 0 <= dp < self.dp and 0 <= tp < self.tp
                and 0 <= cp < self.cp):
            raise TopologyError(
                f"coordinates (pp={pp}, dp={dp}, tp={tp}, cp={cp}) outside the grid "
                f"pp<{self.pp}, dp<{self.dp}, tp<{self.tp}, cp<{self.cp}"
            )
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def expert_coords(self, rank: int) -> ExpertCoord:
        """``rank``'s place in the expert grid (order etp, ep, edp, pp: etp fastest)."""
        self._check_rank(rank)
        etp = rank % self.etp
        ep = (rank // self.etp) % self.ep
        edp = (rank // (self.etp * self.ep)) % self.edp
        return ExpertCoord(pp=rank // (self.etp * self.ep * self.edp), edp=edp, ep=ep, etp=etp)

    def expert_rank(self, pp: int, edp: int, ep: int, etp: int) -> int:
        if not (0 <= pp < self.pp and 0 <= edp < self.edp and 0 <= ep < self.ep
                and 0 <= etp < self.etp):
            raise TopologyError(
                f"expert coordinates (pp={pp}, edp={edp}, ep={ep}, etp={etp}) outside the grid "
                f"pp<{self.pp}, edp<{self.edp}, ep<{self.ep}, etp<{self.etp}")
        return etp + self.etp * (ep + self.ep * (edp + self.edp * pp))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} outside world of size {self.world_size}")

    # --- groups ------------------------------------------------------------------------------

    def group_ranks(self, kind: str, rank: int) -> list[int]:
        """The ranks of the ``kind`` group that contains ``rank`` (sorted)."""
        c, cp = self.coords(rank), self.cp_of(rank)
        if kind == "tp":
            return [self.rank(c.pp, c.dp, t, cp) for t in range(self.tp)]
        if kind == "dp":
            return [self.rank(c.pp, d, c.tp, cp) for d in range(self.dp)]
        if kind == "pp":
            return [self.rank(p, c.dp, c.tp, cp) for p in range(self.pp)]
        if kind == "mp":
            return sorted(self.rank(p, c.dp, t, cp) for p in range(self.pp)
                          for t in range(self.tp))
        if kind == "embedding":
            stages = sorted({0, self.pp - 1})
            return [self.rank(p, c.dp, c.tp, cp) for p in stages]
        if kind == "cp":
            return [self.rank(c.pp, c.dp, c.tp, x) for x in range(self.cp)]
        if kind == "dp_cp":
            return sorted(self.rank(c.pp, d, c.tp, x) for d in range(self.dp)
                          for x in range(self.cp))
        if kind == TP_CP_GROUP_KIND:  # sorted: cp-major, tp-minor (zigzag shares' order)
            return sorted(self.rank(c.pp, c.dp, t, x) for t in range(self.tp)
                          for x in range(self.cp))
        if kind in EXPERT_GROUP_KINDS:
            e = self.expert_coords(rank)
            if kind == "ep":
                return [self.expert_rank(e.pp, e.edp, i, e.etp) for i in range(self.ep)]
            if kind == "etp":
                return [self.expert_rank(e.pp, e.edp, e.ep, i) for i in range(self.etp)]
            return [self.expert_rank(e.pp, i, e.ep, e.etp) for i in range(self.edp)]
        raise TopologyError(f"unknown group kind {kind!r}; expected one of "
                            f"{GROUP_KINDS + CP_GROUP_KINDS + EXPERT_GROUP_KINDS}"
                            f" or {TP_CP_GROUP_KIND!r}")

    def all_groups(self, kind: str) -> list[list[int]]:
        """Every ``kind`` group of the world, ordered by their smallest rank."""
        seen: dict[int, list[int]] = {}
        for r in range(self.world_size):
            ranks = self.group_ranks(kind, r)
            seen.setdefault(ranks[0], ranks)
        return [seen[k] for k in sorted(seen)]


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
