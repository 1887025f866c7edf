"""Metrics: one number per input row from a model's output, the quantity a study differentiates,
patches and compares.

The contract, the same for every method (``patch_sweep``, ``attribution_patch``, ``logit_lens``,
``run_with_capture(backward=)``): a metric is called as ``metric(output)`` on an output of the
form the model returns (a tensor of logits, a ``ModelOutput`` with ``.logits``, or a tuple whose
first element is the logits). The logit lens gives each layer that same output with its logits
replaced by the layer's (:func:`with_logits`), so a function written for the model's output reads
a layer unchanged. It returns a tensor: one value per row, shape ``(batch,)``, or a scalar, one
value for the whole batch. A method's score of a run is the mean over rows (:func:`run_score`).

One value per row, not a mean, is what lets a patching sweep run many patches in one
batched forward and still score each patch on its own rows; so a row's value must depend on
that row alone (a value centred on the batch mean would mix the rows of different patches).
A metric that returns a scalar is scored one forward at a time.

Positions: ``position=-1`` (default) reads the last position; an int reads that position in every
row, a 1-D integer tensor one position per row, and a boolean ``(batch, seq)`` mask the mean over
the positions it marks.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from hookscope.errors import SpecError

__all__ = [
    "Metric",
    "MetricFn",
    "Position",
    "check_metric",
    "kl_to",
    "logit_diff",
    "logits_of",
    "logprob",
    "loss",
    "metric_name",
    "metric_rows",
    "run_score",
    "with_logits",
]

Position = int | torch.Tensor | None
Tokens = int | Sequence[int] | torch.Tensor
MetricFn = Callable[[Any], torch.Tensor]


def logits_of(output: Any) -> torch.Tensor:
    """The logits in a model's output: the tensor itself, ``.logits``, or the first tensor of a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise SpecError(
        f"a metric reads logits, and the model returned {type(output).__name__} without them; expected a "
        "tensor, an output with .logits (a transformers ...ForCausalLM model, not the bare ...Model), or a tuple "
        "whose first element is the logits; or pass your own metric function of the output"
    )


class Metric:
    """A metric: ``metric(output)`` is one value per row, ``(batch,)``; ``metric.name`` says what.

    Subclasses give :meth:`per_position`, ``(batch, seq)`` values; the position rule picks from them.
    """

    name = "metric"

    def __init__(self, position: Position = -1) -> None:
        _check_position(position)
        self.position = position

    def per_position(self, logits: torch.Tensor) -> torch.Tensor:
        """``(batch, seq)`` values from ``(batch, seq, vocab)`` logits."""
        raise NotImplementedError

    def __call__(self, output: Any) -> torch.Tensor:
        logits = logits_of(output)
        if logits.dim() == 2:  # (batch, vocab): a classifier or a model that returns the last position
            logits = logits.unsqueeze(1)
        if logits.dim() != 3:
            raise SpecError(f"{self.name}: logits of shape {tuple(logits.shape)}; expected (batch, seq, vocab)")
        return _at_positions(self.per_position(logits), self.position, self.name)

    def __repr__(self) -> str:
        return f"<metric {self.name}>"


class LogitDiff(Metric):
    def __init__(self, correct: Tokens, wrong: Tokens, position: Position) -> None:
        super().__init__(position)
        self.correct, self.wrong = _tokens(correct, "correct"), _tokens(wrong, "wrong")
        self.name = f"logit_diff({_shown(self.correct)}, {_shown(self.wrong)})"

    def per_position(self, logits: torch.Tensor) -> torch.Tensor:
        return _pick(logits, self.correct) - _pick(logits, self.wrong)


class LogProb(Metric):
    def __init__(self, token: Tokens, position: Position) -> None:
        super().__init__(position)
        self.token = _tokens(token, "token")
        self.name = f"logprob({_shown(self.token)})"

    def per_position(self, logits: torch.Tensor) -> torch.Tensor:
        return _pick(logits.float().log_softmax(-1), self.token)


class KLTo(Metric):
    def __init__(self, baseline: Any, position: Position) -> None:
        super().__init__(position)
        self.baseline = logits_of(baseline).detach()
        self.name = "kl_to(baseline)"

    def per_position(self, logits: torch.Tensor) -> torch.Tensor:
        baseline = _tiled(self.baseline.to(logits.device), logits.shape[0], "the baseline's logits")
        if baseline.dim() == 2:
            baseline = baseline.unsqueeze(1)
        if baseline.shape != logits.shape:
            raise SpecError(f"kl_to: baseline logits {tuple(baseline.shape)}, this run's {tuple(logits.shape)}")
        reference = baseline.float().log_softmax(-1)
        return (reference.exp() * (reference - logits.float().log_softmax(-1))).sum(-1)


