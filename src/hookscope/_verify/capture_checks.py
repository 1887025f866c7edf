"""Capture, checked: every module's inputs and outputs, and the gradients of kept values.

The reference is a :class:`~hookscope._verify.reference.RawRecorder` on the same forward as the
capture: both see the same values, so any difference is hookscope's, and equality is bit for bit.
The model's output with the capture attached is compared with the clean forward's too: a capture
must not change what the model computes.
"""

from __future__ import annotations

from typing import Any

import torch

from hookscope._capture import capture
from hookscope._core.compat.internals import version_counter
from hookscope._core.sites import Site
from hookscope._verify.reference import RawRecorder, close, same
from hookscope._verify.report import Status
from hookscope._verify.subject import Subject, last_line, output_leaves
from hookscope.errors import HookscopeError

__all__ = ["check_capture", "check_gradients"]


def _label(module: str, call: int, what: str, path: str) -> str:
    return f"{module or '(root)'}#{call}:{what}{path}"


def check_capture(subject: Subject) -> None:
    """One forward capturing every module that ran (``keep="both"``), against raw hooks."""
    ran = subject.ran
    with subject.check("capture inputs and outputs", f"every module ({len(ran)})") as findings:
        with RawRecorder(subject.model) as recorder, capture(subject.model, layers=ran, keep="both") as cap:
            output = subject.run()
        cache = cap.cache
        wanted: dict[tuple[str, int, str, str], torch.Tensor] = {}
        for record in recorder.calls:
            for path, value in record.inputs.items():
                wanted[(record.module, record.call, "input", path)] = value
            for path, value in record.outputs.items():
                wanted[(record.module, record.call, "output", path)] = value
        got = {(site.module, site.call, site.what, site.path): site for site in cache.sites()}
        missing = [key for key in wanted if key not in got]
        extra = [key for key in got if key not in wanted]
        wrong = [key for key, value in wanted.items() if key in got and not same(cache[got[key]], value)]
        if missing:
            findings.append(("SILENTLY_WRONG", f"{len(missing)} values not kept, e.g. {_label(*missing[0])}"))
        if extra:
            findings.append(("SILENTLY_WRONG", f"{len(extra)} values kept that no call made, e.g. {_label(*extra[0])}"))
        if wrong:
            findings.append(("SILENTLY_WRONG", f"{len(wrong)} values differ from raw hooks', e.g. {_label(*wrong[0])}"))
        changed = [
            path
            for path, value in output_leaves(output).items()
            if path in subject.clean_output and not close(value, subject.clean_output[path])
        ]
        if changed and not subject.unsteady:  # a model that drifts between forwards says nothing here
            findings.append(("SILENTLY_WRONG", f"the model's output{changed[0]} changed while capturing"))
        calls = len(recorder.calls)
        findings.append(("SUPPORTED", f"{len(wanted)} tensors of {calls} calls equal to raw hooks', bit for bit"))


def check_gradients(subject: Subject) -> None:
    """``grads=True`` on a sample of modules against ``torch.autograd.grad`` of the same loss.

    The loss is a fixed random projection of every floating output, so every kept value gets a
    gradient of its own; the parameters' ``.grad`` are put back as they were afterwards.
    """
    chosen = subject.sample()
    with subject.check("gradients of kept values", ", ".join(chosen) or "no module") as findings:
        if not chosen:
            findings.append(("REFUSED", "no module returned a floating tensor"))
            return
        params = [p for p in subject.model.parameters() if p.requires_grad]
        if not params:
            findings.append(("REFUSED", "no parameter requires grad, so the model's output has no graph"))
            return
        saved = [p.grad for p in params]
        try:
            _compare_gradients(subject, chosen, findings)
        except HookscopeError:
            raise
        except Exception as error:  # a model autograd cannot differentiate is not hookscope's defect
            findings.append(_without_hooks(subject, error))
        finally:
            for param, grad in zip(params, saved, strict=True):
                param.grad = grad


