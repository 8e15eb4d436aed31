"""The tables the benches print: aligned text, or Markdown for the READMEs (``--markdown``)."""

from __future__ import annotations

from typing import Sequence


def print_table(rows: Sequence[Sequence[str]], markdown: bool, left: int) -> None:
    """``rows[0]`` is the header; the first ``left`` columns are text (left-aligned), the
    others figures (right-aligned)."""
    if markdown:
        print("| " + " | ".join(rows[0]) + " |")
        print("|" + "|".join("---" if i < left else "---:" for i in range(len(rows[0]))) + "|")
        for r in rows[1:]:
            print("| " + " | ".join(r) + " |")
        return
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
