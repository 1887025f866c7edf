"""A feature store's integrity: one writer at a time (the writer record), a checksum per chunk
(verified on read, on ``verify=True`` and on resume, which writes damaged chunks again),
input rows and every weight checked on resume, and metadata that lies refused before reading."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr
from torch import nn
from torch.utils.data import Dataset

import hookscope as hs
from hookscope._store.writer_record import RECORD_KEY, STALE_AFTER_S
from tests.models import tiny_gpt2

ROWS, BATCH = 12, 4  # three chunks of four rows


def run(model: nn.Module, data: Any, out: Any, layers: Any = "0", **options: Any) -> hs.Store:
    return hs.extract(model, data, out, layers=layers, progress=False, batch_size=BATCH, chunk_rows=BATCH, **options)


def store_files(path: Path) -> dict[str, bytes]:
    """The store's data files (the writer record aside): equal dicts mean bit-identical stores."""
    return {
        str(p.relative_to(path)): p.read_bytes()
        for p in sorted(path.rglob("*"))
        if p.is_file() and not p.name.startswith(".writer") and p.name != "writer.json"
    }


def model_and_rows(seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3)).eval(), torch.randn(ROWS, 4, generator=torch.Generator().manual_seed(1))


def chunk_file(out: Path, array: str, chunk: int) -> Path:
    """The file of row-chunk ``chunk`` of ``array`` (zarr's ``c/<chunk>/0/...`` key)."""
    found = out / array / "c" / str(chunk)
    while found.is_dir():
        found = found / "0"
    return found


def write_record(out: Path, **fields: Any) -> None:
    record = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.time(),
        "heartbeat": time.time(),
        "command": "someone else's extract",
        "token": "theirs",
        **fields,
    }
    (out / RECORD_KEY).parent.mkdir(parents=True, exist_ok=True)
    (out / RECORD_KEY).write_text(json.dumps(record))


def reference(model: nn.Module, x: torch.Tensor) -> np.ndarray:
    """The model's outputs in the store's batches: a (12, 4) matmul may round apart from (4, 4) ones."""
    with torch.no_grad():
        return torch.cat([model(x[start : start + BATCH]) for start in range(0, len(x), BATCH)]).numpy()


# -- one writer at a time ---------------------------------------------------------------------------


SLOW_WRITER = """
import sys, time, torch
from torch import nn
import hookscope as hs

class Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, index):
        time.sleep(0.05)
        return torch.full((4,), float(index))

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
hs.extract(model, Slow(), sys.argv[1], layers=sys.argv[2], batch_size=4, progress=False)
"""


def test_a_second_writer_is_refused_naming_the_first(tmp_path: Path) -> None:
    """Two extractions with different layers into one path: the second is refused, the first lands whole."""
    out = tmp_path / "f.zarr"
    script = tmp_path / "slow.py"
    script.write_text(SLOW_WRITER)
    with subprocess.Popen([sys.executable, str(script), str(out), "0"], stderr=subprocess.PIPE, text=True) as first:
        deadline = time.monotonic() + 120
        while not (out / "zarr.json").exists():  # its store exists: it holds it
            assert first.poll() is None, first.stderr.read() if first.stderr else ""
            assert time.monotonic() < deadline
            time.sleep(0.02)
        model = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
        for options in ({}, {"overwrite": True}):
            with pytest.raises(hs.StoreBusyError, match=rf"being written by another process: pid {first.pid} on ") as e:
                hs.extract(model, torch.randn(64, 4), out, layers="1", batch_size=4, progress=False, **options)
            assert e.value.holder["pid"] == first.pid
        assert first.wait(timeout=120) == 0
    store = hs.open_store(out)
    assert store.complete
    assert store.sites == ["0"]
    assert len(store) == 64
    assert not (out / RECORD_KEY).exists()  # released at the end


def test_a_second_thread_writing_the_same_store_is_refused(tmp_path: Path) -> None:
    model, x = model_and_rows()
    out = tmp_path / "f.zarr"
    started, release = threading.Event(), threading.Event()

    class Waits(Dataset[torch.Tensor]):
        def __len__(self) -> int:
            return ROWS

        def __getitem__(self, index: int) -> torch.Tensor:
            if index == 8:
                started.set()
                release.wait(timeout=60)
            return x[index]

    errors: list[BaseException] = []

    def first() -> None:
        try:
            run(model, Waits(), out)
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert started.wait(timeout=60)
        with pytest.raises(hs.StoreBusyError, match=rf"pid {os.getpid()} on {socket.gethostname()}"):
            run(model, x, out)
    finally:
        release.set()
        thread.join(timeout=60)
    assert not errors
    assert np.array_equal(hs.open_store(out)["0"][:], reference(model, x))


