"""SAE splicing (``hs.edits.splice``), checked against raw ``register_forward_hook`` references."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hookscope as hs
from tests.conftest import raw_hook_count
from tests.models import gpt2_input, tiny_gpt2, track


class SAE(nn.Module):
    """A plain SAE: encode = relu(W_enc (x - b_dec) + b_enc), decode = W_dec z + b_dec, random weights."""

    def __init__(self, d_in: int = 32, d_sae: int = 64, seed: int = 1) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.W_enc = nn.Parameter(torch.randn(d_in, d_sae, generator=generator) / d_in**0.5)
        self.b_enc = nn.Parameter(torch.randn(d_sae, generator=generator) * 0.1)
        self.W_dec = nn.Parameter(torch.randn(d_sae, d_in, generator=generator) / d_sae**0.5)
        self.b_dec = nn.Parameter(torch.randn(d_in, generator=generator) * 0.1)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu((x - self.b_dec) @ self.W_enc + self.b_enc)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return z @ self.W_dec + self.b_dec


def gpt2_lm() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    return track(GPT2LMHeadModel(config).eval())


def llama_lm() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    )
    return track(LlamaForCausalLM(config).eval())


#: Per architecture: the model, the block spliced, the input embedding.
LMS = {
    "gpt2": (gpt2_lm, "transformer.h.1", "transformer.wte.weight"),
    "llama": (llama_lm, "model.layers.1", "model.embed_tokens.weight"),
}


def first(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output[0]


def with_first(output: Any, new: torch.Tensor) -> Any:
    return new if isinstance(output, torch.Tensor) else (new, *output[1:])


@contextmanager
def raw_hook(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor | None]) -> Iterator[None]:
    """A plain forward hook that replaces the first tensor of the output by ``fn(x)`` (None: leaves it)."""

    def hook(mod: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        new = fn(first(output))
        return None if new is None else with_first(output, new)

    handle = module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def raw_capture(model: nn.Module, site: str, *args: Any, **kwargs: Any) -> tuple[Any, torch.Tensor]:
    """The model's output and the first tensor ``site`` returns, read with a raw hook."""
    seen: list[torch.Tensor] = []

    def keep(x: torch.Tensor) -> None:
        seen.append(x.detach().clone())

    with raw_hook(model.get_submodule(site), keep):
        out = model(*args, **kwargs)
    return out, seen[0]


# -- the value downstream ---------------------------------------------------------------------------


@pytest.mark.transformers
@pytest.mark.parametrize("arch", sorted(LMS))
def test_splice_matches_a_raw_hook_splice(arch: str) -> None:
    build, site, _ = LMS[arch]
    model, sae, ids = build(), SAE(), gpt2_input()
    with torch.no_grad():
        clean = model(ids).logits
        with raw_hook(model.get_submodule(site), lambda x: sae.decode(sae.encode(x))):
            expected = model(ids).logits
        spliced, editor = hs.run_with_edits(model, ids, edits={site: hs.edits.splice(sae)})
    assert editor.applied == {site: 1}
    assert not torch.allclose(expected, clean, atol=1e-3)  # the SAE does change the model's output
    torch.testing.assert_close(spliced.logits, expected)


