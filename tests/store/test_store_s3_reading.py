"""Reading a store on S3 (moto's server on 127.0.0.1, see ``tests/s3_server.py``) from DataLoader
workers, telling a store that cannot be reached from a damaged one, and credentials kept out of
every message, repr, progress line and stored object; the same loader on a local disk."""

from __future__ import annotations

import contextlib
import socket
import threading
import types
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import hookscope as hs
from tests.cli.test_cli import run_cli
from tests.models import track
from tests.s3_server import S3Server, close_s3_clients, s3, s3_objects  # noqa: F401  (s3: the fixture)

pytestmark = pytest.mark.slow  # a server, worker processes

VOCAB, SEQ, ROWS = 50, 6, 24
SECRET = "Sup3rSecretValue9"  # a secret access key as a user would give it


@pytest.fixture
def bucket(s3: S3Server) -> Iterator[str]:  # noqa: F811
    """A fresh bucket; s3fs's cached file systems forgotten before and after."""
    close_s3_clients()
    yield s3.bucket()
    close_s3_clients()


def token_model() -> nn.Module:
    torch.manual_seed(0)
    return track(nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, 5))).eval()


def token_rows() -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(1))


def hooked_values(model: nn.Module, ids: torch.Tensor, batch: int) -> np.ndarray:
    """``model[1]``'s output for every row, by a raw forward hook, in the extraction's batches."""
    kept: list[torch.Tensor] = []
    handle = model[1].register_forward_hook(lambda _m, _a, out: kept.append(out.clone()))
    try:
        with torch.no_grad():
            for start in range(0, len(ids), batch):
                model(ids[start : start + batch])
    finally:
        handle.remove()
    return torch.cat(kept).numpy()


class Rows(torch.utils.data.Dataset[torch.Tensor]):
    """A user's own map-style data set over a store array opened in the parent process."""

    def __init__(self, array: hs.StoreArray) -> None:
        self.array = array

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.from_numpy(self.array[index])


@pytest.mark.parametrize("where", ["local", "s3"])
def test_the_readme_training_loop_reads_the_store_in_forked_dataloader_workers(
    s3: S3Server,  # noqa: F811
    bucket: str,
    tmp_path: Path,
    where: str,
) -> None:
    """Workers forked after the store was read (the default on Linux) inherit its connections and
    make their own: every token is read once, with the values forward hooks see, and a data set of
    the user's own over a store array opened in the parent reads in the workers too."""
    model, ids = token_model(), token_rows()
    out = f"s3://{bucket}/acts.zarr" if where == "s3" else tmp_path / "acts.zarr"
    options = {"storage_options": s3.storage_options} if where == "s3" else {}
    hs.extract(model, ids, out, layers="1", batch_size=4, chunk_rows=4, progress=False, **options)
    store = hs.open_store(out, **options)
    values = hooked_values(model, ids, 4)
    assert np.array_equal(store["1"][:], values)  # read once in the parent: its connections are open
    seen = []
    for epoch in range(2):
        loader = store.loader("1", batch_size=10, tokens=True, seed=0, epoch=epoch, with_rows=True)
        batches = DataLoader(loader, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=120)
        for batch in batches:
            rows, positions = batch["row"].numpy(), batch["position"].numpy()
            assert np.array_equal(batch["1"].numpy(), values[rows, positions])
            seen += [(epoch, row, position) for row, position in zip(rows.tolist(), positions.tolist(), strict=True)]
    every = [(epoch, row, position) for epoch in range(2) for row in range(ROWS) for position in range(SEQ)]
    assert sorted(seen) == every
    own = DataLoader(Rows(store["1"]), batch_size=5, num_workers=2, multiprocessing_context="fork", timeout=120)
    assert np.array_equal(torch.cat(list(own)).numpy(), values)


class Relay:
    """A TCP relay to the S3 server that can be cut: new connections refused, open ones closed.
    An endpoint going away under a reader, as a network does; nothing of the client is replaced."""

    def __init__(self, endpoint: str) -> None:
        self.upstream = int(endpoint.rsplit(":", 1)[1])
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.lock = threading.Lock()
        self.sockets: set[socket.socket] = set()
        self.down = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
                server = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:  # cut
                return
            with self.lock:
                if self.down:
                    client.close()
                    server.close()
                    return
                self.sockets |= {client, server}
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with self.lock:
            for end in (source, sink):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)
                end.close()
                self.sockets.discard(end)

    def cut(self) -> None:
        with self.lock:
            self.down = True
            self.listener.close()
            for end in self.sockets:
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)
                end.close()
            self.sockets.clear()


