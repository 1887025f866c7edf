"""hs.report and `hookscope report`: one self-contained HTML file; what it holds, what it refuses.

What the page does in a browser (sorting, filtering, images decoding) is in test_report_browser.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.functional import cross_entropy

import hookscope as hs
from tests.cli.test_cli import run_cli
from tests.models import SmallCNN, gpt2_input, tiny_gpt2, tiny_resnet, track

EVIL = "<script>alert(1)</script>"


def evil_model() -> nn.Module:
    """A model with a module whose name is markup, and a NaN made in its last layer."""
    model = nn.Sequential()
    model.add_module("conv", nn.Conv2d(3, 4, 3))
    model.add_module(EVIL, nn.ReLU())
    model.add_module("flat", nn.Flatten())
    model.add_module("head", nn.Linear(4 * 6 * 6, 3))
    with torch.no_grad():
        model.head.bias[1] = float("nan")
    return track(model.eval())


def external_references(page: str) -> list[str]:
    """Every src=/href= that would leave the file (anything but data: URIs and #anchors)."""
    found = re.findall(r"""(?:src|href)\s*=\s*["']([^"']*)["']""", page)
    return [target for target in found if not target.startswith(("data:", "#"))]


@pytest.mark.slow
def test_a_report_holds_every_section(tmp_path: Path) -> None:
    model = SmallCNN()
    labels = torch.tensor([1, 2])
    out = hs.report(
        model,
        torch.randn(2, 3, 32, 32),
        out=tmp_path / "sub" / "report.html",
        loss_fn=lambda logits: cross_entropy(logits, labels),
    )
    assert out == tmp_path / "sub" / "report.html"
    page = out.read_text(encoding="utf-8")
    for section in (
        'id="overview"',
        'id="trace"',
        'id="depth"',
        'id="histograms"',
        'id="feature-maps"',
        'id="gradients"',
    ):
        assert section in page
    assert page.count('class="row') == 5  # one row per call
    assert "618 parameters" in page
    assert "[2, 3, 32, 32]" in page
    assert "[2, 10]" in page
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == 5  # depth, histograms, feature maps of conv1 and relu, gradient flow
    assert external_references(page) == []
    assert "<link" not in page
    assert "@import" not in page
    assert not list(out.parent.glob("*.partial"))


@pytest.mark.slow
def test_names_and_title_are_escaped(tmp_path: Path) -> None:
    out = hs.report(evil_model(), torch.randn(1, 3, 8, 8), out=tmp_path / "r.html", title=EVIL)
    page = out.read_text(encoding="utf-8")
    assert EVIL not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert page.count("<script") == 2  # the details JSON and the report's own script
    assert 'class="banner bad"' in page
    assert "NaN/Inf first appears in head#0" in page
    assert re.search(r'<tr class="row bad"[^>]*data-name="head linear"', page)


@pytest.mark.slow
def test_gradients_are_measured_and_the_grads_put_back(tmp_path: Path) -> None:
    model = SmallCNN()
    marker = torch.full_like(model.fc.weight, 7.0)
    model.fc.weight.grad = marker
    out = hs.report(model, torch.randn(2, 3, 32, 32), out=tmp_path / "r.html", loss_fn=lambda y: y.pow(2).mean())
    assert model.fc.weight.grad is marker
    assert model.conv1.weight.grad is None
    page = out.read_text(encoding="utf-8")
    assert "parameter gradients (4)" in page
    assert "conv1.weight" in page
    assert "One backward pass of loss_fn(output), loss " in page


@pytest.mark.slow
def test_a_monitor_of_several_steps(tmp_path: Path) -> None:
    model = SmallCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with hs.watch_grads(model) as monitor:
        for _ in range(3):
            model(torch.randn(2, 3, 32, 32)).pow(2).mean().backward()
            monitor.step()
            optimizer.step()
            optimizer.zero_grad()
    page = hs.report(model, torch.randn(1, 3, 32, 32), out=tmp_path / "r.html", grads=monitor).read_text()
    assert "3 recorded steps" in page
    assert page.count("data:image/png") == 6  # flow and history on top of the four activation figures


@pytest.mark.slow
def test_sites_choose_what_is_drawn(tmp_path: Path) -> None:
    page = hs.report(SmallCNN(), torch.randn(1, 3, 32, 32), out=tmp_path / "r.html", layers="conv1").read_text()
    assert page.count("data:image/png") == 3  # depth, histograms, conv1's feature maps
    assert "feature maps of conv1#0" in page
    assert "feature maps of relu#0" not in page
    none = hs.report(SmallCNN(), torch.randn(1, 3, 32, 32), out=tmp_path / "n.html", feature_maps=0, max_sites=0)
    assert none.read_text().count("data:image/png") == 1  # the depth plot alone


@pytest.mark.slow
def test_a_large_model_draws_a_subset(tmp_path: Path) -> None:
    blocks = [nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.ReLU()) for _ in range(300)]
    model = track(nn.Sequential(*blocks).eval())
    assert len(list(model.modules())) > 1000
    page = hs.report(model, torch.randn(2, 8), out=tmp_path / "big.html").read_text()
    assert page.count('class="row') == 1201
    assert page.count("data:image/png") == 2  # depth and 16 histograms in one figure: no image per module
    assert len(page) < 3_000_000


