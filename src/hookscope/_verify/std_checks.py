"""Canonical names, checked: each ``std:`` name the model resolves, read through a capture, equals
the raw hook's value at the module boundary it names; each name it does not resolve is a
refusal with the reason the map gives.

Attention sub-site names (``blocks.i.attn.pattern``) are read from the same module as the name
``blocks.i.attn``: their values are what the attention sub-sites row checked. One identity ties
the blocks together without hookscope: ``blocks.i.resid_post`` equals ``blocks.{i+1}.resid_pre``.
"""

from __future__ import annotations

import re
from typing import Any

from hookscope._arch.std import std_map
from hookscope._capture import capture
from hookscope._core.op_sites import split_op_label
from hookscope._core.sites import Site
from hookscope._verify.attention_checks import reference_ops, sub_site_problem
from hookscope._verify.reference import OpRecorder, RawRecorder, close, same
from hookscope._verify.subject import Subject
from hookscope.errors import HookscopeError

__all__ = ["check_std"]


def check_std(subject: Subject) -> None:
    """Rows: the resolved names, then one refusal per reason a name is missing."""
    args, kwargs = subject.example
    std: Any = None
    with subject.check("std names", "resolved") as findings:
        subject.begin_forward()
        std = std_map(subject.model, *args, **kwargs)
        names = list(std)
        if not names:
            findings.append(("REFUSED", "no canonical name resolves on this model"))
            return
        modules = frozenset(_parse(std[n].read).module for n in names if std[n].kind != "attn")
        plain = [_parse(std[n].read) for n in names if std[n].kind != "attn"]
        ops = _op_references(subject, [site for site in plain if not site.op.startswith(("expert.", "ssm."))])
        with (
            RawRecorder(subject.model, only=modules) as recorder,
            capture(subject.model, layers=[f"std:{n}" for n in names]) as cap,
        ):
            subject.run()
        checked, via_attention = 0, 0
        unchecked: list[str] = []
        for name in names:
            site = std[name]
            if site.kind == "attn":
                problem = _attention_problem(name, site, cap.cache, subject)
                if problem is None:
                    unchecked.append(name)
                    continue
                if problem:
                    findings.append(("SILENTLY_WRONG", problem))
                via_attention += 1
                continue
            problem = _compare(name, site, cap.cache, recorder, ops, subject)
            if problem is None:
                unchecked.append(name)
                continue
            if problem:
                findings.append(("SILENTLY_WRONG", problem))
            checked += 1
        chained = _chain(std, recorder, findings)
        findings.append(
            (
                "SUPPORTED",
                f"{len(names)} names ({std.family if hasattr(std, 'family') else 'map'}): "
                f"{checked} equal to raw hooks' or a raw function mode's values, "
                f"{via_attention} to the raw kernel call's, "
                f"{chained} block boundaries chained" + _unchecked(unchecked, subject),
            )
        )
    if std is None:
        return
    for reason, missing in _grouped(dict(std.missing)).items():
        with subject.check("std names", _short(missing)) as findings:
            findings.append(("REFUSED", reason))


def _parse(read: str) -> Any:
    """A std name's read selector as a site: ``"h.0"`` (a whole module) is its output."""
    return Site.parse(read if ":" in read else f"{read}:output")


def _op_references(subject: Subject, sites: list[Any]) -> dict[str, OpRecorder]:
    """Raw function modes on the modules whose names are op sites (a residual add inside a
    block's code), in a forward of their own; none where two forwards differ."""
    modules = sorted({site.module for site in sites if site.op})
    if not modules or subject.unsteady:
        return {}
    return reference_ops(subject, modules)


def _expert_problem(name: str, parsed: Site, cache: Any, subject: Subject) -> str | None:
    """``""`` when an expert name equals the experts check's float64 reference, the problem
    otherwise, None where there is none (the experts check did not run)."""
    reference = subject.experts.get(parsed.module)
    if reference is None or parsed.call != 0:
        return None
    kind, expert = split_op_label(parsed.op)
    want = reference.get((kind.removeprefix("expert."), expert))
    if want is None:
        return None
    try:
        got = cache[f"std:{name}"]
    except HookscopeError as error:
        return f"std:{name}: {error.args[0]}"
    good = same(got, want) if kind == "expert.tokens" else close(got, want)
    return "" if good else f"std:{name} is not the float64 reference of {parsed}"


def _ssm_problem(name: str, parsed: Site, cache: Any, subject: Subject) -> str | None:
    """``""`` when a mixer's name equals the state-space check's float64 reference, the problem
    otherwise, None where there is none."""
    reference = subject.ssm.get(parsed.module)
    kind = split_op_label(parsed.op)[0].removeprefix("ssm.")
    if reference is None or parsed.call != 0 or kind not in reference:
        return None
    try:
        got = cache[f"std:{name}"]
    except HookscopeError as error:
        return f"std:{name}: {error.args[0]}"
    want = reference[kind]
    want = want.reshape(got.shape) if want.numel() == got.numel() else want
    return "" if close(got, want, rtol=1e-4, atol=1e-5) else f"std:{name} is not the float64 recurrence's {parsed}"


