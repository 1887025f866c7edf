"""Run every benchmark script, then print one table of every figure held to a target, with PASS or MISS.

Each script prints its own tables and verdicts, which scroll away during a ``make bench`` of many minutes. This
script runs them one after another as subprocesses, each with ``--json <tmpdir>/<script>.json`` plus whatever
extra arguments it was given (``--quick`` for a smoke run), lets their output through as it comes, and then reads
the ``summary`` list of every JSON file: one row per judged figure, ``{"name", "value", "target", "better":
"lower" | "higher", "unit": "x" | "s"}`` (``common.summary_row`` builds one). The table shows the script, the
figure, its value, its target (``<=`` or ``>=``) and PASS or MISS; a last line counts them.

Benchmarks report, they do not gate: a MISS leaves the exit code at 0, since one noisy run on a busy machine is
not a regression by itself. The exit code is 1 only when a script failed (it exited non-zero, or wrote no
readable JSON, or a malformed summary); the failures are named after the table.

Run: ``.venv/bin/python bench/summary.py`` (what ``make bench`` runs); ``--quick`` and any other unknown option
is passed on to every script; ``--only hooks,grads`` runs a subset; ``--from-json DIR`` prints the table from the
JSON files already in DIR without running anything.

This file imports neither torch nor ``common``, so that ``--from-json`` answers at once.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

SCRIPTS: dict[str, tuple[str, ...]] = {
    "bench_hooks.py": (),
    "bench_capture.py": (),
    "bench_trace.py": (),
    "bench_grads.py": (),
    "bench_edit.py": (),
    "bench_extract.py": ("--rss", "--rss-rows", "512"),
    "bench_diff.py": (),
    "bench_compile.py": (),
    "bench_ops.py": (),
    "bench_experts.py": (),
    "bench_methods.py": (),
    "bench_monitor.py": (),
    "bench_store.py": (),
    "bench_report.py": (),
    "bench_verify.py": (),
}
"""The scripts in the order they run, each with the arguments ``make bench`` always gives it."""

FIELDS = ("name", "value", "target", "better", "unit")
REFUSED = ("--json", "--check")


@dataclass
class Row:
    """One judged figure of one script, read from its JSON."""

    script: str
    name: str
    value: float
    target: float
    better: str
    unit: str

    @property
    def passed(self) -> bool:
        """Within the target on the side ``better`` names; a NaN value never passes."""
        if math.isnan(self.value):
            return False
        return self.value <= self.target if self.better == "lower" else self.value >= self.target


@dataclass
class Summary:
    """Everything the final table shows: the rows, the notes about scripts without rows, and the failures."""

    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


def script_name(choice: str) -> str:
    """``hooks``, ``bench_hooks`` or ``bench_hooks.py`` -> ``bench_hooks.py``; unknown names raise ValueError."""
    stem = choice.strip().removesuffix(".py")
    name = f"{stem if stem.startswith('bench_') else 'bench_' + stem}.py"
    if name not in SCRIPTS:
        raise ValueError(f"unknown script {choice!r}; expected one of {', '.join(s[6:-3] for s in SCRIPTS)}")
    return name


def parse_row(script: str, index: int, item: Any) -> Row:
    """One entry of a ``summary`` list, checked: a malformed entry raises ValueError naming what is wrong."""
    if not isinstance(item, dict):
        raise ValueError(f"summary[{index}] is a {type(item).__name__}, not an object")
    missing = [key for key in FIELDS if key not in item]
    if missing:
        raise ValueError(f"summary[{index}] lacks {', '.join(missing)}")
    if item["better"] not in ("lower", "higher") or item["unit"] not in ("x", "s"):
        raise ValueError(f"summary[{index}]: better={item['better']!r}, unit={item['unit']!r}")
    try:
        value, target = float(item["value"]), float(item["target"])
    except (TypeError, ValueError) as error:
        raise ValueError(f"summary[{index}]: value and target must be numbers ({error})") from None
    return Row(script, str(item["name"]), value, target, item["better"], item["unit"])


def read_json(path: Path, script: str, summary: Summary) -> None:
    """Add the rows of one script's JSON file to ``summary``; a missing ``summary`` key is a note, not a failure.

    The key is optional because a script that judges nothing, or one not yet following the convention, still
    belongs in a ``make bench``; a file that cannot be read or a malformed row is a failure, since the table
    would then silently leave a verdict out.
    """
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        summary.failures.append(f"{script}: no readable JSON at {path} ({error})")
        return
    if not isinstance(data, dict) or "summary" not in data:
        summary.notes.append(f"{script}: no summary in its JSON, so no rows")
        return
    items = data["summary"]
    if not isinstance(items, list):
        summary.failures.append(f"{script}: its summary is a {type(items).__name__}, not a list")
        return
    if not items:
        summary.notes.append(f"{script}: no figure with a target")
    for index, item in enumerate(items):
        try:
            summary.rows.append(parse_row(script, index, item))
        except ValueError as error:
            summary.failures.append(f"{script}: {error}")


def shown(value: float, unit: str) -> str:
    """``1.034x`` for a ratio, ``2.41 s`` for seconds."""
    return f"{value:.3f}x" if unit == "x" else f"{value:.2f} s"


def format_summary(summary: Summary) -> str:
    """The final table, the notes, the count of PASS and MISS, and the failed scripts."""
    header = ("script", "name", "value", "target", "")
    cells = [
        (
            row.script,
            row.name,
            shown(row.value, row.unit),
            f"{'<=' if row.better == 'lower' else '>='} {shown(row.target, row.unit)}",
            "PASS" if row.passed else "MISS",
        )
        for row in summary.rows
    ]
    widths = [max(len(line[i]) for line in [header, *cells]) for i in range(len(header))]

    def line(values: Sequence[str]) -> str:
        left = f"{values[0]:<{widths[0]}}  {values[1]:<{widths[1]}}"
        return f"{left}  {values[2]:>{widths[2]}}  {values[3]:>{widths[3]}}  {values[4]}".rstrip()

    lines = ["summary of every figure held to a target", "", line(header), *(line(c) for c in cells)]
    if summary.notes:
        lines += ["", *(f"note: {note}" for note in summary.notes)]
    passed = sum(row.passed for row in summary.rows)
    lines += ["", f"{passed} PASS, {len(summary.rows) - passed} MISS"]
    lines += [f"FAILED: {failure}" for failure in summary.failures]
    return "\n".join(lines)


def json_name(script: str) -> str:
    """``bench_hooks.py`` -> ``bench_hooks.json``: where a run writes that script's JSON."""
    return f"{Path(script).stem}.json"


