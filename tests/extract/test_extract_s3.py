"""``hs.extract`` into an S3 bucket (moto's server on 127.0.0.1, see ``tests/s3_server.py``) and
``hs.open_store`` reading it back: the same bytes as a store on a local disk, killed and resumed,
sharded by torchrun, one writer at a time through S3's conditional writes, checksums verified and
damaged chunks written again; ``memory://`` URLs too."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope._store.writer_record import RECORD_KEY, STALE_AFTER_S, StoreHold
from hookscope._store.zarr_io import target_of
from tests.models import tiny_gpt2
from tests.s3_server import S3Server, close_s3_clients, s3, s3_objects  # noqa: F401  (s3: the fixture)
from tests.store.test_store_integrity import store_files

ROWS, BATCH = 12, 4  # three chunks of four rows
TIMEOUT = 240


def run(model: nn.Module, data: Any, out: Any, layers: Any = "0", **options: Any) -> hs.Store:
    return hs.extract(model, data, out, layers=layers, progress=False, batch_size=BATCH, chunk_rows=BATCH, **options)


def model_and_rows() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3)).eval(), torch.randn(ROWS, 4, generator=torch.Generator().manual_seed(1))


def reference(model: nn.Module, x: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return torch.cat([model(x[start : start + BATCH]) for start in range(0, len(x), BATCH)]).numpy()


def forget_s3_instances() -> None:
    """s3fs caches file systems (and their listings) by options: the next look is a fresh one."""
    close_s3_clients()


@pytest.fixture
def url(s3: S3Server) -> Iterator[str]:  # noqa: F811
    """``s3://<a fresh bucket>/feats.zarr``."""
    forget_s3_instances()
    yield f"s3://{s3.bucket()}/feats.zarr"
    forget_s3_instances()


def objects(s3: S3Server, url: str) -> dict[str, bytes]:  # noqa: F811
    """The store's objects at ``url`` (the writer record aside), comparable with ``store_files``."""
    return s3_objects(s3.fs(), url.removeprefix("s3://"))


def record_key(url: str) -> str:
    return f"{url.removeprefix('s3://')}/{RECORD_KEY}"


# -- the same store as on a local disk ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.transformers
def test_a_gpt2_store_on_s3_is_the_local_store_and_holds_what_forward_hooks_see(
    s3: S3Server,  # noqa: F811
    url: str,
    tmp_path: Path,
) -> None:
    model = tiny_gpt2()
    ids = torch.randint(0, model.config.vocab_size, (ROWS, 8), generator=torch.Generator().manual_seed(3))
    layers = ["h.0.mlp", "h.1.attn.c_proj", "ln_f"]
    run(model, ids, url, layers=layers, storage_options=s3.storage_options, command="extract gpt2")
    run(model, ids, tmp_path / "feats.zarr", layers=layers, command="extract gpt2")
    local = store_files(tmp_path / "feats.zarr")
    remote = objects(s3, url)
    assert sorted(remote) == sorted(local)
    assert [key for key in local if remote[key] != local[key]] == []
    assert not s3.fs().exists(record_key(url))  # released

    seen: dict[str, list[torch.Tensor]] = {name: [] for name in layers}
    handles = [
        model.get_submodule(name).register_forward_hook(lambda _m, _a, out, name=name: seen[name].append(out.clone()))
        for name in layers
    ]
    try:
        with torch.no_grad():
            for start in range(0, ROWS, BATCH):  # the extraction's batches: the same kernels, the same bits
                model(ids[start : start + BATCH])
    finally:
        for handle in handles:
            handle.remove()
    store = hs.open_store(url, storage_options=s3.storage_options, verify=True)
    assert store.complete
    assert sorted(store.sites) == sorted(layers)
    for name in layers:
        want = torch.cat(seen[name]).numpy()
        got = store[name][:]
        assert got.shape == want.shape == (ROWS, 8, 32)
        assert np.array_equal(got, want), name


# -- killed and resumed, sharded by torchrun --------------------------------------------------------------

