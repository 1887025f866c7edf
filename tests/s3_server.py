"""An S3 server for tests: moto in server mode, a subprocess on 127.0.0.1 (nothing else is reached).

``s3`` (session-scoped) starts it on a free port and stops it at the end; ``S3Server.bucket()``
makes a fresh bucket of a unique name, ``S3Server.fs()`` an s3fs file system of its own (not
s3fs's shared instance), ``storage_options`` is what ``hs.extract``/``hs.open_store`` take and
``env`` what a subprocess needs for the same credentials. moto's server implements S3's
conditional writes (``If-None-Match: *`` on create, ``If-Match`` on put and delete), which the
writer record relies on. Use it from a test module with ``from tests.s3_server import s3``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

__all__ = ["S3Server", "close_s3_clients", "s3", "s3_objects"]

KEY = SECRET = "testing"
REGION = "us-east-1"
START_TIMEOUT_S = 20.0


@dataclass
class S3Server:
    """A running moto server: its endpoint, the options and environment that reach it."""

    endpoint: str
    log: Path

    @property
    def storage_options(self) -> dict[str, Any]:
        """s3fs's options for this server (a fresh dict each time: callers may change theirs)."""
        return {"endpoint_url": self.endpoint, "key": KEY, "secret": SECRET, "client_kwargs": {"region_name": REGION}}

    @property
    def env(self) -> dict[str, str]:
        """Environment variables for a subprocess that talks to this server (credentials, region, no proxy)."""
        return {
            "AWS_ACCESS_KEY_ID": KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_DEFAULT_REGION": REGION,
            "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost",
        }

    def fs(self) -> Any:
        """An s3fs file system of this module's own, not s3fs's shared instance, that caches no
        listing; one until :func:`close_s3_clients` closes it (a client takes a while to make)."""
        import s3fs

        if "fs" not in _OWN:
            _OWN["fs"] = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **self.storage_options)
        return _OWN["fs"]

    def bucket(self) -> str:
        """A new, empty bucket with a name no other test uses."""
        import s3fs

        name = f"hs-{uuid.uuid4().hex[:16]}"
        plain = {key: value for key, value in self.storage_options.items() if key != "client_kwargs"}
        # us-east-1 takes no LocationConstraint (moto refuses one): make the bucket without the region
        if "maker" not in _OWN:
            _OWN["maker"] = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **plain)
        _OWN["maker"].mkdir(name)
        return name


_OWN: dict[str, Any] = {}  # the file systems this module made, to close


def close_s3_clients() -> None:
    """Close every s3fs client (this module's and the ones s3fs caches for zarr's stores) and empty
    s3fs's instance cache, so that no file system, listing or connection goes from one test to
    the next. A client dropped unclosed warns (``ResourceWarning: Unclosed client session``) when
    it is collected, in whichever test that happens."""
    import fsspec.asyn
    import s3fs
    import zarr

    for fs in [*_OWN.values(), *s3fs.S3FileSystem._cache.values()]:
        creator = getattr(fs, "_s3creator", None)
        if creator is None:
            continue
        with contextlib.suppress(Exception):  # already closed, or its loop is gone
            if fs.asynchronous:  # zarr's FsspecStore: a client of zarr's event loop
                zarr.core.sync.sync(creator.__aexit__(None, None, None))
            else:
                fsspec.asyn.sync(fs.loop, creator.__aexit__, None, None, None)
        fs._s3creator = fs._s3 = None
    _OWN.clear()
    s3fs.S3FileSystem.clear_instance_cache()


def s3_objects(fs: Any, prefix: str) -> dict[str, bytes]:
    """Every object under ``prefix`` (``bucket/path``), by key relative to it, the writer record
    aside: comparable with ``store_files`` of a local store."""
    prefix = prefix.rstrip("/")
    keys = sorted(fs.find(prefix))
    bodies = fs.cat(keys) if keys else {}  # one concurrent batch of GETs
    found = {key[len(prefix) + 1 :]: bodies[key] for key in keys}
    return {
        key: body for key, body in found.items() if not key.rsplit("/", 1)[-1].startswith((".writer", "writer.json"))
    }


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def _answers(endpoint: str) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy
    try:
        with opener.open(f"{endpoint}/moto-api/", timeout=1):
            return True
    except OSError:
        return False


def _start(log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """moto's server on a free port of 127.0.0.1, once it answers (a port taken meanwhile: another one)."""
    env = {**os.environ, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": REGION}
    for _ in range(3):
        port = _free_port()
        endpoint = f"http://127.0.0.1:{port}"
        with open(log, "ab") as written:
            server = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                stdout=subprocess.DEVNULL,
                stderr=written,
                env=env,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while server.poll() is None and time.monotonic() < deadline:
            if _answers(endpoint):
                return server, endpoint
            time.sleep(0.05)
        _stop(server)
    raise RuntimeError(f"moto's S3 server did not start; its log: {log.read_text()[-2000:]}")


def _stop(server: subprocess.Popen[bytes]) -> None:
    if server.poll() is None:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A moto S3 server for the session (see the module doc)."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    log = tmp_path_factory.mktemp("moto") / "server.log"
    server, endpoint = _start(log)
    try:
        yield S3Server(endpoint, log)
    finally:
        close_s3_clients()
        _stop(server)
