"""``--edit`` specs of the ``edit`` command: ``SELECTOR=KIND[:key=value]...``.

Examples: ``layer1.0.conv2=zero:channels=0,3``, ``h.*=scale:factor=0.5:neurons=7``,
``fc=clamp:min=-1:max=1``, ``h.0=noise:std=0.1:seed=3:positions=2``; op sites and attention
sub-sites are selectors too: ``h.0:op[add#0]=scale:factor=0``, ``h.0.attn:attn.z=zero:heads=3``
(the selector ends at the first ``=``, so its ``:`` are its own). The kinds that need no
tensor or cache work here: ``zero``, ``scale``, ``clamp``, ``noise``; options are the part
(``channels``, ``neurons``, ``positions``, ``heads`` with ``num_heads``) and ``path``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hookscope import edits
from hookscope.errors import SpecError

__all__ = ["KINDS", "parse_edit"]

_LISTS = ("channels", "neurons", "positions", "heads")
_INTS = ("num_heads", "seed")
_FLOATS = ("factor", "min", "max", "std")
KINDS: dict[str, tuple[Callable[..., edits.Edit], tuple[str, ...]]] = {
    "zero": (edits.zero, ()),
    "scale": (edits.scale, ("factor",)),
    "clamp": (edits.clamp, ()),
    "noise": (edits.noise, ("std",)),
}
_EXAMPLE = "e.g. 'layer1.0.conv2=zero:channels=0,3', 'h.*=scale:factor=0.5' or 'h.0.attn:attn.z=zero:heads=3'"


def parse_edit(text: str) -> tuple[str, edits.Edit]:
    """``(selector, edit)`` from one ``--edit`` value."""
    selector, equals, rest = text.partition("=")
    if not equals or not selector.strip() or not rest:
        raise SpecError(f"--edit {text!r} is not SELECTOR=KIND[:key=value]...; {_EXAMPLE}")
    kind, *options = rest.split(":")
    if kind not in KINDS:
        raise SpecError(f"--edit {text!r}: unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
    factory, required = KINDS[kind]
    values: dict[str, Any] = {}
    for option in options:
        key, equals, raw = option.partition("=")
        if not equals or not raw:
            raise SpecError(f"--edit {text!r}: option {option!r} is not key=value; {_EXAMPLE}")
        values[key] = _value(text, key, raw)
    missing = [name for name in required if name not in values]
    if missing:
        raise SpecError(f"--edit {text!r}: {kind} needs {', '.join(f'{m}=' for m in missing)}")
    positional = [values.pop(name) for name in required]
    return selector.strip(), factory(*positional, **values)


def _value(text: str, key: str, raw: str) -> Any:
    try:
        if key in _LISTS:
            return [int(part) for part in raw.split(",")]
        if key in _INTS:
            return int(raw)
        if key in _FLOATS:
            return float(raw)
    except ValueError:
        raise SpecError(f"--edit {text!r}: {key}={raw!r} is not a number (list: comma-separated)") from None
    if key == "path":
        return raw
    known = ", ".join((*_LISTS, *_INTS, *_FLOATS, "path"))
    raise SpecError(f"--edit {text!r}: unknown option {key!r}; known: {known}")
