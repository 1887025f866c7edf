"""CSV text of records that a spreadsheet opens as data, never as formulas, and that no name can split.

Every CSV hookscope writes (``Trace.to_csv``, ``Diff.to_csv``, the command line's ``--csv``) is
made here, so two rules hold everywhere:

- a cell holding a comma, a quote, ``\\n`` or ``\\r`` is quoted (RFC 4180), so a module named
  ``"a\\rb"`` stays one cell of one row; rows end in ``\\n``;
- a text cell that starts with ``=``, ``+``, ``-``, ``@``, a tab or ``\\r`` is written with a
  single quote ``'`` before it, so a spreadsheet shows it as text instead of running it as a
  formula (a module named ``=HYPERLINK(...)``). Numbers are written as they are, ``-0.5``
  included; only text is marked.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["FORMULA_STARTS", "csv_text", "safe_cell"]

#: What a spreadsheet may read as the start of a formula (OWASP's list for CSV injection).
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def safe_cell(value: Any) -> Any:
    """``value``, or a text that starts like a formula with ``'`` put before it.

    >>> safe_cell("=1+1"), safe_cell("fc"), safe_cell(-0.5)
    ("'=1+1", 'fc', -0.5)
    """
    if isinstance(value, str) and value.startswith(FORMULA_STARTS):
        return "'" + value
    return value


def csv_text(records: Sequence[Mapping[str, Any]], *, empty_header: Sequence[str] = ("order",)) -> str:
    """The ``records`` as CSV, one row each under a header of the first record's keys.

    >>> csv_text([{"name": "=cmd", "max": -1.5}, {"name": "a\\rb", "max": 2.0}]).splitlines(keepends=True)
    ['name,max\\n', "'=cmd,-1.5\\n", '"a\\r', 'b",2.0\\n']
    """
    fields = list(records[0]) if records else list(empty_header)
    buffer = io.StringIO()
    # "\r\n" as the terminator makes the writer quote any cell holding "\r" or "\n"; each row
    # is written on its own, so its own terminator (the last two characters) is known to be it.
    writer = csv.writer(buffer, lineterminator="\r\n", quoting=csv.QUOTE_MINIMAL)
    lines = []
    rows: list[list[Any]] = [fields, *([record.get(field) for field in fields] for record in records)]
    for row in rows:
        buffer.seek(0)
        buffer.truncate()
        writer.writerow([safe_cell(value) for value in row])
        lines.append(buffer.getvalue()[:-2] + "\n")
    return "".join(lines)
