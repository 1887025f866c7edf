"""Op sites (issue 19, first step): op names, the site grammar, the scoped op watcher, discovery.

Every value the watcher reports is checked against a reference computed without hookscope: the
attention weights transformers returns, a sum done by hand, a raw PyTorch forward hook, or a
hand-written ``TorchFunctionMode``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional
from torch.overrides import TorchFunctionMode

import hookscope as hs
import hookscope._capture.keeper as keeper
from hookscope._core.op_list import list_ops
from hookscope._core.op_sites import OpPattern, OpSite, op_name, op_pattern
from hookscope._core.ops import OpWatcher
from tests.conftest import Golden, raw_hook_count
from tests.models import Tracked, attention_gpt2, attention_tokens, track

WAIT = 30.0


def stack_depth() -> int:
    return int(torch._C._len_torch_function_stack())


class Recorder:
    """A listener keeping ``(module, call, op, index)`` and a copy of the output of every op."""

    def __init__(self, replace: dict[tuple[str, int, str, int], Callable[[Any], Any]] | None = None) -> None:
        self.calls: list[tuple[str, int, str, int]] = []
        self.outputs: dict[tuple[str, int, str, int], Any] = {}
        self.threads: set[int] = set()
        self._replace = replace or {}

    def __call__(
        self, module: str, call: int, op: str, index: int, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        key = (module, call, op, index)
        self.calls.append(key)
        self.threads.add(threading.get_ident())
        self.outputs[key] = output.detach().clone() if isinstance(output, torch.Tensor) else output
        edit = self._replace.get(key)
        return None if edit is None else edit(output)

    def ops(self, module: str, call: int = 0) -> list[str]:
        return [f"{op}#{index}" for m, c, op, index in self.calls if (m, c) == (module, call)]


# -- names and text -------------------------------------------------------------------------------


class NameOf(TorchFunctionMode):
    """The reference for what a function mode is handed: every function, by identity."""

    def __init__(self) -> None:
        super().__init__()
        self.funcs: list[Any] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.funcs.append(func)
        return func(*args, **(kwargs or {}))


def test_op_name_reads_every_spelling_of_an_op_as_users_write_it() -> None:
    assert {op_name(f) for f in (torch.softmax, torch.Tensor.softmax, functional.softmax)} == {"softmax"}
    dunders = {
        "__add__": "add",
        "__radd__": "add",
        "__iadd__": "add_",
        "__rsub__": "sub",
        "__mul__": "mul",
        "__rtruediv__": "div",
        "__matmul__": "matmul",
        "__getitem__": "getitem",
        "__invert__": "bitwise_not",
        "__len__": "len",
    }
    assert {name: op_name(getattr(torch.Tensor, name)) for name in dunders} == dunders
    assert op_name(functional.scaled_dot_product_attention) == "scaled_dot_product_attention"
    assert op_name(torch.ops.aten.mul.Tensor) == op_name(torch.ops.aten.mul) == "mul"

    a, b = torch.randn(2, 3), torch.randn(3, 2)
    seen = NameOf()
    with seen:
        _ = a + 1, 1 - a, 2 / a, a @ b, a[0], a.T, -a
        c = a.clone()
        c += 1
    assert [op_name(f) for f in seen.funcs] == ["add", "sub", "div", "matmul", "getitem", "T", "neg", "clone", "add_"]


def test_op_sites_print_and_parse_back() -> None:
    site = OpSite("h.0.attn", 1, "softmax", 2)
    assert str(site) == "h.0.attn#1:op[softmax#2]"
    assert OpSite.parse("h.0.attn:op[softmax#0]") == OpSite("h.0.attn", 0, "softmax", 0)
    for odd in (OpSite("fc#1", 0, "add_", 3), OpSite("a:b", 2, "T", 0), OpSite("", 0, "add", 1)):
        assert OpSite.parse(str(odd)) == odd
    assert str(OpSite("fc#1", 0, "mul", 0)) == r"fc\#1#0:op[mul#0]"
    with pytest.raises(hs.SpecError, match=r"names a pattern.*e\.g\. h:op\[softmax#0\]"):
        OpSite.parse("h:op[softmax]")
    with pytest.raises(hs.SpecError, match=r"is not of the form 'module\[#call\]:op\[name\[#index\]\]'"):
        OpSite.parse("h:output")
    with pytest.raises(hs.SpecError, match="count from 0"):
        OpSite("h", -1, "add", 0)


def test_op_patterns_glob_names_and_indices() -> None:
    every = OpPattern.parse("h.*.attn:op[scaled_dot_product_attention]")
    assert (every.module, every.call, every.index) == ("h.*.attn", None, None)
    assert every.matches("scaled_dot_product_attention", 7)
    assert not every.matches("softmax", 0)
    adds = OpPattern.parse("layer1.0#1:op[add*]")
    assert adds.call == 1
    assert adds.matches_call(1)
    assert not adds.matches_call(0)
    assert [adds.matches(op, 0) for op in ("add", "add_", "addmm", "mul")] == [True, True, True, False]
    first = OpPattern.parse("h.0.attn:op[softmax#0]")
    assert (first.matches("softmax", 0), first.matches("softmax", 1)) == (True, False)
    assert OpPattern.parse("h.0.attn:op[softmax#*]").matches("softmax", 12)
    regex = OpPattern.parse(r"re:h\.[0-9]+\.attn:op[softmax]")
    assert regex.module == r"re:h\.[0-9]+\.attn"
    for text in ("h.*.attn:op[add*]", r"fc\#1#2:op[mul#3]", r"re:h\.[0-9]:op[softmax#*]"):
        assert str(OpPattern.parse(text)) == text
    assert op_pattern("h.0.attn") is None
    assert op_pattern(nn.Linear) is None
    with pytest.raises(hs.SpecError, match="op selector name 'soft max'"):
        op_pattern("h:op[soft max]")
    with pytest.raises(hs.SpecError, match="is not of the form"):
        op_pattern("h:op[softmax")


# -- small models ---------------------------------------------------------------------------------


class Residual(Tracked):
    """``out = relu(conv(x)); out += shortcut(x); return out + x``: an in-place and a plain add."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.shortcut = nn.Conv2d(3, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.conv(x))
        out += self.shortcut(x)
        return out + x


