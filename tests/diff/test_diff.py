"""hs.diff: two models or two captures compared layer by layer; where they first part."""

from __future__ import annotations

import copy
import gc
import math
import warnings
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope._core.live_hooks import attached
from tests.cli.test_cli import run_cli
from tests.models import SmallCNN, gpt2_input, tiny_gpt2, track


def mlp(depth: int = 6, width: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    return track(nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)]).eval())  # type: ignore[return-value]


class Renamed(nn.Module):
    """The same layers as ``mlp()`` under other attribute names."""

    def __init__(self, source: nn.Sequential) -> None:
        super().__init__()
        self.body = nn.ModuleDict({f"layer{i}": copy.deepcopy(layer) for i, layer in enumerate(source)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.body.values():
            x = layer(x)
        return x


@pytest.mark.slow
@pytest.mark.parametrize("k", range(6))
def test_a_perturbed_weight_is_found_at_its_layer(k: int) -> None:
    a = mlp()
    b = copy.deepcopy(a)
    with torch.no_grad():
        b[k].weight[0, 0] += 0.5  # type: ignore[index]
    d = hs.diff(a, b, torch.randn(4, 8))
    divergence = d.first_divergence()
    assert divergence is not None
    assert divergence.row.name == str(k)
    assert divergence.introduced
    for row in d.rows:
        if row.name and int(row.name) < k:
            assert row.metrics is not None
            assert row.metrics.exact, f"layer {row.name} before the change must be exactly equal"
    later = [row for row in d.rows if row.name and int(row.name) > k]
    assert all(row.inputs_within(rtol=d.rtol, atol=d.atol) is False for row in later)  # the error came in
    assert not d.within()


def test_an_unchanged_copy_is_exactly_equal() -> None:
    a = mlp()
    d = hs.diff(a, copy.deepcopy(a), torch.randn(4, 8))
    assert d.first_divergence() is None
    assert d.within()
    assert all(row.metrics is not None and row.metrics.exact and row.metrics.sqnr_db == math.inf for row in d)
    assert "no divergence" in str(d)
    assert attached(a) == []


def test_metrics_against_float64_references() -> None:
    a, b = mlp(1), mlp(1)
    with torch.no_grad():
        b[0].bias.add_(torch.linspace(-0.1, 0.1, 8))  # type: ignore[index,union-attr,operator]
    x = torch.randn(16, 8)
    row = hs.diff(a, b, x)["0"]
    with torch.no_grad():
        ya, yb = a(x).double(), b(x).double()
    metrics = row.metrics
    assert metrics is not None
    assert metrics.max_abs == pytest.approx(float((ya - yb).abs().max()), rel=1e-6)
    assert metrics.mean_abs == pytest.approx(float((ya - yb).abs().mean()), rel=1e-6)
    assert metrics.relative == pytest.approx(float((ya - yb).norm() / ya.norm()), rel=1e-6)
    cosine = torch.nn.functional.cosine_similarity(ya.flatten(), yb.flatten(), dim=0)
    assert metrics.cosine == pytest.approx(float(cosine), rel=1e-7)
    assert metrics.sqnr_db == pytest.approx(float(10 * torch.log10(ya.pow(2).sum() / (ya - yb).pow(2).sum())), rel=1e-6)
    assert metrics.within(rtol=0.0, atol=metrics.max_abs)
    assert not metrics.within(rtol=0.0, atol=metrics.max_abs * 0.99)


@pytest.mark.transformers
def test_gpt2_float32_against_bfloat16() -> None:
    model = tiny_gpt2()
    d = hs.diff.dtypes(model, input_ids=gpt2_input(), dtype=torch.bfloat16)
    blocks = [d[f"h.{i}"] for i in range(2)]
    assert all(row.dtype == "float32" and row.dtype_b == "bfloat16" for row in blocks)
    sqnr = [row.metrics.sqnr_db for row in (d["wte"], *blocks, d["ln_f"]) if row.metrics is not None]
    assert all(math.isfinite(value) for value in sqnr)
    assert sqnr[0] > sqnr[-1], "the error grows along depth"
    relative = [row.metrics.relative for row in blocks if row.metrics is not None]
    assert relative[0] < relative[1]
    assert d.within()  # at the dtype comparison's tolerances (rtol 1e-2, atol 1e-3)
    assert d.first_divergence(rtol=1e-5, atol=0.0) is not None
    leaves = {row.path for row in d if row.name == ""}
    assert ".last_hidden_state" in leaves  # every tensor of a ModelOutput is its own row


def test_autocast_against_the_same_model() -> None:
    model = mlp()
    d = hs.diff.dtypes(model, torch.randn(4, 8), dtype="bf16", autocast=True)
    assert d["3"].name_b == "inner.3"
    assert d["3"].dtype_b == "bfloat16"
    assert d.only_a == []
    assert d.only_b == []


@pytest.mark.slow
def test_a_renamed_copy_by_order_and_by_mapping() -> None:
    a = mlp()
    b = track(Renamed(a).eval())
    x = torch.randn(4, 8)
    with pytest.raises(hs.SpecError, match="match='order'"):
        hs.diff(a, b, x, layers=nn.Linear)
    by_order = hs.diff(a, b, x, match="order")
    assert by_order.within()
    assert [row.name_b for row in by_order if row.name][:2] == ["body.layer0", "body.layer1"]
    by_map = hs.diff(a, b, x, match={"*": "body.layer*"})
    assert [row.name for row in by_map] == ["0", "1", "2", "3", "4", "5", ""]
    assert by_map.within()
    with torch.no_grad():
        b.body["layer2"].weight.mul_(2)  # type: ignore[operator,index]
    divergence = hs.diff(a, b, x, match=lambda name: f"body.layer{name}" if name else "").first_divergence()
    assert divergence is not None
    assert divergence.row.name == "2"
    assert divergence.row.name_b == "body.layer2"
    assert "= b's body.layer2" in str(divergence)


def test_two_captures_of_one_run_diff_to_zero() -> None:
    model = SmallCNN()
    x = torch.randn(2, 3, 32, 32)
    _, first = hs.run_with_capture(model, x, layers=["conv1", "relu", "fc"], keep="both")
    _, second = hs.run_with_capture(model, x, layers=["conv1", "relu", "fc"], keep="both")
    d = hs.diff(first, second)
    assert len(d) == 3
    assert all(row.metrics is not None and row.metrics.exact for row in d)
    assert all(row.inputs_within(rtol=0, atol=0) for row in d)
    _, other = hs.run_with_capture(model, x + 1, layers=["conv1", "relu", "fc"], keep="both")
    divergence = hs.diff(first, other).first_divergence()
    assert divergence is not None
    assert divergence.row.name == "conv1"
    assert not divergence.introduced  # its input differed: the difference came in


class Widened(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(4, hidden)
        self.down = nn.Linear(hidden, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.up(x))


def test_mismatched_shapes_are_reported_per_site() -> None:
    torch.manual_seed(0)
    a, b = track(Widened(8)), track(Widened(16))
    d = hs.diff(a, b, torch.randn(3, 4))
    assert d["up"].note == "shapes differ"
    assert d["up"].shape == (3, 8)
    assert d["up"].shape_b == (3, 16)
    assert d["down"].inputs[0].note == "shapes differ"
    assert d["down"].metrics is not None  # same output shape: still compared
    divergence = d.first_divergence()
    assert divergence is not None
    assert divergence.row.name == "up"
    assert "[3, 8] vs [3, 16]" in str(d)


def test_values_an_inplace_op_rewrites_later_are_compared_as_made() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(4, 4)
    a = track(nn.Sequential(linear, nn.ReLU(inplace=True)))
    b = track(nn.Sequential(copy.deepcopy(linear), nn.ReLU()))
    d = hs.diff(a, b, torch.randn(8, 4))
    assert d["0"].metrics is not None
    assert d["0"].metrics.exact  # a's Linear output was copied before the ReLU rewrote it


def test_one_minus_cosine_of_a_bfloat16_copy_matches_float64() -> None:
    """1 - cos of nearly equal values: from float32 dot products it came out 7-35% low."""
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(512, 2048))
    b = nn.Sequential(nn.Linear(512, 2048))
    with torch.no_grad():
        for source, copy in zip(a.parameters(), b.parameters(), strict=True):
            copy.copy_(source.to(torch.bfloat16).float())  # the bf16 copy's weights, compared in float32
    x = torch.randn(64, 512)
    row = hs.diff(a, b, x)["0"]
    with torch.no_grad():
        ya, yb = a(x).double().flatten().numpy(), b(x).double().flatten().numpy()
    want = 1.0 - float(np.dot(ya, yb) / (np.linalg.norm(ya) * np.linalg.norm(yb)))
    assert 1e-7 < want < 1e-4  # nearly equal, where the digits matter
    assert row.metrics is not None
    assert 1.0 - row.metrics.cosine == pytest.approx(want, rel=1e-2)


def test_the_repr_of_a_diff_with_calls_missing_on_one_side_is_not_within() -> None:
    a, b = mlp(3), mlp(4)
    with torch.no_grad():
        b[3].weight.copy_(torch.eye(8))  # type: ignore[index,operator]
        b[3].bias.zero_()  # type: ignore[index,operator]
    d = hs.diff(a, b, torch.randn(2, 8))
    assert d.first_divergence() is None  # every compared site is equal ...
    assert not d.within()  # ... but b made a call a did not
    assert "all within tolerance" not in repr(d)
    assert "NOT within: 0 calls of a and 1 of b have no counterpart" in repr(d)


def test_a_bfloat16_copy_gets_the_same_answer_from_every_way_in() -> None:
    """hs.diff of a model and its bf16 copy, and hs.diff.dtypes, use one table of tolerances."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).eval()
    x = torch.randn(4, 16)
    copy = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).eval()
    copy.load_state_dict(model.state_dict())
    copy = copy.to(torch.bfloat16)
    by_hand = hs.diff(model, copy, x, inputs_b=((x.to(torch.bfloat16),), {}))
    built_in = hs.diff.dtypes(model, x, torch.bfloat16)
    assert (by_hand.rtol, by_hand.atol) == (built_in.rtol, built_in.atol) == (1e-2, 1e-3)
    assert by_hand.within() == built_in.within()
    assert [row.metrics.max_abs for row in by_hand if row.metrics] == [
        row.metrics.max_abs for row in built_in if row.metrics
    ]
    same = hs.diff(model, model, x)
    assert (same.rtol, same.atol) == (1e-5, 1e-8) == hs.diff.tolerances(torch.float32)
    assert (hs.diff(model, copy, x, rtol=0.5, inputs_b=((x.bfloat16(),), {})).rtol) == 0.5


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is there: nothing to refuse")
def test_a_device_this_machine_lacks_is_a_spec_error() -> None:
    model = mlp(1)
    with pytest.raises(hs.SpecError, match=r"device 'cuda' cannot be used here \(AssertionError") as info:
        hs.diff.devices(model, torch.randn(2, 8))  # a CPU build of torch: cuda by default
    assert not isinstance(info.value, AssertionError)
    with pytest.raises(hs.SpecError, match="is not a torch device"):
        hs.diff.devices(model, torch.randn(2, 8), device="gpu:0")
    assert hs.attached(model) == []


def test_only_in_one_model_and_no_pairs() -> None:
    a = mlp(3)
    b = mlp(4)
    with torch.no_grad():
        b[3].weight.copy_(torch.eye(8))  # type: ignore[index,operator]
        b[3].bias.zero_()  # type: ignore[index,operator]
    d = hs.diff(a, b, torch.randn(2, 8))
    assert d.only_b == ["3#0"]
    assert not d.within()
    assert "only in b: 3#0" in str(d)
    with pytest.raises(hs.SpecError, match="no module of b matches"):
        hs.diff(mlp(2), track(Renamed(mlp(2))), torch.randn(2, 8), layers=["0", "1"])


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda a, c: hs.diff(a, c, torch.randn(2, 8)), "two models or two captures"),
        (lambda a, c: hs.diff(c, c, torch.randn(2, 8)), "pass no inputs"),
        (lambda a, c: hs.diff(a, a, torch.randn(2, 8), rtol=-1), "rtol=-1"),
        (lambda a, c: hs.diff(a, a, torch.randn(2, 8), match="names"), "match='names'"),
        (lambda a, c: hs.diff(a, a, torch.randn(2, 8), match={"*": "x.*.*"}), "each '\\*' must land"),
    ],
)
def test_bad_input_is_refused(call: object, message: str) -> None:
    a = mlp(2)
    _, cache = hs.run_with_capture(a, torch.randn(2, 8), layers="0")
    with pytest.raises(hs.SpecError, match=message):
        call(a, cache)  # type: ignore[operator]
    assert attached(a) == []


def test_a_forward_that_raises_leaves_no_hook() -> None:
    a = mlp(2)
    with pytest.raises(RuntimeError):
        hs.diff(a, copy.deepcopy(a), torch.randn(2, 5))
    assert attached(a) == []


@pytest.mark.slow
@pytest.mark.compile
def test_compiled_and_devices() -> None:
    a = mlp()
    x = torch.randn(4, 8)
    compiled = hs.diff.compiled(a, x, backend="eager")
    assert [row.site for row in compiled] == ["(root)#0"]
    assert compiled.within()
    same = hs.diff.devices(a, x, device="cpu")
    assert same.within(rtol=0, atol=0)
    assert len(same) == 7


@pytest.mark.transformers
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_against_cuda() -> None:
    d = hs.diff.devices(tiny_gpt2(), input_ids=gpt2_input(), device="cuda")
    assert d.within()
    assert all((row.metrics is not None and math.isfinite(row.metrics.sqnr_db)) or row.metrics.exact for row in d)  # type: ignore[union-attr]


@pytest.mark.slow
def test_table_pandas_html_and_profile(tmp_path: Path) -> None:
    a = mlp()
    b = copy.deepcopy(a)
    with torch.no_grad():
        b[2].weight.mul_(1.01)  # type: ignore[index,operator]
    d = hs.diff(a, b, torch.randn(4, 8))
    frame = d.to_pandas()
    assert list(frame["name"]) == ["0", "1", "2", "3", "4", "5", ""]
    assert list(frame["within"]) == [True, True, False, False, False, False, False]
    assert "<table>" in d._repr_html_()
    assert "background:#fdd" in d._repr_html_()
    assert "first divergence at 2#0 (Linear)" in str(d)
    assert repr(d) == "<Diff of Sequential and Sequential: 7 sites, first divergence at 2#0>"
    fig = hs.plots.diff_profile(d)
    top, bottom = fig.axes
    assert top.get_yscale() == "log"
    assert [t.get_text() for t in bottom.get_xticklabels()] == ["0#0", "1#0", "2#0", "3#0", "4#0", "5#0"]
    exact = top.collections[0].get_offsets()
    assert exact[:, 0].tolist() == [0.0, 1.0]  # the exactly equal layers sit on the bottom edge
    fig.savefig(tmp_path / "profile.png")
    image = np.asarray(__import__("matplotlib.image").image.imread(tmp_path / "profile.png"))
    assert image[..., :3].var() > 1e-3


NETS = """
import torch
from torch import nn


def reference():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])


