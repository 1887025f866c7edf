"""hs.plots: feature maps, histograms and layer statistics drawn from real traces and captures."""

from __future__ import annotations

import io
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope._shared.histogram import BLOCK, raw_histogram, read_histograms
from tests.models import SmallCNN, gpt2_input, tiny_gpt2, tiny_resnet, track


def pixels(fig: object, path: Path) -> np.ndarray:
    """Save the figure as PNG (a real file) and read its pixels back."""
    fig.savefig(path, dpi=60)  # type: ignore[attr-defined]
    return np.asarray(matplotlib.image.imread(io.BytesIO(path.read_bytes()), format="png"))


def assert_not_blank(fig: object, path: Path) -> None:
    image = pixels(fig, path)
    assert image.shape[0] > 50
    assert image.shape[1] > 50
    assert float(image[..., :3].var()) > 1e-3, "the figure is a flat colour"


def panels(fig: object) -> list[object]:
    """The figure's axes that are panels (not colour bars)."""
    return [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]  # type: ignore[attr-defined]


class TestHistogramCounting:
    def test_counts_match_numpy_on_every_value(self) -> None:
        values = torch.randn(5000, generator=torch.Generator().manual_seed(0))
        histogram = read_histograms([raw_histogram(values, bins=20)])[0]
        expected, edges = np.histogram(values.numpy(), bins=20)
        np.testing.assert_allclose(histogram.edges, edges, rtol=1e-6)
        assert np.abs(np.asarray(histogram.counts) - expected).sum() <= 2  # float32 bucketing at an edge
        assert histogram.counted == histogram.total == 5000

    def test_large_tensors_are_sampled_evenly(self) -> None:
        values = torch.arange(1_000_000, dtype=torch.float32)
        histogram = read_histograms([raw_histogram(values, bins=10, sample=10_000)])[0]
        assert histogram.total == 1_000_000
        assert 9_000 < histogram.counted <= 10_000
        assert max(histogram.counts) - min(histogram.counts) <= BLOCK  # uniform values: even to a run
        assert histogram.low == 0.0
        assert histogram.high > 0.99 * 1_000_000  # the runs reach the end of the tensor

    def test_nonfinite_values_are_left_out(self) -> None:
        values = torch.tensor([1.0, float("nan"), float("inf"), 3.0, -float("inf")])
        histogram = read_histograms([raw_histogram(values, bins=2)])[0]
        assert (histogram.low, histogram.high, histogram.counted, histogram.total) == (1.0, 3.0, 2, 5)
        empty = read_histograms([raw_histogram(torch.full((4,), float("nan")), bins=3)])[0]
        assert empty.counted == 0
        assert np.isnan(empty.low)

    def test_half_and_integer_tensors(self) -> None:
        for tensor in (torch.arange(8, dtype=torch.bfloat16), torch.arange(8), torch.ones(3, dtype=torch.bool)):
            histogram = read_histograms([raw_histogram(tensor, bins=4)])[0]
            assert histogram.counted == tensor.numel()

    def test_bins_must_be_positive(self) -> None:
        with pytest.raises(ValueError, match="bins=0"):
            raw_histogram(torch.ones(3), bins=0)


class TestTraceHistograms:
    def test_every_measured_output_has_one(self) -> None:
        t = hs.trace(SmallCNN(), torch.randn(2, 3, 32, 32), histograms=32)
        relu = t["relu"].output
        assert relu is not None
        assert relu.histogram is not None
        assert relu.histogram.bins == 32
        assert relu.histogram.low == 0.0
        assert relu.histogram.counted == relu.histogram.total == 2 * 16 * 30 * 30
        assert relu.histogram.high == pytest.approx(relu.stats.max)  # type: ignore[union-attr]
        assert t.meta["histogram_bins"] == 32
        assert '"histogram":' in t.to_json()

    def test_rows_with_histograms_compare_and_hash_as_values(self) -> None:
        model, x = SmallCNN(), torch.randn(1, 3, 32, 32)
        first, second = (hs.trace(model, x, histograms=True) for _ in range(2))
        assert first["relu"].outputs[0] == second["relu"].outputs[0]
        assert len({first["relu"].outputs[0], second["relu"].outputs[0]}) == 1
        assert first["relu"].outputs[0] != first["conv1"].outputs[0]

    def test_off_by_default(self) -> None:
        t = hs.trace(SmallCNN(), torch.randn(1, 3, 32, 32))
        assert all(info.histogram is None for row in t for info in row.outputs)
        assert '"histogram":' not in t.to_json()

    @pytest.mark.parametrize(("value", "message"), [(0, "positive number of bins"), ("64", "positive number")])
    def test_bad_values_are_refused(self, value: object, message: str) -> None:
        with pytest.raises(hs.SpecError, match=message):
            hs.trace(SmallCNN(), torch.randn(1, 3, 32, 32), histograms=value)  # type: ignore[arg-type]

    def test_needs_statistics(self) -> None:
        with pytest.raises(hs.SpecError, match="needs statistics"):
            hs.trace(SmallCNN(), torch.randn(1, 3, 32, 32), histograms=True, stats=False)