class Net(Tracked):
    """A stem Linear, a residual block, and a head whose forward calls its Linear twice."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = Residual()
        self.head = Head()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.block(x).mean(dim=(2, 3)))
        return out


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc(x))
        return torch.softmax(self.fc(h) * 2, dim=-1)


def image() -> torch.Tensor:
    return torch.randn(2, 3, 5, 5, generator=torch.Generator().manual_seed(1))


def test_residual_adds_equal_the_hand_computed_sums() -> None:
    model = Residual()
    x = image()
    recorder = Recorder()
    with torch.no_grad(), OpWatcher(model, [("", model)], recorder):
        out = model(x)
        inner = torch.relu(model.conv(x)) + model.shortcut(x)  # by hand, outside the model: no mode
    assert recorder.ops("") == ["relu#0", "add_#0", "add#0"], "the convolutions are the children's ops"
    assert torch.equal(recorder.outputs[("", 0, "add_", 0)], inner)
    assert torch.equal(recorder.outputs[("", 0, "add", 0)], inner + x)
    assert torch.equal(recorder.outputs[("", 0, "add", 0)], out)


@pytest.mark.slow
@pytest.mark.transformers
def test_hf_resnet_residual_add_equals_layer_plus_shortcut() -> None:
    from tests.models import tiny_resnet

    model = tiny_resnet()
    layer = model.encoder.stages[1].layers[0]  # a basic layer whose shortcut is a projection
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    recorder = Recorder()
    name = "encoder.stages.1.layers.0"
    with torch.no_grad(), OpWatcher(model, hs.select(model, name), recorder):
        model(x)
    seen: dict[str, torch.Tensor] = {}
    handle = layer.register_forward_pre_hook(lambda module, args: seen.setdefault("input", args[0]))
    try:
        with torch.no_grad():
            model(x)
            expected = layer.layer(seen["input"]) + layer.shortcut(seen["input"])
    finally:
        handle.remove()
    assert recorder.ops(name) == ["add_#0"]
    assert torch.equal(recorder.outputs[(name, 0, "add_", 0)], expected)


def test_children_ops_are_reported_only_when_asked() -> None:
    model = Net()
    x = image()
    fc_outputs: list[torch.Tensor] = []
    handle = model.head.fc.register_forward_hook(lambda module, args, output: fc_outputs.append(output.clone()))
    try:
        own, every = Recorder(), Recorder()
        with torch.no_grad():
            with OpWatcher(model, [("head", model.head)], own):
                model(x)
            with OpWatcher(model, [("head", model.head)], every, children=True):
                model(x)
    finally:
        handle.remove()
    assert own.ops("head") == ["relu#0", "mul#0", "softmax#0"]
    assert every.ops("head") == ["linear#0", "relu#0", "linear#1", "mul#0", "softmax#0"]
    assert torch.equal(every.outputs[("head", 0, "linear", 0)], fc_outputs[2])
    assert torch.equal(every.outputs[("head", 0, "linear", 1)], fc_outputs[3])
    assert torch.equal(own.outputs[("head", 0, "mul", 0)], fc_outputs[1] * 2)


def test_hooks_attached_before_the_watcher_are_not_the_module_s_code() -> None:
    model = Net()
    x = image()
    with torch.no_grad():
        plain = Recorder()
        with OpWatcher(model, [("", model), ("head", model.head)], plain, children=True):
            model(x)
    sums: list[torch.Tensor] = []
    handles = [
        module.register_forward_pre_hook(lambda module, args: sums.append(args[0].mul(2).sum()))
        for module in (model, model.head, model.head.fc)
    ] + [
        module.register_forward_hook(lambda module, args, output: sums.append((output + 1).sum()))
        for module in (model, model.head, model.head.fc)
    ]
    try:
        hooked = Recorder()
        with torch.no_grad(), OpWatcher(model, [("", model), ("head", model.head)], hooked, children=True):
            model(x)
    finally:
        for handle in handles:
            handle.remove()
    assert len(sums) == 8, "every hook ran (head.fc twice)"
    assert hooked.calls == plain.calls, "their mul, add and sum are neither reported nor counted"
    assert "mul#0" in hooked.ops("head")


def test_module_calls_are_numbered_and_op_indices_restart_at_each() -> None:
    class Twice(Tracked):
        def __init__(self) -> None:
            super().__init__()
            self.block = Head()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.block(self.block(x))
            return out

    model = Twice()
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    recorder = Recorder()
    with torch.no_grad(), OpWatcher(model, [("block", model.block)], recorder) as watcher:
        out = model(x)
        model(x)
        first = model.block(x)
    assert recorder.calls[:6] == [
        ("block", 0, "relu", 0),
        ("block", 0, "mul", 0),
        ("block", 0, "softmax", 0),
        ("block", 1, "relu", 0),
        ("block", 1, "mul", 0),
        ("block", 1, "softmax", 0),
    ]
    assert recorder.calls[6:12] == recorder.calls[:6], "the next pass numbers from 0 again"
    assert recorder.calls[12:] == recorder.calls[:3], "a module called on its own is a pass of its own"
    assert torch.equal(recorder.outputs[("block", 0, "softmax", 0)], first)
    assert torch.equal(recorder.outputs[("block", 1, "softmax", 0)], out)
    assert watcher.seen == {"block": {"relu": 1, "mul": 1, "softmax": 1}}


def test_the_same_op_twice_in_one_call_is_numbered() -> None:
    class TwoSoftmax(Tracked):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.softmax(x, -1) + functional.softmax(x * 3, dim=0)

    model = TwoSoftmax()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    recorder = Recorder()
    with OpWatcher(model, [("", model)], recorder) as watcher:
        model(x)
    assert recorder.ops("") == ["softmax#0", "mul#0", "softmax#1", "add#0"]
    assert torch.equal(recorder.outputs[("", 0, "softmax", 1)], torch.softmax(x * 3, dim=0))
    assert watcher.seen == {"": {"softmax": 2, "mul": 1, "add": 1}}


def test_nested_selected_modules_each_get_their_own_ops() -> None:
    model = Net()
    x = image()
    for children in (False, True):
        recorder = Recorder()
        chosen = [("", model), ("block", model.block), ("head", model.head)]
        with torch.no_grad(), OpWatcher(model, chosen, recorder, children=children):
            out = model(x)
        assert recorder.ops("") == ["mean#0"]
        assert recorder.ops("head")[-1] == "softmax#0"
        convs = ["conv2d#0", "relu#0", "conv2d#1", "add_#0", "add#0"] if children else ["relu#0", "add_#0", "add#0"]
        assert recorder.ops("block") == convs
        assert [key[0] for key in recorder.calls][: len(convs) + 1] == ["block"] * len(convs) + [""]
        assert torch.equal(recorder.outputs[("head", 0, "softmax", 0)], out)


def test_results_without_a_tensor_are_neither_reported_nor_numbered() -> None:
    class Sizes(Tracked):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            n, d = x.shape
            self.sizes = (x.size(0), x.dim(), len(x), x.numel(), x.tolist()[0][0], x[0, 0].item())
            y = x.clone()
            y[0] = 0.0
            return y.view(d, n)

    model = Sizes()
    x = torch.arange(6.0).view(2, 3)
    recorder = Recorder()
    with OpWatcher(model, [("", model)], recorder):
        out = model(x)
    assert model.sizes == (2, 2, 2, 6, 0.0, 0.0)
    assert recorder.ops("") == ["getitem#0", "clone#0", "view#0"]  # x[0, 0]; the setitem returned None
    assert torch.equal(recorder.outputs[("", 0, "view", 0)], out)


def test_functions_are_reported_as_called_not_what_runs_inside_them() -> None:
    torch.manual_seed(0)
    model = track(nn.Sequential(nn.MultiheadAttention(8, 2, batch_first=True), nn.LayerNorm(8)))
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))
    attn_out: list[Any] = []
    handle = model[0].register_forward_hook(lambda module, args, output: attn_out.append(output))
    recorder = Recorder()
    try:
        with torch.no_grad(), OpWatcher(model, [("0", model[0]), ("1", model[1])], recorder):
            model[0](x, x, x)
    finally:
        handle.remove()
    assert "multi_head_attention_forward#0" in recorder.ops("0")
    assert not any(op.startswith(("scaled_dot_product_attention", "linear", "softmax")) for op in recorder.ops("0"))
    output, weights = recorder.outputs[("0", 0, "multi_head_attention_forward", 0)]
    assert torch.equal(output.transpose(0, 1), attn_out[0][0])  # batch_first: the module transposes around it
    assert torch.equal(weights, attn_out[0][1])


def test_a_replacement_changes_the_rest_of_the_forward() -> None:
    model = Net()
    x = image()
    with torch.no_grad():
        block_out = model.block(x)
        hidden = torch.relu(model.head.fc(block_out.mean(dim=(2, 3))))
        expected = torch.softmax(model.head.fc(hidden * 0.0) * 2, dim=-1)  # relu#0 zeroed, by hand
    recorder = Recorder(replace={("head", 0, "relu", 0): torch.zeros_like})
    with torch.no_grad(), OpWatcher(model, [("head", model.head)], recorder):
        out = model(x)
    assert torch.equal(out, expected)
    assert not torch.equal(out, model(x)), "the edit made a difference"


# -- scope, errors, threads -----------------------------------------------------------------------


def test_no_mode_outside_the_selected_modules_and_nothing_left_after() -> None:
    model = Net()
    depths: dict[str, int] = {}

    def note(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            depths[name] = stack_depth()

        return hook

    handles = [model.head.fc.register_forward_pre_hook(note("head.fc")), model.register_forward_pre_hook(note(""))]
    before = stack_depth()
    recorder = Recorder()
    try:
        with OpWatcher(model, [("head", model.head)], recorder) as watcher:
            model(image())
            assert stack_depth() == before
    finally:
        for handle in handles:
            handle.remove()
    # no mode before the head; inside its Linear the mode stays on the stack (reporting nothing, as
    # asserted next): taking it off and on there would reorder modes the forward pushed meanwhile
    assert depths == {"": before, "head.fc": before + 1}
    assert recorder.ops("head") == ["relu#0", "mul#0", "softmax#0"]
    assert not watcher.live
    assert hs.attached(model) == []
    assert raw_hook_count(model) == 0


class Fails(Tracked):
    """Raises where asked: in an op of its own code, or inside its child."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.where = ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc(x))
        if self.where == "op":
            h = h @ torch.ones(5, 5)
        if self.where == "child":
            self.fc(h[:, :2])
        return h * 2


