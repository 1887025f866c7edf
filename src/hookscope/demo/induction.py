"""A two-layer GPT-2 trained to form induction heads, its data, its training loop and its shipped weights.

Induction is the first circuit one looks for in a transformer: a *previous-token head* in layer 0
writes "the token before me was A" into each position, and an *induction head* in layer 1 finds
the earlier position whose previous token is the current one and copies the token that followed it
(``... A B ... A`` -> ``B``). Random tokens with a repeated segment (:func:`make_repeats`) reward
exactly that: the first copy is unpredictable, the second predictable by induction alone.

The model is a transformers ``GPT2LMHeadModel`` built from :func:`induction_config` (nothing is
downloaded), so every hookscope method works on it by its ``std:`` names and attention sub-sites.

Run as ``python -m hookscope.demo.induction [--out PATH] [--seed N] [--steps N]``. The shipped
weights (``induction.safetensors``, 428 kB) come from ``python -m hookscope.demo.induction``: seed 0,
2,400 steps of 32 rows, a final loss of 0.479 on the predictable tokens (the mean of the last 100
steps; uniform guessing scores 3.434), in 126 s of CPU time on one thread (11 min 48 s of wall time
on a shared 2-core machine whose load average was 9, which gave it 17% of a core). The loss falls
from the plateau of copying any earlier token (about 2.5) between steps 500 and 1,000, when the
circuit forms. The file's metadata records the seed, the steps and that loss.

What the shipped model learned (``docs/tutorials/induction-heads.md`` measures it): all four
layer-1 heads are induction heads, attending mostly two tokens past the earlier occurrence of the
current token; layer 0 holds two previous-token heads and a head that looks two tokens back, which
the layer-1 keys depend on.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from hookscope.demo.train import train_command
from hookscope.errors import SpecError

if TYPE_CHECKING:
    from transformers import GPT2Config, GPT2LMHeadModel

__all__ = [
    "BOS",
    "DEFAULT_OUT",
    "LENGTH",
    "PERIODS",
    "STEPS",
    "VOCAB",
    "WEIGHTS_FILE",
    "build_induction_model",
    "induction_config",
    "load_induction_model",
    "main",
    "make_repeats",
    "repeat_loss",
    "train",
]

WEIGHTS_FILE = "induction.safetensors"
DEFAULT_OUT = Path(__file__).with_name(WEIGHTS_FILE)
VOCAB = 32  # token 0 is the beginning-of-sequence token; 1 ... 31 are the random tokens
BOS = 0
LENGTH = 32  # tokens after BOS
PERIODS = (3, 16)  # the repeated segment's length, drawn per sequence (both ends included)
STEPS = 2400
BATCH_SIZE = 32
LEARNING_RATE = 3e-3
WARMUP = 50  # steps of linearly rising learning rate
# Weights drawn with std 0.08 rather than GPT-2's 0.02: attention scores start large enough to have a
# gradient, which shortens the plateau before the two heads of the circuit form.
INIT_STD = 0.08


def induction_config() -> GPT2Config:
    """The architecture: 2 layers, 4 heads of size 16, ``d_model`` 64, a vocabulary of 32, no dropout."""
    from transformers import GPT2Config

    return GPT2Config(
        n_layer=2,
        n_head=4,
        n_embd=64,
        vocab_size=VOCAB,
        n_positions=LENGTH + 1,
        bos_token_id=BOS,
        eos_token_id=BOS,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        initializer_range=INIT_STD,
    )


def build_induction_model() -> GPT2LMHeadModel:
    """An untrained model of :func:`induction_config`, initialised from torch's global generator."""
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel(induction_config())


