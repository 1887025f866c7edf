"""``hookscope extract``: every ``--data`` form, reductions from text, dtypes, reruns and refusals."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import hookscope as hs
from hookscope.cli.extract_run import every_module, parse_reductions
from hookscope.errors import docs_link
from tests.cli.test_cli import run_cli
from tests.extract.test_extract import store_files

GPT2 = "hf-config:gpt2?n_layer=2&n_embd=32&n_head=2&vocab_size=64&n_positions=32"


def test_random_rows_through_a_demo_cnn(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "f.zarr"
    code, stdout, err = run_cli(
        capsys, "extract", "demo:cnn", "--data", "random:40:3x32x32", "-l", "conv1,fc", "-o", str(out), "-b", "16"
    )
    assert code == 0, err
    assert f"wrote 40 rows of 2 sites to {out}" in stdout
    assert "on disk" in stdout
    store = hs.open_store(out)
    assert store["conv1"].shape == (40, 16, 30, 30)
    assert store.meta["config"]["model"]["spec"] == "demo:cnn"
    assert store.meta["command"] == f"hookscope extract demo:cnn --data random:40:3x32x32 -l conv1,fc -o {out} -b 16"
    before = store_files(out)
    code, stdout, err = run_cli(
        capsys, "extract", "demo:cnn", "--data", "random:40:3x32x32", "-l", "conv1,fc", "-o", str(out), "-b", "16"
    )
    assert code == 0, err
    assert f"verified 40 rows of 2 sites in {out}" in stdout  # a complete store is checked, not written
    assert "wrote" not in stdout
    assert store_files(out) == before


@pytest.mark.transformers
def test_gpt2_tokens_with_reductions_per_layer(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "f.zarr"
    argv = ["extract", GPT2, "--data", "random:24:12", "-l", "h.0,h.1,ln_f", "-o", str(out), "-b", "8"]
    code, _, err = run_cli(capsys, *argv, "--reduce", "ln_f=last", "--reduce", "mean:1", "--dtype", "bf16")
    assert code == 0, err
    store = hs.open_store(out)
    assert store.meta["config"]["reduce"] == {"h.0": "mean:1", "h.1": "mean:1", "ln_f": "last:1"}
    assert store.torch("ln_f").dtype == torch.bfloat16
    assert store["h.1"].shape == (24, 32)
    before = store_files(out)
    code, _, err = run_cli(capsys, *argv, "--reduce", "ln_f=last", "--reduce", "mean:1", "--dtype", "bf16")
    assert code == 0
    assert store_files(out) == before
    code, _, err = run_cli(capsys, *argv, "--reduce", "mean:1")
    assert code == 2
    assert "another configuration" in err
    assert "dtype: stored 'bfloat16', now None" in err
    assert "reduce.ln_f: stored 'last:1', now 'mean:1'" in err


@pytest.mark.parametrize("suffix", [".npy", ".npz", ".pt", ".safetensors"])
def test_tensor_files(capsys: pytest.CaptureFixture[str], tmp_path: Path, suffix: str) -> None:
    images = torch.randn(10, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    path = tmp_path / f"rows{suffix}"
    if suffix == ".npy":
        np.save(path, images.numpy())
    elif suffix == ".npz":
        np.savez(path, images=images.numpy())
    elif suffix == ".pt":
        torch.save({"images": images}, path)
    else:
        save_file({"images": images}, path)
    out = tmp_path / "f.zarr"
    code, _, err = run_cli(capsys, "extract", "demo:cnn", "--data", str(path), "-l", "fc", "-o", str(out), "-b", "4")
    assert code == 0, err
    from hookscope.demo.models import SmallCNN

    torch.manual_seed(0)  # the command's --seed 0 builds the same weights
    expected = SmallCNN().eval()(images).detach().numpy()
    assert np.allclose(hs.open_store(out)["fc"][:], expected, atol=1e-6)


@pytest.mark.transformers
def test_several_arrays_are_keyword_inputs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    ids = torch.randint(0, 64, (6, 8))
    mask = torch.ones(6, 8, dtype=torch.long)
    mask[0, 4:] = 0
    path = tmp_path / "tokens.npz"
    np.savez(path, input_ids=ids.numpy(), attention_mask=mask.numpy())
    out = tmp_path / "f.zarr"
    code, _, err = run_cli(
        capsys, "extract", GPT2, "--data", str(path), "-l", "ln_f", "-o", str(out), "--reduce", "last"
    )
    assert code == 0, err
    assert hs.open_store(out).meta["config"]["mask"] == "attention_mask"


def test_a_factory_returning_a_loader(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "data.py").write_text(
        "import torch\n"
        "def loader():\n"
        "    rows = torch.utils.data.TensorDataset(torch.randn(12, 3, 32, 32), torch.zeros(12))\n"
        "    return torch.utils.data.DataLoader(rows, batch_size=5)\n"
    )
    out = tmp_path / "f.zarr"
    spec = f"{tmp_path / 'data.py'}:loader"
    code, _, err = run_cli(capsys, "extract", "demo:cnn", "--data", spec, "-l", "pool", "-o", str(out))
    assert code == 0, err
    store = hs.open_store(out)
    assert len(store) == 12
    assert store.meta["config"]["batch_size"] == 5


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("random:ten:4", "expected 'random:N'"),
        ("random:4:3xx", "input shape '3xx' is not understood"),
        ("nope.npy", "file not found"),
        (
            "no_such_module_here:make",
            "data 'no_such_module_here:make': module 'no_such_module_here' cannot be imported",
        ),
        ("plain", "is not understood; expected 'random:N[:SHAPE]'"),
    ],
)
def test_bad_data_specs_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path, spec: str, message: str) -> None:
    code, _, err = run_cli(capsys, "extract", "demo:cnn", "--data", spec, "-l", "fc", "-o", str(tmp_path / "f.zarr"))
    assert code == 2
    assert message in err
    assert "Traceback" not in err
    assert not (tmp_path / "f.zarr").exists()


def test_a_missing_layer_and_a_taken_out(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "f.zarr"
    code, _, err = run_cli(capsys, "extract", "demo:cnn", "--data", "random:8", "-l", "fcc", "-o", str(out))
    assert code == 2
    assert "did you mean 'fc'" in err
    run_cli(capsys, "extract", "demo:cnn", "--data", "random:8", "-l", "fc", "-o", str(out))
    code, _, err = run_cli(
        capsys, "extract", "demo:cnn", "--data", "random:8", "-l", "fc", "-o", str(out), "--no-resume"
    )
    assert code == 2
    assert "already holds a feature store" in err
    code, _, err = run_cli(
        capsys, "extract", "demo:cnn", "--data", "random:16", "-l", "fc", "-o", str(out), "--overwrite"
    )
    assert code == 0
    assert len(hs.open_store(out)) == 16


def test_parse_reductions() -> None:
    assert parse_reductions([]) is None
    assert parse_reductions(["re:h\\.\\d+=mean:1", "cls"]) == {"re:h\\.\\d+": "mean:1", every_module: "cls"}
    with_ops = parse_reductions(["h.*=mean:1", "last"], ["h.*", "h.0:op[add#0]", "h.1.attn:attn.pattern"])
    assert with_ops == {"h.*": "mean:1", "h.0:op[add#0]": "last", "h.1.attn:attn.pattern": "last", every_module: "last"}
    with pytest.raises(hs.SpecError, match="both apply to every layer"):
        parse_reductions(["mean:1", "last"])
    with pytest.raises(hs.SpecError, match="SELECTOR=SPEC"):
        parse_reductions(["=mean:1"])


def test_a_write_that_failed_part_way_exits_1(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "data.py").write_text(
        "import torch\n"
        "import hookscope as hs\n"
        "class Rows(torch.utils.data.Dataset):\n"
        "    def __len__(self):\n"
        "        return 64\n"
        "    def __getitem__(self, index):\n"
        "        if index == 40:\n"
        "            raise hs.StoreWriteError('the volume went read-only')\n"
        "        return torch.randn(3, 32, 32)\n"
    )
    out = tmp_path / "f.zarr"
    argv = ["extract", "demo:cnn", "--data", f"{tmp_path / 'data.py'}:Rows", "-l", "fc", "-o", str(out), "-b", "8"]
    code, _, err = run_cli(capsys, *argv, "--chunk-rows", "16")
    assert code == 1  # a failure at run time, not bad input
    assert err.strip() == f"error: the volume went read-only (docs: {docs_link(hs.StoreWriteError)})"
    assert hs.open_store(out, partial=True).done_chunks() == {0, 1}


LATER_FAILURE = """
from torch import nn


