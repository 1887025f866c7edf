"""HookscopeCallback in a real transformers Trainer: 20 steps of a tiny GPT-2 on generated data."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope.sinks import JsonLinesSink

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


def arguments(out: Path, steps: int = 20, **changed: Any) -> Any:
    settings: dict[str, Any] = {
        "output_dir": str(out), "max_steps": steps, "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2, "learning_rate": 1e-3, "report_to": [], "use_cpu": True,
        "save_strategy": "no", "logging_strategy": "no", "disable_tqdm": True, "dataloader_num_workers": 0, "seed": 0,
    }  # fmt: skip
    return transformers.TrainingArguments(**(settings | changed))


class RawNorms(transformers.TrainerCallback):  # type: ignore[misc]
    """The reference: every parameter's gradient norm when the callback is called, read without
    hookscope (after the Trainer's clipping: the gradient before it where nothing was clipped)."""

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
    trainer = transformers.Trainer(  # no clipping: the gradients at the callback are the backward's
        model=net, args=arguments(tmp_path, max_grad_norm=0.0), train_dataset=Tokens(), callbacks=[callback, raw]
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
    sink = JsonLinesSink(tmp_path / "metrics.jsonl")
    callback = HookscopeCallback(every=5, sinks=[sink])
    trainer = transformers.Trainer(
        model=model(), args=arguments(tmp_path, steps=5), train_dataset=Tokens(), callbacks=[callback]
    )
    trainer.train()
    trainer.train()  # the sink is the caller's: still open
    sink.close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_under_clipping_every_gradient_of_a_record_is_the_one_before_clipping(tmp_path: Path) -> None:
    """The Trainer clips before on_pre_optimizer_step and logs grad_norm, the norm before clipping.
    The record's parameter norms were read after the clipping, beside activation gradients from
    before it; now every one is from before, and they add up to the Trainer's grad_norm."""
    net = model()
    callback = HookscopeCallback(names="modules")
    raw = RawNorms()
    args = arguments(tmp_path, steps=4, max_grad_norm=0.01, logging_strategy="steps", logging_steps=1)
    trainer = transformers.Trainer(model=net, args=args, train_dataset=Tokens(), callbacks=[callback, raw])
    trainer.train()
    # The Trainer logs step k's grad_norm once global_step has become k + 1.
    grad_norms = {row["step"] - 1: row["grad_norm"] for row in trainer.state.log_history if "grad_norm" in row}
    assert [step.step for step in callback.steps] == sorted(grad_norms) == [0, 1, 2, 3]
    for logged in callback.steps:
        total = grad_norms[logged.step]
        scale = min(1.0, 0.01 / (total + 1e-6))  # clip_grad_norm_'s factor
        assert scale < 0.1  # every step was clipped, hard
        norms = {name: value for name, value in logged.scalars.items() if name.startswith("param_grad/norm/")}
        assert math.sqrt(sum(value**2 for value in norms.values())) == pytest.approx(total, rel=1e-4)
        for name, clipped in raw.norms[logged.step].items():  # before clipping: the clipped norm undone
            assert logged.scalars[f"param_grad/norm/{name}"] == pytest.approx(clipped / scale, rel=1e-4)


def albert() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.AlbertConfig(
        vocab_size=VOCAB, embedding_size=16, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return track(transformers.AlbertForMaskedLM(config))


def test_albert_trains_under_the_callback(tmp_path: Path) -> None:
    """ALBERT (one block object at every layer) crashed the callback with a raw shape error from
    the canonical map; the monitor falls back to the modules with parameters where it cannot be made."""
    import warnings

    callback = HookscopeCallback(every=2)
    raw = RawNorms()
    args = arguments(tmp_path, steps=4, max_grad_norm=0.0)
    trainer = transformers.Trainer(model=albert(), args=args, train_dataset=Tokens(), callbacks=[callback, raw])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "hs.monitor: no canonical names for AlbertForMaskedLM", UserWarning)
        trainer.train()
    assert [step.step for step in callback.steps] == [0, 2]
    for logged in callback.steps:
        for name, norm in raw.norms[logged.step].items():
            assert logged.scalars[f"param_grad/norm/{name}"] == pytest.approx(norm, rel=1e-5)
    assert not callback.monitor.live


def test_under_fp16_the_record_is_divided_by_the_trainers_loss_scale(tmp_path: Path) -> None:
    """The Trainer's fp16 path (accelerate's GradScaler: scale the loss, unscale_ before clipping,
    step and update) logged parameter norms carrying the scale. accelerate gives a CPU no scaler,
    so the test hands the Trainer's accelerator a real CPU GradScaler and float16 autocast, as it
    would make them on a GPU; the Trainer's code runs unchanged."""
    from hookscope.integrations.hf import trainer_scaler

    callback = HookscopeCallback(names="modules")
    args = arguments(tmp_path, steps=3, fp16=True, max_grad_norm=0.01, logging_strategy="steps", logging_steps=1)
    trainer = transformers.Trainer(model=model(), args=args, train_dataset=Tokens(), callbacks=[callback])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
    trainer.accelerator.scaler, trainer.accelerator.native_amp = scaler, True  # what a GPU's fp16 sets up
    trainer.train()
    assert trainer_scaler(trainer.optimizer) is scaler
    grad_norms = {row["step"] - 1: row["grad_norm"] for row in trainer.state.log_history if "grad_norm" in row}
    assert [step.step for step in callback.steps] == sorted(grad_norms) == [0, 1, 2]
    for logged in callback.steps:
        assert logged.scalars["grad/loss_scale"] == 2.0 ** (8 + logged.step)  # doubled after each step
        norms = [value for name, value in logged.scalars.items() if name.startswith("param_grad/norm/")]
        assert math.sqrt(sum(value**2 for value in norms)) == pytest.approx(grad_norms[logged.step], rel=1e-4)
    assert not callback.monitor.live