@pytest.mark.slow
@pytest.mark.transformers
def test_transformers_models(tmp_path: Path) -> None:
    gpt2 = tiny_gpt2()
    page = hs.report(
        gpt2, input_ids=gpt2_input(), out=tmp_path / "gpt2.html", loss_fn=lambda o: o[0].norm()
    ).read_text()
    assert "GPT2Model" in page
    assert "h.1.mlp.c_proj" in page
    assert 'id="gradients"' in page
    assert "output.last_hidden_state" in page
    assert 'id="feature-maps"' not in page  # no conv-like output
    resnet = hs.report(tiny_resnet(), torch.randn(1, 3, 32, 32), out=tmp_path / "resnet.html").read_text()
    assert "feature maps of embedder.embedder.convolution#0" in resnet


def test_a_model_with_no_finite_value_still_gets_its_report(tmp_path: Path) -> None:
    model = track(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).eval())
    page = hs.report(model, torch.full((2, 3), float("nan")), out=tmp_path / "nan.html").read_text()
    assert 'id="histograms"' not in page  # nothing finite to count
    assert page.count('class="row bad"') == 4
    assert "already non-finite where they came in" in page


def test_the_root_alone(tmp_path: Path) -> None:
    page = hs.report(SmallCNN(), torch.randn(1, 3, 32, 32), out=tmp_path / "r.html", layers="").read_text()
    assert "value histograms of 1 layers" in page


class Looping(nn.Module):
    """One Linear and one Tanh called 300 times: 600 calls of two modules."""

    def __init__(self) -> None:
        super().__init__()
        self.step = nn.Linear(4, 4)
        self.squash = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(300):
            x = self.squash(self.step(x))
        return x


@pytest.mark.slow
def test_a_reused_module_draws_the_chosen_calls_only(tmp_path: Path) -> None:
    page = hs.report(track(Looping().eval()), torch.randn(2, 4), out=tmp_path / "loop.html").read_text()
    assert page.count('class="row') == 601
    assert 'alt="value histograms of 16 layers"' in page


