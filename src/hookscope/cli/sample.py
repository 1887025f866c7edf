"""Shared by the commands that run a model: build it, make its sample input, run it, blame well.

The sample input is made up on the command line's behalf, so when the forward pass fails on it,
the input is the likeliest culprit: such failures become a ``SpecError`` that suggests
``--input-shape`` instead of a bare traceback from deep inside the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from torch import nn

import hookscope as hs
from hookscope.cli.parse.specs import load_model, make_input
from hookscope.errors import HookscopeError, SpecError

__all__ = ["SampleRun", "build_model", "prepare"]

T = TypeVar("T")


@dataclass(frozen=True)
class SampleRun:
    """A model built from its spec, with the sample input to run it on."""

    model: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def describe_input(self) -> str:
        """``"input: (1, 3, 32, 32) float32"`` or ``"input: input_ids (1, 16) int64"``."""
        labelled = [("", x) for x in self.args] + [(f"{name} ", x) for name, x in self.kwargs.items()]
        parts = [f"{label}{tuple(x.shape)} {hs.dtype_name(x.dtype)}" for label, x in labelled]
        return "input: " + ", ".join(parts)

    def run(self, call: Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], T]) -> T:
        """``call(model, args, kwargs)``; a failure that is not hookscope's is blamed on the input."""
        try:
            return call(self.model, self.args, self.kwargs)
        except HookscopeError:
            raise
        except Exception as error:
            raise SpecError(
                f"the forward pass on the sample input raised {type(error).__name__}: {error}; "
                "pass an --input-shape the model accepts"
            ) from error


def build_model(model_spec: str, dtype: str | None) -> nn.Module:
    """Build the model ``model_spec`` names, cast to ``dtype`` if given."""
    model = load_model(model_spec)
    return model.to(hs.parse_dtype(dtype)) if dtype is not None else model


def prepare(model_spec: str, input_shape: str | None, dtype: str | None, seed: int = 0) -> SampleRun:
    """Build the model (cast to ``dtype`` if given) and its sample input."""
    model = build_model(model_spec, dtype)
    args, kwargs = make_input(model, input_shape, dtype=dtype, seed=seed)
    return SampleRun(model, args, kwargs)
