"""The report's building blocks: a table as data, the number formats, and the one renderer of both.

A section's report is a list of blocks: a ``str`` is one line of markdown (``""`` a blank line), a
:class:`Table` its header, separator and rows. :func:`render` turns any such list into markdown.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Table", "gb", "pct", "render"]


@dataclass
class Table:
    """A markdown table: ``columns`` (the header) and ``rows`` of cells; a ``None`` cell is left blank."""

    columns: list[str]
    rows: list[list[str | None]] = field(default_factory=list)

    def add(self, *cells: str | None) -> None:
        self.rows.append(list(cells))

    def lines(self) -> list[str]:
        header = "| " + " | ".join(self.columns) + " |"
        body = ["|" + "".join(" |" if cell is None else f" {cell} |" for cell in row) for row in self.rows]
        return [header, "|" + "---|" * len(self.columns), *body]


def render(blocks: list[str | Table]) -> str:
    """Markdown of ``blocks``: lines as they are, tables as their lines."""
    lines: list[str] = []
    for block in blocks:
        lines.extend(block.lines() if isinstance(block, Table) else [block])
    return "\n".join(lines)


def gb(n: float) -> str:
    """Bytes in GiB from a quarter GiB up, MiB below."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def pct(x: float | None) -> str:
    """A fraction as a percentage, ``-`` for none."""
    return "-" if x is None else f"{100 * x:.1f}%"
