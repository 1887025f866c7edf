"""``logit_lens``: what each layer's residual stream would predict, read through the model's own
final norm and unembedding; a tuned lens when the caller passes a translator per layer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hookscope._core.compat.offload import ensure_loaded
from hookscope._core.std import known_std_map
from hookscope._methods.metrics import MetricFn, metric_name
from hookscope._methods.resid import _captured, final_norm, stack_std, unembed
from hookscope._shared.tables import Column, Table
from hookscope.errors import SpecError

__all__ = ["Lens", "logit_lens"]

Decode = Callable[[int], str] | Sequence[str] | None


@dataclass
class Lens:
    """The logit lens of one run: ``logits[layer, row, position, vocab]`` for each layer in ``layers``.

    :meth:`top` gives the top tokens of a position per layer, :attr:`scores` the metric per layer
    (when one was given) and :meth:`plot` the usual grid: layers down, positions across, each cell
    the top token and its probability.
    """

    logits: torch.Tensor
    layers: list[str]
    scores: torch.Tensor | None = None  # (layer,) the metric, mean over rows
    metric: str = ""
    decode: Decode = None

    def probs(self) -> torch.Tensor:
        """``softmax(logits)`` over the vocabulary, in float32."""
        return self.logits.float().softmax(-1)

    def top(self, k: int = 5, *, position: int = -1, row: int = 0) -> list[list[tuple[int, float]]]:
        """Per layer, the ``k`` most likely token ids at ``position`` of ``row``, with probabilities."""
        probs = self.probs()[:, row, position]
        values, ids = probs.topk(min(k, probs.shape[-1]), dim=-1)
        return [list(zip(i.tolist(), v.tolist(), strict=True)) for i, v in zip(ids, values, strict=True)]

    def token(self, token_id: int) -> str:
        """A token id as text, through ``decode`` (a tokenizer's ``decode`` or a list), else the id."""
        if self.decode is None:
            return str(token_id)
        if callable(self.decode):
            return str(self.decode(token_id))
        return str(self.decode[token_id])

    def plot(self, *, row: int = 0, title: str | None = None) -> Any:
        """Layers down, positions across, each cell the top token coloured by its probability
        (:func:`hookscope.plots.lens`); returns the matplotlib ``Figure``."""
        from hookscope.plots import lens

        return lens(self, row=row, title=title)

    def _table(self, k: int = 3) -> Table:
        columns = [Column("layer"), Column("top tokens (last position, row 0)")]
        if self.scores is not None:
            columns.append(Column(self.metric or "metric", "right"))
        table = Table(columns, title=f"Logit lens: {len(self.layers)} layers")
        for index, (name, best) in enumerate(zip(self.layers, self.top(k), strict=True)):
            tokens = "  ".join(f"{self.token(i)} {p:.2f}" for i, p in best)
            cells = [name, tokens] + ([f"{float(self.scores[index]):.4g}"] if self.scores is not None else [])
            table.add(*cells)
        return table

    def __repr__(self) -> str:
        return self._table().text()

    def _repr_html_(self) -> str:
        return self._table().html()


def logit_lens(
    model: nn.Module,
    inputs: Any,
    *,
    layers: str | Sequence[str] | None = None,
    metric: MetricFn | None = None,
    translators: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] | None = None,
    decode: Decode = None,
    stack: str = "",
    model_kwargs: dict[str, Any] | None = None,
) -> Lens:
    """Project each layer's residual stream through the final norm and the unembedding.

    Args:
        model: a model with an LM head (``std:ln_final`` and ``std:unembed`` in its map).
        inputs: token ids, a dict of keyword inputs or a tuple of positional inputs.
        layers: canonical names of the residual values to read (default every
            ``blocks.*.resid_post``; ``"std:blocks.*.resid_pre"`` works too).
        metric: scored on each layer's logits (``hs.methods.logit_diff(...)``): ``lens.scores``.
        translators: a tuned lens: ``{canonical name: module or function}`` applied to that
            layer's residual before the norm (layers without one are read as they are).
        decode: turns token ids into text for ``print(lens)`` and ``lens.plot()``: a tokenizer's
            ``decode`` or a list of strings.
        stack: ``"decoder."`` reads an encoder-decoder's decoder (its blocks and final norm).

    A model without a final norm (post-norm stacks such as BART, whose blocks end in their own)
    is read through the unembedding alone. The last layer's ``resid_post`` through the lens is
    the model's own logits where the model does nothing between its final norm and its LM head
    and after it (T5 with tied embeddings scales by ``d_model ** -0.5`` before the head, Gemma 2
    soft-caps after it: their lens leaves those out).

    Example::

        lens = hs.methods.logit_lens(gpt2_lm, ids, decode=tokenizer.decode)
        print(lens)                          # top tokens per layer at the last position
        lens.top(5, position=3); lens.plot().savefig("lens.png")
    """
    ensure_loaded(model)  # a meta model: one line, not torch's error
    chosen = layers if layers is not None else f"std:{stack}blocks.*.resid_post"
    patterns = [chosen] if isinstance(chosen, str) else list(chosen)
    std = known_std_map(model)
    names = [
        site.name
        for pattern in patterns
        for site in std.expand(pattern if pattern.startswith("std:") else "std:" + pattern)
    ]
    if translators is not None:
        unknown = [name for name in translators if name not in names]
        if unknown:
            raise SpecError(f"translators for {unknown}, which the lens does not read; its layers: {names[:6]}...")
    norm, head = final_norm(model, stack, or_identity=True), unembed(model, stack)
    resid = stack_std(_captured(model, inputs, names, model_kwargs), names).tensor
    logits = []
    with torch.no_grad():
        for name, value in zip(names, resid, strict=True):
            translated = translators[name](value) if translators and name in translators else value
            logits.append(head(norm(translated)))
    stacked = torch.stack(logits)
    scores = None
    if metric is not None:
        scores = torch.stack([metric(layer_logits).detach().double().mean() for layer_logits in stacked])
    return Lens(stacked, names, scores, metric_name(metric) if metric is not None else "", decode)
