"""``hookscope report``'s loss: a word for a quick look at gradients, or a function of the user's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import hookscope as hs
from hookscope.cli.parse.specs import load_attribute
from hookscope.errors import SpecError

__all__ = ["LOSS_FORMS", "loss_from_spec"]

LOSS_FORMS = "'mean', 'norm', 'package.module:function' or 'path/to/file.py:function'"


def loss_from_spec(spec: str) -> Callable[[Any], torch.Tensor]:
    """The ``loss_fn`` that ``--loss SPEC`` names.

    ``mean`` and ``norm`` reduce the model's main output (its first floating-point tensor,
    e.g. logits or ``last_hidden_state``): enough to see how gradient flows back through
    the layers. A ``module:function`` is called with the model's output and returns a scalar.
    """
    if spec in ("mean", "norm"):
        return lambda output: _reduce(_main_tensor(output), spec)
    found, name = load_attribute(spec, kind="loss", forms=LOSS_FORMS)
    if not callable(found):
        raise SpecError(f"loss {spec!r}: {name!r} is {type(found).__name__}, not a function of the model's output")
    function: Callable[[Any], torch.Tensor] = found

    def loss_fn(output: Any) -> torch.Tensor:
        try:
            return function(output)
        except Exception as error:  # the user's function failed, not the model: say which
            raise SpecError(f"--loss {spec}: {name}(output) raised {type(error).__name__}: {error}") from error

    return loss_fn


def _main_tensor(output: Any) -> torch.Tensor:
    for _, tensor in hs.flatten_tensors(output):
        if tensor.is_floating_point():
            return tensor
    raise SpecError("the model's output holds no floating-point tensor to take a loss of; pass --loss module:function")


def _reduce(tensor: torch.Tensor, how: str) -> torch.Tensor:
    values = tensor.float()
    return values.mean() if how == "mean" else values.norm()
