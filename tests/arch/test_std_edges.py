"""Canonical names at their edges: train mode, weight-tied blocks, hooks attached after the map,
names past the last block. References are raw PyTorch hooks on modules named here by hand."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import hookscope as hs

pytestmark = [pytest.mark.transformers]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")


def t5(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=100, d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8, dropout_rate=dropout
    )
    return transformers.T5ForConditionalGeneration(config).eval()


def t5_inputs() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {
        "input_ids": torch.randint(0, 100, (2, 6), generator=generator),
        "decoder_input_ids": torch.randint(0, 100, (2, 5), generator=generator),
    }


def gpt2(layers: int = 2) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_embd=32, n_layer=layers, n_head=4, vocab_size=100, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2Model(config).eval()


def tokens() -> torch.Tensor:
    return torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(1))


def raw_outputs(model: nn.Module, names: list[str], run: object) -> dict[str, torch.Tensor]:
    """The first tensor each named module returned and took, with plain PyTorch hooks."""
    seen: dict[str, torch.Tensor] = {}
    handles = []
    modules = dict(model.named_modules())

    def keep(name: str) -> object:
        def hook(_module: nn.Module, args: tuple[torch.Tensor, ...], output: object) -> None:
            first = output[0] if isinstance(output, tuple) else output
            seen.setdefault(f"{name}:output", first.detach().clone())
            seen.setdefault(f"{name}:input", args[0].detach().clone())

        return hook

    for name in names:
        handles.append(modules[name].register_forward_hook(keep(name)))
    try:
        run()  # type: ignore[operator]
    finally:
        for handle in handles:
            handle.remove()
    return seen


# -- T5 in train mode: attn and mlp are what the sublayer adds, after its dropout ------------------


@pytest.mark.slow
def test_t5_attn_and_mlp_are_what_each_sublayer_adds_in_train_mode() -> None:
    model, inputs = t5(dropout=0.5), t5_inputs()
    hs.std_map(model)
    names = ["attn", "resid_mid", "mlp", "resid_post", "resid_pre"]
    selectors = [f"std:{stack}.blocks.0.{name}" for stack in ("encoder", "decoder") for name in names]
    selectors += ["std:decoder.blocks.0.cross_attn", "std:decoder.blocks.0.resid_mid_cross"]
    model.train()
    block = {stack: f"{stack}.block.0" for stack in ("encoder", "decoder")}
    hand = [f"{block['encoder']}.layer.{i}" for i in (0, 1)] + [f"{block['decoder']}.layer.{i}" for i in (0, 1, 2)]
    torch.manual_seed(3)
    raw = raw_outputs(model, hand, lambda: model(**inputs))
    torch.manual_seed(3)  # the same dropout masks
    with hs.capture(model, *selectors) as cap:
        model(**inputs)
    cache = cap.cache
    for stack, layers in (("encoder", ("layer.0", "layer.1")), ("decoder", ("layer.0", "layer.1", "layer.2"))):
        b = f"{stack}.blocks.0"
        adds = ["attn", "cross_attn", "mlp"] if stack == "decoder" else ["attn", "mlp"]
        for add, layer in zip(adds, layers, strict=True):
            raw_in, raw_out = raw[f"{block[stack]}.{layer}:input"], raw[f"{block[stack]}.{layer}:output"]
            added = raw_out - raw_in  # what the sublayer added to the stream, dropout applied
            got = cache[f"std:{b}.{add}"]
            torch.testing.assert_close(got, added, rtol=1e-5, atol=1e-5, msg=f"{b}.{add}")
            assert (got == 0).float().mean() > 0.2, f"{b}.{add}: dropout zeroes about half of it in train mode"
    assert model.training


# -- resid_mid is the stream, whatever a hook on the next norm does with its input -----------------


def _resid_mid_by_hand(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Block 0's resid_mid of GPT-2: its input plus what attention returns, by plain hooks."""
    raw = raw_outputs(model, ["h.0", "h.0.attn"], lambda: model(ids))
    return raw["h.0:input"] + raw["h.0.attn:output"]


