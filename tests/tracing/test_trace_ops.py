"""Op sites in a trace (issue 19, item 2): ``hs.trace(model, x, ops="h.*.attn:op[softmax]")``.

Every reference here is computed without hookscope: by hand (the residual sum), by the eager
GPT-2's own ``output_attentions``, or by a bare ``TorchFunctionMode`` listing the torch calls;
statistics in numpy float64.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional
from torch.overrides import TorchFunctionMode

import hookscope as hs
from hookscope.errors import SpecError
from tests.cli.test_cli import run_cli
from tests.models import attention_gpt2, attention_tokens, track


class Residual(nn.Module):
    """``relu(fc(x)) + x``: a residual add that no module hook sees."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)) + x


class Net(nn.Module):
    """A residual block called twice, then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Residual()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.block(x)))


class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x) * 2


class Fails(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(x)
        raise ValueError(f"broken after tanh of {tuple(y.shape)}")


class Calls(TorchFunctionMode):
    """The torch functions called while it is on, by name (no hookscope involved)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        output = func(*args, **(kwargs or {}))
        if isinstance(output, torch.Tensor):
            self.names.append(getattr(func, "__name__", ""))
        return output


def function_modes() -> int:
    return int(torch._C._len_torch_function_stack())


def reference(values: torch.Tensor) -> dict[str, float]:
    """The trace's statistics of ``values``, in float64 numpy."""
    array = values.detach().double().numpy().ravel()
    return {
        "min": array.min(),
        "max": array.max(),
        "mean": array.mean(),
        "std": array.std(ddof=1),
        "abs_mean": np.abs(array).mean(),
        "zero_frac": np.mean(array == 0),
    }


def assert_stats(row: hs.TraceRow, values: torch.Tensor) -> None:
    stats = row.stats
    assert stats is not None
    assert stats.count == values.numel()
    for field, expected in reference(values).items():
        assert getattr(stats, field) == pytest.approx(expected, rel=1e-5, abs=1e-7), field


def net() -> Net:
    torch.manual_seed(0)
    return track(Net().eval())  # type: ignore[return-value]


def test_the_residual_add_row_holds_the_statistics_of_the_hand_computed_sum() -> None:
    model, x = net(), torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    traced = hs.trace(model, x, ops="block:op[add]")
    with torch.no_grad():  # by hand: the sum the block's forward returns, each call
        first = torch.relu(model.block.fc(x)) + x
        second = torch.relu(model.block.fc(first)) + first
    rows = [row for row in traced if row.op]
    assert [row.site for row in rows] == ["block#0:op[add#0]", "block#1:op[add#0]"]
    assert_stats(rows[0], first)
    assert_stats(rows[1], second)
    assert [info.shape for info in rows[0].inputs] == [(5, 4), (5, 4)]
    assert rows[0].outputs[0].shape == (5, 4)
    assert rows[0].outputs[0].dtype == "float32"
    assert traced["block:op[add#0]"] is rows[0]
    assert traced["block#1:op[add#0]"] is rows[1]
    assert traced.calls("block:op[add#0]") == rows
    assert [row.order for row in traced.calls("block")] == [1, 4]  # module calls only


def test_op_rows_sit_under_their_module_call_in_execution_order() -> None:
    model, x = net(), torch.randn(5, 4)
    traced = hs.trace(model, x, ops=["block:op[relu]", "block:op[add]"])
    shown = [(row.called_as(numbered=True), row.depth, row.parent) for row in traced]
    assert shown == [
        ("(root)#0", 0, None),
        ("block#0", 1, 0),
        ("block.fc#0", 2, 1),
        ("block#0:op[relu#0]", 2, 1),
        ("block#0:op[add#0]", 2, 1),
        ("block#1", 1, 0),
        ("block.fc#1", 2, 5),
        ("block#1:op[relu#0]", 2, 5),
        ("block#1:op[add#0]", 2, 5),
        ("head#0", 1, 0),
    ]
    assert [row.order for row in traced] == list(range(len(traced)))
    finished = sorted(traced, key=lambda row: row.finished or 0)  # an op returns before its module
    assert [row.site for row in finished[:4]] == ["block.fc#0", "block#0:op[relu#0]", "block#0:op[add#0]", "block#0"]
    assert "10 calls (4 op calls) · 4 modules" in traced.table()
    relu = traced["block:op[relu#0]"]
    assert relu.inputs[0].source == "block.fc#0"  # what fed the op, by the row that made it
    assert traced["head"].inputs[0].source == "block#1:op[add#0]"
    assert relu.class_name == "op"
    assert relu.params == 0


