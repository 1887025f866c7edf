"""The readings of a detected block: its norms placed by where their values flow.

Names cannot say which side of a sublayer a norm sits on: Llama's ``post_attention_layernorm``
feeds the MLP, OLMo 2's and EXAONE 4's normalize what attention adds, HyperCLOVA X registers its
four norms in neither order. The check forward shows it: a norm whose output is the attention
module's input is ``ln1``, one whose input is attention's output is what attention adds
(``attn_out``), and the same for the MLP and a decoder's cross-attention. Nor can names say
whether an MLP returns what it adds or the sum (MPT's MLP adds the residual itself; then what
it adds is its output projection's output).

Each reading is only a proposal: the resolver checks every one against the residual identities
and keeps the one that places the most names, so a placement that does not hold is never a
name.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from hookscope._arch.std.locate import _BlockPlan, _StackPlan
from hookscope._arch.std.observe import Seen, values_close
from hookscope._arch.std.spec import Family, Stack

__all__ = ["readings", "same_values", "scale_of", "scaled_add"]


def readings(family: Family, plans: list[_StackPlan], seen: Seen) -> list[Family]:
    """``family`` as the detector proposed it, then with its norms placed by the values of each
    stack's first block, then each with every MLP's ``mlp_out`` at its output projection;
    without repeats. A table (not detected) has one reading: itself."""
    if not family.detected:
        return [family]
    placed = replace(family, stacks=tuple(_placed(s, p, seen) for s, p in zip(family.stacks, plans, strict=True)))
    found: list[Family] = []
    for reading in (family, placed):
        for candidate in (reading, _mlp_at_projection(reading)):
            if candidate not in found:
                found.append(candidate)
    return found


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """One value seen at two places, maybe reshaped on the way (an MLP run on rows)."""
    if a.numel() != b.numel():
        return False
    return a.dtype == b.dtype and values_close(a.reshape(-1), b.reshape(-1))


def _placed(stack: Stack, plan: _StackPlan, seen: Seen) -> Stack:
    """``stack`` with the norm roles of its blocks where block 0's values put them; unchanged
    where no norm feeds or follows a sublayer (post-norm blocks: their norms read sums)."""
    if not plan.blocks or not plan.blocks[0].norms:
        return stack
    block = plan.blocks[0]
    roles = block.roles

    def rel(name: str | None) -> str | None:
        return name[len(block.name) + 1 :] if name else None

    ln1, attn_out = _feeds(block, seen, roles["attn"]), _follows(block, seen, roles["attn"])
    ln_cross, cross_out = _feeds(block, seen, roles["cross_attn"]), _follows(block, seen, roles["cross_attn"])
    ln2, mlp_out = _feeds(block, seen, roles["mlp"] or roles["mlp_in"]), _follows(block, seen, roles["mlp"])
    if not any((ln1, attn_out, ln_cross, cross_out, ln2, mlp_out)):
        return stack
    moved = replace(
        stack.block,
        ln1=rel(ln1),
        attn_out=rel(attn_out),
        ln_cross=rel(ln_cross),
        cross_attn_out=rel(cross_out),
        ln2=rel(ln2),
        mlp_out=rel(mlp_out) if mlp_out else stack.block.mlp_out,  # an MLP of loose layers: its last one
    )
    return replace(stack, block=moved)


def _feeds(block: _BlockPlan, seen: Seen, module: str | None) -> str | None:
    """The norm whose output is ``module``'s input."""
    if module is None or not seen.has_input(module):
        return None
    taken = seen.input(module)
    return next((n for n in block.norms if seen.has_output(n) and same_values(seen.output(n), taken)), None)


def _follows(block: _BlockPlan, seen: Seen, module: str | None) -> str | None:
    """The norm whose input is ``module``'s output."""
    if module is None or not seen.has_output(module):
        return None
    given = seen.output(module)
    return next((n for n in block.norms if seen.has_input(n) and same_values(seen.input(n), given)), None)


def _mlp_at_projection(family: Family) -> Family:
    """``family`` with what each MLP adds read at its output projection (an MLP that returns
    the sum, MPT's); the same family where that is already so or there is no projection."""

    def moved(stack: Stack) -> Stack:
        block = stack.block
        if block.mlp_proj is None or block.mlp_out is not None:
            return stack
        return replace(stack, block=replace(block, mlp_out=block.mlp_proj))

    return replace(family, stacks=tuple(moved(s) for s in family.stacks))


def scale_of(delta: torch.Tensor, added: torch.Tensor) -> torch.Tensor | None:
    """The per-channel ``gamma`` with ``delta == gamma * added`` (a layer scale: BEiT, CaiT), or
    None. Fitted by least squares over every position, then checked: with the check forward's
    many positions per channel, a value that is not such a multiple does not fit."""
    if delta.shape != added.shape or delta.dim() < 2 or delta.numel() // delta.shape[-1] < 2:
        return None
    d = delta.double().reshape(-1, delta.shape[-1])
    a = added.double().reshape(-1, added.shape[-1])
    gamma = (d * a).sum(0) / (a * a).sum(0).clamp_min(torch.finfo(torch.float64).tiny)
    return gamma if values_close(a * gamma, d) and values_close(d, a * gamma) else None


def scaled_add(seen: Seen, block: str, before: torch.Tensor, added: torch.Tensor) -> str | None:
    """The first op of ``block``'s own code whose value is ``before + gamma * added``."""
    for label, value in seen.ops(block):
        if value.shape == before.shape and scale_of(value - before, added) is not None:
            return label
    return None
