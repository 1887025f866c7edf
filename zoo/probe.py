"""What the sweep does with one model type, inside its own process: build it tiny, make its
sample input, run one plain forward, then ``hookscope.verify`` where the installed hookscope has it.

Each stage's outcome is a small dict ``{"ok": bool, "reason": str | None, ...}`` so the ledger can
say which stage stopped a model type and why, in one line. A model type whose tiny build fails at
full shrinking is tried again with widths left alone (``zoo.tiny`` level 1), because a failure
there is usually the shrinker's, not the architecture's.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from zoo.reasons import reason_class, reason_for

__all__ = ["STAGES", "probe"]

STAGES = ("build", "input", "forward")


def probe(model_type: str, options: dict[str, Any], report: Any = None) -> dict[str, Any]:
    """The ledger entry of ``model_type``: its stages, the tiny model's facts and the verify dict.

    ``report`` (a callable or None) receives the entry after the first attempt, so that a parent
    that must kill a slow second attempt still knows how far the first one got.
    """
    started = time.perf_counter()
    entry = _attempt(model_type, options, level=0)
    if _worth_retrying(entry):
        if report is not None:
            report({**entry, "seconds": round(time.perf_counter() - started, 2)})
        retry = _attempt(model_type, options, level=1)
        if _progress(retry) > _progress(entry):
            retry["level0_reason"] = entry["stages"][entry["failed_stage"]]["reason"]
            entry = retry
    entry["seconds"] = round(time.perf_counter() - started, 2)
    return entry


def _worth_retrying(entry: dict[str, Any]) -> bool:
    """Whether leaving widths alone may help: a build or forward error that is not a missing
    library, remote code, pretrained files or a model class the mappings lack."""
    stage = entry["failed_stage"]
    if stage not in ("build", "forward"):
        return False
    reason = entry["stages"][stage]["reason"] or ""
    return reason_class(reason, stage).endswith(" error") and not reason.startswith("LookupError")


def _progress(entry: dict[str, Any]) -> int:
    return sum(1 for stage in STAGES if entry["stages"][stage]["ok"])


def _attempt(model_type: str, options: dict[str, Any], *, level: int) -> dict[str, Any]:
    from zoo.tiny import build_tiny

    entry: dict[str, Any] = {
        "model_type": model_type,
        "level": level,
        "stages": {stage: {"ok": False, "reason": "not reached"} for stage in STAGES},
        "failed_stage": None,
        "verify": None,
    }
    entry.update(_static_facts(model_type))
    try:
        tiny = build_tiny(model_type, seed=int(options.get("seed", 0)), level=level)
    except BaseException as error:  # anything a constructor raises is the ledger's reason
        return _failed(entry, "build", error)
    model = tiny.model
    entry.update(
        config_class=tiny.config_class,
        model_class=tiny.model_class,
        kind=tiny.kind,
        parameters=tiny.parameters,
        main_input=getattr(model, "main_input_name", None),
    )
    entry["stages"]["build"] = {"ok": True, "reason": None}
    try:
        args, kwargs = _sample(model, int(options.get("seed", 0)))
    except BaseException as error:
        return _failed(entry, "input", error)
    entry["stages"]["input"] = {"ok": True, "reason": None, "inputs": _describe(args, kwargs)}
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    except BaseException as error:
        return _failed(entry, "forward", error)
    entry["stages"]["forward"] = {"ok": True, "reason": None}
    if options.get("verify", True):
        entry["verify"] = _verify(model, args, kwargs, options.get("compile", "eager"))
    return entry


def _static_facts(model_type: str) -> dict[str, Any]:
    """What the ledger can say about a model type without building it (for failed builds)."""
    from transformers.models.auto import configuration_auto

    names = vars(configuration_auto)["CONFIG_MAPPING_NAMES"]
    facts: dict[str, Any] = {"config_class": names.get(model_type), "model_class": None}
    facts.update(kind="other", parameters=None)
    try:
        from transformers import CONFIG_MAPPING

        from zoo.tiny import kind_of, model_class_name

        config = CONFIG_MAPPING[model_type]()
        facts["model_class"] = model_class_name(model_type, config)
        facts["kind"] = kind_of(model_type, config, None)
    except BaseException:  # the build stage reports the reason
        pass
    return facts


def _sample(model: torch.nn.Module, seed: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    import hookscope as hs

    return hs.sample_input(model, seed=seed)


def _verify(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], backend: str | bool
) -> dict[str, Any] | None:
    import hookscope as hs

    verify = getattr(hs, "verify", None)
    if verify is None:
        return None
    try:
        result: dict[str, Any] = verify(model, example=(args, kwargs), compile=backend).to_dict()
    except BaseException as error:
        return {"error": reason_for(error)}
    return result


def _failed(entry: dict[str, Any], stage: str, error: BaseException) -> dict[str, Any]:
    entry["stages"][stage] = {"ok": False, "reason": reason_for(error)}
    entry["failed_stage"] = stage
    return entry


def _describe(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, str]:
    """The sample input's names and shapes, for the ledger (values would be noise)."""

    def one(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
        return type(value).__name__

    return {**{f"arg{index}": one(value) for index, value in enumerate(args)}, **{k: one(v) for k, v in kwargs.items()}}
