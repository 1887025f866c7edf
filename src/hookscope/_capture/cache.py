"""``Cache``: captured values by site, read-only, addressable by short or full site names.

A key names a module and, optionally, which call, which value and which leaf of a structured
value: ``"fc"`` is the output of ``fc``'s last call; ``"block#1"`` its second call;
``"fc:input"`` its input; ``"h.0:output[0]"`` the first element of a tuple output;
``"model#0:output.last_hidden_state"`` a ``ModelOutput`` field; a leaf may also be written
relative to the value left out (``"h.0:[0]"``). Left out, the call is the last one, the value is
the output (the input if only inputs were kept), and the leaf is the value itself when it is a
tensor, or its only tensor. A key that names nothing raises
``SiteNotFoundError`` with the closest names, or the leaf paths to choose from, in its message
and as keys that do name something (``.candidates``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hookscope._capture.stack import Stacked, stack
from hookscope._core.compat.internals import version_counter
from hookscope._core.site_index import SiteIndex
from hookscope._core.sites import Site, short_names
from hookscope._core.std_names import STD_PREFIX, StdMap, std_matches, std_pattern
from hookscope._shared.bits import NUMPY_LACKS
from hookscope._shared.dtypes import dtype_name
from hookscope._shared.tables import Column, Table
from hookscope._shared.units import counted, format_bytes
from hookscope.errors import CaptureError, FileFormatError, SiteNotFoundError, SpecError

__all__ = ["Cache", "load", "tensor_bytes"]

_SITES_KEY = "hookscope_sites"  # in a saved file's metadata: each stored name's full site


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor's elements; for a sparse tensor, of its indices and values."""
    if tensor.is_sparse:
        return tensor_bytes(tensor._indices()) + tensor_bytes(tensor._values())
    return tensor.numel() * tensor.element_size()


