"""Hybrid models: blocks with attention or a state-space (or linear-attention) mixer, by canonical name.

The family tables' checks run on the model (``resid_mid == resid_pre + mixer`` in a mixer block,
``+ attn`` in an attention block); here the names are compared with raw hooks' values, and a
Bamba mixer's values with the float64 recurrence through ``hs.verify``.
"""

from __future__ import annotations

from functools import cache

import pytest
import torch
from torch import nn

import hookscope as hs
from tests.models import track

pytestmark = pytest.mark.transformers


@cache
def _built(model_type: str) -> nn.Module:
    from zoo.tiny import build_tiny

    model: nn.Module = build_tiny(model_type).model.eval()
    return model


def tiny(model_type: str) -> nn.Module:
    return track(_built(model_type))


def raw_outputs(model: nn.Module, names: list[str], x: torch.Tensor) -> dict[str, torch.Tensor]:
    seen: dict[str, torch.Tensor] = {}
    handles = [
        model.get_submodule(name).register_forward_hook(
            lambda _, __, output, name=name: seen.__setitem__(name, output[0] if isinstance(output, tuple) else output)
        )
        for name in names
    ]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for handle in handles:
            handle.remove()
    return seen


@pytest.mark.parametrize(
    ("model_type", "mixer"), [("jamba", "mamba"), ("bamba", "mamba"), ("qwen3_next", "linear_attn")]
)
def test_each_block_names_its_mixer_or_its_attention(model_type: str, mixer: str) -> None:
    model = tiny(model_type)
    std = hs.std_map(model)
    kinds = {
        index: "mixer" if f"blocks.{index}.mixer" in std else "attn"
        for index in range(len(model.model.layers))  # type: ignore[union-attr, arg-type]
    }
    assert set(kinds.values()) == {"mixer", "attn"}  # both kinds of block
    x = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    names = [f"model.layers.{i}.{mixer if kind == 'mixer' else 'self_attn'}" for i, kind in kinds.items()]
    raw = raw_outputs(model, names, x)
    with torch.no_grad():
        _, cache_ = hs.run_with_capture(model, x, layers=[f"std:blocks.{i}.{kind}" for i, kind in kinds.items()])
    for (index, kind), name in zip(kinds.items(), names, strict=True):
        assert torch.equal(cache_[f"std:blocks.{index}.{kind}"], raw[name])
        other = "attn" if kind == "mixer" else "mixer"
        assert "hybrid model" in std.missing[f"blocks.{index}.{other}"]


def test_a_mamba_variant_or_a_linear_attention_is_not_read_inside() -> None:
    next_ = hs.std_map(tiny("qwen3_next"))
    assert "gated delta net" in next_.missing["blocks.0.mixer.decay"]
    falcon = tiny("falcon_mamba")  # Mamba with RMS norms of its own: not a mixer the tap reproduces
    with pytest.raises(hs.SpecError, match="not a Mamba or Mamba-2 mixer"):
        hs.capture(falcon, layers="backbone.layers.0.mixer:ssm.decay")


@pytest.mark.parametrize("model_type", ["bamba", "jamba"])
def test_a_hybrid_s_mamba_mixer_is_read_and_verified(model_type: str) -> None:
    report = hs.verify(tiny(model_type), checks=["ssm", "std"], compile=False)
    rows = {row.check: row for row in report.rows}
    assert rows["state-space mixers"].status == "SUPPORTED"
    assert not rows["state-space mixers"].detail.startswith("0 values")
    assert rows["edit state-space"].status == "SUPPORTED"
    assert report.ok
