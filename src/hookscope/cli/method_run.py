"""The steps ``hookscope patch`` and ``hookscope lens`` share: the model and its ids, checks made
before the model runs, a text table, and atomic writes of what they produce.

Both take token ids written out (``--clean "5,6,7,8;9,10,11,12"``, see
:mod:`hookscope.cli.parse.method_specs`), since a model spec brings no tokenizer: the weights of an
``hf-config:`` model are random, and ids are what a study pins down anyway. A model that refuses
the ids (an id outside its vocabulary, a sequence longer than its positions) is bad input: exit 2.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, TypeVar

import hookscope as hs
from hookscope.cli.parse.options import seed_option
from hookscope.errors import HookscopeError, OutputWriteError, SpecError

__all__ = [
    "FIGURE_OUTPUTS",
    "Seed",
    "check_out",
    "check_read",
    "figure_bytes",
    "parse_decoder_ids",
    "refused",
    "seeded",
    "stack_prefix",
    "text_table",
    "with_decoder",
    "write_file",
]

T = TypeVar("T")

#: What a figure may be written as (``lens --out``).
FIGURE_OUTPUTS = (".png", ".svg", ".pdf")

#: The ``--seed`` of both commands.
Seed = Annotated[int, seed_option("Seed of the random weights of an hf-config: model.")]


def check_read(ids: Any, row: int, position: int, what: str) -> None:
    """Refuse a --row or --position outside the ids the lens reads, before the model runs."""
    rows, seq = ids.shape
    if row >= rows:
        raise SpecError(f"--row {row}: {what} has {rows} row{'' if rows == 1 else 's'} (0 to {rows - 1})")
    if not -seq <= position < seq:
        plural = "" if seq == 1 else "s"
        raise SpecError(f"--position {position}: {what} has {seq} position{plural} (0 to {seq - 1}, or -1 to -{seq})")


def stack_prefix(stack: str | None) -> str | None:
    """``--stack`` as the library spells it: ``decoder`` is ``decoder.``; ``''`` reads one stack."""
    return stack + "." if stack and not stack.endswith(".") else stack


def parse_decoder_ids(text: str | None, rows: int, paired: str) -> Any:
    """``--decoder-prompt``'s ids (None where not given), one row per row of ``paired``."""
    from hookscope.cli.parse.method_specs import parse_ids

    if text is None:
        return None
    ids = parse_ids(text, what="--decoder-prompt")
    if ids.shape[0] != rows:
        raise SpecError(
            f"--decoder-prompt has {ids.shape[0]} rows and {paired} {rows}: give the decoder one row per {paired} row"
        )
    return ids


def with_decoder(net: Any, ids: Any, decoder_ids: Any) -> Any:
    """The model's input: ``ids``, or for an encoder-decoder the encoder's ``ids`` with the
    decoder's (``decoder_ids``, or its start token, one per row)."""
    encoder_decoder = getattr(getattr(net, "config", None), "is_encoder_decoder", False) is True
    if not encoder_decoder:
        if decoder_ids is not None:
            raise SpecError(f"--decoder-prompt: {type(net).__name__} is not an encoder-decoder; drop the option")
        return ids
    if decoder_ids is None:
        _, sample = hs.sample_input(net, (ids.shape[0], 1))
        decoder_ids = sample.get("decoder_input_ids")
        if decoder_ids is None:
            raise SpecError(f"{type(net).__name__} takes no decoder_input_ids; pass --stack '' to read it as one stack")
    return {"input_ids": ids, "decoder_input_ids": decoder_ids}


def text_table(header: list[str], rows: list[list[str]], *, right: set[int] | None = None) -> str:
    widths = [max(len(line[i]) for line in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        shown = [
            c.rjust(w) if i in (right or set()) else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "   ".join(shown).rstrip()

    rule = "-" * len(line(header))
    return "\n".join([line(header), rule, *map(line, rows)])


def figure_bytes(figure: Any, file_format: str) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format=file_format, dpi=100)
    return buffer.getvalue()


def write_file(out: Path, data: bytes) -> None:
    """Write ``data`` through a temporary file beside ``out``: a failed write leaves nothing, and an
    earlier file stays as it was (:class:`~hookscope.errors.OutputWriteError`, exit 1)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial")
    try:
        partial.write_bytes(data)
        os.replace(partial, out)
    except OSError as error:
        partial.unlink(missing_ok=True)
        raise OutputWriteError(
            f"cannot write --out {os.fspath(out)!r}: {error.strerror or error}; nothing was written",
            path=out,
            errno=error.errno,
        ) from error


def check_out(out: Path, suffixes: Sequence[str]) -> None:
    """Refuse an output of another kind, or one that cannot be written, before the model runs."""
    if out.suffix.lower() not in suffixes:
        raise SpecError(f"--out {out}: expected a file name ending in {', '.join(suffixes)}")
    hs.check_output_path(out, what="--out")


def seeded(model: str, dtype: str | None, seed: int) -> Any:
    """The model ``model`` names, its random weights (an hf-config: model's) drawn after ``torch.manual_seed(seed)``."""
    import torch

    from hookscope.cli.sample import build_model

    torch.manual_seed(seed)
    return build_model(model, dtype)


def refused(call: Callable[[], T], flags: dict[str, str]) -> T:
    """``call()``; a failure that is not hookscope's is the model refusing the ids given (exit 2).
    A hookscope error names the library's arguments: they are written as the command's ``flags``."""
    from hookscope.cli.parse.method_specs import flag_words

    try:
        return call()
    except HookscopeError as error:
        if error.args and isinstance(error.args[0], str):
            error.args = (flag_words(error.args[0], flags), *error.args[1:])
        raise
    except Exception as error:
        raise SpecError(
            f"the model raised {type(error).__name__} on the token ids given: {error}; pass ids inside its "
            "vocabulary and sequences no longer than its positions"
        ) from error
