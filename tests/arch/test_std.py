"""Canonical names ("std:") in every feature, the structural detector, and the map's life cycle.

Per-family values are in test_std_families.py; here the references are raw hooks and hand
arithmetic on GPT-2 and Llama, a wrapped (re-nested) GPT-2 and a model no table knows.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope.cli import main

pytestmark = [pytest.mark.transformers]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100, n_positions=64)
    return transformers.GPT2LMHeadModel(config).eval()


def llama(**overrides: object) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=100, **overrides,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def tokens() -> torch.Tensor:
    return torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(1))


class Wrapped(nn.Module):
    """A block re-nested under another name: the GPT-2 table no longer fits."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: object, **kwargs: object) -> object:
        return self.inner(*args, **kwargs)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm_a = nn.LayerNorm(8)
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.norm_b = nn.LayerNorm(8)
        self.ffn = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm_a(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        return x + self.ffn(self.norm_b(x))


class Unknown(nn.Module):
    """A pre-norm transformer no family table knows."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(50, 8)
        self.layers = nn.ModuleList([Block(), Block()])
        self.final = nn.LayerNorm(8)
        self.head = nn.Linear(8, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.final(x))


def raw_io(model: nn.Module, name: str, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
    """The first positional input and the first output tensor of module ``name``, by raw hooks."""
    module = dict(model.named_modules())[name]
    seen: dict[str, torch.Tensor] = {}

    def pre(_m: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        seen["in"] = inputs[0].detach().clone()

    def post(_m: nn.Module, _i: object, output: object) -> None:
        first = output[0] if isinstance(output, tuple) else output
        assert isinstance(first, torch.Tensor)
        seen["out"] = first.detach().clone()

    handles = [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        with torch.no_grad():
            model(*args)
    finally:
        for handle in handles:
            handle.remove()
    return seen["in"], seen["out"]


def test_a_renamed_copy_resolves_through_the_detector_with_the_same_values() -> None:
    model, x = gpt2(), tokens()
    for index in range(2):
        model.transformer.h[index] = Wrapped(model.transformer.h[index])
    std = hs.std_map(model, x)
    assert std.family == "detected"
    assert std["blocks.1.ln2"].read == "transformer.h.1.inner.ln_2:output"
    with hs.capture(model, "std:blocks.*.resid_*", "std:blocks.*.attn") as cap, torch.no_grad():
        model(x)
    pre, post = raw_io(model, "transformer.h.1", x)
    assert torch.equal(cap.cache.std["blocks.1.resid_pre"], pre)
    assert torch.equal(cap.cache.std["blocks.1.resid_post"], post)
    mid = cap.cache.std["blocks.1.resid_mid"]
    torch.testing.assert_close(mid, pre + cap.cache.std["blocks.1.attn"], rtol=0, atol=1e-6)


def test_an_unknown_architecture_resolves_every_role_by_structure() -> None:
    model, ids = Unknown().eval(), torch.randint(0, 50, (2, 5))
    std = hs.std_map(model, ids)
    assert {"embed", "ln_final", "unembed", "blocks.0.ln1", "blocks.0.mlp.pre", "blocks.1.resid_mid"} <= set(std)
    assert std["blocks.0.mlp.pre"].read == "layers.0.ffn.1:input[0]"
    with hs.capture(model, "std:blocks.0.mlp.post", "std:blocks.0.resid_mid") as cap, torch.no_grad():
        model(ids)
    with torch.no_grad():  # by hand: the block's arithmetic, step by step
        x = model.tok(ids)
        h = model.layers[0].norm_a(x)
        mid = x + model.layers[0].attention(h, h, h, need_weights=False)[0]
        hidden = model.layers[0].ffn[1](model.layers[0].ffn[0](model.layers[0].norm_b(mid)))
    torch.testing.assert_close(cap.cache.std["blocks.0.resid_mid"], mid, rtol=0, atol=0)
    torch.testing.assert_close(cap.cache.std["blocks.0.mlp.post"], hidden, rtol=0, atol=0)
    assert "attention" in std.missing["blocks.0.attn.pattern"]


def test_a_model_without_blocks_or_input_is_refused_with_the_fix() -> None:
    with pytest.raises(hs.StdMapError, match="no block list") as caught:
        hs.std_map(nn.Sequential(nn.Linear(4, 4)), torch.ones(1, 4))
    assert caught.value.check == "no block list"
    with pytest.raises(hs.StdMapError, match=r"hs.std_map\(model, example_input\)"):
        hs.capture(Unknown(), "std:blocks.*.resid_post")


def test_the_detector_names_a_role_it_cannot_place() -> None:
    class NoMlp(Unknown):
        def __init__(self) -> None:
            super().__init__()
            for layer in self.layers:
                layer.proj = layer.ffn  # type: ignore[assignment]
                del layer.ffn

    model = NoMlp()
    for layer in model.layers:
        layer.forward = lambda x, layer=layer: (lambda h: h + layer.proj(layer.norm_b(h)))(  # type: ignore[method-assign]
            x + layer.attention(*(layer.norm_a(x),) * 3, need_weights=False)[0]
        )
    std = hs.std_map(model.eval(), torch.randint(0, 50, (2, 5)))
    assert "found no mlp module" in std.missing["blocks.0.mlp"]
    with pytest.raises(hs.SelectionError, match="found no mlp module"):
        hs.capture(model, "std:blocks.0.mlp")


def test_the_map_is_made_once_and_again_when_the_modules_change() -> None:
    model, x = gpt2(), tokens()
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    with hs.capture(model, "std:blocks.0.resid_post"), torch.no_grad():
        model(x)
    with hs.capture(model, "std:blocks.1.resid_post"), torch.no_grad():
        model(x)
    assert len(forwards) == 3  # one check forward, then the user's two
    for index in range(2):
        model.transformer.h[index] = Wrapped(model.transformer.h[index])
    hs.capture(model, "std:blocks.1.resid_post").remove()
    assert len(forwards) > 3  # the modules changed: checked again (the detector reads the blocks both ways)


def test_edits_at_canonical_sites_change_what_the_rest_of_the_forward_sees() -> None:
    model, x = llama(), tokens()
    with hs.edit(model, {"std:blocks.0.resid_mid": hs.edits.scale(0.5)}) as editor, torch.no_grad():
        edited = model(x).logits
    assert editor.applied == {"model.layers.0:op[add#0]": 1}
    layer = model.model.layers[0]

    def halve_the_sum(_m: nn.Module, args: tuple[torch.Tensor, ...], kwargs: dict[str, object]) -> object:
        return args, kwargs

    # By hand: run layer 0 with the residual sum halved (both the norm's input and the residual).
    def layer0(hidden: torch.Tensor, **kwargs: object) -> torch.Tensor:
        normed = layer.input_layernorm(hidden)
        attn = layer.self_attn(normed, **kwargs)[0]
        mid = (hidden + attn) * 0.5
        return mid + layer.mlp(layer.post_attention_layernorm(mid))

    original = layer.forward
    layer.forward = lambda hidden, **kwargs: layer0(
        hidden, **{k: v for k, v in kwargs.items() if k in ("attention_mask", "position_embeddings")}
    )  # type: ignore[method-assign]
    try:
        with torch.no_grad():
            expected = model(x).logits
    finally:
        layer.forward = original  # type: ignore[method-assign]
    torch.testing.assert_close(edited, expected, rtol=0, atol=1e-5)


def test_an_edit_of_an_input_site_runs_the_block_on_the_edited_input() -> None:
    model, x = gpt2(), tokens()
    with hs.edit(model, {"std:blocks.1.resid_pre": hs.edits.zero()}) as editor, torch.no_grad():
        edited = model(x).logits
    assert editor.applied == {"transformer.h.1": 1}
    handle = model.transformer.h[0].register_forward_hook(lambda _m, _i, out: torch.zeros_like(out))
    try:
        with torch.no_grad():
            expected = model(x).logits
    finally:
        handle.remove()
    assert torch.equal(edited, expected)


def test_a_leaf_selector_edit_takes_its_side_and_refuses_a_second_path() -> None:
    model, x = gpt2(), tokens()
    with hs.edit(model, {"transformer.h.1:input[0]": hs.edits.zero()}, on="output"), torch.no_grad():
        by_leaf = model(x).logits
    with hs.edit(model, {"transformer.h.1": hs.edits.zero()}, on="input"), torch.no_grad():
        by_side = model(x).logits
    assert torch.equal(by_leaf, by_side)
    with pytest.raises(hs.SpecError, match="path="):
        hs.edit(model, {"transformer.h.1:output": hs.edits.zero(path="[0]")})


def test_extract_stores_canonical_sites_and_reads_them_back_by_name(tmp_path: Path) -> None:
    model, x = gpt2(), torch.randint(0, 100, (8, 7), generator=torch.Generator().manual_seed(2))
    store = hs.extract(model, x, layers=["std:blocks.*.resid_post"], out=tmp_path / "f.zarr", batch_size=4)
    with hs.capture(model, "std:blocks.1.resid_post") as cap, torch.no_grad():
        model(x)
    assert np.array_equal(store["std:blocks.1.resid_post"][:], cap.cache.std["blocks.1.resid_post"].numpy())
    reopened = hs.open_store(tmp_path / "f.zarr")
    assert np.array_equal(reopened["std:blocks.0.resid_post"][:2], store["transformer.h.0"][:2])


def test_a_saved_cache_keeps_its_canonical_names(tmp_path: Path) -> None:
    model, x = gpt2(), tokens()
    with hs.capture(model, "std:blocks.0.attn.pattern") as cap, torch.no_grad():
        model(x)
    loaded = hs.load(cap.cache.save(tmp_path / "c.safetensors"))
    assert torch.equal(loaded["std:blocks.0.attn.pattern"], cap.cache.std["blocks.0.attn.pattern"])
    with pytest.raises(hs.SiteNotFoundError, match="std:blocks.0.attn.pattern"):
        loaded["std:blocks.0.attn.patern"]


def test_trace_and_gradients_take_module_valued_names_and_refuse_the_rest() -> None:
    model, x = gpt2(), tokens()
    trace = hs.trace(model, x, layers=["std:blocks.*.attn"])
    assert [row.name for row in trace.rows] == ["transformer.h.0.attn", "transformer.h.1.attn"]
    with pytest.raises(hs.SelectionError, match="not a module's output"):
        hs.trace(model, x, layers="std:blocks.0.resid_pre")
    model.train()
    with hs.watch_grads(model, layers="std:blocks.*.mlp") as monitor:
        model(x).logits.sum().backward()
        monitor.step()
    assert list(monitor.history.columns) == ["transformer.h.0.mlp#0", "transformer.h.1.mlp#0"]


def test_diff_pairs_two_architectures_by_canonical_name() -> None:
    a = llama()
    config = transformers.MistralConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=100,
    )  # fmt: skip
    b = transformers.MistralForCausalLM(config).eval()
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        b.model.layers[1].mlp.down_proj.weight.mul_(1.5)
    found = hs.diff(a, b, tokens(), match="std")
    divergence = found.first_divergence()
    assert divergence is not None
    assert divergence.row.site.startswith("model.layers.1.mlp")
    assert "model.layers.0.self_attn#0:output[0]" in [row.site for row in found.rows]


def test_layers_prints_the_map_and_the_cli_takes_canonical_selectors(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    table = hs.layers(gpt2(), std=True)
    assert table.std is not None
    assert "blocks.{i}.resid_mid" in str(table)
    spec = "hf-config:gpt2?n_layer=2&n_embd=32&n_head=2&vocab_size=64&n_positions=32&bos_token_id=0&eos_token_id=0"
    with pytest.raises(SystemExit) as done:
        main(["layers", spec, "--std"])
    out = capsys.readouterr().out
    assert done.value.code in (0, None)
    assert "blocks.{i}.attn.pattern" in out
    assert "h.{i}.attn:attn.pattern" in out
    with pytest.raises(SystemExit) as done:
        main(["capture", spec, "-l", "std:blocks.*.resid_post", "-o", str(tmp_path / "c.safetensors")])
    capsys.readouterr()
    assert done.value.code in (0, None)
    loaded = hs.load(tmp_path / "c.safetensors")
    assert loaded["std:blocks.1.resid_post"].shape[-1] == 32


def test_the_report_draws_the_modules_of_canonical_names(tmp_path: Path) -> None:
    model, x = gpt2(), tokens()
    path = hs.report(model, x, out=tmp_path / "r.html", layers="std:blocks.*.mlp")
    text = Path(path).read_text()
    assert "transformer.h.1.mlp" in text


def test_two_names_on_one_site_both_read_and_a_bad_example_is_a_hookscope_error() -> None:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=100
    )
    bert = transformers.BertModel(config).eval()
    with hs.capture(bert, "std:blocks.0.ln1", "std:blocks.0.resid_mid") as cap, torch.no_grad():
        bert(tokens())
    assert torch.equal(cap.cache["std:blocks.0.ln1"], cap.cache["std:blocks.0.resid_mid"])
    with pytest.raises(hs.StdMapError, match="check forward"):
        hs.std_map(gpt2(), torch.zeros(2, 3, 4))


def test_a_switched_attention_implementation_makes_a_new_map() -> None:
    model = llama()
    assert hs.std_map(model)["blocks.0.attn.pattern"].read.endswith(":attn.pattern")
    model.set_attn_implementation("eager")
    with hs.capture(model, "std:blocks.0.attn.pattern") as cap, torch.no_grad():
        model(tokens())
    assert cap.cache.meta["std"]["blocks.0.attn.pattern"].endswith(":op[softmax#0]")