def test_resid_mid_is_read_before_a_pre_hook_on_the_next_norm_attached_after_the_map() -> None:
    model, ids = gpt2(), tokens()
    hs.std_map(model)
    with torch.no_grad():
        expected = _resid_mid_by_hand(model, ids)
    handle = model.h[0].ln_2.register_forward_pre_hook(lambda _m, args: (args[0] * 3.0,))
    try:
        with torch.no_grad(), hs.capture(model, "std:blocks.0.resid_mid") as cap:
            model(ids)
        torch.testing.assert_close(cap.cache["std:blocks.0.resid_mid"], expected, rtol=1e-5, atol=1e-5)
    finally:
        handle.remove()


def test_resid_mid_is_read_before_an_input_edit_of_the_next_norm() -> None:
    model, ids = gpt2(), tokens()
    hs.std_map(model)
    with torch.no_grad():
        expected = _resid_mid_by_hand(model, ids)
    with (
        torch.no_grad(),
        hs.edit(model, {"h.0.ln_2": hs.edits.scale(0.0)}, on="input"),
        hs.capture(model, "std:blocks.0.resid_mid") as cap,
    ):
        model(ids)
    torch.testing.assert_close(cap.cache["std:blocks.0.resid_mid"], expected, rtol=1e-5, atol=1e-5)
    assert cap.cache["std:blocks.0.resid_mid"].abs().max() > 0  # the stream, not the zeroed norm input


