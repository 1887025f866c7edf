"""Sinks that fail, names that would merge, stores MLflow now recommends: every sink gets every
step, a failure is named after the others wrote, and no two metrics become one."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope.sinks import MLflowSink, TensorBoardSink


def tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


class Broken:
    """A sink whose every write fails, as one on an unreachable server does."""

    def write(self, step: int, scalars: dict[str, float]) -> None:
        raise ConnectionError("tracking server unreachable")


def open_files(*paths: Path) -> list[str]:
    """Which of ``paths`` this process holds open, read from the kernel's table (no Python object)."""
    wanted = {os.path.realpath(path) for path in paths}
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target in wanted:
            held.append(target)
    return held


def steps_in(path: Path) -> list[int]:
    lines = path.read_text().splitlines()
    if path.suffix == ".csv":
        return sorted({int(line.split(",")[0]) for line in lines[1:]})
    return [int(line.split('"step": ')[1].split(",")[0]) for line in lines]


def test_a_sink_that_raises_keeps_no_other_from_the_step(tmp_path: Path) -> None:
    model = tiny()
    first, last = tmp_path / "a.jsonl", tmp_path / "b.csv"
    with hs.monitor(model, names="modules", sinks=[first, Broken(), last]) as mon:
        for step in range(2):
            model(torch.randn(3, 4)).sum().backward()
            with pytest.raises(
                hs.SinkError, match=f"1 of 3 sinks failed to write step {step}; the other sinks have it"
            ):
                mon.step()
            model.zero_grad()
    assert steps_in(first) == steps_in(last) == [0, 1]  # before, the sink after the broken one had none
    assert [s.step for s in mon.steps] == [0, 1]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full (every write: no space left)")
def test_on_a_full_disk_the_other_sinks_get_the_step_and_every_file_is_closed(tmp_path: Path) -> None:
    model = tiny()
    full = tmp_path / "full.jsonl"
    full.symlink_to("/dev/full")
    first, last = tmp_path / "a.jsonl", tmp_path / "b.csv"
    mon = hs.monitor(model, names="modules", sinks=[first, full, last])
    model(torch.randn(3, 4)).sum().backward()
    assert len(open_files(first, last)) == 2
    with pytest.raises(hs.SinkError) as caught, mon:
        mon.step()
    error = caught.value
    assert error.step == 0
    assert [shown for _, shown, _ in error.failures] == [f"JsonLinesSink({str(full)!r})"]
    assert isinstance(error.failures[0][2], OSError)
    assert "No space left on device" in str(error)
    assert steps_in(first) == steps_in(last) == [0]  # before, the sink after the full one missed the step
    assert open_files(first, last) == []  # and stayed open: closing stopped at the full one
    assert any("failed to close" in note for note in getattr(error, "__notes__", []))  # said, not hidden


def test_tensorboard_sink_without_tensorboard_names_the_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [name for name in sys.modules if name.startswith("torch.utils.tensorboard")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # what an environment without it imports
    with pytest.raises(
        hs.MissingDependencyError, match=r"TensorBoardSink needs tensorboard: pip install 'hookscope\[tensorboard\]'"
    ):
        TensorBoardSink(tmp_path / "runs")


# -- MLflow: the SQLite store MLflow recommends for local use ------------------------------------------


@pytest.fixture
def mlflow(monkeypatch: pytest.MonkeyPatch) -> Any:
    module = pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    yield module
    if module.active_run() is not None:
        module.end_run()
    module.set_tracking_uri(None)


def test_mlflow_sink_on_sqlite_without_its_database_packages_names_the_install(
    tmp_path: Path, mlflow: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)  # mlflow-skinny alone: no database packages
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    with pytest.raises(hs.MissingDependencyError, match=r"sqlalchemy: pip install 'hookscope\[mlflow\]'"):
        MLflowSink()
    assert mlflow.active_run() is None


def test_mlflow_file_store_refusal_names_the_sqlite_store(tmp_path: Path, mlflow: Any) -> None:
    mlflow.set_tracking_uri(f"file:{tmp_path / 'mlruns'}")
    with pytest.raises(hs.SpecError, match=r"mlflow.set_tracking_uri\('sqlite:///mlflow.db'\)"):
        MLflowSink()


class NoHistograms:
    """A sink that draws histograms and whose histogram writes fail (a full event file); its scalars work."""

    def __init__(self) -> None:
        self.written: list[int] = []

    def write_histograms(self, step: int, histograms: dict[str, Any]) -> None:
        raise OSError("histogram event file: no space left")

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self.written.append(step)


def test_a_failed_histogram_write_keeps_the_same_sinks_scalars(tmp_path: Path) -> None:
    """write_histograms raising skipped the same sink's write(): its scalars of the step were lost."""
    model, sink, other = tiny(), NoHistograms(), tmp_path / "b.jsonl"
    with hs.monitor(model, names="modules", histograms=True, sinks=[sink, other]) as mon:
        for step in range(2):
            model(torch.randn(3, 4)).sum().backward()
            with pytest.raises(hs.SinkError, match=f"1 of 2 sinks failed to write step {step}") as caught:
                mon.step()
            model.zero_grad()
    assert sink.written == steps_in(other) == [0, 1]
    assert [shown for _, shown, _ in caught.value.failures] == ["NoHistograms (histograms)"]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated:DeprecationWarning")  # MLflow's
def test_a_sink_error_quoting_a_tracking_uri_keeps_no_credentials(
    tmp_path: Path, mlflow: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLflow quotes its tracking URI, userinfo and all, when the server is gone: SinkError quoted it."""
    pytest.importorskip("sqlalchemy")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    secret = "Sup3rSecretValue9"
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    sink = MLflowSink()
    mlflow.set_tracking_uri(f"http://user:{secret}@127.0.0.1:1")  # the server, reached with basic auth, is gone
    model = tiny()
    try:
        with hs.monitor(model, names="modules", sinks=[sink]) as mon:
            model(torch.randn(3, 4)).sum().backward()
            with pytest.raises(hs.SinkError) as caught:
                mon.step()
    finally:
        mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")  # the fixture's end_run reaches a store
    assert secret in str(caught.value.failures[0][2])  # MLflow's own error has it
    assert secret not in str(caught.value)
    assert "user:" not in str(caught.value)
    assert "http://***@" in str(caught.value)  # the package's one rule: userinfo shown as ***@
