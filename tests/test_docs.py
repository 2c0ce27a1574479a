"""The README as a front door and the generated pages as current as the code (issue 52)."""

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 250
MAX_WIDTH = 200
# the generated ISA reference keeps its op table's long rows; every other page is held to the README's width
WIDTH_EXEMPT = {"ISA.md"}


def _cli_doc():
    spec = importlib.util.spec_from_file_location("cli_doc", ROOT / "scripts" / "cli_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ci_commands() -> list:
    """The commands .ci/run runs, one list of words each, without the pip flags that only quiet it."""
    commands = []
    for line in (ROOT / ".ci" / "run").read_text().splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] == ["python"]:
            commands.append([w for w in words if w not in ("--quiet", "--disable-pip-version-check")])
    return commands


def test_cli_reference_is_current():
    expected = _cli_doc().cli_reference()
    assert (ROOT / "docs" / "cli.md").read_text() == expected, "run: python scripts/cli_doc.py > docs/cli.md"


def test_cli_reference_names_every_command():
    from lpx_tvm.app.cli import build_parser

    text = _cli_doc().cli_reference(build_parser())
    for name in ("compile", "run", "profile", "compare", "disasm", "quantize", "zoo", "generate", "plan", "sweep",
                 "bench"):
        assert f"## lpx-tvm {name}\n" in text
    assert max(len(line) for line in text.splitlines()) <= MAX_WIDTH


def test_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; move the detail to docs/"
    long = [(n, len(line)) for n, line in enumerate(lines, 1) if len(line) > MAX_WIDTH]
    assert not long, f"README.md lines over {MAX_WIDTH} characters (line, length): {long}"


def test_readme_gives_the_commands_ci_runs():
    text = README.read_text()
    commands = _ci_commands()
    install = next(c for c in commands if "install" in c)
    test = next(c for c in commands if "pytest" in c)
    assert " ".join(test) == "python -m pytest -q -n 2" and "python -m pytest -q -n 2" in text
    # the README says `pip install ...`; CI says `python -m pip install ...`: the same install
    pip = shlex.join(install[install.index("pip"):])
    given = {shlex.join(shlex.split(m)) for m in re.findall(r"pip install [^&\n`]*", text)}
    assert pip in given, f"README.md does not give CI's install command: {pip}"
    assert 'pip install -e ".[test]" && python -m pytest -q -n 2' in text


@pytest.mark.parametrize("page", [README] + sorted((ROOT / "docs").glob("*.md")), ids=lambda p: p.name)
def test_links_to_pages_exist(page):
    text = page.read_text()
    targets = re.findall(r"\]\(([^)#\s]+\.(?:md|png))(?:#[^)]*)?\)", text)
    missing = [t for t in targets if not t.startswith("http") and not (page.parent / t).exists()]
    assert not missing, f"{page.name} links to missing files: {missing}"


def test_readme_links_every_docs_page_it_names():
    links = set(re.findall(r"\]\((docs/[^)#\s]+\.md)", README.read_text()))
    assert {"docs/cli.md", "docs/results.md", "docs/testing.md"} <= links
    assert all((ROOT / link).is_file() for link in links)


@pytest.mark.parametrize("page", sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in WIDTH_EXEMPT),
                         ids=lambda p: p.name)
def test_docs_lines_fit(page):
    long = [(n, len(line)) for n, line in enumerate(page.read_text().splitlines(), 1) if len(line) > MAX_WIDTH]
    assert not long, f"{page.name} lines over {MAX_WIDTH} characters (line, length): {long}"