SCRIPT = """
import json
import os
import sys
import time

import torch
from torch import nn

import hookscope as hs


class Rows(torch.utils.data.Dataset):
    '''Fixed rows; each fetch takes a while when SLOW is set.'''

    def __init__(self):
        self.x = torch.randn(128, 16, generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        if os.environ.get("SLOW"):
            time.sleep(0.02)
        return self.x[index]


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def extract(out, storage_options=None):
    return hs.extract(
        build(), Rows(), out, layers=["0", "2"], storage_options=storage_options, batch_size=8, chunk_rows=16,
        progress=False, command="extract rows",
    )


if __name__ == "__main__":
    import torch.distributed as dist

    if "LOCAL_RANK" in os.environ:
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
    try:
        extract(sys.argv[1], json.loads(os.environ["HS_STORAGE_OPTIONS"]))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
"""
CHUNKS = 128 // 16


def script(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """The script's path, and its namespace imported here (for the local reference run)."""
    import runpy

    path = tmp_path / "rows.py"
    path.write_text(SCRIPT)
    return path, runpy.run_path(str(path), run_name="rows")


def environment(s3: S3Server, **extra: str) -> dict[str, str]:  # noqa: F811
    env = {key: value for key, value in os.environ.items() if key != "SLOW"}
    return {
        **env,
        **s3.env,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HS_STORAGE_OPTIONS": json.dumps(s3.storage_options),
        **extra,
    }


def flags_on_s3(fs: Any, url: str) -> int:
    """Chunks the manifest records now, counted from its element objects (a cheap look to poll)."""
    found = fs.find(f"{url.removeprefix('s3://')}/_hookscope/done/c")
    return sum(1 for key in found if key.rsplit("/", 1)[-1].isdigit())


def done_on_s3(s3: S3Server, url: str) -> int:  # noqa: F811
    """Chunks the manifest records now, as ``open_store(partial=True)`` reads them (0 before the store is made)."""
    forget_s3_instances()  # a fresh look, no listing cached
    try:
        return len(hs.open_store(url, partial=True, storage_options=s3.storage_options).done_chunks())
    except hs.StoreError:
        return 0


@pytest.mark.slow
@pytest.mark.distributed
def test_killed_with_sigkill_while_writing_to_s3_then_resumed_is_bit_identical(
    s3: S3Server,  # noqa: F811
    url: str,
    tmp_path: Path,
) -> None:
    path, rows = script(tmp_path)
    rows["extract"](tmp_path / "local.zarr")
    command = [sys.executable, str(path), url]
    log = tmp_path / "killed.log"
    with (
        open(log, "wb") as written,
        subprocess.Popen(
            command, cwd=tmp_path, env=environment(s3, SLOW="1"), stdout=subprocess.DEVNULL, stderr=written
        ) as running,
    ):
        deadline, fs = time.monotonic() + TIMEOUT, s3.fs()
        while flags_on_s3(fs, url) < 2:
            assert running.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        running.send_signal(signal.SIGKILL)
        running.wait(timeout=TIMEOUT)
    flags = done_on_s3(s3, url)
    assert flags == flags_on_s3(s3.fs(), url)
    assert 2 <= flags < CHUNKS, flags  # killed part-way
    assert s3.fs().exists(record_key(url))  # the killed writer's record is left behind
    with pytest.raises(hs.StoreError, match="is incomplete"):
        hs.open_store(url, storage_options=s3.storage_options)
    resumed = subprocess.run(
        command, cwd=tmp_path, env=environment(s3), capture_output=True, text=True, timeout=TIMEOUT
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    local = store_files(tmp_path / "local.zarr")
    remote = objects(s3, url)
    assert sorted(remote) == sorted(local)
    assert [key for key in local if remote[key] != local[key]] == []
    assert not s3.fs().exists(record_key(url))  # the record of the dead writer was taken over, then released
    assert hs.open_store(url, storage_options=s3.storage_options, verify=True).complete


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_two_cpu_processes_write_the_s3_store_one_process_writes_locally(
    s3: S3Server,  # noqa: F811
    url: str,
    tmp_path: Path,
) -> None:
    """Rank 1 reads the store before rank 0 makes it and opens it after: a listing s3fs cached
    then must not hide the store (``use_listings_cache=False``, zarr_io._fsspec_store)."""
    path, rows = script(tmp_path)
    rows["extract"](tmp_path / "local.zarr")
    launched = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(path), url],
        cwd=tmp_path,
        env=environment(s3),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    local = store_files(tmp_path / "local.zarr")
    remote = objects(s3, url)
    assert sorted(remote) == sorted(local)
    assert [key for key in local if remote[key] != local[key]] == []
    assert not s3.fs().exists(record_key(url))


# -- one writer at a time: S3's conditional writes --------------------------------------------------------


def test_a_second_writer_is_refused_naming_the_holder_then_runs_once_it_is_released(
    s3: S3Server,  # noqa: F811
    url: str,
) -> None:
    model, x = model_and_rows()
    options = s3.storage_options
    hold = StoreHold(target_of(url, options), command="someone's extract")
    hold.take()
    try:
        held = json.loads(s3.fs().cat_file(record_key(url)))
        assert held["token"] == hold.token
        for extra in ({}, {"overwrite": True}):
            with pytest.raises(
                hs.StoreBusyError, match=rf"pid {os.getpid()} on {socket.gethostname()}.*someone's extract"
            ) as refused:
                run(model, x, url, storage_options=options, **extra)
            assert refused.value.holder["pid"] == os.getpid()
            assert refused.value.holder["token"] == hold.token
        assert json.loads(s3.fs().cat_file(record_key(url)))["token"] == hold.token  # left as it was
        assert list(objects(s3, url)) == []  # nothing made
    finally:
        hold.release()
    assert not s3.fs().exists(record_key(url))
    store = run(model, x, url, storage_options=options)
    assert np.array_equal(store["0"][:], reference(model, x))
    assert not s3.fs().exists(record_key(url))


def test_two_holds_on_one_s3_store_the_conditional_create_lets_one_win(s3: S3Server, url: str) -> None:  # noqa: F811
    first, second = StoreHold(target_of(url, s3.storage_options)), StoreHold(target_of(url, s3.storage_options))
    assert first._object is not None
    assert first._object.conditional  # S3: If-None-Match / If-Match, not a look
    first.take()
    try:
        with pytest.raises(hs.StoreBusyError, match=rf"pid {os.getpid()} on "):
            second.take()
        second.release()  # it holds nothing: releasing leaves the first's record
        assert json.loads(s3.fs().cat_file(record_key(url)))["token"] == first.token
    finally:
        first.release()
    assert not s3.fs().exists(record_key(url))
    second.take()  # free again
    second.release()
    assert not s3.fs().exists(record_key(url))


def test_a_heartbeat_whose_reply_was_lost_renews_and_a_takeover_is_still_seen(s3: S3Server, url: str) -> None:  # noqa: F811
    """A renewal that reached S3 but whose reply was lost leaves our own record at another version:
    the next renewal's If-Match fails, and the holder must tell that from a takeover."""
    hold = StoreHold(target_of(url, s3.storage_options), heartbeat_s=3600)
    hold.take()
    try:
        ours = s3.fs().cat_file(record_key(url))
        s3.fs().pipe_file(record_key(url), ours + b" ")  # our record, a version this process never saw
        hold._write()  # If-Match fails; the record read back is ours: renewed from that version
        assert hold._lost_to is None
        hold.confirm()
        assert json.loads(s3.fs().cat_file(record_key(url)))["token"] == hold.token
        hold._write()  # and the next renewal succeeds from there
        s3.fs().pipe_file(record_key(url), their_record())  # taken over meanwhile
        hold._write()
        with pytest.raises(hs.StoreBusyError, match="was taken over by another writer"):
            hold.confirm()
        assert json.loads(s3.fs().cat_file(record_key(url)))["token"] == "theirs"  # left as it was
    finally:
        hold.release()
    assert json.loads(s3.fs().cat_file(record_key(url)))["token"] == "theirs"


def test_release_after_a_lost_reply_deletes_our_own_record(s3: S3Server, url: str) -> None:  # noqa: F811
    hold = StoreHold(target_of(url, s3.storage_options), heartbeat_s=3600)
    hold.take()
    ours = s3.fs().cat_file(record_key(url))
    s3.fs().pipe_file(record_key(url), ours + b" ")  # a renewal that landed, its reply lost: a version we never saw
    hold.release()
    assert not s3.fs().exists(record_key(url))


def test_a_missing_bucket_is_named_not_taken_for_another_writer(s3: S3Server) -> None:  # noqa: F811
    model, x = model_and_rows()
    with pytest.raises(hs.StoreError, match="check that the bucket exists") as refused:
        run(model, x, "s3://no-such-bucket-here/f.zarr", storage_options=s3.storage_options)
    assert not isinstance(refused.value, hs.StoreBusyError)


def their_record(**fields: Any) -> bytes:
    now = time.time()
    record = {"host": "gpu-node-7", "pid": 1, "started": now, "heartbeat": now, "command": "their extract"}
    return json.dumps({**record, "token": "theirs", **fields}).encode()


@pytest.mark.slow
def test_a_fresh_record_of_another_host_holds_and_a_stale_one_is_taken_over(s3: S3Server, url: str) -> None:  # noqa: F811
    model, x = model_and_rows()
    fs = s3.fs()
    fs.pipe_file(record_key(url), their_record())
    with pytest.raises(hs.StoreBusyError, match=r"pid 1 on gpu-node-7, started .* last heartbeat \d+ s ago"):
        run(model, x, url, storage_options=s3.storage_options)
    assert json.loads(fs.cat_file(record_key(url)))["token"] == "theirs"  # left as it was
    fs.pipe_file(record_key(url), their_record(heartbeat=time.time() - STALE_AFTER_S - 5))
    store = run(model, x, url, storage_options=s3.storage_options)
    assert np.array_equal(store["0"][:], reference(model, x))
    assert not fs.exists(record_key(url))  # theirs taken over, ours released


# -- checksums verified on S3, damage written again ------------------------------------------------------


@pytest.mark.slow
def test_a_chunk_overwritten_on_s3_is_found_by_its_checksum_and_written_again(
    s3: S3Server,  # noqa: F811
    url: str,
    tmp_path: Path,
) -> None:
    model, x = model_and_rows()
    options = s3.storage_options
    run(model, x, url, storage_options=options)
    run(model, x, tmp_path / "feats.zarr")
    local = store_files(tmp_path / "feats.zarr")
    fs = s3.fs()  # another client, as another process would be: hookscope's own one keeps its cache
    prefix = url.removeprefix("s3://")
    fs.pipe_file(f"{prefix}/0/c/1/0", fs.cat_file(f"{prefix}/0/c/0/0"))  # a valid chunk, of other rows' values
    with pytest.raises(hs.StoreError, match=r"chunk 1 \(rows 4..7\) of '0': its values differ from those written") as e:
        hs.open_store(url, storage_options=options, verify=True)
    assert (e.value.array, e.value.chunk) == ("0", 1)
    fs.rm(f"{prefix}/0/c/2/0")
    with pytest.raises(hs.StoreError, match=r"chunk 2 \(rows 8..11\) of '0' is damaged: its file is gone"):
        hs.open_store(url, storage_options=options)["0"][8:]
    fs.pipe_file(f"{prefix}/0/c/0/0", b"\x00garbage")
    with pytest.raises(hs.StoreError, match=r"chunk 0 \(rows 0..3\) of '0' is damaged: it cannot be read"):
        hs.open_store(url, storage_options=options)["0"][:2]
    with pytest.warns(hs.StoreRepairWarning, match=r"3 stored chunk\(s\) are damaged and are written again"):
        repaired = run(model, x, url, storage_options=options)
    assert repaired.complete
    assert np.array_equal(repaired["0"][:], reference(model, x))
    remote = objects(s3, url)
    assert [key for key in local if remote.get(key) != local[key]] == []
    assert sorted(remote) == sorted(local)
    hs.open_store(url, storage_options=options, verify=True)


# -- other URLs ---------------------------------------------------------------------------------------


def test_a_memory_url_is_written_and_read_like_a_local_store(tmp_path: Path) -> None:
    import fsspec

    model, x = model_and_rows()
    memory = f"memory://hs-{uuid.uuid4().hex[:12]}/feats.zarr"
    try:
        run(model, x, memory)
        run(model, x, tmp_path / "feats.zarr")
        store = hs.open_store(memory, verify=True)
        assert store.complete
        assert np.array_equal(store["0"][:], reference(model, x))
        fs = fsspec.filesystem("memory")
        root = memory.removeprefix("memory://")
        found = {key.removeprefix(f"/{root}/").removeprefix(f"{root}/"): fs.cat_file(key) for key in fs.find(root)}
        local = store_files(tmp_path / "feats.zarr")
        assert sorted(found) == sorted(local)
        assert [key for key in local if found[key] != local[key]] == []
    finally:
        fsspec.filesystem("memory").rm(memory.removeprefix("memory://").split("/")[0], recursive=True)


def test_storage_options_with_a_local_path_are_refused(tmp_path: Path) -> None:
    model, x = model_and_rows()
    out = tmp_path / "feats.zarr"
    options = {"endpoint_url": "http://127.0.0.1:9"}
    with pytest.raises(hs.StoreError, match="storage_options were given, but out=.* is a local path"):
        run(model, x, out, storage_options=options)
    with pytest.raises(hs.StoreError, match="storage_options were given, but out=.* is a local path"):
        run(model, x, str(out), storage_options=options)
    assert not out.exists()
    run(model, x, out)
    with pytest.raises(hs.StoreError, match="storage_options were given"):
        hs.open_store(out, storage_options=options)


def test_file_urls_are_local_paths(tmp_path: Path) -> None:
    model, x = model_and_rows()
    folder = tmp_path / "with space"
    written = run(model, x, f"file://localhost{folder.as_posix().replace(' ', '%20')}/f.zarr")
    assert written.path == str(folder / "f.zarr")
    assert np.array_equal(hs.open_store(f"FILE://{folder}/f.zarr")["0"][:], reference(model, x))
    with pytest.raises(hs.StoreError, match="names another host"):
        hs.open_store(f"file://elsewhere{folder}/f.zarr")


# -- the README's "At scale": the command line under torchrun to S3, read back for training ----------------


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.transformers
def test_the_command_line_under_torchrun_writes_s3_and_the_loader_reads_every_token_once(
    s3: S3Server,  # noqa: F811
    url: str,
    tmp_path: Path,
) -> None:
    model = "hf-config:gpt2?n_layer=2&n_embd=32&n_head=2&vocab_size=64&n_positions=32"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["-m", "hookscope", "extract", model, "--data", "random:48:16", "-l", "h.1", "-o", url]
    command += ["-b", "8", "--chunk-rows", "8", "--no-progress", "--storage-option", f"endpoint_url={s3.endpoint}"]
    command += ["--storage-option", "key=testing", "--storage-option", "secret=not-for-the-store"]
    launched = subprocess.run(
        command, cwd=tmp_path, env=environment(s3), capture_output=True, text=True, timeout=TIMEOUT
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    store = hs.open_store(url, storage_options=s3.storage_options)
    values = store["h.1"][:]
    assert values.shape == (48, 16, 32)
    assert store.tokens is not None
    assert store.stats["h.1"].count == 48 * 16
    assert "secret=***" in store.meta["command"]
    assert [key for key, data in objects(s3, url).items() if b"not-for-the-store" in data] == []
    assert store.stats["h.1"].mean == pytest.approx(values.astype(np.float64).mean(), rel=1e-12)
    seen = []
    for rank in range(2):
        loader = store.loader("h.1", 40, tokens=True, seed=0, rank=rank, world_size=2, with_rows=True)
        for batch in loader:
            rows, positions = batch["row"], batch["position"]
            assert np.array_equal(batch["h.1"].numpy(), values[rows.numpy(), positions.numpy()])
            seen += list(zip(rows.tolist(), positions.tolist(), strict=True))
    assert sorted(seen) == [(row, position) for row in range(48) for position in range(16)]
