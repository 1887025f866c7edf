"""The command line: demo, help, exit codes, one-line errors."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import hookscope as hs
from hookscope.cli import main
from hookscope.demo.models import SmallCNN
from hookscope.demo.tour import run_tour
from hookscope.errors import docs_link


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as done:
        main(list(argv))
    out, err = capsys.readouterr()
    code = done.value.code
    return (code if isinstance(code, int) else 0), out, err


def test_no_arguments_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys)
    assert code == 2
    assert "Usage" in out
    assert "demo" in out
    assert "Traceback" not in out + err


def test_unknown_subcommand_exits_2_without_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "frobnicate")
    assert code == 2
    assert "No such command 'frobnicate'" in out + err
    assert "Traceback" not in out + err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "--version")
    assert code == 0
    assert out.startswith("hookscope 0.")


@pytest.mark.slow
@pytest.mark.transformers
def test_demo_runs_and_saves_conv1_features(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = run_cli(capsys, "demo", "--out", str(tmp_path))
    assert code == 0, err
    saved = np.load(tmp_path / "conv1_features.npy")
    torch.manual_seed(0)
    model = SmallCNN().eval()
    expected = model.conv1(torch.randn(1, 3, 32, 32)).detach().numpy()
    np.testing.assert_array_equal(saved, expected)
    assert "conv1 (Conv2d)" in out
    assert "input (1, 3, 32, 32)" in out
    assert "-> output (1, 16, 30, 30)" in out
    assert "reloaded from disk: identical" in out
    assert "after the with-block: 0 hookscope hooks attached" in out
    assert "after the failed forward: 0 hookscope hooks attached" in out
    assert not list(tmp_path.glob("*.partial")), "no temporary file left behind"
    assert f"open it in a browser: {(tmp_path / 'report.html').resolve()}" in out
    assert "feature maps of conv1#0" in (tmp_path / "report.html").read_text()


def test_demo_into_an_unwritable_place_is_a_one_line_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    code, _, err = run_cli(capsys, "demo", "--out", str(blocker / "sub"))
    assert code == 2  # a path that cannot be written is bad input, like an unwritable store
    assert err.startswith("error: ")
    assert "is a file, not a folder" in err
    assert "Traceback" not in err


@pytest.mark.slow
@pytest.mark.transformers
def test_tour_steps_in_order(tmp_path: Path) -> None:
    lines: list[str] = []
    run_tour(tmp_path, write=lines.append)
    steps = [line.split(".")[0] for line in lines if line[:1].isdigit()]
    assert steps == ["1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12", "13", "14"]
    text = "\n".join(lines)
    assert "5 calls · 5 modules · 618 parameters" in text
    assert "NonFiniteError: NaN first appears in output of 'fc' (Linear, call 0)" in text
    assert "first_nonfinite(): fc#0, inputs finite, 1 NaN out" in text
    poor, good = [line for line in lines if "first/last layer gradient norm" in line]
    assert "layers flagged vanishing" in poor
    assert "no layer flagged" in good
    before, after = (
        [int(n) for n in re.findall(r"(\d+)%", line)]
        for line in lines
        if line.startswith(("   accuracy per class", "   with those zeroed"))
    )
    assert min(before) >= 90, "the trained demo model classifies the shapes"
    assert after[0] <= before[0] - 50, "circles are lost"
    assert after[2] >= 90, "triangles are not"
    assert f"open it in a browser: {(tmp_path / 'report.html').resolve()}" in text
    patched = [line for line in lines if "patched in" in line]
    assert len(patched) == 3
    assert patched[-1].endswith("restores 100.0% of it")  # the last block's whole clean output: the clean run
    assert "the first run stopped: reading row 300 failed; 2 of 4 chunks had landed" in text
    assert "512 rows, 2 sites, complete" in text
    assert hs.open_store(tmp_path / "features.zarr")["conv1"].shape == (512, 16)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("hookscope", path=os.path.dirname(sys.executable)) is None, reason="not installed")
def test_console_script_without_arguments() -> None:
    script = shutil.which("hookscope", path=os.path.dirname(sys.executable))
    assert script is not None
    done = subprocess.run([script, "bogus"], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert "Traceback" not in done.stdout + done.stderr


@pytest.mark.slow
@pytest.mark.transformers
def test_python_dash_m(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "hookscope", "demo", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "conv1_features.npy").exists()


class TestCaptureCommand:
    def test_capture_demo_model_to_each_format(self, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
        import hookscope as hs

        for suffix in (".safetensors", ".npz", ".pt"):
            out = tmp_path / f"feats{suffix}"
            code, text, err = run_cli(
                capsys, "capture", "demo:cnn", "--input-shape", "1x3x32x32", "--layers", "conv1", "--out", str(out)
            )
            assert code == 0, err
            assert "input: (1, 3, 32, 32) float32" in text
            assert f"saved 1 tensor to {out}" in text
            loaded = hs.load(out)
            assert loaded["conv1"].shape == (1, 16, 30, 30)
            assert loaded.meta["model"] == "SmallCNN"

    def test_values_match_the_model(self, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
        import hookscope as hs
        from hookscope.cli.parse.specs import load_model, make_input

        out = tmp_path / "f.npz"
        code, _, err = run_cli(capsys, "capture", "demo:cnn", "-l", "conv1,fc", "--keep", "both", "-o", str(out))
        assert code == 0, err
        cache = hs.load(out)
        args, _ = make_input(load_model("demo:cnn"), None)
        assert torch.equal(cache["conv1:input"], args[0]), "the sample input is seeded, so runs repeat"
        assert sorted({site.module for site in cache.sites()}) == ["conv1", "fc"]

    @pytest.mark.transformers
    def test_transformers_model_with_reduce_and_stop(self, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
        import hookscope as hs

        spec = "hf-config:gpt2?n_layer=2&n_embd=32&n_head=2&vocab_size=64&n_positions=32&bos_token_id=0&eos_token_id=0"
        out = tmp_path / "g.safetensors"
        code, text, err = run_cli(
            capsys, "capture", spec, "-l", "h.*.mlp", "--reduce", "mean:1", "--stop", "-s", "2x8", "-o", str(out)
        )
        assert code == 0, err
        assert "input: input_ids (2, 8) int64" in text
        cache = hs.load(out)
        assert [str(site) for site in cache.sites()] == ["h.0.mlp#0:output", "h.1.mlp#0:output"]
        assert cache["h.1.mlp"].shape == (2, 32)

    def test_bad_layer_is_one_line_exit_2(self, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
        code, _, err = run_cli(capsys, "capture", "demo:cnn", "-l", "conv", "-o", str(tmp_path / "f.npz"))
        assert code == 2
        assert err.strip().splitlines() == [
            "error: selector 'conv' matched 0 of 5 modules; did you mean 'conv1'?"
            + f" (docs: {docs_link(hs.SelectionError)})"
        ]
        assert not list(tmp_path.iterdir()), "no file written"

    def test_unknown_format_and_budget(self, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
        code, _, err = run_cli(capsys, "capture", "demo:cnn", "-l", "conv1", "-o", str(tmp_path / "f.csv"))
        assert code == 2
        assert "error:" in err
        assert ".csv" in err
        code, _, err = run_cli(
            capsys, "capture", "demo:cnn", "-l", "conv1", "--max-bytes", "1KiB", "-o", str(tmp_path / "f.npz")
        )
        assert code == 2
        assert "over max_bytes=1 KiB" in err
        assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "argv",
    [
        ["layers", "demo:cnn", "-s", "1x4x8x8"],
        ["capture", "demo:cnn", "-s", "1x4x8x8", "-l", "conv1", "-o", "{tmp}/f.safetensors"],
        ["trace", "demo:cnn", "-s", "1x4x8x8"],
        ["grads", "demo:cnn", "-s", "1x4x8x8"],
        ["edit", "demo:cnn", "-s", "1x4x8x8", "-e", "conv1=zero"],
        ["report", "demo:cnn", "-s", "1x4x8x8", "-o", "{tmp}/r.html"],
        ["diff", "demo:cnn", "demo:cnn", "-s", "1x4x8x8"],
        ["extract", "demo:cnn", "--data", "random:8:4x8x8", "-l", "conv1", "-o", "{tmp}/f.zarr", "--no-progress"],
    ],
    ids=lambda argv: argv[0],
)
def test_every_command_exits_2_when_the_model_refuses_its_input(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str]
) -> None:
    code, _, err = run_cli(capsys, *(arg.format(tmp=tmp_path) for arg in argv))
    assert code == 2, err
    assert "to have 3 channels, but got 4 channels" in err
    assert "Traceback" not in err


def test_layers_ops_lists_the_op_sites_that_ran(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "layers", "demo:cnn", "--ops")
    assert code == 0, err
    assert "relu:op[relu#0]" in out
    assert "fc:op[linear#0]" in out
    code, out, err = run_cli(capsys, "layers", "demo:cnn", "--ops", "--ops-in", "conv1,fc")
    assert code == 0, err
    assert "fc:op[linear#0]" in out
    assert "relu:op[relu#0]" not in out
    assert "2 op sites in 2 modules" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ops", "--no-run"], "--ops lists the op sites a forward pass ran, and --no-run runs none"),
        (["--ops-in", "fc"], "--ops-in chooses whose op sites --ops lists; add --ops"),
        (["--ops", "--ops-in", "fcc"], "did you mean 'fc'"),
    ],
)
def test_layers_ops_refuses_what_contradicts(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    code, _, err = run_cli(capsys, "layers", "demo:cnn", *argv)
    assert code == 2
    assert message in err


@pytest.mark.transformers
def test_capture_takes_op_sites_and_attention_sub_sites(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    gpt2 = "hf-config:gpt2?n_layer=2&n_embd=32&n_head=2&vocab_size=64&n_positions=32"
    out = tmp_path / "att.safetensors"
    code, _, err = run_cli(capsys, "capture", gpt2, "-l", "h.*.attn:attn.pattern,h.0:op[add#0]", "-o", str(out))
    assert code == 0, err
    loaded = hs.load(out)
    pattern = loaded["h.1.attn:attn.pattern"]
    assert pattern.shape == (1, 2, 16, 16)
    assert torch.allclose(pattern.sum(-1), torch.ones(1, 2, 16))  # probabilities over the keys
    assert torch.equal(pattern.triu(1), torch.zeros_like(pattern))  # causal: no query sees a later key
    assert loaded["h.0:op[add#0]"].shape == (1, 16, 32)