def _loss(output: Any) -> torch.Tensor | None:
    """A fixed random projection of every floating output that requires grad, or None."""
    outs = [t for t in floating_leaves_graph(output) if t.requires_grad]
    if not outs:
        return None
    generator = torch.Generator().manual_seed(0)
    return torch.stack([(t.float() * torch.randn(t.shape, generator=generator).to(t.device)).sum() for t in outs]).sum()


def _without_hooks(subject: Subject, error: Exception) -> tuple[Status, str]:
    """A backward that failed under the capture: REFUSED where it fails with no hook too."""
    try:
        loss = _loss(subject.run(grad=True))
        if loss is not None:
            torch.autograd.backward(loss)
            subject.backwards += 1
    except Exception as plain:
        return "REFUSED", f"autograd cannot differentiate this model without hookscope either: {last_line(plain)}"
    return "ERROR", f"a backward works without hookscope and fails with its capture: {last_line(error)}"


def _compare_gradients(subject: Subject, chosen: list[str], findings: list[Any]) -> None:
    with (
        RawRecorder(subject.model, keep_graph=frozenset(chosen), values=False) as recorder,
        capture(subject.model, layers=chosen, grads=True) as cap,
    ):
        output = subject.run(grad=True)
        made = _loss(output)
        if made is None:
            findings.append(("REFUSED", "the model's output does not require grad"))
            return
        loss: torch.Tensor = made
        on_graph = {key: t for key, t in recorder.graph.items() if t.requires_grad and t.is_floating_point()}
        keys = [key for key, tensor in on_graph.items() if version_counter(tensor) == recorder.versions[key]]
        written = len(on_graph) - len(keys)
        torch.autograd.backward(loss, retain_graph=True)
        subject.backwards += 1
        kept = _kept_grads(cap.cache, keys, recorder.paths)
    # after the capture: a backward inside it would reach its hooks a second time
    expected: tuple[Any, ...] = torch.autograd.grad(loss, [recorder.graph[key] for key in keys], allow_unused=True)
    compared, unused = 0, 0
    for key, want in zip(keys, expected, strict=True):
        if want is None:  # not on the path to the output (a value cut off by integer codes): no gradient to keep
            unused += 1
            continue
        got = kept[key]
        if isinstance(got, str):
            findings.append(("SILENTLY_WRONG", f"{key[0]}#{key[1]}: {got}; torch.autograd.grad gives one"))
            continue
        compared += 1
        if not close(got, want, rtol=1e-5, atol=1e-7):
            findings.append(("SILENTLY_WRONG", f"{key[0]}#{key[1]}: gradient differs from torch.autograd.grad's"))
    if not compared:
        findings.append(("REFUSED", "no kept value lies on the path from the parameters to the output"))
    note = f"; {written} left out (the model writes into them in place later)" if written else ""
    note += f"; {unused} on no path to the output (no gradient to keep)" if unused else ""
    findings.append(("SUPPORTED", f"{compared} gradients equal to torch.autograd.grad's{note}"))


def _kept_grads(
    cache: Any, keys: list[tuple[str, int]], paths: dict[tuple[str, int], str]
) -> dict[tuple[str, int], torch.Tensor | str]:
    """Each key's kept gradient (cloned), or why there is none."""
    kept: dict[tuple[str, int], torch.Tensor | str] = {}
    for module, call in keys:
        site = Site(module, call, "output", paths[(module, call)])
        if site not in cache.sites():
            kept[(module, call)] = f"no value kept at {site}"
            continue
        try:
            kept[(module, call)] = cache.grad[site].clone()
        except HookscopeError as error:
            kept[(module, call)] = f"no gradient kept ({error.args[0]})"
    return kept


def floating_leaves_graph(output: Any) -> list[torch.Tensor]:
    """The floating tensors of the model's output, graph kept."""
    from hookscope._verify.reference import leaves

    return [tensor for _, tensor in leaves(output) if tensor.is_floating_point()]
