"""The one writer (lpx_tvm.app.output): a Report as text, markdown and JSON, and --format on a command."""

import io
import json

import numpy as np
import onnx
import pytest

from conftest import mlp_model
from lpx_tvm.app.cli import main
from lpx_tvm.app.output import Report, Table, json_safe, render, write


def _report() -> Report:
    """A line with two details, a table with a caption and a legend (its digits kept as formatted, one cell
    with a pipe), a note, and a record of numpy values and the non-finite."""
    return Report("Two chips", ["llama on tiny-2: a pipeline\n  2 stages\n  1.5 µs a token",
                                Table(["chip", "cycles", "% peak"], [[0, 1577, "17.40"], [1, "3|710", "10.00"]],
                                      name="chips", above="tiny-2: 2 stages", below="(decode cycles)",
                                      numparse=False)],
                  record={"cycles": np.int64(3710), "share": np.float32(0.5), "chips": (0, 1), "error": float("nan"),
                          "bound": float("inf"), "agree": np.bool_(True), "logits": np.arange(3, dtype=np.float32)},
                  notes=["every token equal to ONNX Runtime"])


def test_text_is_the_lines_and_tables_a_blank_line_apart_with_captions_and_notes_attached():
    assert render(_report(), "text") == str(_report()) == """\
llama on tiny-2: a pipeline
  2 stages
  1.5 µs a token

tiny-2: 2 stages
| chip   | cycles   | % peak   |
|--------|----------|----------|
| 0      | 1577     | 17.40    |
| 1      | 3|710    | 10.00    |
(decode cycles)
every token equal to ONNX Runtime"""


def test_markdown_puts_headings_on_the_report_and_table_and_details_in_a_list():
    assert render(_report(), "markdown") == """\
## Two chips

llama on tiny-2: a pipeline

- 2 stages
- 1.5 µs a token

### chips

tiny-2: 2 stages

| chip   | cycles   | % peak   |
|--------|----------|----------|
| 0      | 1577     | 17.40    |
| 1      | 3\\|710   | 10.00    |

(decode cycles)

every token equal to ONNX Runtime"""


def test_json_is_the_record_alone_with_numpy_values_as_plain_ones_and_the_non_finite_as_strings():
    text = render(_report(), "json")
    assert text == """\
{
 "cycles": 3710,
 "share": 0.5,
 "chips": [
  0,
  1
 ],
 "error": "nan",
 "bound": "inf",
 "agree": true,
 "logits": [
  0.0,
  1.0,
  2.0
 ]
}"""
    assert json.loads(text) == {"cycles": 3710, "share": 0.5, "chips": [0, 1], "error": "nan", "bound": "inf",
                                "agree": True, "logits": [0.0, 1.0, 2.0]}
    assert json_safe({np.int64(2): [float("-inf"), (np.float64(1.5),)]}) == {2: ["-inf", [1.5]]}


def test_write_ends_in_a_newline_and_an_unknown_format_is_refused():
    out = io.StringIO()
    write(_report(), "json", out)
    assert out.getvalue() == render(_report(), "json") + "\n"
    with pytest.raises(ValueError, match="text, json, markdown"):
        render(_report(), "yaml")


def test_profile_prints_in_each_format_the_same_figures(tmp_path, capsys):
    """One compiled model, three formats: the JSON on stdout parses, is what --json PATH wrote, and carries the
    cycles and offload the text shows; the markdown is the text's tables under headings."""
    path = tmp_path / "mlp.onnx"
    onnx.save(mlp_model(), path)
    assert main(["profile", str(path), "--config", "tiny", "--json", str(tmp_path / "p.json")]) == 0
    text = capsys.readouterr().out
    assert main(["profile", str(path), "--config", "tiny", "--format", "json"]) == 0
    out = capsys.readouterr()
    record = json.loads(out.out)
    assert record == json.loads((tmp_path / "p.json").read_text()) and out.err == ""
    assert (f"total (fp32 on tiny): {record['simulated_cycles']} cycles (predicted {record['predicted_cycles']}) = "
            f"{record['microseconds']:.1f} µs") in text
    assert f"{record['offload']['lpx_functions']} lpx subgraph(s), {record['offload']['offloaded_pct']:.2f}%" in text
    assert text.rstrip().endswith(f"wrote {tmp_path / 'p.json'}")
    assert main(["profile", str(path), "--config", "tiny", "--format", "markdown"]) == 0
    markdown = capsys.readouterr().out
    assert markdown.startswith("## Profile (fp32 on tiny)\n\n### layers\n\n| layer (ONNX tensor)")
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert "\n".join(table) in markdown


def test_a_page_gets_the_block_between_its_markers_and_keeps_the_rest(tmp_path, monkeypatch):
    """``bench --markdown docs/results.md``: the block it wrote last time is replaced, the page around it kept;
    a page without the markers gets it at its end; the block says which commit, machine and day."""
    from lpx_tvm.app import output

    monkeypatch.setattr(output, "provenance", lambda: "abc1234 on x86_64, a CPU, 2 CPUs, 2026-12-06")
    report = output.Report("Speed", [output.Table(["model", "cycles"], [["m", 12]], name="Schedule")])
    page = tmp_path / "results.md"
    page.write_text("# Measured figures\n\nprose before\n")
    output.write_into(report, page, "lpx-tvm bench --markdown")
    block = ("<!-- written by lpx-tvm bench --markdown: begin -->\n"
             "Written by `lpx-tvm bench --markdown` at commit abc1234 on x86_64, a CPU, 2 CPUs, 2026-12-06.\n\n"
             "### Speed\n\n#### Schedule\n\n| model   |   cycles |\n|---------|----------|\n| m       |       12 |\n"
             "<!-- written by lpx-tvm bench --markdown: end -->")
    assert page.read_text() == f"# Measured figures\n\nprose before\n\n{block}\n"
    page.write_text(page.read_text() + "\n## Kept after\n")
    report.blocks[0].rows[0][1] = 13
    output.write_into(report, page, "lpx-tvm bench --markdown")
    assert page.read_text() == ("# Measured figures\n\nprose before\n\n" + block.replace("|       12 |", "|       13 |")
                                + "\n\n## Kept after\n")


def test_provenance_names_this_checkouts_commit():
    import subprocess
    from pathlib import Path

    from lpx_tvm.app.output import provenance

    root = Path(__file__).resolve().parents[1]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=root).stdout.strip() or "none (not a git checkout)"
    assert provenance().startswith(f"{commit} on ")
