"""The reference side of :func:`hookscope.verify`: what a model does, recorded without hookscope.

Everything here is plain PyTorch: ``register_forward_pre_hook(with_kwargs=True)`` and
``register_forward_hook`` on every module, and a ``TorchFunctionMode`` pushed inside chosen
modules. It walks containers with its own few lines (tuples, lists, dicts, dataclasses and
``ModelOutput``, namedtuples), so that a defect in hookscope's walker cannot hide in both sides of
a comparison. Values are cloned when the hook runs: a later in-place write cannot reach them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from hookscope._core.compat.internals import version_counter
from hookscope._core.op_sites import op_name

__all__ = ["CallRecord", "OpRecorder", "RawRecorder", "leaves", "same"]


def leaves(value: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in ``value`` with its path as hookscope's site grammar writes it (``""``,
    ``"[0]"``, ``"['mask']"``, ``".logits"``)."""
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, tuple) and hasattr(type(value), "_fields"):
        for name in getattr(type(value), "_fields"):  # noqa: B009 - a namedtuple's, unknown to the type checker
            yield from leaves(getattr(value, name), f"{path}.{name}")
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        if isinstance(value, dict):  # a transformers ModelOutput: its set fields only
            for key, item in value.items():
                yield from leaves(item, f"{path}.{key}")
        else:
            for item_field in dataclasses.fields(value):
                yield from leaves(getattr(value, item_field.name), f"{path}.{item_field.name}")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from leaves(item, f"{path}[{key!r}]")
    elif isinstance(value, (tuple, list)):
        for index, item in enumerate(value):
            yield from leaves(item, f"{path}[{index}]")


def call_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """A call's input tensors: positional ones at ``[i]``, keyword ones at ``['name']``."""
    found = [leaf for index, arg in enumerate(args) for leaf in leaves(arg, f"[{index}]")]
    return found + [leaf for key, value in kwargs.items() for leaf in leaves(value, f"[{key!r}]")]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit the same values, dtype and shape; NaN equals NaN at the same place."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.device != b.device:
        b = b.to(a.device)
    if a.is_floating_point() or a.is_complex():
        holes = a.isnan()
        return bool(torch.equal(holes, b.isnan()) and torch.equal(a.masked_fill(holes, 0), b.masked_fill(holes, 0)))
    return bool(torch.equal(a, b))


def close(a: torch.Tensor, b: torch.Tensor, *, rtol: float = 1e-4, atol: float = 1e-5) -> bool:
    """Equal up to float rounding (another kernel, another order of a sum), compared in float64."""
    if a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return bool(torch.equal(a, b.to(a.device)))
    return bool(torch.allclose(a.double(), b.double().to(a.device), rtol=rtol, atol=atol, equal_nan=True))


