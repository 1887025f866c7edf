"""A padded batch reduced over its tokens: ``hs.capture`` and ``hs.extract`` keep the same rows,
those of the real tokens only, checked against numpy in float64 on a transformers model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import hookscope as hs
from tests.models import tiny_gpt2

pytest.importorskip("zarr")

LENGTHS = torch.tensor([8, 5, 2, 1])


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    mask = (torch.arange(8) < LENGTHS[:, None]).long()
    ids = torch.randint(1, 64, (4, 8), generator=torch.Generator().manual_seed(0)) * mask
    return ids, mask


def real_token_means(hidden: torch.Tensor, mask: torch.Tensor) -> np.ndarray:
    """The mean over each row's real tokens, in float64, without hookscope."""
    values = hidden.detach().double().numpy()
    weights = mask.numpy().astype(np.float64)[..., None]
    return (values * weights).sum(axis=1) / weights.sum(axis=1)


@pytest.mark.transformers
def test_a_padded_mean_agrees_between_capture_and_extract(tmp_path: Path) -> None:
    model = tiny_gpt2()
    ids, mask = padded_batch()
    with torch.no_grad():
        hidden = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    expected = {"drop": real_token_means(hidden[0], mask), "ln_f": real_token_means(hidden[-1], mask)}
    layers = ["drop", "ln_f"]

    _, one_shot = hs.run_with_capture(model, input_ids=ids, attention_mask=mask, layers=layers, reduce="mean:1")
    with hs.capture(model, *layers, reduce="mean:1") as scoped, torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    data = {"input_ids": ids, "attention_mask": mask}
    store = hs.extract(model, data, tmp_path / "f.zarr", layers=layers, reduce="mean:1", batch_size=4, progress=False)

    for name, want in expected.items():
        assert np.allclose(one_shot[name].double().numpy(), want, atol=1e-5), name
        assert torch.equal(scoped.cache[name], one_shot[name])
        assert np.array_equal(store[name][:], one_shot[name].numpy()), name
    unmasked = real_token_means(hidden[-1], torch.ones_like(mask))  # what a mean with the pads in gives
    assert not np.allclose(store["ln_f"][1], unmasked[1], atol=1e-3)


@pytest.mark.transformers
def test_the_last_real_token_and_no_mask_agree_too(tmp_path: Path) -> None:
    model = tiny_gpt2()
    ids, mask = padded_batch()
    with torch.no_grad():
        final = model(input_ids=ids, attention_mask=mask).last_hidden_state
    last = final[torch.arange(4), LENGTHS - 1].double().numpy()
    _, cache = hs.run_with_capture(model, input_ids=ids, attention_mask=mask, layers="ln_f", reduce="last:1")
    data = {"input_ids": ids, "attention_mask": mask}
    store = hs.extract(model, data, tmp_path / "f.zarr", layers="ln_f", reduce="last", batch_size=4, progress=False)
    assert np.allclose(cache["ln_f"].double().numpy(), last, atol=1e-6)
    assert np.array_equal(store["ln_f"][:], cache["ln_f"].numpy())

    with_pads = real_token_means(final, torch.ones_like(mask))
    _, plain = hs.run_with_capture(
        model, input_ids=ids, attention_mask=mask, layers="ln_f", reduce="mean:1", token_mask=None
    )
    unmasked = hs.extract(
        model, data, tmp_path / "g.zarr", layers="ln_f", reduce="mean:1", batch_size=4, progress=False, mask=None
    )
    assert np.allclose(plain["ln_f"].double().numpy(), with_pads, atol=1e-5)
    assert np.array_equal(unmasked["ln_f"][:], plain["ln_f"].numpy())


@pytest.mark.transformers
def test_a_named_token_mask_the_call_lacks_is_refused() -> None:
    model = tiny_gpt2()
    ids, _ = padded_batch()
    with pytest.raises(hs.SpecError, match=r"token_mask='pad_mask': the model was called without a 2-D tensor"):
        hs.run_with_capture(model, input_ids=ids, layers="ln_f", reduce="mean:1", token_mask="pad_mask")
    with pytest.raises(hs.SpecError, match=r"token_mask=3 is not 'auto'"):
        hs.CaptureOptions(token_mask=3)  # type: ignore[arg-type]
    assert hs.attached(model) == []