class Failing(Recorder):
    """A recorder that raises ``error`` at its first op while one is set."""

    def __init__(self) -> None:
        super().__init__()
        self.error: BaseException | None = None

    def __call__(self, *args: Any) -> Any:
        if self.error is not None:
            raise self.error
        return super().__call__(*args)


@pytest.mark.parametrize("where", ["op", "child", "listener", "interrupt"])
def test_an_exception_leaves_no_mode_and_no_hook(where: str) -> None:
    model = Fails()
    outer = track(nn.Sequential(model))
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    before = stack_depth()
    listener = Failing()
    model.where = where if where in ("op", "child") else ""
    # KeyboardInterrupt skips PyTorch's always_call hooks; the watcher's wrappers close in finally
    listener.error = {"listener": ValueError("listener failed"), "interrupt": KeyboardInterrupt()}.get(where)
    with OpWatcher(outer, [("0", model)], listener):
        with pytest.raises(type(listener.error) if listener.error is not None else RuntimeError):
            outer(x)
        assert stack_depth() == before, "taken off as the forward unwound, the watcher still attached"
        listener.calls.clear()
        _ = x * 3, torch.softmax(x, -1)  # the user's own code between passes: never the module's ops
        assert listener.calls == []
        model.where, listener.error = "", None
        listener.calls.clear()
        out = outer(x)
        assert stack_depth() == before
        assert listener.calls == [("0", 0, "relu", 0), ("0", 0, "mul", 0)], "numbered from 0 again"
        assert torch.equal(listener.outputs[("0", 0, "mul", 0)], out)
    assert stack_depth() == before
    assert hs.attached(outer) == []
    assert raw_hook_count(outer) == 0


