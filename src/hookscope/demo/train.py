"""Train :class:`~hookscope.demo.models.ShapesCNN` on generated shapes and write the weights the package ships.

Run as ``python -m hookscope.demo.train [--out PATH] [--seed N] [--epochs N]``; it takes well under a
minute on two CPU cores. Training images come from ``make_shapes(..., seed=seed)`` and the test images
from ``seed + 1``, so the accuracy reported (and stored in the file) is on images the model never saw.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from hookscope._shared.files import atomic_path
from hookscope.demo.models import WEIGHTS_FILE, ShapesCNN
from hookscope.demo.shapes import make_shapes
from hookscope.errors import SpecError

__all__ = ["DEFAULT_OUT", "EPOCHS", "accuracy", "main", "save", "train", "train_command"]

DEFAULT_OUT = Path(__file__).with_name(WEIGHTS_FILE)
EPOCHS = 8
TRAIN_COUNT = 8000
TEST_COUNT = 2000
BATCH_SIZE = 32
LEARNING_RATE = 1e-2


def accuracy(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    """The fraction of ``images`` that ``model`` labels right, in eval mode and without gradients.

    The model's training flag is put back afterwards, so this can be called between epochs.
    """
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            predicted = torch.cat([model(batch).argmax(1) for batch in torch.split(images, 1000)])
    finally:
        model.train(was_training)
    return (predicted == labels).float().mean().item()


def train(*, seed: int = 0, epochs: int = EPOCHS, write: Callable[[str], object] = print) -> tuple[ShapesCNN, float]:
    """A trained :class:`ShapesCNN` (in eval mode) and its accuracy on fresh test images.

    The result depends only on ``seed`` and ``epochs``: the global torch RNG is seeded for the model's
    initialisation and the batch order, inside :func:`torch.random.fork_rng` so that the caller's RNG
    state is the same afterwards. ``write`` receives one line per epoch and one for the test accuracy.
    """
    if epochs < 1:
        raise SpecError(f"epochs={epochs}; expected at least 1 pass over the training images")
    started = time.perf_counter()
    images, labels = make_shapes(TRAIN_COUNT, seed=seed)
    test_images, test_labels = make_shapes(TEST_COUNT, seed=seed + 1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ShapesCNN()
        optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
        steps = epochs * -(-TRAIN_COUNT // BATCH_SIZE)
        # Annealed to zero, so the last epochs settle instead of bouncing at the full step size.
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=LEARNING_RATE, total_steps=steps)
        loss_fn = nn.CrossEntropyLoss()
        model.train()
        for epoch in range(1, epochs + 1):
            total = 0.0
            for batch in torch.split(torch.randperm(TRAIN_COUNT), BATCH_SIZE):
                loss = loss_fn(model(images[batch]), labels[batch])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                schedule.step()
                total += loss.item() * len(batch)
            elapsed = time.perf_counter() - started
            write(
                f"epoch {epoch}/{epochs}  loss {total / TRAIN_COUNT:.4f}  "
                f"test accuracy {accuracy(model, test_images, test_labels):.2%}  ({elapsed:.1f} s)"
            )
    model.eval()
    result = accuracy(model, test_images, test_labels)
    write(f"test accuracy on {TEST_COUNT} new images (seed {seed + 1}): {result:.2%}")
    return model, result


def save(model: nn.Module, out: Path, *, metadata: dict[str, str]) -> None:
    """Write ``model``'s weights to ``out`` as safetensors, atomically: a reader (or an interrupted
    run) never sees half a file, and no temporary file is left on failure. Tied weights (a language
    model's embedding and unembedding) are written once per name, as safetensors requires."""
    from safetensors.torch import save as to_bytes

    state = model.state_dict()
    data = to_bytes({name: tensor.detach().clone().contiguous() for name, tensor in state.items()}, metadata)
    with atomic_path(out) as temporary:
        temporary.write_bytes(data)


def train_command(
    argv: list[str] | None,
    *,
    prog: str,
    description: str,
    default_out: Path,
    seed_help: str,
    count: tuple[str, int, str],
    run: Callable[[int, int], tuple[nn.Module, dict[str, str]]],
) -> int:
    """The command line every demo training script shares: ``--out``, ``--seed`` and one count
    (``count`` is its name, default and help: epochs, steps), then ``run(seed, count)``, which
    returns the model and its metadata; the file records the seed and the count besides."""
    name, default, count_help = count
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument(
        "--out", type=Path, default=default_out, help="where to write the weights (default: %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0, help=seed_help)
    parser.add_argument(f"--{name}", type=int, default=default, help=count_help)
    args = parser.parse_args(argv)
    value = getattr(args, name)
    if value < 1:
        parser.error(f"--{name} must be >= 1, got {value}")
    model, metadata = run(args.seed, value)
    save(model, args.out, metadata={"seed": str(args.seed), name: str(value), **metadata})
    print(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """The command line: train, report, write the weights; returns the exit status."""

    def run(seed: int, epochs: int) -> tuple[nn.Module, dict[str, str]]:
        model, result = train(seed=seed, epochs=epochs)
        return model, {"test_accuracy": f"{result:.4f}"}

    return train_command(
        argv,
        prog="python -m hookscope.demo.train",
        description="Train the demo ShapesCNN and write its weights.",
        default_out=DEFAULT_OUT,
        seed_help="seed for the data, the initialisation and the batches",
        count=("epochs", EPOCHS, "passes over the training images"),
        run=run,
    )


if __name__ == "__main__":
    raise SystemExit(main())