def test_a_record_left_by_a_dead_process_is_taken_over(tmp_path: Path) -> None:
    model, x = model_and_rows()
    out = tmp_path / "f.zarr"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    write_record(out, pid=int(gone.stdout))  # same host, its process has ended (as after kill -9)
    assert np.array_equal(run(model, x, out)["0"][:], reference(model, x))
    assert not (out / RECORD_KEY).exists()


def test_a_fresh_record_of_another_host_is_respected_and_a_stale_one_taken_over(tmp_path: Path) -> None:
    model, x = model_and_rows()
    out = tmp_path / "f.zarr"
    write_record(out, host="gpu-node-7", pid=1)
    with pytest.raises(hs.StoreBusyError, match=r"pid 1 on gpu-node-7, started .* last heartbeat \d+ s ago"):
        run(model, x, out)
    assert json.loads((out / RECORD_KEY).read_text())["token"] == "theirs"  # left as it was
    assert not (out / "zarr.json").exists()  # nothing made
    write_record(out, host="gpu-node-7", pid=1, heartbeat=time.time() - STALE_AFTER_S - 5)
    assert np.array_equal(run(model, x, out)["0"][:], reference(model, x))


def test_the_record_goes_when_a_run_fails_and_a_refused_run_leaves_no_folder(tmp_path: Path) -> None:
    model, x = model_and_rows()
    out = tmp_path / "f.zarr"

    class Breaks(Dataset[torch.Tensor]):
        def __len__(self) -> int:
            return ROWS

        def __getitem__(self, index: int) -> torch.Tensor:
            if index == 9:
                raise RuntimeError("row 9 is unreadable")
            return x[index]

    with pytest.raises(RuntimeError, match="row 9 is unreadable"):
        run(model, Breaks(), out)
    assert not (out / RECORD_KEY).exists()
    assert hs.open_store(out, partial=True).done_chunks() == {0, 1}
    assert not [t for t in threading.enumerate() if t.name == "hookscope-store-heartbeat"]

    fresh = tmp_path / "new.zarr"
    with pytest.raises(hs.SpecError):
        run(model, x, fresh, reduce="no-such-reduction")
    assert not fresh.exists()


def test_the_heartbeat_is_renewed_while_the_writer_runs(tmp_path: Path) -> None:
    from hookscope._store.writer_record import StoreHold
    from hookscope._store.zarr_io import target_of

    out = tmp_path / "f.zarr"
    with StoreHold(target_of(out), heartbeat_s=0.05) as hold:
        first = json.loads((out / RECORD_KEY).read_text())["heartbeat"]
        deadline = time.monotonic() + 30
        while json.loads((out / RECORD_KEY).read_text())["heartbeat"] == first:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert json.loads((out / RECORD_KEY).read_text())["token"] == hold.token
    assert not out.exists()  # the folders it made only for the record are gone with it


# -- a checksum per chunk -----------------------------------------------------------------------------


def test_a_deleted_chunk_file_is_an_error_on_read_and_written_again_on_resume(tmp_path: Path) -> None:
    model, x = model_and_rows()
    out = tmp_path / "f.zarr"
    run(model, x, out)
    whole = store_files(out)
    chunk_file(out, "0", 1).unlink()
    store = hs.open_store(out)
    assert np.array_equal(store["0"][:4], reference(model, x)[:4])  # other chunks read as before
    with pytest.raises(hs.StoreError, match=r"chunk 1 \(rows 4..7\) of '0' is damaged: its file is gone") as e:
        store["0"][5]
    assert (e.value.array, e.value.chunk) == ("0", 1)
    with pytest.raises(hs.StoreError, match=r"1 damaged chunk\(s\): chunk 1 \(rows 4..7\) of '0': its file is gone"):
        hs.open_store(out, verify=True)
    with pytest.warns(hs.StoreRepairWarning, match=r"1 stored chunk\(s\) are damaged and are written again"):
        repaired = run(model, x, out)
    assert repaired.complete
    assert store_files(out) == whole  # bit-identical to the store before the damage
    hs.open_store(out, verify=True)


