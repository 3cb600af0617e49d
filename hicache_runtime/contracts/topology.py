"""Who a rank is: its global rank, TP, PP and DP coordinates, and the slice of the model it owns.

Global ranks are laid out stage-major, as SGLang does: ``rank = pp_rank * tp_size + tp_rank``.
With several DP groups each group is a torch.distributed world of its own, so ``rank`` is the
rank in its group's world (what every collective and point-to-point op addresses), and the rank
in the whole grid, which names its files in a bundle, is ``dp_rank * tp_size * pp_size + rank``
(:attr:`RankInfo.grid_rank`). With one group the two are the same.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RankInfo:
    """The identity of one rank process. Immutable; passed to every per-rank object."""

    rank: int = 0
    tp_rank: int = 0
    pp_rank: int = 0
    tp_size: int = 1
    pp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1

    @classmethod
    def of(cls, rank: int, tp_size: int, pp_size: int, dp_rank: int = 0,
           dp_size: int = 1) -> RankInfo:
        return cls(rank, rank % tp_size, rank // tp_size, tp_size, pp_size, dp_rank, dp_size)

    @property
    def world_size(self) -> int:
        """Ranks of this rank's DP group (its torch.distributed world)."""
        return self.tp_size * self.pp_size

    @property
    def grid_rank(self) -> int:
        """The rank in the whole ``dp × pp × tp`` grid."""
        return self.dp_rank * self.world_size + self.rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def label(self) -> str:
        """Short name used in logs and bundles, in SGLang's style: ``TP1 PP0``, ``DP1 TP1 PP0``
        when the run has several DP groups."""
        dp = f"DP{self.dp_rank} " if self.dp_size > 1 else ""
        return f"{dp}TP{self.tp_rank} PP{self.pp_rank}"

    def stage_ranks(self, pp_rank: int) -> list[int]:
        """Ranks (in this DP group's world) of every TP rank in stage ``pp_rank``."""
        return [pp_rank * self.tp_size + t for t in range(self.tp_size)]

    def layer_range(self, num_layers: int) -> range:
        """This stage's layers: an even split, earlier stages take the remainder."""
        return _split(num_layers, self.pp_size, self.pp_rank)

    def head_range(self, num_heads: int) -> range:
        return _split(num_heads, self.tp_size, self.tp_rank)

    def shard_range(self, size: int) -> range:
        """This TP rank's slice of a dimension of ``size`` (ffn columns, etc.)."""
        return _split(size, self.tp_size, self.tp_rank)


def _split(total: int, parts: int, index: int) -> range:
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (1 if index < extra else 0))