def test_a_norm_input_captured_by_module_name_does_not_answer_for_resid_mid_after_an_input_edit() -> None:
    model, ids = gpt2(), tokens()
    hs.std_map(model)
    with torch.no_grad():
        expected = _resid_mid_by_hand(model, ids)
    with (
        torch.no_grad(),
        hs.edit(model, {"h.0.ln_2": hs.edits.scale(0.5)}, on="input"),
        hs.capture(model, "std:blocks.0.resid_mid") as by_std,
        hs.capture(model, "h.0.ln_2", keep="input") as by_module,
    ):
        model(ids)
    torch.testing.assert_close(by_std.cache["std:blocks.0.resid_mid"], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(by_module.cache["h.0.ln_2"], 0.5 * expected, rtol=1e-5, atol=1e-5)  # what ln_2 took
    with pytest.raises(hs.SiteNotFoundError, match=r"capture 'std:blocks\.0\.resid_mid' itself"):
        by_module.cache["std:blocks.0.resid_mid"]
    assert "std:blocks.0.resid_mid" not in by_module.cache
    # a trace reads a module's input after its other pre-hooks too
    with hs.edit(model, {"h.0.ln_2": hs.edits.scale(0.5)}, on="input"):
        traced = hs.trace(model, ids)
    with pytest.raises(hs.SiteNotFoundError, match="residual stream"):
        traced["std:blocks.0.resid_mid"]
    assert traced["std:blocks.0.resid_post"].name == "h.0"  # other canonical names still answer


# -- a block whose weights serve several layers is refused, not mapped as fewer blocks -------------


def albert(layers: int) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.AlbertConfig(
        vocab_size=100, embedding_size=16, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
        intermediate_size=37,
    )  # fmt: skip
    return transformers.AlbertModel(config).eval()


def test_a_block_object_at_two_positions_is_refused_naming_them() -> None:
    model = gpt2(layers=3)
    model.h[1] = model.h[0]  # tied: h.2 would vanish and blocks.0 would read the second call
    with pytest.raises(hs.StdMapError, match=r"positions 0 and 1") as raised:
        hs.std_map(model)
    assert raised.value.check == "shared block"
    assert "h.0#1" in str(raised.value)  # the fix: the calls of the shared block, by name
    with pytest.raises(hs.StdMapError, match="positions 0 and 1"):
        hs.capture(model, "std:blocks.*.resid_post")


def test_albert_is_refused_with_a_hookscope_error() -> None:
    model = albert(layers=3)  # one layer group run three times
    with pytest.raises(hs.StdMapError, match="ran 3 times") as raised:
        hs.std_map(model)
    assert raised.value.check == "shared block"
    with pytest.raises(hs.StdMapError, match="ran 3 times"):
        hs.capture(model, "std:blocks.0.resid_post")
    # one layer: the detector's reading does not fit, said as a StdMapError, not torch's shape error
    with pytest.raises(hs.StdMapError, match="does not fit"):
        hs.std_map(albert(layers=1))


@pytest.mark.parametrize(("sub", "role"), [("mlp", "mlp"), ("attn", "attn"), ("ln_1", "ln1")])
def test_a_sublayer_object_in_two_blocks_is_refused_naming_it(sub: str, role: str) -> None:
    model, ids = gpt2(), tokens()
    setattr(model.h[1], sub, getattr(model.h[0], sub))  # tied at the sublayer: blocks.0.<role> read block 1's call
    with pytest.raises(hs.StdMapError, match=rf"'h\.0\.{sub}' is also block 'h\.1'") as raised:
        hs.std_map(model)
    assert raised.value.check == "shared block"
    with pytest.raises(hs.StdMapError, match="shared across layers"):
        hs.capture(model, f"std:blocks.0.{role}")
    # the fix the message names reads each call: the second is block 1's, by plain hooks
    calls: list[torch.Tensor] = []
    handle = getattr(model.h[0], sub).register_forward_hook(
        lambda _m, _a, out: calls.append((out[0] if isinstance(out, tuple) else out).detach().clone())
    )
    with torch.no_grad():
        model(ids)
    handle.remove()
    assert f"cache['h.0.{sub}#1']" in str(raised.value)
    with torch.no_grad(), hs.capture(model, f"h.0.{sub}") as cap:
        model(ids)
    torch.testing.assert_close(cap.cache[f"h.0.{sub}#1"], calls[1])
    assert not torch.equal(calls[0], calls[1])


def test_a_role_module_run_twice_in_one_block_is_refused() -> None:
    model = gpt2()
    model.h[0].ln_2 = model.h[0].ln_1  # one norm object for both sublayers: ln1 would read its second call
    with pytest.raises(hs.StdMapError, match=r"'h\.0\.ln_1' of block 'h\.0' ran 2 times") as raised:
        hs.std_map(model)
    assert raised.value.check == "shared block"


# -- names that name nothing say what there is --------------------------------------------------


def test_a_block_past_the_last_says_how_many_blocks_there_are() -> None:
    model = gpt2()
    with pytest.raises(hs.SelectionError, match=r"has 2 blocks \(blocks\.0 to blocks\.1") as raised:
        hs.capture(model, "std:blocks.7.resid_post")
    assert "block 7" in str(raised.value)
    with pytest.raises(hs.SelectionError, match="has 2 blocks"):
        hs.std_map(model)["blocks.2.attn"]


@pytest.mark.transformers
def test_a_final_norm_run_twice_is_missing_with_the_call_to_select() -> None:
    """BLIP's vision post_layernorm norms the last hidden state, then the pooled token: std:ln_final
    read the last call (the pooled one) until it was refused (found by the zoo sweep)."""
    from transformers import BlipVisionConfig, BlipVisionModel

    torch.manual_seed(0)
    config = BlipVisionConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, image_size=32, patch_size=8
    )
    model = BlipVisionModel(config).eval()
    calls = []
    handle = model.post_layernorm.register_forward_hook(lambda m, a, out: calls.append(out.shape))
    try:
        std = hs.std_map(model)
    finally:
        handle.remove()
    assert len(calls) >= 2  # the reason the name is refused: two calls, two shapes
    assert "ln_final" not in std
    assert "ran 2 times in one forward" in std.missing["ln_final"]
    assert "'post_layernorm#0'" in std.missing["ln_final"]
    assert "blocks.1.resid_post" in std  # the rest of the map stands