def test_a_flipped_bit_in_a_chunk_is_an_error_never_other_values(tmp_path: Path) -> None:
    model, x = model_and_rows()
    out = tmp_path / "f.zarr"
    run(model, x, out, compression_level=None)  # raw bytes: the flipped bit would decode to another value
    whole = store_files(out)
    damaged = chunk_file(out, "0", 2)
    data = bytearray(damaged.read_bytes())
    data[5] ^= 0x10
    damaged.write_bytes(bytes(data))
    with pytest.raises(hs.StoreError, match=r"chunk 2 \(rows 8..11\) of '0' is damaged: it cannot be read"):
        hs.open_store(out)["0"][:]
    with pytest.warns(hs.StoreRepairWarning):
        run(model, x, out, compression_level=None)
    assert store_files(out) == whole


def test_values_rewritten_behind_the_stores_back_are_found_by_their_checksum(tmp_path: Path) -> None:
    """zarr's own CRC covers the bytes as written; the manifest's checksum covers the values."""
    model, x = model_and_rows()
    out = tmp_path / "f.zarr"
    run(model, x, out)
    zarr.open_group(out, mode="r+")["0"][0:4] = np.ones((4, 3), dtype=np.float32)  # a valid chunk of other values
    with pytest.raises(hs.StoreError, match=r"chunk 0 \(rows 0..3\) of '0': its values differ from those written"):
        hs.open_store(out, verify=True)
    with pytest.warns(hs.StoreRepairWarning, match="chunk 0"):
        run(model, x, out)
    assert np.array_equal(hs.open_store(out, verify=True)["0"][:], reference(model, x))


def test_a_rerun_on_an_intact_complete_store_checks_it_and_writes_nothing(tmp_path: Path) -> None:
    model, x = model_and_rows()
    out = tmp_path / "f.zarr"
    run(model, x, out)
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(model, x, out)
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before


# -- the same data and the same model on resume -------------------------------------------------------


def test_resume_refuses_data_changed_after_the_first_row(tmp_path: Path) -> None:
    model, x = model_and_rows()
    out = tmp_path / "f.zarr"
    with pytest.raises(RuntimeError, match="stop"):
        run(model, StopsAt(x, 8), out)  # chunks 0 and 1 done
    changed = x.clone()
    changed[5] += 1  # row 0 unchanged: the first-row hash cannot see it
    with pytest.raises(hs.DataError, match=r"rows 4..7 of the data are not the rows the store was made from") as e:
        run(model, changed, out)
    assert e.value.rows == range(4, 8)
    assert hs.open_store(out, partial=True).done_chunks() == {0, 1}  # nothing written
    assert np.array_equal(run(model, x, out)["0"][:], reference(model, x))  # the same data resumes


def test_resume_refuses_a_changed_stream(tmp_path: Path) -> None:
    model, x = model_and_rows()
    out = tmp_path / "f.zarr"

    def batches(rows: torch.Tensor, stop_at: int | None = None) -> Any:
        for start in range(0, ROWS, BATCH):
            if start == stop_at:
                raise RuntimeError("stop")
            yield rows[start : start + BATCH]

    with pytest.raises(RuntimeError, match="stop"):
        hs.extract(model, batches(x, stop_at=8), out, layers="0", progress=False, chunk_rows=BATCH)
    changed = x.clone()
    changed[6] -= 1
    with pytest.raises(hs.DataError, match=r"rows 4..7 of the data are not the rows the store was made from"):
        hs.extract(model, batches(changed), out, layers="0", progress=False, chunk_rows=BATCH)
    store = hs.extract(model, batches(x), out, layers="0", progress=False, chunk_rows=BATCH)
    assert np.array_equal(store["0"][:], reference(model, x))


def test_resume_refuses_a_model_whose_change_a_sample_would_miss(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5000, 3)).eval()
    x = torch.randn(ROWS, 5000, generator=torch.Generator().manual_seed(1))
    out = tmp_path / "f.zarr"
    with pytest.raises(RuntimeError, match="stop"):
        run(model, StopsAt(x, 8), out)
    with torch.no_grad():
        model[0].weight[1, 2502] += 1e-3  # one weight of 15,000, which a 4,096-value sample (every ~3.7th) skipped
    with pytest.raises(hs.StoreError, match=r"model.fingerprint: stored '[0-9a-f]+', now '[0-9a-f]+'"):
        run(model, x, out)


