"""The op selectors of one feature's run: which op calls it wants, and the check that each one fired.

A capture given ``"h.0.attn:op[softmax#0]"`` keeps that op's output (and, with ``keep="both"``
or ``"input"``, its tensor arguments) through an :class:`~hookscope._core.ops.OpWatcher` on the
selector's modules; an edit replaces it; a trace makes a row of it. Each feature hands its own
``keep`` (and ``keep_attn``) to :meth:`OpSelectors.attach` and names its error type.

An attention sub-site selector (``"h.0.attn:attn.pattern"``, :mod:`~hookscope._capture.attn_sites`)
is an op selector of the module's ``scaled_dot_product_attention`` calls whose values are
computed from the call (:data:`AttnKeep`) instead of kept as the op's.

An op selector whose module ran in a pass but whose op never did is an error at the end of that
pass, naming the ops the module called: a misspelt op would otherwise match nothing, silently.
An attention sub-site on a module that never called the kernel (an eager-attention model) says
the fix: ``attn_implementation="sdpa"``, or the eager softmax's op site.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from hookscope._arch.attention import HeadCounts, head_counts
from hookscope._arch.eager_advice import merged_heads, refuses_sdpa
from hookscope._arch.experts import TAPS, experts_problem, tap_experts
from hookscope._arch.ssm import ssm_problem, tap_ssm
from hookscope._core.names import ROOT_LABEL, escape_name, module_label
from hookscope._core.op_sites import SDPA, OpPattern, indexed_family
from hookscope._core.ops import OpWatcher
from hookscope._core.select import select
from hookscope.errors import CaptureError, HookscopeError, SpecError

__all__ = ["AttnKeep", "OpKeep", "OpSelectors"]

#: Keeps one op call's values: ``(module, call, op label "softmax#0", args, kwargs, output)``;
#: returns what the model goes on with instead of the output, or None.
OpKeep = Callable[[str, int, str, tuple[Any, ...], dict[str, Any], Any], Any]
#: Keeps attention sub-sites of one kernel call: ``(module, call, kernel call index, kinds
#: ["pattern", ...], args, kwargs, output)``; returns what the model goes on with, or None.
AttnKeep = Callable[[str, int, int, list[str], tuple[Any, ...], dict[str, Any], Any], Any]


class OpSelectors:
    """The op selectors of a capture, the modules they watch, and which of them fired in a pass.

    Args:
        model: the captured model.
        patterns: the op selectors, parsed (:func:`~hookscope._core.op_sites.op_pattern`); a
            module part that names no module is the usual ``SelectionError``, raised here.
        owner: the ``hs.`` verb watching (named in errors and in ``hs.attached``).
        error: the error type raised for a selector that never fired (the feature's own).
    """

    def __init__(
        self,
        model: nn.Module,
        patterns: Sequence[OpPattern],
        *,
        owner: str = "capture",
        error: type[HookscopeError] = CaptureError,
    ) -> None:
        self.patterns = list(patterns)
        # transformers refuses attn_implementation="sdpa" for some models (Gemma 2): never advised then
        self._refuses_sdpa = refuses_sdpa(model)
        self._model = model  # read only for the advice of an error
        self._owner = owner
        self._error = error
        self._per_module: dict[str, list[tuple[int, OpPattern]]] = {}
        self._modules_of: dict[int, list[str]] = {}
        modules: dict[str, nn.Module] = {}
        self._heads: dict[str, HeadCounts] = {}  # attention modules with grouped heads, read once here
        for number, pattern in enumerate(self.patterns):
            module_selector = "" if pattern.module == ROOT_LABEL else pattern.module  # "(root):op[add]"
            for name, module in select(model, module_selector):
                if pattern.sub and isinstance(module, nn.MultiheadAttention):
                    raise SpecError(_multihead(pattern, name))
                self._per_module.setdefault(name, []).append((number, pattern))
                self._modules_of.setdefault(number, []).append(name)
                modules.setdefault(name, module)
                counts = head_counts(module) if pattern.sub else None
                if counts is not None:
                    self._heads[name] = counts
        #: ``(name, module)`` of every module an op selector watches, in selection order.
        self.modules = list(modules.items())
        self._experts = self._expert_taps(modules)
        self._ssm = self._ssm_taps(modules)
        self._untaps: list[Callable[[], None]] = []
        self._fired: set[int] = set()  # the patterns that matched an op call, this pass
        self._watcher: OpWatcher | None = None

    def attach(
        self,
        model: nn.Module,
        keep: OpKeep,
        want: Callable[[int], bool],
        keep_attn: AttnKeep,
        *,
        replays: Callable[[str], None] | None = None,
    ) -> OpWatcher:
        """Watch the modules' ops, handing each selected op call that ``want`` accepts to ``keep``
        (and the kernel calls of attention sub-sites to ``keep_attn``). ``replays``: also those of
        a checkpointed block recomputing in backward (an edit must change them again), after
        ``replays(module)`` is told of each such op, before any call filter (it may refuse)."""
        listener = self._listener(keep, want, keep_attn, replays)
        self._watcher = OpWatcher(model, self.modules, listener, owner=self._owner)
        by_name = dict(self.modules)
        try:
            for name, wanted in self._experts.items():
                self._untaps.append(tap_experts(by_name[name], wanted))
            for name, (kinds, wants) in self._ssm.items():
                self._untaps.append(tap_ssm(by_name[name], kinds, wants))
        except BaseException:
            self.remove()
            raise
        return self._watcher

    def _family(self, name: str, family: str, why_alone: str) -> list[OpPattern]:
        """The selectors of ``family``'s sub-sites (``"expert"``, ``"ssm"``) at module ``name``;
        any other op selector of that module beside them is refused (``why_alone``: why)."""
        chosen = [pattern for _, pattern in self._per_module[name]]
        found = [pattern for pattern in chosen if indexed_family(pattern.op) == family]
        others = [pattern for pattern in chosen if indexed_family(pattern.op) != family]
        if found and others:
            raise SpecError(
                f"{str(others[0])!r} and {str(found[0])!r} both select {module_label(name)!r}: {why_alone}; select "
                "them in separate runs"
            )
        return found

    def _ssm_taps(self, modules: dict[str, nn.Module]) -> dict[str, tuple[frozenset[str], Callable[[str, int], bool]]]:
        """The state-space sub-sites each mixer is selected for: their kinds and which positions
        of ``ssm.state``; a mixer hookscope cannot read, or an index on a value with one per
        call, is refused here."""
        taps: dict[str, tuple[frozenset[str], Callable[[str, int], bool]]] = {}
        for name, module in modules.items():
            why = (
                "an edit of its state-space values recomputes its output from its input, and its own ops are those "
                "of the forward without the edit"
            )
            chosen = self._family(name, "ssm", why)
            if not chosen:
                continue
            kinds = frozenset(pattern.op[len("ssm.") :] for pattern in chosen)
            problem = ssm_problem(module, name, set(kinds))
            if problem is not None:
                raise SpecError(f"state-space sub-site selector {str(chosen[0])!r}: {problem}")
            for pattern in chosen:
                if pattern.op != "ssm.state" and pattern.index not in (None, "0"):
                    raise SpecError(
                        f"{str(pattern)!r}: {pattern.op} is one value per mixer call, written #0; only ssm.state takes "
                        "a position (ssm.state#5: the recurrent state after token 5)"
                    )

            def wants(kind: str, index: int, chosen: list[OpPattern] = chosen) -> bool:
                return any(pattern.matches(f"ssm.{kind}", index) for pattern in chosen)

            taps[name] = (kinds, wants)
        return taps

    def _expert_taps(self, modules: dict[str, nn.Module]) -> dict[str, frozenset[tuple[str, int]]]:
        """The ``(kind, expert)`` pairs each fused experts module is selected for; a selector of
        expert sub-sites at a module that has none, or beside op selectors of that module, is
        refused here."""
        taps: dict[str, frozenset[tuple[str, int]]] = {}
        for name, module in modules.items():
            why = "while its experts are tapped hookscope computes them, so the module's own ops do not run"
            experts = self._family(name, "expert", why)
            if not experts:
                continue
            problem = experts_problem(module, name, {pattern.op[len("expert.") :] for pattern in experts})
            if problem is not None:
                raise SpecError(f"expert sub-site selector {str(experts[0])!r}: {problem}")
            count = int(getattr(module, "num_experts", 0))
            pairs: set[tuple[str, int]] = set()
            for pattern in experts:
                chosen_experts = [expert for expert in range(count) if pattern.matches(pattern.op, expert)]
                if not chosen_experts:
                    raise SpecError(
                        f"expert sub-site selector {str(pattern)!r} names no expert of {module_label(name)!r}, "
                        f"which has {count}: #0 to #{count - 1}"
                    )
                pairs.update((pattern.op[len("expert.") :], expert) for expert in chosen_experts)
            taps[name] = frozenset(pairs)
        return taps

    def modules_of(self, number: int) -> list[str]:
        """The names of the modules selector ``number`` (its place in :attr:`patterns`) watches."""
        return list(self._modules_of.get(number, []))

    def head_counts(self, module: str) -> HeadCounts | None:
        """The query and key/value head counts of a watched attention module with grouped heads
        (what lays its kernel calls' sub-sites out as documented), else None."""
        return self._heads.get(module)

    def matching(self, module: str, call: int, op: str, index: int) -> list[int]:
        """The numbers of the selectors naming the ``index``-th ``op`` of this call of ``module``,
        in :attr:`patterns` order: which of them a value handed to ``keep`` is for."""
        return [
            number
            for number, pattern in self._per_module.get(module, [])
            if pattern.matches_call(call) and pattern.matches(op, index)
        ]

    def _listener(
        self, keep: OpKeep, want: Callable[[int], bool], keep_attn: AttnKeep, replays: Callable[[str], None] | None
    ) -> Any:
        per_module, fired = self._per_module, self._fired

        def listen(
            module: str, call: int, op: str, index: int, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
        ) -> Any:
            chosen = per_module.get(module)
            if chosen is None:
                return None
            watcher = self._watcher
            if watcher is not None and watcher.replaying:
                if replays is None:
                    return None  # a checkpointed block recomputing in backward: its values were kept already
                replays(module)
            if not want(call):
                return None
            hit = False
            subs: list[str] = []
            for number, pattern in chosen:
                if pattern.matches_call(call) and pattern.matches(op, index):
                    fired.add(number)
                    if not pattern.sub:
                        hit = True
                    elif pattern.sub not in subs:
                        subs.append(pattern.sub)
            result = keep_attn(module, call, index, subs, args, kwargs, output) if subs else None
            if hit:
                kept = keep(module, call, f"{op}#{index}", args, kwargs, output if result is None else result)
                result = result if kept is None else kept
            return result

        return listen

    def start(self) -> None:
        """A new pass: nothing has fired yet."""
        self._fired.clear()

    def check(self, calls: dict[str, int], want: Callable[[int], bool]) -> None:
        """At a pass's end: refuse an op selector whose module ran a call it names (``calls``:
        the pass's calls per module; ``want``: the capture's ``calls=``) but whose op never did."""
        for number, pattern in enumerate(self.patterns):
            if number in self._fired:
                continue
            for module in self._modules_of.get(number, []):
                if any(pattern.matches_call(call) and want(call) for call in range(calls.get(module, 0))):
                    raise self._unfired_error(pattern, module)

    def _unfired_error(self, pattern: OpPattern, module: str) -> HookscopeError:
        message = self._unfired(pattern, module)
        if issubclass(self._error, CaptureError):
            return self._error(message, site=str(pattern))
        return self._error(message)

    def _unfired(self, pattern: OpPattern, module: str) -> str:
        seen = self._watcher.seen.get(module, {}) if self._watcher is not None else {}
        called = ", ".join(f"{op} (x{count})" if count > 1 else op for op, count in list(seen.items())[:20])
        close = difflib.get_close_matches(pattern.op, list(seen), n=3, cutoff=0.5)
        if pattern.sub:
            return _unfired_attention(pattern, module, seen, called, self._eager_advice(module))
        if pattern.op.startswith("expert."):
            return (
                f"expert sub-site selector {str(pattern)!r} matched nothing: {module_label(module)!r} ran, but not "
                "through transformers' experts interface on the thread that attached the tap (its forward was "
                "replaced, or it ran on another thread)"
            )
        tapped = TAPS.wanted(dict(self.modules)[module]) if module in dict(self.modules) else None
        if tapped is not None and not pattern.op.startswith("expert."):
            return (
                f"op selector {str(pattern)!r} matched no op call of {module_label(module)!r}: its experts are tapped "
                "(an expert sub-site is selected, by this or another hookscope feature), so hookscope computed them "
                "and the module's own ops did not run; select its ops in a run without expert sub-sites"
            )
        if pattern.op in seen:  # the name ran, the index did not
            hint = f"{pattern.op!r} ran {seen[pattern.op]} time(s) per call: indices 0 to {seen[pattern.op] - 1}"
        elif close:
            hint = "did you mean " + " or ".join(repr(f"{escape_name(module)}:op[{op}]") for op in close) + "?"
        elif seen:
            hint = "hs.layers(model, x, ops=True) lists the op sites"
        else:
            hint = (
                "its own code calls no torch function (a container such as nn.Sequential only calls its children: "
                "select the child whose code makes the op; a torch.compile wrapper's forward is compiled code: "
                "select the eager model's modules); hs.layers(model, x, ops=True) lists the op sites"
            )
        return (
            f"op selector {str(pattern)!r} matched no op call of {module_label(module)!r}, which ran and called: "
            f"{called or 'no torch op returning a tensor'}; {hint}"
        )

    def _eager_advice(self, module: str) -> str:
        """How to read ``module``'s eager attention on this model: only sites it has, and
        ``attn_implementation='sdpa'`` only where transformers allows it."""
        from hookscope._arch.std import kept_std_map  # an error path: the map is read, never made

        softmax = f"'{escape_name(module)}:op[softmax#0]'"
        std = kept_std_map(self._model)
        named = [
            site.name
            for site in (std.sites.values() if std is not None else ())
            if site.name.endswith("attn.z") and site.read.startswith(f"{escape_name(module)}:")
        ]
        per_head = f"; per head, std:{named[0]}" if named else ""
        merged = merged_heads(self._model, module, dict(self.modules)[module])
        eager = f"the pattern per head is the softmax {softmax}, and {merged}{per_head}"
        if self._refuses_sdpa:
            refused = "transformers refuses attn_implementation='sdpa' for this model"
            return f"{refused}, so read its eager attention: {eager}"
        return f"load a transformers model with attn_implementation='sdpa', or read its eager attention: {eager}"

    def remove(self) -> None:
        """Take the op watcher's hooks and the experts taps off (safe to call twice)."""
        try:
            while self._untaps:
                self._untaps.pop()()
        finally:
            if self._watcher is not None:
                self._watcher.remove()


def _unfired_attention(pattern: OpPattern, module: str, seen: dict[str, int], called: str, eager: str) -> str:
    """Why an attention sub-site selector matched nothing, and the fix (``eager``: how to read
    the module's eager attention on this model)."""
    where = module_label(module)
    if SDPA in seen:
        return (
            f"attention sub-site selector {str(pattern)!r} matched no {SDPA} call of {where!r}, which called it "
            f"{seen[SDPA]} time(s) per call: indices 0 to {seen[SDPA] - 1}"
        )
    called = called or "no torch op returning a tensor"
    fix = eager if "softmax" in seen else "load a transformers model with attn_implementation='sdpa'"
    if "softmax" not in seen and eager.startswith("transformers refuses"):
        fix = "transformers refuses attn_implementation='sdpa' for this model, and its attention calls no softmax"
    return (
        f"attention sub-site selector {str(pattern)!r} matched nothing: {where!r} ran but its own code never called "
        f"torch.nn.functional.{SDPA}, which attention sub-sites read; it called: {called}; {fix} "
        "(hs.layers(model, x, ops=True) lists the op sites)"
    )


def _multihead(pattern: OpPattern, name: str) -> str:
    return (
        f"attention sub-site selector {str(pattern)!r} selects {module_label(name)!r}, an nn.MultiheadAttention, "
        f"whose forward runs {SDPA} inside F.multi_head_attention_forward, where op sites cannot see: call it with "
        "need_weights=True, average_attn_weights=False and read its second output (the pattern), or capture "
        f"'{escape_name(name)}:op[multi_head_attention_forward#0]'"
    )
