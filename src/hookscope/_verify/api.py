"""``hs.verify``: what hookscope does on this model, each feature checked against a reference made
without it, in one report."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from hookscope._arch.samples import sample_input
from hookscope._core.compat.internals import module_hooks
from hookscope._core.live_hooks import remove_all
from hookscope._core.select import ensure_module
from hookscope._verify.attention_checks import check_attention
from hookscope._verify.capture_checks import check_capture, check_gradients
from hookscope._verify.compile_checks import check_compile
from hookscope._verify.edit_checks import check_edits
from hookscope._verify.expert_checks import check_experts
from hookscope._verify.report import VerifyReport, VerifyRow
from hookscope._verify.ssm_checks import check_ssm
from hookscope._verify.std_checks import check_std
from hookscope._verify.subject import Example, Subject, last_line
from hookscope._verify.trace_checks import check_trace
from hookscope.errors import SpecError

__all__ = ["CHECKS", "verify"]

#: Every check, in the order it runs.
CHECKS: tuple[str, ...] = (
    "capture", "gradients", "edits", "trace", "attention", "experts", "ssm", "std", "compile",
)  # fmt: skip


def verify(
    model: nn.Module,
    example: Any = None,
    *,
    checks: Sequence[str] | None = None,
    sample: int = 3,
    compile: str | bool = "eager",  # noqa: A002 - the name users know from torch.compile
    seed: int = 0,
) -> VerifyReport:
    """Check what hookscope does on ``model`` against references made without it; one row per check.

    Each row is ``SUPPORTED`` (equal to the reference), ``REFUSED`` (hookscope declined with the
    reason a user sees, or the check does not apply), ``SILENTLY_WRONG`` (a value that differs
    from the reference, or one the reference has and hookscope lacks) or ``ERROR`` (something
    raised; the row holds the last line). ``report.ok`` is True when no row is SILENTLY_WRONG or
    ERROR. The checks, in order (``checks=`` picks some):

    - ``capture``: every module that ran, inputs (keyword ones too) and outputs of every call,
      bit for bit against raw ``register_forward_pre_hook``/``register_forward_hook`` on the same
      forward; the model's output unchanged by the capture.
    - ``gradients``: ``grads=True`` on ``sample`` modules against ``torch.autograd.grad``.
    - ``edits``: ``hs.edits.zero()`` and ``hs.edits.patch(cache)`` on ``sample`` modules against
      raw hooks that replace the value; the outputs must agree, and move where the reference's do.
    - ``trace``: calls counted and statistics against float64; a NaN put in one parameter (and put
      back) must be blamed on the call raw hooks say made it.
    - ``attention``: op sites of every attention module against a raw ``TorchFunctionMode``; the
      SDPA sub-sites against the kernel's own arguments (scores, pattern in float64), and against
      transformers' eager twin where the model can switch.
    - ``experts`` (mixtures of experts only): every expert's rows of every fused experts module,
      read through the tap, against a float64 reference from the fused weights; the tapped output
      against the clean one; ``zero`` at one expert's output against a raw hook's routing weight 0.
    - ``ssm`` (Mamba and Mamba-2 mixers only): every value the state-space tap reads against the
      recurrence run token by token in float64; the decay halved against the same edit by hand.
    - ``std``: each resolved ``std:`` name against the raw value it names; each missing one a
      refusal with its reason.
    - ``compile``: a capture under ``torch.compile(model, backend=compile)`` against the eager raw
      values (``compile=False`` skips it; ``"inductor"`` compiles for real, minutes on a CPU).

    Cost: about ``4 * sample + 16`` forwards (3 more with fused experts or state-space mixers) and one backward of
    ``model`` on ``example`` (the report states the count), plus a compile; every hook of
    hookscope's and of the report's is removed (transformers keeps the hooks it installs for
    ``output_attentions``), and the train/eval mode, parameters and torch's generator put back,
    however a check ends. The generator is reseeded with ``seed`` before every forward, so that
    a model drawing random numbers draws the same ones.

    Args:
        model: any ``nn.Module``; run in eval mode during the checks.
        example: what the model runs on: a tensor, a tuple (or list) of positional inputs, a dict of
            keyword inputs, or ``(args, kwargs)`` (a pair of a tuple and a dict is always read so);
            None makes one with :func:`hookscope.sample_input`.
        checks: names from ``CHECKS``; None runs them all.
        sample: how many modules the edits, gradients and compile checks use (spread evenly).
        compile: the ``torch.compile`` backend (``torch.compiler.list_backends()``), or False.
        seed: the seed of the sample input and of the random projections.

    >>> import torch, hookscope as hs
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> report = hs.verify(model, torch.randn(3, 4), compile=False)
    >>> report.ok, report.counts["SILENTLY_WRONG"]
    (True, 0)
    """
    ensure_module(model)
    chosen = _checks(checks)
    if isinstance(sample, bool) or not isinstance(sample, int) or sample < 1:
        raise SpecError(f"sample={sample!r} is not a count of modules; expected a whole number of 1 or more, e.g. 3")
    backend = _backend(compile)
    start = time.perf_counter()
    args, kwargs = _example(model, example, seed)
    subject = Subject(model, (args, kwargs), sample_size=sample, seed=seed)
    modes = {module: module.training for module in model.modules()}
    hooks_before = _hook_count(model)
    generator = torch.get_rng_state()
    cuda = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    devices = torch.cuda.get_rng_state_all() if cuda else None  # manual_seed reseeds them too
    try:
        model.eval()
        try:
            subject.record_clean()
        except Exception as error:
            raise SpecError(
                f"{type(model).__name__} did not run on the example ({last_line(error)}); pass example= an input "
                "the model takes: a tensor, a tuple, a dict of keyword inputs or (args, kwargs)"
            ) from error
        runs: dict[str, Callable[[], None]] = {
            "capture": lambda: check_capture(subject),
            "gradients": lambda: check_gradients(subject),
            "edits": lambda: check_edits(subject),
            "trace": lambda: check_trace(subject),
            "attention": lambda: check_attention(subject),
            "experts": lambda: check_experts(subject),
            "ssm": lambda: check_ssm(subject),
            "std": lambda: check_std(subject),
            "compile": lambda: check_compile(subject, backend) if backend else None,
        }
        for name in chosen:
            runs[name]()
            _no_hook_left(subject, model, hooks_before, name)
    finally:
        torch.set_rng_state(generator)
        if devices is not None:
            torch.cuda.set_rng_state_all(devices)
        for module, training in modes.items():
            module.train(training)
    return VerifyReport(
        type(model).__name__,
        subject.rows,
        forwards=subject.forwards,
        backwards=subject.backwards,
        seconds=time.perf_counter() - start,
        example=_describe(args, kwargs),
        versions=_versions(),
    )


def _checks(checks: Sequence[str] | None) -> list[str]:
    if checks is None:
        return list(CHECKS)
    if isinstance(checks, str):
        checks = [part.strip() for part in checks.split(",") if part.strip()]
    if not checks:
        raise SpecError(f"checks= is empty; name some of {', '.join(CHECKS)}, or leave it out to run them all")
    unknown = [name for name in checks if name not in CHECKS]
    if unknown:
        raise SpecError(f"checks={list(checks)!r} names no check {unknown!r}; expected some of {', '.join(CHECKS)}")
    return [name for name in CHECKS if name in checks]


def _backend(compile: str | bool) -> str | None:  # noqa: A002
    if compile is False or (isinstance(compile, str) and compile.lower() in ("none", "off", "false")):
        return None
    if compile is True:
        return "eager"
    known = torch.compiler.list_backends(exclude_tags=())
    if isinstance(compile, str) and compile in known:
        return compile
    raise SpecError(
        f"compile={compile!r} is not a torch.compile backend; expected one of {', '.join(sorted(known))}, "
        "or False (or 'none') to leave the compile check out"
    )


def _example(model: nn.Module, example: Any, seed: int) -> Example:
    if example is None:
        return sample_input(model, seed=seed)
    if isinstance(example, torch.Tensor):
        return (example,), {}
    if isinstance(example, dict):
        return (), dict(example)
    if (
        isinstance(example, tuple)
        and len(example) == 2
        and isinstance(example[0], tuple)
        and isinstance(example[1], dict)
    ):
        return example[0], dict(example[1])
    if isinstance(example, (tuple, list)):
        return tuple(example), {}
    raise SpecError(
        f"example={type(example).__name__} is not a model input; expected a tensor, a tuple of inputs, a dict of "
        "keyword inputs or (args, kwargs)"
    )


def _hook_count(model: nn.Module) -> int:
    """Module hooks defined in hookscope's code (its features' and this report's references); hooks
    of other code are left out, such as those transformers installs for ``output_attentions``."""
    hooks = 0
    for module in model.modules():
        for hook in module_hooks(module):
            owner = getattr(hook, "__module__", None) or getattr(getattr(hook, "__func__", None), "__module__", "")
            hooks += str(owner).startswith("hookscope")
    return hooks


def _no_hook_left(subject: Subject, model: nn.Module, before: int, check: str) -> None:
    """A check that left a hook behind is an ERROR row (and the hooks are taken off)."""
    left = _hook_count(model) - before
    if left > 0:
        remove_all(model)
        subject.rows.append(VerifyRow(check, "hooks", "ERROR", f"{left} hooks were left attached after the check"))


def _describe(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    def one(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            return "x".join(map(str, value.shape)) + f" {str(value.dtype).removeprefix('torch.')}"
        return type(value).__name__

    parts = [one(arg) for arg in args] + [f"{key}={one(value)}" for key, value in kwargs.items()]
    return ", ".join(parts)


def _versions() -> dict[str, str]:
    from hookscope._version import __version__

    found = {"hookscope": __version__, "torch": torch.__version__}
    try:
        import transformers

        found["transformers"] = transformers.__version__
    except ImportError:
        pass
    return found
