"""``logit_lens``: what each layer's residual stream would predict, read through the model's own
final norm and unembedding, and every linear step the model takes between them and its logits
(measured on the same run, :mod:`~hookscope._methods.readout`); a tuned lens when the caller
passes a translator per layer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hookscope._arch.std import known_std_map
from hookscope._core.compat.offload import ensure_loaded
from hookscope._core.names import escape_name
from hookscope._core.std_names import STD_PREFIX, StdMap
from hookscope._methods.metrics import MetricFn, check_metric, logits_of, metric_name, run_score, with_logits
from hookscope._methods.readout import Readout, measure_readout
from hookscope._methods.resid import block_count, captured_run, final_norm, unembed, unembed_site
from hookscope._shared.tables import Column, Table
from hookscope.errors import SiteNotFoundError, SpecError

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
    #: What was applied between the final norm and the logits besides the head, and what was left out.
    readout: str = ""

    def probs(self) -> torch.Tensor:
        """``softmax(logits)`` over the vocabulary, in float32."""
        return self.logits.float().softmax(-1)

    def top(self, k: int = 5, *, position: int = -1, row: int = 0) -> list[list[tuple[int | str, float]]]:
        """Per layer, the ``k`` most likely tokens at ``position`` of ``row`` with their probabilities:
        as text where the lens has ``decode``, else as ids."""
        probs = self.probs()[:, row, position]
        values, ids = probs.topk(min(k, probs.shape[-1]), dim=-1)
        shown = self.token if self.decode is not None else int
        return [
            [(shown(i), p) for i, p in zip(layer_ids.tolist(), layer_values.tolist(), strict=True)]
            for layer_ids, layer_values in zip(ids, values, strict=True)
        ]

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
        table = Table(
            columns, title=f"Logit lens: {len(self.layers)} layers", notes=[self.readout] if self.readout else []
        )
        for index, (name, best) in enumerate(zip(self.layers, self.top(k), strict=True)):
            tokens = "  ".join(f"{token} {p:.2f}" for token, p in best)
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
        model: a model with an LM head (``std:ln_final`` and ``std:unembed`` in its map), in eval mode.
        inputs: token ids, a dict of keyword inputs or a tuple of positional inputs.
        layers: canonical names of the residual values to read (default every
            ``blocks.*.resid_post``; ``"std:blocks.*.resid_pre"`` works too).
        metric: scored on each layer as on the model's output (``hs.methods.logit_diff(...)``, or any
            function of the output: it gets the model's output with the layer's logits in place of
            the model's): ``lens.scores``.
        translators: a tuned lens: ``{canonical name: module or function}`` applied to that
            layer's residual before the norm (layers without one are read as they are).
        decode: turns token ids into text for ``print(lens)``, ``lens.top()`` and ``lens.plot()``: a
            tokenizer's ``decode`` or a list of strings.
        stack: ``"decoder."`` reads an encoder-decoder's decoder (its blocks and final norm);
            ``"encoder."`` its encoder, through the encoder's final norm, then the steps the
            decoder's output takes to the head (the inputs must run the decoder too).

    A model without a final norm (post-norm stacks such as BART, whose blocks end in their own)
    is read through the unembedding alone. Whatever linear steps the model takes between its final
    norm and its logits (T5's ``d_model ** -0.5`` before its tied head, a scale or a bias after
    the head) are measured on the same run and applied to every layer, so the last layer's
    ``resid_post`` through the lens is the model's own logits; a step that is not linear (Gemma 2's
    soft-cap) is left out. A linear module between the norm and a head of another width (OPT's
    ``project_out``) is applied too. ``lens.readout`` (and ``print(lens)``) says which.

    Example::

        lens = hs.methods.logit_lens(gpt2_lm, ids, decode=tokenizer.decode)
        print(lens)                          # top tokens per layer at the last position
        lens.top(5, position=3); lens.plot().savefig("lens.png")
    """
    ensure_loaded(model)  # a meta model: one line, not torch's error
    if metric is not None:
        check_metric(metric)
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
    feeding = _feeding_stack(std, stack)  # the steps after the norm are measured where they happen
    normed_at = _normed_at(std, stack)
    fitted_at = _normed_at(std, feeding)
    head_site = unembed_site(model, stack)
    head_input = f"{escape_name(head_site.module or '')}:input[0]"
    sites = [STD_PREFIX + name for name in dict.fromkeys([*names, normed_at, fitted_at, head_site.name])]
    output, cache, rows = captured_run(model, inputs, [*sites, head_input], model_kwargs, "logit_lens")
    readout = _readout(
        cache, output, STD_PREFIX + fitted_at, head_input, STD_PREFIX + head_site.name,
        projections=_projections(model, std, head_site.module or ""), known_after=_soft_cap(model),
    )  # fmt: skip
    logits = []
    with torch.no_grad():
        for name in names:
            value = cache[STD_PREFIX + name]
            translated = translators[name](value) if translators and name in translators else value
            logits.append(readout(head, norm(translated)))
    stacked = torch.stack(logits)
    scores = None
    if metric is not None:
        scores = torch.stack([run_score(metric, with_logits(output, layer), rows) for layer in stacked])
    named = metric_name(metric) if metric is not None else ""
    shown_norm = STD_PREFIX + normed_at if normed_at.endswith("ln_final") else ""
    described = readout.describe(shown_norm, STD_PREFIX + head_site.name)
    if feeding != stack:
        described += f" (the steps after the norm measured on the {feeding[:-1]}, whose std:{fitted_at} feeds the head)"
    return Lens(stacked, names, scores, named, decode, described)