@pytest.mark.transformers
@pytest.mark.parametrize("arch", sorted(LMS))
def test_keep_error_leaves_logits_and_gives_latent_gradients(arch: str) -> None:
    build, site, embedding_name = LMS[arch]
    model, sae, ids = build(), SAE(), gpt2_input()
    clean = model(ids).logits.detach()
    # The reference, by hand: the same formula in a raw hook, the latents' gradient kept.
    held: dict[str, torch.Tensor] = {}

    def by_hand(x: torch.Tensor) -> torch.Tensor:
        held["z"] = z = sae.encode(x)
        z.retain_grad()
        recon = sae.decode(z)
        return recon + (x - recon).detach()

    with raw_hook(model.get_submodule(site), by_hand):
        model(ids).logits.square().mean().backward()
    expected_latent_grad = held["z"].grad
    expected_param_grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    expected_sae_grad = sae.W_enc.grad.clone()  # type: ignore[union-attr]
    model.zero_grad()
    sae.zero_grad()

    spliced = hs.edits.splice(sae, keep_error=True)
    seen: list[torch.Tensor] = []

    def keep_latents(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
        output.retain_grad()
        seen.append(output)

    handle = spliced.hook_point.register_forward_hook(keep_latents)
    try:
        with hs.edit(model, {site: spliced}):
            logits = model(ids).logits
        logits.square().mean().backward()
    finally:
        handle.remove()
    torch.testing.assert_close(logits.detach(), clean)  # downstream runs as without the splice
    assert expected_latent_grad is not None
    assert expected_latent_grad.abs().sum() > 0
    torch.testing.assert_close(seen[0].grad, expected_latent_grad)
    got_param_grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(got_param_grads) == len(expected_param_grads) > 0
    for got, want in zip(got_param_grads, expected_param_grads, strict=True):
        torch.testing.assert_close(got, want)
    embedding = model.get_parameter(embedding_name).grad
    assert embedding is not None
    assert embedding.abs().sum() > 0  # reaches the inputs, through the SAE
    assert sae.W_enc.grad is not None
    assert sae.W_enc.grad.abs().sum() > 0
    torch.testing.assert_close(sae.W_enc.grad, expected_sae_grad)
    assert not spliced.latents.last.requires_grad  # the mapping holds them detached


@pytest.mark.transformers
def test_keep_error_differs_from_the_plain_splice() -> None:
    model, sae, ids = tiny_gpt2(), SAE(), gpt2_input()
    with torch.no_grad():
        clean = model(ids).last_hidden_state
        plain, _ = hs.run_with_edits(model, ids, edits={"h.0": hs.edits.splice(sae)})
        kept, _ = hs.run_with_edits(model, ids, edits={"h.0": hs.edits.splice(sae, keep_error=True)})
    assert not torch.allclose(plain.last_hidden_state, clean, atol=1e-3)
    torch.testing.assert_close(kept.last_hidden_state, clean)


# -- latents ----------------------------------------------------------------------------------------


@pytest.mark.transformers
@pytest.mark.parametrize("grad", [False, True])
def test_latents_read_back_equal_encode_of_a_raw_capture(grad: bool) -> None:
    model, sae, ids = tiny_gpt2(), SAE(), gpt2_input()
    _, x0 = raw_capture(model, "h.0", ids)
    spliced = hs.edits.splice(sae)
    with torch.set_grad_enabled(grad), hs.edit(model, {r"re:h\.\d+": spliced}):
        out = model(ids)
    assert out.last_hidden_state.requires_grad is grad
    # h.1 sees h.0's reconstruction: its reference is taken under a raw splice of h.0.
    with torch.no_grad(), raw_hook(model.get_submodule("h.0"), lambda x: sae.decode(sae.encode(x))):
        _, x1 = raw_capture(model, "h.1", ids)
    assert list(spliced.latents) == ["h.0#0:output", "h.1#0:output"]
    with torch.no_grad():
        torch.testing.assert_close(spliced.latents["h.0#0:output"], sae.encode(x0))
        torch.testing.assert_close(spliced.latents["h.1:output"], sae.encode(x1))  # call 0 when left out
    assert spliced.latents.last is spliced.latents["h.1#0:output"]
    assert not any(t.requires_grad for t in spliced.latents.values())
    with pytest.raises(hs.SiteNotFoundError, match="h.0#0:output"):
        spliced.latents["h.2#0:output"]


def test_latents_keep_the_latest_pass_only() -> None:
    model = track(nn.Sequential(nn.Linear(3, 32), nn.Linear(32, 32)))
    spliced = hs.edits.splice(SAE())
    with hs.edit(model, {"0": spliced, "1": spliced}):
        model(torch.ones(2, 3))
    assert list(spliced.latents) == ["0#0:output", "1#0:output"]
    with hs.edit(model, {"0": spliced}):
        model(torch.ones(5, 3))
    assert list(spliced.latents) == ["0#0:output"]  # the earlier pass's h.1 is gone
    assert spliced.latents.last.shape == (5, 64)
    with pytest.raises(hs.SiteNotFoundError, match="has not run"):
        _ = hs.edits.splice(SAE()).latents.last


def test_a_hook_on_the_hook_point_edits_the_latents() -> None:
    model, sae, x = nn.Sequential(nn.Linear(3, 32), nn.Tanh()), SAE(), torch.randn(4, 3)
    track(model)
    with torch.no_grad():
        z = sae.encode(model[0](x))
        expected = model[1](sae.decode(z.index_fill(-1, torch.tensor([0, 1, 2]), 0)))
        spliced = hs.edits.splice(sae)
        with (
            hs.edit(model, {"0": spliced}),
            hs.edit(spliced.hook_point, {"(root)": hs.edits.zero(neurons=[0, 1, 2])}),
        ):
            out = model(x)
    assert z[:, :3].abs().sum() > 0  # there was something to ablate
    torch.testing.assert_close(out, expected)
    assert spliced.latents.last[:, :3].abs().sum() == 0


# -- sites, dtypes, errors --------------------------------------------------------------------------


@pytest.mark.transformers
def test_splice_at_a_std_site() -> None:
    model, sae, ids = tiny_gpt2(), SAE(), gpt2_input()
    with torch.no_grad():
        with raw_hook(model.get_submodule("h.1"), lambda x: sae.decode(sae.encode(x))):
            expected = model(ids).last_hidden_state
        spliced = hs.edits.splice(sae)
        out, editor = hs.run_with_edits(model, ids, edits={"std:blocks.1.resid_post": spliced})
    assert sum(editor.applied.values()) == 1
    torch.testing.assert_close(out.last_hidden_state, expected)
    _, x1 = raw_capture(model, "h.1", ids)
    torch.testing.assert_close(spliced.latents.last, sae.encode(x1).detach())


def test_the_value_is_cast_to_the_sae_and_back() -> None:
    model, x = nn.Sequential(nn.Linear(3, 32), nn.Tanh()), torch.randn(4, 3)
    track(model)
    sae = SAE().double()
    with torch.no_grad():
        expected = model[1](sae.decode(sae.encode(model[0](x).double())).float())
        out, _ = hs.run_with_edits(model, x, edits={"0": hs.edits.splice(sae)})
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected)
    assert sae.W_enc.dtype == torch.float64  # the SAE is not cast


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_value_moves_to_the_sae_device_and_back() -> None:
    model, x = nn.Sequential(nn.Linear(3, 32), nn.Tanh()), torch.randn(4, 3)
    track(model)
    sae = SAE().cuda()
    with torch.no_grad():
        expected = model[1](sae.decode(sae.encode(model[0](x).cuda())).cpu())
        spliced = hs.edits.splice(sae)
        out, _ = hs.run_with_edits(model, x, edits={"0": spliced})
    assert out.device.type == "cpu"
    assert spliced.latents.last.device.type == "cuda"
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("sae", [nn.Linear(2, 2), object(), "sae"])
def test_no_encode_or_decode_is_a_spec_error(sae: Any) -> None:
    with pytest.raises(hs.SpecError, match=r"encode\(x\) -> latents and decode"):
        hs.edits.splice(sae)


