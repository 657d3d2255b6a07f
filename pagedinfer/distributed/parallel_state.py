"""Process groups for tensor and pipeline parallelism, and the collectives the model uses.

One engine core drives `tp * pp` worker ranks. Rank r sits at pipeline stage `r // tp` and
tensor rank `r % tp` (TP innermost, as in vLLM: the ranks of one stage are contiguous). Every
worker calls `init_distributed` once; it builds the world group over gloo (the CPU backend;
NCCL would take its place on GPUs) and one TP and one PP group per position.

The model never sees torch.distributed directly: it asks `get_tp_group()` /
`get_pp_group()` for a `GroupCoordinator`, whose collectives are no-ops on a group of one. A
process that never calls `init_distributed` (the in-process executor, the tests) therefore
runs the unsharded model unchanged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

__all__ = [
    "GroupCoordinator",
    "init_distributed",
    "destroy_distributed",
    "get_tp_group",
    "get_pp_group",
    "get_pp_indices",
]


@dataclass
class GroupCoordinator:
    """One process group seen from one of its members."""

    ranks: list[int]
    """Global ranks of the members, in group order."""
    rank_in_group: int
    group: dist.ProcessGroup | None = None
    """None for a group of one (nothing to communicate)."""

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place (returns `tensor`)."""
        if self.group is not None:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every member's `tensor` (same shape on all), concatenated along `dim` in rank
        order."""
        if self.group is None:
            return tensor
        parts = [torch.empty_like(tensor) for _ in self.ranks]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def send(self, tensors: list[torch.Tensor], dst_in_group: int) -> None:
        """Point-to-point, blocking: the receiver knows the shapes (both sides derive them
        from the same scheduler output), so only the data crosses."""
        assert self.group is not None
        for t in tensors:
            dist.send(t.contiguous(), self.ranks[dst_in_group], group=self.group)

    def recv(self, tensors: list[torch.Tensor], src_in_group: int) -> None:
        """Fill `tensors` (preallocated, shapes as sent) from `src_in_group`."""
        assert self.group is not None
        for t in tensors:
            dist.recv(t, self.ranks[src_in_group], group=self.group)


_SINGLE = GroupCoordinator(ranks=[0], rank_in_group=0)
_TP: GroupCoordinator = _SINGLE
_PP: GroupCoordinator = _SINGLE


def get_tp_group() -> GroupCoordinator:
    return _TP


def get_pp_group() -> GroupCoordinator:
    return _PP


def init_distributed(
    rank: int, tensor_parallel_size: int, pipeline_parallel_size: int, init_method: str
) -> None:
    """Join the world group (`init_method`: "tcp://host:port", the same for every rank) and
    build the TP and PP groups. Every rank must call this with the same sizes:
    `new_group` is itself collective, so all groups are made by all ranks, in one order."""
    global _TP, _PP
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    world = tp * pp
    if world == 1:
        return
    dist.init_process_group("gloo", init_method=init_method, world_size=world, rank=rank)
    for stage in range(pp):  # TP groups: the ranks of one stage
        ranks = list(range(stage * tp, (stage + 1) * tp))
        group = dist.new_group(ranks, backend="gloo")
        if rank in ranks:
            _TP = GroupCoordinator(ranks, ranks.index(rank), group if tp > 1 else None)
    for position in range(tp):  # PP groups: one rank per stage, same TP position
        ranks = list(range(position, world, tp))
        group = dist.new_group(ranks, backend="gloo")
        if rank in ranks:
            _PP = GroupCoordinator(ranks, ranks.index(rank), group if pp > 1 else None)
    logger.debug("rank %d: tp %d/%d, pp %d/%d", rank, _TP.rank_in_group, tp,
                 _PP.rank_in_group, pp)  # fmt: skip


def destroy_distributed() -> None:
    global _TP, _PP
    _TP = _PP = _SINGLE
    if dist.is_initialized():
        dist.destroy_process_group()


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the decoder layers stage `pp_rank` runs: `num_layers // pp_size`
    each; the remainder goes one layer each to the stages counting back from the
    second-to-last, so the last stage (which also runs the norm, LM head and sampler) never
    gets an extra one."""
    base, extra = divmod(num_layers, pp_size)
    sizes = [base] * pp_size
    for i in range(extra):
        sizes[pp_size - 2 - i if pp_size > 1 else 0] += 1
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]