def test_ops_true_rows_are_the_torch_calls_a_bare_function_mode_sees() -> None:
    model, x = net(), torch.randn(3, 4)
    calls = Calls()
    with torch.no_grad(), calls:
        model(x)
    traced = hs.trace(model, x, ops=True)
    names = [row.op.split("#")[0] for row in traced if row.op]
    assert names == [{"__add__": "add"}.get(name, name) for name in calls.names]
    assert names == ["linear", "relu", "add", "linear", "relu", "add", "linear"]
    fc = traced["block.fc:op[linear#0]"]
    assert fc.parent == traced["block.fc"].order
    assert fc.depth == traced["block.fc"].depth + 1
    assert hs.trace(model, x, ops=True, layers="block").rows[0].name == "block"  # layers= bounds ops=True
    outside = hs.trace(model, x, layers="head", ops="block#1:op[add]")  # an op site's module is traced too
    assert [row.called_as(numbered=True) for row in outside] == ["block#0", "block#1", "block#1:op[add#0]", "head#0"]
    assert [row.parent for row in outside] == [None, None, 1, None]


def test_csv_json_and_table_show_the_op_rows(tmp_path: Path) -> None:
    model, x = net(), torch.randn(3, 4)
    traced = hs.trace(model, x, ops="block#1:op[add]")
    records = list(csv.DictReader(traced.to_csv().splitlines()))
    op_rows = [record for record in records if record["op"]]
    assert [(r["name"], r["call"], r["op"], r["class"]) for r in op_rows] == [("block", "1", "add#0", "op")]
    assert float(op_rows[0]["max"]) == pytest.approx(traced["block#1:op[add#0]"].stats.max)  # type: ignore[union-attr]
    document = json.loads(traced.to_json())
    assert [row["op"] for row in document["rows"]].count("add#0") == 1
    text = traced.table()
    assert "block#1:op[add#0]" in text
    assert "block#1:op[add#0]" in traced.table(filter="block")  # a module's filter keeps its op rows
    assert "op[add" not in traced.table(filter="head")


def test_first_nonfinite_blames_the_op_that_made_the_nan() -> None:
    model = track(nn.Sequential(nn.Identity(), Log(), nn.Linear(3, 2)))
    x = torch.tensor([[1.0, -2.0, 3.0]])
    assert torch.log(x).isnan().any()  # the log of -2 is the culprit, by hand
    assert hs.trace(model, x).first_nonfinite().site == "1#0"  # type: ignore[union-attr]
    found = hs.trace(model, x, ops="1:op[*]").first_nonfinite()
    assert found is not None
    assert (found.site, found.name, found.op, found.from_input, found.nan) == ("1#0:op[log#0]", "1", "log#0", False, 1)
    assert "'1:op[log#0]'" in repr(found)
    # allow= takes a module's NaN as intended, from its ops too: the next call is blamed, as without ops
    plain, with_ops = hs.trace(model, x).first_nonfinite(allow="1"), hs.trace(model, x, ops="1:op[*]")
    allowed = with_ops.first_nonfinite(allow="1")
    assert plain is not None
    assert allowed is not None
    assert with_ops["2"].inputs[0].source == "1#0:op[mul#0]"
    assert (allowed.site, allowed.from_input) == (plain.site, plain.from_input) == ("2#0", False)


def test_a_selector_that_never_fired_raises_and_leaves_nothing_behind() -> None:
    model, x = net(), torch.randn(3, 4)
    with pytest.raises(SpecError, match=r"'block:op\[softmax\]' matched no op call of 'block'.*relu, add"):
        hs.trace(model, x, ops="block:op[softmax]")
    assert hs.attached(model) == []
    assert function_modes() == 0
    with pytest.raises(SpecError, match="ran 1 time"):  # the op ran, the index did not
        hs.trace(model, x, ops="block:op[add#1]")
    assert hs.trace(model, x, ops="block#1:op[add]")["block#1:op[add#0]"].call == 1


def test_a_forward_that_raises_keeps_the_op_rows_and_leaves_no_hook_or_mode() -> None:
    model = track(nn.Sequential(nn.Linear(2, 3), Fails()))
    with hs.tracing(model, ops="1:op[tanh]") as tracer, pytest.raises(ValueError, match="broken after tanh"):
        model(torch.ones(4, 2))
    assert function_modes() == 0
    assert hs.attached(model) == []
    partial = tracer.trace
    assert partial.failure is not None
    assert partial.failure.name == "1"
    assert partial["1:op[tanh#0]"].finished is not None
    with torch.no_grad():
        assert_stats(partial["1:op[tanh#0]"], torch.tanh(model[0](torch.ones(4, 2))))


def test_every_form_takes_ops_and_refuses_a_module_selector() -> None:
    model, x = net(), torch.randn(3, 4)
    out, traced = hs.run_with_trace(model, x, options=hs.TraceOptions(ops=["head:op[linear]"]))
    assert_stats(traced["head:op[linear#0]"], out)  # the head's linear is what the model returns
    assert hs.TraceOptions(ops="head:op[linear]").ops == ("head:op[linear]",)
    assert hs.TraceOptions(ops=["a:op[x]"]) == hs.TraceOptions.from_dict(hs.TraceOptions(ops=("a:op[x]",)).to_dict())
    with pytest.raises(SpecError, match="ops= takes op selectors.*not 'head'"):
        hs.trace(model, x, ops="head")
    with pytest.raises(SpecError, match="expected True"):
        hs.TraceOptions(ops=[])
    with pytest.raises(SpecError, match="is not of the form"):
        hs.TraceOptions(ops="head:op[]")
    with hs.tracing(model, ops="block:op[add]", passes="all") as tracer:
        model(x)
        model(x[:1])
    assert [t["block#1:op[add#0]"].outputs[0].shape for t in tracer.passes] == [(3, 4), (1, 4)]
    shapes_only = hs.trace(model, x, ops="block:op[add]", stats=False)
    assert shapes_only["block:op[add#0]"].stats is None
    assert shapes_only["block:op[add#0]"].outputs[0].shape == (3, 4)