def _compare(
    name: str, site: Any, cache: Any, recorder: RawRecorder, ops: dict[str, OpRecorder], subject: Subject
) -> str | None:
    """The problem with ``std:name``'s value, ``""`` for none, None where no reference exists."""
    parsed = _parse(site.read)
    if parsed.op.startswith("expert."):
        return _expert_problem(name, parsed, cache, subject)
    if parsed.op.startswith("ssm."):
        return _ssm_problem(name, parsed, cache, subject)
    if parsed.op:
        if parsed.module not in ops or parsed.what != "output":
            return None
        want = ops[parsed.module].value(parsed.call, parsed.op, parsed.path)
        if want is None:
            return f"std:{name}: the module's code made no {parsed.op} (raw function mode)"
    else:
        record = recorder.record(parsed.module, parsed.call)
        if record is None:
            return f"std:{name}: {parsed.module} did not run"
        values = record.inputs if parsed.what == "input" else record.outputs
        if site.kind == "module":  # a whole block: every tensor it returned, under the block's name
            for path, value in values.items():
                kept = cache.get(Site(parsed.module, parsed.call, "output", path))
                if kept is None or not same(kept, value):
                    return f"std:{name}: {site.read}:output{path} is not the raw value"
            if len(values) != 1:  # several tensors: the name alone is refused, naming them
                return ""
            want = next(iter(values.values()))
        else:
            found = values.get(parsed.path)
            if found is None:
                return f"std:{name}: raw hooks saw no tensor at {site.read}"
            want = found
    try:
        got = cache[f"std:{name}"]
    except HookscopeError as error:
        return f"std:{name}: {error.args[0]}"
    return "" if same(got, want) else f"std:{name} is not the raw value at {site.read}"


def _attention_problem(name: str, site: Any, cache: Any, subject: Subject) -> str | None:
    """``""`` when the sub-site name equals the attention check's kernel reference, the problem
    otherwise, None where there is no reference (the attention check did not run)."""
    module, _, part = site.read.partition(":attn.")
    part, _, index = part.partition("#")
    module, _, call = module.partition("#")
    calls = subject.kernels.get(module, [])
    kernels = calls[int(call or 0)] if int(call or 0) < len(calls) else []
    if int(index or 0) >= len(kernels):
        return None
    try:
        got = cache[f"std:{name}"]
    except HookscopeError as error:
        return f"std:{name}: {error.args[0]}"
    return (
        f"std:{name} is not the kernel call's {part}"
        if sub_site_problem(part, got, kernels[int(index or 0)][part])
        else ""
    )


def _chain(std: Any, recorder: RawRecorder, findings: list[Any]) -> int:
    chained = 0
    for prefix in sorted({n.rsplit("blocks.", 1)[0] for n in std if re.search(r"(^|\.)blocks\.\d+\.resid_post$", n)}):
        index = 0
        while f"{prefix}blocks.{index + 1}.resid_pre" in std and f"{prefix}blocks.{index}.resid_post" in std:
            post, pre = std[f"{prefix}blocks.{index}.resid_post"], std[f"{prefix}blocks.{index + 1}.resid_pre"]
            a, b = _raw(post.read, recorder), _raw(pre.read, recorder)
            if a is not None and b is not None:
                chained += 1
                if not same(a, b):
                    findings.append(
                        (
                            "SILENTLY_WRONG",
                            f"{prefix}blocks.{index}.resid_post is not "
                            f"{prefix}blocks.{index + 1}.resid_pre (raw values at {post.read}, {pre.read})",
                        )
                    )
            index += 1
    return chained


def _unchecked(names: list[str], subject: Subject) -> str:
    if not names:
        return ""
    why = subject.unsteady or "no reference without hookscope for these sites"
    return f"; {len(names)} not checked ({_short(names)}: {why})"


def _raw(read: str, recorder: RawRecorder) -> Any:
    parsed = _parse(read)
    if parsed.op:
        return None
    record = recorder.record(parsed.module, parsed.call)
    if record is None:
        return None
    values = record.inputs if parsed.what == "input" else record.outputs
    return values.get(parsed.path) if parsed.path else next(iter(values.values()), None)


def _grouped(missing: dict[str, str]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for name, reason in missing.items():
        groups.setdefault(reason, []).append(name)
    return groups


def _short(names: list[str]) -> str:
    """``blocks.*.cross_attn.*`` for a list of numbered names: the patterns, deduplicated."""
    patterns = list(dict.fromkeys(re.sub(r"\.\d+(\.|$)", r".*\1", name) for name in names))
    return ", ".join(patterns[:4]) + (f" (+{len(patterns) - 4})" if len(patterns) > 4 else "")
