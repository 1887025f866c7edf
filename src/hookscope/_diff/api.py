"""``hs.diff``: run two models on the same inputs (or take two captures) and compare them site by site.

This module holds the public callable and its built-ins (``dtypes``, ``compiled``, ``devices``):
argument checks, default tolerances and the wrapped or copied second model; the comparison they
all end in is ``compare``'s.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from hookscope._capture import Cache
from hookscope._core.select import Selector, ensure_module
from hookscope._core.tree import map_tensors
from hookscope._diff.compare import Inputs, compare_caches, compare_models
from hookscope._diff.matching import Match
from hookscope._diff.result import Diff
from hookscope._shared.dtypes import parse_device
from hookscope._shared.tolerances import model_dtypes, tolerances
from hookscope.errors import SpecError

__all__ = ["DiffFunction", "cast_floats", "diff"]


_DEVICE = re.compile(r"^(cpu|cuda|mps|xpu|meta)(:\d+)?$")


def _is_device(value: object) -> bool:
    return isinstance(value, torch.device) or (isinstance(value, str) and _DEVICE.match(value) is not None)


def _inside(prefix: str) -> Callable[[str], str]:
    """a's names as they read in a wrapper that holds a as ``prefix``."""
    return lambda name: f"{prefix}.{name}" if name else prefix


def cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating-point tensor in it cast to ``dtype``."""
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, value)


def _own_inputs(inputs: object) -> Inputs:
    """``inputs_b`` checked: a pair ``(args tuple, kwargs dict)``, as ``inputs=`` of ``hs.extract`` returns."""
    if isinstance(inputs, tuple) and len(inputs) == 2 and isinstance(inputs[0], tuple) and isinstance(inputs[1], dict):
        return inputs[0], inputs[1]
    raise SpecError(
        f"inputs_b is {type(inputs).__name__}; expected b's (args tuple, kwargs dict), "
        "e.g. inputs_b=((x.half(),), {})"
    )


def _moved(value: Any, device: torch.device) -> Any:
    return map_tensors(lambda t: t.to(device), value)


def _usable_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch device this process can put tensors on; else ``SpecError`` saying why."""
    target = parse_device(device)
    assert target is not None
    try:
        torch.empty(0, device=target)
    except (RuntimeError, AssertionError) as error:  # a CPU build asked for CUDA raises AssertionError
        raise SpecError(
            f"device {str(target)!r} cannot be used here ({type(error).__name__}: {error}); compare against a "
            f"device this machine has, e.g. 'cpu' or 'meta' (torch {torch.__version__})"
        ) from None
    return target


def _given(rtol: float | None, atol: float | None, dtypes: list[torch.dtype]) -> tuple[float, float]:
    """The tolerances asked for, each left out one the default for these dtypes."""
    default_rtol, default_atol = tolerances(*dtypes)
    return (default_rtol if rtol is None else rtol), (default_atol if atol is None else atol)


