"""One forward that shows a canonical map its values: the first tensor each role module takes
and returns, the ops of the blocks' own code, and which ops attention modules call.

Run once per map (on a tiny input), with the model in eval mode, without gradients and with
torch's random state put back afterwards, so making a map changes nothing the user can see.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from hookscope._core.attach import HookGroup, HookSpec
from hookscope._core.names import escape_name, named_modules
from hookscope._core.ops import OpWatcher
from hookscope._core.std_names import StdSite
from hookscope._core.tree import call_leaves, flatten_tensors
from hookscope.errors import StdMapError

__all__ = ["Seen", "observe", "values_close"]


class Seen:
    """What the check forward showed, read by the resolver."""

    def __init__(self) -> None:
        self._inputs: dict[str, tuple[str, torch.Tensor]] = {}
        self._outputs: dict[str, tuple[str, torch.Tensor]] = {}
        self._ops: dict[str, list[tuple[str, torch.Tensor]]] = {}
        self._op_names: dict[str, dict[str, int]] = {}
        self._attention_ops: dict[str, list[tuple[str, tuple[int, ...]]]] = {}  # call 0's ops and shapes, in order
        self._calls: dict[str, int] = {}
        #: Per attention module, where its heads' output is merged (the errors' advice), and
        #: whether transformers refuses ``attn_implementation='sdpa'`` for the model.
        self.merged_heads: dict[str, str] = {}
        self.refuses_sdpa = False

    def ran(self, module: str) -> bool:
        return module in self._outputs or module in self._inputs

    def calls(self, module: str) -> int:
        """How many times ``module`` was called in the check forward."""
        return self._calls.get(module, 0)

    def has_input(self, module: str) -> bool:
        """Whether ``module`` took a tensor (a module called with none has no input value)."""
        return module in self._inputs

    def has_output(self, module: str) -> bool:
        return module in self._outputs

    def input(self, module: str) -> torch.Tensor:
        return self._inputs[module][1]

    def output(self, module: str) -> torch.Tensor:
        return self._outputs[module][1]

    def site(self, name: str, module: str, side: str) -> StdSite:
        """The site of the first tensor ``module`` takes (``side="input"``) or returns."""
        path, _ = (self._inputs if side == "input" else self._outputs)[module]
        read = f"{escape_name(module)}:{side}{path}"
        return StdSite(name, read, read, module if side == "output" else None, "input" if side == "input" else "output")

    def ops_of(self, module: str) -> dict[str, int]:
        return self._op_names.get(module, {})

    def eager_output(self, attention: str) -> str | None:
        """The op of an eager attention module's code that returns its output per head: the
        first matrix product after its ``softmax#0`` whose value is ``(batch, heads, queries,
        head size)`` over the softmax's rows (``"matmul#1"``), or None."""
        ops = self._attention_ops.get(attention, [])
        labels = [label for label, _ in ops]
        if "softmax#0" not in labels:
            return None
        start = labels.index("softmax#0")
        rows = ops[start][1]
        for label, shape in ops[start + 1 :]:
            if label.split("#")[0] in ("matmul", "bmm", "einsum"):  # the first product: z, or no z here
                return label if len(rows) == len(shape) == 4 and shape[:3] == rows[:3] else None
        return None

    def find_op(self, block: str, expected: torch.Tensor) -> str | None:
        """The first op of the block's own code that returned ``expected``: ``"add#0"``."""
        for label, value in self._ops.get(block, []):
            if value.shape == expected.shape and value.dtype == expected.dtype and values_close(value, expected):
                return label
        return None

    def ops(self, block: str) -> list[tuple[str, torch.Tensor]]:
        """Every op of the block's own code and its value, in call order."""
        return self._ops.get(block, [])

    def op_value(self, block: str, label: str) -> torch.Tensor:
        return next(value for found, value in self._ops[block] if found == label)


def observe(
    model: nn.Module,
    modules: Sequence[str],
    blocks: Sequence[str],
    attention: Sequence[str],
    inputs: tuple[tuple[Any, ...], dict[str, Any]],
) -> Seen:
    """Run ``model`` once on ``inputs`` (``(args, kwargs)``), recording the first call of each
    of ``modules``, the ops of ``blocks``' own code, and the op names ``attention`` calls."""
    seen = Seen()
    by_name = dict(named_modules(model))
    specs = []
    for name in modules:
        specs.append(
            HookSpec(name, by_name[name], "forward_pre", _record_input(seen, name), with_kwargs=True, fitted=True)
        )
        specs.append(HookSpec(name, by_name[name], "forward", _record_output(seen, name), fitted=True))
    group = HookGroup(model, specs, owner="std_map", restore_mode=True)
    watched = list(dict.fromkeys([*blocks, *attention]))
    watcher: OpWatcher | None = None
    try:
        if watched:
            record = _record_op(seen, set(blocks), set(attention))
            watcher = OpWatcher(model, [(n, by_name[n]) for n in watched], record, owner="std_map", bare_to_caller=True)
        model.eval()
        args, kwargs = inputs
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            try:
                model(*args, **kwargs)
            except Exception as error:  # a bad example input: say so, in hookscope's words
                raise StdMapError(
                    f"the check forward of the canonical map failed on the example input ({type(error).__name__}: "
                    f"{error}); pass an input the model takes: hs.std_map(model, example_input)",
                    check="check forward failed",
                ) from error
        if watcher is not None:
            seen._op_names = {name: dict(ops) for name, ops in watcher.seen.items()}
    finally:
        if watcher is not None:
            watcher.remove()
        group.remove()
    return seen


def _record_input(seen: Seen, name: str) -> Any:
    def record(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen._calls[name] = seen._calls.get(name, 0) + 1
        if name not in seen._inputs:
            leaves = call_leaves(args, kwargs)
            if leaves:
                seen._inputs[name] = (leaves[0][0], leaves[0][1].detach().clone())

    return record


def _record_output(seen: Seen, name: str) -> Any:
    def record(_module: nn.Module, _args: tuple[Any, ...], output: Any) -> None:
        if name not in seen._outputs:
            leaves = flatten_tensors(output, "")
            if leaves:
                seen._outputs[name] = (leaves[0][0], leaves[0][1].detach().clone())

    return record


def _record_op(seen: Seen, blocks: set[str], attention: set[str]) -> Any:
    def record(
        module: str, call: int, op: str, index: int, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        if call == 0 and module in blocks and isinstance(output, torch.Tensor):
            seen._ops.setdefault(module, []).append((f"{op}#{index}", output.detach().clone()))
        if call == 0 and module in attention and isinstance(output, torch.Tensor):
            seen._attention_ops.setdefault(module, []).append((f"{op}#{index}", tuple(output.shape)))

    return record


def values_close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal up to rounding: the model may add in another order, or in place."""
    got64, expected64 = got.double(), expected.double()
    scale = float(expected64.abs().max()) if expected64.numel() else 0.0
    eps = torch.finfo(got.dtype).eps if got.is_floating_point() else 0.0
    return bool(((got64 - expected64).abs() <= max(1e-4, 16 * eps) * (1.0 + scale)).all())
