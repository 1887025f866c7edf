"""Command-line text of the ``patch`` and ``lens`` commands: token ids, positions and metrics.

Token ids are written as comma-separated ints per row, rows separated by ``;``:
``"5,6,7,8;9,10,11,12"`` is a batch of two rows of four tokens. Metrics::

    logit_diff:A,B       logits[A] - logits[B] at the last position (A, B token ids)
    logprob:T            the log probability of token T at the last position
    loss                 next-token cross-entropy of the patched run on its own ids, mean over positions
    loss:clean           ... against the clean ids (loss:corrupted: against the corrupted ids)

``@P`` after a metric reads position ``P`` instead (``logit_diff:3,4@2``; ``loss@-2``). Every
text that cannot be read raises ``SpecError`` with what was given, what was expected and the fix.

Selectors (``--sites``) are split at commas by :func:`~hookscope.cli.parse.options.split_selectors`,
the one splitter of every command's list options.
"""

from __future__ import annotations

import re
from typing import Literal

import torch

import hookscope as hs
from hookscope.cli.parse.options import split_selectors
from hookscope.cli.parse.specs import COUNT_MAX
from hookscope.errors import SpecError

__all__ = [
    "LENS_FLAGS",
    "METRIC_FORMS",
    "PATCH_FLAGS",
    "check_pair",
    "flag_words",
    "parse_ids",
    "parse_metric",
    "parse_positions",
    "split_selectors",
]

METRIC_FORMS = "'logit_diff:A,B', 'logprob:T', 'loss', 'loss:clean' or 'loss:corrupted' (optionally '@POSITION')"
_IDS_EXAMPLE = "e.g. '5,6,7,8' or '5,6,7,8;9,10,11,12' (ints joined by ',', rows by ';')"


def parse_ids(text: str, *, what: str) -> torch.Tensor:
    """Token ids ``(rows, seq)`` (int64) from ``"5,6,7;8,9,10"``; ``what`` names the option in errors.

    >>> parse_ids("5,6,7;8,9,10", what="--clean").tolist()
    [[5, 6, 7], [8, 9, 10]]
    >>> parse_ids("5,6;7", what="--clean")
    Traceback (most recent call last):
    ...
    hookscope.errors.SpecError: --clean '5,6;7': row 2 has 1 token and row 1 has 2; ...
    """
    rows = [row.strip() for row in text.strip().strip(";").split(";")]
    if not any(rows):
        raise SpecError(f"{what} {text!r} holds no token ids; expected {_IDS_EXAMPLE}")
    parsed: list[list[int]] = []
    for number, row in enumerate(rows, start=1):
        parts = [part.strip() for part in row.split(",")]
        bad = [part for part in parts if not part.isdecimal() or int(part) > COUNT_MAX]
        if bad:
            raise SpecError(
                f"{what} {text!r}: row {number} holds {bad[0]!r}, which is not a token id (an int from 0 to "
                f"2**63 - 1); expected {_IDS_EXAMPLE}"
            )
        parsed.append([int(part) for part in parts])
        if len(parsed[-1]) != len(parsed[0]):
            count = len(parsed[-1])
            raise SpecError(
                f"{what} {text!r}: row {number} has {count} token{'' if count == 1 else 's'} and row 1 has "
                f"{len(parsed[0])}; give every row the same length (pad the prompts)"
            )
    return torch.tensor(parsed, dtype=torch.long)


def check_pair(clean: torch.Tensor, corrupted: torch.Tensor) -> None:
    """Refuse clean and corrupted batches of different shapes: patching pairs them row by row, position by position."""
    if clean.shape != corrupted.shape:
        raise SpecError(
            f"--clean is {_shape(clean)} and --corrupted {_shape(corrupted)}; patching pairs them row by row and "
            "position by position: give both the same number of rows and tokens per row"
        )


def _shape(ids: torch.Tensor) -> str:
    rows, seq = ids.shape
    return f"{rows} row{'' if rows == 1 else 's'} of {seq} token{'' if seq == 1 else 's'}"


def parse_positions(text: str) -> Literal["each", "all"] | list[int]:
    """``--positions``: ``each`` (one column per position), ``all`` (every position at once) or ``3,4``.

    >>> parse_positions("each"), parse_positions("all"), parse_positions("3, -1")
    ('each', 'all', [3, -1])
    """
    word = text.strip().lower()
    if word in ("each", "all"):
        return "each" if word == "each" else "all"
    try:
        positions = [int(part) for part in word.split(",")]
    except ValueError:
        raise SpecError(
            f"--positions {text!r} is not understood; expected 'each', 'all' or positions such as '3,4' or '-1'"
        ) from None
    return positions


