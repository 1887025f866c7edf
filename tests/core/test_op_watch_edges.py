"""Op watches beside other code: several watchers on one op, the user's own function modes,
other threads, removal in any order, accelerate's forward wrapper, listeners that call modules.

Each test is a case where the watch's bookkeeping (its wrappers, its place on torch's mode
stack) could go wrong silently; references are plain PyTorch.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import hookscope as hs
from hookscope._core.op_list import list_ops

WAIT = 30.0


def stack() -> list[str]:
    """The names of the modes on this thread's torch function stack, bottom first."""
    return [type(torch._C._get_function_stack_at(i)).__name__ for i in range(torch._C._len_torch_function_stack())]


def wrapped(model: nn.Module) -> list[str]:
    """Modules that still hold an instance ``forward``, ``_call_impl`` or ``_old_forward``."""
    return [
        name
        for name, module in model.named_modules()
        if {"forward", "_call_impl", "_old_forward"} & set(module.__dict__)
    ]


class TwoSoftmax(nn.Module):
    """The same op before and after a submodule call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.softmax(-1) + self.lin(x).softmax(-1)


def test_watchers_see_an_op_in_the_order_they_were_attached_as_hooks_do() -> None:
    model = nn.Sequential(TwoSoftmax())
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    original = x.softmax(-1)
    doubled = {"0:op[softmax#*]": hs.edits.scale(2.0)}
    sites = ("0:op[softmax#0]", "0:op[softmax#1]")
    with torch.no_grad():
        with hs.capture(model, *sites) as before, hs.edit(model, doubled):
            out = model(x)
        with hs.edit(model, doubled), hs.capture(model, *sites) as after:
            model(x)
    torch.testing.assert_close(out, 4 * original)
    for site in sites:
        torch.testing.assert_close(before[site], original)  # attached before the edit: the value before it
        torch.testing.assert_close(after[site], 2 * original)  # attached after: the edited value
    assert stack() == []


class UserMode(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


class InsideAMode(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with UserMode():
            y = self.lin(x)  # a submodule called inside the user's own function mode
        return y.softmax(-1)


class CallsInsideAMode(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.inner = TwoSoftmax()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) * 1.0
        with UserMode():
            return self.inner(h) + 0


def test_attach_order_holds_with_a_user_mode_between_the_watchers_modes() -> None:
    model = nn.Sequential(CallsInsideAMode())
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        h = model[0].lin(x)
        # the edit's mode is pushed inside the user's mode, the capture's (also watching the outer
        # module) before it: the capture, attached later, must still see the edited value
        with (
            hs.edit(model, {"0.inner:op[softmax#0]": hs.edits.scale(2.0)}),
            hs.capture(model, "0.inner:op[softmax#0]", "0:op[mul#0]") as cap,
        ):
            model(x)
    torch.testing.assert_close(cap["0.inner:op[softmax#0]"], 2 * h.softmax(-1))
    assert stack() == []


def test_a_mode_the_forward_pushes_around_a_submodule_stays_its_own() -> None:
    model = nn.Sequential(InsideAMode())
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(x)
        with hs.capture(model, "0:op[softmax#0]") as cap:
            model(x)
    torch.testing.assert_close(cap["0:op[softmax#0]"], expected)
    assert stack() == []


class Paused(nn.Module):
    """Waits in the middle of its forward until another thread has run."""

    def __init__(self) -> None:
        super().__init__()
        self.sub = nn.Linear(4, 4)
        self.inside, self.go_on = threading.Event(), threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.softmax(-1)
        self.inside.set()
        assert self.go_on.wait(timeout=WAIT)
        return y.exp() + self.sub(x)


def test_another_thread_calling_a_watched_submodule_passes_through() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Paused())
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    seen: dict[str, Any] = {}

    def other() -> None:
        assert model[0].inside.wait(timeout=WAIT)
        with torch.no_grad():
            model[0].sub(x)
            seen["stack"] = stack()
            seen["sum"] = torch.ones(1) + 1  # an add on this thread: never the module's
        model[0].go_on.set()

    thread = threading.Thread(target=other)
    thread.start()
    with torch.no_grad(), hs.capture(model, "0:op[add#0]") as cap:
        out = model(x)
    thread.join(timeout=WAIT)
    assert seen["stack"] == []
    torch.testing.assert_close(cap["0:op[add#0]"], out)
    assert stack() == []


@pytest.mark.parametrize("order", ["first-attached first", "last-attached first", "remove_all"])
def test_wrappers_come_off_whatever_the_removal_order(order: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Softmax(-1)))
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x)
        cap = hs.capture(model, "1.1:op[softmax#0]")
        editor = hs.edit(model, {"1.1:op[softmax#0]": hs.edits.scale(2.0)})
        torch.testing.assert_close(model(x), 2 * expected)
        if order == "remove_all":
            hs.remove_all(model)
        else:
            first, second = (cap, editor) if order == "first-attached first" else (editor, cap)
            first.remove()
            if first is cap:
                torch.testing.assert_close(model(x), 2 * expected)  # the edit still applies
            second.remove()
        torch.testing.assert_close(model(x), expected)
    assert wrapped(model) == []
    assert hs.attached(model) == []
    twin = copy.deepcopy(model)  # a copy computes with its own weights
    with torch.no_grad():
        for parameter in twin.parameters():
            parameter.zero_()
        torch.testing.assert_close(twin(x), torch.full((2, 4), 0.25))


class Tripled(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 3).softmax(-1)


def test_accelerate_s_hook_work_is_not_the_module_s_own_code() -> None:
    hooks = pytest.importorskip("accelerate.hooks")

    class Doubling(hooks.ModelHook):  # type: ignore[misc]
        def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return (args[0] * 2,), kwargs

        def post_forward(self, module: nn.Module, output: Any) -> Any:
            return output * 1

    model = nn.Sequential(Tripled())
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    plain = [str(op) for op in list_ops(model, x, layers="0")]
    hooks.add_hook_to_module(model[0], Doubling())
    assert [str(op) for op in list_ops(model, x, layers="0")] == plain == ["0#0:op[mul#0]", "0#0:op[softmax#0]"]
    with torch.no_grad(), hs.edit(model, {"0:op[mul#0]": hs.edits.scale(0.0)}):
        out = model(x)  # the module's own x * 3 zeroed: a uniform softmax
    torch.testing.assert_close(out, torch.full((2, 4), 0.25))
    held = model[0].__dict__["_old_forward"]  # accelerate's own attribute, given back as it held it
    assert getattr(held, "__func__", None) is Tripled.forward
    hooks.remove_hook_from_module(model[0])
    with torch.no_grad():
        torch.testing.assert_close(model(x), (x * 3).softmax(-1))


class LinearThenSoftmax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).softmax(-1) * 2


def test_an_edit_that_calls_a_watched_submodule_leaves_no_mode() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(LinearThenSoftmax())
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    lin = model[0].lin
    with torch.no_grad(), hs.edit(model, {"0:op[softmax#0]": lambda value, ctx: lin(value)}) as editor:
        out = model(x)
    assert editor.applied == {"0:op[softmax#0]": 1}
    with torch.no_grad():
        torch.testing.assert_close(out, lin(lin(x).softmax(-1)) * 2)
    assert stack() == []
    assert hs.attached(model) == []


def test_a_watch_removed_from_inside_a_listener_leaves_no_mode() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Softmax(-1)))
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    held: dict[str, Any] = {}

    def remove_the_capture(value: torch.Tensor, ctx: Any) -> torch.Tensor:
        if "capture" in held:
            held.pop("capture").remove()  # while torch holds the capture's mode lifted off the stack
        return value

    with torch.no_grad(), hs.edit(model, {"1.1:op[softmax#0]": remove_the_capture}):
        held["capture"] = hs.capture(model, "1.1:op[softmax#0]")
        model(x)
        assert stack() == []
        hs.remove_all(model)  # and the edit itself, between passes
    assert stack() == []
    assert wrapped(model) == []


def test_a_bare_forward_call_on_another_thread_does_not_take_the_watch() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Softmax(-1))
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    errors: list[BaseException] = []

    def bare() -> None:
        try:
            model[1].forward(x)  # no module call around it: no call index to report under
        except hs.HookscopeError as error:
            errors.append(error)

    with torch.no_grad(), hs.capture(model, "1:op[softmax#0]") as cap:
        thread = threading.Thread(target=bare)
        thread.start()
        thread.join(timeout=WAIT)
        out = model(x)  # the attaching thread's pass is still watched
    assert len(errors) == 1
    torch.testing.assert_close(cap["1:op[softmax#0]"], out)


class TanhBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Twice(nn.Module):
    """One block applied twice, each under torch.utils.checkpoint."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.block = TanhBlock()
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        once = checkpoint(self.block, x, use_reentrant=self.reentrant)
        return checkpoint(self.block, once, use_reentrant=self.reentrant).square().sum()