@pytest.mark.slow
@pytest.mark.transformers
def test_gpt2_eager_softmax_rows_hold_the_statistics_of_output_attentions() -> None:
    model, ids = attention_gpt2("eager"), attention_tokens()
    with torch.no_grad():
        expected = model(ids, output_attentions=True).attentions  # the model's own, no hookscope
    traced = hs.trace(model, ids, ops="h.*.attn:op[softmax]")
    for layer in (0, 1):
        row, attn = traced[f"h.{layer}.attn:op[softmax#0]"], traced[f"h.{layer}.attn"]
        assert row.outputs[0].shape == tuple(expected[layer].shape)
        assert (row.parent, row.depth) == (attn.order, attn.depth + 1)
        assert_stats(row, expected[layer])
    assert sum(1 for row in traced if row.op) == 2


@pytest.mark.slow
@pytest.mark.transformers
def test_gpt2_sdpa_pattern_rows_equal_the_eager_models_attention_weights() -> None:
    ids = attention_tokens()
    with torch.no_grad():
        expected = attention_gpt2("eager")(ids, output_attentions=True).attentions
    model = attention_gpt2("sdpa")
    traced = hs.trace(model, ids, ops="h.*.attn:attn.pattern")
    for layer in (0, 1):
        row = traced[f"h.{layer}.attn:attn.pattern"]
        assert (row.site, row.class_name) == (f"h.{layer}.attn#0:attn.pattern", "attention")
        assert_stats(row, expected[layer])
    with pytest.raises(SpecError, match="attn_implementation='sdpa'"):  # eager attention calls no kernel
        hs.trace(attention_gpt2("eager"), ids, ops="h.0.attn:attn.pattern")


def test_cli_trace_ops_rows_in_table_and_csv(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_csv = tmp_path / "t.csv"
    code, out, err = run_cli(capsys, "trace", "demo:cnn", "--ops", "(root):op[flatten]", "--csv", str(out_csv))
    assert code == 0, err
    assert "(root):op[flatten#0]" in out
    rows = list(csv.DictReader(out_csv.read_text().splitlines()))
    assert [(row["name"], row["op"]) for row in rows if row["op"]] == [("", "flatten#0")]


@pytest.mark.parametrize(
    ("selector", "message"),
    [
        ("conv1:op[mul]", "'conv1:op[mul]' matched no op call of 'conv1', which ran and called: conv2d"),
        ("conv1", "ops= takes op selectors"),
        ("fc:op[linear],conv9:op[conv2d]", "did you mean 'conv1'"),
    ],
)
def test_cli_trace_refuses_op_selectors_that_select_nothing(
    capsys: pytest.CaptureFixture[str], selector: str, message: str
) -> None:
    code, _, err = run_cli(capsys, "trace", "demo:cnn", "--ops", selector)
    assert (code, message in err) == (2, True), err


def test_functional_ops_inside_a_module_are_numbered_per_call() -> None:
    class Twice(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return functional.softmax(functional.softmax(x, dim=-1) * 3, dim=-1)

    model = track(nn.Sequential(Twice()))
    x = torch.randn(2, 5)
    traced = hs.trace(model, x, ops="0:op[softmax*]")
    with torch.no_grad():
        inner = functional.softmax(x, dim=-1)
    assert [row.op for row in traced if row.op] == ["softmax#0", "softmax#1"]
    assert_stats(traced["0:op[softmax#0]"], inner)
    assert_stats(traced["0:op[softmax#1]"], functional.softmax(inner * 3, dim=-1))


def test_max_depth_keeps_the_op_rows_asked_for() -> None:
    model, x = net(), torch.randn(3, 4)
    traced = hs.trace(model, x, ops=["block:op[add]", "block.fc:op[linear]"])
    shown = traced.table(max_depth=1)
    for row in traced:
        if row.op:  # op rows sit one deeper than their module, yet were asked for
            assert row.depth >= 2
            assert row.called_as(numbered=True) in shown
    assert "block.fc#0 " not in shown
    assert "block#0 " in shown


def test_cli_trace_depth_keeps_the_op_rows_asked_for(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "trace", "demo:cnn", "--ops", "conv1:op[conv2d]", "--depth", "0")
    assert code == 0, err
    assert "conv1:op[conv2d#0]" in out
    assert "relu#0" not in out
