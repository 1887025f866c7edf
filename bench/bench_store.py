"""Feature stores end to end: ``hs.extract`` to local disk and to S3 against the forward, and ``store.loader``'s
token rows/s against reading the same arrays with zarr and against a Hugging Face ``datasets`` Arrow copy (CPU).

The workload: a small GPT-2, ``GPT2Model(GPT2Config(n_layer=4, n_embd=256, n_head=4))`` with random weights
(nothing is downloaded), eval mode, ``torch.no_grad()``, ``--rows`` sequences (default 512) of 128 random token
ids with a right-padded ``attention_mask`` (each row's length drawn from 32..128), batches of 32, chunks of 32
rows. Three sites: ``h.1`` and ``h.2`` unreduced, ``(N, 128, 256)`` float32 (128 KiB a row each), and ``h.3``
reduced to its masked mean over tokens.

**Extraction**, each method over the same rows, timed as one whole call:

- ``forward``: ``model(input_ids=..., attention_mask=...)`` for every batch, nothing kept: the floor;
- ``extract local``: ``hs.extract(model, data, sites, out, ...)`` into a fresh local zarr store;
- ``extract s3``: the same into ``s3://<bucket>/<fresh key>.zarr`` on a moto S3 server this script starts on
  127.0.0.1 (a subprocess, stopped at the end): every chunk goes through HTTP, with hookscope's pool of chunk
  writers.

Target: both extractions at least 0.9x the forward's rows/s (median of per-round ratios).

**Loading**, over the local store the extraction wrote, counting token rows (real tokens only):

- ``zarr sequential``: chunk by chunk, ``array[a:b]`` and ``mask[a:b]`` with zarr, then ``values[mask]``: the
  floor of reading the store in order, no shuffle;
- ``loader shuffle``: ``store.loader("h.1", batch, tokens=True)`` (shuffled: chunk order and a window of 8
  chunks), iterated to the end;
- ``loader no shuffle``: the same with ``shuffle=False``;
- ``hf arrow shuffle``: the same token rows written once (not timed) as a ``datasets`` Arrow table in a temporary
  folder (``Dataset.from_dict(...).save_to_disk``, then ``load_from_disk``, memory-mapped), then timed:
  ``.with_format("torch").shuffle(seed=0)`` and ``ds.iter(batch)`` to the end.

Target: ``loader shuffle`` at least 0.8x ``zarr sequential``'s token rows/s; its ratio to the Arrow copy is
reported without a target.

How it is measured: as in the other scripts (``common.measure``): every round runs every method once, in an order
rotated from round to round, after a full garbage collection; the figures are medians of per-round ratios. The
loading methods are warmed up once (the store's files are then in the page cache for every method alike).

Run: ``.venv/bin/python bench/bench_store.py``; ``--rows N``; ``--rounds N``; ``--no-s3`` skips the S3 row;
``--quick`` for a smoke run (256 rows, 1 round); ``--json PATH``; ``--check`` exits 1 on a missed target.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Run as a file, not as a package: make ``common`` (next to this file) importable from any working directory.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from torch import nn
from transformers import GPT2Config, GPT2Model

import common
import hookscope as hs

EXTRACT_TARGET, LOADER_TARGET = 0.9, 0.8
N_LAYER, N_EMBD, N_HEAD = 4, 256, 4
ROWS, QUICK_ROWS = 512, 128
CHUNK_ROWS = 32  # 4 MiB of h.1 a chunk: 16 chunks at 512 rows, two shuffle windows of the loader
SEQ_LEN, BATCH, MIN_LEN = 128, 32, 32
LOADER_BATCH = 1024  # token rows per training batch
SITES = ["h.1", "h.2", "h.3"]
REDUCE = {"h.3": "mean:1"}  # h.1 and h.2 stay (N, seq, d)
TOKEN_SITE = "h.1"
DEFAULT_ROUNDS, MIN_ROUNDS, QUICK_ROUNDS = 3, 3, 1
LOAD_ROUNDS = 20  # loading takes well under a second a call: more rounds, cheaply
FORWARD, LOCAL, S3 = "forward", "extract local", "extract s3"
ZARR_SEQ, LOADER, LOADER_SEQ, HF = "zarr sequential", "loader shuffle", "loader no shuffle", "hf arrow shuffle"


@dataclass
class Table(common.RoundRatios):
    """Seconds per method per round over the same work; ``units`` rows (or token rows) per call."""

    key: str
    title: str
    units: int
    times: dict[str, list[float]]
    stored_bytes: dict[str, int] = field(default_factory=dict)
    cpu: dict[str, list[float]] = field(default_factory=dict)  # this process's CPU seconds per call
    notes: list[str] = field(default_factory=list)

    def per_second(self, name: str) -> float:
        return self.units / statistics.median(self.times[name])

    def speed(self, name: str, baseline: str) -> list[float]:
        """Per-round (units/s of ``name``) / (units/s of ``baseline``): the inverse of the time ratios."""
        return [1 / ratio for ratio in self.ratios(name, baseline)]

    def median_speed(self, name: str, baseline: str) -> float:
        return statistics.median(self.speed(name, baseline))


# -- a moto S3 server on 127.0.0.1 (the start/stop logic of tests/s3_server.py, without pytest) --------------

KEY = SECRET = "testing"
REGION = "us-east-1"


class MotoServer:
    """``python -m moto.server`` on a free port of 127.0.0.1, until :meth:`stop`; ``bucket()`` makes a bucket."""

    def __init__(self, log: Path) -> None:
        self.log = log
        env = {**os.environ, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": REGION}
        for _ in range(3):
            port = _free_port()
            self.endpoint = f"http://127.0.0.1:{port}"
            with open(log, "ab") as written:
                self.process = subprocess.Popen(
                    [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                    stdout=subprocess.DEVNULL,
                    stderr=written,
                    env=env,
                )
            deadline = time.monotonic() + 20
            while self.process.poll() is None and time.monotonic() < deadline:
                if _answers(self.endpoint):
                    self.fs = self._fs()
                    return
                time.sleep(0.05)
            self._kill()
        raise RuntimeError(f"moto's S3 server did not start; its log: {log.read_text()[-2000:]}")

    @property
    def storage_options(self) -> dict[str, Any]:
        return {"endpoint_url": self.endpoint, "key": KEY, "secret": SECRET}

    def _fs(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **self.storage_options)

    def bucket(self) -> str:
        name = f"bench-{uuid.uuid4().hex[:12]}"
        self.fs.mkdir(name)
        return name

    def cpu_seconds(self) -> float:
        """CPU time the server process has used so far (user + system), from ``/proc``; 0 where unreadable."""
        try:
            fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stored_bytes(self, prefix: str) -> int:
        return int(sum(self.fs.du(prefix, total=False).values()))

    def stop(self) -> None:
        """Close every s3fs client (ours and those zarr's stores made), then stop the server."""
        import fsspec.asyn
        import s3fs
        import zarr

        for fs in [self.fs, *s3fs.S3FileSystem._cache.values()]:
            creator = getattr(fs, "_s3creator", None)
            if creator is None:
                continue
            with contextlib.suppress(Exception):  # already closed, or its loop is gone
                if fs.asynchronous:  # zarr's FsspecStore: a client of zarr's event loop
                    zarr.core.sync.sync(creator.__aexit__(None, None, None))
                else:
                    fsspec.asyn.sync(fs.loop, creator.__aexit__, None, None, None)
            fs._s3creator = fs._s3 = None
        s3fs.S3FileSystem.clear_instance_cache()
        self._kill()

    def _kill(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


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


@contextlib.contextmanager
def moto_server(scratch: Path) -> Iterator[MotoServer]:
    for name in ("NO_PROXY", "no_proxy"):
        os.environ[name] = "127.0.0.1,localhost"
    server = MotoServer(scratch / "moto.log")
    try:
        yield server
    finally:
        server.stop()


# -- the workload -----------------------------------------------------------------------------------


def workload(rows: int) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The model and ``{"input_ids", "attention_mask"}``, right-padded, each row 32..128 real tokens."""
    config = GPT2Config(n_layer=N_LAYER, n_embd=N_EMBD, n_head=N_HEAD, n_positions=SEQ_LEN)
    model = GPT2Model(config).eval()
    lengths = torch.randint(MIN_LEN, SEQ_LEN + 1, (rows,))
    mask = (torch.arange(SEQ_LEN) < lengths[:, None]).long()
    ids = torch.randint(0, config.vocab_size, (rows, SEQ_LEN)) * mask
    return model, {"input_ids": ids, "attention_mask": mask}


# -- extraction -------------------------------------------------------------------------------------


class Extraction:
    """The three ways through the rows; each store goes to a fresh place."""

    def __init__(self, scratch: Path, server: MotoServer | None) -> None:
        self.scratch = scratch
        self.server = server
        self.bucket = server.bucket() if server is not None else ""
        self.s3_key = ""
        self.stored: dict[str, int] = {}
        self.cpu: dict[str, list[float]] = {}
        self.server_cpu: list[float] = []  # the S3 server's CPU seconds during each timed ``extract s3``

    def forward(self, model: nn.Module, data: dict[str, torch.Tensor]) -> common.Timed:
        def loop() -> None:
            for start in range(0, len(data["input_ids"]), BATCH):
                model(**{key: value[start : start + BATCH] for key, value in data.items()})

        return self.timed(FORWARD, loop)

    def local(self, model: nn.Module, data: dict[str, torch.Tensor]) -> common.Timed:
        out = self.scratch / "store.zarr"
        if out.exists():
            shutil.rmtree(out)
        timed = self.timed(LOCAL, lambda: self._extract(model, data, out, None))
        self.stored[LOCAL] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        return timed

    def s3(self, model: nn.Module, data: dict[str, torch.Tensor]) -> common.Timed:
        assert self.server is not None
        if self.s3_key:  # the last run's objects: moto keeps them in memory
            self.server.fs.rm(self.s3_key, recursive=True)
        self.s3_key = f"{self.bucket}/{uuid.uuid4().hex[:8]}.zarr"
        options = self.server.storage_options
        cpu = self.server.cpu_seconds()
        timed = self.timed(S3, lambda: self._extract(model, data, f"s3://{self.s3_key}", options))
        self.server_cpu.append(self.server.cpu_seconds() - cpu)
        self.stored[S3] = self.server.stored_bytes(self.s3_key)
        return timed

    def timed(self, name: str, fn: Callable[[], Any]) -> common.Timed:
        """``common.timed_call(fn)``, noting the CPU seconds this process (every thread) spent in it."""
        before = sum(os.times()[:2])
        timed = common.timed_call(fn)
        self.cpu.setdefault(name, []).append(sum(os.times()[:2]) - before)
        return timed

    @staticmethod
    def _extract(model: nn.Module, data: Any, out: Any, storage_options: dict[str, Any] | None) -> hs.Store:
        return hs.extract(
            model,
            data,
            out,
            layers=SITES,
            reduce=REDUCE,
            batch_size=BATCH,
            chunk_rows=CHUNK_ROWS,
            progress=False,
            storage_options=storage_options,
        )

    def runs(self) -> dict[str, common.Run]:
        runs: dict[str, common.Run] = {FORWARD: self.forward, LOCAL: self.local}
        if self.server is not None:
            runs[S3] = self.s3
        return runs


def bench_extract(model: nn.Module, data: dict[str, torch.Tensor], extraction: Extraction, rounds: int) -> Table:
    rows = len(data["input_ids"])
    times = common.measure(extraction.runs(), model, data, rounds, warmup=0)
    store = hs.open_store(extraction.scratch / "store.zarr")
    values = sum(store[name].zarr.nbytes for name in store.sites)
    title = (
        f"extraction: GPT-2 {N_LAYER} layers, n_embd {N_EMBD}, {rows:,} sequences x {SEQ_LEN} tokens "
        f"(right-padded), batch {BATCH}"
    )
    notes = [
        f"sites {', '.join(f'{s} {store[s].shape}' for s in store.sites)} float32; {values / 2**20:.0f} MiB of "
        f"values per run, {store.meta['config']['chunk_rows']} rows a chunk (zstd 3); MB/s = stored bytes "
        "(compressed, mask and row index included) / median s; CPU s = this process's CPU seconds a call (median)"
    ]
    if extraction.server_cpu:
        cpu, s3 = statistics.median(extraction.server_cpu), statistics.median(times[S3])
        notes.append(
            f"the moto S3 server (a Python process on the same cores) used {cpu:.2f} CPU s per extract s3 call "
            f"(median; {cpu / s3:.0%} of that call's wall time)"
        )
    return Table("extract", title, rows, times, dict(extraction.stored), extraction.cpu, notes)


# -- loading ----------------------------------------------------------------------------------------


class Loading:
    """The four ways through the token rows of the local store; each returns the token rows it saw."""

    def __init__(self, store: hs.Store, arrow: Path) -> None:
        self.store = store
        self.arrow = arrow

    def zarr_sequential(self, _model: Any, _x: Any) -> common.Timed:
        values, mask = self.store[TOKEN_SITE].zarr, self.store.attention_mask
        assert mask is not None
        chunk, rows = self.store.chunk_rows, len(self.store)

        def loop() -> int:
            seen = 0
            for start in range(0, rows, chunk):
                seen += len(values[start : start + chunk][mask.zarr[start : start + chunk]])
            return seen

        return common.timed_call(loop)

    def loader(self, shuffle: bool) -> common.Run:
        def run(_model: Any, _x: Any) -> common.Timed:
            def loop() -> int:
                loader = self.store.loader(TOKEN_SITE, LOADER_BATCH, tokens=True, shuffle=shuffle, seed=0)
                return sum(len(batch) for batch in loader)

            return common.timed_call(loop)

        return run

    def hf(self, _model: Any, _x: Any) -> common.Timed:
        import datasets

        def loop() -> int:
            ds = datasets.load_from_disk(str(self.arrow)).with_format("torch").shuffle(seed=0, keep_in_memory=True)
            return sum(len(batch["x"]) for batch in ds.iter(LOADER_BATCH))

        return common.timed_call(loop)

    def runs(self) -> dict[str, common.Run]:
        return {ZARR_SEQ: self.zarr_sequential, LOADER: self.loader(True), LOADER_SEQ: self.loader(False), HF: self.hf}


def arrow_copy(store: hs.Store, folder: Path) -> int:
    """The store's real token rows of ``TOKEN_SITE`` as a ``datasets`` Arrow table saved in ``folder``."""
    import datasets

    datasets.disable_progress_bars()
    mask = store.attention_mask
    assert mask is not None
    tokens = store[TOKEN_SITE].zarr[:][mask.zarr[:]]  # (token rows, d)
    features = datasets.Features({"x": datasets.Sequence(datasets.Value("float32"), length=tokens.shape[1])})
    datasets.Dataset.from_dict({"x": tokens}, features=features).save_to_disk(str(folder / "arrow"))
    return len(tokens)


def bench_load(store: hs.Store, scratch: Path, rounds: int) -> Table:
    units = arrow_copy(store, scratch)
    loading = Loading(store, scratch / "arrow")
    seen: dict[str, int] = {}

    def first_round(name: str, kept: Any) -> None:
        seen[name] = kept

    times = common.measure(loading.runs(), None, None, rounds, warmup=1, first_round=first_round)  # type: ignore[arg-type]
    assert all(count == units for count in seen.values()), f"token rows seen differ: {seen} (expected {units})"
    title = (
        f"loading: {TOKEN_SITE} {store[TOKEN_SITE].shape} float32, {units:,} real token rows "
        f"({units / (len(store) * SEQ_LEN):.0%} of positions), batches of {LOADER_BATCH:,} token rows"
    )
    notes = ["every method saw the same number of token rows", "x zarr seq = token rows/s over zarr sequential's"]
    return Table("load", title, units, times, notes=notes)


# -- reporting --------------------------------------------------------------------------------------


def verdicts(extract: Table, load: Table) -> list[tuple[str, float, float]]:
    found = [
        (f"{name} rows/s over forward", extract.median_speed(name, FORWARD), EXTRACT_TARGET)
        for name in (LOCAL, S3)
        if name in extract.times
    ]
    return [*found, (f"{LOADER} token rows/s over {ZARR_SEQ}", load.median_speed(LOADER, ZARR_SEQ), LOADER_TARGET)]


def format_extract(table: Table) -> str:
    header = f"{'method':<18}{'median s':>9}{'CPU s':>7}{'rows/s':>9}{'MB/s':>8}{'x forward':>11}{'range':>14}"
    lines = [table.title, *(f"  {note}" for note in table.notes), "", header]
    for name, seconds in table.times.items():
        median = statistics.median(seconds)
        written = f"{table.stored_bytes[name] / 1e6 / median:.0f}" if name in table.stored_bytes else "-"
        speed = table.speed(name, FORWARD)
        cpu = statistics.median(table.cpu[name])
        row = f"{name:<18}{median:>9.2f}{cpu:>7.2f}{table.per_second(name):>9.1f}{written:>8}"
        lines.append(row + f"{statistics.median(speed):>11.3f}{common.ratio_range(speed):>14}")
    return "\n".join(lines)


def format_load(table: Table) -> str:
    header = f"{'method':<20}{'median s':>9}{'token rows/s':>14}{'x zarr seq':>12}{'range':>14}{'x hf arrow':>12}"
    lines = [table.title, *(f"  {note}" for note in table.notes), "", header]
    for name, seconds in table.times.items():
        speed = table.speed(name, ZARR_SEQ)
        row = f"{name:<20}{statistics.median(seconds):>9.3f}{table.per_second(name):>14,.0f}"
        lines.append(
            row
            + f"{statistics.median(speed):>12.3f}{common.ratio_range(speed):>14}{table.median_speed(name, HF):>12.3f}"
        )
    return "\n".join(lines)


def format_verdicts(found: list[tuple[str, float, float]]) -> str:
    return "\n".join(
        f"{label}: {value:.3f} (target >= {target:.2f}): {'PASS' if value >= target else 'MISS'}"
        for label, value, target in found
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    def extra(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--rows", type=int, default=None, help=f"sequences (default {ROWS}, a multiple of {BATCH})")
        parser.add_argument(
            "--load-rounds", type=int, default=LOAD_ROUNDS, help=f"timed rounds of loading (default {LOAD_ROUNDS})"
        )
        parser.add_argument("--no-s3", action="store_true", help="skip the extraction to the local S3 server")

    return common.parse_run_args(
        argv,
        description=__doc__.splitlines()[0],
        min_rounds=MIN_ROUNDS,
        default_rounds=DEFAULT_ROUNDS,
        quick_rounds=QUICK_ROUNDS,
        quick_help=f"smoke run: {QUICK_ROUNDS} round, {QUICK_ROWS} rows",
        check_help="exit 1 if a target is missed",
        extra=extra,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rows = args.rows or (QUICK_ROWS if args.quick else ROWS)
    load_rounds = args.rounds if args.quick else args.load_rounds
    common.start(args, f"extraction under torch.no_grad(), {load_rounds} rounds of loading")
    model, data = workload(rows)
    with tempfile.TemporaryDirectory(prefix="bench-store-") as folder, contextlib.ExitStack() as stack:
        scratch = Path(folder)
        server = None if args.no_s3 else stack.enter_context(moto_server(scratch))
        with torch.no_grad():
            extract = bench_extract(model, data, Extraction(scratch, server), args.rounds)
        print(f"\n{format_extract(extract)}", flush=True)
        load = bench_load(hs.open_store(scratch / "store.zarr"), scratch, load_rounds)
        print(f"\n{format_load(load)}", flush=True)
    found = verdicts(extract, load)
    print(f"\n{format_verdicts(found)}")
    tables = [asdict(extract) | extract.medians(FORWARD), asdict(load) | load.medians(ZARR_SEQ, HF)]
    targets = [{"what": w, "value": v, "target": t, "passed": v >= t} for w, v, t in found]
    passed = all(value >= target for _, value, target in found)
    summary = [common.summary_row(w, v, t, better="higher") for w, v, t in found]
    return common.finish(args, tables, passed, load_rounds=load_rounds, targets=targets, summary=summary)


if __name__ == "__main__":
    sys.exit(main())