class Cache(Mapping[str, torch.Tensor]):
    """Captured tensors by :class:`~hookscope._core.sites.Site`; read-only.

    ``cache["fc"]`` is ``fc``'s output in its last call; ``cache.calls("block")`` lists every
    call's value in order; iterating yields every full site name (``"fc#0:output"``).

    >>> cache = Cache({Site("fc", 0): torch.ones(2, 3)})
    >>> cache["fc"].shape, list(cache), cache.nbytes
    (torch.Size([2, 3]), ['fc#0:output'], 24)
    """

    def __init__(
        self,
        entries: Mapping[Site, torch.Tensor] | None = None,
        *,
        meta: Mapping[str, Any] | None = None,
        versions: Mapping[Site, int | None] | None = None,
    ) -> None:
        self._entries: dict[Site, torch.Tensor] = dict(entries or {})
        self._versions: dict[Site, int | None] = dict(versions or {})
        self.meta: dict[str, Any] = dict(meta or {})
        self._index: SiteIndex | None = None
        self._hint = (
            "the cache is empty (did the forward run inside the capture, on the thread that made it? "
            "forwards on other threads are not captured)"
        )
        self._empty: dict[str, str] = {}
        self._overflowed: dict[str, int] = {}
        self._grads: dict[Site, torch.Tensor] = {}
        self._no_grad: dict[Site, str] = {}
        self._grad_versions: dict[Site, int | None] = {}
        #: The canonical map of the model the values came from (set by the capture): a value
        #: captured by module name answers to its canonical names too.
        self._canonical: Callable[[], StdMap] | None = None

    # -- filled by the recorder while a forward runs ------------------------------------------

    def _put(self, site: Site, tensor: torch.Tensor, version: int | None) -> None:
        self._entries[site] = tensor
        self._versions[site] = version
        self._index = None

    def _drop(self, site: Site) -> None:
        self._entries.pop(site, None)
        self._versions.pop(site, None)
        self._grads.pop(site, None)
        self._grad_versions.pop(site, None)
        self._no_grad.pop(site, None)
        self._index = None

    def _add_grad(self, site: Site, grad: torch.Tensor) -> None:
        """A backward reached ``site``: keep its gradient, summed with an earlier backward's (as
        ``.grad`` accumulates); a grad of a site dropped since (``calls="last"``) is not kept."""
        if site not in self._entries:
            return
        previous = self._grads.get(site)
        self._grads[site] = grad if previous is None else previous + grad
        self._grad_versions[site] = version_counter(self._grads[site])

    def _note_no_grad(self, site: Site, why: str) -> None:
        self._no_grad[site] = why

    def _get(self, site: Site) -> torch.Tensor | None:
        return self._entries.get(site)

    def _version_of(self, site: Site) -> int | None:
        return self._versions.get(site)

    def _note_empty(self, module: str, what: str, type_name: str) -> None:
        self._empty.setdefault(module, f"{module!r} ran, but its {what} held no tensor ({type_name})")

    def _items(self) -> Iterator[tuple[Site, torch.Tensor]]:
        return iter(list(self._entries.items()))

    # -- reading ----------------------------------------------------------------------------------

    @property
    def overflowed(self) -> dict[str, int]:
        """How many finite values the ``dtype=`` cast turned into +-inf, by site; empty when none
        did (float16 stops at 65504). The capture's ``overflow`` option says what else happens."""
        return dict(self._overflowed)

    def __getitem__(self, key: str | Site) -> torch.Tensor:
        return self._checked(self.resolve(key))

    def __iter__(self) -> Iterator[str]:
        return (str(site) for site in list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, (str, Site)):
            return False
        try:
            self.resolve(key)
        except SiteNotFoundError:
            return False
        return True

    @property
    def std(self) -> dict[str, torch.Tensor]:
        """The values selected by canonical names, keyed by them: ``cache.std["blocks.3.resid_post"]``.

        Present when the capture was given ``"std:..."`` selectors (:func:`hookscope.std_map`);
        ``cache["std:blocks.3.resid_post"]`` reads one, and saved files keep the names.
        """
        std = self.meta.get("std")
        found: dict[str, torch.Tensor] = {}
        for name in std if isinstance(std, dict) else {}:
            try:
                found[name] = self[STD_PREFIX + name]
            except SiteNotFoundError:  # selected, but its module never ran in this pass
                continue
        return found

    @property
    def grad(self) -> Cache:
        """The gradients of the kept values (``capture(..., grads=True)``), read like the values:
        ``cache.grad["h.3"]`` has ``cache["h.3"]``'s shape. Filled when a backward reaches each
        value (``loss.backward()`` after the forward, or ``run_with_capture(..., backward=metric)``);
        a second backward adds to them, as ``.grad`` does.

        >>> import hookscope as hs
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2))
        >>> with hs.capture(model, "0", grads=True) as cap:
        ...     model(torch.ones(1, 3)).pow(2).sum().backward()
        >>> torch.equal(cap.cache.grad["0"], 2 * cap.cache["0"])
        True
        """
        notes: dict[str, str] = {}
        for site in self._entries:
            if site not in self._grads:
                why = self._no_grad.get(site, _NO_BACKWARD)
                notes.setdefault(site.module, f"no gradient reached {str(site)!r}: {why}")
        in_order = {site: self._grads[site] for site in self._entries if site in self._grads}  # capture order
        grads = Cache(in_order, meta=self.meta, versions=self._grad_versions)
        grads._empty = notes
        grads._canonical = self._canonical
        grads._hint = (
            "no gradient was kept: capture with grads=True, and run a backward after the forward "
            "(loss.backward(), or run_with_capture(..., backward=metric))"
        )
        return grads

    def stack(self, pattern: str) -> Stacked:
        """The values matching ``pattern`` as one tensor with a labelled first axis:
        ``values, labels = cache.stack("std:blocks.*.resid_post")`` (canonical names, map order)
        or ``cache.stack("transformer.h.*")`` (a glob over :meth:`short_names`, capture order).

        >>> cache = Cache({Site("h.0"): torch.zeros(2), Site("h.1"): torch.ones(2)})
        >>> values, labels = cache.stack("h.*")
        >>> values.shape, labels
        (torch.Size([2, 2]), ['h.0', 'h.1'])
        """
        return stack(self, pattern)

    def std_names(self, pattern: str) -> list[str]:
        """The canonical names matching ``pattern`` (``"blocks.*.resid_post"``) that name a value
        held here, in map order: those the capture was given and those of the model's canonical
        map whose site was captured by module name (``capture(model, "transformer.h.*")`` holds
        every ``blocks.*``, ``blocks.*.resid_post`` among them). Only the given ones where the
        model has no map.

        >>> Cache({Site("h.0"): torch.zeros(1)}, meta={"std": {"blocks.0": "h.0"}}).std_names("blocks.*")
        ['blocks.0']
        """
        wanted = std_pattern(pattern)
        std = self.meta.get("std")
        given = [name for name in (std if isinstance(std, dict) else {}) if std_matches(wanted, name)]
        if self._canonical is None:
            return given
        try:
            canonical = self._canonical()
        except SiteNotFoundError:  # no map: no names beyond those given
            return given
        found = []
        for name in canonical:  # every value answering to the names, whichever name it was captured by
            if std_matches(wanted, name) and (name in given or (STD_PREFIX + name) in self):
                found.append(name)
        return found + [name for name in given if name not in found]

    def sites(self) -> list[Site]:
        """Every site held, in the order the values were captured."""
        return list(self._entries)

    def calls(self, key: str | Site) -> list[torch.Tensor]:
        """The value named by ``key`` in every call of its module, in call order.

        ``key`` is read as in ``cache[key]``; a call index in it is ignored.
        """
        return [self._checked(site) for site in self._built_index().every_call(key)]

    @property
    def nbytes(self) -> int:
        """Bytes held by the values (each tensor's elements; views of one storage count each)."""
        return sum(tensor_bytes(t) for t in self._entries.values())

    def short_names(self) -> dict[Site, str]:
        """The shortest name that says each site: the module's name where the site is the only
        one of its module (``"fc"``), else the full site (``"h.0#1:output"``), as in stores.

        >>> cache = Cache({Site("fc"): torch.zeros(1), Site("h", 0): torch.zeros(1), Site("h", 1): torch.zeros(1)})
        >>> list(cache.short_names().values())
        ['fc', 'h#0:output', 'h#1:output']
        """
        return short_names(list(self._entries))

    def numpy(self) -> dict[str, np.ndarray]:
        """``{name: numpy array}`` under :meth:`short_names` (``"fc"``, or ``"h.0#1:output"``
        where a module has several sites); dtypes numpy lacks (bfloat16, float8) become float32.

        >>> list(Cache({Site("fc"): torch.zeros(1)}).numpy())
        ['fc']
        """
        arrays = {}
        for site, name in self.short_names().items():
            tensor = self._checked(site).detach().cpu()
            if tensor.dtype in NUMPY_LACKS:
                tensor = tensor.float()
            arrays[name] = tensor.resolve_conj().numpy()
        return arrays

    def to(self, device: str | torch.device) -> Cache:
        """A new cache with every value moved to ``device``."""
        moved = {site: self._checked(site).to(device) for site in self._entries}
        copy = Cache(moved, meta=self.meta, versions=dict.fromkeys(moved))
        copy._overflowed = dict(self._overflowed)
        copy._empty = dict(self._empty)
        copy._canonical = self._canonical
        return copy

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the cache to ``path``; the format follows the extension.

        ``.safetensors`` (needs the safetensors package), ``.npz`` or ``.pt``; the write is
        atomic, and site names, call indices, dtypes and versions come back with :func:`load`.
        Tensors are stored under :meth:`short_names` (``np.load(path)["fc"]``); the full site
        of each is in the file's metadata.
        """
        from hookscope._capture.files import save_tensors

        names = self.short_names()
        tensors = {names[site]: self._checked(site) for site in self._entries}
        meta = {**self.meta, _SITES_KEY: {name: str(site) for site, name in names.items()}}
        return save_tensors(path, tensors, meta)  # names, dtypes and shapes are in the file itself

    # -- names ------------------------------------------------------------------------------------

    def resolve(self, key: str | Site) -> Site:
        """The full :class:`Site` that ``key`` names; raises ``SiteNotFoundError`` if none.

        Every spelling of :class:`~hookscope._core.site_index.SiteIndex`: ``"fc"`` (its last
        call), ``"fc#0"``, ``"fc:input"``, ``"h.0#1:output[0]"``, ``"(root)"``, a :class:`Site`.
        """
        return self._built_index().resolve(key)

    def _built_index(self) -> SiteIndex:
        if self._index is None:
            aliases = self.meta.get("aliases")
            std = self.meta.get("std")
            first = self.meta.get("first_inputs")
            self._index = SiteIndex(
                self._entries,
                aliases=aliases if isinstance(aliases, dict) else None,
                std=std if isinstance(std, dict) else None,
                notes=self._empty,
                verb="captured",
                empty_hint=self._hint,
                canonical=self._canonical,
                first_inputs=[str(m) for m in first] if isinstance(first, list) else [],
            )
        return self._index

    def _checked(self, site: Site) -> torch.Tensor:
        tensor = self._entries[site]
        version = self._versions.get(site)
        if version is not None and version_counter(tensor) != version:
            raise CaptureError(
                f"the value captured at {str(site)!r} was changed in place after it was captured "
                "(by code that ran later); capture it with copy=True, or read it before the change",
                site=str(site),
            )
        return tensor

    # -- display ----------------------------------------------------------------------------------

    def _table(self) -> Table:
        """One row per kept tensor: site, shape, dtype, device and size, under a count."""
        title = f"Cache: {counted(len(self), 'tensor')}, {format_bytes(self.nbytes)}"
        table = Table([*map(Column, ("site", "shape", "dtype", "device")), Column("size", "right")], title=title)
        for site, tensor in self._entries.items():
            size = format_bytes(tensor_bytes(tensor))
            table.add(str(site), str(tuple(tensor.shape)), dtype_name(tensor.dtype), str(tensor.device), size)
        return table

    def __repr__(self) -> str:
        return self._table().text()

    def _repr_html_(self) -> str:
        return self._table().html()


_NO_BACKWARD = (
    "no backward has reached it since the forward (call loss.backward(), or give run_with_capture a "
    "backward= metric), or the metric does not depend on it"
)


def load(path: str | os.PathLike[str]) -> Cache:
    """Read a cache written by :meth:`Cache.save` (``.safetensors``, ``.npz`` or ``.pt``).

    >>> import tempfile
    >>> saved = Cache({Site("fc", 0): torch.arange(3.0)}).save(Path(tempfile.mkdtemp()) / "c.npz")
    >>> load(saved)["fc"]
    tensor([0., 1., 2.])
    """
    from hookscope._capture.files import load_tensors

    tensors, meta = load_tensors(path)
    sites = meta.pop(_SITES_KEY, None)
    sites = sites if isinstance(sites, dict) else {}
    entries = {}
    for key, tensor in tensors.items():
        try:
            entries[Site.parse(str(sites.get(key, key)))] = tensor
        except SpecError:
            raise FileFormatError(
                f"{os.fspath(path)!r} holds a tensor named {key!r}, not a hookscope site such as 'fc#0:output'; "
                "it was not written by Cache.save: read it with safetensors, numpy or torch directly"
            ) from None
    return Cache(entries, meta=meta)