class TestFeatureMaps:
    def test_grid_of_the_most_active_channels(self, tmp_path: Path) -> None:
        model = SmallCNN()
        with hs.capture(model, "relu") as cache, torch.no_grad():
            model(torch.randn(2, 3, 32, 32))
        value = cache["relu"]
        fig = hs.plots.feature_maps(value, max_channels=9, sample=1, title="relu")
        shown = panels(fig)
        assert len(shown) == 9
        assert len(fig.axes) == 10
        means = value[1].mean((1, 2))
        expected = [f"ch {int(c)}" for c in means.argsort(descending=True)[:9]]
        assert [ax.get_title() for ax in shown] == expected
        assert "9 of 16 channels" in fig._suptitle.get_text()
        assert_not_blank(fig, tmp_path / "maps.png")

    def test_one_colour_scale_for_every_panel(self) -> None:
        maps = torch.stack([torch.full((4, 4), float(c)) for c in range(4)])
        fig = hs.plots.feature_maps(maps)
        limits = {ax.images[0].get_clim() for ax in panels(fig)}
        assert limits == {(0.0, 3.0)}

    def test_numpy_input_and_all_channels(self) -> None:
        fig = hs.plots.feature_maps(np.random.default_rng(0).normal(size=(5, 6, 6)))
        assert len(panels(fig)) == 5

    @pytest.mark.parametrize("shape", [(4, 10), (2, 3, 4, 5, 6)])
    def test_values_that_are_not_images_are_refused(self, shape: tuple[int, ...]) -> None:
        with pytest.raises(hs.SpecError, match=r"\(C, H, W\) or \(N, C, H, W\).*histograms"):
            hs.plots.feature_maps(torch.zeros(shape))

    def test_a_dollar_in_a_name_is_not_math(self, tmp_path: Path) -> None:
        fig = hs.plots.feature_maps(torch.rand(2, 4, 4), title=r"cost$\frac$")
        assert_not_blank(fig, tmp_path / "dollar.png")  # matplotlib would raise on mathtext

    def test_bad_options(self) -> None:
        with pytest.raises(hs.SpecError, match="outside the batch of 2"):
            hs.plots.feature_maps(torch.zeros(2, 3, 4, 4), sample=2)
        with pytest.raises(hs.SpecError, match="max_channels=0"):
            hs.plots.feature_maps(torch.zeros(3, 4, 4), max_channels=0)

    @pytest.mark.transformers
    def test_resnet_from_transformers(self, tmp_path: Path) -> None:
        model = tiny_resnet()
        with hs.capture(model, "embedder") as cache, torch.no_grad():
            model(torch.randn(1, 3, 32, 32))
        fig = hs.plots.feature_maps(cache["embedder"], max_channels=4)
        assert len(panels(fig)) == 4
        assert_not_blank(fig, tmp_path / "resnet.png")


