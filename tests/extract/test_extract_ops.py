"""Op sites and attention sub-sites in a store: ``hs.extract`` keeps what ``hs.capture`` keeps of
them, checked against transformers' own attention weights and raw hooks on a real GPT-2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

import hookscope as hs
from tests.models import attention_gpt2

pytest.importorskip("zarr")

pytestmark = pytest.mark.transformers

ROWS = 6
LENGTHS = torch.tensor([8, 5, 8, 2, 7, 8])


def padded_rows() -> dict[str, torch.Tensor]:
    """Six rows of eight tokens, some padded on the right."""
    mask = (torch.arange(8) < LENGTHS[:, None]).long()
    ids = torch.randint(1, 100, (ROWS, 8), generator=torch.Generator().manual_seed(1)) * mask
    return {"input_ids": ids, "attention_mask": mask}


def captured_in_batches(model: torch.nn.Module, layers: list[str], rows: dict[str, torch.Tensor], **opts: Any) -> Any:
    """What ``hs.capture`` keeps of ``layers`` over the rows, run in the extraction's batches of four."""
    parts: dict[str, list[torch.Tensor]] = {}
    for start in range(0, ROWS, 4):
        batch = {key: value[start : start + 4] for key, value in rows.items()}
        _, cache = hs.run_with_capture(model, **batch, layers=layers, **opts)
        for key in cache:
            parts.setdefault(key, []).append(cache[key])
    return {key: torch.cat(values).numpy() for key, values in parts.items()}


def test_extract_of_attention_patterns_equals_capture_and_the_model_s_own_weights(tmp_path: Path) -> None:
    model, eager = attention_gpt2("sdpa"), attention_gpt2("eager")
    rows = padded_rows()
    layers = ["h.*.attn:attn.pattern"]

    store = hs.extract(model, rows, tmp_path / "f.zarr", layers=layers, batch_size=4, progress=False)
    captured = captured_in_batches(model, layers, rows)
    with torch.no_grad():
        weights = eager(**rows, output_attentions=True).attentions  # transformers' eager softmax, no hookscope

    assert store.sites == ["h.0.attn#0:attn.pattern", "h.1.attn#0:attn.pattern"]
    for layer, expected in enumerate(weights):
        name = f"h.{layer}.attn#0:attn.pattern"
        stored = store[name][:]
        assert stored.shape == (ROWS, 2, 8, 8)
        assert np.array_equal(stored, captured[name]), name
        assert np.allclose(stored, expected.numpy(), atol=1e-6), name
    assert store.meta["config"]["layers"] == layers


