"""What a patching study checks before it runs: the model's mode, and the sites it patches by default.

A study compares runs that must differ only by the patch. A module in training mode breaks that
in ways no option of the study can repair: dropout (``nn.Dropout`` or ``F.dropout`` inside a
module's code) draws other units in every run and consumes the random generator, and batch norm
normalises each run by its own batch, so one patched copy of the batch changes the others, and
moves the running statistics, a change to the model that outlives the study. So any module in
training mode is refused, before the first forward: nothing has run, nothing moved.

The default sites are canonical names, which exist for transformers. Their map is made from the
model's sample input where hookscope can make one, else from the study's own clean input; a model
with no map at all (an MLP, a CNN) is told to name its sites.
"""

from __future__ import annotations

import re

from torch import nn

from hookscope._arch.std import StdMap, known_std_map, std_map
from hookscope._methods.runs import Inputs
from hookscope.errors import SpecError, StdMapError

__all__ = ["DEFAULT_SITES", "HEAD_SITES", "default_sites", "refuse_training"]

DEFAULT_SITES = "std:{stack}blocks.*.resid_pre"
HEAD_SITES = "std:{stack}blocks.*.attn.z"
_STACK = re.compile(r"^(?P<stack>(?:[^.]+\.)*)blocks\.0\.resid_pre$")


def refuse_training(model: nn.Module, method: str) -> None:
    """Refuse a model with any module in training mode (see the module doc)."""
    training = [(name, module) for name, module in model.named_modules() if module.training]
    if not training:
        return
    stateful = (nn.modules.batchnorm._BatchNorm, nn.modules.dropout._DropoutNd)
    name, module = next(((n, m) for n, m in training if isinstance(m, stateful)), training[0])
    example = f"'{name}' ({type(module).__name__})" if name else f"the model itself ({type(module).__name__})"
    count = len(training)
    raise SpecError(
        f"{method}: {count} module{'' if count == 1 else 's'} of the model {'is' if count == 1 else 'are'} in "
        f"training mode, e.g. {example}: dropout draws other units on every run and batch norm normalises by "
        "the batch and moves its running statistics, so the runs would not be the model at inference; "
        "call model.eval() first"
    )


def default_sites(model: nn.Module, by_head: bool, stack: str, clean: Inputs, method: str) -> str:
    """The canonical sites a study patches when given none: every block's ``resid_pre`` (by head,
    ``attn.z``) in ``stack`` (``""``, or an encoder-decoder's ``"decoder."``/``"encoder."``)."""
    if not isinstance(stack, str) or (stack and not stack.endswith(".")):
        raise SpecError(f"stack={stack!r}: expected an encoder-decoder's 'decoder.' or 'encoder.' (or '')")
    pattern = (HEAD_SITES if by_head else DEFAULT_SITES).format(stack=stack)
    std = _map(model, clean, method, pattern)
    stacks = [match["stack"] for name in std if (match := _STACK.match(name))]
    if stack not in stacks:
        if not stacks:
            raise SpecError(f"{method}: this {std.family} model's canonical map has no blocks; pass layers=")
        model_is = (
            f"stack={stack!r} names no stack of this {std.family} model"
            if stack
            else (f"this {std.family} model is an encoder-decoder")
        )
        named = " and ".join(repr(s) for s in stacks)
        raise SpecError(
            f"{method}: {model_is}, whose blocks are in {named}; pass stack={stacks[-1]!r} (or another of them), "
            "or layers="
        )
    return pattern


def _map(model: nn.Module, clean: Inputs, method: str, pattern: str) -> StdMap:
    """The model's canonical map, made from the clean input where hookscope cannot make a sample."""
    try:
        return known_std_map(model)
    except StdMapError as error:
        failed = error
    if failed.check == "no sample input":
        try:
            return std_map(model, *clean.args, **clean.kwargs)
        except StdMapError as error:
            failed = error
    children = [name for name, _ in model.named_children()][:2]
    example = f", e.g. layers={children}" if children else ""
    raise StdMapError(
        f"{method}'s default sites ({pattern}) are canonical names of transformer blocks, and this "
        f"{type(model).__name__} has none ({failed.check or failed}): pass layers= with the modules or values to "
        f"patch (names, globs or selectors{example})",
        family=failed.family,
        check=failed.check,
    )
