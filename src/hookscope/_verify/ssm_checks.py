"""State-space mixers, checked: every value the tap reads against the recurrence run token by
token in float64, and an edit of the decay against the same edit made by hand.

The reference needs no hookscope: the mixer's input as the clean forward's raw pre-hook saw it
(its padding mask, if the block passed one), the mixer's weights, and the Mamba or Mamba-2
equations written out: the input projection, the causal convolution, the time step and decay,
the state ``h[t] = decay[t] h[t-1] + dt[t] x[t] B[t]``, ``y[t] = h[t] C[t] + D x[t]``, the
gate, and for Mamba-2 the matrix ``pattern[t, s] = C[t]·B[s] Π decay(s, t]``. The edit: the
decay halved through ``hs.edit`` against a raw forward hook returning the reference's output
with the decay halved.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional

from hookscope._arch.ssm import MAMBA1_KINDS, flavour
from hookscope._capture import capture
from hookscope._core.names import escape_name
from hookscope._core.op_sites import SSM_KINDS
from hookscope._edit import edit
from hookscope._verify.reference import close
from hookscope._verify.subject import Subject, output_leaves
from hookscope.edits import scale

__all__ = ["check_ssm", "ssm_reference"]


def ssm_reference(module: nn.Module, hidden: torch.Tensor, mask: Any, factor: float = 1.0) -> dict[str, torch.Tensor]:
    """The mixer's values in float64 (``state`` per token along dim 1) and its ``output``, with
    the decay times ``factor``."""
    m: Any = module
    h = hidden.double() if mask is None else hidden.double() * mask[:, :, None].double()
    projected = h @ m.in_proj.weight.double().T
    if m.in_proj.bias is not None:
        projected = projected + m.in_proj.bias.double()
    two = flavour(module) == "mamba2"
    inner = int(m.num_heads * m.head_dim) if two else int(m.intermediate_size)
    heads = int(m.num_heads) if two else 0
    if two:
        z, branch, dt_raw = torch.split(projected, [inner, projected.shape[-1] - inner - heads, heads], dim=-1)
    else:
        branch, z = projected.chunk(2, dim=-1)
    seq = h.shape[1]
    bias = m.conv1d.bias.double() if m.conv1d.bias is not None else None
    conv = functional.conv1d(
        branch.transpose(1, 2), m.conv1d.weight.double(), bias, padding=m.conv1d.kernel_size[0] - 1,
        groups=branch.shape[-1],
    )[..., :seq]  # fmt: skip
    conv = functional.silu(conv).transpose(1, 2)
    if mask is not None:
        conv = conv * mask[:, :, None].double()
    found = {"z": z, "conv": conv}
    found.update(_mamba2(m, conv, dt_raw, factor) if two else _mamba(m, conv, factor))
    y = found["y"]
    if two:
        gated = y * functional.silu(z)
        grouped = gated.reshape(*gated.shape[:2], int(m.n_groups), -1)
        normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + m.norm.variance_epsilon)
        out = m.norm.weight.double() * normed.reshape(gated.shape)
    else:
        out = y * functional.silu(z)
    found["out"] = out
    output = out @ m.out_proj.weight.double().T
    found["output"] = output + m.out_proj.bias.double() if m.out_proj.bias is not None else output
    return found


def _mamba2(m: Any, conv: torch.Tensor, dt_raw: torch.Tensor, factor: float) -> dict[str, torch.Tensor]:
    heads, head_dim, groups, n = int(m.num_heads), int(m.head_dim), int(m.n_groups), int(m.ssm_state_size)
    x, b, c = torch.split(conv, [heads * head_dim, groups * n, groups * n], dim=-1)
    x = x.reshape(*x.shape[:2], heads, head_dim)
    b, c = b.reshape(*b.shape[:2], groups, n), c.reshape(*c.shape[:2], groups, n)
    b_heads, c_heads = b.repeat_interleave(heads // groups, dim=2), c.repeat_interleave(heads // groups, dim=2)
    limit = getattr(m, "time_step_limit", (0.0, float("inf")))
    dt = functional.softplus(dt_raw + m.dt_bias.double()).clamp(min=limit[0], max=limit[1])
    decay = torch.exp(-torch.exp(m.A_log.double()) * dt) * factor
    state = torch.zeros(x.shape[0], heads, head_dim, n, dtype=torch.float64)
    states, ys = [], []
    seq = x.shape[1]
    for t in range(seq):
        state = (
            decay[:, t, :, None, None] * state + (dt[:, t, :, None] * x[:, t])[..., None] * b_heads[:, t, :, None, :]
        )
        states.append(state)
        ys.append(torch.einsum("bhpn,bhn->bhp", state, c_heads[:, t]) + m.D.double()[:, None] * x[:, t])
    pattern = torch.zeros(x.shape[0], heads, seq, seq, dtype=torch.float64)
    for t in range(seq):
        for s in range(t + 1):
            pattern[:, :, t, s] = (c_heads[:, t] * b_heads[:, s]).sum(-1) * decay[:, s + 1 : t + 1].prod(dim=1)
    y = torch.stack(ys, dim=1).reshape(x.shape[0], seq, -1)
    return {
        "x": x,
        "B": b,
        "C": c,
        "dt": dt,
        "decay": decay,
        "pattern": pattern,
        "state": torch.stack(states, 1),
        "y": y,
    }


def _mamba(m: Any, x: torch.Tensor, factor: float) -> dict[str, torch.Tensor]:
    rank, n = int(m.time_step_rank), int(m.ssm_state_size)
    step, b, c = torch.split(x @ m.x_proj.weight.double().T, [rank, n, n], dim=-1)
    if all(hasattr(m, name) for name in ("dt_layernorm", "b_layernorm", "c_layernorm")):  # Jamba's RMS norms
        step, b, c = (
            _rms(norm, value) for norm, value in ((m.dt_layernorm, step), (m.b_layernorm, b), (m.c_layernorm, c))
        )
    dt = functional.softplus(step @ m.dt_proj.weight.double().T + m.dt_proj.bias.double())
    decay = torch.exp(-torch.exp(m.A_log.double())[None, None] * dt[..., None]) * factor
    state = torch.zeros(x.shape[0], x.shape[-1], n, dtype=torch.float64)
    states, ys = [], []
    for t in range(x.shape[1]):
        state = decay[:, t] * state + (dt[:, t, :, None] * b[:, t, None, :]) * x[:, t, :, None]
        states.append(state)
        ys.append((state @ c[:, t, :, None]).squeeze(-1))
    y = torch.stack(ys, dim=1) + m.D.double() * x
    return {"x": x, "B": b, "C": c, "dt": dt, "decay": decay, "state": torch.stack(states, 1), "y": y}


def _rms(norm: Any, value: torch.Tensor) -> torch.Tensor:
    """An RMS norm in float64: ``weight * x / sqrt(mean(x^2) + eps)``."""
    scale = torch.sqrt(value.pow(2).mean(-1, keepdim=True) + float(norm.variance_epsilon))
    normed: torch.Tensor = norm.weight.detach().double() * (value / scale)
    return normed


def _mixers(subject: Subject) -> list[str]:
    return [name for name in subject.ran if flavour(subject.model.get_submodule(name)) is not None]


def _inputs(subject: Subject, name: str) -> tuple[torch.Tensor, Any] | None:
    record = subject.reference.record(name) if subject.reference else None
    hidden = None if record is None else record.inputs.get("[0]", record.inputs.get("['hidden_states']"))
    if record is None or hidden is None:
        return None
    return hidden, record.inputs.get("['attention_mask']", record.inputs.get("[2]"))


def check_ssm(subject: Subject) -> None:
    """One row for every value of every Mamba mixer, one for an edit of one mixer's decay."""
    names = _mixers(subject)
    if not names:
        return  # no state-space mixer: nothing to say
    with subject.check("state-space mixers", f"{len(names)} mixers") as findings:
        if subject.unsteady:
            findings.append(("REFUSED", subject.unsteady))
            return
        kinds = {name: _kinds(subject, name) for name in names}
        selectors = [f"{escape_name(n)}:ssm.{kind}" for n in names for kind in kinds[n]] + [
            f"{escape_name(n)}:ssm.state" for n in names
        ]
        with capture(subject.model, layers=selectors) as cap:
            subject.run()
        compared = 0
        for name in names:
            given = _inputs(subject, name)
            if given is None:
                continue
            want = ssm_reference(subject.model.get_submodule(name), *given)
            subject.ssm[name] = want
            for kind in kinds[name]:
                got = cap.cache[f"{escape_name(name)}#0:ssm.{kind}#0"]
                expected = want[kind].reshape(got.shape) if want[kind].numel() == got.numel() else want[kind]
                if not close(got, expected, rtol=1e-4, atol=1e-5):
                    findings.append(("SILENTLY_WRONG", f"{name}:ssm.{kind} is not the float64 recurrence's"))
                compared += 1
            for t in range(want["state"].shape[1]):
                if not close(cap.cache[f"{escape_name(name)}#0:ssm.state#{t}"], want["state"][:, t], atol=1e-5):
                    findings.append(("SILENTLY_WRONG", f"{name}:ssm.state#{t} is not the float64 recurrence's"))
                compared += 1
        findings.append(("SUPPORTED", f"{compared} values equal to the float64 recurrence from the mixers' weights"))
    chosen = names[len(names) // 2]
    with subject.check("edit state-space", chosen) as findings:
        given = _inputs(subject, chosen)
        record = subject.reference.record(chosen) if subject.reference else None
        if given is None or record is None or chosen not in subject.ssm:
            findings.append(("REFUSED", "the values check did not run on this mixer"))
            return
        module = subject.model.get_submodule(chosen)
        clean = next(iter(record.outputs.values()), None)
        if clean is None or not close(clean, subject.ssm[chosen]["output"], rtol=1e-4, atol=1e-5):
            findings.append(("REFUSED", "the float64 recurrence does not give this mixer's output: no reference edit"))
            return
        replaced = ssm_reference(module, *given, factor=0.5)["output"]
        handle = module.register_forward_hook(lambda _, __, output: replaced.to(output.dtype))
        try:
            reference = output_leaves(subject.run())
        finally:
            handle.remove()
        with edit(subject.model, {f"{escape_name(chosen)}:ssm.decay": scale(0.5)}):
            edited = output_leaves(subject.run())
        differs = [
            path for path, value in reference.items() if path not in edited or not close(edited[path], value, atol=1e-4)
        ]
        if differs:
            findings.append(("SILENTLY_WRONG", f"the decay halved: output{differs[0]} is not the reference's"))
            return
        findings.append(
            ("SUPPORTED", "the decay halved: the output equals a raw hook's float64 recurrence, within rounding")
        )


def _kinds(subject: Subject, name: str) -> list[str]:
    two = flavour(subject.model.get_submodule(name)) == "mamba2"
    return [kind for kind in SSM_KINDS if kind != "state" and (two or kind in MAMBA1_KINDS)]
