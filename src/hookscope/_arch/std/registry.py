"""Make, keep and use a model's canonical map: ``std_map`` and the expansion of ``"std:"`` selectors.

A map is made once per model (one small forward, see :mod:`~hookscope._arch.std.resolve`) and
kept beside the model, weakly, until the model's modules change: every feature that meets a
``"std:..."`` selector asks here, and only the first pays for the forward.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from torch import nn

from hookscope._arch.samples import sample_input
from hookscope._arch.std.detect import detect_family
from hookscope._arch.std.families import family_of
from hookscope._arch.std.resolve import resolve_family
from hookscope._arch.std.shared import SHARED_BLOCK
from hookscope._core.compat.offload import ensure_loaded
from hookscope._core.live_hooks import attached
from hookscope._core.names import named_modules, split_leaf_selector
from hookscope._core.params import model_device, model_float_dtype
from hookscope._core.select import Selector, ensure_module, select
from hookscope._core.std_names import StdMap, StdSite, is_std_selector
from hookscope._core.tree import map_tensors
from hookscope.errors import SelectionError, SiteNotFoundError, SpecError, StdMapError

__all__ = [
    "CanonicalSource",
    "canonical_source",
    "expand_std",
    "kept_std_map",
    "known_std_map",
    "select_std",
    "std_map",
    "stream_modules",
]

_MAPS: weakref.WeakKeyDictionary[nn.Module, tuple[int, StdMap]] = weakref.WeakKeyDictionary()

Use = Literal["read", "write", "module"]


def std_map(model: nn.Module, *args: Any, family: str | None = "auto", **kwargs: Any) -> StdMap:
    """The canonical names of ``model``'s sites, resolved on the model and checked on one forward.

    One set of names across architectures: ``blocks.3.resid_post`` is ``transformer.h.3``'s
    hidden state on GPT-2 and ``model.layers.3``'s on Llama, so one script runs on both. Any
    selector ``"std:NAME"`` (globs: ``*`` is one dotted part) works wherever hookscope takes a
    selector. The names: ``embed``, ``pos_embed``, ``blocks.{i}`` and, in each block,
    ``resid_pre``, ``ln1``, ``attn`` (what attention adds to the residual),
    ``attn.q|k|v|scores|pattern|z``, ``resid_mid``, ``ln2``, ``mlp``, ``mlp.pre``, ``mlp.post``,
    ``mlp.router`` (mixtures of experts), ``resid_post``; then ``ln_final`` and ``unembed``;
    encoder-decoder models prefix ``encoder.`` and ``decoder.``, and decoder blocks add
    ``ln_cross``, ``cross_attn`` (and its sub-sites) and ``resid_mid_cross``.

    Args:
        model: a transformers model of a known family, or any model with a list of blocks.
        ``*args``, ``**kwargs``: an example input for the check forward; a transformers model needs
            none (a tiny one is made from its config).
        family: ``"auto"``: the family table for ``config.model_type``, else the structural
            detector; None: the structural detector always.

    The map is kept for the model (until its modules change), so later ``"std:"`` selectors
    cost nothing; calling again with an input checks again.

    >>> import hookscope as hs, transformers  # doctest: +SKIP
    >>> model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2))  # doctest: +SKIP
    >>> hs.std_map(model)["blocks.1.resid_post"].read  # doctest: +SKIP
    'transformer.h.1:output[0]'
    """
    ensure_loaded(model)  # a meta model: one line, not torch's error
    ensure_module(model)
    if family not in ("auto", None):
        raise SpecError(
            f"family={family!r}: expected 'auto' (a family table, else the detector) or None (the detector)"
        )
    inputs = (args, kwargs) if args or kwargs else _sample(model)
    resolved = _make(model, family, inputs)
    _MAPS[model] = (_signature(model), resolved)
    return resolved


def known_std_map(model: nn.Module) -> StdMap:
    """The map kept for ``model``, made now (from a sample input) when there is none or the
    model's modules changed since; a model that needs an example input says so."""
    kept = _kept(model)
    return kept if kept is not None else std_map(model)


def kept_std_map(model: nn.Module) -> StdMap | None:
    """The map kept for ``model``, or None; never runs the model (an error path may ask)."""
    return _kept(model)


def _kept(model: nn.Module) -> StdMap | None:
    """The map kept for ``model`` if it still fits the model's modules; never runs the model."""
    kept = _MAPS.get(model)
    return kept[1] if kept is not None and kept[0] == _signature(model) else None


class CanonicalSource:
    """The canonical map of the model a result came from, for reading it by ``"std:"`` names
    later (:class:`~hookscope._core.site_index.SiteIndex`): a cache holding ``h.1`` answers
    ``std:blocks.1.resid_post`` although it was captured by module name.

    Asked only when such a name is read: the map kept for the model, or one made then (one
    small forward), unless hookscope hooks are attached to the model, which that forward would
    run through (a capture would take it for a pass). Holds the model weakly. Raises
    ``SiteNotFoundError`` saying why there is no map.
    """

    def __init__(self, model: nn.Module) -> None:
        self._model: Callable[[], nn.Module | None] = weakref.ref(model)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_without_model, ())  # a result pickled to another process is read without its model

    def __copy__(self) -> CanonicalSource:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> CanonicalSource:
        return self  # a copied result still came from the same model

    def __call__(self) -> StdMap:
        model = self._model()
        if model is None:
            raise SiteNotFoundError(
                "canonical names are read through the model's canonical map, and the model is gone (or the values "
                "were unpickled elsewhere); select 'std:...' names when capturing"
            )
        kept = _kept(model)
        if kept is not None:
            return kept
        if attached(model):
            raise SiteNotFoundError(
                "canonical names are read through the model's canonical map, made by one forward, and hookscope "
                "hooks are attached to the model now (that forward would run through them); read it after they "
                "are removed, or make the map before attaching: hs.std_map(model)"
            )
        try:
            return known_std_map(model)
        except StdMapError as error:
            raise SiteNotFoundError(f"this model has no canonical map: {error}") from None