def reference_gradient(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """d/dx of sum(square(0.5 * block(block(x)))), without hookscope or checkpointing."""
    x = x.detach().requires_grad_(True)
    (0.5 * block(block(x))).square().sum().backward()
    assert x.grad is not None
    return x.grad


@pytest.mark.parametrize("how", ["calls=1", "block#1:op"])
def test_an_edit_of_one_call_of_a_recomputed_block_is_exact_or_refused(how: str) -> None:
    for reentrant in (False, True):
        torch.manual_seed(0)
        model = Twice(reentrant)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
        if how == "calls=1":
            editor = hs.edit(model, {"block": hs.edits.scale(0.5)}, calls=1)
        else:
            editor = hs.edit(model, {"block#1:op[tanh#0]": hs.edits.scale(0.5)})
        if reentrant:  # its recomputation cannot tell block#0 from block#1: refused, not misplaced
            with editor, pytest.raises(hs.EditError, match=r"'block' runs 2 times in the forward and is recomputed"):
                model(x).backward()
        else:  # non-reentrant recomputation keeps the forward's numbering: exact, gradients included
            with editor:
                model(x).backward()
            assert x.grad is not None
            torch.testing.assert_close(x.grad, reference_gradient(model.block, x))
        assert stack() == []
        assert wrapped(model) == []
        assert hs.attached(model) == []


class Doubles(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * 2


class PlusOne(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.doubles = Doubles()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.doubles(x) + 1


def test_with_children_a_hook_s_calls_are_still_nobody_s_code() -> None:
    from hookscope._core.ops import OpWatcher

    model = PlusOne()
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    log: list[str] = []

    def listen(module: str, call: int, op: str, index: int, *rest: Any) -> None:
        log.append(f"{module or '(root)'}:{op}#{index}")

    watched = [("", model), ("doubles", model.doubles)]
    with torch.no_grad():
        with OpWatcher(model, watched, listen, children=True):
            model(x)
        plain = list(log)
        log.clear()
        hook = model.doubles.register_forward_hook(lambda module, args, out: out + module.inner(out))
        try:
            with OpWatcher(model, watched, listen, children=True):
                model(x)  # the hook calls the watched module's child: its ops are the hook's, unreported
        finally:
            hook.remove()
    assert plain == ["doubles:linear#0", "doubles:tanh#0", "doubles:mul#0", "(root):add#0"]
    assert log == plain
    assert stack() == []


class Timed:
    """A user's own wrapper of a module's forward, as picklable as any plain object."""

    def __init__(self, forward: Any) -> None:
        self.forward = forward
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.forward(*args, **kwargs)


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_a_model_whose_forward_other_code_wrapped_during_a_watch_saves_after_it(how: str) -> None:
    """The watch's forward wrapper stays under the user's as a pass-through (undoing it would
    undo theirs); it refused to pickle as if the watch were still attached, so the model could
    never be saved again."""
    import io
    import pickle

    torch.manual_seed(0)
    model = nn.Sequential(LinearThenSoftmax(), nn.Linear(4, 2))
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), hs.capture(model, "0:op[softmax#0]") as cap:
        model[0].forward = Timed(model[0].forward)  # wraps the watch's own forward wrapper
        out = model(x)
    with torch.no_grad():
        torch.testing.assert_close(cap["0:op[softmax#0]"], model[0].lin(x).softmax(-1))
    assert hs.attached(model) == []
    if how == "pickle":
        twin = pickle.loads(pickle.dumps(model))
    else:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        twin = torch.load(buffer, weights_only=False)
    assert isinstance(twin[0].forward, Timed)
    with torch.no_grad():
        torch.testing.assert_close(twin(x), out)
        torch.testing.assert_close(twin(x), model[1](model[0].lin(x).softmax(-1) * 2))
    assert twin[0].forward.calls == model[0].forward.calls + 2
    with torch.no_grad():
        twin[0].lin.weight.zero_()  # the copy computes with its own weights, not the original's
        assert not torch.equal(twin(x), model(x))


class SoftmaxOfLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).softmax(-1)


class CallsForward(nn.Module):
    """Runs its child's ``forward`` itself, bypassing ``nn.Module.__call__`` (and so every hook)."""

    def __init__(self) -> None:
        super().__init__()
        self.child = SoftmaxOfLinear()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.child.forward(x))
        return out