class StopsAt(Dataset[torch.Tensor]):
    """Rows of a tensor; fetching row ``stop`` raises (a run that dies part-way)."""

    def __init__(self, rows: torch.Tensor, stop: int) -> None:
        self.rows, self.stop = rows, stop

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == self.stop:
            raise RuntimeError("stop")
        return self.rows[index]


# -- metadata that lies ----------------------------------------------------------------------------


def edit_json(path: Path, change: Any) -> None:
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record))


def test_metadata_that_lies_about_rows_or_shapes_is_refused_on_open(tmp_path: Path) -> None:
    model, x = model_and_rows()
    out = tmp_path / "f.zarr"
    run(model, x, out)
    edit_json(out / "zarr.json", lambda r: r["attributes"]["hookscope"].update(rows=1_000_000))
    with pytest.raises(
        hs.StoreError, match=r"array '0' of store .* is \(12, 3\) float32 .* record says \(1000000, 3\)"
    ):
        hs.open_store(out)
    edit_json(out / "zarr.json", lambda r: r["attributes"]["hookscope"].update(rows=ROWS))
    hs.open_store(out)

    edit_json(out / "0" / "zarr.json", lambda r: r.update(shape=[1_000_000, 3]))
    edit_json(out / "_rows" / "index" / "zarr.json", lambda r: r.update(shape=[1_000_000]))
    edit_json(out / "zarr.json", lambda r: r["attributes"]["hookscope"].update(rows=1_000_000))
    with pytest.raises(hs.StoreError, match=r"holds 1,000,000 rows in 250,000 chunks, but its manifest has \(3,\)"):
        hs.open_store(out)


def test_a_read_bigger_than_memory_is_refused_before_allocating(tmp_path: Path) -> None:
    model, x = model_and_rows()
    out = tmp_path / "f.zarr"
    run(model, x, out)
    huge = 2**40
    chunks = huge // BATCH
    edit_json(out / "0" / "zarr.json", lambda r: r.update(shape=[huge, 3]))
    edit_json(out / "_rows" / "index" / "zarr.json", lambda r: r.update(shape=[huge]))
    edit_json(out / "_hookscope" / "done" / "zarr.json", lambda r: r.update(shape=[chunks]))
    edit_json(out / "zarr.json", lambda r: r["attributes"]["hookscope"].update(rows=huge, chunks=chunks))
    store = hs.open_store(out)  # consistent lies: only reading can tell
    with pytest.raises(hs.StoreError, match=r"reading 1,099,511,627,776 rows of '0' needs 12 TiB, more than"):
        store["0"][:]
    with pytest.raises(hs.StoreError, match=r"chunk 3 \(rows 12..15\) of '0' is damaged: its file is gone"):
        store["0"][12:14]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda out: (out / "0" / "zarr.json").write_text("{not json"), r"array '0' of store .* cannot be opened"),
        (lambda out: (out / "0" / "zarr.json").unlink(), r"array '0' of store .* cannot be opened"),
        (
            lambda out: edit_json(out / "zarr.json", lambda r: r["attributes"]["hookscope"].update(sites="x")),
            r"lack 'config' or 'sites'",
        ),
        (
            lambda out: edit_json(
                out / "zarr.json", lambda r: r["attributes"]["hookscope"]["config"].update(chunk_rows="4")
            ),
            r"chunk_rows '4' is not a positive int; its attributes are damaged: make it anew",
        ),
        (
            lambda out: edit_json(
                out / "zarr.json", lambda r: r["attributes"]["hookscope"]["sites"][0].update(dtype="float99")
            ),
            r"record of a site .* is damaged",
        ),
        (
            lambda out: edit_json(out / "zarr.json", lambda r: r["attributes"]["hookscope"]["sites"][0].pop("shape")),
            r"record of a site .* is damaged: KeyError",
        ),
        (lambda out: (out / "zarr.json").write_text("{"), r"cannot be opened|is not a zarr group|holds something"),
    ],
)
def test_damaged_metadata_is_one_store_error(tmp_path: Path, damage: Any, message: str) -> None:
    model, x = model_and_rows()
    out = tmp_path / "f.zarr"
    run(model, x, out)
    damage(out)
    with pytest.raises(hs.StoreError, match=message):
        hs.open_store(out)


