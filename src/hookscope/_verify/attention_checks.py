"""Attention, checked: op sites inside each attention module, and the kernel's sub-sites.

Op sites are compared, op by op and in order, with a plain ``TorchFunctionMode`` pushed by raw
hooks around the module's own code (:class:`~hookscope._verify.reference.OpRecorder`), on a
forward of its own: a mode beneath hookscope's would see hookscope's copies as the module's ops.
Sub-sites (``:attn.q|k|v|scores|pattern|z``) are compared with the raw
``scaled_dot_product_attention`` call that mode saw: q, k, v are its arguments, z its output, and
the scores and pattern are recomputed from them in float64 (mask, causal flag, scale and grouped
heads as the kernel reads them). Where the model can switch to transformers' eager attention,
the pattern is also compared with the eager twin's ``output_attentions``.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
from torch import nn

from hookscope._capture import capture
from hookscope._verify.reference import UNINITIALISED, OpCall, OpRecorder, close, same
from hookscope._verify.subject import Subject, last_line, output_leaves

__all__ = ["attention_modules", "check_attention", "reference_ops", "sub_site_problem"]

_ATTENTION = re.compile(r"attn|attention", re.IGNORECASE)
_SUB_SITES = ("q", "k", "v", "scores", "pattern", "z")


def attention_modules(subject: Subject) -> list[str]:
    """The modules that ran and are named or classed as attention (``attn``, ``attention``),
    nested ones too (BERT's ``attention`` wraps ``attention.self``, which calls the kernel);
    norms, linear layers and dropouts inside them left out."""
    found: list[str] = []
    for name in subject.ran:
        module = subject.model.get_submodule(name)
        leaf = name.rsplit(".", 1)[-1]
        kind = type(module).__name__
        if not name or "Norm" in kind or isinstance(module, (nn.Linear, nn.Dropout)):
            continue
        if _ATTENTION.search(leaf) or _ATTENTION.search(kind):
            found.append(name)
    return found


def check_attention(subject: Subject) -> None:
    """One row for the op sites of every attention module, one for the sub-sites."""
    names = attention_modules(subject)
    if not names:
        with subject.check("attention op sites", "no attention module") as findings:
            findings.append(("REFUSED", "no module named or classed attn/attention ran"))
        return
    recorders: dict[str, OpRecorder] = {}
    with subject.check("attention op sites", "attention modules") as findings:
        if subject.unsteady:
            findings.append(("REFUSED", subject.unsteady))
            return
        recorders = reference_ops(subject, names)
        own = [name for name in names if any(recorders[name].calls)]  # a wrapper whose children do the work has none
        if not own:
            findings.append(
                ("REFUSED", "no attention module's own code calls a torch function (its children do it all)")
            )
            return
        again = reference_ops(subject, own)  # ops reading memory nobody wrote differ from run to run
        cache = _captured(subject, [f"{name}:op[*]" for name in own])
        for name in own:
            _compare_ops(name, cache, recorders[name], findings, _unsteady_ops(recorders[name], again[name]))
        ops = sum(len(call) for name in own for call in recorders[name].calls)
        findings.append(
            ("SUPPORTED", f"{ops} op calls of {len(own)} modules in order, each equal to a raw function mode's")
        )
    kernels = [name for name in recorders if _kernel_calls(recorders[name])]
    if not recorders:
        return
    with subject.check("attention sub-sites", f"{len(kernels)} modules calling SDPA") as findings:
        if not kernels:
            findings.append(
                (
                    "REFUSED",
                    "no attention module calls F.scaled_dot_product_attention "
                    "(eager attention: its op sites above hold the softmax)",
                )
            )
            return
        drifting = [name for name in kernels if name in subject.drifting]
        if drifting:  # the reference's forward and hookscope's saw different values there
            findings.append(("REFUSED", f"not compared: {', '.join(drifting)} compute something else on every forward"))
            kernels = [name for name in kernels if name not in subject.drifting]
            if not kernels:
                return
        cache = _captured(subject, [f"{name}:attn.{part}" for name in kernels for part in _SUB_SITES])
        compared = 0
        for name in kernels:
            subject.kernels[name] = [
                [_reference_sub_sites(op) for op in call if op.name == "scaled_dot_product_attention"]
                for call in recorders[name].calls
            ]
            compared += _compare_sub_sites(name, cache, subject.kernels[name], findings)
        findings.append(
            (
                "SUPPORTED",
                f"{compared} sub-site values equal to the raw kernel call's (scores and pattern recomputed in float64)",
            )
        )
        _eager_twin(subject, kernels, cache, findings)


def reference_ops(subject: Subject, names: list[str]) -> dict[str, OpRecorder]:
    """A forward with raw function modes alone: a mode beneath hookscope's would see hookscope's
    copies as the module's ops."""
    recorders = {name: OpRecorder(subject.model, name) for name in names}
    try:
        for recorder in recorders.values():
            recorder.attach()
        subject.run()
    finally:
        for recorder in recorders.values():
            recorder.remove()
    return recorders


def _captured(subject: Subject, selectors: list[str]) -> Any:
    with capture(subject.model, layers=selectors) as cap:
        subject.run()
    return cap.cache


def _kernel_calls(recorder: OpRecorder) -> list[OpCall]:
    return [op for call in recorder.calls for op in call if op.name == "scaled_dot_product_attention"]


def _unsteady_ops(first: OpRecorder, second: OpRecorder) -> set[tuple[int, int]]:
    """``(call, op index)`` of the ops whose values two plain runs did not agree on: uninitialised
    memory (``new_empty``) and views of it read before anything is written there."""
    unsteady = set()
    for call, (ops, again) in enumerate(zip(first.calls, second.calls, strict=False)):
        unwritten: set[int] = set()  # memory an uninitialised op returned: a view of it reads whatever was there
        for index, (op, other) in enumerate(zip(ops, again, strict=False)):
            outputs = zip(op.outputs, other.outputs, strict=False)
            fresh = op.name in UNINITIALISED
            viewed = not op.name.endswith("_") and any(ptr in unwritten for ptr in op.storages)
            if fresh or viewed or not all(same(a, b) for a, b in outputs):
                unsteady.add((call, index))
            if fresh:
                unwritten.update(op.storages)
    return unsteady


def _compare_ops(
    name: str, cache: Any, recorder: OpRecorder, findings: list[Any], unsteady: set[tuple[int, int]]
) -> None:
    for call, expected in enumerate(recorder.calls):
        got: list[list[torch.Tensor]] = []
        last = None
        for site in cache.sites():
            if site.module != name or site.call != call or not site.op or site.op.startswith("attn."):
                continue
            if site.op != last:
                got.append([])
                last = site.op
            got[-1].append(cache[site])
        if len(got) != len(expected):
            findings.append(
                ("SILENTLY_WRONG", f"{name}#{call}: {len(got)} op sites, the module's code called {len(expected)} ops")
            )
            continue
        for index, (values, op) in enumerate(zip(got, expected, strict=False)):
            equal = _same_shape if (call, index) in unsteady else same
            if len(values) != len(op.outputs) or not all(equal(a, b) for a, b in zip(values, op.outputs, strict=False)):
                findings.append(
                    ("SILENTLY_WRONG", f"{name}#{call}: op {index} ({op.name}) differs from the raw mode's")
                )
                break


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype


def _reference_sub_sites(op: OpCall) -> dict[str, torch.Tensor]:
    """q, k, v and z as the kernel took and gave them; scores and pattern in float64."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    given = dict(zip(names, op.args, strict=False))
    given.update(op.kwargs)
    q, k, v = given["query"], given["key"], given["value"]
    mask, causal, scale = given.get("attn_mask"), bool(given.get("is_causal", False)), given.get("scale")
    qd, kd = q.double(), k.double()
    if kd.shape[-3] != qd.shape[-3] and qd.dim() >= 3:
        kd = kd.repeat_interleave(qd.shape[-3] // kd.shape[-3], dim=-3)
    factor = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = qd @ kd.transpose(-2, -1) * factor
    length, source = q.shape[-2], k.shape[-2]
    if causal:
        keep = torch.ones(length, source, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if isinstance(mask, torch.Tensor):
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    return {"q": q, "k": k, "v": v, "z": op.outputs[0], "scores": scores, "pattern": scores.softmax(-1)}


def sub_site_problem(part: str, value: torch.Tensor, want: torch.Tensor) -> bool:
    """True when ``value`` (a sub-site in its documented layout) is not the reference: q, k, v, z
    bit for bit, scores and pattern within float rounding. The documented layout keeps one of each
    run of repeated key/value heads and splits packed query heads; the reference is the kernel's
    layout, so key/value heads are repeated back and a packed value reshaped before comparing."""
    if part in ("k", "v") and value.dim() == want.dim() >= 3 and value.shape[-3] != want.shape[-3]:
        if want.shape[-3] % value.shape[-3] == 0:  # the kernel took the heads repeated
            value = value.repeat_interleave(want.shape[-3] // value.shape[-3], dim=-3)
        elif value.shape[-3] % want.shape[-3] == 0:  # the kernel grouped them itself (enable_gqa)
            want = want.repeat_interleave(value.shape[-3] // want.shape[-3], dim=-3)
    if value.shape != want.shape and value.numel() == want.numel():
        value = value.reshape(want.shape)
    if part in ("q", "k", "v", "z"):
        return not same(value, want)
    return not close(value, want, rtol=1e-4, atol=1e-5)


def _compare_sub_sites(name: str, cache: Any, calls: list[list[dict[str, torch.Tensor]]], findings: list[Any]) -> int:
    """Each module call's kernel calls (``#1``: a call's second) against their references."""
    compared = 0
    for call, kernels in enumerate(calls):
        for index, expected in enumerate(kernels):
            for part in _SUB_SITES:
                key = f"{name}#{call}:attn.{part}" + (f"#{index}" if index else "")
                got = [
                    cache[site]
                    for site in cache.sites()
                    if site.module == name and site.call == call and site.op == f"attn.{part}#{index}"
                ]
                if not got:
                    findings.append(("SILENTLY_WRONG", f"{key}: no value kept"))
                    continue
                if sub_site_problem(part, got[0], expected[part]):
                    findings.append(("SILENTLY_WRONG", f"{key} differs from the kernel call's"))
                compared += 1
    return compared


def _eager_twin(subject: Subject, kernels: list[str], cache: Any, findings: list[Any]) -> None:
    """The pattern against transformers' eager attention on the same weights, where it applies."""
    model = subject.model
    config = getattr(model, "config", None)
    switch = getattr(model, "set_attn_implementation", None)
    before = getattr(config, "_attn_implementation", None)
    if config is None or not callable(switch) or before in (None, "eager"):
        findings.append(("SUPPORTED", "(no eager twin: the model cannot switch to transformers' eager attention)"))
        return
    args, kwargs = subject.example
    try:
        switch("eager")
        subject.begin_forward()
        with torch.no_grad():
            output = model(*args, **{**kwargs, "output_attentions": True})
    except Exception as error:  # the twin is an extra reference; the float64 one stands without it
        findings.append(("SUPPORTED", f"(the eager twin did not run: {last_line(error)})"))
        return
    finally:
        try:
            switch(before)
        except Exception:
            config._attn_implementation = before
    attentions = getattr(output, "attentions", None)
    if attentions and not all(isinstance(item, torch.Tensor) for item in attentions):
        findings.append(("SUPPORTED", "(the eager twin's attentions are not one tensor per layer: not compared)"))
        return
    if not attentions or getattr(output, "cross_attentions", None) or len(attentions) != len(kernels):
        found = len(attentions) if attentions else 0
        findings.append(
            (
                "SUPPORTED",
                f"(the eager twin returned {found} attention maps for {len(kernels)} modules: "
                "not paired, not compared)",
            )
        )
        return
    differ = [
        name
        for name, eager in zip(kernels, attentions, strict=True)
        if eager is not None
        and cache[f"{name}:attn.pattern"].shape == eager.shape
        and not close(cache[f"{name}:attn.pattern"], eager, rtol=1e-4, atol=1e-5)
    ]
    twin = output_leaves(output)
    apart = [p for p in subject.clean_output if p in twin and not close(twin[p], subject.clean_output[p])]
    if differ and apart:  # transformers' two paths compute different models here: the twin is no reference
        findings.append(("SUPPORTED", f"(the eager twin is no reference here: its output{apart[0]} is not SDPA's)"))
    elif differ:
        findings.append(("SILENTLY_WRONG", f"{differ[0]}:attn.pattern differs from the eager twin's attentions"))
    else:
        findings.append(("SUPPORTED", f"the pattern of {len(kernels)} modules equals the eager twin's attentions"))