def test_a_module_whose_parent_calls_its_forward_is_refused_naming_it_and_the_parent() -> None:
    """It got the call tracker's internal "no call of this module is open; current() is valid
    only inside its hooks", and hs.layers(ops=True) failed on the whole model."""
    torch.manual_seed(0)
    model = CallsForward()
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    for scope in (
        lambda: hs.capture(model, "child:op[softmax#0]"),
        lambda: hs.edit(model, {"child:op[softmax#0]": hs.edits.zero()}),
    ):
        with pytest.raises(hs.UnsupportedModelError) as info, scope():
            model(x)
        message = str(info.value)
        assert "'child' (SoftmaxOfLinear)" in message
        assert ".forward() directly" in message
        assert "'(root)'" in message
        assert "\n" not in message
        assert hs.attached(model) == []
        assert wrapped(model) == []
    with torch.no_grad():
        expected = model.child.fc(x).softmax(-1)
    with hs.capture(model, "(root):op[softmax#0]") as cap:  # the way out the error names
        model(x)
    torch.testing.assert_close(cap["(root):op[softmax#0]"], expected)
    assert [str(op) for op in list_ops(model, x)] == [
        "child.fc#0:op[linear#0]",
        "(root)#0:op[softmax#0]",
        "head#0:op[linear#0]",
    ]


def test_a_bare_forward_child_selected_beside_its_watched_parent_is_refused_too() -> None:
    """With the parent watched too, the child's op site was a silent no-op: an edit applied 0
    times and the output unchanged, its ops counted as the parent's."""
    torch.manual_seed(0)
    model = CallsForward()
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model.head(model.child.fc(x).softmax(-1))  # by hand, no hookscope
        torch.testing.assert_close(model(x), plain)
    for scope in (
        lambda: hs.capture(model, ["(root):op[softmax#0]", "child:op[softmax#0]"]),
        lambda: hs.edit(model, {"(root):op[softmax#0]": hs.edits.scale(1.0), "child:op[softmax#0]": hs.edits.zero()}),
    ):
        refused = pytest.raises(hs.UnsupportedModelError, match=r"'child' \(SoftmaxOfLinear\).*\.forward\(\) directly")
        with refused, torch.no_grad(), scope():
            model(x)
        assert hs.attached(model) == []
        assert wrapped(model) == []
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain)
