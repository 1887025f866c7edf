"""Which process this is, and how the processes of one extraction agree.

Inside a ``torch.distributed`` job (torchrun, accelerate, or a process group of your own) the
rank and world size come from the process group. The processes meet after every step of an
extraction (reading the store, the first batch, comparing configurations, rank 0 making the
store, reading the manifest, writing chunks, rank 0 completing the store). Each meeting is an
``all_gather_object`` of every rank's error (or None), not a bare barrier: when one rank
fails, the others learn it at the next meeting and raise too (``StoreWriteError`` naming the
rank and its error), instead of waiting for it forever. With nccl, the current CUDA device
must be the rank's own (``torch.cuda.set_device``), as for any nccl collective.
"""

from __future__ import annotations

from dataclasses import dataclass

from hookscope.errors import SpecError, StoreWriteError

__all__ = ["Ranks", "resolve_ranks"]


@dataclass(frozen=True)
class Ranks:
    """This process's rank among ``world_size``; ``agree`` is the meeting described above."""

    rank: int
    world_size: int
    distributed: bool

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def agree(self, failure: BaseException | None, step: str) -> None:
        """Meet the other ranks; raise if any of them (or this one) failed before ``step``."""
        if not self.distributed:
            if failure is not None:
                raise failure
            return
        import torch.distributed as dist

        reports: list[str | None] = [None] * self.world_size
        mine = None if failure is None else f"{type(failure).__name__}: {failure}"
        dist.all_gather_object(reports, mine)
        if failure is not None:
            raise failure
        failed = [(rank, report) for rank, report in enumerate(reports) if report is not None]
        if failed:
            rank, report = failed[0]
            raise StoreWriteError(f"rank {rank} of {self.world_size} failed {step}: {report}")


def resolve_ranks(rank: int | None, world_size: int | None) -> Ranks:
    """The ranks of this job: from the process group when one is initialised, else one process.

    ``rank`` and ``world_size``, when given, must agree with the process group (they document
    the call in code written for other launchers); a world of several processes needs one.
    """
    import torch.distributed as dist

    live = dist.is_available() and dist.is_initialized()
    found_rank, found_world = (dist.get_rank(), dist.get_world_size()) if live else (0, 1)
    for name, given, found in (("rank", rank, found_rank), ("world_size", world_size, found_world)):
        if given is None:
            continue
        if isinstance(given, bool) or not isinstance(given, int) or given < 0:
            raise SpecError(f"{name}={given!r} must be an int >= 0")
        if live and given != found:
            raise SpecError(
                f"{name}={given} differs from the process group's {found}; drop {name}= to use the process group's"
            )
    if not live:
        wanted_world = world_size if world_size is not None else 1
        if wanted_world > 1:
            raise SpecError(
                f"world_size={wanted_world} needs torch.distributed initialised (torchrun and accelerate do it; else "
                "torch.distributed.init_process_group), so that the processes can agree on the store"
            )
        if rank not in (None, 0):
            raise SpecError(f"rank={rank} without a process group; a single process is rank 0")
    return Ranks(found_rank, found_world, distributed=live and found_world > 1)