class Loss(Metric):
    def __init__(self, labels: torch.Tensor, position: Position) -> None:
        super().__init__(position)
        if not isinstance(labels, torch.Tensor) or labels.dim() != 2 or labels.is_floating_point():
            raise SpecError("loss(labels): expected the (batch, seq) token ids the model was given")
        if isinstance(position, int) and position in (-1, labels.shape[1] - 1):
            raise SpecError(
                f"loss(position={position}): the last position predicts no label of these ids; pick an earlier "
                "position, or position=None for the mean over every position that predicts one"
            )
        self.labels = labels
        self.name = "loss"

    def per_position(self, logits: torch.Tensor) -> torch.Tensor:
        labels = _tiled(self.labels.to(logits.device), logits.shape[0], "the labels")
        if labels.shape != logits.shape[:2]:
            raise SpecError(f"loss: labels {tuple(labels.shape)} for logits {tuple(logits.shape)}")
        following = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), labels[:, 1:], reduction="none")
        return F.pad(following, (0, 1), value=float("nan"))  # the last position predicts nothing here


def logit_diff(correct: Tokens, wrong: Tokens, *, position: Position = -1) -> Metric:
    """``logits[correct] - logits[wrong]`` at ``position``; tokens are ids, one for every row or one per row.

    >>> logits = torch.tensor([[[0.0, 2.0, 5.0]]])          # (batch 1, seq 1, vocab 3)
    >>> logit_diff(2, 1)(logits)
    tensor([3.])
    """
    return LogitDiff(correct, wrong, position)


def logprob(token: Tokens, *, position: Position = -1) -> Metric:
    """The log probability of ``token`` (an id, or one per row) at ``position``.

    >>> logprob(0)(torch.zeros(1, 1, 4))
    tensor([-1.3863])
    """
    return LogProb(token, position)


def kl_to(baseline: Any, *, position: Position = -1) -> Metric:
    """``KL(baseline || this run)`` over the vocabulary at ``position``; ``baseline`` is a run's
    output or logits (the clean run's, say), repeated over rows when a batch holds several copies.

    >>> kl_to(torch.zeros(1, 1, 4))(torch.zeros(1, 1, 4))
    tensor([0.])
    """
    return KLTo(baseline, position)


def loss(labels: torch.Tensor, *, position: Position = None) -> Metric:
    """Next-token cross-entropy against ``labels`` (the input ids), averaged over the positions
    (``position=None``: every position that predicts a label) or at the ones chosen.

    >>> ids = torch.tensor([[1, 2]])
    >>> loss(ids)(torch.zeros(1, 2, 4))                      # uniform over 4 tokens: log 4
    tensor([1.3863])
    """
    return Loss(labels, position)


def check_metric(metric: object) -> None:
    """Refuse a metric that cannot be called, before any forward runs."""
    if not callable(metric):
        raise SpecError(
            f"metric={metric!r}: expected hs.methods.logit_diff(...) (or another built-in) or a function of the "
            "model's output that returns one value per row"
        )


def with_logits(output: Any, logits: torch.Tensor) -> Any:
    """``output`` (a model's output) with its logits replaced by ``logits``, in the same form: what a
    metric of the model's output reads for another set of logits (a logit lens layer's).

    >>> with_logits((torch.zeros(1, 2), "cache"), torch.ones(1, 2))
    (tensor([[1., 1.]]), 'cache')
    """
    if isinstance(output, torch.Tensor):
        return logits
    if isinstance(getattr(output, "logits", None), torch.Tensor):
        if dataclasses.is_dataclass(output) and not isinstance(output, type):
            return dataclasses.replace(output, logits=logits)  # a transformers ModelOutput
        replaced = copy.copy(output)
        replaced.logits = logits
        return replaced
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return type(output)([logits, *output[1:]]) if isinstance(output, list) else (logits, *output[1:])
    logits_of(output)  # raises: the output holds no logits
    return logits


def run_score(metric: MetricFn, output: Any, rows: int) -> torch.Tensor:
    """The metric of one run as one float64 number: the mean of its per-row values, or the scalar it
    returned (a metric of the whole batch). Anything else is refused with the contract."""
    value = metric(output)
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return value.detach().double()
    return metric_rows(metric, output, rows, value=value).detach().double().mean()


