"""hs.watch_grads: per-call gradients equal autograd's, across steps, with the flags the summary raises."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import hookscope as hs
from hookscope.errors import SpecError
from tests.models import LinearInplaceReLU, SharedTwice, gpt2_input, tiny_gpt2, track


def norms(step: hs.GradStep, what: str) -> dict[str, float]:
    return {f"{r.layer}:{r.leaf}": r.norm for r in step.records if r.what == what}


def test_inplace_relu_gradients_equal_autograd() -> None:
    torch.manual_seed(0)
    model = LinearInplaceReLU()
    x = torch.randn(6, 4)
    weights = torch.randn(6, 4)
    with hs.watch_grads(model) as monitor:
        (model(x) * weights).sum().backward()
        step = monitor.step()
    assert step is not None
    fc_out = model.fc(x)
    act_out = torch.relu(fc_out)
    want_fc, want_act = torch.autograd.grad((act_out * weights).sum(), [fc_out, act_out])
    got = norms(step, "grad_output")
    assert got["fc#0:output"] == pytest.approx(want_fc.norm().item(), rel=1e-6)  # before the in-place ReLU
    assert got["act#0:output"] == pytest.approx(want_act.norm().item(), rel=1e-6)
    assert norms(step, "grad_input")["act#0:input[0]"] == pytest.approx(want_fc.norm().item(), rel=1e-6)
    max_abs = {r.layer: r.max_abs for r in step.of("grad_output")}
    assert max_abs["fc#0"] == pytest.approx(want_fc.abs().max().item())


@dataclass
class Halves:
    left: torch.Tensor
    right: torch.Tensor


class SplitHalves(nn.Module):
    def forward(self, x: torch.Tensor) -> Halves:
        left, right = x.chunk(2, dim=-1)
        return Halves(left * 2, right * 3)


class UsesDataclass(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.split = SplitHalves()
        track(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        halves = self.split(self.fc(x))
        return halves.left.sum(-1) * halves.right.sum(-1)


def test_dataclass_outputs_get_gradients() -> None:
    torch.manual_seed(0)
    model = UsesDataclass()
    x = torch.randn(3, 4)
    with hs.watch_grads(model, layers="split") as monitor:
        model(x).sum().backward()
        step = monitor.step()
    assert step is not None
    halves = model.split(model.fc(x))
    want_left, want_right = torch.autograd.grad(
        (halves.left.sum(-1) * halves.right.sum(-1)).sum(), [halves.left, halves.right]
    )
    got = norms(step, "grad_output")
    assert got["split#0:output.left"] == pytest.approx(want_left.norm().item(), rel=1e-6)
    assert got["split#0:output.right"] == pytest.approx(want_right.norm().item(), rel=1e-6)


def test_a_module_called_twice_gets_one_record_per_call() -> None:
    torch.manual_seed(0)
    model = SharedTwice()
    x = torch.randn(5, 4)
    with hs.watch_grads(model, layers="shared", params=False) as monitor:
        model(x).pow(2).sum().backward()
        step = monitor.step()
    assert step is not None
    first = model.shared(x)
    second = model.shared(torch.relu(first))
    want_first, want_second = torch.autograd.grad(model.head(second).pow(2).sum(), [first, second])
    got = norms(step, "grad_output")
    assert got == pytest.approx(
        {"shared#0:output": want_first.norm().item(), "shared#1:output": want_second.norm().item()}, rel=1e-6
    )


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        self.head = nn.Linear(4, 1)
        track(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = checkpoint(self.block, x, use_reentrant=self.reentrant)
        out: torch.Tensor = self.head(hidden)
        return out


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_blocks_are_counted_once(reentrant: bool) -> None:
    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    x = torch.randn(3, 4, requires_grad=True)
    with hs.watch_grads(model, params=False) as monitor:
        model(x).sum().backward()
        step = monitor.step()
    assert step is not None
    counts = {r.layer: r.count for r in step.of("grad_output")}
    assert {"block.0#0", "block.1#0", "block.2#0", "head#0"} <= set(counts)
    assert counts["block.0#0"] == 3 * 4  # one call's gradient, not two merged
    inner = model.block[0](x)
    want = torch.autograd.grad(model.head(model.block[2](torch.tanh(inner))).sum(), inner)[0]
    assert norms(step, "grad_output")["block.0#0:output"] == pytest.approx(want.norm().item(), rel=1e-6)


@pytest.mark.transformers
def test_gpt2_block_gradients_equal_autograd() -> None:
    model = tiny_gpt2()  # eval mode: no dropout, so the reference forward is the same function
    ids = gpt2_input()
    with hs.watch_grads(model, layers=["h.*", "ln_f"], params=False) as monitor:
        model(input_ids=ids).last_hidden_state.pow(2).mean().backward()
        step = monitor.step()
    assert step is not None
    captured: dict[str, torch.Tensor] = {}
    hooks = [
        model.get_submodule(name).register_forward_hook(
            lambda _m, _a, out, name=name: captured.__setitem__(name, out[0] if isinstance(out, tuple) else out)
        )
        for name in ("h.0", "h.1.mlp")
    ]
    try:
        loss = model(input_ids=ids).last_hidden_state.pow(2).mean()
    finally:
        for hook in hooks:
            hook.remove()
    want = torch.autograd.grad(loss, [captured["h.0"], captured["h.1.mlp"]])
    got = {r.layer: r.norm for r in step.of("grad_output") if r.path in ("", "[0]")}
    assert got["h.0#0"] == pytest.approx(want[0].norm().item(), rel=1e-5)
    assert got["h.1.mlp#0"] == pytest.approx(want[1].norm().item(), rel=1e-5)


class NaNBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        out = grad.clone()
        out.view(-1)[0] = math.nan
        return out


class PoisonsBackward(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = NaNBackward.apply(x)
        return out


@pytest.mark.parametrize("k", [0, 2, 4])
def test_a_nan_made_in_one_layers_backward_is_traced_to_it(k: int) -> None:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(6):
        layers += [nn.Linear(8, 8), PoisonsBackward() if i == k else nn.Identity(), nn.Tanh()]
    model = track(nn.Sequential(*layers))
    with hs.watch_grads(model) as monitor:
        model(torch.randn(4, 8)).sum().backward()
        monitor.step()
    summary = monitor.summary()
    assert summary.layers("nonfinite") == [f"{3 * k + 1}#0"]
    assert "first NaN/Inf in backward order" in str(summary)


def deep_sigmoid_mlp(std: float | None) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(20):
        linear = nn.Linear(16, 16)
        if std is not None:
            nn.init.normal_(linear.weight, std=std)
            nn.init.zeros_(linear.bias)
        layers += [linear, nn.Sigmoid()]
    return track(nn.Sequential(*layers))


def train(model: nn.Module, monitor: hs.GradMonitor, steps: int, x: torch.Tensor | None = None) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        batch = x if x is not None else torch.randn(8, 16, generator=generator)
        model(batch).pow(2).mean().backward()
        monitor.step()
        optimizer.step()
        optimizer.zero_grad()


def test_a_deep_sigmoid_mlp_with_small_weights_is_flagged_vanishing() -> None:
    model = deep_sigmoid_mlp(std=0.01)
    with hs.watch_grads(model, layers=nn.Linear) as monitor:
        train(model, monitor, 3)
    vanishing = monitor.summary().layers("vanishing")
    assert "0#0" in vanishing  # the first layers get almost nothing back
    assert "38#0" not in vanishing  # the last layer is the reference


def test_a_huge_weight_is_flagged_exploding() -> None:
    torch.manual_seed(0)
    model = track(nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 1)))
    with torch.no_grad():
        model[2].weight.mul_(1e6)
    with hs.watch_grads(model) as monitor:
        train(model, monitor, 2)
    summary = monitor.summary()
    assert "1#0" in summary.layers("exploding")  # the gradient entering the tanh is scaled by 1e6


def _scaled_head_run(scales: list[float]) -> hs.GradSummary:
    """Three linears trained with the last one's weight set to ``scales[step]`` of its start:
    the gradients reaching the first two follow that scale."""
    torch.manual_seed(0)
    model = track(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 1)))
    start = model[2].weight.detach().clone()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    with hs.watch_grads(model, params=False) as monitor:
        for scale in scales:
            with torch.no_grad():
                model[2].weight.copy_(start * scale)
            model(x).pow(2).mean().backward()
            monitor.step()
            model.zero_grad()
    return monitor.summary()


def test_growth_that_brings_a_layer_to_the_networks_size_is_exploding() -> None:
    summary = _scaled_head_run([1.0, 3.0, 9.0, 27.0, 81.0])  # every gradient grows 81x in 5 steps
    assert {"0#0", "1#0"} <= set(summary.layers("exploding"))


def test_a_layer_recovering_from_vanishing_is_not_exploding() -> None:
    summary = _scaled_head_run([1e-9, 1e-9, 1e-9, 1e-9, 1e-3])  # 1e-9 of the others, then 1e-3
    assert "1#0" in summary.layers("vanishing")  # it was vanishing ...
    assert "1#0" not in summary.layers("exploding")  # ... and grew a millionfold, still far below the rest


def test_a_relu_fed_negative_bias_is_flagged_dead() -> None:
    torch.manual_seed(0)
    model = track(nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 1)))
    with torch.no_grad():
        model[0].bias[[1, 5]] = -100.0  # channels 1 and 5 never fire
    with hs.watch_grads(model, dead_window=3) as monitor:
        train(model, monitor, 3)
    dead = monitor.summary().of("dead")
    assert [(flag.layer, flag.detail) for flag in dead] == [("1#0", "2 channels zero for every sample: 1, 5")]
    assert monitor.records[-1].dead == {"1#0": [1, 5]}


def test_every_n_records_only_those_steps() -> None:
    torch.manual_seed(0)
    model = track(nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)))
    hooked: list[int] = []
    with hs.watch_grads(model, every=3) as monitor:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        for index in range(7):
            out = model(torch.randn(4, 16))
            hooked.append(len(out._backward_hooks or {}))  # tensor hooks on the model's output
            out.sum().backward()
            result = monitor.step()
            assert (result is not None) == (index % 3 == 0)
            optimizer.step()
            optimizer.zero_grad()
    assert [step.step for step in monitor.records] == [0, 3, 6]
    assert hooked == [1, 0, 0, 1, 0, 0, 1]  # skipped steps hook nothing
    frame = monitor.history
    assert list(frame.index) == [0, 3, 6]
    assert list(frame.columns) == ["0#0", "1#0", "2#0"]
    assert monitor.history_of("ratio", what="param").shape == (3, 4)


def test_parameter_records_give_norm_and_ratio() -> None:
    torch.manual_seed(0)
    model = track(nn.Sequential(nn.Linear(4, 3)))
    with hs.watch_grads(model, activations=False) as monitor:
        model(torch.randn(2, 4)).sum().backward()
        step = monitor.step()
    assert step is not None
    weight = {r.path: r for r in step.of("param")}["0.weight"]
    assert weight.norm == pytest.approx(model[0].weight.grad.norm().item(), rel=1e-6)  # type: ignore[union-attr]
    assert weight.ratio == pytest.approx(weight.norm / model[0].weight.norm().item(), rel=1e-6)
    assert step.of("grad_output") == []


def test_bad_arguments() -> None:
    model = track(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(SpecError, match="every=0"):
        hs.watch_grads(model, every=0)
    with pytest.raises(SpecError, match="watch nothing"):
        hs.watch_grads(model, params=False, activations=False)
    with pytest.raises(hs.SelectionError, match="matched 0 of 2 modules"):
        hs.watch_grads(model, layers="1")
    with hs.watch_grads(model) as monitor:
        pass
    with pytest.raises(SpecError, match="vanishing"):
        monitor.summary(vanishing=2.0)


def test_the_same_mlp_initialised_for_the_sigmoid_is_not_flagged() -> None:
    model = deep_sigmoid_mlp(std=8 / math.sqrt(16))  # four times LeCun's: the sigmoid's slope is 1/4
    with hs.watch_grads(model, layers=nn.Linear) as monitor:
        train(model, monitor, 3)
    assert monitor.summary().layers("vanishing") == []


@pytest.mark.slow
def test_plots_draw_the_recorded_steps(tmp_path: Any) -> None:
    from matplotlib.image import imread

    model = deep_sigmoid_mlp(std=0.5)
    with hs.watch_grads(model) as monitor:
        train(model, monitor, 3)
    flow = hs.plots.grad_flow(monitor)
    assert len(flow.axes) == 1
    axis = flow.axes[0]
    assert axis.get_yscale() == "log"
    assert len(axis.get_xticklabels()) == 40  # 20 Linear + 20 Sigmoid calls, forward order
    assert axis.get_xticklabels()[0].get_text() == "0#0"
    history = hs.plots.grad_history(monitor, layers=["0#0", "38#0"])
    assert [line.get_label() for line in history.axes[0].get_lines()] == ["0#0", "38#0"]
    for name, figure in (("flow.png", flow), ("history.png", history)):
        figure.savefig(tmp_path / name)
        pixels = imread(tmp_path / name)
        assert pixels.std() > 0.05, f"{name} looks blank"
    with pytest.raises(SpecError, match="step 7 was not recorded"):
        hs.plots.grad_flow(monitor, step=7)
    with pytest.raises(hs.SiteNotFoundError, match="nothing was recorded for 'nope'"):
        hs.plots.grad_history(monitor, layers=["nope"])


def test_plots_mark_non_finite_layers() -> None:
    model = track(nn.Sequential(nn.Linear(8, 8), PoisonsBackward(), nn.Tanh()))
    with hs.watch_grads(model) as monitor:
        model(torch.randn(2, 8)).sum().backward()
        monitor.step()
    axis = hs.plots.grad_flow(monitor, what="grad_input").axes[0]
    assert any(collection.get_label() == "NaN/Inf" for collection in axis.collections)


def test_tensorboard_gets_each_step_once(tmp_path: Any) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    torch.manual_seed(0)
    model = track(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
    writer = SummaryWriter(str(tmp_path))
    with hs.watch_grads(model, every=2) as monitor:
        for _ in range(5):
            model(torch.randn(3, 4)).sum().backward()
            monitor.step()
            monitor.to_tensorboard(writer)
            monitor.to_tensorboard(writer)  # nothing new: nothing written twice
    writer.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    # hs.monitor's tag scheme, <kind>/<metric>/<name> (before: grads/param/0.weight/ratio)
    ratios = events.Scalars("param_grad/ratio/0.weight")
    assert [event.step for event in ratios] == [0, 2, 4]
    norms = {event.step: event.value for event in events.Scalars("grad/norm/2#0")}
    assert norms[4] == pytest.approx({r.layer: r.norm for r in monitor.records[-1].of("grad_output")}["2#0"])


def test_micro_batches_of_one_step_merge_per_site() -> None:
    torch.manual_seed(0)
    model = track(nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
    first, second = torch.randn(3, 4), torch.randn(5, 4)
    with hs.watch_grads(model, layers="0", params=False) as monitor:
        for batch in (first, second):
            model(batch).sum().backward()
        step = monitor.step()
    assert step is not None
    [record] = step.of("grad_output")
    outputs = [model[0](batch) for batch in (first, second)]
    grads = [torch.autograd.grad(torch.tanh(out).sum(), out)[0] for out in outputs]
    together = torch.cat([g.reshape(-1) for g in grads])
    assert record.count == together.numel()
    assert record.norm == pytest.approx(together.norm().item(), rel=1e-6)


class Looped(nn.Module):
    """One layer applied three times, each application checkpointed (reentrant or not)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.layer = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)
        track(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = checkpoint(lambda t: torch.tanh(self.layer(t)), x, use_reentrant=self.reentrant)
        out: torch.Tensor = self.head(x)
        return out


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_layer_checkpointed_in_a_loop_keeps_each_call(reentrant: bool) -> None:
    torch.manual_seed(0)
    model = Looped(reentrant)
    x = torch.randn(2, 4, requires_grad=True)
    with hs.watch_grads(model, layers="layer", params=False) as monitor:
        model(x).sum().backward()
        step = monitor.step()
    assert step is not None
    outs, hidden = [], x
    for _ in range(3):
        out = model.layer(hidden)
        outs.append(out)
        hidden = torch.tanh(out)
    want = torch.autograd.grad(model.head(hidden).sum(), outs)
    got = {r.layer: r.norm for r in step.of("grad_output")}
    assert got == pytest.approx({f"layer#{i}": want[i].norm().item() for i in range(3)}, rel=1e-6)


def test_hooks_on_leaf_tensors_come_off_each_step() -> None:
    class UsesItsWeight(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.queries = nn.Parameter(torch.randn(3, 4))
            self.mix = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mix(self.queries) @ x.T

    model = track(UsesItsWeight())
    with hs.watch_grads(model) as monitor:
        for _ in range(4):
            model(torch.randn(2, 4)).sum().backward()
            monitor.step()
            assert not model.queries._backward_hooks  # type: ignore[attr-defined]
    step = monitor.records[-1]
    assert {r.column for r in step.of("grad_input")} == {"mix#0"}


def test_keyword_inputs_get_grad_input_records() -> None:
    class TakesKeyword(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, *, hidden: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.fc(hidden)
            return out

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = TakesKeyword()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.inner(hidden=x * 2)
            return out

    model = track(Outer())
    with hs.watch_grads(model, layers="inner", params=False) as monitor:
        model(torch.randn(2, 4, requires_grad=True)).sum().backward()
        step = monitor.step()
    assert step is not None
    assert [r.column for r in step.of("grad_input")] == ["inner#0:input['hidden']"]


def test_a_nan_from_a_functional_op_is_still_flagged() -> None:
    class SqrtBetween(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            hidden = self.a(x) * 0  # sqrt'(0) is infinite
            out: torch.Tensor = self.b(hidden.sqrt())
            return out

    model = track(SqrtBetween())
    with hs.watch_grads(model) as monitor:
        model(torch.randn(2, 4)).sum().backward()
        monitor.step()
    [flag] = monitor.summary().of("nonfinite")
    assert flag.layer == "a#0"
    assert "outside the watched modules" in flag.detail


def test_nan_in_parameter_gradients_only_is_flagged() -> None:
    model = track(nn.Sequential(nn.Linear(2, 2)))
    with hs.watch_grads(model, activations=False) as monitor:
        model(torch.randn(1, 2)).sum().backward()
        model[0].weight.grad[0, 0] = math.nan  # type: ignore[index]
        monitor.step()
    [flag] = monitor.summary().of("nonfinite")
    assert flag.layer == "0.weight"


def test_a_relu_reused_at_two_widths_does_not_break_the_forward() -> None:
    class TwoWidths(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wide = nn.Linear(4, 8)
            self.narrow = nn.Linear(8, 3)
            self.act = nn.ReLU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.act(self.narrow(self.act(self.wide(x))))

    model = track(TwoWidths())
    with hs.watch_grads(model, dead_window=1) as monitor:
        model(torch.randn(5, 4)).sum().backward()
        step = monitor.step()
    assert step is not None
    assert set(step.dead) <= {"act#0", "act#1"}


def test_step_without_a_forward_records_nothing() -> None:
    model = track(nn.Sequential(nn.Linear(2, 2)))
    with hs.watch_grads(model) as monitor:
        model(torch.randn(1, 2)).sum().backward()
        assert monitor.step() is not None
        model.zero_grad(set_to_none=True)
        assert monitor.step() is None  # nothing ran and no parameter has a gradient
        model(torch.randn(1, 2)).sum().backward()
        model.zero_grad(set_to_none=False)
        assert monitor.step() is not None  # the forward ran: its records are there
    assert len(monitor.records) == 2


def test_root_parameters_are_watched() -> None:
    class WithToken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.token = nn.Parameter(torch.ones(4))
            self.fc = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.fc(x + self.token)
            return out

    model = track(WithToken())
    with hs.watch_grads(model) as monitor:
        model(torch.randn(2, 4)).sum().backward()
        step = monitor.step()
    assert step is not None
    assert {r.path for r in step.of("param")} == {"token", "fc.weight", "fc.bias"}


def test_repr_and_html() -> None:
    model = track(nn.Sequential(nn.Linear(2, 2)))
    model.add_module("<b>", nn.Identity())
    with hs.watch_grads(model) as monitor:
        assert repr(monitor) == "<GradMonitor of 2 modules: 0 steps recorded, live>"
        model(torch.randn(1, 2)).sum().backward()
        monitor.step()
    html = monitor._repr_html_()
    assert "&lt;b&gt;#0" in html
    assert "<b>#0" not in html
    assert "no gradient problems found in 1 recorded steps" in html


class Shared(nn.Module):
    """``blk`` twice and ``drop`` around ``a``, inside one reentrant checkpointed function."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.blk = nn.Linear(4, 4)
        self.a = nn.Linear(4, 4)
        self.scale = nn.Tanh()
        track(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def region(t: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.scale(self.a(self.scale(self.blk(self.blk(t)))))
            return out

        out: torch.Tensor = checkpoint(region, x, use_reentrant=self.reentrant)
        return out


def test_a_module_called_twice_in_one_checkpointed_region_keeps_its_call_numbers() -> None:
    results = {}
    for reentrant in (False, True):
        torch.manual_seed(0)
        model = Shared(reentrant)
        with hs.watch_grads(model, params=False) as monitor:
            model(torch.randn(2, 4, requires_grad=True)).pow(2).sum().backward()
            step = monitor.step()
        assert step is not None
        results[reentrant] = [(r.layer, round(r.norm, 6)) for r in step.of("grad_output")]
    assert results[True] == results[False]
    assert [layer for layer, _ in results[True]] == ["blk#0", "blk#1", "scale#0", "a#0", "scale#1"]


def test_a_no_grad_call_inside_a_training_forward_is_not_a_checkpoint() -> None:
    class Teacher(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = nn.Linear(4, 4)
            track(self)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            trained = checkpoint(self.enc, x, use_reentrant=True)
            with torch.no_grad():
                target = self.enc(x * 2)  # a frozen target, not a checkpoint
            out: torch.Tensor = (trained - target).pow(2).sum()
            return out

    torch.manual_seed(0)
    model = Teacher()
    x = torch.randn(2, 4, requires_grad=True)
    with hs.watch_grads(model, layers="enc", params=False) as monitor:
        model(x).backward()
        step = monitor.step()
    assert step is not None
    assert [r.layer for r in step.of("grad_output")] == ["enc#0"]


def test_a_whole_model_checkpointed_from_outside_is_recorded() -> None:
    torch.manual_seed(0)
    model = track(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)))
    x = torch.randn(3, 4, requires_grad=True)
    with hs.watch_grads(model, params=False) as monitor:
        checkpoint(model, x, use_reentrant=True).sum().backward()
        step = monitor.step()
    assert step is not None
    assert [r.layer for r in step.of("grad_output")] == ["0#0", "1#0", "2#0"]


def test_a_parameter_passed_in_to_every_micro_batch_is_counted_once_per_step() -> None:
    class Queries(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.queries = nn.Parameter(torch.randn(6, 4))
            self.mix = nn.Linear(4, 4)
            track(self)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mix(self.queries) @ x.T

    torch.manual_seed(0)
    model = Queries()
    batches = [torch.randn(3, 4), torch.randn(3, 4)]
    with hs.watch_grads(model, layers="mix", params=False) as monitor:
        for batch in batches:
            model(batch).sum().backward()
        step = monitor.step()
    assert step is not None
    [record] = step.of("grad_input")
    each = [torch.autograd.grad(model(batch).sum(), model.queries)[0] for batch in batches]
    assert record.count == 2 * 24  # both micro-batches' gradients, each counted once
    assert record.norm == pytest.approx(math.sqrt(sum(g.pow(2).sum().item() for g in each)), rel=1e-6)


def test_dead_unit_windows_start_over_for_calls_that_stop_running() -> None:
    class Variable(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.act = nn.ReLU()
            self.times = 3
            track(self)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(self.times):
                x = self.act(self.fc(x)) - 1  # from the second call on, everything is negative
            return x

    torch.manual_seed(0)
    model = Variable()
    with hs.watch_grads(model, dead_window=2) as monitor:
        for times in (3, 3, 1, 1):
            model.times = times
            model(torch.randn(5, 4)).sum().backward()
            monitor.step()
    assert "act#2" in monitor.records[1].dead
    assert "act#2" not in monitor.records[3].dead


def test_all_zero_gradients_are_flagged() -> None:
    model = track(nn.Sequential(nn.Linear(2, 2), nn.Tanh()))
    with hs.watch_grads(model) as monitor:
        (model(torch.randn(3, 2)) * 0).sum().backward()
        monitor.step()
    assert set(monitor.summary().layers("vanishing")) == {"0#0", "1#0"}


def test_grad_history_takes_every_spelling_a_cache_key_takes() -> None:
    torch.manual_seed(0)
    model = SharedTwice()
    x = torch.randn(3, 4)
    with hs.watch_grads(model) as monitor:
        for _ in range(2):
            model(x).pow(2).sum().backward()
            monitor.step()
    first = model.shared(x)
    second = model.shared(torch.relu(first))
    out = model.head(second)
    wanted = torch.autograd.grad(out.pow(2).sum(), [out, second, first])  # autograd's, no hooks
    keys = ["head", "shared", "shared#0", "shared#1:output", "shared#0:output"]
    figure = hs.plots.grad_history(monitor, layers=keys)
    lines = figure.axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["head#0", "shared#1", "shared#0"]  # "shared": its last call
    for line, grad in zip(lines, wanted, strict=True):
        assert list(line.get_ydata()) == pytest.approx([grad.norm().item()] * 2, rel=1e-5)
    params = hs.plots.grad_history(monitor, layers=["head.weight"], what="param")
    assert [line.get_label() for line in params.axes[0].get_lines()] == ["head.weight"]


def test_grad_history_names_the_closest_recorded_layers_on_a_miss() -> None:
    model = SharedTwice()
    with hs.watch_grads(model) as monitor:
        model(torch.randn(3, 4)).sum().backward()
        monitor.step()
    with pytest.raises(hs.SiteNotFoundError, match="nothing was recorded for 'heads'; did you mean 'head'") as info:
        hs.plots.grad_history(monitor, layers=["heads"])
    assert info.value.candidates == ("head",)
    with pytest.raises(hs.SiteNotFoundError, match=r"call 2 was not recorded; calls kept: \[0, 1\]"):
        hs.plots.grad_history(monitor, layers=["shared#2"])
    with pytest.raises(hs.SiteNotFoundError, match="did you mean 'head.weight'"):
        hs.plots.grad_history(monitor, layers=["head.wieght"], what="param")