class TestHistograms:
    def test_from_a_trace_one_panel_per_site(self, tmp_path: Path) -> None:
        t = hs.trace(SmallCNN(), torch.randn(2, 3, 32, 32), histograms=True)
        fig = hs.plots.histograms(t, layers=["conv1", "relu"])
        assert [ax.get_title() for ax in fig.axes] == ["conv1#0", "relu#0"]
        assert_not_blank(fig, tmp_path / "h.png")
        log = hs.plots.histograms(t, log=True)
        assert [ax.get_title() for ax in log.axes] == ["conv1#0", "relu#0", "pool#0", "fc#0"]
        assert all(ax.get_yscale() == "log" for ax in log.axes)

    def test_from_a_capture(self, tmp_path: Path) -> None:
        model = SmallCNN()
        _, cache = hs.run_with_capture(model, torch.randn(2, 3, 32, 32), layers=["conv1", "fc"])
        fig = hs.plots.histograms(cache, bins=10)
        assert [ax.get_title() for ax in fig.axes] == ["conv1#0:output", "fc#0:output"]
        heights = list(fig.axes[0].patches)
        assert heights, "bars were drawn"
        assert_not_blank(fig, tmp_path / "c.png")
        assert len(hs.plots.histograms(cache, layers="fc").axes) == 1

    def test_many_layers_are_thinned_to_max_sites(self) -> None:
        model = track(nn.Sequential(*[nn.Linear(8, 8) for _ in range(40)]))
        t = hs.trace(model, torch.randn(4, 8), histograms=True)
        titles = [ax.get_title() for ax in hs.plots.histograms(t, max_sites=6).axes]
        assert len(titles) == 6
        assert titles[0] == "0#0"
        assert titles[-1] == "39#0"

    @pytest.mark.transformers
    def test_gpt2_from_transformers(self, tmp_path: Path) -> None:
        t = hs.trace(tiny_gpt2(), gpt2_input(), histograms=True)
        fig = hs.plots.histograms(t, layers="h.*.mlp")
        assert [ax.get_title() for ax in fig.axes] == ["h.0.mlp#0", "h.1.mlp#0"]
        assert_not_blank(fig, tmp_path / "gpt2.png")

    def test_a_trace_without_histograms_says_how_to_get_them(self) -> None:
        t = hs.trace(SmallCNN(), torch.randn(1, 3, 32, 32))
        with pytest.raises(hs.SpecError, match=r"histograms=True"):
            hs.plots.histograms(t)


class TestLayerStats:
    def test_leaf_layers_along_depth(self, tmp_path: Path) -> None:
        t = hs.trace(SmallCNN(), torch.randn(2, 3, 32, 32))
        fig = hs.plots.layer_stats(t)
        top, bottom = fig.axes
        assert [tick.get_text() for tick in bottom.get_xticklabels()] == ["conv1#0", "relu#0", "pool#0", "fc#0"]
        mean_line = top.get_lines()[0]
        np.testing.assert_allclose(
            mean_line.get_ydata(), [t[name].stats.mean for name in ("conv1", "relu", "pool", "fc")]
        )  # type: ignore[union-attr]
        assert bottom.get_yscale() == "log"
        assert_not_blank(fig, tmp_path / "stats.png")

    def test_growth_through_depth_reads_off_the_std_line(self) -> None:
        model = track(nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)]))
        with torch.no_grad():
            for layer in model:
                layer.weight.copy_(torch.eye(16) * 2)  # type: ignore[operator]
                layer.bias.zero_()  # type: ignore[operator]
        fig = hs.plots.layer_stats(hs.trace(model, torch.randn(32, 16)))
        std = fig.axes[1].get_lines()[0].get_ydata()
        np.testing.assert_allclose(std[1:] / std[:-1], 2.0, rtol=1e-5)

    def test_nonfinite_layers_are_marked(self) -> None:
        model = track(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
        with torch.no_grad():
            model[1].bias[0] = float("nan")  # type: ignore[index]
        fig = hs.plots.layer_stats(hs.trace(model, torch.randn(2, 4)))
        crosses = fig.axes[0].collections[-1]
        assert crosses.get_offsets()[:, 0].tolist() == [1.0]

    @pytest.mark.transformers
    def test_gpt2_blocks(self, tmp_path: Path) -> None:
        t = hs.trace(tiny_gpt2(), gpt2_input())
        fig = hs.plots.layer_stats(t, layers=r"re:h\.\d+$")
        labels = [tick.get_text() for tick in fig.axes[1].get_xticklabels()]
        assert labels == ["h.0#0", "h.1#0"]
        assert_not_blank(fig, tmp_path / "gpt2.png")

    def test_all_nan_layers_draw_without_warnings(self, tmp_path: Path) -> None:
        model = track(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)))
        fig = hs.plots.layer_stats(hs.trace(model, torch.full((2, 3), float("nan"))))
        assert len(fig.axes[0].collections[-1].get_offsets()) == 3  # every layer marked NaN/Inf
        fig.savefig(tmp_path / "nan.png")

    def test_stats_off_is_refused(self) -> None:
        with pytest.raises(hs.SpecError, match="stats=False"):
            hs.plots.layer_stats(hs.trace(SmallCNN(), torch.randn(1, 3, 32, 32), stats=False))
