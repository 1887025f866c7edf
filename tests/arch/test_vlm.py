"""Vision-language models: both stacks and the projector by canonical name, and image positions.

References are raw forward hooks on the same modules and the call's own ``input_ids``.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hookscope as hs
from tests.models import track

pytestmark = pytest.mark.transformers

FAMILIES = ("llava", "qwen2_vl", "gemma3")


@cache
def _built(model_type: str) -> tuple[nn.Module, dict[str, Any]]:
    from zoo.tiny import build_tiny

    model: nn.Module = build_tiny(model_type).model.eval()
    _, kwargs = hs.sample_input(model)
    return model, kwargs


def tiny(model_type: str) -> tuple[nn.Module, dict[str, Any]]:
    model, kwargs = _built(model_type)
    return track(model), kwargs


def raw_outputs(model: nn.Module, names: list[str], kwargs: dict[str, Any]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    handles = []
    for name in names:
        module = model.get_submodule(name)
        handles.append(
            module.register_forward_hook(lambda _, args, output, name=name: seen.update({name: (args, output)}))
        )
    try:
        with torch.no_grad():
            model(**kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def first(value: Any) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else value[0]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_both_stacks_and_the_projector_have_canonical_names(model_type: str) -> None:
    model, kwargs = tiny(model_type)
    std = hs.std_map(model)
    assert std.family == "detected"
    for name in ("vision.embed", "vision.blocks.0", "vision.blocks.1.resid_post", "text.embed", "text.blocks.1.attn",
                 "projector.in", "projector"):  # fmt: skip
        assert name in std, name
    modules = {name: std[name].read.partition(":")[0] for name in ("vision.blocks.1", "text.blocks.1", "projector")}
    seen = raw_outputs(model, list(modules.values()), kwargs)
    with torch.no_grad():
        _, cache_ = hs.run_with_capture(
            model, **kwargs, layers=["std:vision.blocks.1.resid_post", "std:text.blocks.1.resid_post", "std:projector",
                                     "std:projector.in"],
        )  # fmt: skip
    assert torch.equal(cache_["std:vision.blocks.1.resid_post"], first(seen[modules["vision.blocks.1"]][1]))
    assert torch.equal(cache_["std:text.blocks.1.resid_post"], first(seen[modules["text.blocks.1"]][1]))
    assert torch.equal(cache_["std:projector"], first(seen[modules["projector"]][1]))
    assert torch.equal(cache_["std:projector.in"], seen[modules["projector"]][0][0])


def test_a_text_only_input_names_the_language_model_and_says_why_not_the_vision_tower() -> None:
    model, kwargs = tiny("gemma3")
    std = hs.std_map(model, input_ids=kwargs["input_ids"][:, :5].clamp(max=50))
    assert "text.blocks.1.resid_post" in std
    assert "give the map an image" in std.missing["vision.blocks.0"]
    assert "give the map an image" in std.missing["projector"]


def test_the_projected_image_tokens_are_what_the_language_model_reads_at_the_image_positions() -> None:
    model, kwargs = tiny("llava")
    image = kwargs["input_ids"] == model.config.image_token_id  # type: ignore[union-attr]
    with torch.no_grad():
        _, cache_ = hs.run_with_capture(model, **kwargs, layers=["std:projector", "std:text.blocks.0.resid_pre"])
    stream = cache_["std:text.blocks.0.resid_pre"]
    assert torch.equal(stream[image], cache_["std:projector"].reshape(-1, stream.shape[-1]))


@pytest.mark.parametrize("model_type", FAMILIES)
def test_image_and_text_positions_reduce_over_their_own_tokens(model_type: str) -> None:
    model, kwargs = tiny(model_type)
    ids = kwargs["input_ids"]
    image = ids == model.config.image_token_id  # type: ignore[union-attr]
    assert 0 < int(image.sum()) < ids.numel()
    site = "std:text.blocks.1.resid_post"
    with torch.no_grad():
        _, whole = hs.run_with_capture(model, **kwargs, layers=[site])
        _, on_image = hs.run_with_capture(model, **kwargs, layers=[site], reduce="mean:1", token_mask="image")
        _, on_text = hs.run_with_capture(model, **kwargs, layers=[site], reduce="mean:1", token_mask="text")
    value = whole[site].double()
    for got, mask in ((on_image[site], image), (on_text[site], ~image)):
        want = torch.stack([value[row][mask[row]].mean(0) for row in range(value.shape[0])])
        assert torch.allclose(got.double(), want, atol=1e-6)


def test_extract_reduces_over_the_image_positions(tmp_path: Path) -> None:
    model, kwargs = tiny("llava")
    site = "std:text.blocks.1.resid_post"
    store = hs.extract(
        model, [kwargs], layers=[site], out=tmp_path / "image.zarr", reduce="mean:1", mask="image", progress=False
    )
    with torch.no_grad():
        _, want = hs.run_with_capture(model, **kwargs, layers=[site], reduce="mean:1", token_mask="image")
    stored = torch.as_tensor(store[store.sites[0]][:])
    assert torch.allclose(stored, want[site], atol=1e-6)
    padded = {key: torch.cat([value, value]) for key, value in kwargs.items()}
    padded["attention_mask"] = torch.ones_like(padded["input_ids"])
    padded["attention_mask"][1, -3:] = 0
    per_token = hs.extract(model, [padded], layers=[site], out=tmp_path / "padded.zarr", mask="image", progress=False)
    assert per_token.attention_mask is not None  # the padding mask is kept beside the image positions


def test_a_model_without_an_image_token_refuses_image_positions() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = track(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)).eval())
    with pytest.raises(hs.SpecError, match="names no image token"):
        hs.run_with_capture(model, torch.zeros(1, 4, dtype=torch.long), layers="transformer.h.0", reduce="mean:1",
                            token_mask="image")  # fmt: skip


@pytest.mark.parametrize("model_type", ["idefics3", "smolvlm"])
def test_sample_input_gives_idefics_models_an_image_and_its_tokens(model_type: str) -> None:
    model, kwargs = tiny(model_type)
    assert kwargs["pixel_values"].dim() == 5  # (batch, images, channels, height, width)
    image = kwargs["input_ids"] == model.config.image_token_id  # type: ignore[union-attr]
    std = hs.std_map(model)
    with torch.no_grad():
        _, cache_ = hs.run_with_capture(model, **kwargs, layers=["std:projector"])
    assert cache_["std:projector"].reshape(-1, cache_["std:projector"].shape[-1]).shape[0] == int(image.sum())
    assert "vision.blocks.0" in std


def test_a_patch_sweep_over_the_image_positions_patches_each_image_token() -> None:
    model, kwargs = tiny("llava")
    ids = kwargs["input_ids"]
    image = (ids[0] == model.config.image_token_id).nonzero().flatten().tolist()  # type: ignore[union-attr]
    corrupted = {**kwargs, "pixel_values": torch.zeros_like(kwargs["pixel_values"])}

    def metric(output: Any) -> torch.Tensor:
        return output.last_hidden_state[:, -1].sum(-1)

    by_word = hs.methods.patch_sweep(
        model, kwargs, corrupted, metric=metric, layers="std:text.blocks.0.resid_pre", positions="image"
    )
    by_list = hs.methods.patch_sweep(
        model, kwargs, corrupted, metric=metric, layers="std:text.blocks.0.resid_pre", positions=image
    )
    assert by_word.coords == by_list.coords
    assert torch.equal(torch.as_tensor(by_word.values), torch.as_tensor(by_list.values))
