"""The layout's pure rank arithmetic: a :class:`ParallelLayout` maps a global rank to its
``(pp, dp, tp)`` coordinates (and ``cp``, and its place in the expert grid) and lists the ranks of
every group, with no ``torch.distributed`` needed, so it is tested against golden tables up to
thousands of ranks without processes. Ranks are ordered "tp fastest, then dp, then pp":
tensor-parallel groups are neighbouring ranks (one node, NVLink), pipeline groups stride across
the whole world (they carry the least traffic, so they may cross nodes).

Context parallelism (``cp``, the sequence split over ranks) sits between tp and dp, as in
megatron-core: ``rank = tp + TP·(cp + CP·(dp + DP·pp))``. Its coordinate is
:meth:`ParallelLayout.cp_of` (``Coord`` keeps its three fields, so code written before CP is
unchanged at ``cp = 1``). Weights are replicated over CP, so gradients are reduced and ZeRO
shards over the ``dp_cp`` group; the ``dp`` group is the data replicas alone (the sampler's,
which CP ranks share). The expert grid (``etp, ep, edp, pp``) spans the same ranks.

:class:`megazero.distributed.topology.ParallelTopology` builds the process groups from it.
"""


from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from megazero.config.rules import check_expert_grid, check_vpp_needs_pp, check_world_size
from megazero.errors import TopologyError

GROUP_KINDS = ("tp", "dp", "pp", "mp", "embedding")
#: Built only when cp > 1 (at cp = 1 they are single ranks and the dp groups).
CP_GROUP_KINDS = ("cp", "dp_cp")
#: the expert grid's groups, built only for models with MoE layers
EXPERT_GROUP_KINDS = ("ep", "etp", "edp")
#: TP x CP: the ranks holding the tokens of one micro-batch of one data replica (an MoE
#: router counts over it); built only for MoE models with tp > 1 and cp > 1 (otherwise it is
#: the tp or the cp group)
TP_CP_GROUP_KIND = "tp_cp"


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
