"""What a model does between its final norm and its logits, measured on the run the lens reads.

The logit lens reads each layer as the model reads its last one: through the final norm and the
LM head. Most models call the head on the norm's output and return the head's output as their
logits, but some do more, in code between the modules where no hook sees it: T5 with tied
embeddings multiplies the norm's output by ``d_model ** -0.5`` before its head, BART-like models
add ``final_logits_bias`` after it, Granite and Cohere scale the logits, Gemma 2 soft-caps them
(``tanh``: not linear). Reading each model's config for these is a list that never ends, so the
run that captures the layers also keeps the norm's output, the head's input and output and the
model's logits, and the two steps are fitted on them (in float64): a scale before the head, a
scale and a per-token bias after it. A fit that reproduces every value to the tolerance of its
dtype (``hs.diff``'s table, relative to the terms each value sums) is applied to every layer; a
step that no such map reproduces is left out, and :meth:`Readout.describe` (shown by
``print(lens)``) says which. A non-linear step the config declares (Gemma 2's
``final_logit_softcapping``) is never fitted: on small logits a soft-cap is a scale of 1 to
within bf16's rounding, which is no reason to call it one.

Where the head takes another width than the norm gives (OPT's ``word_embed_proj_dim``), the
model projects between them: the linear module that maps the norm's output to the head's input
on this run (``project_out``) is applied too, or the lens is refused, naming the widths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hookscope._shared.tolerances import tolerances
from hookscope.errors import SpecError

__all__ = ["Readout", "measure_readout"]


@dataclass(frozen=True)
class Readout:
    """The steps between the final norm's output and the logits: ``logits = scale * head(before *
    project(normed)) + bias``, with what could not be written so in ``left_out``. ``project``:
    the model's own linear module between the norm and the head (``project_name``), or none."""

    before: float = 1.0
    scale: float = 1.0
    bias: torch.Tensor | None = None
    left_out: tuple[str, ...] = ()
    project: nn.Module | None = None
    project_name: str = ""

    def __call__(self, head: nn.Module, normed: torch.Tensor) -> torch.Tensor:
        if self.project is not None:
            normed = self.project(normed)
        logits: torch.Tensor = head(normed * self.before if self.before != 1.0 else normed)
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.bias is not None:
            logits = logits + self.bias.to(logits.device, logits.dtype)
        return logits

    def describe(self, norm: str, head: str) -> str:
        """One line: ``norm`` and ``head`` (how the caller names them), the steps applied besides
        them, and those left out."""
        steps = [f"read through {norm}"] if norm else []
        steps.append(self.project_name if self.project is not None else "")
        steps.append(f"x {self.before:.6g}" if self.before != 1.0 else "")
        steps.append(head)
        steps.append(f"x {self.scale:.6g}" if self.scale != 1.0 else "")
        steps.append("+ the model's bias per token" if self.bias is not None else "")
        line = " then ".join(step for step in steps if step)
        line = line if norm else f"read through {line}"
        if self.left_out:
            line += "; left out, so the last layer is not the model's own logits: " + "; ".join(self.left_out)
        return line


def measure_readout(
    normed: torch.Tensor,
    head_in: torch.Tensor | None,
    head_out: torch.Tensor,
    logits: torch.Tensor | None,
    *,
    projections: Sequence[tuple[str, nn.Module]] = (),
    known_after: str = "",
) -> Readout:
    """The :class:`Readout` of one run: ``normed`` the final norm's output (or, without a final norm,
    the last block's), ``head_in`` and ``head_out`` the LM head's input and output, ``logits`` the
    model's. ``None`` for a value the run did not show (a head called by keyword, an output without
    logits): that step is taken as nothing and named in ``left_out``. ``projections``: the model's
    linear modules that may map the norm's output to the head's input where their widths differ;
    ``known_after``: a non-linear step after the head the model's config declares (never fitted)."""
    left_out = []
    before = 1.0
    project: tuple[str, nn.Module] | None = None
    if head_in is None:
        left_out.append("the head's input was not seen (it is passed by keyword), so no step before the head")
    else:
        if normed.shape != head_in.shape:
            project = _projection(normed, head_in, projections)
            with torch.no_grad():
                normed = project[1](normed)
        fitted = _scale(normed, head_in)
        if fitted is None:
            left_out.append(f"what the model does before the head ({_why(normed, head_in, 'a scale')})")
        else:
            before = fitted
    scale, bias = 1.0, None
    if logits is None:
        left_out.append("the model's output holds no logits to compare the head's output with")
    elif known_after and not torch.equal(head_out, logits):
        left_out.append(f"what the model does after the head ({known_after}, not linear)")
    else:
        after = _affine(head_out, logits)
        if after is None:
            left_out.append(f"what the model does after the head ({_why(head_out, logits, 'a scale and a bias')})")
        else:
            scale, bias = after
    if project is None:
        return Readout(before, scale, bias, tuple(left_out))
    return Readout(before, scale, bias, tuple(left_out), project[1], project[0])