def test_garbage_in_a_chunk_is_a_store_error_naming_it(tmp_path: Path) -> None:
    model, x = model_and_rows()
    out = tmp_path / "f.zarr"
    run(model, x, out)
    chunk_file(out, "0", 0).write_bytes(b"\x00garbage")
    with pytest.raises(hs.StoreError, match=r"chunk 0 \(rows 0..3\) of '0' is damaged: it cannot be read") as e:
        hs.open_store(out)["0"][:2]
    assert e.value.chunk == 0


# -- a real transformers model ------------------------------------------------------------------------


@pytest.mark.transformers
def test_gpt2_store_survives_damage_and_a_resume_with_changed_tokens_is_refused(tmp_path: Path) -> None:
    model = tiny_gpt2().eval()
    ids = torch.randint(0, model.config.vocab_size, (ROWS, 8), generator=torch.Generator().manual_seed(3))
    out = tmp_path / "gpt2.zarr"
    layers = ["h.0", "ln_f"]
    run(model, ids, out, layers=layers)
    with torch.no_grad(), hs.capture(model, *layers) as cap:  # the reference: a capture of one forward
        model(ids)
    want = cap["ln_f"].numpy()
    chunk_file(out, "ln_f", 1).unlink()
    with pytest.warns(hs.StoreRepairWarning):
        store = run(model, ids, out, layers=layers)
    assert np.allclose(store["ln_f"][:], want, atol=1e-5)
    store.verify()

    changed = ids.clone()
    changed[10, 3] = (changed[10, 3] + 1) % model.config.vocab_size
    with pytest.raises(hs.DataError, match=r"rows 8..11 of the data are not the rows"):
        run(model, changed, out, layers=layers)


def test_a_zarr_reader_sees_the_arrays_and_the_manifest_and_no_warning(tmp_path: Path) -> None:
    """A store read by zarr alone: the checksum codec and the manifest disturb no zarr reader."""
    model, x = model_and_rows()
    out = tmp_path / "f.zarr"
    run(model, x, out)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        group = zarr.open_group(out, mode="r")
        assert sorted(group.keys()) == ["0", "_hookscope", "_rows"]
        assert np.array_equal(group["0"][:], reference(model, x))


# -- any zarr store, and the command line ------------------------------------------------------------


def test_a_store_in_memory_is_held_checked_and_repaired_the_same_way() -> None:
    """Stores that are not local paths (zarr ``Store`` objects: memory, fsspec) take the same record and checks."""
    model, x = model_and_rows()
    memory = zarr.storage.MemoryStore()
    run(model, x, memory)
    assert RECORD_KEY not in memory._store_dict
    del memory._store_dict["0/c/2/0"]
    with pytest.raises(hs.StoreError, match=r"chunk 2 \(rows 8..11\) of '0' is damaged: its file is gone"):
        hs.open_store(memory)["0"][:]
    with pytest.warns(hs.StoreRepairWarning):
        assert np.array_equal(run(model, x, memory)["0"][:], reference(model, x))
    record = {"host": "elsewhere", "pid": 1, "heartbeat": time.time(), "started": time.time(), "token": "t"}
    prototype = zarr.core.buffer.default_buffer_prototype()
    zarr.core.sync.sync(memory.set(RECORD_KEY, prototype.buffer.from_bytes(json.dumps(record).encode())))
    with pytest.raises(hs.StoreBusyError, match="pid 1 on elsewhere"):
        run(model, x, memory, overwrite=True)


