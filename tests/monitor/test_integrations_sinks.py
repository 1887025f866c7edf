"""Real sinks and a real Lightning Trainer: wandb offline run files, an MLflow SQLite store, and
Lightning's CSV logger, each read back and compared with the monitor's own values."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope.sinks import MLflowSink, WandbSink

pytestmark = [pytest.mark.slow]


def tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


def train(model: nn.Module, steps: int, sinks: list[Any]) -> hs.Monitor:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    with hs.monitor(model, sinks=sinks, names="modules") as mon:
        for _ in range(steps):
            x = torch.randn(8, 4, generator=generator)
            model(x).pow(2).mean().backward()
            mon.step()
            optimizer.step()
            optimizer.zero_grad()
    return mon


def test_wandb_offline_run_files_hold_the_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = WandbSink(project="hookscope-test", dir=str(tmp_path))
    run_dir = Path(sink.run.dir)  # .../offline-run-*/files
    mon = train(tiny(), 3, [sink])
    sink.close()  # the sink's owner closes it: the run it started finishes
    assert wandb.run is None
    (history_file,) = run_dir.parent.glob("run-*.wandb")
    history: dict[int, dict[str, Any]] = {}
    for _ in range(50):  # wandb's service may still be writing the file after finish() returned: up to 10 s
        history = {row["_step"]: row for row in wandb_history(history_file)}
        if len(history) == 3:
            break
        time.sleep(0.2)
    assert sorted(history) == [0, 1, 2]
    for step in mon.steps:
        for name in ("grad/norm/0", "param_grad/norm/2.weight", "act/mean_abs/0"):
            assert history[step.step][name] == pytest.approx(step.scalars[name])


def wandb_history(path: Path) -> list[dict[str, Any]]:
    """The history rows of an offline run file, read without wandb's reader: the file is a 7-byte
    header, then LevelDB-log records (crc32c, length, type; 32 KiB blocks) of ``Record`` protobufs."""
    from wandb.proto import wandb_internal_pb2

    data, block, position, pending = path.read_bytes(), 32768, 7, b""
    rows = []
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        chunk = data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind == 0 and length == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                )
    return rows


# MLflow's SQLite store uses a loader strategy SQLAlchemy 2.1 deprecates (MLflow's own code, at import).
@pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated:DeprecationWarning")
def test_mlflow_sqlite_store_holds_every_step_and_names_it_would_merge_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store MLflow recommends for local use (its file store is refused by default since 3.x);
    ``x+1`` and ``x_1`` clean to one MLflow name, and each module keeps its own metric at every step."""
    mlflow = pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    pytest.importorskip("alembic")

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.add_module("x+1", nn.Linear(4, 16))
            self.add_module("x_1", nn.Linear(16, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.x_1(torch.tanh(getattr(self, "x+1")(x)))

    torch.manual_seed(0)
    model = Two()
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    outputs: list[torch.Tensor] = []
    handles = [
        m.register_forward_hook(lambda m, a, out: outputs.append(out) or out.retain_grad()) for m in model.children()
    ]
    try:
        sink = MLflowSink(run_name="hookscope-test")
        run_id = sink.run.info.run_id
        mon = train(model, 3, [sink])
        sink.close()
        client = mlflow.tracking.MlflowClient()
        history = client.get_metric_history(run_id, "param_grad/norm/x_1.weight")
        assert [m.step for m in history] == [0, 1, 2]
        for metric, step in zip(history, mon.steps, strict=True):
            assert metric.value == pytest.approx(step.scalars["param_grad/norm/x_1.weight"])
        own = client.get_metric_history(run_id, "grad/norm/x_1")  # the name MLflow takes as it is
        renamed = client.get_metric_history(run_id, "grad/norm/x_1-2")  # x+1, which cleans to the same
        assert [m.step for m in own] == [m.step for m in renamed] == [0, 1, 2]  # before: one metric, merged
        for step in range(3):
            first, second = outputs[2 * step], outputs[2 * step + 1]  # x+1 runs first, x_1 second
            assert renamed[step].value == pytest.approx(float(first.grad.double().norm()), rel=1e-6)
            assert own[step].value == pytest.approx(float(second.grad.double().norm()), rel=1e-6)
        assert sink.renamed["grad/norm/x+1"] == "grad/norm/x_1-2"
        assert all(spelling == name.replace("x+1", "x_1") + "-2" for name, spelling in sink.renamed.items())
        assert len(sink.renamed) == len([name for name in mon.steps[0].scalars if "x+1" in name])
    finally:
        for handle in handles:
            handle.remove()
        if mlflow.active_run() is not None:
            mlflow.end_run()
        mlflow.set_tracking_uri(None)


@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")  # Lightning's own use of a torch API
@pytest.mark.filterwarnings("ignore:.*does not have many workers.*")  # a 64-row data set needs none
def test_the_lightning_callback_logs_each_optimiser_step(tmp_path: Path) -> None:
    lightning = pytest.importorskip("lightning.pytorch")
    from hookscope.integrations.lightning import HookscopeCallback

    class Regressor(lightning.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.net = tiny()
            self.norms: dict[int, float] = {}

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def on_before_optimizer_step(self, optimizer: Any) -> None:  # the reference, read by hand
            self.norms[self.trainer.global_step] = float(self.net[0].weight.grad.double().norm())

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    callback = HookscopeCallback(every=2, names="modules")
    logger = lightning.loggers.CSVLogger(str(tmp_path))
    module = Regressor()
    trainer = lightning.Trainer(
        max_steps=6, accumulate_grad_batches=2, callbacks=[callback], logger=logger, accelerator="cpu",
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, log_every_n_steps=1,
        default_root_dir=str(tmp_path),
    )  # fmt: skip
    trainer.fit(module, loader)
    assert [step.step for step in callback.steps] == [0, 2, 4]
    for step in callback.steps:
        assert step.scalars["param_grad/norm/net.0.weight"] == pytest.approx(module.norms[step.step], rel=1e-6)
    assert not callback.monitor.live
    logged = (Path(logger.log_dir) / "metrics.csv").read_text()
    assert "param_grad/norm/net.0.weight" in logged.splitlines()[0]


@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")  # Lightning's own use of a torch API
@pytest.mark.filterwarnings("ignore:.*does not have many workers.*")  # a 64-row data set needs none
def test_the_lightning_callback_under_16_mixed_logs_the_unscaled_gradients(tmp_path: Path) -> None:
    """16-mixed scales the loss with its precision plugin's GradScaler and unscales before
    on_before_optimizer_step; the record's parameter norms carried the scale. A CPU gets
    bf16-mixed by default, so the plugin is given as a GPU's 16-mixed would be, with a CPU scaler."""
    lightning = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.plugins.precision import MixedPrecision

    from hookscope.integrations.lightning import HookscopeCallback

    class Regressor(lightning.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.net = tiny()
            self.norms: dict[int, dict[str, float]] = {}

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x).float(), y)

        def on_before_optimizer_step(self, optimizer: Any) -> None:  # the reference: unscaled by Lightning
            self.norms[self.trainer.global_step] = {
                name: float(p.grad.double().norm()) for name, p in self.named_parameters()
            }

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
    callback = HookscopeCallback(names="modules", log_to_lightning=False)
    module = Regressor()
    trainer = lightning.Trainer(
        max_steps=3, callbacks=[callback], logger=False, accelerator="cpu", enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
    )  # fmt: skip
    trainer.fit(module, loader)
    assert [step.step for step in callback.steps] == [0, 1, 2]
    for step in callback.steps:
        assert step.scalars["grad/loss_scale"] == 2.0 ** (8 + step.step)
        for name, norm in module.norms[step.step].items():
            assert step.scalars[f"param_grad/norm/{name}"] == pytest.approx(norm, rel=1e-6), name
    assert not callback.monitor.live


@pytest.mark.transformers
@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")  # Lightning's own use of a torch API
@pytest.mark.filterwarnings("ignore:.*does not have many workers.*")  # a 16-row data set needs none
@pytest.mark.filterwarnings("ignore:hs.monitor. no canonical names for:UserWarning")  # where ALBERT has no map
def test_the_lightning_callback_trains_albert(tmp_path: Path) -> None:
    """ALBERT (one block object at every layer) crashed the callback with a raw shape error from
    the canonical map; the monitor falls back to the modules with parameters where it cannot be made."""
    lightning = pytest.importorskip("lightning.pytorch")
    transformers = pytest.importorskip("transformers")
    from hookscope.integrations.lightning import HookscopeCallback

    torch.manual_seed(0)
    config = transformers.AlbertConfig(
        vocab_size=64, embedding_size=16, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip

    class Masked(lightning.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.net = transformers.AlbertForMaskedLM(config)
            self.norms: dict[int, dict[str, float]] = {}

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            (ids,) = batch
            return self.net(input_ids=ids, labels=ids).loss

        def on_before_optimizer_step(self, optimizer: Any) -> None:  # the reference, read by hand
            self.norms[self.trainer.global_step] = {
                name: float(p.grad.double().norm()) for name, p in self.named_parameters() if p.grad is not None
            }

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    ids = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4)
    callback = HookscopeCallback(log_to_lightning=False)
    module = Masked()
    trainer = lightning.Trainer(
        max_steps=2, callbacks=[callback], logger=False, accelerator="cpu", enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
    )  # fmt: skip
    trainer.fit(module, loader)
    assert [step.step for step in callback.steps] == [0, 1]
    for step in callback.steps:
        for name, norm in module.norms[step.step].items():
            assert step.scalars[f"param_grad/norm/{name}"] == pytest.approx(norm, rel=1e-5), name
    assert not callback.monitor.live