def metric_name(metric: MetricFn) -> str:
    """What a metric is called in a result: ``metric.name`` (the built-ins'), else the function's name."""
    return str(getattr(metric, "name", getattr(metric, "__name__", "metric")))


def metric_rows(metric: MetricFn, output: Any, rows: int, *, value: Any = None) -> torch.Tensor:
    """``metric(output)`` (or the ``value`` it already gave) as one value per row, ``(rows,)``; a
    scalar is accepted only for one row."""
    value = metric(output) if value is None else value
    if not isinstance(value, torch.Tensor):
        raise SpecError(f"the metric returned {type(value).__name__}; expected a tensor, one value per row")
    if value.dim() == 0 and rows == 1:
        return value.reshape(1)
    if value.shape != (rows,):
        raise SpecError(
            f"the metric returned shape {tuple(value.shape)} for a batch of {rows} rows; expected ({rows},), "
            "one value per row, or a scalar for one row. A sweep runs several copies of the input's rows in one "
            "batch: a metric that indexes per-row tokens must repeat them to the batch (hs.methods.logit_diff and "
            "the other built-ins do), or pass batch_rows=<the input's rows> for one patch per forward"
        )
    return value


# -- helpers ----------------------------------------------------------------------------------


def _check_position(position: Position) -> None:
    if position is None or (isinstance(position, int) and not isinstance(position, bool)):
        return
    if isinstance(position, torch.Tensor) and (position.dtype == torch.bool or not position.is_floating_point()):
        return
    raise SpecError(
        f"position={position!r}: expected an int, a tensor of one position per row, a boolean (batch, seq) "
        "mask, or None (every position)"
    )


def _at_positions(values: torch.Tensor, position: Position, name: str) -> torch.Tensor:
    """``(batch, seq)`` values at ``position``: ``(batch,)``."""
    rows, seq = values.shape
    if position is None:
        return values.nanmean(1)
    if isinstance(position, int):
        if not -seq <= position < seq:
            raise SpecError(f"{name}: position {position} is outside a sequence of {seq}")
        return values[:, position]
    position = position.to(values.device)
    if position.dtype == torch.bool:
        mask = _tiled(position, rows, "the position mask")
        if mask.shape != values.shape:
            raise SpecError(f"{name}: a position mask of shape {tuple(mask.shape)} for {rows} rows of {seq} positions")
        return torch.where(mask, values, 0.0).sum(1) / mask.sum(1).clamp(min=1)
    per_row = _tiled(position.reshape(-1), rows, "the positions")
    return values.gather(1, (per_row % seq).unsqueeze(1)).squeeze(1)


def _tokens(tokens: Tokens, what: str) -> torch.Tensor:
    if isinstance(tokens, bool) or not isinstance(tokens, (int, Sequence, torch.Tensor)):
        raise SpecError(f"{what}={tokens!r}: expected a token id or one id per row")
    tensor = torch.as_tensor(tokens)
    if tensor.is_floating_point() or tensor.dim() > 1:
        raise SpecError(f"{what}={tokens!r}: expected integer token ids, one for all rows or one per row")
    return tensor.long()


def _pick(values: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``values[..., token]`` per row: ``(batch, seq)`` from ``(batch, seq, vocab)``."""
    rows, seq, vocab = values.shape
    if tokens.dim() == 0:
        if not 0 <= int(tokens) < vocab:
            raise SpecError(f"token id {int(tokens)} is outside a vocabulary of {vocab}")
        return values[..., int(tokens)]
    index = _tiled(tokens.to(values.device), rows, "the token ids")
    if int(index.max()) >= vocab or int(index.min()) < 0:
        raise SpecError(f"token ids {index.tolist()} reach outside a vocabulary of {vocab}")
    return values.gather(2, index.view(rows, 1, 1).expand(rows, seq, 1)).squeeze(2)


def _tiled(values: torch.Tensor, rows: int, what: str) -> torch.Tensor:
    """``values`` with one entry per row: repeated when a batch holds whole copies of the rows
    given (a sweep runs several patches of the same prompts in one batch)."""
    given = values.shape[0]
    if given == rows:
        return values
    if given and rows % given == 0:
        return values.repeat(rows // given, *([1] * (values.dim() - 1)))
    raise SpecError(f"{what} are given for {given} rows, and the batch has {rows}; give one per row")


def _shown(tokens: torch.Tensor) -> str:
    return str(int(tokens)) if tokens.dim() == 0 else str(tokens.tolist())