def make_repeats(
    count: int, *, seed: int, length: int = LENGTH, period: int | tuple[int, int] = PERIODS
) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` rows of ``BOS`` and ``length`` random tokens, each holding a segment repeated to the end.

    Each row draws its period ``P`` (an int, or uniformly from an inclusive ``(low, high)`` range)
    and where the segment starts, after a random prefix, then repeats the segment's ``P`` tokens
    until the row ends. Returns the ids, ``(count, length + 1)`` int64, and a boolean mask of the
    same shape marking the tokens a model can predict by induction: every token from the second
    copy's second token on (nothing announces where the first repeat starts). ``length=2 * P``
    with a fixed period gives ``BOS A A``. The same seed gives the same rows; torch's global
    generator is neither used nor moved.

    >>> ids, predictable = make_repeats(1, seed=0, length=6, period=3)
    >>> bool((ids[0, 1:4] == ids[0, 4:]).all()), predictable[0].tolist()
    (True, [False, False, False, False, False, True, True])
    """
    low, high = (period, period) if isinstance(period, int) else period
    if count < 0 or not 1 <= low <= high or 2 * high > length:
        raise SpecError(
            f"make_repeats(count={count}, length={length}, period={period}): expected count >= 0 and a period, "
            "an int or a (low, high) range, with 1 <= low <= high and 2 * high <= length"
        )
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (count, length + 1), generator=generator)
    ids[:, 0] = BOS
    periods = torch.randint(low, high + 1, (count,), generator=generator)
    predictable = torch.zeros(count, length + 1, dtype=torch.bool)
    for row, size in enumerate(periods.tolist()):
        start = 1 + int(torch.randint(0, length - 2 * size + 1, (), generator=generator))
        ids[row, start:] = ids[row, start : start + size].repeat(-(-(length + 1 - start) // size))[: length + 1 - start]
        predictable[row, start + size + 1 :] = True
    return ids, predictable


def repeat_loss(logits: torch.Tensor, ids: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The mean next-token cross-entropy over the tokens ``tokens`` marks (a boolean mask over
    ``ids``, such as :func:`make_repeats`'s), from ``(batch, seq, vocab)`` logits. The first token has
    no prediction and must not be marked."""
    if tokens[:, 0].any():
        raise SpecError("repeat_loss: the first token has no prediction; the mask must leave column 0 False")
    losses = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    return losses[tokens[:, 1:]].mean()


def train(
    *, seed: int = 0, steps: int = STEPS, write: Callable[[str], object] = print
) -> tuple[GPT2LMHeadModel, float]:
    """A trained model (in eval mode) and its mean loss on the predictable tokens over its last
    100 steps.

    The loss is :func:`repeat_loss`, on the tokens induction can predict: the random ones carry
    nothing to learn, and their gradient only slows the circuit down. The result depends only on
    ``seed`` and ``steps``: torch's global generator is seeded for the initialisation inside
    :func:`torch.random.fork_rng` (the caller's state is the same afterwards), batch ``i`` is
    ``make_repeats(..., seed=seed * 1_000_003 + i)``, and torch runs on one thread meanwhile, so
    no reduction's order depends on the machine's cores. ``write`` gets a line every 250 steps
    and one at the end.
    """
    if steps < 1:
        raise SpecError(f"steps={steps}; expected at least 1 training step")
    started = time.perf_counter()
    threads = torch.get_num_threads()
    recent: list[float] = []
    with torch.random.fork_rng(devices=[]):
        torch.set_num_threads(1)
        try:
            torch.manual_seed(seed)
            model = build_induction_model().train()
            optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.01, betas=(0.9, 0.98))
            schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: min(1.0, (done + 1) / WARMUP))
            for step in range(1, steps + 1):
                ids, predictable = make_repeats(BATCH_SIZE, seed=seed * 1_000_003 + step)
                loss = repeat_loss(model(ids).logits, ids, predictable)
                optimizer.zero_grad()
                loss.backward()  # type: ignore[no-untyped-call]
                optimizer.step()
                schedule.step()
                recent = [*recent[-99:], loss.item()]
                if step % 250 == 0 or step == steps:
                    write(f"step {step}/{steps}  loss {loss.item():.4f}  ({time.perf_counter() - started:.1f} s)")
        finally:
            torch.set_num_threads(threads)
    final = sum(recent) / len(recent)
    write(f"mean loss of the last {len(recent)} steps: {final:.4f} (uniform guessing: {math.log(VOCAB - 1):.4f})")
    return model.eval(), final


def load_induction_model() -> GPT2LMHeadModel:
    """The model with the weights shipped in the package, in eval mode.

    safetensors and transformers are imported here, not at module import, to keep the demo light.

    >>> ids, predictable = make_repeats(100, seed=12345)
    >>> logits = load_induction_model()(ids).logits
    >>> repeat_loss(logits, ids, predictable).item() < 1.0      # uniform guessing: 3.43
    True
    """
    from safetensors.torch import load

    model = build_induction_model()
    model.load_state_dict(load(resources.files("hookscope.demo").joinpath(WEIGHTS_FILE).read_bytes()))
    model.eval()  # type: ignore[no-untyped-call]
    return model


def main(argv: list[str] | None = None) -> int:
    """The command line: train, report, write the weights; returns the exit status."""

    def run(seed: int, steps: int) -> tuple[nn.Module, dict[str, str]]:
        model, final = train(seed=seed, steps=steps)
        return model, {"final_loss": f"{final:.4f}"}

    return train_command(
        argv,
        prog="python -m hookscope.demo.induction",
        description="Train the two-layer induction GPT-2 and write its weights.",
        default_out=DEFAULT_OUT,
        seed_help="seed for the initialisation and the batches",
        count=("steps", STEPS, f"training steps of {BATCH_SIZE} rows"),
        run=run,
    )


if __name__ == "__main__":
    raise SystemExit(main())
