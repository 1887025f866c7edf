"""Turn a family table into a checked :class:`~hookscope._core.std_names.StdMap` on one model.

Three steps, one screen each: :func:`~hookscope._arch.std.locate._plan` finds every role's module
on the model (a role whose module is absent becomes a missing name with the reason);
:func:`~hookscope._arch.std.observe.observe` runs one forward with hooks on those modules;
:func:`_resolve` names each canonical site in hookscope's site grammar and checks the values
against each other, so a table that no longer fits the model is a clear
:class:`~hookscope.errors.StdMapError`, never silently wrong names.

The checks (``rtol`` 1e-4 relative to the values' scale; the shapes exactly):
every ``resid_*`` is ``(batch, seq, d_model)``; ``resid_post[i]`` is ``resid_pre[i+1]``;
in a sequential block ``resid_mid == resid_pre + attn`` and ``resid_post == resid_mid + mlp``
(with ``resid_mid_cross`` between them in a decoder); in a parallel block
``resid_post == resid_pre + attn + mlp``; after a post-norm sublayer the norm's input is the sum.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from hookscope._arch.eager_advice import merged_heads, refuses_sdpa
from hookscope._arch.std.attn_sites import ATTN_SUBS, attention_subs
from hookscope._arch.std.locate import _BlockPlan, _find, _modules_of, _plan, _StackPlan
from hookscope._arch.std.observe import Seen, observe, values_close
from hookscope._arch.std.place import readings, same_values, scale_of, scaled_add
from hookscope._arch.std.shared import SHARED_BLOCK, shared_block_error
from hookscope._arch.std.spec import Block, Family, Layout
from hookscope._arch.std.sublayer_sites import expert_sites, mixer_subs
from hookscope._core.names import escape_name, named_modules
from hookscope._core.op_sites import SSM_KINDS
from hookscope._core.std_names import StdMap, StdSite
from hookscope.errors import StdMapError

__all__ = ["ATTN_SUBS", "resolve_family"]


def resolve_family(
    model: nn.Module,
    family: Family,
    inputs: tuple[tuple[object, ...], dict[str, object]],
    *,
    layouts: Sequence[Layout] = (),
) -> StdMap:
    """The checked canonical map of ``model`` by ``family``'s table, from one forward on ``inputs``.

    ``layouts``: read the blocks each of these ways instead of as the table says (the structural
    detector cannot tell pre-norm from post-norm by names) and keep the reading that places the
    most names; the one forward serves every reading.
    """
    by_name = dict(named_modules(model))
    names = set(by_name)
    name_of = {id(module): name for name, module in by_name.items()}
    stacks = [_plan(by_name, name_of, family, stack) for stack in family.stacks]
    unembed = _find(names, "", family.unembed)
    projector = _find(names, "", family.projector)
    watched_blocks = [b.core for s in stacks for b in s.blocks if b.roles["resid_mid"] is None]
    attention = [m for s in stacks for b in s.blocks for m in (b.roles["attn"], b.roles["cross_attn"]) if m]
    modules = {m for s in stacks for m in _modules_of(s)} | {m for m in (unembed, projector) if m}
    seen = observe(model, sorted(modules), watched_blocks, attention, inputs)
    seen.refuses_sdpa = refuses_sdpa(model)
    seen.merged_heads = {name: merged_heads(model, name, by_name[name]) for name in attention}
    maps: list[StdMap] = []
    failure: StdMapError | None = None
    chosen: Sequence[Layout | None] = layouts or [None]
    for reading in readings(family, stacks, seen):  # a detected block's norms placed by values
        planned = stacks if reading is family else [_plan(by_name, name_of, reading, s) for s in reading.stacks]
        for layout in chosen:
            try:
                maps.append(_resolve(reading, planned, unembed, seen, layout))
            except StdMapError as error:
                failure = failure or error  # the first reading's: the detector's own proposal
    if not maps and family.detected and failure is not None and failure.check != SHARED_BLOCK:
        for reading in readings(family, stacks, seen):  # what the sublayers add is not a module's output
            planned = [_plan(by_name, name_of, reading, s) for s in reading.stacks]
            try:
                maps.append(_resolve(reading, planned, unembed, seen, "pre", sums=False))
            except StdMapError:
                continue
    if not maps:
        assert failure is not None
        raise failure
    return max(maps, key=len)


def _resolve(
    family: Family,
    stacks: list[_StackPlan],
    unembed: str | None,
    seen: Seen,
    layout: Layout | None,
    *,
    sums: bool = True,
) -> StdMap:
    sites: dict[str, StdSite] = {}
    missing: dict[str, str] = {}
    checks: list[str] = []
    for stack in stacks:
        _StackResolver(family, stack, seen, sites, missing, checks, layout, sums).run()
    _projector_sites(family, sites, missing, seen)
    if unembed and seen.ran(unembed):
        sites["unembed"] = seen.site("unembed", unembed, "output")
    else:
        missing["unembed"] = (
            f"the model has no head ({family.unembed!r} is not in it): build the model with its language-model head"
            if family.unembed and not family.detected
            else "the structural detector found no linear head as wide as the vocabulary"
            if family.detected
            else f"{family.name} has no unembedding"
        )
    return StdMap(family.name, sites, missing, tuple(checks))


def _projector_sites(family: Family, sites: dict[str, StdSite], missing: dict[str, str], seen: Seen) -> None:
    """``projector.in`` (the vision tower's tokens as the projector takes them) and ``projector``
    (the image tokens in the language model's width) of a vision-language model."""
    if not family.vision_language:
        return
    module = family.projector
    if module is None or not seen.ran(module):
        why = (
            "no projector module (named multi_modal_projector, connector, merger or projector) outside the blocks"
            if module is None
            else "the projector did not run in the check forward: give the map an image (hs.sample_input makes one)"
        )
        missing["projector"] = missing["projector.in"] = why
        return
    sites["projector.in"] = seen.site("projector.in", module, "input")
    sites["projector"] = seen.site("projector", module, "output")


class _StackResolver:
    """Names and checks one stack's canonical sites (see the module docstring for the checks)."""

    def __init__(
        self,
        family: Family,
        stack: _StackPlan,
        seen: Seen,
        sites: dict[str, StdSite],
        missing: dict[str, str],
        checks: list[str],
        layout: Layout | None,
        sums: bool = True,
    ) -> None:
        self.family, self.plan, self.seen = family, stack, seen
        #: False: name the stream and the norms only, where no reading's residual sums hold (a
        #: layer scale multiplies what attention adds in the block's own code: BEiT, CaiT).
        self.sums = sums
        self.sites, self.missing, self.checks = sites, missing, checks
        self.prefix = f"{stack.stack.prefix}." if stack.stack.prefix else ""
        self.block: Block = stack.stack.block
        self.layout: Layout = layout or self.block.layout

    def run(self) -> None:
        if self.prefix == "vision." and self.family.vision_language and not self.seen.ran(self.plan.blocks[0].name):
            self._not_run()
            return
        for role in ("embed", "pos_embed"):
            self._module_site(role, self.plan.around[role], "output", self.plan.why[role])
        width: torch.Size | None = None
        previous: torch.Tensor | None = None
        for index, block in enumerate(self.plan.blocks):
            if not self.seen.ran(block.name):
                raise self._error(f"block {block.name!r} did not run in the check forward", block.name)
            calls = self.seen.calls(block.name)
            if calls > 1:
                what = f"block {block.name!r} ran {calls} times in one forward"
                raise shared_block_error(self.family.name, what, block.name)
            for role in dict.fromkeys(m for m in block.roles.values() if m):  # a canonical name reads one call
                if (role_calls := self.seen.calls(role)) > 1:
                    what = f"the module {role!r} of block {block.name!r} ran {role_calls} times in one forward"
                    raise shared_block_error(self.family.name, what, role)
            pre, post = self.seen.input(block.name), self.seen.output(block.name)
            for label, value in (("resid_pre", pre), ("resid_post", post)):
                packed = value.dim() == 2 and self.plan.stack.prefix == "vision"  # Qwen2-VL: (patches, d_model)
                if (value.dim() != 3 and not packed) or (width is not None and value.shape != width):
                    raise self._error(
                        f"{label} of block {index} ({block.name!r}) has shape {tuple(value.shape)}, expected "
                        f"(batch, seq, d_model){' ' + str(tuple(width)) if width is not None else ''}"
                        + (" (a vision tower's blocks may take packed patches, (patches, d_model))" if packed else ""),
                        block.name,
                    )
                width = value.shape
            if previous is not None and not torch.equal(previous, pre):
                raise self._error(f"resid_post of block {index - 1} is not resid_pre of block {index}", block.name)
            previous = post
            self._block(index, block)
        self.checks.append(
            f"{self.prefix}blocks: every resid_* is (batch, seq, d_model); resid_post[i] == resid_pre[i+1]"
        )
        final = self.plan.around["ln_final"]
        if (
            self.family.detected
            and final is not None
            and previous is not None
            and self.seen.has_input(final)
            and not same_values(self.seen.input(final), previous)
        ):
            self.missing[self._name("ln_final")] = (  # a pooler's norm, not the stream's
                f"the norm after the blocks ({final!r}) does not read the last block's output (a pooler's norm?): "
                "select it by module name"
            )
            return
        self._module_site("ln_final", final, "output", self.plan.why["ln_final"])

    def _not_run(self) -> None:
        """A vision-language model's vision tower on a text-only input: its names are missing
        with the fix, the language model's are named as ever."""
        why = "the vision tower did not run in the check forward (a text-only input): give the map an image"
        for role in ("embed", "pos_embed", "ln_final"):
            self.missing[self._name(role)] = why
        for index, _ in enumerate(self.plan.blocks):
            for role in ("", ".resid_pre", ".resid_post"):
                self.missing[f"{self.prefix}blocks.{index}{role}"] = why

    def _name(self, role: str, index: int | None = None) -> str:
        return f"{self.prefix}blocks.{index}.{role}" if index is not None else f"{self.prefix}{role}"

    def _module_site(self, role: str, module: str | None, side: str, why: str, index: int | None = None) -> bool:
        name = self._name(role, index)
        if module is None:
            self.missing[name] = why
            return False
        if not self.seen.ran(module):
            self.missing[name] = "its module did not run in the check forward (its weights are used directly)"
            return False
        if (calls := self.seen.calls(module)) > 1:  # BLIP's post_layernorm also norms the pooled token
            self.missing[name] = (
                f"its module {module!r} ran {calls} times in one forward, and a canonical name reads one call: "
                f"select the call you mean by module name, e.g. '{module}#0'"
            )
            return False
        self.sites[name] = self.seen.site(name, module, side)
        return True

    def _block(self, index: int, block: _BlockPlan) -> None:
        roles, why = block.roles, block.why
        name = f"{self.prefix}blocks.{index}"
        self.sites[name] = StdSite(name, escape_name(block.name), escape_name(block.name), block.name, "module")
        self.sites[f"{name}.resid_pre"] = self.seen.site(f"{name}.resid_pre", block.name, "input")
        mixing = roles["mixer"] is not None and roles["attn"] is None  # a state-space block or a hybrid's
        first = "mixer" if mixing else "attn"
        what = "mixer" if mixing else "attention module"
        self._module_site("ln1", roles["ln1"], "output", why.get("ln1", self._no_norm(block, "attention")), index)
        self._feeding("ln1", index, roles["ln1"], roles[first], what)
        if mixing:
            self._module_site("mixer", roles["mixer"], "output", self._unfound("mixer"), index)
            mixer_subs(self.sites, self.missing, f"{name}.mixer", roles["mixer"], block.ssm)
            owner = "this block of a hybrid model" if self.block.attn is not None else "a state-space block"
            for sub in ("attn", *(f"attn.{s}" for s in ATTN_SUBS)):
                self.missing[f"{name}.{sub}"] = f"{owner} has a state-space mixer in place of attention"
            if roles["mlp"] is None and roles["mlp_in"] is None:  # Mamba: the mixer is the block's one sublayer
                self._single_add(index, block)
                return
        else:
            self._sublayer("attn", roles["attn_out"] or roles["attn"], why.get("attn", self._unfound("attn")), index)
            attention_subs(self.seen, self.sites, self.missing, f"{name}.attn", roles["attn"])
            if self.block.mixer is not None:  # a hybrid's attention block: the mixer's names are the others'
                for sub in ("mixer", *(f"mixer.{kind}" for kind in SSM_KINDS)):
                    self.missing[f"{name}.{sub}"] = "this block of a hybrid model has attention in place of a mixer"
        mid = self._residual_mid(index, block, first)
        before_mlp = self._cross(index, block, mid)
        self._module_site("ln2", roles["ln2"], "output", why.get("ln2", self._no_norm(block, "the MLP")), index)
        self._feeding("ln2", index, roles["ln2"], roles["mlp"] or roles["mlp_in"], "MLP")
        self._sublayer("mlp", roles["mlp_out"] or roles["mlp"], why.get("mlp", self._unfound("mlp")), index)
        self._mlp_parts(index, block)
        self.sites[f"{name}.resid_post"] = self.seen.site(f"{name}.resid_post", block.name, "output")
        summed = self._check_mlp(index, block, before_mlp)
        if self.family.detected:  # a name the detector placed by name only is not a name until a sum checks it
            added = f"{name}.resid_mid" in self.sites
            self._unchecked(f"{name}.attn", added or (summed and before_mlp is None and self.sums))
            self._unchecked(f"{name}.mlp", summed)

    def _single_add(self, index: int, block: _BlockPlan) -> None:
        """A block whose mixer is its one sublayer (Mamba): ``resid_post == resid_pre + mixer``."""
        name = f"{self.prefix}blocks.{index}"
        for role in ("resid_mid", "ln2", "mlp"):
            self.missing[f"{name}.{role}"] = "a state-space block adds its mixer alone: no MLP"
        self.sites[f"{name}.resid_post"] = self.seen.site(f"{name}.resid_post", block.name, "output")
        added = self._value(f"{name}.mixer")
        if added is None:
            raise self._error(f"no mixer output to add (block {index})", block.name)
        check = f"resid_post == resid_pre + mixer (block {index})"
        post = self.seen.output(block.name)
        summed = self._sum(check, block.name, self.seen.input(block.name).to(post.dtype), added.to(post.dtype))
        self._expect(post, summed, check, block.name)

    def _unchecked(self, name: str, checked: bool) -> None:
        if checked or name not in self.sites:
            return
        module = self.sites.pop(name).module
        self.missing[name] = (
            f"no residual sum of the block checks what {module!r} adds (the block adds it in another module or "
            f"changes it on the way), so the detector does not name it: read the module by name"
        )

    def _sublayer(self, role: str, module: str | None, why: str, index: int) -> None:
        """Name what a sublayer adds to the stream: its module's output, checked by the sums."""
        if self.sums or module is None:
            self._module_site(role, module, "output", why, index)
            return
        self.missing[self._name(role, index)] = (
            f"the block adds gamma * the output of {module!r} (a per-channel layer scale in its own code), not the "
            f"output itself: read the module by name, hs.capture(model, {module!r}), and scale it"
        )

    def _feeding(self, role: str, index: int, norm: str | None, reader: str | None, what: str) -> None:
        """A detected pre-norm ``role`` must be what its sublayer reads (its output the
        sublayer's input), else it is missing with the reason: the detector picks norms by
        class and order, which a renamed or re-ordered block can defeat. Post-norm norms read
        the sums the resolver checks already."""
        name = self._name(role, index)
        if not self.family.detected or self.layout == "post" or name not in self.sites or norm is None:
            return
        if reader is None or not self.seen.has_input(reader) or not self.seen.has_output(norm):
            return
        if not same_values(self.seen.output(norm), self.seen.input(reader)):
            del self.sites[name]
            self.missing[name] = (
                f"the structural detector's {role} ({norm!r}) is not what the {what} reads (its output is not the "
                f"{what}'s input): select the norm by module name"
            )
            return
        self._checked(f"{role}'s output is what its sublayer reads (detected blocks)")

    def _no_norm(self, block: _BlockPlan, what: str) -> str:
        """Why a block has no ``ln1`` (``ln2``): its norms sit after the sublayers, or it has one."""
        after = [block.roles[r] for r in ("attn_out", "mlp_out") if block.roles[r] in block.norms]
        if self.family.detected and after:
            return (
                f"this block's norms ({', '.join(map(repr, after))}) normalize what its sublayers add, after them "
                f"(OLMo 2 style): {what} reads the stream itself, resid_pre or resid_mid"
            )
        if self.family.detected:
            return (
                "the structural detector found one norm in a block (ln1): attention and the MLP read it, "
                "or its norms are not classes named *Norm*"
            )
        return f"{self.family.name} blocks: attention and the MLP read one norm (ln1)"

    def _unfound(self, role: str) -> str:
        """Why a role has no module: the table has none, or the detector could not place one."""
        if not self.family.detected:
            return f"{self.family.name} blocks have no {role} module"
        words = {"mlp": "mlp, ffn, feed_forward or experts", "attn": "attn or attention", "mixer": "mixer"}
        what = words.get(role, role)
        return f"the structural detector found no {role} module in a block (a class or attribute named {what})"

    def _residual_mid(self, index: int, block: _BlockPlan, first: str = "attn") -> torch.Tensor | None:
        """Name ``resid_mid`` and return its value, or None where it is not defined (``first``:
        the sublayer before it, attention or a hybrid block's mixer)."""
        name = f"{self.prefix}blocks.{index}.resid_mid"
        roles = block.roles
        if not self.sums:
            return self._scaled_mid(name, index, block)
        attn = self._value(f"{self.prefix}blocks.{index}.{first}")
        if attn is None:
            self.missing[name] = f"no {'mixer' if first == 'mixer' else 'attention'} output to add"
            return None
        mid = self._after_add(
            name, index, block, self.seen.input(block.name), attn, roles["resid_mid"], roles["ln1"],
            roles["ln_cross"] or roles["ln2"], f"resid_mid == resid_pre + {first}",
        )  # fmt: skip
        if mid is None:
            parallel = self.layout == "parallel"
            self.missing[name] = self.block.why_parallel if parallel else "no op of the block's own code returns it"
        return mid

    def _scaled_mid(self, name: str, index: int, block: _BlockPlan) -> torch.Tensor:
        """``resid_mid`` where the block adds a per-channel multiple of attention's output (a
        layer scale): the op of the block's code whose value is ``resid_pre + gamma * attn``."""
        attn = block.roles["attn_out"] or block.roles["attn"]
        pre = self.seen.input(block.name)
        op = (
            scaled_add(self.seen, block.core, pre, self.seen.output(attn))
            if attn and self.seen.has_output(attn)
            else None
        )
        if op is None:
            raise self._error(f"no op of the block adds attention's output, scaled or not (block {index})", block.name)
        self._checked("resid_mid == resid_pre + gamma * attn, gamma per channel (a layer scale)")
        self.sites[name] = self._op_site(name, block.core, op, block.roles["ln_cross"] or block.roles["ln2"])
        return self.seen.op_value(block.core, op)

    def _cross(self, index: int, block: _BlockPlan, mid: torch.Tensor | None) -> torch.Tensor | None:
        """Name a decoder block's cross-attention sites; return the stream entering the MLP."""
        name = f"{self.prefix}blocks.{index}"
        roles = block.roles
        if roles["cross_attn"] is None or not self.seen.ran(roles["cross_attn"]):
            why = (
                "no cross-attention (only decoders of encoder-decoder models have one)"
                if roles["cross_attn"] is None
                else "the cross-attention did not run in the check forward (a decoder run without encoder states)"
            )
            for role in ("ln_cross", "cross_attn", *(f"cross_attn.{s}" for s in ATTN_SUBS), "resid_mid_cross"):
                self.missing[f"{name}.{role}"] = why
            return mid  # the stream goes on to the MLP: the sums check it
        self._module_site("ln_cross", roles["ln_cross"], "output", "no cross-attention norm", index)
        self._feeding("ln_cross", index, roles["ln_cross"], roles["cross_attn"], "cross-attention module")
        self._sublayer("cross_attn", roles["cross_attn_out"] or roles["cross_attn"], "", index)
        attention_subs(self.seen, self.sites, self.missing, f"{name}.cross_attn", roles["cross_attn"])
        cross = self._value(f"{name}.cross_attn")
        full = f"{name}.resid_mid_cross"
        if mid is None or cross is None:
            self.missing[full] = "resid_mid is not defined"
            return None
        after = self._after_add(
            full, index, block, mid, cross, roles["resid_mid_cross"], roles["ln_cross"], roles["ln2"],
            "resid_mid_cross == resid_mid + cross_attn",
        )  # fmt: skip
        if after is None:
            raise self._error(f"no op of the block returns resid_mid + cross_attn (block {index})", block.name)
        return after

    def _after_add(
        self,
        name: str,
        index: int,
        block: _BlockPlan,
        before: torch.Tensor,
        added: torch.Tensor,
        module: str | None,
        norm: str | None,
        next_norm: str | None,
        check: str,
    ) -> torch.Tensor | None:
        """Name the stream after one sublayer's add and return its value (None: no add found).

        Where the add happens decides the site: inside a sublayer module (``module``: T5's
        sublayers, BLOOM's attention), its output; in a post-norm block, the sublayer's
        ``norm``, whose input is the sum; else an add in the block's own code, found by value.
        """
        expected = self._sum(f"{check} (block {index})", block.name, before, added)
        if module is not None or self.layout == "post":
            carrier = module if module is not None else norm
            if carrier is None:
                raise self._error(f"a post-norm block without a norm after the add ({check})", block.name)
            summed = self.seen.output(carrier) if module is not None else self.seen.input(carrier)
            self._expect(summed, expected, f"{check} (block {index})", block.name)
            self.sites[name] = self.seen.site(name, carrier, "output")
            return self.seen.output(carrier)
        op = self.seen.find_op(block.core, expected)
        if op is None:
            return None
        self._checked(f"{check} (an add in the block's own code)")
        self.sites[name] = self._op_site(name, block.core, op, next_norm)
        return self.seen.op_value(block.core, op)

    def _op_site(self, name: str, block: str, op: str, next_norm: str | None) -> StdSite:
        """A residual add inside the block's code: edited at the op; read at the next norm's
        input where that is the same value (a module boundary costs less than watching ops), as
        a ``"stream"`` site: read before the norm's other pre-hooks, so that one attached after
        the map (a user's, an input edit) changes what the norm takes, not what is read."""
        write = f"{escape_name(block)}:op[{op}]"
        value = self.seen.op_value(block, op)
        if next_norm is not None and self.seen.ran(next_norm) and torch.equal(self.seen.input(next_norm), value):
            read = self.seen.site(name, next_norm, "input")
            return StdSite(name, read.read, write, None, "stream")
        return StdSite(name, write, write, None, "op")

    def _mlp_parts(self, index: int, block: _BlockPlan) -> None:
        roles, why = block.roles, block.why
        moe = roles["router"] is not None or block.experts is not None
        fused = (
            "a mixture of experts has no one value before or after the activation: per expert, "
            "mlp.experts.{e}.pre and .post of the same block"
        )
        no_act = why.get("act", "no activation module in the MLP (a class named *Act*, GELU, ReLU, SiLU, Tanh)")
        no_proj = why.get("mlp_proj", "no output projection in the MLP (a Linear or Conv1D)")
        proj, out = roles["mlp_proj"], [m for m in (roles["mlp"], roles["mlp_out"]) if m and self.seen.has_output(m)]
        given = proj is not None and self.seen.has_output(proj)
        if self.family.detected and proj and given and not any(self._same_out(proj, m) for m in out):
            # the detector's last linear layer is not what the MLP returns: its act is a guess too
            no_act = no_proj = (
                f"the last linear layer the structural detector found in the MLP ({proj!r}) does not give the "
                "MLP's output: select the MLP's modules by name"
            )
            roles = {**roles, "act": None, "mlp_proj": None}
        self._module_site("mlp.pre", roles["act"], "input", fused if moe else no_act, index)
        self._module_site("mlp.post", roles["mlp_proj"], "input", fused if moe else no_proj, index)
        self._module_site("mlp.router", roles["router"], "output", "not a mixture of experts", index)
        expert_sites(self.sites, self.missing, self._name("mlp", index), block.experts, self.seen)

    def _same_out(self, a: str, b: str) -> bool:
        return same_values(self.seen.output(a), self.seen.output(b))

    def _check_mlp(self, index: int, block: _BlockPlan, before_mlp: torch.Tensor | None) -> bool:
        """Check the MLP's add: ``resid_post`` (or, post-norm, ln2's input) is ``before_mlp + mlp``;
        a parallel block (no stream between the sublayers) adds both to ``resid_pre``. False
        where there is no MLP to check."""
        post = self.seen.output(block.name)
        if not self.sums:
            out = block.roles["mlp_out"] or block.roles["mlp"]
            if before_mlp is None or out is None or not self.seen.has_output(out):
                raise self._error(f"no MLP output to add (block {index})", block.name)
            if scale_of(post - before_mlp, self.seen.output(out)) is None:
                raise self._error(f"resid_post is not resid_mid + gamma * mlp (block {index})", block.name)
            self._checked("resid_post == resid_mid + gamma * mlp, gamma per channel (a layer scale)")
            return True
        mlp = self._value(f"{self.prefix}blocks.{index}.mlp")
        if mlp is None:
            return False
        if mlp.shape != post.shape and mlp.numel() == post.numel():
            mlp = mlp.reshape(post.shape)  # an MLP run on (batch * seq, d) rows (OPT)
        if self.layout == "post":
            ln2 = block.roles["ln2"]
            if ln2 is None or before_mlp is None:
                raise self._error("a post-norm block without ln2", block.name)
            check = f"ln2's input is resid_mid + mlp (block {index})"
            self._expect(self.seen.input(ln2), self._sum(check, block.name, before_mlp, mlp), check, block.name)
            self._expect(self.seen.output(ln2), post, f"resid_post is ln2's output (block {index})", block.name)
        elif before_mlp is not None:
            check = f"resid_post == resid_mid + mlp (block {index})"
            self._expect(post, self._sum(check, block.name, before_mlp, mlp), check, block.name)
        else:
            attn = self._value(f"{self.prefix}blocks.{index}.attn")
            if attn is None:
                raise self._error("a block without attention", block.name)
            check = f"resid_post == resid_pre + attn + mlp (block {index}, parallel)"
            parallel = self._sum(check, block.name, self.seen.input(block.name), attn, mlp)
            self._expect(post, parallel, check, block.name)
        return True

    def _value(self, name: str) -> torch.Tensor | None:
        """The value of a site named for a module's output (``attn``, ``mlp``), if resolved."""
        site = self.sites.get(name)
        return None if site is None or site.module is None else self.seen.output(site.module)

    def _sum(self, check: str, block: str, *parts: torch.Tensor) -> torch.Tensor:
        """The sum a check compares against; parts of different shapes fail the check (a role
        that is not what the table or the detector took it for), never a raw broadcasting error."""
        shapes = [tuple(part.shape) for part in parts]
        if len(set(shapes)) > 1:
            raise self._error(f"check failed: {check}: the values have shapes {', '.join(map(str, shapes))}", block)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total

    def _expect(self, got: torch.Tensor, expected: torch.Tensor, check: str, block: str) -> None:
        if got.shape != expected.shape or not values_close(got, expected):
            raise self._error(f"check failed: {check}", block)
        self._checked(check.split(" (block")[0])

    def _checked(self, check: str) -> None:
        if check not in self.checks:
            self.checks.append(check)

    def _error(self, what: str, block: str) -> StdMapError:
        if self.family.detected:
            fix = (
                "the structural detector cannot read this architecture; select its modules by name instead "
                "(hs.layers(model) lists them)"
            )
        else:
            fix = (
                "the installed transformers may have changed the architecture's code: pass family=None to "
                "hs.std_map to use the structural detector, or report it"
            )
        return StdMapError(
            f"the {self.family.name} canonical map does not fit this model: {what} (at {block!r}); {fix}",
            family=self.family.name,
            check=what,
        )