class FailsLater(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("the device fell over")
        return self.fc(x)
"""


def test_a_model_refusing_the_first_batch_exits_2_and_one_failing_later_exits_1(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "later.py").write_text(LATER_FAILURE)
    monkeypatch.chdir(tmp_path)
    base = ["extract", "later.py:FailsLater", "-l", "fc", "-b", "2", "--chunk-rows", "2", "--no-progress"]
    code, _, err = run_cli(capsys, *base, "--data", "random:8:5", "-o", "a.zarr")
    assert code == 2
    assert "the model refuses the first batch of --data 'random:8:5'" in err
    assert "random:N:SHAPE" in err
    code, _, err = run_cli(capsys, *base, "--data", "random:8:4", "-o", "b.zarr")
    assert code == 1  # a failure at run time, after batches went through: the same command resumes
    assert "error: RuntimeError: the device fell over" in err
    assert hs.open_store(tmp_path / "b.zarr", partial=True).done_chunks()


def test_random_data_without_a_shape_gives_a_hint_extract_can_follow(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = str(tmp_path / "f.zarr")
    code, _, err = run_cli(capsys, "extract", "torch.nn:Identity", "--data", "random:10", "-l", "", "-o", out)
    assert code == 2
    assert "--input-shape" not in err
    assert "random:10:SHAPE, e.g. random:10:3x32x32" in err


def _done_chunks(out: Path) -> int:
    """Chunks the store at ``out`` records as done; 0 while it does not exist yet."""
    try:
        return len(hs.open_store(out, partial=True).done_chunks())
    except hs.StoreError:
        return 0


def _run_until(command: list[str], out: Path, more_than: int, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Start ``command``, send it SIGINT once ``out`` records more than ``more_than`` chunks, and wait."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path(hs.__file__).parents[1])}
    process = subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a shell's foreground job has it
    )
    try:
        deadline = time.monotonic() + 120
        while _done_chunks(out) <= more_than and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert process.poll() is None, process.communicate()  # still running: far too many rows to finish
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


@pytest.mark.slow
@pytest.mark.distributed
def test_ctrl_c_says_what_is_recorded_and_the_same_command_resumes(tmp_path: Path) -> None:
    out = tmp_path / "f.zarr"
    argv = ["extract", "demo:cnn", "--data", "random:100000:3x32x32", "-l", "fc", "-o", str(out)]
    argv += ["-b", "8", "--chunk-rows", "8", "--no-progress"]  # 12,500 chunks: far from done at the signal
    command = [sys.executable, "-m", "hookscope", *argv]
    first = _run_until(command, out, 0, tmp_path)
    assert first.returncode == 130, first.stderr
    kept = _done_chunks(out)
    assert kept > 0
    line = first.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: interrupted (Ctrl-C): {kept:,} of 12,500 chunks ({kept * 8:,} of 100,000 rows)")
    assert f"are recorded in {out}; run the same command again to resume after them" in line
    assert line.endswith("hookscope " + shlex.join(argv))
    second = _run_until(command, out, kept, tmp_path)
    assert second.returncode == 130, second.stderr
    assert (
        f"resumed after {kept:,} chunks: {kept * 8:,} of 100,000 rows were recorded by an earlier run" in second.stdout
    )
    assert f"error: interrupted (Ctrl-C): {_done_chunks(out):,} of 12,500 chunks" in second.stderr


def test_progress_to_a_pipe_is_plain_lines(tmp_path: Path) -> None:
    out = tmp_path / "f.zarr"
    argv = ["extract", "demo:cnn", "--data", "random:40:3x32x32", "-l", "fc", "-o", str(out), "-b", "8"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path(hs.__file__).parents[1])}
    command = [sys.executable, "-m", "hookscope", *argv]
    piped = subprocess.run(
        [*command, "--progress"],
        env={**env, "HOOKSCOPE_PROGRESS_INTERVAL": "0"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert piped.returncode == 0, piped.stderr
    lines = [line for line in piped.stderr.splitlines() if line.startswith("extract → f.zarr: ")]
    assert "\x1b" not in piped.stderr
    assert [line.split(" rows")[0].split(": ")[1] for line in lines] == [
        "8/40",
        "16/40",
        "24/40",
        "32/40",
        "40/40",
        "40/40",
    ]
    assert lines[0].split(", ")[2].startswith("ETA ")
    assert lines[-1].split(", ")[2].startswith("done in ")
    assert lines[-1].endswith(" written")
    assert hs.open_store(out)["fc"].shape == (40, 10)
    quiet = subprocess.run([*command, "--overwrite"], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert quiet.returncode == 0, quiet.stderr
    assert "extract →" not in quiet.stderr  # not asked for, and no terminal: nothing


def test_storage_options_and_tokens_flags(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = ["extract", "demo:cnn", "--data", "random:8:3x32x32", "-l", "fc", "-b", "4"]
    code, _, err = run_cli(capsys, *argv, "-o", str(tmp_path / "a.zarr"), "--storage-option", "endpoint_url")
    assert code == 2
    assert "--storage-option 'endpoint_url' is not KEY=VALUE" in err
    code, _, err = run_cli(capsys, *argv, "-o", str(tmp_path / "b.zarr"), "--storage-option", "anon=true")
    assert code == 2
    assert "storage_options were given, but out=" in err
    code, _, err = run_cli(capsys, *argv, "-o", str(tmp_path / "c.zarr"), "--tokens", "maybe")
    assert code == 2
    assert "--tokens 'maybe' is not auto, yes or no" in err
    code, stdout, err = run_cli(capsys, *argv, "-o", "memory://cli/f.zarr", "--tokens", "no")
    assert code == 0, err
    assert "wrote 8 rows of 1 site to memory://cli/f.zarr" in stdout
    assert "on disk" not in stdout
    assert hs.open_store("memory://cli/f.zarr").meta["config"]["tokens"] is False