def port():
    model = reference()
    with torch.no_grad():
        model[2].bias += 1
    return model


class Renamed(nn.Module):
    def __init__(self):
        super().__init__()
        self.h = nn.ModuleList(reference())

    def forward(self, x):
        for layer in self.h:
            x = layer(x)
        return x
"""


class TestDiffCommand:
    def write_models(self, tmp_path: Path) -> Path:
        script = tmp_path / "nets.py"
        script.write_text(NETS)
        return script

    @pytest.mark.slow
    def test_exit_0_when_within_and_1_at_a_divergence(self, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
        nets = self.write_models(tmp_path)
        code, out, err = run_cli(capsys, "diff", f"{nets}:reference", f"{nets}:reference", "-s", "2x8")
        assert code == 0, err
        assert "no divergence" in out
        code, out, err = run_cli(
            capsys, "diff", f"{nets}:reference", f"{nets}:port", "-s", "2x8", "--csv", str(tmp_path / "d.csv")
        )
        assert code == 1, err
        assert "first divergence at 2#0 (Linear)" in out
        assert "this layer introduced the difference" in out
        assert (tmp_path / "d.csv").read_text().startswith("order,name,name_b")

    @pytest.mark.slow
    def test_mapping_and_order(self, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
        nets = self.write_models(tmp_path)
        a, b = f"{nets}:reference", f"{nets}:Renamed"
        assert run_cli(capsys, "diff", a, b, "-s", "2x8", "--map", "*=h.*")[0] == 0
        assert run_cli(capsys, "diff", a, b, "-s", "2x8", "--by-order")[0] == 0

    @pytest.mark.slow
    def test_dtype_and_tolerance(self, capsys: pytest.CaptureFixture[str]) -> None:
        code, out, _ = run_cli(
            capsys, "diff", "demo:cnn", "demo:cnn", "--dtype", "bf16", "--rtol", "0.05", "--atol", "0.01"
        )
        assert code == 0
        assert "within rtol=0.05, atol=0.01" in out
        _, out, _ = run_cli(capsys, "diff", "demo:cnn", "demo:cnn", "--dtype", "bf16")
        assert "within rtol=0.01, atol=0.001" in out  # bf16's defaults, as hs.diff.dtypes uses, shown
        _, out, _ = run_cli(capsys, "diff", "demo:cnn", "demo:cnn")
        assert "within rtol=1e-05, atol=1e-08" in out

    @pytest.mark.parametrize(
        ("argv", "message"),
        [
            (["--map", "nope"], "is not A=B"),
            (["--map", "a=b", "--by-order"], "pass one"),
            (["-s", "1x5"], "the forward pass of demo:cnn on the sample input raised"),
            (["--csv", "/nonexistent/d.csv"], "does not exist"),
        ],
    )
    def test_bad_input_exits_2(self, capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
        code, _, err = run_cli(capsys, "diff", "demo:cnn", "demo:cnn", *argv)
        assert code == 2
        assert message in err
        assert "Traceback" not in err


class Probe(nn.Module):
    """Counts, when called, how many of the watched tensors are still alive."""

    def __init__(self, watched: list[weakref.ref[torch.Tensor]], seen: list[int]) -> None:
        super().__init__()
        self.watched, self.seen = watched, seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(sum(ref() is not None for ref in self.watched))
        return x


def test_a_values_are_let_go_as_b_compares_them(monkeypatch: pytest.MonkeyPatch) -> None:
    from hookscope._diff import recorder

    watched: list[weakref.ref[torch.Tensor]] = []
    taken = recorder.Reference.fill

    def fill_and_watch(self: recorder.Reference, cache: hs.Cache) -> None:
        taken(self, cache)
        watched.extend(weakref.ref(kept) for call in self.calls for kept in call.outputs.values() if kept is not None)

    monkeypatch.setattr(recorder.Reference, "fill", fill_and_watch)  # a spy on our own step, not on torch
    a = mlp(4, 128)
    seen: list[int] = []
    b = track(nn.Sequential(*copy.deepcopy(list(a)), Probe(watched, seen)).eval())
    gc.disable()  # no collection by chance: only what the diff lets go of may go
    try:
        hs.diff(a, b, torch.randn(256, 128), layers=nn.Linear)
    finally:
        gc.enable()
    assert len(watched) == 4
    assert seen == [0], "a's outputs were dropped as soon as b's counterparts were compared"


def test_inside_an_except_block() -> None:
    a = mlp()
    b = copy.deepcopy(a)
    with torch.no_grad():
        b[4].weight.mul_(2)  # type: ignore[index,operator]
    try:
        raise ValueError("a check failed; now find where")
    except ValueError:
        d = hs.diff(a, b, torch.randn(2, 8))
    assert len(d) == 7
    divergence = d.first_divergence()
    assert divergence is not None
    assert divergence.row.name == "4"


def test_captures_with_containers_blame_the_leaf() -> None:
    model = track(nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Tanh()), nn.Linear(4, 2)).eval())
    x = torch.randn(2, 4)
    _, first = hs.run_with_capture(model, x, layers=["", "*"], keep="both")
    with torch.no_grad():
        model[0][1].register_forward_hook(lambda m, args, out: out * 1.5)  # type: ignore[index]
    _, second = hs.run_with_capture(model, x, layers=["", "*"], keep="both")
    for hook in list(model[0][1]._forward_hooks):  # type: ignore[index]
        del model[0][1]._forward_hooks[hook]  # type: ignore[index]
    divergence = hs.diff(first, second).first_divergence()
    assert divergence is not None
    assert divergence.row.name == "0.1"
    assert divergence.introduced
    outputs_only = hs.diff(
        hs.run_with_capture(model, x, layers="0.0")[1], hs.run_with_capture(model, x + 1, layers="0.0")[1]
    )
    late = outputs_only.first_divergence()
    assert late is not None
    assert late.introduced is None
    assert "inputs were not compared" in str(late)


@pytest.mark.slow
def test_non_finite_values_in_the_same_places_are_equal() -> None:
    torch.manual_seed(0)
    a = track(nn.Sequential(nn.Linear(4, 4), nn.Softplus(), nn.Identity()).eval())
    x = torch.randn(3, 4)
    x[0, 0] = float("nan")
    d = hs.diff(a, copy.deepcopy(a), x)
    assert d.within(rtol=0, atol=0)
    assert all(row.metrics is not None and row.metrics.exact for row in d)
    metrics = hs.diff(a, copy.deepcopy(a), torch.randn(3, 4)).rows[0].metrics
    assert metrics is not None
    assert metrics.mismatched == 0
    from hookscope._diff.metrics import raw_metrics, read_metrics

    mixed = read_metrics([raw_metrics(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0]))])[0]
    assert mixed.mismatched == 1
    assert not mixed.within(rtol=1, atol=1)
    zeros = read_metrics([raw_metrics(torch.zeros(3), torch.ones(3))])[0]
    assert math.isnan(zeros.cosine)  # one side all zeros: no direction to compare, not "aligned"
    exact_ints = read_metrics([raw_metrics(torch.tensor([2**40]), torch.tensor([2**40 + 1]))])[0]
    assert exact_ints.max_abs == 1.0


@pytest.mark.slow
def test_inference_mode_and_positional_targets() -> None:
    a = mlp()
    with torch.inference_mode():
        assert hs.diff(a, copy.deepcopy(a), torch.randn(2, 8)).within()
    d = hs.diff.dtypes(a, torch.randn(2, 8), torch.float16)
    assert d["0"].dtype_b == "float16"
    assert hs.diff.devices(a, torch.randn(2, 8), "cpu").within(rtol=0, atol=0)
    with pytest.raises(hs.SpecError, match="two dtypes given"):
        hs.diff.dtypes(a, torch.randn(2, 8), torch.float16, dtype="bf16")


def test_order_pairing_notes_a_layer_of_another_kind() -> None:
    torch.manual_seed(0)
    a = track(nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval())
    b = track(nn.Sequential(copy.deepcopy(a[0]), nn.Tanh()).eval())
    with pytest.warns(hs.PairingWarning, match="ReLU"):
        d = hs.diff(a, b, torch.rand(2, 4), match="order")
    assert d["1"].note == "classes differ (ReLU vs Tanh)"
    assert not d.within()


def test_only_the_roots_pairing_is_refused_with_the_fix() -> None:
    a = mlp(2)
    with pytest.raises(hs.SpecError, match="match='order'"):
        hs.diff(a, track(Renamed(a)), torch.randn(2, 8))


def test_order_pairing_of_a_layer_with_a_container_is_marked_and_warned() -> None:
    torch.manual_seed(0)
    a = track(nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval())
    b = track(nn.Sequential(nn.Sequential(copy.deepcopy(a[0]), nn.ReLU())).eval())
    x = torch.rand(2, 4)
    assert torch.equal(a(x), b(x))  # one function, two structures
    with pytest.warns(hs.PairingWarning, match=r"paired 2 calls with a module of another kind") as caught:
        d = hs.diff(a, b, x, match="order")
    assert caught[0].filename == __file__  # points at the caller's line
    assert d["0"].note == "classes differ (Linear vs Sequential)"
    divergence = d.first_divergence()
    assert divergence is not None
    assert "classes differ" in str(divergence)


def test_order_pairing_of_two_implementations_of_one_block_is_quiet() -> None:
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.fc(x))

    class OtherBlock(Block):
        pass

    a = track(nn.Sequential(Block()).eval())
    b = track(nn.Sequential(OtherBlock()).eval())
    b.load_state_dict(a.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert hs.diff(a, b, torch.rand(2, 4), match="order").within()


class _AddConstant(nn.Module):
    def __init__(self, constant: int) -> None:
        super().__init__()
        self.constant = constant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.constant


@pytest.mark.parametrize("big", [2**20, 2**60])
def test_integers_compare_exactly_at_any_magnitude(big: int) -> None:
    x = torch.tensor([big, 5], dtype=torch.int64)
    assert not hs.diff(_AddConstant(0), _AddConstant(1), x).within()
    assert not hs.diff(_AddConstant(0), _AddConstant(1), x).within(rtol=1e-2, atol=0.5)
    assert hs.diff(_AddConstant(1), _AddConstant(1), x).within(rtol=0, atol=0)
    same_bools = hs.diff(_AddConstant(0), _AddConstant(0), torch.tensor([True, False]))
    assert same_bools.within(rtol=0, atol=0)


def test_float32_against_float64_is_not_compared_as_integers() -> None:
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    b, x = copy.deepcopy(a).double(), torch.randn(2, 4)
    assert hs.diff(a, b, x, inputs_b=((x.double(),), {})).within(rtol=1e-5, atol=1e-6)


def test_rows_are_found_by_every_spelling_a_cache_key_takes() -> None:
    a = mlp()
    b = copy.deepcopy(a)
    with torch.no_grad():
        b[2].weight.mul_(2)  # type: ignore[operator]
    x = torch.randn(4, 8)
    d = hs.diff(a, b, x)
    assert d["2:output"] is d["2"]
    assert d["2#0:output"] is d["2"]
    assert d["(root)"] is d[""]
    assert d["2"].metrics is not None
    want = (a[2](a[1](a[0](x))) - b[2](b[1](b[0](x)))).abs().max().item()  # type: ignore[operator]
    assert d["2"].metrics.max_abs == pytest.approx(want, rel=1e-6)
    with pytest.raises(hs.SiteNotFoundError, match="nothing was compared for '22'; did you mean '2'"):
        d["22"]
    with pytest.raises(hs.SiteNotFoundError, match=r"call 1 was not compared; calls kept: \[0\]"):
        d["2#1"]
