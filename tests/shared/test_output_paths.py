"""Writing files where they cannot go: one OutputPathError naming the real path and the cause,
before the work where it can be known, and no temporary file left behind, ever.

A full disk is a real one: a 64 KiB tmpfs mounted for the test (skipped where mounting is not
allowed). A folder that refuses files is a read-only mount, since root ignores permission bits.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope.io import check_output_path, save_tensors
from tests.cli.test_cli import run_cli
from tests.models import SmallCNN

SUFFIXES = (".safetensors", ".npz", ".pt")
BIG = {"fc#0:output": torch.arange(100_000, dtype=torch.float32)}  # 400 KB: more than the tiny disk holds


def _mount(folder: Path, *options: str) -> bool:
    folder.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", ",".join(("size=64k", *options)), "tmpfs", str(folder)],
        capture_output=True,
        check=False,
    )
    return done.returncode == 0


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A folder on a 64 KiB file system: writing more fails with ENOSPC."""
    folder = tmp_path / "disk"
    if not _mount(folder):
        pytest.skip("cannot mount a tmpfs here (not root, or no mount permission)")
    yield folder
    subprocess.run(["umount", "--lazy", str(folder)], check=False)  # lazy: a failed write may hold a handle


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[Path]:
    """A folder in which no file can be made, for root too."""
    folder = tmp_path / "ro"
    if os.geteuid() != 0:
        folder.mkdir()
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    if not _mount(folder, "ro"):
        pytest.skip("cannot mount a read-only tmpfs here")
    yield folder
    subprocess.run(["umount", "--lazy", str(folder)], check=False)  # lazy: a failed write may hold a handle


@pytest.fixture
def below_a_file(tmp_path: Path) -> Path:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    return blocker


def assert_names_path_not_partial(error: BaseException, path: Path) -> None:
    message = str(error)
    assert str(path) in message
    assert ".partial" not in message
    assert "\n" not in message


# --- cache.save / save_tensors ----------------------------------------------------------------


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_saving_below_a_file_is_an_output_path_error(below_a_file: Path, suffix: str) -> None:
    target = below_a_file / f"acts{suffix}"
    with pytest.raises(hs.OutputPathError) as info:
        hs.Cache({hs.Site("fc", 0): torch.ones(3)}).save(target)
    assert isinstance(info.value, OSError)
    assert info.value.path == target
    assert info.value.errno == errno.ENOTDIR
    assert_names_path_not_partial(info.value, target)
    assert "is a file, not a folder" in str(info.value)


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_saving_into_proc_is_an_output_path_error(suffix: str) -> None:
    target = Path(f"/proc/acts{suffix}")
    with pytest.raises(hs.OutputPathError) as info:
        save_tensors(target, {"x": torch.ones(2)})
    assert_names_path_not_partial(info.value, target)
    assert not target.exists()


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_saving_into_a_read_only_folder_is_an_output_path_error(read_only: Path, suffix: str) -> None:
    target = read_only / "sub" / f"acts{suffix}"
    with pytest.raises(hs.OutputPathError) as info:
        save_tensors(target, {"x": torch.ones(2)})
    assert info.value.errno in (errno.EROFS, errno.EACCES)
    assert_names_path_not_partial(info.value, target)
    assert list(read_only.iterdir()) == []


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_a_full_disk_is_an_output_write_error_and_leaves_nothing(tiny_disk: Path, suffix: str) -> None:
    old = save_tensors(tiny_disk / f"acts{suffix}", {"old": torch.arange(4)})
    before = old.read_bytes()
    with pytest.raises(hs.OutputWriteError) as info:
        save_tensors(old, BIG)
    assert info.value.errno == errno.ENOSPC
    assert "No space left on device" in str(info.value)
    assert_names_path_not_partial(info.value, old)
    assert isinstance(info.value, hs.OutputPathError)
    assert [p.name for p in tiny_disk.iterdir()] == [old.name]
    assert old.read_bytes() == before  # the older file stays whole


def test_output_errors_pickle_with_their_fields(below_a_file: Path) -> None:
    import pickle

    with pytest.raises(hs.OutputPathError) as info:
        check_output_path(below_a_file / "x.npz")
    back = pickle.loads(pickle.dumps(info.value))
    assert (type(back), str(back), back.path, back.errno) == (
        hs.OutputPathError,
        str(info.value),
        info.value.path,
        errno.ENOTDIR,
    )


def test_check_output_path_accepts_missing_folders_and_leaves_nothing(tmp_path: Path) -> None:
    assert check_output_path(tmp_path / "a" / "b" / "c.npz") == tmp_path / "a" / "b" / "c.npz"
    assert list(tmp_path.iterdir()) == []  # neither the folders nor the probe


# --- text exports and the report ----------------------------------------------------------------


def _trace() -> hs.Trace:
    return hs.trace(nn.Sequential(nn.Linear(2, 3)), torch.ones(1, 2))


@pytest.mark.parametrize("export", ["to_csv", "to_json"])
def test_trace_exports_below_a_file(below_a_file: Path, export: str) -> None:
    target = below_a_file / "t.csv"
    with pytest.raises(hs.OutputPathError) as info:
        getattr(_trace(), export)(target)
    assert_names_path_not_partial(info.value, target)


