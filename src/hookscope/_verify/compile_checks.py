"""``torch.compile``, checked: a capture of a sample of modules while the compiled model runs
equals the raw hooks' values of the eager reference forward.

The backend is ``"eager"`` by default: it runs dynamo, which is where hooks meet compiled code
(graph breaks, guards, the compiled-code escape), without spending a minute in a C++ compiler;
``compile="inductor"`` checks the whole stack, within float rounding. A model dynamo cannot
compile on its own is a refusal with dynamo's reason, not a defect of hookscope.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch

from hookscope._capture import capture
from hookscope._core.compat.private import compiled_code_objects
from hookscope._core.sites import Site
from hookscope._verify.reference import close
from hookscope._verify.report import Status
from hookscope._verify.subject import Subject, last_line, output_leaves
from hookscope.errors import HookscopeError, StaleCompiledCodeWarning

__all__ = ["check_compile"]


def check_compile(subject: Subject, backend: str) -> None:
    """One row: the sample's values under ``torch.compile(model, backend=backend)``.

    Dynamo keeps what it compiled from the model's classes, and hookscope then runs the model
    eagerly while its hooks are attached (code compiled before them would never call them). Where
    nothing was compiled in the process before the check, the check clears Dynamo's caches after
    itself (``torch.compiler.reset()``), so the model is as it was; else the row says what stays."""
    before = compiled_code_objects()
    try:
        _check(subject, backend)
    finally:
        if before is not None and not before:
            torch.compiler.reset()
        elif subject.rows and subject.rows[-1].check == "torch.compile":
            row = subject.rows[-1]
            kept = "; Dynamo keeps the code compiled here (other code was compiled before; "
            kept += "torch.compiler.reset() clears both)"
            subject.rows[-1] = dataclasses.replace(row, detail=row.detail + kept)


def _check(subject: Subject, backend: str) -> None:
    chosen = [name for name in subject.sample() if name not in subject.drifting]
    with subject.check("torch.compile", f"backend={backend}: {', '.join(chosen)}") as findings:
        if not chosen:
            findings.append(("REFUSED", "no module returned a floating tensor to capture"))
            return
        if subject.unsteady:
            findings.append(("REFUSED", subject.unsteady))
            return
        compiled = torch.compile(subject.model, backend=backend)
        args, kwargs = subject.example
        try:
            # hooks first: code compiled before they were attached would never call them
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", StaleCompiledCodeWarning)
                with capture(subject.model, layers=chosen) as cap:
                    subject.begin_forward()
                    with torch.no_grad():
                        compiled(*args, **kwargs)
        except HookscopeError:
            raise
        except Exception as error:
            findings.append(_without_hooks(subject, compiled, error))
            return
        if any(issubclass(item.category, StaleCompiledCodeWarning) for item in caught):
            findings.append(
                (
                    "REFUSED",
                    "Dynamo already holds code compiled from this model's classes, so hookscope runs the model "
                    "eagerly while its hooks are attached: nothing compiled to check (torch.compiler.reset() first)",
                )
            )
            return
        reference = subject.reference
        assert reference is not None
        compared, wrong = 0, []
        for name in chosen:
            for record in [r for r in reference.calls if r.module == name]:
                for path, want in record.outputs.items():
                    site = Site(name, record.call, "output", path)
                    try:
                        got = cap.cache[site]
                    except HookscopeError:
                        findings.append(("SILENTLY_WRONG", f"{site} not kept under torch.compile"))
                        continue
                    compared += 1
                    if not close(got, want, rtol=1e-4, atol=1e-5):
                        wrong.append(f"{site} under torch.compile differs from eager raw hooks'")
        if wrong:
            apart = _compiled_apart(subject, compiled)
            if apart:  # dynamo alone moves this model's output: values under it are not eager's to compare
                findings.append(("REFUSED", f"torch.compile changes this model's output{apart} without hookscope"))
                return
            findings += [("SILENTLY_WRONG", problem) for problem in wrong]
        findings.append(("SUPPORTED", f"{compared} values under torch.compile equal to eager raw hooks'"))


def _compiled_apart(subject: Subject, compiled: Any) -> str:
    """The first output path where the compiled model, run with no hook, differs from eager, or ""."""
    args, kwargs = subject.example
    subject.begin_forward()
    with torch.no_grad():
        plain = output_leaves(compiled(*args, **kwargs))
    apart = [p for p in subject.clean_output if p in plain and not close(plain[p], subject.clean_output[p])]
    return apart[0] if apart else ""


def _without_hooks(subject: Subject, compiled: Any, error: Exception) -> tuple[Status, str]:
    """A failure under hooks: REFUSED where the compiled model fails without them too, else ERROR."""
    args, kwargs = subject.example
    try:
        subject.begin_forward()
        with torch.no_grad():
            compiled(*args, **kwargs)
    except Exception as plain:
        return "REFUSED", f"the model does not compile without hookscope: {last_line(plain)}"
    return "ERROR", f"compiles without hookscope, fails with its capture: {last_line(error)}"
