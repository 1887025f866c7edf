"""What a capture answers when read: the :class:`~hookscope._capture.cache.Cache` of its latest pass.

Why a module of its own: :class:`~hookscope._capture.recorder.Capture` keeps values during the
forward; reading them (``capture["fc"]``, ``capture.calls(...)``, ``capture.save(...)``) only
hands each question to the cache of the latest pass, or, with ``passes="all"``, lists every
pass's. :class:`LatestPass` is that read side, which ``Capture`` inherits.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from hookscope._capture.cache import Cache
from hookscope._capture.keeper import Keeper
from hookscope._core.sites import Site

__all__ = ["LatestPass"]


class LatestPass:
    """Reads like the :class:`Cache` of the latest pass (``_keeper.cache``); with ``passes="all"``
    (``_keep_passes``), :attr:`passes` lists every finished pass's (``_passes``)."""

    _keeper: Keeper
    _keep_passes: bool
    _passes: list[Cache]

    @property
    def cache(self) -> Cache:
        """The :class:`Cache` of the latest forward pass."""
        return self._keeper.cache

    @property
    def passes(self) -> list[Cache]:
        """With ``passes="all"``, the :class:`Cache` of every finished forward pass, in order (a
        generation loop: the prefill, then one per new token); otherwise the latest one's."""
        if self._keep_passes:
            return list(self._passes)
        return [self._keeper.cache]

    def __getitem__(self, key: str | Site) -> torch.Tensor:
        return self.cache[key]

    def __contains__(self, key: object) -> bool:
        return key in self.cache

    def __iter__(self) -> Iterator[str]:
        return iter(self.cache)

    def __len__(self) -> int:
        return len(self.cache)

    def calls(self, key: str | Site) -> list[torch.Tensor]:
        """Every call's value for ``key``, in order (see :meth:`Cache.calls`)."""
        return self.cache.calls(key)

    def sites(self) -> list[Site]:
        """Every site captured in the latest pass."""
        return self.cache.sites()

    @property
    def nbytes(self) -> int:
        """Bytes held by the latest pass's values."""
        return self.cache.nbytes

    def numpy(self) -> dict[str, Any]:
        """The latest pass's values as numpy arrays (see :meth:`Cache.numpy`)."""
        return self.cache.numpy()

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Save the latest pass's values (see :meth:`Cache.save`)."""
        return self.cache.save(path)