def _projection(
    normed: torch.Tensor, head_in: torch.Tensor, projections: Sequence[tuple[str, nn.Module]]
) -> tuple[str, nn.Module]:
    """The module among ``projections`` that maps ``normed`` to ``head_in`` on this run (to the
    dtype's tolerance, up to a scale fitted after it), else a ``SpecError``: the head cannot take
    the norm's output, so no layer could be read through it."""
    width, wanted = normed.shape[-1], head_in.shape[-1]
    for name, module in projections:
        if getattr(module, "in_features", None) != width or getattr(module, "out_features", None) != wanted:
            continue
        with torch.no_grad():
            projected = module(normed)
        if projected.shape == head_in.shape and _scale(projected, head_in) is not None:
            return name, module
    raise SpecError(
        f"the LM head takes values of width {wanted} and the final norm gives {width}: the model projects "
        f"between them, and none of its linear modules from {width} to {wanted} outside the blocks reproduces the "
        "head's input on this run (OPT's project_out would), so no layer can be read through the head"
    )


def _why(x: torch.Tensor, y: torch.Tensor, linear: str) -> str:
    if x.shape != y.shape:
        return f"its input has shape {tuple(x.shape)} and its output {tuple(y.shape)}"
    return f"not {linear}: a soft-cap, as Gemma 2's, or another curve"


#: Rows (positions) a fit reads, spread over the run: a scale and a bias are fitted as well on a
#: few hundred as on all, and a float64 copy of a large vocabulary's logits is not made.
_FIT_ROWS = 256
#: Rows compared at once when a fit is checked on every row, in float64.
_CHECK_ROWS = 1024


def _rows(value: torch.Tensor) -> torch.Tensor:
    return value.reshape(-1, value.shape[-1]) if value.dim() else value.reshape(1, 1)


def _sample(value: torch.Tensor) -> torch.Tensor:
    """Up to ``_FIT_ROWS`` rows of ``value`` (rows, features), evenly spread, in float64."""
    step = max(1, value.shape[0] // _FIT_ROWS)
    return value[::step][:_FIT_ROWS].double()


def _within(x: torch.Tensor, y: torch.Tensor, a: float, b: torch.Tensor | None) -> bool:
    """``a * x + b`` reproduces each value of ``y`` to the dtypes' tolerance (``hs.diff``'s
    table), relative to that value's own terms (``|a x| + |b|``, and ``|y|``): the rounding the
    model's own step leaves there, not a tolerance of the largest logit, which lets a small
    curve pass for a line."""
    rtol, atol = tolerances(x.dtype, y.dtype)
    worst = torch.zeros((), dtype=torch.float64, device=y.device)
    for start in range(0, x.shape[0], _CHECK_ROWS):
        wanted = y[start : start + _CHECK_ROWS].double()
        scaled = a * x[start : start + _CHECK_ROWS].double()
        fitted = scaled + (0.0 if b is None else b)
        terms = torch.maximum(scaled.abs() + (0.0 if b is None else b.abs()), wanted.abs())
        worst = torch.maximum(worst, ((fitted - wanted).abs() - rtol * terms).max())
    return float(worst) <= atol  # one read back, after every chunk


def _scale(x: torch.Tensor, y: torch.Tensor) -> float | None:
    """``a`` with ``y == a * x`` to the dtypes' tolerance (1.0 where they are equal), else None."""
    if x.shape != y.shape:
        return None
    if torch.equal(x.to(y.dtype), y):
        return 1.0
    x2, y2 = _rows(x), _rows(y)
    xs, ys = _sample(x2), _sample(y2)
    norm = float((xs * xs).sum())
    if norm == 0.0:
        return None
    a = float((xs * ys).sum()) / norm
    return a if _within(x2, y2, a, None) else None


def _affine(h: torch.Tensor, logits: torch.Tensor) -> tuple[float, torch.Tensor | None] | None:
    """``(a, b)`` with ``logits == a * h + b`` (``b`` one value per token, None for none) to the
    dtypes' tolerance, else None. A bias needs two rows of values to be told from a scale."""
    scale = _scale(h, logits)
    if scale is not None:
        return scale, None
    if h.shape != logits.shape or h.dim() < 2:
        return None
    h2, l2 = _rows(h), _rows(logits)
    h_fit, l_fit = _sample(h2), _sample(l2)
    if h_fit.shape[0] < 2:
        return None
    h_mean, l_mean = h_fit.mean(0), l_fit.mean(0)
    if _within(h2, l2, 1.0, l_mean - h_mean):  # a bias alone: no scale fitted near 1
        return 1.0, (l_mean - h_mean).to(logits.dtype)
    spread = float(((h_fit - h_mean) ** 2).sum())
    if spread == 0.0:
        return None
    a = float(((h_fit - h_mean) * (l_fit - l_mean)).sum()) / spread
    b = l_mean - a * h_mean
    return (a, b.to(logits.dtype)) if _within(h2, l2, a, b) else None