def _without_model() -> CanonicalSource:
    source = CanonicalSource.__new__(CanonicalSource)
    source._model = lambda: None
    return source


def canonical_source(model: nn.Module | None) -> CanonicalSource | None:
    """A :class:`CanonicalSource` for ``model`` (None for None)."""
    return CanonicalSource(model) if model is not None else None


def expand_std(
    model: nn.Module, selectors: Selector | Sequence[Selector], use: Use = "read"
) -> tuple[list[Any], dict[str, str]]:
    """``selectors`` (one, or a list) with each ``"std:..."`` one replaced by the selectors it
    stands for, lists opened up, and ``{canonical name: site text}`` for them (two names may
    share one site). ``use``: ``"read"`` (capture, extract), ``"write"`` (edit) or ``"module"``
    (trace, gradients: the module carrying it).

    Selectors without ``"std:"`` pass through untouched, and the model is not run for them.
    """
    given: Sequence[Any] = selectors if isinstance(selectors, (list, tuple)) else [selectors]
    if not _has_std(given):
        return list(given), {}
    std = known_std_map(model)
    expanded: list[Any] = []
    names: dict[str, str] = {}
    for selector in given:
        if isinstance(selector, (list, tuple)):
            inner, inner_names = expand_std(model, selector, use)
            expanded.append(type(selector)(inner) if isinstance(selector, tuple) else inner)
            names.update(inner_names)
            continue
        if not is_std_selector(selector):
            expanded.append(selector)
            continue
        for site in std.expand(selector):
            text = _text(site, use)
            if text not in expanded:
                expanded.append(text)
            names.setdefault(site.name, text)
    return expanded, names


def stream_modules(model: nn.Module, names: Mapping[str, str]) -> set[str]:
    """The modules whose input carries one of the canonical ``names`` as a ``"stream"`` site
    (``resid_mid`` at the next norm's input): a feature reads their input before their other
    pre-hooks (``prepend=True``), which may change what the norm takes, never the stream.
    ``names`` come from :func:`expand_std`, so the map is already kept: no forward."""
    if not names:
        return set()
    std = known_std_map(model)
    found = set()
    for name in names:
        site = std.get(name)
        split = split_leaf_selector(site.read) if site is not None and site.kind == "stream" else None
        if split is not None:
            found.add(split[0])
    return found


def select_std(model: nn.Module, selectors: Selector | Sequence[Selector]) -> list[tuple[str, nn.Module]]:
    """:func:`~hookscope._core.select.select`, also taking ``"std:..."`` names for the modules
    whose outputs they are: what the features that work per module (trace, gradients, diff)
    select with."""
    return select(model, expand_std(model, selectors, "module")[0])


def _text(site: StdSite, use: Use) -> str:
    if use == "read":
        return site.read
    if use == "write":
        return site.write
    if site.module is None:
        raise SelectionError(
            f"canonical site 'std:{site.name}' ({site.read}) is not a module's output, and this feature works per "
            "module: select it in hs.capture or hs.extract, or pick a name a module returns (blocks.*, *.attn, "
            "*.mlp, *.ln1, *.resid_post)",
            selector=f"std:{site.name}",
        )
    return site.module


def _has_std(selectors: Sequence[Any]) -> bool:
    return any(_has_std(s) if isinstance(s, (list, tuple)) else is_std_selector(s) for s in selectors)


def _sample(model: nn.Module) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The model's default sample input (:func:`~hookscope._arch.samples.sample_input`), on its
    device and in its float dtype; a model without one is asked for an example."""
    try:
        inputs = sample_input(model, dtype=model_float_dtype(model))
    except SpecError:
        raise StdMapError(
            f"canonical names need one forward to be checked, and hookscope cannot make an input for a "
            f"{type(model).__name__}: call hs.std_map(model, example_input) once first (the map is kept for the model)",
            check="no sample input",
        ) from None
    device = model_device(model)
    args, kwargs = inputs
    return tuple(map_tensors(lambda t: t.to(device), args)), map_tensors(lambda t: t.to(device), kwargs)


def _make(model: nn.Module, family: str | None, inputs: tuple[tuple[Any, ...], dict[str, Any]]) -> StdMap:
    """The family table's map; else (no table, or one that no longer fits: a renamed or
    re-nested copy) the detector's."""
    table = family_of(getattr(getattr(model, "config", None), "model_type", None)) if family == "auto" else None
    table_error: StdMapError | None = None
    if table is not None:
        try:
            return resolve_family(model, table, inputs)
        except StdMapError as error:
            if error.check == SHARED_BLOCK:  # no reading of the blocks fits it: the detector would say the same
                raise
            table_error = error
    try:  # the detector cannot tell pre-norm from post-norm blocks by names: the values decide
        return resolve_family(model, detect_family(model), inputs, layouts=("pre", "post"))
    except StdMapError as error:
        if table_error is None:
            raise
        raise StdMapError(
            f"{table_error}; the structural detector: {error}", family=table_error.family, check=table_error.check
        ) from error


def _signature(model: nn.Module) -> int:
    """What the map depends on: the module structure and the config (an attention
    implementation or a residual layout switched after the map was made)."""
    config: Any = getattr(model, "config", None)
    settings = repr(sorted(config.to_dict().items())) if config is not None and hasattr(config, "to_dict") else ""
    attention = getattr(config, "_attn_implementation", None)
    return hash((tuple((name, type(module)) for name, module in named_modules(model)), settings, attention))