class DiffFunction:
    """``hs.diff(a, b, *args, **kwargs)``, and the built-in comparisons ``hs.diff.dtypes``,
    ``hs.diff.compiled`` and ``hs.diff.devices``."""

    def __call__(
        self,
        a: nn.Module | Cache,
        b: nn.Module | Cache,
        *args: Any,
        match: Match = "name",
        layers: Selector | Sequence[Selector] | None = None,
        rtol: float | None = None,
        atol: float | None = None,
        keep_on: str | torch.device = "cpu",
        model_kwargs: dict[str, Any] | None = None,
        inputs_b: Inputs | None = None,
        **kwargs: Any,
    ) -> Diff:
        """Compare ``a`` and ``b`` layer by layer: two models run on the same inputs, or two captures.

        For each site (module and call) and each output tensor: max and mean |a - b|, relative
        error ``||a - b|| / ||a||``, cosine similarity, SQNR in dB, and whether it is within
        ``max|a - b| <= atol + rtol * max|a|``; the call's inputs are compared too, so
        :meth:`Diff.first_divergence` can tell a layer that introduced a difference from one that
        was handed it. Sites are paired ``match="name"`` (default), by a mapping of name patterns
        (``{"model.layers.*": "transformer.h.*"}``), by a function of a's names, by execution
        order (``"order"``, for the same structure under other names), or by canonical name
        (``"std"``, for two architectures: the modules carrying ``blocks.3.attn``, ``embed``,
        ... in each, see :func:`hookscope.std_map`). ``layers`` limits the comparison to a's
        modules a selector picks (``"std:..."`` selectors included).

        Models run once each under ``torch.no_grad()``, a first: its values are copied to
        ``keep_on`` (the CPU) as they are made, then b's are compared the moment they exist and
        a's copy is dropped, so the peak is one copy of a's values plus b's own forward.
        Train/eval modes are left as they are (use eval mode: dropout would differ).

        ``inputs_b=(args, kwargs)`` gives b inputs of its own, for a b that cannot take a's:
        a copy in another dtype needs inputs in that dtype, a port may name its arguments
        differently. They should hold the same values, or every site differs from the first.

        Example::

            d = hs.diff(model, quantised, x)
            print(d.first_divergence())     # first divergence at h.3.mlp#0 (Linear): ...
            d.to_pandas()

        b in float64, given float64 inputs; the output's max|a-b| is the one computed by hand:

        >>> import copy, hookscope as hs
        >>> a = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        >>> b, x = copy.deepcopy(a).double(), torch.randn(2, 4)
        >>> d = hs.diff(a, b, x, inputs_b=((x.double(),), {}))
        >>> [row.site for row in d.rows], d.within(rtol=1e-5, atol=1e-6)
        (['0#0', '1#0', '(root)#0'], True)
        >>> with torch.no_grad():
        ...     by_hand = (a(x).double() - b(x.double())).abs().max().item()
        >>> d.rows[-1].metrics.max_abs == by_hand
        True
        """
        if isinstance(a, Cache) or isinstance(b, Cache):
            if not (isinstance(a, Cache) and isinstance(b, Cache)):
                raise SpecError("pass two models or two captures (Cache) to hs.diff, not one of each")
            if args or kwargs or inputs_b is not None:
                raise SpecError("two captures are compared as they are: pass no inputs with them")
            if match == "std":
                raise SpecError("match='std' pairs the modules of two models; two captures are paired by their names")
            rtol, atol = _given(rtol, atol, [v.dtype for cache in (a, b) for v in cache.values()])
            return compare_caches(a, b, match=match, rtol=rtol, atol=atol)
        inputs = (args, {**kwargs, **(model_kwargs or {})})
        other = inputs if inputs_b is None else _own_inputs(inputs_b)
        rtol, atol = _given(rtol, atol, model_dtypes(ensure_module(a), ensure_module(b)))
        return compare_models(a, b, inputs, other, match=match, layers=layers, rtol=rtol, atol=atol, keep_on=keep_on)

    def tolerances(self, *dtypes: torch.dtype | None) -> tuple[float, float]:
        """The default ``(rtol, atol)`` for values of these dtypes: ``(1e-5, 1e-8)`` for float32
        and float64, ``(1e-2, 1e-3)`` when any is bfloat16, float16 or narrower. ``hs.diff``
        takes them from the dtypes of the two models' parameters (or the captured values).

        >>> import hookscope as hs
        >>> hs.diff.tolerances(torch.float32, torch.bfloat16)
        (0.01, 0.001)
        """
        return tolerances(*dtypes)

    def dtypes(
        self,
        model: nn.Module,
        *args: Any,
        dtype: torch.dtype | str | None = None,
        autocast: bool = False,
        rtol: float | None = None,
        atol: float | None = None,
        **kwargs: Any,
    ) -> Diff:
        """``model`` in its own dtype against a copy cast to ``dtype`` (inputs cast too), or, with
        ``autocast=True``, against the same model under ``torch.autocast`` on its device.

        The dtype may also come last among the positional arguments, as in the example; it
        defaults to bfloat16. Tolerances default to :meth:`tolerances` of that dtype (for bf16 and
        fp16: rtol 1e-2, atol 1e-3), the same as ``hs.diff`` of a model and such a copy.

        Example::

            print(hs.diff.dtypes(model, x, torch.bfloat16))     # where bf16 loses the most
        """
        from hookscope._shared.dtypes import floating_dtype

        if args and isinstance(args[-1], torch.dtype):  # hs.diff.dtypes(model, x, torch.bfloat16)
            if dtype is not None:
                raise SpecError(f"two dtypes given: {args[-1]} among the inputs and dtype={dtype!r}; pass one")
            args, dtype = args[:-1], args[-1]
        target = floating_dtype(torch.bfloat16 if dtype is None else dtype)
        if target is None:
            raise SpecError("dtype: name the floating dtype to compare against, e.g. torch.bfloat16 or 'fp16'")
        inputs = (args, kwargs)
        rtol, atol = _given(rtol, atol, [target])
        options: dict[str, Any] = {"layers": None, "rtol": rtol, "atol": atol, "keep_on": "cpu"}
        if autocast:
            device = next((p.device.type for p in model.parameters() if not p.is_meta), "cpu")  # offloaded: meta
            wrapped = _Autocast(model, device, target)
            return compare_models(model, wrapped, inputs, inputs, match=_inside("inner"), paired_b_only=True, **options)
        cast = copy.deepcopy(model).to(target)
        return compare_models(
            model, cast, inputs, (cast_floats(args, target), cast_floats(kwargs, target)), match="name", **options
        )

    def compiled(
        self,
        model: nn.Module,
        *args: Any,
        backend: str = "inductor",
        rtol: float = 1e-4,
        atol: float = 1e-5,
        **kwargs: Any,
    ) -> Diff:
        """``model`` eager against ``torch.compile(model, backend=backend)``, compared at the
        model's output: inside a compiled graph the submodules' hooks would break the graph or
        not run at all, so only the whole model is compared. To find the layer, compile the
        layers one at a time, or diff eager against ``backend="eager"`` (graph capture alone).

        Example::

            hs.diff.compiled(model, x).within()     # does inductor change the result?
        """
        compiled = _Compiled(model, backend)
        inputs = (args, kwargs)
        options: dict[str, Any] = {"rtol": rtol, "atol": atol, "keep_on": "cpu"}
        return compare_models(model, compiled, inputs, inputs, match="name", layers=[""], paired_b_only=True, **options)

    def devices(
        self,
        model: nn.Module,
        *args: Any,
        device: str | torch.device | None = None,
        rtol: float = 1e-4,
        atol: float = 1e-5,
        **kwargs: Any,
    ) -> Diff:
        """``model`` where it is against a copy on ``device`` (inputs moved too), layer by layer.

        The device may also come last among the positional arguments; it defaults to ``cuda``.

        Example::

            hs.diff.devices(model, x, "cuda").first_divergence()
        """
        if args and _is_device(args[-1]):  # hs.diff.devices(model, x, "cuda")
            if device is not None:
                raise SpecError(f"two devices given: {args[-1]!r} among the inputs and device={device!r}; pass one")
            args, device = args[:-1], args[-1]
        target = _usable_device("cuda" if device is None else device)
        moved = copy.deepcopy(model).to(target)
        inputs = (args, kwargs)
        options: dict[str, Any] = {"layers": None, "rtol": rtol, "atol": atol, "keep_on": "cpu"}
        return compare_models(
            model, moved, inputs, (_moved(args, target), _moved(kwargs, target)), match="name", **options
        )

    def __repr__(self) -> str:
        return "<function hookscope.diff (and .dtypes, .compiled, .devices)>"


class _Autocast(nn.Module):
    """The same model, called under ``torch.autocast``: its module names are the model's own."""

    def __init__(self, model: nn.Module, device: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.inner = model
        self._device, self._dtype = device, dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self._device, dtype=self._dtype):
            return self.inner(*args, **kwargs)


class _Compiled(nn.Module):
    """``torch.compile(model)`` as one module: compared at its output, by execution order."""

    def __init__(self, model: nn.Module, backend: str) -> None:
        super().__init__()
        self.__dict__["_compiled"] = torch.compile(model, backend=backend)  # not a submodule: no hooks inside

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        compiled: Callable[..., Any] = self.__dict__["_compiled"]
        return compiled(*args, **kwargs)


diff = DiffFunction()