def test_an_interrupted_forward_is_cleaned_up_when_the_watcher_is_removed() -> None:
    model = Fails()
    before = stack_depth()

    def interrupt(*args: Any) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt), OpWatcher(model, [("", model)], interrupt):
        model(torch.ones(1, 4))
    assert stack_depth() == before
    assert raw_hook_count(model) == 0


def test_hooks_attached_after_the_watcher_are_not_the_module_s_code() -> None:
    model = Net()
    x = image()
    with torch.no_grad():
        plain = Recorder()
        with OpWatcher(model, [("head", model.head)], plain):
            model(x)
        later = Recorder()
        with OpWatcher(model, [("head", model.head)], later):
            handles = [  # attached after the watcher: a pre-hook and a forward hook doing torch ops,
                model.head.register_forward_pre_hook(lambda module, args: (args[0] * 1,)),
                model.head.register_forward_hook(lambda module, args, output: torch.softmax(output, -1) + 0),
                model.head.fc.register_forward_hook(lambda module, args, output: output.mul(1)),  # on a child too
            ]
            try:
                model(x)
            finally:
                for handle in handles:
                    handle.remove()
    assert later.ops("head") == plain.ops("head") == ["relu#0", "mul#0", "softmax#0"]
    for key, value in plain.outputs.items():
        assert torch.equal(later.outputs[key], value)


