"""Find and replace the tensors inside whatever a module takes or returns.

Module inputs and outputs are rarely a bare tensor: GPT-2 blocks return tuples, transformers
models return ``ModelOutput`` objects, user code returns dicts, dataclasses and namedtuples with
``None`` and ints mixed in. This module walks those containers once, names every leaf with a
readable path, and rebuilds them with the same container types, so a hook can read or replace
tensors without knowing the structure in advance.

Paths read like the Python that would fetch the value:

=======================================  ===========================================
``output``                               the value itself is a tensor
``output[0]``                            item of a tuple or list
``output['logits']``                     key of a dict (keys shown with ``repr``)
``output.last_hidden_state``             field of a dataclass, namedtuple or ``ModelOutput``
=======================================  ===========================================

Each path starts at ``root``: ``"output"`` by default, as above, the full form a person reads.
hookscope's own records pass ``root=""`` and keep the path relative to the value (``""``,
``"[0]"``, ``".logits"``) beside which value it is (see :func:`~hookscope._core.names.leaf_label`);
:func:`call_leaves` names a call's inputs the same way (``"[0]"``, ``"['mask']"``).

Containers: tuple, list, dict (and subclasses such as ``OrderedDict``), namedtuple, dataclass
instances and transformers ``ModelOutput`` (a dict that is also a dataclass; only its set fields
are visited). Anything else -- ``None``, ints, strings, custom objects -- is a leaf that passes
through untouched.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["call_leaves", "flatten_tensors", "iter_leaves", "map_call_tensors", "map_tensors", "map_tensors_with_paths"]


def iter_leaves(value: Any, root: str = "output") -> Iterator[tuple[str, Any]]:
    """Yield ``(path, leaf)`` for every leaf of ``value``, tensors and non-tensors alike.

    >>> list(iter_leaves((1, {"a": None})))
    [('output[0]', 1), ("output[1]['a']", None)]
    """
    children = _children(value)
    if children is None:
        yield root, value
        return
    for suffix, child in children:
        yield from iter_leaves(child, root + suffix)


def flatten_tensors(value: Any, root: str = "output") -> list[tuple[str, torch.Tensor]]:
    """Return ``[(path, tensor), ...]`` for every tensor inside ``value``, in container order.

    >>> x = torch.zeros(2)
    >>> [path for path, _ in flatten_tensors({"logits": x, "n": 3, "pair": (x, None)})]
    ["output['logits']", "output['pair'][0]"]
    """
    found: list[tuple[str, torch.Tensor]] = []
    _collect_tensors(value, root, found)  # no generator: torch.compile traces this inside hooks
    return found


def _collect_tensors(value: Any, path: str, found: list[tuple[str, torch.Tensor]]) -> None:
    if isinstance(value, torch.Tensor):
        found.append((path, value))
        return
    for suffix, child in _children(value) or ():
        _collect_tensors(child, path + suffix, found)


def map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """Return ``value`` rebuilt with every tensor replaced by ``fn(tensor)``.

    Containers keep their types (a ``ModelOutput`` stays a ``ModelOutput``, a namedtuple stays
    that namedtuple); non-tensor leaves are kept as they are.

    >>> map_tensors(lambda t: t + 1, (torch.zeros(1), None))
    (tensor([1.]), None)
    """
    return _rebuild(value, "", lambda _path, tensor: fn(tensor))


def map_tensors_with_paths(fn: Callable[[str, torch.Tensor], Any], value: Any, root: str = "output") -> Any:
    """Like :func:`map_tensors`, but ``fn`` also receives each tensor's path.

    >>> map_tensors_with_paths(lambda path, t: t * 0 if path == "output[1]" else t,
    ...                        (torch.ones(1), torch.ones(1)))
    (tensor([1.]), tensor([0.]))
    """
    return _rebuild(value, root, fn)


def call_leaves(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of a call's positional and keyword inputs: paths ``[0]``, ``['mask']``.

    >>> [path for path, _ in call_leaves((torch.zeros(1),), {"mask": torch.ones(1)})]
    ['[0]', "['mask']"]
    """
    leaves = [leaf for i, arg in enumerate(args) for leaf in flatten_tensors(arg, f"[{i}]")]
    leaves += [leaf for key, value in kwargs.items() for leaf in flatten_tensors(value, f"[{key!r}]")]
    return leaves


def map_call_tensors(
    fn: Callable[[str, torch.Tensor], Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` rebuilt with ``fn(path, tensor)`` for every tensor, paths as in :func:`call_leaves`."""
    new_args = tuple(_rebuild(arg, f"[{i}]", fn) for i, arg in enumerate(args))
    return new_args, {key: _rebuild(value, f"[{key!r}]", fn) for key, value in kwargs.items()}


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def _is_dataclass_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _children(value: Any) -> list[tuple[str, Any]] | None:
    """``[(path suffix, child), ...]`` of a container, or None for a leaf."""
    if isinstance(value, torch.Tensor):
        return None
    if isinstance(value, dict):
        if _is_dataclass_instance(value):  # transformers ModelOutput: fields set so far, by name
            return [(f".{key}", child) for key, child in value.items()]
        return [(f"[{key!r}]", child) for key, child in value.items()]
    if _is_namedtuple(value):
        return [(f".{field}", child) for field, child in zip(type(value)._fields, value, strict=True)]
    if isinstance(value, (tuple, list)):
        return [(f"[{index}]", child) for index, child in enumerate(value)]
    if _is_dataclass_instance(value):
        return [(f".{field.name}", getattr(value, field.name)) for field in dataclasses.fields(value)]
    return None


def _rebuild(value: Any, path: str, fn: Callable[[str, torch.Tensor], Any]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(path, value)
    if isinstance(value, dict):
        if _is_dataclass_instance(value):  # ModelOutput: item assignment keeps item and attribute in step
            rebuilt = copy.copy(value)
            for key, child in value.items():
                rebuilt[key] = _rebuild(child, f"{path}.{key}", fn)
            return rebuilt
        rebuilt_dict = copy.copy(value)  # keeps the dict subclass, defaultdict factory, OrderedDict order
        for key, child in value.items():
            rebuilt_dict[key] = _rebuild(child, f"{path}[{key!r}]", fn)
        return rebuilt_dict
    if _is_namedtuple(value):
        fields = type(value)._fields
        return type(value)(*(_rebuild(child, f"{path}.{f}", fn) for f, child in zip(fields, value, strict=True)))
    if isinstance(value, tuple):
        items = tuple(_rebuild(child, f"{path}[{i}]", fn) for i, child in enumerate(value))
        return items if type(value) is tuple else type(value)(items)
    if isinstance(value, list):
        rebuilt_list = copy.copy(value)
        rebuilt_list[:] = [_rebuild(child, f"{path}[{i}]", fn) for i, child in enumerate(value)]
        return rebuilt_list
    if _is_dataclass_instance(value):
        rebuilt_obj = copy.copy(value)
        for field in dataclasses.fields(value):
            child = getattr(value, field.name)
            object.__setattr__(rebuilt_obj, field.name, _rebuild(child, f"{path}.{field.name}", fn))
        return rebuilt_obj
    return value
