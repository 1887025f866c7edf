"""A few training steps on made-up data, for ``hookscope grads``: a model's gradient flow at init.

The loss is synthetic and documented: the model's first floating-point output (``logits``,
``last_hidden_state``, or the tensor itself) is compared with random targets. A 2-D output
``(batch, classes)`` gets cross-entropy against random class labels; anything else gets the
mean squared error against standard-normal targets of its shape. Each step draws a new random
input (seeded), runs forward and backward, closes the monitor's step, and takes a plain SGD step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional

import hookscope as hs
from hookscope.cli.parse.specs import make_input
from hookscope.cli.sample import SampleRun
from hookscope.errors import SpecError

__all__ = ["synthetic_loss", "train_steps"]


def synthetic_loss(output: object, generator: torch.Generator) -> torch.Tensor:
    """The loss described in the module doc, for a model's ``output``."""
    floating = [t for _, t in hs.flatten_tensors(output) if t.is_floating_point() and t.requires_grad]
    if not floating:
        raise SpecError("the model's output holds no floating-point tensor that requires grad: nothing to train")
    prediction = floating[0]
    if prediction.dim() == 2 and prediction.shape[1] > 1:
        labels = torch.randint(0, prediction.shape[1], (prediction.shape[0],), generator=generator)
        return functional.cross_entropy(prediction.float(), labels.to(prediction.device))
    target = torch.randn(prediction.shape, generator=generator).to(prediction.device)
    return functional.mse_loss(prediction.float(), target)


def train_steps(
    sample: SampleRun,
    monitor: hs.GradMonitor,
    *,
    steps: int,
    lr: float,
    shape: str | None,
    dtype: str | None,
    seed: int,
    report: Callable[[int, float], None],
) -> None:
    """Run ``steps`` SGD steps of the synthetic loss, closing a monitor step after each backward."""
    model = sample.model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    for index in range(steps):
        args, kwargs = (
            (sample.args, sample.kwargs) if index == 0 else make_input(model, shape, dtype=dtype, seed=seed + index)
        )
        loss = synthetic_loss(model(*args, **kwargs), generator)
        loss.backward()  # type: ignore[no-untyped-call]
        monitor.step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        report(index, float(loss.detach()))
