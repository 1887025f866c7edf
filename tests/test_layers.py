from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import hookscope as hs
from tests.conftest import UPDATE_GOLDEN, Golden
from tests.models import KeywordOnly, Looped, Nested, SharedTwice, SmallCNN, gpt2_input, tiny_gpt2, track


def test_a_missing_golden_fails_and_says_how_to_write_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    golden = Golden(tmp_path)
    monkeypatch.delenv(UPDATE_GOLDEN, raising=False)
    with pytest.raises(pytest.fail.Exception, match=f"is missing; write it with `{UPDATE_GOLDEN}=1 pytest tests/"):
        golden.check("new.txt", "a table")
    assert not (tmp_path / "new.txt").exists()
    monkeypatch.setenv(UPDATE_GOLDEN, "1")
    golden.check("new.txt", "a table")
    assert (tmp_path / "new.txt").read_text() == "a table\n"


def test_small_cnn_table_golden(golden: Golden) -> None:
    table = hs.layers(SmallCNN(), SmallCNN.example())
    golden.check("layers_small_cnn.txt", str(table))


def test_nested_table_without_input_golden(golden: Golden) -> None:
    golden.check("layers_nested.txt", str(hs.layers(Nested())))


def test_rows_are_named_modules_in_order_with_own_params() -> None:
    model = Nested()
    table = hs.layers(model)
    assert table.names == [name for name, _ in model.named_modules()]
    for row, (name, module) in zip(table, model.named_modules(), strict=True):
        assert row.class_name == type(module).__name__
        assert row.params == sum(p.numel() for p in module.parameters(recurse=False))
        assert row.calls is None
        assert row.depth == (0 if not name else name.count(".") + 1)
    assert sum(row.params for row in table) == table.total_params == sum(p.numel() for p in model.parameters())
    assert table["stem.0.0"].params == 4 * 8 + 8
    assert table[0].name == ""


def test_calls_count_shared_and_looped_modules() -> None:
    assert hs.layers(SharedTwice(), torch.ones(1, 4))["shared"].calls == 2
    looped = hs.layers(Looped(steps=5), torch.ones(1, 4))
    assert [(row.name, row.calls) for row in looped] == [("", 1), ("block", 5)]


def test_uncalled_modules_show_zero_and_footer_says_so() -> None:
    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(2, 2)
            self.spare = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.used(x)
            return out

    table = hs.layers(track(Unused()), torch.ones(1, 2))
    assert table["spare"].calls == 0
    assert str(table).endswith("· 1 modules not called")


def test_keyword_inputs_are_passed() -> None:
    class Takes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = KeywordOnly()

        def forward(self, x: torch.Tensor, *, twice: bool) -> torch.Tensor:
            out: torch.Tensor = self.inner(x)
            return self.inner(out) if twice else out

    model = track(Takes())
    assert hs.layers(model, torch.ones(1, 4), twice=True)["inner.block.fc"].calls == 2


def test_sample_run_uses_eval_mode_no_grad_and_restores() -> None:
    model = track(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))).train()
    before = model[1].running_mean.clone()
    hs.layers(model, torch.randn(4, 3))
    assert torch.equal(model[1].running_mean, before), "batch-norm statistics untouched"
    assert model.training
    assert model[1].training
    assert hs.attached(model) == []


@pytest.mark.transformers
def test_gpt2_calls_and_tied_weights() -> None:
    model = tiny_gpt2()
    table = hs.layers(model, gpt2_input())
    assert table["h.1.mlp.c_fc"].calls == 1
    assert table[""].class_name == "GPT2Model"
    assert table["h"].calls == 0, "a ModuleList is iterated, never called"
    assert [row.calls for row in table if row.class_name == "GPT2Block"] == [1, 1]

    from transformers import GPT2Config, GPT2LMHeadModel

    tied = track(
        GPT2LMHeadModel(
            GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16, bos_token_id=0, eos_token_id=0)
        )
    )
    lm = hs.layers(tied)
    assert lm["lm_head"].params == lm["transformer.wte"].params == 50 * 16
    assert sum(row.params for row in lm) - lm.total_params == 50 * 16
    assert "(800 counted under two names above)" in str(lm)


def test_failed_forward_leaves_nothing_attached() -> None:
    from tests.models import RaisesMidForward

    model = RaisesMidForward()
    with pytest.raises(RuntimeError, match="boom"):
        hs.layers(model, torch.ones(1, 4))
    assert hs.attached(model) == []


def test_not_a_module() -> None:
    with pytest.raises(hs.UnsupportedModelError):
        hs.layers("resnet50")  # type: ignore[arg-type]


def test_a_name_the_table_lacks_is_named_with_the_closest() -> None:
    table = hs.layers(SmallCNN())
    with pytest.raises(hs.SiteNotFoundError, match=r"no module 'conv_1' in this table; did you mean 'conv1'\?") as info:
        table["conv_1"]
    assert info.value.key == "conv_1"
    assert info.value.candidates[0] == "conv1"
    assert isinstance(info.value, KeyError)  # code that caught the KeyError still does
    assert table["(root)"] is table[""]