def test_trace_csv_on_a_full_disk(tiny_disk: Path) -> None:
    traced = hs.trace(nn.Sequential(*[nn.Linear(2, 2) for _ in range(400)]), torch.ones(1, 2))
    with pytest.raises(hs.OutputWriteError) as info:
        traced.to_csv(tiny_disk / "t.csv")
    assert info.value.errno == errno.ENOSPC
    assert list(tiny_disk.iterdir()) == []


def test_report_below_a_file_fails_before_the_model_runs(below_a_file: Path) -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    calls: list[int] = []
    model.register_forward_hook(lambda *_: calls.append(1))
    with pytest.raises(hs.OutputPathError) as info:
        hs.report(model, torch.ones(1, 2), out=below_a_file / "r.html")
    assert calls == []
    assert_names_path_not_partial(info.value, below_a_file / "r.html")


# --- the command line: before the model runs, exit 2; a failed write exits 1 -------------------

CLI_CASES = {
    "capture -o": ["capture", "demo:cnn", "-l", "conv1", "-o", "{bad}/a.npz"],
    "report -o": ["report", "demo:cnn", "-o", "{bad}/r.html"],
    "grads --png": ["grads", "demo:cnn", "-n", "1", "--png", "{bad}/g.png"],
    "trace --csv": ["trace", "demo:cnn", "--csv", "{bad}/t.csv"],
    "trace --json": ["trace", "demo:cnn", "--json", "{bad}/t.json"],
    "diff --csv": ["diff", "demo:cnn", "demo:cnn", "--csv", "{bad}/d.csv"],
}


@pytest.mark.parametrize("argv", CLI_CASES.values(), ids=CLI_CASES.keys())
def test_cli_output_below_a_file_exits_2_before_the_model_runs(
    capsys: pytest.CaptureFixture[str], below_a_file: Path, argv: list[str]
) -> None:
    code, out, err = run_cli(capsys, *(part.format(bad=below_a_file) for part in argv))
    assert code == 2
    assert "is a file, not a folder" in err
    assert str(below_a_file) in err
    assert "input:" not in out  # the sample input was never made
    assert "Traceback" not in err
    assert ".partial" not in err


def test_cli_capture_on_a_full_disk_exits_1_in_one_line(capsys: pytest.CaptureFixture[str], tiny_disk: Path) -> None:
    code, _, err = run_cli(
        capsys, "capture", "demo:cnn", "-l", "conv1", "-s", "16x3x32x32", "-o", str(tiny_disk / "a.pt")
    )
    assert code == 1
    assert "No space left on device" in err
    assert str(tiny_disk / "a.pt") in err
    assert "enforce fail" not in err
    assert err.strip().count("\n") == 0
    assert list(tiny_disk.iterdir()) == []


# --- a killed writer's temporary file, and fsync ----------------------------------------------


@pytest.mark.slow
def test_a_temporary_file_of_a_killed_writer_is_removed_by_the_next_save(tmp_path: Path) -> None:
    target = tmp_path / "acts.npz"
    script = textwrap.dedent(
        f"""
        import os, signal
        from hookscope._shared.files import atomic_path
        with atomic_path({str(target)!r}) as temporary:
            temporary.write_bytes(b"half")
            os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ}, check=False)
    assert done.returncode == -signal.SIGKILL
    left = [p.name for p in tmp_path.iterdir()]
    assert len(left) == 1
    assert left[0].startswith(".acts.npz.")
    assert left[0].endswith(".partial")
    save_tensors(target, {"x": torch.ones(2)})
    assert [p.name for p in tmp_path.iterdir()] == ["acts.npz"]


def test_a_live_writers_temporary_file_is_left_alone(tmp_path: Path) -> None:
    target = tmp_path / "acts.npz"
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as other:
        try:
            theirs = tmp_path / f".acts.npz.{other.pid}-0a1b2c3d.partial"
            theirs.write_bytes(b"in progress")
            save_tensors(target, {"x": torch.ones(2)})
            assert theirs.exists()
        finally:
            other.kill()


def test_saved_files_and_their_folder_are_synced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(handle: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{handle}"))
        real_fsync(handle)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    save_tensors(tmp_path / "a.safetensors", {"x": torch.ones(2)})
    assert any(
        name.endswith(".partial") and "/.a.safetensors." in name for name in synced
    )  # the data, before the rename
    assert str(tmp_path) in synced  # the folder's entry, after it


# --- the report draws names matplotlib cannot ---------------------------------------------------


def test_a_module_named_by_a_lone_surrogate_gets_its_report(tmp_path: Path) -> None:
    model = nn.Sequential()
    model.add_module("\udcff", nn.Conv2d(3, 4, 3))
    model.add_module("act", nn.ReLU())
    page = hs.report(model, torch.randn(1, 3, 8, 8), out=tmp_path / "r.html").read_text(encoding="utf-8")
    assert "\\udcff" in page
    csv_text = hs.trace(model, torch.randn(1, 3, 8, 8)).to_csv(tmp_path / "t.csv")
    assert "\udcff" in csv_text
    assert "\\udcff" in (tmp_path / "t.csv").read_text(encoding="utf-8")


def test_small_cnn_saves_and_loads_through_the_checked_path(tmp_path: Path) -> None:
    _, cache = hs.run_with_capture(SmallCNN(), SmallCNN.example(), layers="conv1")
    loaded = hs.load(cache.save(tmp_path / "new" / "c.pt"))
    torch.testing.assert_close(loaded["conv1"], cache["conv1"], rtol=0, atol=0)
