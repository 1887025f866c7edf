"""Find every role's module of a family table on one model: the first step of resolving a map.

Why a module of its own: finding modules by the table's paths reads only names (and refuses tied
or shared modules); :mod:`~hookscope._arch.std.resolve` then runs the forward and checks values.
A role whose module is absent becomes a missing name with the reason (``why``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from hookscope._arch.experts import fused_experts
from hookscope._arch.ssm import flavour
from hookscope._arch.std.shared import refuse_shared_role, refuse_tied, shared_stateless
from hookscope._arch.std.spec import Family, Stack
from hookscope.errors import StdMapError

__all__: list[str] = []


@dataclass
class _BlockPlan:
    """One block's modules, by role, as full module names (None: absent, with ``why``)."""

    name: str
    roles: dict[str, str | None]
    why: dict[str, str] = field(default_factory=dict)
    norms: list[str] = field(default_factory=list)  # the detector's norms, to be placed by values
    #: The block's fused mixture-of-experts module: its name, expert count and whether its
    #: experts have a gate (an ``up`` projection apart from ``pre``), or None.
    experts: tuple[str, int, bool] | None = None
    #: Which state-space mixer the block's ``mixer`` is (``"mamba2"``, ``"mamba"``), or None.
    ssm: str | None = None

    @property
    def core(self) -> str:
        """The module whose own code adds the residual: the block, or the module inside a
        wrapper that holds the attention (a re-nested copy)."""
        attn = self.roles["attn"]
        parent = attn.rpartition(".")[0] if attn else ""
        return parent if parent.startswith(self.name) else self.name


@dataclass
class _StackPlan:
    stack: Stack
    blocks: list[_BlockPlan]
    around: dict[str, str | None]  # embed, pos_embed, ln_final
    why: dict[str, str] = field(default_factory=dict)
    blocks_path: str = ""


_ROLE_FIELDS = (
    "ln1", "attn", "attn_out", "ln2", "mlp", "mlp_out", "mlp_in", "act", "mlp_proj", "router", "mixer",
    "cross_attn", "cross_attn_out", "ln_cross", "resid_mid", "resid_mid_cross",
)  # fmt: skip


def _find(names: set[str], prefix: str, path: str | None) -> str | None:
    """The first alternative of ``path`` (``"a|b"``) that is a module under ``prefix``."""
    if not path:
        return None
    for alternative in path.split("|"):
        full = f"{prefix}.{alternative}" if prefix else alternative
        if full in names:
            return full
    return None


def _block_list(names: set[str], family: Family, stack: Stack) -> tuple[str, str]:
    """The model's base below a task head (``transformer``, ``model``), where the table's paths
    start, and the block list's full name: the shortest name that ends in the table's path."""
    for alternative in stack.blocks.split("|"):
        found = sorted((n for n in names if n == alternative or n.endswith("." + alternative)), key=len)
        if found:
            return found[0][: -len(alternative)].rstrip("."), found[0]
    listed = ", ".join(repr(a) for a in stack.blocks.split("|"))
    raise StdMapError(
        f"the {family.name} table's block list {listed} is not in this model: the installed transformers may have "
        "renamed it; pass family=None to hs.std_map to use the structural detector",
        family=family.name,
    )


def _plan(by_name: dict[str, nn.Module], name_of: dict[int, str], family: Family, stack: Stack) -> _StackPlan:
    names = set(by_name)
    base, blocks_path = _block_list(names, family, stack)
    refuse_tied(by_name, family.name, blocks_path)
    paths = [path for role in _ROLE_FIELDS if (path := getattr(stack.block, role))]
    count = next(i for i in range(len(names) + 1) if f"{blocks_path}.{i}" not in names)
    in_list = [by_name[f"{blocks_path}.{i}"] for i in range(count)]
    stateless = {r for r in _ROLE_FIELDS if (p := getattr(stack.block, r)) and shared_stateless(in_list, p)}
    blocks = []
    index = 0
    while f"{blocks_path}.{index}" in names:
        block_name = f"{blocks_path}.{index}"
        refuse_shared_role(by_name[block_name], block_name, paths, name_of, family.name)
        roles = {role: _find(names, block_name, getattr(stack.block, role)) for role in _ROLE_FIELDS}
        why = {
            role: f"{family.name} blocks of this model have no {getattr(stack.block, role)!r} module"
            for role in _ROLE_FIELDS
            if getattr(stack.block, role) and roles[role] is None
        }
        for role in stateless:  # one module object without weights in every block: its calls are not per block
            roles[role] = None
            why[role] = f"one module object without weights ({getattr(stack.block, role)!r}) serves every block"
        core = ("ln1",) if roles["mixer"] is not None else ("ln1", "attn")  # a hybrid's block: attention or a mixer
        missing_core = [role for role in core if getattr(stack.block, role) and roles[role] is None]
        if missing_core and not family.detected:  # a table whose core roles are gone: renamed or re-nested
            raise StdMapError(
                f"the {family.name} table's {missing_core[0]} module {getattr(stack.block, missing_core[0])!r} is not "
                f"in block {block_name!r}",
                family=family.name,
                check=f"no {missing_core[0]}",
            )
        norms = [found for norm in stack.block.norms if (found := _find(names, block_name, norm))]
        ssm = _mixer_kind(by_name[roles["mixer"]]) if roles["mixer"] is not None else None
        blocks.append(_BlockPlan(block_name, roles, why, norms, _experts_of(by_name, block_name), ssm))
        index += 1
    around = {
        "embed": _find(names, base, stack.embed),
        "pos_embed": _find(names, base, stack.pos_embed),
        "ln_final": _find(names, base, stack.ln_final),
    }
    why = {
        "embed": stack.no_embed,
        "pos_embed": stack.no_pos_embed,
        "ln_final": "the structural detector found no norm after the last block"
        if family.detected
        else f"{family.name} has no norm after the last block (each post-norm block ends in its own)",
    }
    return _StackPlan(stack, blocks, around, why, blocks_path)


def _mixer_kind(module: nn.Module) -> str:
    """``"mamba2"``, ``"mamba"``, ``"variant"`` (a Mamba mixer with steps of its own) or
    ``"other"`` (a linear attention such as a gated delta net)."""
    found = flavour(module)
    if found is not None:
        return found
    mamba_like = all(hasattr(module, name) for name in ("A_log", "D", "conv1d", "in_proj", "out_proj"))
    return "variant" if mamba_like else "other"


def _experts_of(by_name: dict[str, nn.Module], block: str) -> tuple[str, int, bool] | None:
    """The first fused experts module inside ``block`` (:mod:`~hookscope._arch.experts`)."""
    for name, module in by_name.items():
        if name.startswith(f"{block}.") and fused_experts(module) is not None:
            count = getattr(module, "num_experts", None)
            if isinstance(count, int) and count > 0:
                return name, count, bool(getattr(module, "has_gate", True))
    return None


def _modules_of(stack: _StackPlan) -> list[str]:
    found = [m for m in stack.around.values() if m]
    for block in stack.blocks:
        found.append(block.name)
        found += [m for m in block.roles.values() if m]
        found += block.norms
        if block.experts is not None:
            found.append(block.experts[0])
    return found