def _normed_at(std: StdMap, stack: str) -> str:
    """Where ``stack``'s last residual leaves its final norm (its last block, where it has none)."""
    if f"{stack}ln_final" in std:
        return f"{stack}ln_final"
    return f"{stack}blocks.{block_count(std, stack) - 1}.resid_post"


def _feeding_stack(std: StdMap, stack: str) -> str:
    """The stack whose final norm's output the head reads: ``stack`` itself, or for an
    encoder-decoder's encoder (whose output feeds cross-attention, not the head) the decoder.
    The encoder's layers are read through its own final norm, then every step the model takes
    between the decoder's final norm and its logits (T5's ``d_model ** -0.5``): measured
    comparing the encoder's norm with the head's input, those steps fit nothing."""
    if not stack or f"{stack}unembed" in std:
        return stack
    others = [prefix for prefix in ("decoder.",) if prefix != stack and f"{prefix}blocks.0.resid_pre" in std]
    return others[0] if others else stack


def _projections(model: nn.Module, std: StdMap, head: str) -> list[tuple[str, nn.Module]]:
    """The model's linear modules outside its blocks and head: those that may project the final
    norm's output to the head's width (OPT's ``project_out``)."""
    blocks = {site.module for name, site in std.sites.items() if name.endswith(".resid_post") and site.module}
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and name != head
        and not any(name == block or name.startswith(block + ".") for block in blocks)
    ]


def _soft_cap(model: nn.Module) -> str:
    """The soft-cap of the logits the config declares (Gemma 2's ``final_logit_softcapping``), as words."""
    cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    if isinstance(cap, int | float) and not isinstance(cap, bool) and cap:
        return f"the soft-cap tanh(logits / {cap:g}) * {cap:g} of config.final_logit_softcapping"
    return ""


def _readout(
    cache: Any,
    output: Any,
    normed: str,
    head_input: str,
    head_output: str,
    *,
    projections: list[tuple[str, nn.Module]],
    known_after: str,
) -> Readout:
    """The steps between the final norm and the logits, from the values one run kept."""
    try:
        head_in: torch.Tensor | None = cache[head_input]
    except SiteNotFoundError:  # the head took its input by keyword: no positional leaf to keep
        head_in = None
    try:
        logits: torch.Tensor | None = logits_of(output)
    except SpecError:
        logits = None
    return measure_readout(
        cache[normed], head_in, cache[head_output], logits, projections=projections, known_after=known_after
    )