class Awkward(nn.Module):
    """Conv outputs under names that read as globs and regexes, and one returned inside a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.ModuleDict({"a[0]": nn.Conv2d(3, 4, 3), "re:q": nn.Conv2d(4, 4, 3), "x*": nn.Conv2d(4, 4, 3)})
        self.pair = PairOut()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv in self.convs.values():
            x = conv(x)
        maps, _ = self.pair(x)
        return maps


class PairOut(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x.mean()


@pytest.mark.slow
def test_names_that_look_like_patterns_and_tuple_outputs(tmp_path: Path) -> None:
    page = hs.report(track(Awkward().eval()), torch.randn(1, 3, 12, 12), out=tmp_path / "r.html").read_text()
    for site in ("convs.a[0]#0", "convs.re:q#0", "convs.x*#0", "pair#0"):
        assert f'alt="feature maps of {site}"' in page
    assert page.count('alt="feature maps of ') == 4


@pytest.mark.slow
def test_a_loss_that_reaches_no_parameter_is_refused(tmp_path: Path) -> None:
    model = SmallCNN()
    with pytest.raises(hs.SpecError, match="does not depend on any parameter"):
        hs.report(model, torch.randn(1, 3, 32, 32), out=tmp_path / "r.html", loss_fn=lambda y: torch.tensor(1.0))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_an_input_that_requires_grad_keeps_its_grad(tmp_path: Path) -> None:
    x = torch.randn(1, 3, 32, 32, requires_grad=True)
    hs.report(SmallCNN(), x, out=tmp_path / "r.html", loss_fn=lambda y: y.sum())
    assert x.grad is None


@pytest.mark.slow
def test_the_file_follows_the_umask(tmp_path: Path) -> None:
    previous = os.umask(0o077)
    try:
        out = hs.report(SmallCNN(), torch.randn(1, 3, 32, 32), out=tmp_path / "private.html", feature_maps=0)
    finally:
        os.umask(previous)
    assert out.stat().st_mode & 0o777 == 0o600
    shared = hs.report(SmallCNN(), torch.randn(1, 3, 32, 32), out=tmp_path / "shared.html", feature_maps=0)
    assert shared.stat().st_mode & 0o777 == 0o666 & ~previous


@pytest.mark.slow
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"out": "report.txt"}, "ending in .html"),
        ({"loss_fn": 3}, "loss_fn must be a function"),
        ({"max_sites": -1}, "max_sites=-1"),
        ({"layers": "nope"}, "matched 0 of 5 modules"),
        ({"loss_fn": lambda y: y}, r"scalar tensor; it returned \(1, 10\)"),
    ],
)
def test_bad_options_are_refused_and_nothing_is_written(
    tmp_path: Path, options: dict[str, object], message: str
) -> None:
    model = SmallCNN()
    options = {"out": tmp_path / "r.html", **options}
    with pytest.raises((hs.SpecError, hs.SelectionError), match=message):
        hs.report(model, torch.randn(1, 3, 32, 32), **options)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []
    assert all(p.grad is None for p in model.parameters())


def test_out_that_is_a_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "x.html").mkdir()
    with pytest.raises(hs.SpecError, match="is a folder"):
        hs.report(SmallCNN(), torch.randn(1, 3, 32, 32), out=tmp_path / "x.html")


def test_loss_fn_and_grads_together_are_refused(tmp_path: Path) -> None:
    model = SmallCNN()
    with hs.watch_grads(model) as monitor, pytest.raises(hs.SpecError, match="not both"):
        hs.report(model, torch.randn(1, 3, 32, 32), out=tmp_path / "r.html", loss_fn=torch.sum, grads=monitor)


class TestReportCommand:
    @pytest.mark.slow
    def test_writes_the_page_and_prints_its_path(self, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
        out = tmp_path / "r.html"
        code, text, err = run_cli(capsys, "report", "demo:cnn", "--input-shape", "2x3x32x32", "-o", str(out))
        assert code == 0, err
        assert "input: (2, 3, 32, 32) float32" in text
        assert f"wrote {out}" in text
        assert "[2, 3, 32, 32]" in out.read_text()

    @pytest.mark.slow
    def test_loss_words_and_functions(self, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
        script = tmp_path / "losses.py"
        script.write_text("def first_logit(output):\n    return output[:, 0].sum()\n")
        for loss in ("mean", "norm", f"{script}:first_logit"):
            out = tmp_path / "r.html"
            code, _, err = run_cli(capsys, "report", "demo:cnn", "--loss", loss, "-o", str(out), "--title", EVIL)
            assert code == 0, err
            page = out.read_text()
            assert 'id="gradients"' in page
            assert EVIL not in page

    @pytest.mark.slow
    @pytest.mark.transformers
    def test_gpt2_from_a_config(self, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
        out = tmp_path / "gpt2.html"
        spec = "hf-config:gpt2?n_layer=2&n_embd=32&n_head=2&vocab_size=64&bos_token_id=0&eos_token_id=0"
        code, text, err = run_cli(capsys, "report", spec, "--layers", "h.*.mlp", "--loss", "mean", "-o", str(out))
        assert code == 0, err
        assert "input: input_ids (1, 16) int64" in text
        assert "GPT2MLP" in out.read_text()

    @pytest.mark.slow
    def test_the_trained_demo_model_sees_generated_shapes(
        self, capsys: pytest.CaptureFixture[str], tmp_path: Path
    ) -> None:
        out = tmp_path / "shapes.html"
        code, _text, err = run_cli(capsys, "report", "demo:shapes", "-s", "4x3x32x32", "--loss", "norm", "-o", str(out))
        assert code == 0, err
        page = out.read_text()
        assert "ShapesCNN" in page
        assert "feature maps of conv3#0" in page
        from hookscope.cli.parse.specs import load_model, make_input
        from hookscope.demo.shapes import make_shapes

        (images,), _ = make_input(load_model("demo:shapes"), "4x3x32x32", seed=5)
        torch.testing.assert_close(images, make_shapes(4, seed=5)[0])  # shapes, not noise
        code, _, err = run_cli(capsys, "report", "demo:shapes", "-s", "4x1x32x32", "-o", str(out))
        assert code == 2
        assert "ShapesCNN takes square RGB images" in err

    @pytest.mark.slow
    def test_a_failing_loss_is_named_and_an_unwritable_out_exits_2(
        self, capsys: pytest.CaptureFixture[str], tmp_path: Path
    ) -> None:
        script = tmp_path / "losses.py"
        script.write_text("def needs_labels(output):\n    raise KeyError('labels missing')\n")
        code, _, err = run_cli(
            capsys, "report", "demo:cnn", "--loss", f"{script}:needs_labels", "-o", str(tmp_path / "r.html")
        )
        assert code == 2
        assert "--loss" in err
        assert "needs_labels(output) raised KeyError" in err
        assert "input-shape" not in err
        blocker = tmp_path / "file"
        blocker.write_text("not a folder")
        code, out, err = run_cli(capsys, "report", "demo:cnn", "-o", str(blocker / "r.html"))
        assert code == 2  # refused before the model is loaded
        assert "is a file, not a folder" in err
        assert "input:" not in out

    @pytest.mark.parametrize(
        ("argv", "message"),
        [
            (["-o", "r.txt"], "ending in .html"),
            (["--sites", "conv9"], "did you mean 'conv1'"),
            (["--loss", "nowhere:fn"], "loss 'nowhere:fn'"),
        ],
    )
    def test_bad_input_exits_2(
        self,
        capsys: pytest.CaptureFixture[str],
        tmp_path: Path,
        argv: list[str],
        message: str,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        monkeypatch.chdir(tmp_path)
        code, _, err = run_cli(capsys, "report", "demo:cnn", *argv)
        assert code == 2
        assert message in err
        assert "Traceback" not in err
        assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_an_hs_monitor_and_its_steps_are_taken_as_grads(tmp_path: Path) -> None:
    """``hs.monitor`` keeps ``.steps`` where ``hs.watch_grads`` keeps ``.records``: both are read."""
    model = SmallCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with hs.monitor(model) as monitor:
        for _ in range(2):
            model(torch.randn(2, 3, 32, 32)).pow(2).mean().backward()
            monitor.step()
            optimizer.step()
            optimizer.zero_grad()
    for grads in (monitor, monitor.steps):
        page = hs.report(model, torch.randn(1, 3, 32, 32), out=tmp_path / "r.html", grads=grads).read_text()
        assert "2 recorded steps" in page
        assert page.count("data:image/png") == 6  # flow and history on top of the four activation figures
    assert hs.plots.grad_flow(monitor).axes
    assert hs.plots.grad_history(monitor.steps).axes


@pytest.mark.parametrize(
    ("grads", "said"),
    [
        (42, "grads= is a int; expected an hs.monitor or hs.watch_grads monitor"),
        ([1, 2], "grads= holds int; expected"),
        ([], "grads= holds no recorded step yet"),
    ],
)
def test_grads_that_are_no_monitor_are_refused(tmp_path: Path, grads: object, said: str) -> None:
    with pytest.raises(hs.SpecError, match=re.escape(said)):
        hs.report(SmallCNN(), torch.randn(1, 3, 32, 32), out=tmp_path / "r.html", grads=grads)  # type: ignore[arg-type]
    assert not (tmp_path / "r.html").exists()
