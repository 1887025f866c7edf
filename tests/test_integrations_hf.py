"""HookscopeCallback in a real transformers Trainer: 20 steps of a tiny GPT-2 on generated data."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hookscope as hs

pytestmark = [pytest.mark.transformers, pytest.mark.slow]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from hookscope.integrations.hf import HookscopeCallback  # noqa: E402
from tests.models import track  # noqa: E402

VOCAB = 64


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Generated token ids, the labels the ids themselves (language modelling)."""

    def __init__(self, rows: int = 64, seq: int = 8) -> None:
        self.ids = torch.randint(0, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def model() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return track(transformers.GPT2LMHeadModel(config))


def arguments(out: Path, steps: int = 20) -> Any:
    return transformers.TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=1e-3, report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, seed=0,
    )  # fmt: skip


class RawNorms(transformers.TrainerCallback):  # type: ignore[misc]
    """The reference: every parameter's gradient norm at the same moment, read without hookscope."""

    def __init__(self) -> None:
        self.norms: dict[int, dict[str, float]] = {}

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.norms[state.global_step] = {
            name: float(p.grad.double().norm()) for name, p in model.named_parameters() if p.grad is not None
        }


def test_the_callback_logs_gradient_norms_equal_to_autograd_over_20_steps(tmp_path: Path) -> None:
    net = model()
    callback = HookscopeCallback(every=5, precision="bf16", sinks=[tmp_path / "metrics.jsonl"])
    raw = RawNorms()
    trainer = transformers.Trainer(
        model=net, args=arguments(tmp_path), train_dataset=Tokens(), callbacks=[callback, raw]
    )
    trainer.train()
    assert [step.step for step in callback.steps] == [0, 5, 10, 15]
    assert sorted(raw.norms) == list(range(20))
    for logged in callback.steps:
        for name, norm in raw.norms[logged.step].items():
            assert logged.scalars[f"param_grad/norm/{name}"] == pytest.approx(norm, rel=1e-5)
        assert 0 <= logged.scalars["precision/grad/underflow/blocks.1"] <= 1
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4
    assert not callback.monitor.live  # removed at on_train_end


def test_a_nan_at_step_7_stops_training_at_step_7_naming_the_layer(tmp_path: Path) -> None:
    net = model()
    poison = {"step": -1}

    class Clock(transformers.TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            poison["step"] = state.global_step

    handle = net.transformer.h[1].mlp.register_forward_hook(
        lambda module, args, output: output * float("nan") if poison["step"] == 7 and torch.is_grad_enabled() else None
    )
    trainer = transformers.Trainer(
        model=net, args=arguments(tmp_path), train_dataset=Tokens(), callbacks=[Clock(), HookscopeCallback()]
    )
    try:
        with pytest.raises(hs.NonFiniteError) as caught:
            trainer.train()
    finally:
        handle.remove()
    assert caught.value.step == 7
    assert caught.value.module == "transformer.h.1.mlp"
    batch = torch.load(tmp_path / "nonfinite_step7_batch.pt", weights_only=True)
    assert batch["kwargs"]["input_ids"].shape == (4, 8)
    assert "transformer.h.1.mlp" in (tmp_path / "nonfinite_step7_trace.csv").read_text()
    # the autouse fixture checks that no hook is left on the model after the raise


def test_a_second_train_call_logs_again_to_the_same_sink_object(tmp_path: Path) -> None:
    sink = hs.JsonLinesSink(tmp_path / "metrics.jsonl")
    callback = HookscopeCallback(every=5, sinks=[sink])
    trainer = transformers.Trainer(
        model=model(), args=arguments(tmp_path, steps=5), train_dataset=Tokens(), callbacks=[callback]
    )
    trainer.train()
    trainer.train()  # the sink is the caller's: still open
    sink.close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