def run_scripts(scripts: Sequence[str], extra: Sequence[str], folder: Path) -> Summary:
    """Run each script in turn with ``--json`` into ``folder``, its output streamed through, and read its rows.

    The scripts run in processes of their own, one at a time, so that no script's allocations, threads or
    torch settings bleed into the next one's timings.
    """
    summary = Summary()
    for script in scripts:
        out = folder / json_name(script)
        command = [sys.executable, str(HERE / script), *SCRIPTS[script], *extra, "--json", str(out)]
        print(f"\n=== {' '.join([script, *SCRIPTS[script], *extra])}", flush=True)
        code = subprocess.run(command, check=False).returncode
        if code != 0:
            summary.failures.append(f"{script} exited with code {code}")
        elif not out.exists():
            summary.failures.append(f"{script} exited 0 but wrote no JSON")
        else:
            read_json(out, script, summary)
    return summary


def read_folder(folder: Path, only: Sequence[str] | None) -> Summary:
    """The rows of the JSON files already in ``folder``: the known scripts' first, in run order, then the rest."""
    summary = Summary()
    known = {json_name(script): script for script in SCRIPTS}
    order = list(known)
    for path in sorted(
        folder.glob("*.json"), key=lambda p: (order.index(p.name) if p.name in known else len(order), p.name)
    ):
        script = known.get(path.name, path.name)
        if only is not None and script not in only:
            continue
        read_json(path, script, summary)
    return summary


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """This script's options, and the rest, which go to every benchmark script."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Any other option (--quick, --threads N, ...) is passed on to every script.",
    )
    parser.add_argument("--only", metavar="A,B", help="run these scripts only (hooks, bench_grads, bench_edit.py, ...)")
    parser.add_argument("--from-json", type=Path, metavar="DIR", help="print the table from DIR's JSON files, run none")
    args, extra = parser.parse_known_args(argv)
    for option in REFUSED:
        if any(arg == option or arg.startswith(option + "=") for arg in extra):
            parser.error(f"{option} is set by this script per benchmark (run a script alone to use {option})")
    if args.from_json is not None and extra:
        parser.error(f"--from-json runs nothing; unexpected {' '.join(extra)}")
    if args.from_json is not None and not args.from_json.is_dir():
        parser.error(f"--from-json {args.from_json}: not a folder")
    try:
        args.only = None if args.only is None else [script_name(choice) for choice in args.only.split(",")]
    except ValueError as error:
        parser.error(str(error))
    return args, extra


def main(argv: Sequence[str] | None = None) -> int:
    """Run the scripts (or read their JSON), print the table; 1 when a script failed, else 0."""
    args, extra = parse_args(argv)
    if args.from_json is not None:
        summary = read_folder(args.from_json, args.only)
        if not summary.rows and not summary.notes and not summary.failures:
            print(f"no benchmark JSON in {args.from_json}", file=sys.stderr)
            return 1
    else:
        scripts = [script for script in SCRIPTS if args.only is None or script in args.only]
        with tempfile.TemporaryDirectory(prefix="bench-summary-") as folder:
            summary = run_scripts(scripts, extra, Path(folder))
    print(f"\n{format_summary(summary)}", flush=True)
    return 1 if summary.failures else 0


if __name__ == "__main__":
    sys.exit(main())
