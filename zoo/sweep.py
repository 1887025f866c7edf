"""Run the zoo: every model type in its own process, under a wall-time and a memory limit.

    python -m zoo.sweep [--jobs N] [--only gpt2,bert | --sample] [--out docs/zoo/ledger.json]

A model type that hangs, crashes or allocates without bound must not take the sweep with it, so
each one runs in a child process forked from a server that has imported torch and transformers
once (``forkserver`` with a preload: a child starts in well under a second instead of the five
an import takes). The child sets ``RLIMIT_AS`` on itself and sends its ledger entry back over a
pipe; the parent kills it at the time limit and records why.
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import sys
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_MEMORY_GIB", "DEFAULT_TIMEOUT_S", "main", "run_sweep"]

DEFAULT_TIMEOUT_S = 120.0
DEFAULT_MEMORY_GIB = 6.0
_PRELOAD = ["torch", "transformers", "transformers.modeling_utils", "hookscope", "zoo.probe", "zoo.tiny"]

Target = Callable[[str, dict[str, Any], Any], dict[str, Any]]


def _child(target: Target, model_type: str, options: dict[str, Any], conn: Connection, memory_bytes: int) -> None:
    """The body of one child: limit memory, run ``target`` and send its entry (or its failure)."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    torch = sys.modules.get("torch")  # preloaded by the fork server; a stand-in target needs none
    if torch is not None:
        torch.set_num_threads(1)  # the sweep's parallelism is its processes
    try:
        entry = target(model_type, options, conn.send)
    except BaseException as error:
        from zoo.reasons import reason_for

        entry = {"model_type": model_type, "error": reason_for(error)}
    conn.send(entry)
    conn.close()


def run_sweep(
    model_types: Sequence[str],
    *,
    jobs: int = 1,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_gib: float = DEFAULT_MEMORY_GIB,
    options: dict[str, Any] | None = None,
    target: Target | None = None,
    preload: Sequence[str] = tuple(_PRELOAD),
    progress: Callable[[str, dict[str, Any]], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """The entry of each model type, from ``target(model_type, options, report)`` in a child.

    ``target`` defaults to :func:`zoo.probe.probe`; it must be importable by name (the children
    unpickle it). A child past ``timeout_s`` is killed, and its entry is the last one it reported
    plus ``"timeout": True`` and the reason; a child that dies is recorded with its exit code.
    """
    if target is None:
        from zoo.probe import probe

        target = probe
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(preload))
    memory_bytes = int(memory_gib * 2**30)
    pending = list(model_types)
    running: dict[str, tuple[Any, Connection, float, dict[str, Any]]] = {}
    results: dict[str, dict[str, Any]] = {}
    while pending or running:
        while pending and len(running) < max(1, jobs):
            model_type = pending.pop(0)
            parent_end, child_end = context.Pipe(duplex=False)
            process = context.Process(
                target=_child, args=(target, model_type, options or {}, child_end, memory_bytes), daemon=True
            )
            process.start()
            child_end.close()
            running[model_type] = (process, parent_end, time.monotonic(), {"model_type": model_type})
        for model_type in list(running):
            finished = _step(model_type, running, timeout_s, memory_gib)
            if finished is not None:
                results[model_type] = finished
                if progress is not None:
                    progress(model_type, finished)
        time.sleep(0.05)
    return results


def _step(
    model_type: str,
    running: dict[str, tuple[Any, Connection, float, dict[str, Any]]],
    timeout_s: float,
    memory_gib: float,
) -> dict[str, Any] | None:
    """Read what one child has sent; its final entry once it is done, else None."""
    process, conn, started, last = running[model_type]
    done = False
    try:
        while conn.poll():
            last = conn.recv()
            running[model_type] = (process, conn, started, last)
    except (EOFError, OSError):
        done = True
    elapsed = time.monotonic() - started
    if not done and process.is_alive() and elapsed <= timeout_s:
        return None
    if process.is_alive() and elapsed > timeout_s:
        process.kill()
        last = {**last, "timeout": True, "error": f"timed out after {timeout_s:g} s (the sweep's limit)"}
    process.join(5)
    conn.close()
    del running[model_type]
    if process.exitcode not in (0, None) and "error" not in last and not last.get("stages"):
        code = process.exitcode
        last = {**last, "error": f"killed by signal {-code}" if code < 0 else f"exited with status {code}"}
        if code == -9:
            last["error"] += f" (memory limit {memory_gib:g} GiB?)"
    last.setdefault("seconds", round(elapsed, 2))
    return last


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: run the sweep, write the ledger JSON and its Markdown page."""
    from zoo import ledger
    from zoo.tiny import SAMPLE_TYPES, model_types

    parser = argparse.ArgumentParser(prog="python -m zoo.sweep", description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1, help="children at once (default 1)")
    parser.add_argument("--only", default="", help="comma-separated model types")
    parser.add_argument("--sample", action="store_true", help="the fixed sample of ~25 architectures")
    parser.add_argument("--out", type=Path, default=Path("docs/zoo/ledger.json"), help="the ledger JSON")
    parser.add_argument("--page", type=Path, default=None, help="the Markdown page (default: none for --only)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per model type")
    parser.add_argument("--memory-gib", type=float, default=DEFAULT_MEMORY_GIB, help="address space per child")
    parser.add_argument("--no-verify", action="store_true", help="skip hookscope.verify")
    parser.add_argument(
        "--compile-backend",
        default="eager",
        help="torch.compile backend of verify's compile check, or 'none' (about half of verify's time)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--merge", action="store_true", help="replace only these types' entries in --out")
    parsed = parser.parse_args(argv)
    if parsed.only:
        types = [name.strip() for name in parsed.only.split(",") if name.strip()]
    else:
        types = list(SAMPLE_TYPES) if parsed.sample else model_types()
    settings = {
        "jobs": parsed.jobs,
        "timeout_s": parsed.timeout,
        "memory_gib": parsed.memory_gib,
        "compile_backend": parsed.compile_backend,
    }
    earlier = ledger.read_json(parsed.out) if parsed.merge and parsed.out.exists() else None
    started = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}

    def show(model_type: str, entry: dict[str, Any]) -> None:
        print(f"{model_type:40s} {ledger.outcome(entry):10s} {ledger.reason_of(entry) or ''}"[:200], flush=True)
        results[model_type] = entry
        if len(results) % 25 == 0:  # a sweep stopped early still leaves what it found
            _write(results, partial=True)

    def _write(found: dict[str, dict[str, Any]], *, partial: bool) -> dict[str, Any]:
        wall = time.perf_counter() - started
        document = ledger.make_ledger(found, wall_seconds=wall, settings={**settings, "partial": partial})
        if earlier is not None:
            document = ledger.merged(earlier, document)
        ledger.write_json(document, parsed.out)
        return document

    run_sweep(
        types,
        jobs=parsed.jobs,
        timeout_s=parsed.timeout,
        memory_gib=parsed.memory_gib,
        options={
            "verify": not parsed.no_verify,
            "seed": parsed.seed,
            "compile": False if parsed.compile_backend.lower() == "none" else parsed.compile_backend,
        },
        progress=show,
    )
    document = _write(results, partial=False)
    page = parsed.page if parsed.page is not None else (ledger.page_path(parsed.out) if not parsed.only else None)
    if page is not None:
        page.write_text(ledger.render_page(document), encoding="utf-8")
    print(ledger.summary_line(document))
    return 0


if __name__ == "__main__":
    sys.exit(main())
