"""A model whose weights are on ``meta`` (built there, not loaded yet), given a real input:
one UnsupportedModelError saying so, not a device mismatch deep in the first layer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hookscope as hs

CALLS: dict[str, Callable[[nn.Module, torch.Tensor], Any]] = {
    "trace": lambda model, x: hs.trace(model, x),
    "run_with_edits": lambda model, x: hs.run_with_edits(model, x, edits={"0": hs.edits.zero()}),
    "run_with_capture": lambda model, x: hs.run_with_capture(model, x, layers="0"),
    "layers": lambda model, x: hs.layers(model, x),
}


def meta_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4, device="meta"), nn.ReLU())


@pytest.mark.parametrize("call", CALLS.values(), ids=CALLS.keys())
def test_a_meta_model_with_a_real_input_is_one_clear_error(call: Callable[[nn.Module, torch.Tensor], Any]) -> None:
    with pytest.raises(RuntimeError):  # what torch itself says: a device mismatch
        meta_model()(torch.ones(2, 4))
    model = meta_model()
    with pytest.raises(hs.UnsupportedModelError) as info:
        call(model, torch.ones(2, 4))
    message = str(info.value)
    assert "meta device" in message
    assert "'0.weight'" in message
    assert "to_empty" in message
    assert "\n" not in message
    assert hs.attached(model) == []  # nothing was left attached


@pytest.mark.parametrize("call", CALLS.values(), ids=CALLS.keys())
def test_a_meta_model_on_a_meta_input_still_runs(call: Callable[[nn.Module, torch.Tensor], Any]) -> None:
    call(meta_model(), torch.ones(2, 4, device="meta"))  # shapes only: a legitimate use


def test_a_materialised_model_runs_as_a_plain_one() -> None:
    model = meta_model().to_empty(device="cpu")
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(4))
        model[0].bias.zero_()
    x = torch.arange(8.0).reshape(2, 4) - 3
    out, cache = hs.run_with_capture(model, x, layers="0")
    torch.testing.assert_close(cache["0"], x, rtol=0, atol=0)
    torch.testing.assert_close(out, x.clamp(min=0), rtol=0, atol=0)


# -- every entry point that runs a forward refuses a meta model (issue 36, item 9) -----------------

RUNS: dict[str, Callable[[nn.Module, torch.Tensor, Path], Any]] = {
    "monitor": lambda model, x, tmp: hs.monitor(model, layers="0"),
    "extract": lambda model, x, tmp: hs.extract(model, [x], layers="0", out=tmp / "store.zarr"),
    "diff": lambda model, x, tmp: hs.diff(model, meta_model(), x),
    "diff, b on meta": lambda model, x, tmp: hs.diff(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), model, x),
    "report": lambda model, x, tmp: hs.report(model, x, out=tmp / "report.html"),
}


@pytest.mark.parametrize("call", RUNS.values(), ids=RUNS.keys())
def test_every_entry_point_that_reads_values_refuses_a_meta_model(
    call: Callable[[nn.Module, torch.Tensor, Path], Any], tmp_path: Path
) -> None:
    """run_with_edits returned meta values silently; the others raised torch's own errors."""
    if call is RUNS["extract"]:
        pytest.importorskip("zarr")
    model = meta_model()
    with pytest.raises(hs.UnsupportedModelError, match=r"meta device.*'0\.weight'.*to_empty") as info:
        call(model, torch.ones(2, 4), tmp_path)
    assert "\n" not in str(info.value)
    assert hs.attached(model) == []
    assert list(tmp_path.iterdir()) == []  # no store, no report


def meta_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, bos_token_id=0, eos_token_id=0)
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    return model.eval()


METHODS: dict[str, Callable[[nn.Module, torch.Tensor], Any]] = {
    "std_map": lambda model, ids: hs.std_map(model),
    "logit_lens": lambda model, ids: hs.methods.logit_lens(model, ids),
    "patch_sweep": lambda model, ids: hs.methods.patch_sweep(model, ids, ids.flip(1), metric=hs.methods.logprob(1)),
    "attribution_patch": lambda model, ids: hs.methods.attribution_patch(
        model, ids, ids.flip(1), metric=hs.methods.logprob(1)
    ),
    "decompose_resid": lambda model, ids: hs.methods.decompose_resid(model, ids),
    "monitor": lambda model, ids: hs.monitor(model),
}


@pytest.mark.transformers
@pytest.mark.parametrize("call", METHODS.values(), ids=METHODS.keys())
def test_methods_refuse_a_transformer_built_on_meta(call: Callable[[nn.Module, torch.Tensor], Any]) -> None:
    """std_map, logit_lens, decompose_resid and monitor raised torch's ``.item()`` error."""
    pytest.importorskip("transformers")
    model = meta_gpt2()
    ids = torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    with pytest.raises(hs.UnsupportedModelError, match=r"meta device.*'transformer\.wte\.weight'.*to_empty"):
        call(model, ids)
    assert hs.attached(model) == []


def meta_embedding() -> nn.Module:
    """Built on meta; plain torch runs it on real token ids and returns meta values silently."""
    return nn.Sequential(nn.Embedding(10, 4, device="meta"), nn.ReLU())


SCOPES: dict[str, Callable[[nn.Module], Any]] = {
    "capture": lambda model: hs.capture(model, "0"),
    "edit": lambda model: hs.edit(model, {"0": hs.edits.zero()}),
    "tracing": lambda model: hs.tracing(model),
}


@pytest.mark.parametrize("scope", SCOPES.values(), ids=SCOPES.keys())
def test_a_scoped_hook_group_refuses_real_inputs_to_a_meta_model_at_the_forward(
    scope: Callable[[nn.Module], Any],
) -> None:
    ids = torch.tensor([[1, 2, 3]])
    assert meta_embedding()(ids).is_meta  # what torch does alone: meta values, no error
    model = meta_embedding()
    refused = pytest.raises(hs.UnsupportedModelError, match=r"meta device.*'0\.weight'.*input.*cpu.*to_empty")
    with refused, scope(model):
        model(ids)
    assert hs.attached(model) == []
    # shapes only: meta inputs still run, with the shapes raw hooks see
    seen: list[torch.Size] = []
    handle = model[0].register_forward_hook(lambda _m, _a, out: seen.append(out.shape))
    model(ids.to("meta"))
    handle.remove()
    with hs.capture(model, "0") as cap:
        model(ids.to("meta"))
    assert cap["0"].is_meta
    assert cap["0"].shape == seen[0]
    assert hs.attached(model) == []
