"""Edits, checked: zero ablation and activation patching of a sample of modules.

The reference replaces the module's first output tensor in every call with a raw
``register_forward_hook`` (zeros, or the value the module returned in that call on a second
input); hookscope applies ``edits.zero()`` or ``edits.patch(cache)`` there. The model's
outputs must agree; and where the reference's output moved, hookscope's must have moved too, or
the edit never reached the output.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from hookscope import edits
from hookscope._capture import capture
from hookscope._edit import edit
from hookscope._verify.reference import RawRecorder, close, leaves, same
from hookscope._verify.subject import Example, Subject, last_line, other_example, output_leaves

__all__ = ["check_edits", "replace_first"]

Finding = tuple[Any, str]


def replace_first(value: Any, make: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with its first tensor replaced by ``make(tensor)``, containers rebuilt."""
    done = False

    def walk(item: Any) -> Any:
        nonlocal done
        if done:
            return item
        if isinstance(item, torch.Tensor):
            done = True
            return make(item)
        if isinstance(item, tuple) and hasattr(type(item), "_fields"):
            return type(item)(*(walk(part) for part in item))  # a namedtuple takes its fields
        if _is_model_output(item):
            for key in list(item.keys()):
                item[key] = walk(item[key])
            return item
        if dataclasses.is_dataclass(item) and not isinstance(item, type):
            fields = {f.name: walk(getattr(item, f.name)) for f in dataclasses.fields(item) if f.init}
            return dataclasses.replace(item, **fields)
        if isinstance(item, dict):
            return type(item)({key: walk(part) for key, part in item.items()})
        if isinstance(item, (tuple, list)):
            return type(item)(walk(part) for part in item)
        return item

    return walk(value)


def _is_model_output(item: object) -> bool:
    """A transformers ``ModelOutput``: a dict that is also a dataclass, rebuilt by setting its keys."""
    return isinstance(item, dict) and dataclasses.is_dataclass(item)


def check_edits(subject: Subject) -> None:
    """Zero and patch each module of the sample; one row per edit kind and module."""
    chosen = subject.sample()
    if subject.unsteady:
        with subject.check("edit", "every edit") as findings:
            findings.append(("REFUSED", subject.unsteady))
        return
    if not chosen:
        with subject.check("edit", "no module") as findings:
            findings.append(("REFUSED", "no module returned a floating tensor to edit"))
        return
    for name in chosen:
        with subject.check("edit zero", name) as findings:
            _compare(subject, name, edits.zero(), lambda call, t: torch.zeros_like(t), findings)
    other = other_example(subject.example)
    if other is None:
        with subject.check("edit patch", ", ".join(chosen)) as findings:
            findings.append(("REFUSED", "the example has no token ids or floating input to vary for a second run"))
        return
    source = _source_run(subject, other, chosen)
    if source is None:
        return
    recorder, cache = source
    for name in chosen:
        with subject.check("edit patch", name) as findings:

            def patched(call: int, tensor: torch.Tensor, name: str = name) -> torch.Tensor:
                record = recorder.record(name, call)
                if record is None or not record.outputs:
                    raise RuntimeError(f"{name} call {call} did not run on the second input")
                return next(iter(record.outputs.values()))

            _compare(subject, name, edits.patch(cache), patched, findings)


def _source_run(subject: Subject, other: Example, chosen: list[str]) -> tuple[RawRecorder, Any] | None:
    """The second input's run: raw values (the reference's patches) and hookscope's cache."""
    result: tuple[RawRecorder, Any] | None = None
    with subject.check("capture for patching", "second input") as findings:
        try:
            subject.run(other)
        except Exception as error:  # the varied input is ours, not the user's: say so
            findings.append(("REFUSED", f"the second input (the example varied) does not run: {last_line(error)}"))
            return None
        with (
            RawRecorder(subject.model, only=frozenset(chosen)) as recorder,
            capture(subject.model, layers=chosen) as cap,
        ):
            subject.run(other)
        findings.append(("SUPPORTED", f"{len(chosen)} modules captured on a second input to patch from"))
        result = recorder, cap.cache
    return result  # noqa: RET504 - None where the check's context turned an error into its row


def _compare(
    subject: Subject,
    name: str,
    change: Any,
    reference: Callable[[int, torch.Tensor], torch.Tensor],
    findings: list[Finding],
) -> None:
    """The raw hook's run, then hookscope's: the value handed on at the module, call by call, and
    the model's outputs must be the same."""
    module = subject.model.get_submodule(name)
    handed: list[torch.Tensor] = []

    def raw(mod: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        call = len(handed)
        new = reference(call, next(tensor for _, tensor in leaves(output)))
        handed.append(new.detach().clone())
        return replace_first(output, lambda tensor: new.clone())  # the model may write into it

    handle = module.register_forward_hook(raw)
    try:
        want = output_leaves(subject.run())
    finally:
        handle.remove()
    seen: list[torch.Tensor] = []
    with edit(subject.model, {name: change}) as editor:
        # attached after the edit's hook, so it sees what the edit hands on
        after = module.register_forward_hook(lambda mod, args, out: seen.append(_first(out)))
        try:
            got = output_leaves(subject.run())
        finally:
            after.remove()
    applied = sum(editor.applied.values())
    if applied != len(handed):
        findings.append(("SILENTLY_WRONG", f"edited {applied} calls; the module ran {len(handed)}"))
    wrong_calls = [call for call, value in enumerate(handed) if call >= len(seen) or not same(seen[call], value)]
    if wrong_calls:
        findings.append(("SILENTLY_WRONG", f"{name}#{wrong_calls[0]} handed on a value that is not the edit's"))
    clean = subject.clean_output
    moved_ref = any(not close(want[p], clean[p]) for p in want if p in clean)
    moved_got = any(not close(got[p], clean[p]) for p in got if p in clean)
    differ = [p for p in want if p not in got or not same(got[p], want[p])]
    rounding = [p for p in differ if p in got and close(got[p], want[p], rtol=1e-6, atol=1e-7)]
    if len(rounding) < len(differ):
        why = "the edit did not reach the output" if moved_ref and not moved_got else "outputs differ"
        findings.append(("SILENTLY_WRONG", f"{why}: output{differ[0]} is not the raw hook's"))
    elif not moved_ref:
        unmoved = "the output does not depend on this value (nor the raw hook's)"
        findings.append(("SUPPORTED", f"{applied} calls edited, each value the edit's; {unmoved}"))
    else:
        how = "within float rounding (another memory layout)" if rounding else "bit for bit"
        findings.append(
            ("SUPPORTED", f"{applied} calls edited, each value the edit's; the output equals the raw hook's, {how}")
        )


def _first(output: Any) -> torch.Tensor:
    return next(tensor for _, tensor in leaves(output)).detach().clone()
