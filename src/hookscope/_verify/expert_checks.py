"""Experts, checked: every expert's rows read through the tap against a float64 reference
computed from the fused weights, and an expert ablated by an edit against the same ablation made
by a raw hook.

The reference needs no hookscope: the experts module's arguments ``(hidden_states, top_k_index,
top_k_weights)`` as the clean forward's raw pre-hooks saw them, and its 3-D weights. For expert
``e`` the rows are the tokens whose top-k choice holds ``e`` (in token order), ``in`` those
hidden states, the first projection ``in @ W[e].T`` (plus bias) split into the gate (``pre``) and
the linear half (``up``) as the module lays them out, ``post`` the module's own gate function of
it, ``out`` the down projection; ``tokens`` and ``weights`` the rows' tokens and routing weights.

The edit: ``zero`` at ``expert.out#e`` drops expert ``e``'s contribution, which a raw pre-hook
setting its routing weight to 0 does too; the outputs must agree bit for bit. The tapped output
without an edit must equal the clean one bit for bit where the model runs ``grouped_mm`` (the
arithmetic the tap reproduces), within rounding otherwise.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hookscope._arch.experts import experts_problem, fused_experts
from hookscope._capture import capture
from hookscope._core.names import escape_name
from hookscope._core.op_sites import EXPERT_KINDS
from hookscope._edit import edit
from hookscope._verify.reference import close, same
from hookscope._verify.subject import Subject, output_leaves
from hookscope.edits import zero

__all__ = ["check_experts", "expert_reference"]


def expert_reference(module: nn.Module, args: dict[str, torch.Tensor]) -> dict[tuple[str, int], torch.Tensor]:
    """Every ``(kind, expert)`` value of one call, in float64, from the call's raw arguments
    (``args``: the raw hook's inputs by path, ``"[0]"`` to ``"[2]"``) and the module's weights."""
    m: Any = module
    hidden, choice, weights = (args[f"[{i}]"] for i in range(3))
    hidden = hidden.double()
    gated, transposed, biased = bool(m.has_gate), bool(m.is_transposed), bool(m.has_bias)
    found: dict[tuple[str, int], torch.Tensor] = {}
    with torch.no_grad():
        for expert in range(int(m.num_experts)):
            token, slot = (choice == expert).nonzero(as_tuple=True)
            rows = hidden[token]
            first = (m.gate_up_proj if gated else m.up_proj)[expert].double()
            projected = rows @ first if transposed else rows @ first.T
            if biased:
                projected = projected + (m.gate_up_proj_bias if gated else m.up_proj_bias)[expert].double()
            if gated:
                half = projected.size(-1) // 2
                concatenated = bool(getattr(m, "is_concatenated", True))
                gate = projected[:, :half] if concatenated else projected[:, 0::2]
                found[("up", expert)] = projected[:, half:] if concatenated else projected[:, 1::2]
                post = m._apply_gate(projected)
            else:
                gate, post = projected, m.act_fn(projected)
            down = m.down_proj[expert].double()
            out = post @ down if transposed else post @ down.T
            if biased:
                out = out + m.down_proj_bias[expert].double()
            if getattr(m, "has_post_expert_norm", False):
                out = m.post_expert_norm(out.to(m.down_proj.dtype)).double()
            found.update(
                {
                    ("in", expert): rows,
                    ("pre", expert): gate,
                    ("post", expert): post,
                    ("out", expert): out,
                    ("tokens", expert): token,
                    ("weights", expert): weights[token, slot],
                }
            )
    return found


def check_experts(subject: Subject) -> None:
    """One row for every expert value of every fused experts module, one for an expert ablated."""
    names = [name for name in subject.ran if fused_experts(subject.model.get_submodule(name)) is not None]
    if not names:
        return  # no mixture of experts: nothing to say
    with subject.check("experts", f"{len(names)} fused experts modules") as findings:
        refused = {
            name: problem
            for name in names
            if (problem := experts_problem(subject.model.get_submodule(name), name, set())) is not None
        }
        for problem in dict.fromkeys(refused.values()):
            findings.append(("REFUSED", problem))
        names = [name for name in names if name not in refused]
        drifting = [name for name in names if name in subject.drifting]
        if subject.unsteady or drifting:
            findings.append(
                ("REFUSED", subject.unsteady or f"{', '.join(drifting)} compute something else per forward")
            )
            return
        if not names:
            return
        _compare_values(subject, names, findings)
    with subject.check("edit expert", names[len(names) // 2]) as findings:
        _compare_ablation(subject, names[len(names) // 2], findings)


def _compare_values(subject: Subject, names: list[str], findings: list[Any]) -> None:
    selectors = [f"{escape_name(name)}:expert.{kind}" for name in names for kind in _kinds(subject, name)]
    with capture(subject.model, layers=selectors) as cap:
        tapped = output_leaves(subject.run())
    compared = 0
    for name in names:
        module = subject.model.get_submodule(name)
        record = subject.reference.record(name) if subject.reference else None
        if record is None:
            continue
        want = expert_reference(module, record.inputs)
        subject.experts[name] = want
        for (kind, expert), value in want.items():
            got = cap.cache[f"{escape_name(name)}#0:expert.{kind}#{expert}"]
            good = same(got, value) if kind == "tokens" else close(got, value)
            if not good:
                findings.append(("SILENTLY_WRONG", f"{name}:expert.{kind}#{expert} is not the float64 reference's"))
            compared += 1
    grouped = all(_implementation(subject, name) == "grouped_mm" for name in names)
    equal = same if grouped else close
    moved = [path for path, value in tapped.items() if not equal(value, subject.clean_output.get(path, value))]
    if moved:
        how = "bit for bit" if grouped else "within rounding"
        findings.append(("SILENTLY_WRONG", f"the tapped model's output{moved[0]} differs from the clean one ({how})"))
    same_words = "bit for bit" if grouped else "within rounding (the model does not run grouped_mm)"
    findings.append(
        (
            "SUPPORTED",
            f"{compared} expert values equal to the float64 reference from the fused weights; the tapped output "
            f"equals the clean one {same_words}",
        )
    )


def _compare_ablation(subject: Subject, name: str, findings: list[Any]) -> None:
    module = subject.model.get_submodule(name)
    want = subject.experts.get(name, {})
    counts = {expert: value.size(0) for (kind, expert), value in want.items() if kind == "tokens"}
    if not counts:
        findings.append(("REFUSED", "the values check did not run"))
        return
    chosen = max(counts, key=lambda expert: counts[expert])

    def drop(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden, choice, weights, *rest = args
        return (hidden, choice, weights.masked_fill(choice == chosen, 0), *rest)

    handle = module.register_forward_pre_hook(drop)
    try:
        expected = output_leaves(subject.run())
    finally:
        handle.remove()
    with edit(subject.model, {f"{escape_name(name)}:expert.out#{chosen}": zero()}):
        got = output_leaves(subject.run())
    grouped = _implementation(subject, name) == "grouped_mm"
    equal = same if grouped else close
    differs = [path for path, value in expected.items() if path not in got or not equal(got[path], value)]
    if differs:
        findings.append(
            ("SILENTLY_WRONG", f"zero at expert.out#{chosen}: output{differs[0]} is not the raw hook's ablation")
        )
        return
    findings.append(
        (
            "SUPPORTED",
            f"zero at expert.out#{chosen} ({counts[chosen]} rows): the output equals a raw hook's routing weight 0, "
            + ("bit for bit" if grouped else "within rounding"),
        )
    )


def _kinds(subject: Subject, name: str) -> list[str]:
    gated = bool(getattr(subject.model.get_submodule(name), "has_gate", True))
    return [kind for kind in EXPERT_KINDS if gated or kind != "up"]


def _implementation(subject: Subject, name: str) -> str:
    config = getattr(subject.model.get_submodule(name), "config", None)
    return str(getattr(config, "_experts_implementation", ""))
