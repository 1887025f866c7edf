"""Strict JSON for values that hold NaN and Inf: what ``json.dumps(allow_nan=False)`` accepts."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["finite_json"]


def finite_json(value: Any) -> Any:
    """``value`` with every non-finite float written as ``"nan"``, ``"inf"`` or ``"-inf"``.

    Python's JSON writes NaN as a bare ``NaN``, which is not JSON: browsers and most readers
    refuse it. Dicts, lists and tuples are walked; everything else is kept as it is.

    >>> finite_json({"a": [1.0, float("nan")], "b": -float("inf")})
    {'a': [1.0, 'nan'], 'b': '-inf'}
    """
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {key: finite_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(item) for item in value]
    return value