def parse_metric(
    text: str, *, clean: torch.Tensor, corrupted: torch.Tensor, direction: Literal["denoise", "noise"]
) -> hs.methods.Metric:
    """The metric ``text`` names (see the module doc); ``loss`` scores against the patched run's own ids:
    the corrupted ids when denoising, the clean ids with ``direction="noise"``.

    >>> ids = torch.tensor([[1, 2, 3]])
    >>> parse_metric("logit_diff:3,4@1", clean=ids, corrupted=ids, direction="denoise").name
    'logit_diff(3, 4)'
    """
    body, at, where = text.strip().partition("@")
    position: int | None = None
    if at:
        try:
            position = int(where)
        except ValueError:
            raise SpecError(f"--metric {text!r}: position {where!r} is not an int; e.g. 'logit_diff:3,4@-1'") from None
    kind, _, argument = (part.strip() for part in body.partition(":"))
    if kind == "logit_diff":
        tokens = _token_list(text, argument, 2, "logit_diff:A,B (the correct and the wrong token ids)")
        return hs.methods.logit_diff(tokens[0], tokens[1], position=-1 if position is None else position)
    if kind == "logprob":
        (token,) = _token_list(text, argument, 1, "logprob:T (a token id)")
        return hs.methods.logprob(token, position=-1 if position is None else position)
    if kind == "loss":
        own = corrupted if direction == "denoise" else clean
        labels = {"": own, "clean": clean, "corrupted": corrupted}.get(argument)
        if labels is None:
            raise SpecError(f"--metric {text!r}: loss takes no argument, 'clean' or 'corrupted'; got {argument!r}")
        return hs.methods.loss(labels, position=position)
    raise SpecError(f"--metric {text!r}: unknown metric {kind!r}; expected {METRIC_FORMS}")


def _token_list(text: str, argument: str, count: int, form: str) -> list[int]:
    parts = [part.strip() for part in argument.split(",")] if argument else []
    if len(parts) != count or not all(part.isdecimal() and int(part) <= COUNT_MAX for part in parts):
        raise SpecError(f"--metric {text!r}: expected {form}, e.g. --metric {_example(count)}")
    return [int(part) for part in parts]


def _example(count: int) -> str:
    return "logit_diff:3,4" if count == 2 else "logprob:3"


#: The library's argument names as ``hookscope patch`` and ``hookscope lens`` spell them.
PATCH_FLAGS = {
    "stack": "--stack",
    "sites": "--sites",
    "num_heads": "--num-heads",
    "heads": "--heads",
    "positions": "--positions",
    "batch_rows": "--batch-rows",
    "verify": "--verify",
}
LENS_FLAGS = {"stack": "--stack", "layers": "--layers"}

_CALL = re.compile(r"[\w.]+\([^()]*\)")  # an example call, `hs.edits.zero(heads=, num_heads=4)`: kept as written
_ARGUMENT = re.compile(r"(?<![\w.'\"-])(?P<name>[a-z_]+)=(?P<value>'[^']*'|\"[^\"]*\"|[\w.\[\]*-]+)?")


def flag_words(message: str, flags: dict[str, str]) -> str:
    """``message`` (a library error) with the arguments it names written as the command's flags:
    ``pass stack='decoder.'`` reads ``pass --stack decoder.``, ``give num_heads=`` reads ``give
    --num-heads``, so the command line never sends its user to an argument it does not have.

    >>> flag_words("pass stack='decoder.', or sites=; give num_heads= (config: num_attention_heads=2)", PATCH_FLAGS)
    'pass --stack decoder., or --sites; give --num-heads (config: num_attention_heads=2)'
    >>> flag_words("add heads=True or drop num_heads=", PATCH_FLAGS)
    'add --heads or drop --num-heads'
    """

    def flag(match: re.Match[str]) -> str:
        name, value = match["name"], match["value"]
        if name not in flags:
            return match[0]
        if value is None or (name == "heads" and value == "True"):
            return flags[name]
        plain = value.strip("'\"")
        shown = plain if re.fullmatch(r"[\w.*\[\]-]+", plain) else value
        return f"{flags[name]} {shown}"

    parts, end = [], 0
    for call in _CALL.finditer(message):
        parts.append(_ARGUMENT.sub(flag, message[end : call.start()]))
        parts.append(call[0])
        end = call.end()
    parts.append(_ARGUMENT.sub(flag, message[end:]))
    return "".join(parts)