def test_encode_without_decode_names_what_is_missing() -> None:
    class Half(nn.Module):
        def encode(self, x: torch.Tensor) -> torch.Tensor:
            return x

    with pytest.raises(hs.SpecError, match="no callable decode;"):
        hs.edits.splice(Half())
    with pytest.raises(hs.SpecError, match="keep_error"):
        hs.edits.splice(SAE(), keep_error="yes")  # type: ignore[arg-type]


@pytest.mark.transformers
def test_an_error_in_encode_leaves_no_hook() -> None:
    class Broken(SAE):
        def encode(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("encode failed")

    model = tiny_gpt2()
    with pytest.raises(RuntimeError, match="encode failed") as raised:
        hs.run_with_edits(model, gpt2_input(), edits={"h.1": hs.edits.splice(Broken())})
    if sys.version_info >= (3, 11):  # the note that names the site
        assert any("h.1#0:output" in note for note in raised.value.__notes__)
    assert raw_hook_count(model) == 0
    with pytest.raises(RuntimeError, match="encode failed"), hs.edit(model, {"h.0": hs.edits.splice(Broken())}):
        model(gpt2_input())
    assert raw_hook_count(model) == 0


def test_a_decode_of_another_shape_is_an_edit_error_naming_the_site() -> None:
    model = track(nn.Sequential(nn.Linear(3, 32), nn.Tanh()))
    sae = SAE()
    sae.W_dec = nn.Parameter(torch.randn(64, 16))
    sae.b_dec = nn.Parameter(torch.zeros(16))
    sae.encode = lambda x: torch.relu(x @ sae.W_enc)  # type: ignore[method-assign]
    with pytest.raises(hs.EditError, match=r"0#0:output: sae.decode.*shape \(4, 16\).*\(4, 32\)"):
        hs.run_with_edits(model, torch.randn(4, 3), edits={"0": hs.edits.splice(sae)})
    assert raw_hook_count(model) == 0


def test_path_picks_the_tensor_of_a_structured_output() -> None:
    class Pair(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x * 2, x * 3

    model, sae, x = track(nn.Sequential(Pair())), SAE(), torch.randn(4, 32)
    with torch.no_grad():
        out, _ = hs.run_with_edits(model, x, edits={"0": hs.edits.splice(sae, path="[1]")})
        torch.testing.assert_close(out[0], x * 2)
        torch.testing.assert_close(out[1], sae.decode(sae.encode(x * 3)))
    assert repr(hs.edits.splice(sae, keep_error=True, path="[1]")) == (
        "hs.edits.splice(SAE, keep_error=True, path='[1]')"
    )


# -- sparse latents to disk -------------------------------------------------------------------------


def test_topk_latents_keeps_the_largest_and_scatters_back() -> None:
    z = torch.relu(torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0)) - 1.5)
    k = int((z > 0).sum(-1).max())
    values, indices = hs.edits.topk_latents(z, k)
    assert values.shape == indices.shape == (3, 5, k)
    assert (values[..., :-1] >= values[..., 1:]).all()
    torch.testing.assert_close(torch.zeros_like(z).scatter(-1, indices, values), z)  # nothing non-zero lost
    with pytest.raises(hs.SpecError, match="more latents than the 64"):
        hs.edits.topk_latents(z, 65)
    with pytest.raises(hs.SpecError, match="k=0"):
        hs.edits.topk_latents(z, 0)


@pytest.mark.transformers
def test_extract_stores_the_topk_latents_of_a_data_set(tmp_path: Path) -> None:
    pytest.importorskip("zarr")
    model, sae, k = tiny_gpt2(), SAE(), 6
    ids = torch.randint(0, 64, (10, 8), generator=torch.Generator().manual_seed(3))
    spliced = hs.edits.splice(sae)
    store = hs.extract(model, ids, layers="h.1", out=tmp_path / "latents.zarr", reduce=spliced.topk(k), batch_size=4)
    rows = store.torch("h.1")
    assert rows.shape == (10, 8, 2 * k)
    assert rows.dtype == torch.float32
    with torch.no_grad():
        _, x1 = raw_capture(model, "h.1", ids)
        values, indices = torch.topk(sae.encode(x1), k, dim=-1)
    torch.testing.assert_close(rows[..., :k], values)
    assert torch.equal(rows[..., k:].long(), indices)
    # The same latents as the splice computes at that site in an edited run.
    with torch.no_grad(), hs.edit(model, {"h.1": spliced}):
        model(ids[:4])
    torch.testing.assert_close(rows[:4, :, :k], hs.edits.topk_latents(spliced.latents.last, k)[0])