def test_other_threads_forwards_pass_through_unreported() -> None:
    class Held(Tracked):
        """Its first call on the held thread waits, with the watcher's mode on, until the other thread is done."""

        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.held: int | None = None
            self.inside, self.go_on = threading.Event(), threading.Event()
            self.depths: dict[int, list[int]] = {}

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.softmax(self.fc(x), -1)
            self.depths.setdefault(threading.get_ident(), []).append(stack_depth())
            if self.held == threading.get_ident():
                self.held = None
                self.inside.set()
                assert self.go_on.wait(timeout=WAIT)
            return h * 2

    torch.manual_seed(0)
    model = Held()
    outer = track(nn.Sequential(model, nn.ReLU()))
    mine = torch.rand(3, 4, generator=torch.Generator().manual_seed(1))
    theirs = [torch.rand(5, 4, generator=torch.Generator().manual_seed(i)) for i in range(40)]
    with torch.no_grad():
        expected, plain = outer(mine), [outer(x) for x in theirs]
    got: list[torch.Tensor] = []
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            assert model.inside.wait(timeout=WAIT)
            with torch.no_grad():
                got.extend(outer(x) for x in theirs)
        except BaseException as error:
            errors.append(error)
        finally:
            model.go_on.set()

    recorder = Recorder()
    model.held = threading.get_ident()
    model.depths.clear()
    before = stack_depth()
    other = threading.Thread(target=serve)
    with torch.no_grad(), OpWatcher(outer, [("0", model)], recorder):
        other.start()
        out = outer(mine)
    other.join(timeout=2 * WAIT)
    assert errors == []
    assert all(torch.equal(a, b) for a, b in zip(got, plain, strict=True))
    assert len(got) == 40
    assert torch.equal(out, expected)
    assert recorder.calls == [("0", 0, "softmax", 0), ("0", 0, "mul", 0)]
    assert recorder.threads == {threading.get_ident()}
    assert recorder.outputs[("0", 0, "mul", 0)].shape == (3, 4)
    assert model.depths[threading.get_ident()] == [before + 1], "the owner's mode was on"
    assert model.depths[other.ident or 0] == [before] * 40, "the other thread never had a mode"


