"""Arguments shared by the commands that build and run a model (typer annotations)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from hookscope.cli.parse.specs import HF_HEADS

__all__ = ["MAX_WORKERS", "SEED_MAX", "Dtype", "InputShape", "ModelSpec", "seed_option", "split_selectors"]

#: torch's seeds are whole numbers below 2**64 (``torch.manual_seed``); past it, torch raises a raw
#: ``ValueError`` once the model is built, so ``--seed`` is checked when the line is read (exit 2).
SEED_MAX = 2**64 - 1
#: More DataLoader processes than this is a typo, not a plan: each one imports torch.
MAX_WORKERS = 1024


def seed_option(help: str) -> Any:  # noqa: A002 (typer's word)
    """The ``--seed`` option of every command: a whole number from 0 to :data:`SEED_MAX`."""
    return typer.Option("--seed", min=0, max=SEED_MAX, help=help)


ModelSpec = Annotated[
    str,
    typer.Argument(
        metavar="MODEL",
        help="package.module:factory, path/to/file.py:factory, demo:cnn, demo:shapes or "
        "hf-config:<model_type>/<head>?key=value&... (head and keys optional), e.g. "
        "'hf-config:gpt2/causal-lm?n_layer=2&n_embd=64'; keys are fields of the model type's config (checked); "
        "values are numbers, true/false, null, strings or lists such as hidden_sizes=[16,32]; heads: "
        + ", ".join(HF_HEADS)
        + " (default: the bare AutoModel).",
        show_default=False,
    ),
]
InputShape = Annotated[
    str | None,
    typer.Option("--input-shape", "-s", help="Shape of a random sample input, e.g. 1x3x32x32 (tokens: 1x16)."),
]
Dtype = Annotated[
    str | None, typer.Option("--dtype", help="Cast the model and its float input: fp32, fp16, bf16, fp64.")
]


def split_selectors(options: list[str]) -> list[str]:
    """The values of a repeatable option that may also be comma-separated (every command's list
    options: selectors, layers, statistics, ``--map`` pairs); a comma inside ``()``, ``[]`` or
    ``{}`` (a regex's ``{1,2}``, a glob's ``[0,1]``) or escaped is part of its value, not a
    separator. A literal comma outside them is written ``[,]`` in a regex.

    >>> split_selectors(["re:h[.][0-9]{1,2}[.]attn, std:blocks.0.resid_pre", "re:h[.](0|1)$,h.[0,1].mlp"])
    ['re:h[.][0-9]{1,2}[.]attn', 'std:blocks.0.resid_pre', 're:h[.](0|1)$', 'h.[0,1].mlp']
    """
    parts: list[str] = []
    for option in options:
        current, depth, in_class, escaped = "", 0, False, False
        for char in option:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif in_class:
                in_class = char != "]"
            elif char == "[":
                in_class = True
            elif char in "({":
                depth += 1
            elif char in ")}":
                depth = max(depth - 1, 0)
            elif char == "," and depth == 0:
                parts.append(current)
                current = ""
                continue
            current += char
        parts.append(current)
    return [part.strip() for part in parts if part.strip()]
