"""One writer for every command's result: a :class:`Report`, written as text, markdown or JSON.

A command turns the record it computed (a dict, or a list of them) into a Report: its lines and tables in the
order the text shows them, the record kept whole for JSON. :func:`write` is the only place the CLI renders a
result, so ``--format`` means the same on every command.
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, field

FORMATS = ("text", "json", "markdown")


@dataclass
class Table:
    """Rows under headers, with the lines that belong to it (no blank line between) above and below.

    Parameters
    ----------
    headers : list of str
        The column names.
    rows : list of list
        The cells, as the text shows them: a figure already formatted to its digits, or a number for
        tabulate to align.
    name : str, optional
        Its heading in markdown; text shows none.
    above, below : str, optional
        Lines printed right above and right below it (a caption, a legend).
    numparse : bool, optional
        Whether tabulate reads numbers in string cells (and aligns them); False keeps each cell's digits as
        formatted: tabulate would print ``"0.50"`` as 0.5.
    """

    headers: list
    rows: list
    name: str = ""
    above: str = ""
    below: str = ""
    numparse: bool = True

    def __str__(self) -> str:
        return _text(self)


@dataclass
class Report:
    """One command's result: what it prints, and the record behind it.

    Parameters
    ----------
    title : str
        Its heading in markdown; text shows none.
    blocks : list of str or Table
        In order; text puts a blank line between two. A string is one or more lines.
    record : object, optional
        What JSON writes: the command's figures whole (a dict or a list; numpy scalars are fine).
    notes : list of str, optional
        Lines right under the last block.
    """

    title: str
    blocks: list
    record: object = None
    notes: list = field(default_factory=list)

    def __str__(self) -> str:
        return render(self, "text")


def render(report: Report, fmt: str = "text") -> str:
    """``report`` as one string in ``fmt``, with no newline at its end.

    Parameters
    ----------
    report : Report
        What a command found.
    fmt : {"text", "json", "markdown"}
        ``text``: the tables in tabulate's github layout between the report's lines, as a terminal shows them;
        ``markdown``: the same under ``##``/``###`` headings, indented lines as a bullet list; ``json``: the
        report's record alone, through :func:`json_safe`.

    Returns
    -------
    str
    """
    if fmt == "json":
        return json.dumps(json_safe(report.record), indent=1, allow_nan=False)
    if fmt == "markdown":
        notes = _lines("\n".join(report.notes))
        parts = [f"## {report.title}", *(_markdown(block) for block in report.blocks), notes]
        return "\n\n".join(part for part in parts if part)
    if fmt != "text":
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    body = "\n\n".join(_text(block) for block in report.blocks)
    return "\n".join(([body] if body else []) + list(report.notes))


def write(report: Report, fmt: str, stream) -> None:
    """Write ``report`` to ``stream`` in ``fmt`` (see :func:`render`), ending in a newline.

    Parameters
    ----------
    report : Report
    fmt : {"text", "json", "markdown"}
    stream : file-like
        Anything with ``write`` (``sys.stdout``, an open file).
    """
    stream.write(render(report, fmt) + "\n")


BEGIN, END = "<!-- written by {command}: begin -->", "<!-- written by {command}: end -->"


def write_into(report: Report, path, command: str) -> None:
    """Write ``report`` as markdown into the page at ``path``, between the markers of ``command`` (the block
    that command wrote last time is replaced, the rest of the page kept; a page without them gets the block at
    its end, a missing page is made), under a line saying which commit, machine and day measured it, its headings
    one level down.

    Parameters
    ----------
    report : Report
    path : str or Path
        A markdown page (``docs/results.md``).
    command : str
        What wrote it, as a user would type it (``lpx-tvm bench --markdown``).
    """
    from pathlib import Path

    begin, end = BEGIN.format(command=command), END.format(command=command)
    page = Path(path).read_text() if Path(path).exists() else ""
    # a section of the page: its headings one level down (the report's "##" under the page's own "##")
    body = "\n".join("#" + line if line.startswith("##") else line for line in render(report, "markdown").split("\n"))
    block = "\n".join([begin, f"Written by `{command}` at commit {provenance()}.", "", body, end])
    if begin in page and end in page:
        head, rest = page.split(begin, 1)
        page = head + block + rest.split(end, 1)[1]
    else:
        page = (page.rstrip("\n") + "\n\n" if page else "") + block + "\n"
    Path(path).write_text(page)


def provenance() -> str:
    """``abc1234 on x86_64, <the CPU>, 2 CPUs, 2026-12-06``: the checkout's commit (or that it is none), the
    machine and the day, for a page of measured figures."""
    import datetime
    import os
    import platform
    import subprocess
    from pathlib import Path

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                                cwd=Path(__file__).resolve().parent).stdout.strip() or "none (not a git checkout)"
    except (OSError, subprocess.SubprocessError):
        commit = "none (git not found)"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{commit} on {platform.machine()}, {cpu}, {os.cpu_count()} CPUs, {datetime.date.today().isoformat()}"


def json_safe(value):
    """``value`` as plain JSON values: numpy scalars and arrays as Python numbers and lists, tuples as lists,
    and the non-finite floats as the strings ``"inf"``, ``"-inf"`` and ``"nan"`` (JSON has no such numbers;
    Python's ``json`` would write ``Infinity``, which strict parsers refuse).

    Parameters
    ----------
    value : object
        A record: dicts, lists, tuples, strings, numbers, None.

    Returns
    -------
    object
        The same record, which ``json.dumps(..., allow_nan=False)`` takes.
    """
    if isinstance(value, dict):
        return {(k.item() if hasattr(k, "item") else k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return json_safe(value.tolist())
    if isinstance(value, numbers.Number) and not isinstance(value, (bool, int, float)):
        value = float(value)  # a Fraction or a Decimal: the plan's figures are floats in the end
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def _tabulate(table: Table, escape: bool = False) -> str:
    from tabulate import tabulate

    # a "|" in a cell would end it early in a markdown table
    rows = [[c.replace("|", "\\|") if escape and isinstance(c, str) else c for c in row] for row in table.rows]
    return tabulate(rows, headers=table.headers, tablefmt="github", disable_numparse=not table.numparse)


def _text(block) -> str:
    if isinstance(block, str):
        return block
    return "\n".join(part for part in (block.above, _tabulate(block), block.below) if part)


def _markdown(block) -> str:
    if isinstance(block, str):
        return _lines(block)
    parts = [f"### {block.name}" if block.name else "", _lines(block.above),
             _tabulate(block, escape=True), _lines(block.below)]
    return "\n\n".join(part for part in parts if part)


def _lines(text: str) -> str:
    """Text lines as markdown: each its own paragraph (markdown would run them together), and a run of
    indented lines (the details of the line above) one bullet list."""
    chunks, listing = [], False
    for line in filter(str.strip, text.splitlines()):
        item = line.startswith(" ")
        if item and listing:
            chunks[-1] += f"\n- {line.strip()}"
        else:
            chunks.append(f"- {line.strip()}" if item else line)
        listing = item
    return "\n\n".join(chunks)