def test_op_sites_reduce_over_real_tokens_by_their_own_key(tmp_path: Path) -> None:
    model = attention_gpt2("sdpa")
    rows = padded_rows()
    residual: list[torch.Tensor] = []
    attn_out: list[torch.Tensor] = []

    def block_input(_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        residual.append(args[0] if args else kwargs["hidden_states"])

    handles = [
        model.h[0].register_forward_pre_hook(block_input, with_kwargs=True),
        model.h[0].attn.register_forward_hook(lambda _m, _i, out: attn_out.append(out[0])),
    ]
    try:
        with torch.no_grad():
            model(**rows)
    finally:
        for handle in handles:
            handle.remove()
    resid_mid = (residual[0] + attn_out[0]).double().numpy()  # what the block's first `+` returns
    weights = rows["attention_mask"].numpy().astype(np.float64)[..., None]
    expected = (resid_mid * weights).sum(axis=1) / weights.sum(axis=1)

    layers = ["h.0:op[add#0]", "h.1.attn:attn.pattern"]
    store = hs.extract(
        model,
        rows,
        tmp_path / "f.zarr",
        layers=layers,
        reduce={"h.0:op[add#0]": "mean:1"},
        batch_size=4,
        progress=False,
    )
    reduced = captured_in_batches(model, ["h.0:op[add#0]"], rows, reduce="mean:1")
    whole = captured_in_batches(model, ["h.1.attn:attn.pattern"], rows)

    assert store.sites == ["h.0#0:op[add#0]", "h.1.attn#0:attn.pattern"]
    assert store["h.0#0:op[add#0]"].shape == (ROWS, 32)
    assert np.allclose(store["h.0#0:op[add#0]"][:], expected, atol=1e-5)
    assert np.array_equal(store["h.0#0:op[add#0]"][:], reduced["h.0#0:op[add#0]"])
    assert np.array_equal(store["h.1.attn#0:attn.pattern"][:], whole["h.1.attn#0:attn.pattern"])
    assert store.meta["config"]["reduce"] == {"h.0:op[add#0]": "mean:1", "h.1.attn:attn.pattern": None}
    stored_reductions = {site["name"]: site["reduce"] for site in store.meta["sites"]}
    assert stored_reductions == {"h.0#0:op[add#0]": "mean:1", "h.1.attn#0:attn.pattern": None}


class FailsOnce(Dataset[dict[str, torch.Tensor]]):
    """The padded rows one by one; fetching ``fail_at`` raises until ``armed`` is turned off."""

    def __init__(self, fail_at: int) -> None:
        self.rows, self.fail_at, self.armed = padded_rows(), fail_at, True

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if self.armed and index == self.fail_at:
            raise RuntimeError("the data went away")
        return {key: value[index] for key, value in self.rows.items()}


def test_a_store_of_op_sites_resumes_to_the_same_values_and_refuses_other_op_sites(tmp_path: Path) -> None:
    model = attention_gpt2("sdpa")
    layers = ["h.0.attn:op[split#0]", "h.1.attn:attn.pattern"]
    whole = hs.extract(model, padded_rows(), tmp_path / "whole.zarr", layers=layers, batch_size=2, progress=False)
    names = [*(f"h.0.attn#0:op[split#0][{part}]" for part in range(3)), "h.1.attn#0:attn.pattern"]
    assert whole.sites == names  # the tuple's three tensors, then the next module's pattern

    data, out = FailsOnce(fail_at=4), tmp_path / "f.zarr"
    with pytest.raises(RuntimeError, match="went away"):
        hs.extract(model, data, out, layers=layers, batch_size=2, chunk_rows=2, progress=False)
    assert hs.open_store(out, partial=True).done_chunks() == {0, 1}
    data.armed = False
    resumed = hs.extract(model, data, out, layers=layers, batch_size=2, chunk_rows=2, progress=False)
    assert resumed.complete
    assert resumed.sites == names
    for name in names:
        assert np.array_equal(resumed[name][:], whole[name][:]), name
    query = captured_in_batches(model, ["h.0.attn:op[split#0]"], padded_rows())["h.0.attn#0:op[split#0][0]"]
    assert np.allclose(whole["h.0.attn#0:op[split#0][0]"][:], query, atol=1e-6)

    with pytest.raises(hs.StoreError, match="layers"):
        hs.extract(model, padded_rows(), out, layers=["h.0.attn:op[split#1]"], batch_size=2, progress=False)


def test_ops_of_one_module_under_two_reductions_see_the_model_s_ops_only(tmp_path: Path) -> None:
    model, eager = attention_gpt2("sdpa"), attention_gpt2("eager")
    rows = padded_rows()
    layers = ["h.0.attn:op[s*]", "h.0.attn:attn.pattern"]  # split, scaled_dot_product_attention: batch-first
    store = hs.extract(
        model, rows, tmp_path / "f.zarr", layers=layers, reduce={"h.0.attn:attn.pattern": "mean:1"}, progress=False
    )
    alone = hs.extract(model, rows, tmp_path / "g.zarr", layers=["h.0.attn:op[s*]"], progress=False)
    # the other capture's softmax (its pattern recomputed) is not one of the module's ops
    assert [name for name in store.sites if "attn.pattern" not in name] == alone.sites
    assert not any("softmax" in name for name in store.sites)
    with torch.no_grad():
        weights = eager(**rows, output_attentions=True).attentions[0].double().numpy()
    assert np.allclose(store["h.0.attn#0:attn.pattern"][:], weights.mean(axis=1), atol=1e-6)


def test_an_op_site_named_under_two_reductions_is_refused(tmp_path: Path) -> None:
    model = attention_gpt2("sdpa")
    with pytest.raises(hs.SpecError, match=r"op site 'h.0#0:op\[add#0\]' is named by op selectors of two reductions"):
        hs.extract(
            model,
            padded_rows(),
            tmp_path / "f.zarr",
            layers=["h.*:op[add#0]", "h.0:op[add#0]"],
            reduce={"h.0:op[add#0]": "mean:1"},
            progress=False,
        )
    assert hs.attached(model) == []


def test_a_mean_over_attention_heads_is_never_masked_as_tokens() -> None:
    """Two heads and two tokens: the padding mask fits the pattern's (batch, heads) by shape alone."""
    model, eager = attention_gpt2("sdpa"), attention_gpt2("eager")
    rows = {"input_ids": torch.tensor([[5, 6], [7, 0]]), "attention_mask": torch.tensor([[1, 1], [1, 0]])}
    _, cache = hs.run_with_capture(model, **rows, layers="h.1.attn:attn.pattern", reduce="mean:1")
    with torch.no_grad():
        weights = eager(**rows, output_attentions=True).attentions[1].double().numpy()
    assert np.allclose(cache["h.1.attn:attn.pattern"].double().numpy(), weights.mean(axis=1), atol=1e-6)


def test_a_reduction_keyed_by_an_op_selector_not_extracted_is_refused(tmp_path: Path) -> None:
    model = attention_gpt2("sdpa")
    with pytest.raises(hs.SpecError, match=r"reduce key 'h.1:op\[add#0\]' is an op selector that layers= does not"):
        hs.extract(
            model,
            padded_rows(),
            tmp_path / "f.zarr",
            layers=["h.0:op[add#0]"],
            reduce={"h.1:op[add#0]": "mean:1"},
            progress=False,
        )
    assert not (tmp_path / "f.zarr").exists()


def test_an_op_selector_that_never_fires_is_an_error_and_leaves_no_hook(tmp_path: Path) -> None:
    model = attention_gpt2("sdpa")
    with pytest.raises(hs.CaptureError, match="softmax"):
        hs.extract(model, padded_rows(), tmp_path / "f.zarr", layers=["h.0.attn:op[softmax]"], progress=False)
    assert hs.attached(model) == []


def test_empty_layers_are_refused_as_selecting_nothing(tmp_path: Path) -> None:
    with pytest.raises(hs.SpecError, match="empty"):
        hs.extract(attention_gpt2("sdpa"), padded_rows(), tmp_path / "f.zarr", layers=[], progress=False)