def test_coexists_with_a_captures_copy_on_write_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keeper, "EAGER_COPY_BYTES", 0)  # watch the conv's output: the guard is pushed mid-forward

    class InPlace(Tracked):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.conv = nn.Conv2d(3, 3, 3, padding=1)
            self.shortcut = nn.Conv2d(3, 3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.conv(x)
            out.relu_()
            out += self.shortcut(x)
            return out

    model = InPlace()
    x = image()
    with torch.no_grad():
        conv = model.conv(x)
        expected = torch.relu(conv) + model.shortcut(x)
    before = stack_depth()
    recorder = Recorder()
    with torch.no_grad(), hs.capture(model, "conv") as cap, OpWatcher(model, [("", model)], recorder):
        model(x)
    assert stack_depth() == before
    assert torch.equal(cap["conv"], conv), "the guard saw relu_ write into the captured output"
    assert recorder.ops("") == ["relu_#0", "add_#0"]
    assert torch.equal(recorder.outputs[("", 0, "relu_", 0)], torch.relu(conv))
    assert torch.equal(recorder.outputs[("", 0, "add_", 0)], expected)


@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_under_torch_compile_watched_modules_run_eagerly_and_report_their_ops() -> None:
    torch._dynamo.reset()
    model = Net()
    x = image()
    expected, eager = Recorder(), Recorder()
    with OpWatcher(model, [("head", model.head)], eager):
        plain = model(x)
    compiled = torch.compile(model, backend="eager")
    before = stack_depth()
    try:
        with OpWatcher(compiled, hs.select(compiled, "head"), expected):
            out = compiled(x)
        assert stack_depth() == before
        assert raw_hook_count(model) == 0
        assert "forward" not in model.head.__dict__
        assert "_call_impl" not in model.head.__dict__
        assert expected.ops("head") == eager.ops("head") == ["relu#0", "mul#0", "softmax#0"]
        assert torch.equal(out, plain)
    finally:
        torch._dynamo.reset()


# -- transformers ---------------------------------------------------------------------------------


@pytest.mark.transformers
def test_gpt2_eager_softmax_is_the_attention_pattern() -> None:
    model = attention_gpt2("eager")
    recorder = Recorder()
    with torch.no_grad(), OpWatcher(model, hs.select(model, "h.*.attn"), recorder):
        out = model(attention_tokens(), output_attentions=True)
    for layer in (0, 1):
        pattern = recorder.outputs[(f"h.{layer}.attn", 0, "softmax", 0)]
        assert pattern.shape == (2, 2, 8, 8)
        assert torch.equal(pattern, out.attentions[layer])
    assert recorder.ops("h.0.attn").count("softmax#0") == 1
    assert "matmul#1" in recorder.ops("h.0.attn")


@pytest.mark.transformers
def test_gpt2_sdpa_lists_the_kernel_and_it_equals_eager_attention() -> None:
    eager, sdpa = attention_gpt2("eager"), attention_gpt2("sdpa")
    ops = list_ops(sdpa, attention_tokens(), layers="h.0.attn")
    names = [op.site.op_label for op in ops]
    assert "scaled_dot_product_attention#0" in names
    assert "softmax#0" not in names, "the kernel's inside is not reported"
    kernel = next(op for op in ops if op.op == "scaled_dot_product_attention")
    assert (kernel.module, kernel.call, kernel.shapes, kernel.dtypes) == (
        "h.0.attn",
        0,
        ((2, 2, 8, 16),),
        (torch.float32,),
    )
    got, want = Recorder(), Recorder()
    with torch.no_grad():
        with OpWatcher(sdpa, hs.select(sdpa, "h.0.attn"), got):
            sdpa(attention_tokens())
        with OpWatcher(eager, hs.select(eager, "h.0.attn"), want):
            eager(attention_tokens())
    heads = got.outputs[("h.0.attn", 0, "scaled_dot_product_attention", 0)]
    torch.testing.assert_close(heads, want.outputs[("h.0.attn", 0, "matmul", 1)], rtol=0, atol=1e-6)


# -- discovery ------------------------------------------------------------------------------------


def test_list_ops_lists_every_module_s_own_ops_in_order() -> None:
    model = Net().train()
    x = image()
    ops = list_ops(model, x)
    assert [op.site.short for op in ops] == [
        "block.conv:op[conv2d#0]",
        "block:op[relu#0]",
        "block.shortcut:op[conv2d#0]",
        "block:op[add_#0]",
        "block:op[add#0]",
        "(root):op[mean#0]",
        "head.fc:op[linear#0]",
        "head:op[relu#0]",
        "head.fc#1:op[linear#0]",
        "head:op[mul#0]",
        "head:op[softmax#0]",
    ]
    assert {op.shapes for op in ops[:5]} == {((2, 3, 5, 5),)}
    assert (ops[5].shapes, ops[-1].shapes, ops[-1].dtypes) == (((2, 3),), ((2, 3),), (torch.float32,))
    assert model.training, "modes restored"
    assert hs.attached(model) == []
    assert [str(op) for op in list_ops(model, x, layers="head", children=True)] == [
        "head#0:op[linear#0]",
        "head#0:op[relu#0]",
        "head#0:op[linear#1]",
        "head#0:op[mul#0]",
        "head#0:op[softmax#0]",
    ]


def test_layers_lists_op_sites_in_a_second_table(golden: Golden) -> None:
    model = Net()
    table = hs.layers(model, image(), ops=True)
    golden.check("layers_ops_net.txt", str(table))
    assert table.ops is not None
    assert [str(op) for op in table.ops] == [str(op) for op in list_ops(model, image())]
    assert "head.fc#1:op[linear#0]" in str(table), "a module called twice shows its call"
    assert "<td" in table._repr_html_().split("op sites")[1]
    only = hs.layers(model, image(), ops="head")
    assert [op.site.short for op in only.ops or []] == ["head:op[relu#0]", "head:op[mul#0]", "head:op[softmax#0]"]
    assert hs.layers(model, image()).ops is None
    with pytest.raises(hs.SpecError, match=r"give a sample input, e\.g\. hs\.layers\(model, x, ops=True\)"):
        hs.layers(model, ops=True)
    with pytest.raises(hs.SpecError, match="ops= is layers' own option"):
        hs.layers(model, image(), ops=torch.ones(1))  # type: ignore[arg-type]


def test_a_function_whose_name_is_no_identifier_gets_one_a_site_can_hold() -> None:
    from hookscope._core.op_sites import OpSite, op_name

    strange = lambda x: x  # noqa: E731
    assert op_name(strange) == "lambda"
    assert str(OpSite("fc", 0, op_name(strange), 0)) == "fc#0:op[lambda#0]"


def test_features_without_op_sites_say_so_for_an_op_selector() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Softmax(dim=-1))
    said = r"names a value inside a module \(an op site\), which hs.capture, hs.edit, hs.trace\(ops=...\)"
    with pytest.raises(hs.SelectionError, match=said):
        hs.trace(model, torch.ones(1, 2), layers="1:op[softmax#0]")
    with pytest.raises(hs.SelectionError, match=said):
        hs.watch_grads(model, layers="1:op[softmax#0]")


def test_a_watched_model_is_not_copied_silently_and_copies_freely_after() -> None:
    import copy
    import pickle

    model = Net()
    with OpWatcher(model, [("head", model.head)], Recorder()):
        with pytest.raises(hs.HookscopeError, match=r"being copied while hookscope.ops is attached.*copy the model"):
            copy.deepcopy(model)
        with pytest.raises((hs.HookscopeError, AttributeError, TypeError)):
            pickle.dumps(model)  # hooks' closures never pickle; a wrapper met first says why
    with (
        hs.capture(model, "head"),
        pytest.raises(hs.HookscopeError, match=r"being copied while hookscope.capture is attached"),
    ):
        copy.deepcopy(model)  # module hooks alone: the copy would report into the capture
    twin = copy.deepcopy(model)
    assert "forward" not in twin.head.__dict__
    with torch.no_grad():
        twin.head.fc.weight.zero_()  # the copy computes with its own weights, not the original's
        assert not torch.equal(twin(image()), model(image()))