def _clone(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().clone()


@dataclass
class CallRecord:
    """One call of one module: its inputs and outputs as they were when the hooks ran."""

    module: str
    call: int
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    finished: int = -1  # the order in which calls returned; -1 for a call that raised


class RawRecorder:
    """Record every call of every module of ``model`` with raw hooks (a context manager).

    ``keep_graph`` names modules whose first output tensor is also kept undetached
    (``graph[(module, call)]``), for gradients taken with ``torch.autograd.grad``; ``only`` limits
    the recording to some modules (a check that needs a few keeps no copy of the rest).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        keep_graph: frozenset[str] = frozenset(),
        values: bool = True,
        only: frozenset[str] | None = None,
    ) -> None:
        self.model = model
        self.only = only
        self.keep_graph = keep_graph
        self.values = values
        self.calls: list[CallRecord] = []
        self.graph: dict[tuple[str, int], torch.Tensor] = {}
        self.paths: dict[tuple[str, int], str] = {}
        self.versions: dict[tuple[str, int], int | None] = {}
        self._counts: dict[str, int] = {}
        self._open: dict[str, list[CallRecord]] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._finished = 0

    def __enter__(self) -> RawRecorder:
        try:
            for name, module in self.model.named_modules():
                if self.only is not None and name not in self.only:
                    continue
                self._handles.append(module.register_forward_pre_hook(self._pre(name), with_kwargs=True))
                self._handles.append(module.register_forward_hook(self._post(name), always_call=True))
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _pre(self, name: str) -> Any:
        def pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            call = self._counts.get(name, 0)
            self._counts[name] = call + 1
            record = CallRecord(name, call)
            if self.values:
                record.inputs = {path: _clone(t) for path, t in call_inputs(args, kwargs)}
            self._open.setdefault(name, []).append(record)
            self.calls.append(record)

        return pre

    def _post(self, name: str) -> Any:
        def post(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            stack = self._open.get(name)
            if not stack:
                return
            record = stack.pop()
            record.finished = self._finished
            self._finished += 1
            found = list(leaves(output))
            if self.values:
                record.outputs = {path: _clone(t) for path, t in found}
            if name in self.keep_graph and found:
                self.graph[(name, record.call)] = found[0][1]
                self.paths[(name, record.call)] = found[0][0]
                self.versions[(name, record.call)] = version_counter(found[0][1])

        return post

    def record(self, module: str, call: int = 0) -> CallRecord | None:
        """The record of ``module``'s call ``call``, or None where it did not run that often."""
        return next((r for r in self.calls if r.module == module and r.call == call), None)

    def counts(self) -> dict[str, int]:
        """How many times each module was called."""
        return dict(self._counts)


#: Ops whose result is memory left as it was found: equal shapes are all two runs can share.
UNINITIALISED = frozenset({"empty", "new_empty", "empty_like", "empty_strided", "new_empty_strided"})


@dataclass
class OpCall:
    """One torch function a module's own code called, with its tensor arguments and results."""

    name: str
    args: list[Any]
    kwargs: dict[str, Any]
    outputs: list[torch.Tensor]
    paths: list[str] = field(default_factory=list)  # each output's path in what the op returned
    storages: list[int] = field(default_factory=list)  # where each output's memory lies (views share it)


class OpRecorder(TorchFunctionMode):
    """Record the torch functions ``module``'s own code calls (its children's are not its own),
    with raw hooks pushing and popping this mode around each of its calls.

    Only calls that return a tensor (or a tuple or list holding one) are recorded, as op sites are.
    """

    def __init__(self, model: nn.Module, module_name: str) -> None:
        super().__init__()
        self.model = model
        self.module_name = module_name
        self.calls: list[list[OpCall]] = []
        self._paused = 0
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if self._paused == 0 and self.calls:
            outs = list(leaves(result)) if isinstance(result, (torch.Tensor, tuple, list)) else []
            if outs:
                kept = [_clone(a) if isinstance(a, torch.Tensor) else a for a in args]
                named = {k: _clone(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
                copies = [_clone(t) for _, t in outs]
                paths = [path for path, _ in outs]
                storages = [t.untyped_storage().data_ptr() for _, t in outs]
                self.calls[-1].append(OpCall(op_name(func), kept, named, copies, paths, storages))
        return result

    def attach(self) -> OpRecorder:
        target = self.model.get_submodule(self.module_name)
        try:
            # The mode is on only between the module's own hooks and its forward: the start runs
            # after every other pre-hook and the stop before every other forward hook.
            self._handles.append(target.register_forward_pre_hook(self._start))
            self._handles.append(target.register_forward_hook(self._stop, prepend=True, always_call=True))
            for child in target.modules():
                if child is target:
                    continue
                self._handles.append(child.register_forward_pre_hook(self._pause, prepend=True))
                self._handles.append(child.register_forward_hook(self._resume, always_call=True))
        except BaseException:
            self.remove()
            raise
        return self

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def value(self, call: int, op: str, path: str) -> torch.Tensor | None:
        """The output at ``path`` of op ``"add#1"`` (the second ``add``) in the module's call ``call``."""
        name, _, index = op.partition("#")
        if call >= len(self.calls):
            return None
        found = [item for item in self.calls[call] if item.name == name]
        if int(index or 0) >= len(found):
            return None
        item = found[int(index or 0)]
        return dict(zip(item.paths, item.outputs, strict=True)).get(path)

    def _start(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self.calls.append([])
        self.__enter__()  # type: ignore[no-untyped-call]

    def _stop(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self.__exit__(None, None, None)  # type: ignore[no-untyped-call]

    def _pause(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self._paused += 1

    def _resume(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self._paused -= 1