def test_the_command_line_exits_1_naming_the_other_writer(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from tests.cli.test_cli import run_cli

    out = tmp_path / "f.zarr"
    write_record(out, host="gpu-node-7", pid=4242, command="hookscope extract demo:cnn ...")
    code, _, err = run_cli(
        capsys, "extract", "demo:cnn", "--data", "random:8:3x32x32", "-l", "fc", "-o", str(out), "-b", "4"
    )
    assert code == 1
    assert "is being written by another process: pid 4242 on gpu-node-7" in err
    assert "(hookscope extract demo:cnn ...)" in err
    assert "Traceback" not in err


# -- edges a review found --------------------------------------------------------------------------


def test_an_all_zero_chunk_has_its_file_and_reads_back(tmp_path: Path) -> None:
    model, x = model_and_rows()
    model = nn.Sequential(model[0], nn.ReLU()).eval()
    with torch.no_grad():
        model[0].bias.zero_()
    x[4:8] = 0  # chunk 1 of the ReLU's output is all zeros
    out = tmp_path / "f.zarr"
    store = run(model, x, out, layers="1")
    assert chunk_file(out, "1", 1).is_file()
    assert np.array_equal(store["1"][:], reference(model, x))
    assert not store["1"][4:8].any()
    hs.open_store(out, verify=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(model, x, out, layers="1")  # nothing to repair


def test_a_stale_record_is_moved_aside_only_if_it_is_still_the_one_judged(tmp_path: Path) -> None:
    """Two newcomers judge one stale record: the slower one must not move the faster one's new record."""
    from hookscope._store.writer_record import StoreHold
    from hookscope._store.zarr_io import target_of

    out = tmp_path / "f.zarr"
    write_record(out, host="gone-host", heartbeat=time.time() - STALE_AFTER_S - 5)
    judged = json.loads((out / RECORD_KEY).read_text())
    with StoreHold(target_of(out)) as faster:  # took it over
        slower = StoreHold(target_of(out))
        slower._remove_stale(judged)  # what the slower one does next, having judged the old record
        assert json.loads((out / RECORD_KEY).read_text())["token"] == faster.token  # put back
        with pytest.raises(hs.StoreBusyError, match="another extraction in this process"):
            slower.take()
        faster.confirm()  # still holds it


def test_a_live_writer_here_holds_the_store_however_old_its_heartbeat(tmp_path: Path) -> None:
    model, x = model_and_rows()
    out = tmp_path / "f.zarr"
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as paused:  # as after Ctrl-Z
        try:
            write_record(out, pid=paused.pid, heartbeat=time.time() - 10 * STALE_AFTER_S)
            with pytest.raises(hs.StoreBusyError, match=rf"pid {paused.pid} on "):
                run(model, x, out)
        finally:
            paused.kill()
    paused.wait()
    assert np.array_equal(run(model, x, out)["0"][:], reference(model, x))  # its pid gone: taken over


def test_a_writer_in_another_pid_namespace_is_judged_by_its_heartbeat(tmp_path: Path) -> None:
    """A container sharing the host's name: its pid means nothing here, so only its heartbeat tells."""
    model, x = model_and_rows()
    out = tmp_path / "f.zarr"
    write_record(out, pid=999_999, pid_namespace="pid:[4026531999]")  # no such pid here; fresh heartbeat
    with pytest.raises(hs.StoreBusyError, match="pid 999999"):
        run(model, x, out)


def test_a_run_that_lost_the_store_stops_without_recording_more(tmp_path: Path) -> None:
    model, x = model_and_rows()
    out = tmp_path / "f.zarr"

    class TakenOver(Dataset[torch.Tensor]):
        def __len__(self) -> int:
            return ROWS

        def __getitem__(self, index: int) -> torch.Tensor:
            if index == 10:  # another writer took the store over while this one was stopped
                deadline = time.monotonic() + 60
                while not (out / "_hookscope" / "done" / "c" / "1").exists():  # chunks 0 and 1 recorded
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                record = json.loads((out / RECORD_KEY).read_text())
                (out / RECORD_KEY).write_text(json.dumps({**record, "token": "theirs", "pid": 1, "host": "other"}))
            return x[index]

    with pytest.raises(hs.StoreBusyError, match="was taken over by another writer while this run was stopped"):
        run(model, TakenOver(), out)
    assert hs.open_store(out, partial=True).done_chunks() == {0, 1}  # chunk 2 was not recorded
    assert json.loads((out / RECORD_KEY).read_text())["token"] == "theirs"  # the new holder's record stays


@pytest.fixture
def read_only_store(tmp_path: Path) -> Any:
    """A complete store on a file system mounted read-only (for root too)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], capture_output=True, check=False
    )
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        model, x = model_and_rows()
        run(model, x, folder / "f.zarr")
        if subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=False).returncode != 0:
            pytest.skip("cannot remount the tmpfs read-only")
        yield model, x, folder / "f.zarr"
    finally:
        subprocess.run(["umount", "--lazy", str(folder)], check=False)


def test_a_complete_store_on_a_read_only_mount_is_checked_by_reading(read_only_store: Any) -> None:
    model, x, out = read_only_store
    assert np.array_equal(run(model, x, out)["0"][:], reference(model, x))


def test_an_old_complete_store_is_read_not_refused_with_contradicting_advice(tmp_path: Path) -> None:
    model, x = model_and_rows()
    model = nn.Sequential(model[0], nn.ReLU()).eval()
    with torch.no_grad():
        model[0].bias.zero_()
    x[4:8] = 0
    out = tmp_path / "f.zarr"
    run(model, x, out, layers="1")
    # as format 1 made it: no checksums in the manifest, no file for an all-zero chunk
    edit_json(out / "zarr.json", lambda r: r["attributes"]["hookscope"].update(format=1))
    for found in sorted((out / "_hookscope" / "digests").rglob("*"), reverse=True):
        found.unlink() if found.is_file() else found.rmdir()
    (out / "_hookscope" / "digests").rmdir()
    chunk_file(out, "1", 1).unlink()
    store = hs.open_store(out, verify=True)  # no file for chunk 1 is what format 1 wrote
    assert np.array_equal(store["1"][:], reference(model, x))
    with pytest.raises(hs.StoreError, match=r"complete store of format 1.* read it with hs.open_store\(path\)"):
        run(model, x, out, layers="1")


def test_a_run_that_fails_before_making_the_store_leaves_no_folder_it_made(tmp_path: Path) -> None:
    model, x = model_and_rows()
    with pytest.raises(RuntimeError, match="stop"):
        run(model, StopsAt(x, 0), tmp_path / "runs" / "exp1" / "f.zarr")  # the first batch fails, store held
    assert not (tmp_path / "runs").exists()


def test_rows_iterate_and_an_index_past_the_end_is_also_an_index_error(tmp_path: Path) -> None:
    model, x = model_and_rows()
    array = run(model, x, tmp_path / "f.zarr")["0"]
    assert np.array_equal(np.stack(list(array)), reference(model, x))
    with pytest.raises(IndexError, match=r"the array has rows 0..11 \(or -12..-1\)"):
        array[12]
    with pytest.raises(hs.StoreIndexError):
        array[[0, 40]]


def test_the_memory_check_counts_whole_rows_only_when_whole_rows_are_read() -> None:
    from hookscope._store.array import _whole_rows

    assert _whole_rows(slice(0, 10))
    assert _whole_rows((slice(0, 10), slice(None), Ellipsis))
    assert not _whole_rows((slice(None), 0))  # one column of every row: zarr sizes that read itself


def test_a_read_over_many_chunks_finds_a_lost_one_with_one_listing(tmp_path: Path) -> None:
    model, x = model_and_rows()
    rows = torch.cat([x] * 4)  # 48 rows, 12 chunks
    out = tmp_path / "f.zarr"
    run(model, rows, out)
    chunk_file(out, "0", 10).unlink()
    store = hs.open_store(out)
    assert np.array_equal(store["0"][:40], reference(model, rows)[:40])
    with pytest.raises(hs.StoreError, match=r"chunk 10 \(rows 40..43\) of '0' is damaged: its file is gone"):
        store["0"][:]


class WritesIntoItsInput(nn.Module):
    """A model whose forward doubles its input in place, as some do."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.mul_(2))


def test_a_stream_into_a_model_that_writes_its_inputs_resumes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = WritesIntoItsInput().eval()
    x = torch.randn(ROWS, 4, generator=torch.Generator().manual_seed(1))

    def batches(stop_at: int | None = None) -> Any:
        for start in range(0, ROWS, BATCH):
            if start == stop_at:
                raise RuntimeError("stop")
            yield x[start : start + BATCH].clone()  # fresh rows each pass, as a loader gives

    whole = hs.extract(model, batches(), tmp_path / "whole.zarr", layers="fc", progress=False, chunk_rows=BATCH)
    out = tmp_path / "f.zarr"
    with pytest.raises(RuntimeError, match="stop"):
        hs.extract(model, batches(stop_at=8), out, layers="fc", progress=False, chunk_rows=BATCH)
    resumed = hs.extract(model, batches(), out, layers="fc", progress=False, chunk_rows=BATCH)
    assert np.array_equal(resumed["fc"][:], whole["fc"][:])