def test_a_store_that_cannot_be_reached_is_a_read_error_never_a_damaged_store(
    s3: S3Server,  # noqa: F811
    bucket: str,
) -> None:
    relay = Relay(s3.endpoint)
    # botocore's own retries off: each failed request fails at once
    options = {**s3.storage_options, "endpoint_url": relay.endpoint, "config_kwargs": {"retries": {"max_attempts": 1}}}
    url = f"s3://{bucket}/f.zarr"
    model, ids = token_model(), token_rows()
    hs.extract(model, ids, url, layers="1", storage_options=options, batch_size=4, chunk_rows=4, progress=False)
    store = hs.open_store(url, storage_options=options)
    array = store["1"]
    loader = store.loader("1", 8, read_ahead=0)
    assert np.array_equal(array[:4], hooked_values(model, ids, 4)[:4])
    relay.cut()
    reads = {
        "a read": lambda: array[4:8],
        "the loader": lambda: list(loader),
        "an array opened": lambda: store["1"],
        "verify": store.verify,
    }
    for what, read in reads.items():
        with pytest.raises(hs.StoreReadError) as found:
            read()
        message = str(found.value)
        assert "not known to be damaged" in message, what
        assert "is damaged" not in message, what
        assert "run the same extraction again" not in message, what
        assert "EndpointConnectionError" in message, what
        assert SECRET not in message, what
        assert "testing" not in message, what  # the key and secret the server was given
    with pytest.raises(hs.StoreReadError) as found:
        array[8:12]
    assert (found.value.array, found.value.chunk) == ("1", 2)


def test_credentials_never_reach_a_message_a_repr_a_progress_line_or_the_store(
    s3: S3Server,  # noqa: F811
    bucket: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    model, ids = token_model(), token_rows()
    # any mapping, not only a dict; the secret is the server's own (moto takes any), kept in a secret option too
    given = types.MappingProxyType({**s3.storage_options, "client_kwargs": {"region_name": "us-east-1"}})
    with_token = {**given, "token": SECRET}
    url = f"s3://{bucket}/f.zarr"
    command = f"python train.py --out s3://AKIAHOOK:{SECRET}@{bucket}/f.zarr --storage-option secret={SECRET}"
    store = hs.extract(
        model,
        ids,
        url,
        layers="1",
        storage_options=with_token,
        batch_size=4,
        chunk_rows=4,
        progress=True,
        command=command,
    )
    err = capsys.readouterr().err
    progress = [line for line in err.splitlines() if line.startswith("extract →")]
    assert progress
    assert all(line.startswith(f"extract → {url}: ") for line in progress), progress  # the URL, not 'f.zarr'
    config = hs.ExtractConfig(storage_options=with_token, command=command)
    shown = [
        err,
        repr(store),
        repr(store["1"]),
        repr(store.loader("1", 8)),
        repr(config),
        str(config.to_dict()),
        str(store.meta),
    ]
    for text in shown:
        assert SECRET not in text, text
    assert "'token': '***'" in repr(config)
    stored = s3_objects(s3.fs(), f"{bucket}/f.zarr")
    assert stored
    assert [key for key, body in stored.items() if SECRET.encode() in body] == []
    opened = hs.open_store(url, storage_options=types.MappingProxyType(dict(given)))
    assert np.array_equal(opened["1"][:], hooked_values(model, ids, 4))

    for bad in (f"s3://AKIAHOOK:{SECRET}@{bucket}/g.zarr", f"s3://AKIAHOOK:Sup3r/{SECRET}@{bucket}/g.zarr"):
        with pytest.raises(hs.StoreError, match=r"credentials written into the URL.*storage_options") as refused:
            hs.extract(model, ids, bad, layers="1", storage_options=given, progress=False)
        assert SECRET not in str(refused.value)
        assert "AKIAHOOK" not in str(refused.value)
    for wrong in ([f"secret={SECRET}"], f"secret={SECRET}"):
        with pytest.raises(hs.StoreError, match="expected a mapping") as refused:
            hs.open_store(url, storage_options=wrong)  # type: ignore[arg-type]
        assert SECRET not in str(refused.value)
        with pytest.raises(hs.SpecError, match="expected a mapping") as refused:
            hs.ExtractConfig(storage_options=wrong)  # type: ignore[arg-type]
        assert SECRET not in str(refused.value)


def cli_extract(s3: S3Server, out: str, *extra: str) -> list[str]:  # noqa: F811
    return [
        "extract",
        "demo:cnn",
        "--data",
        "random:8:3x32x32",
        "-l",
        "fc",
        "-b",
        "4",
        "-o",
        out,
        "--storage-option",
        f"endpoint_url={s3.endpoint}",
        *extra,
    ]


def test_the_command_line_prints_no_credential_and_refuses_a_malformed_bucket(
    s3: S3Server,  # noqa: F811
    bucket: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    code, out, err = run_cli(capsys, *cli_extract(s3, f"s3://AKIAHOOK:{SECRET}@{bucket}/f.zarr"))
    assert code == 2, err
    assert SECRET not in out + err
    assert "credentials written into the URL" in err
    assert "ParamValidationError" not in err

    for malformed in ("s3://Bad_Bucket!/f.zarr", "s3:///f.zarr", f"s3://{'b' * 300}/f.zarr"):
        code, _, err = run_cli(capsys, *cli_extract(s3, malformed))
        assert code == 2, (malformed, err)
        assert "which is not an S3 bucket name" in err, err
        assert "ParamValidationError" not in err
    with pytest.raises(hs.StoreError, match="is not an S3 bucket name"):
        hs.open_store("s3://Bad_Bucket!/f.zarr")

    url = f"s3://{bucket}/f.zarr"
    argv = cli_extract(s3, url, "--storage-option", f"secret={SECRET}", "--storage-option", "key=testing", "--progress")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)  # moto takes any secret: the one given is used
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert SECRET not in out + err
    assert f"extract → {url}: " in err
    assert f"wrote 8 rows of 1 site to {url}" in out
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert f"verified 8 rows of 1 site in {url}" in out
    assert SECRET not in out + err
