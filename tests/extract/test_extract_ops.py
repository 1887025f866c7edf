"""Op sites and attention sub-sites in a store: ``hs.extract`` keeps what ``hs.capture`` keeps of
them, checked against transformers' own attention weights and raw hooks on a real GPT-2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

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


def test_a_store_of_op_sites_resumes_and_refuses_other_op_sites(tmp_path: Path) -> None:
    model = attention_gpt2("sdpa")
    rows = padded_rows()
    out = tmp_path / "f.zarr"
    layers = ["h.0.attn:op[split#0]"]
    first = hs.extract(model, rows, out, layers=layers, batch_size=4, progress=False)
    assert first.sites == [f"h.0.attn#0:op[split#0][{part}]" for part in range(3)]  # the tuple's three tensors
    again = hs.extract(model, rows, out, layers=layers, batch_size=4, progress=False)  # complete: reopened
    for name in first.sites:
        assert np.array_equal(again[name][:], first[name][:])
    query = captured_in_batches(model, ["h.0.attn:op[split#0]"], rows)["h.0.attn#0:op[split#0][0]"]
    assert np.array_equal(first["h.0.attn#0:op[split#0][0]"][:], query)

    with pytest.raises(hs.StoreError, match="layers"):
        hs.extract(model, rows, out, layers=["h.0.attn:op[split#1]"], batch_size=4, progress=False)


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
