"""The real values of weights that accelerate keeps off the model (``cpu_offload``, device maps).

accelerate's big-model loading leaves offloaded parameters on the ``meta`` device and moves the
real ones in for the forward only, from a ``weights_map`` held by the ``AlignDevicesHook`` of
the module (or of an ancestor, with ``place_submodules``). Hooks still see the activations
(every value is computed), but anything that reads *weights* outside the forward -- a weight
norm, a fingerprint of the model -- would read nothing. :func:`real_value` reads them from the
weights map instead, without moving or loading the model.

>>> from torch import nn
>>> layer = nn.Linear(2, 2)
>>> real_value(layer, "weight", layer.weight) is layer.weight
True
"""

from __future__ import annotations

import sys
from itertools import chain
from typing import Any

import torch
from torch import nn

from hookscope._core.tree import flatten_tensors
from hookscope.errors import UnsupportedModelError

__all__ = ["ensure_loaded", "named_real_tensors", "real_value", "refuse_real_inputs", "unloaded_tensor"]


def real_value(model: nn.Module, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (the parameter or buffer ``name`` of ``model``), or, when accelerate has
    offloaded it to ``meta``, its real value from the offload hook's weights map (a CPU
    tensor; disk-offloaded weights are read from their memory map)."""
    if not tensor.is_meta or "accelerate" not in sys.modules:
        return tensor
    parts = name.split(".")
    for depth in range(len(parts) - 1, -1, -1):  # the owner first, then its ancestors
        module = model.get_submodule(".".join(parts[:depth]))
        relative = ".".join(parts[depth:])
        for hook in _offload_hooks(module):
            if depth < len(parts) - 1 and not getattr(hook, "place_submodules", False):
                continue  # a hook that places only its own module's tensors
            try:
                return hook.weights_map[relative].detach()  # type: ignore[no-any-return]
            except KeyError:
                continue
    raise UnsupportedModelError(
        f"{name!r} is on the meta device and no accelerate offload hook holds its value; load the "
        "weights first (accelerate.load_checkpoint_and_dispatch, or model.to_empty() and a state dict)"
    )


def ensure_loaded(model: nn.Module, inputs: Any = None) -> None:
    """Refuse, in one line, a model whose weights are on ``meta`` (built there, not loaded), at
    every public entry point that runs a forward.

    Without it the forward fails deep inside the first layer with a device-mismatch
    ``RuntimeError``, a statistic with torch's ``.item()`` error, or returns meta values
    silently. With ``inputs`` (the run's own), a model built on ``meta`` given ``meta`` inputs
    passes: a run for shapes only (``hs.layers``, ``hs.trace``). Without them the entry point
    reads values (a method, a store, a statistic, a probe of its own) and any such model is
    refused. accelerate's offloaded weights are real where they live: they pass. Costs one
    look at each parameter and buffer, and at the inputs only when one is on ``meta``.

    >>> ensure_loaded(nn.Linear(2, 2), (torch.ones(1, 2),))
    >>> ensure_loaded(nn.Linear(2, 2, device="meta"), (torch.ones(1, 2, device="meta"),))
    >>> ensure_loaded(nn.Linear(2, 2, device="meta"), (torch.ones(1, 2),))
    Traceback (most recent call last):
    ...
    hookscope.errors.UnsupportedModelError: the model's parameters are on the meta device (no values), ...
    """
    if not isinstance(model, nn.Module):  # called before the entry point's own check, which names it
        return  # type: ignore[unreachable]
    meta = unloaded_tensor(model)
    if meta is None:
        return
    if inputs is None:
        raise UnsupportedModelError(
            f"the model's parameters are on the meta device, e.g. {meta!r}: there are no values to read; {_FIX}"
        )
    refuse_real_inputs(meta, inputs)


_FIX = "materialise the model first (model.to_empty(device=...) and load_state_dict, or load it from a checkpoint)"


def unloaded_tensor(model: nn.Module) -> str | None:
    """The name of a parameter or buffer of ``model`` on ``meta`` with no value anywhere (built
    there, not loaded; accelerate's offloaded weights have theirs), or None."""
    meta = next(((n, t) for n, t in chain(model.named_parameters(), model.named_buffers()) if t.is_meta), None)
    if meta is None:
        return None
    try:
        if not real_value(model, *meta).is_meta:
            return None  # offloaded by accelerate: its hooks bring the values in for the forward
    except UnsupportedModelError:
        pass
    return meta[0]


def refuse_real_inputs(meta: str, inputs: Any) -> None:
    """Refuse a run of a model whose tensor ``meta`` has no value on inputs that have values: it
    would return meta tensors, silently. Meta inputs pass (a run for shapes only)."""
    real = next(((p, t) for p, t in flatten_tensors(inputs, "input") if not t.is_meta), None)
    if real is not None:
        raise UnsupportedModelError(
            f"the model's parameters are on the meta device (no values), e.g. {meta!r}, but "
            f"{real[0]} is on {real[1].device}; {_FIX}"
        )


def named_real_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``model`` (each once), offloaded ones read where they live
    (a meta tensor no offload hook holds stays as it is)."""
    named = [*model.named_parameters(remove_duplicate=True), *model.named_buffers(remove_duplicate=True)]
    return [(name, _held(model, name, tensor)) for name, tensor in named]


def _held(model: nn.Module, name: str, tensor: torch.Tensor) -> torch.Tensor:
    try:
        return real_value(model, name, tensor)
    except UnsupportedModelError:
        return tensor  # a model built on meta, weights not loaded yet: its structure is all there is


def _offload_hooks(module: nn.Module) -> list[Any]:
    """The offloading ``AlignDevicesHook`` objects accelerate attached to ``module``."""
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return []
    hooks = getattr(hook, "hooks", None)  # a SequentialHook holds several
    found = list(hooks) if isinstance(hooks, (list, tuple)) else [hook]
    return [h for h in found if getattr(h, "offload", False) and getattr(h, "weights_map", None) is not None]
