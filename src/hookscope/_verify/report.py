"""What :func:`hookscope.verify` found: one row per check, rated, and the report that holds them.

A rating answers "can I trust hookscope here?" for one feature on one model:

- ``SUPPORTED``: hookscope's values equal a reference made without it (raw hooks, autograd,
  a twin of the model run in eager attention).
- ``REFUSED``: hookscope declined, with the reason the user would see (a ``HookscopeError``), or
  the check cannot apply to this model (it has no attention module, it does not compile).
- ``SILENTLY_WRONG``: hookscope returned a value, and it differs from the reference, or a value
  the reference holds is missing: the worst outcome, the one this report exists to rule out.
- ``ERROR``: something raised that is not a stated refusal; the row holds the last line of the
  traceback.
"""

from __future__ import annotations

import html
import json
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Literal

__all__ = ["STATUSES", "Status", "VerifyReport", "VerifyRow"]

Status = Literal["SUPPORTED", "REFUSED", "SILENTLY_WRONG", "ERROR"]

#: Every status, in the order reports list them; a check made of several comparisons takes the
#: worst (SILENTLY_WRONG, then ERROR, REFUSED, SUPPORTED: a wrong value is worse than a crash).
STATUSES: tuple[Status, ...] = ("SUPPORTED", "REFUSED", "SILENTLY_WRONG", "ERROR")
_RANK = {"SUPPORTED": 0, "REFUSED": 1, "ERROR": 2, "SILENTLY_WRONG": 3}


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def worst(statuses: Sequence[Status]) -> Status:
    """The worst of ``statuses`` (SILENTLY_WRONG over ERROR over REFUSED over SUPPORTED)."""
    return max(statuses, key=_RANK.__getitem__, default="SUPPORTED")


@dataclass(frozen=True)
class VerifyRow:
    """One check of one feature on one part of the model.

    Attributes:
        check: the feature checked (``"capture outputs"``, ``"edit zero"``, ``"std names"``, ...).
        subject: what it was checked on (a module name, ``"every module"``, a canonical name).
        status: one of :data:`STATUSES`.
        detail: what was compared and what came out, or the refusal's reason, or the error's last line.
        seconds: the wall time the check took.
    """

    check: str
    subject: str
    status: Status
    detail: str
    seconds: float = 0.0


@dataclass
class VerifyReport:
    """Every row :func:`hookscope.verify` produced on one model, with what it cost.

    ``report.ok`` is True when no row is ``SILENTLY_WRONG`` or ``ERROR`` (what ``hookscope verify``
    turns into exit code 0); ``print(report)`` shows the table; ``report.to_dict()`` and
    ``report.to_json()`` give the same facts as data.

    >>> report = VerifyReport("Linear", [VerifyRow("capture outputs", "every module", "SUPPORTED", "1 value equal")])
    >>> report.ok, report.counts
    (True, {'SUPPORTED': 1, 'REFUSED': 0, 'SILENTLY_WRONG': 0, 'ERROR': 0})
    """

    #: The type of a row (``hs.VerifyReport.Row``), kept here rather than at the package root.
    Row: ClassVar[type[VerifyRow]] = VerifyRow

    model: str
    rows: list[VerifyRow] = field(default_factory=list)
    forwards: int = 0
    backwards: int = 0
    seconds: float = 0.0
    example: str = ""
    versions: dict[str, str] = field(default_factory=dict)

    def __iter__(self) -> Iterator[VerifyRow]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def ok(self) -> bool:
        """True when no row is SILENTLY_WRONG or ERROR."""
        return not any(row.status in ("SILENTLY_WRONG", "ERROR") for row in self.rows)

    @property
    def counts(self) -> dict[str, int]:
        """How many rows have each status, every status listed."""
        counted = Counter(row.status for row in self.rows)
        return {status: counted.get(status, 0) for status in STATUSES}

    def select(self, status: Status) -> list[VerifyRow]:
        """The rows with ``status``."""
        return [row for row in self.rows if row.status == status]

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data: ``model``, ``ok``, ``counts``, ``rows``, ``forwards``, ..."""
        return {
            "model": self.model,
            "example": self.example,
            "ok": self.ok,
            "counts": self.counts,
            "forwards": self.forwards,
            "backwards": self.backwards,
            "seconds": round(self.seconds, 3),
            "versions": dict(self.versions),
            "rows": [{**asdict(row), "seconds": round(row.seconds, 3)} for row in self.rows],
        }

    def to_json(self, *, indent: int | None = 2) -> str:
        """:meth:`to_dict` as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)

    def table(self) -> str:
        """The rows as a plain-text table (subjects cut at 44 characters; ``to_dict`` has them
        whole), then one line of totals."""
        header = ("status", "check", "subject", "detail")
        lines = [(row.status, row.check, _clip(row.subject, 44), row.detail) for row in self.rows]
        widths = [max(len(header[i]), *(len(line[i]) for line in lines)) if lines else len(header[i]) for i in range(3)]
        out = [f"hookscope verify: {self.model}" + (f" on {self.example}" if self.example else "")]
        out.append("  ".join(part.ljust(width) for part, width in zip(header, widths, strict=False)) + "  " + header[3])
        for line in lines:
            out.append("  ".join(part.ljust(width) for part, width in zip(line, widths, strict=False)) + "  " + line[3])
        totals = ", ".join(f"{n} {status}" for status, n in self.counts.items() if n)
        verdict = "ok" if self.ok else "NOT OK"
        out.append(
            f"{verdict}: {totals or 'no rows'}; {self.forwards} forwards, {self.backwards} backwards, "
            f"{self.seconds:.1f} s"
        )
        return "\n".join(out)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        totals = ", ".join(f"{n} {status}" for status, n in self.counts.items() if n)
        return f"<VerifyReport {self.model}: {totals or 'no rows'}>"

    def _repr_html_(self) -> str:
        colours = {"SUPPORTED": "#1a7f37", "REFUSED": "#9a6700", "SILENTLY_WRONG": "#cf222e", "ERROR": "#cf222e"}
        cells = "".join(
            f"<tr><td style='color:{colours[row.status]}'><b>{row.status}</b></td><td>{html.escape(row.check)}</td>"
            f"<td><code>{html.escape(row.subject)}</code></td><td>{html.escape(row.detail)}</td></tr>"
            for row in self.rows
        )
        totals = ", ".join(f"{n} {status}" for status, n in self.counts.items() if n)
        return (
            f"<p><b>hookscope verify</b>: {html.escape(self.model)} — {html.escape(totals)}; {self.forwards} forwards, "
            f"{self.seconds:.1f} s</p><table><tr><th>status</th><th>check</th><th>subject</th><th>detail</th></tr>"
            f"{cells}</table>"
        )
