"""Which layers ``hs.monitor`` watches, and the names it logs them under."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from torch import nn

from hookscope._arch.std import known_std_map, select_std
from hookscope._core.names import named_modules
from hookscope._core.select import Selector
from hookscope.errors import HookscopeError, SpecError, StdMapError

__all__ = ["chosen_layers", "logged_names"]


def chosen_layers(
    model: nn.Module, layers: Selector | Sequence[Selector] | None
) -> tuple[list[tuple[str, nn.Module]], str | None, bool]:
    """The layers given, or by default the blocks (``std:blocks.*``) where the model has a map,
    else every module that holds parameters of its own; and a note where a transformers model,
    which should have a map, fell back (a warning too: its logs are named unlike its family's);
    and whether the map failed."""
    if layers is not None:
        return select_std(model, layers), None, False
    try:
        return select_std(model, "std:blocks.*"), None, False
    except HookscopeError as error:
        mapped = hasattr(model, "config")  # a transformers model: its map should resolve
        if mapped and not isinstance(error, StdMapError):
            raise  # the error says why it does not, and what to pass
        owners = [(n, m) for n, m in named_modules(model) if n and any(True for _ in m.parameters(recurse=False))]
        if not owners:
            raise SpecError("the model holds no parameters of its own modules: name the layers to monitor") from None
        if not mapped:
            return owners, None, True
        note = (
            f"hs.monitor: no canonical names for {type(model).__name__} ({error}); it watches the {len(owners)} "
            "modules with parameters of their own, under their module names; pass layers= to choose others"
        )
        warnings.warn(note, UserWarning, stacklevel=5)
        return owners, note, True


def logged_names(model: nn.Module, chosen: list[tuple[str, nn.Module]]) -> dict[str, str]:
    """Module name -> canonical name where the map names the module itself (``blocks.3``)."""
    try:
        std = known_std_map(model)
    except HookscopeError:  # a StdMapError among them: module names, as the layers fell back to
        return {name: name for name, _ in chosen}
    by_module = {site.module: name for name, site in std.items() if site.kind == "module" and site.module}
    return {name: by_module.get(name, name) for name, _ in chosen}
