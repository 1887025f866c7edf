"""``hs.plots.attention``: one heatmap per head, equal to the pattern, tokens on the axes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import hookscope as hs

pytest.importorskip("matplotlib")


def panels(fig: Any) -> list[Any]:
    return [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]


@pytest.mark.transformers
def test_heads_of_an_eager_gpt2_pattern_are_drawn_as_they_are(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    model = GPT2Model(GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=100, attn_implementation="eager")).eval()
    ids = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        weights = model(ids, output_attentions=True).attentions[0]  # (1, 4, 6, 6), causal
    tokens = [f"t{i}" for i in range(6)]
    fig = hs.plots.attention(weights, tokens=tokens)
    shown = panels(fig)
    assert [ax.get_title() for ax in shown] == ["head 0", "head 1", "head 2", "head 3"]
    for head, ax in enumerate(shown):
        assert np.array_equal(ax.images[0].get_array(), weights[0, head].numpy())
        assert [label.get_text() for label in ax.get_xticklabels()] == tokens
    assert {ax.images[0].get_clim() for ax in shown} == {(0.0, float(weights.max()))}  # one scale
    one = hs.plots.attention(weights, heads=2, title="h.0")
    assert [ax.get_title() for ax in panels(one)] == ["head 2"]
    assert "1 of 4 heads" in one.get_suptitle()
    fig.savefig(tmp_path / "attention.png")
    assert (tmp_path / "attention.png").stat().st_size > 0


def test_a_generated_steps_one_query_is_labelled_with_the_last_token() -> None:
    pattern = torch.softmax(torch.randn(2, 1, 5), dim=-1)  # (heads, 1 query, 5 keys)
    fig = hs.plots.attention(pattern, tokens=list("abcde"))
    assert [label.get_text() for label in panels(fig)[0].get_yticklabels()] == ["e"]
    assert np.allclose(panels(fig)[1].images[0].get_array(), pattern[1].numpy())


@pytest.mark.parametrize(
    ("pattern", "options", "message"),
    [
        (torch.zeros(5), {}, r"pattern has shape \(5,\); expected \(queries, keys\)"),
        (torch.zeros(2, 3, 4, 4), {"sample": 2}, "sample=2 is outside the batch of 2"),
        (torch.zeros(3, 4, 4), {"heads": 3}, "heads=3; expected head indices from 0 to 2"),
        (torch.zeros(3, 4, 4), {"heads": []}, r"heads=\[\]"),
        (torch.zeros(3, 4, 4), {"tokens": ["a"]}, "tokens has 1 labels for 4 keys"),
    ],
)
def test_bad_input_is_refused(pattern: torch.Tensor, options: dict[str, Any], message: str) -> None:
    with pytest.raises(hs.SpecError, match=message):
        hs.plots.attention(pattern, **options)


def test_more_queries_than_keys_and_numpy_head_indices() -> None:
    pattern = torch.softmax(torch.randn(2, 6, 3), dim=-1)  # cross-attention: 6 queries over 3 keys
    fig = hs.plots.attention(pattern, tokens=["x", "y", "z"], heads=np.int64(1))
    (ax,) = panels(fig)
    assert [label.get_text() for label in ax.get_xticklabels()] == ["x", "y", "z"]
    assert np.allclose(ax.images[0].get_array(), pattern[1].numpy())


def test_one_head_s_title_fits_inside_its_figure() -> None:
    pattern = torch.softmax(torch.randn(4, 8, 8, generator=torch.Generator().manual_seed(0)), -1)
    fig = hs.plots.attention(pattern, heads=[3])
    fig.canvas.draw()
    title = fig._suptitle
    assert title is not None
    box = title.get_window_extent()
    width = fig.get_figwidth() * fig.dpi
    assert box.x0 >= 0
    assert box.x1 <= width
