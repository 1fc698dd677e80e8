"""The docs are a reference: every CLI command and flag is in docs/cli.md, every page is indexed,
the front door points only inside the repository, and development history stays in git log.

The commands and flags come from the argparse parsers themselves (scripts/cli_reference.py), so a
new flag without its line in the docs fails here; `scripts/cli_reference.py` rewrites the page.
"""
from __future__ import annotations

import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
sys.path.insert(0, str(ROOT / "scripts"))

import cli_reference

# What a reference page does not carry: issue numbers, and words of a development diary.
HISTORY = re.compile(r"\bissues? [0-9]|#[0-9]{2}\b|\bsuperseded\b|\bowed\b", re.IGNORECASE)


def _sections(text: str) -> dict[str, str]:
    """'### heading' -> the text up to the next heading of any level 2 or 3."""
    parts = re.split(r"^(#{2,3} .+)$", text, flags=re.MULTILINE)
    return {parts[i].lstrip("#").strip(): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def _cases() -> list[tuple[str, str, list[str]]]:
    cases = []
    for prog, factory, _ in cli_reference.parsers():
        parser = factory()
        options = [o for a in cli_reference.flags(parser) for o in a.option_strings]
        cases.append((prog, prog, options))
        for name, sub in cli_reference.commands(parser).items():
            cases.append((prog, f"{prog} {name}",
                          [o for a in cli_reference.flags(sub) for o in a.option_strings]))
    return cases


@pytest.mark.parametrize("prog,heading,options", _cases(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_cli_command_and_flag_is_in_the_command_line_reference(prog, heading, options):
    sections = _sections((DOCS / "cli.md").read_text())
    assert heading in sections, (f"`{heading}` is not documented in docs/cli.md: run "
                                 f".venv/bin/python scripts/cli_reference.py")
    missing = [o for o in options if f"`{o}`" not in sections[heading]]
    assert not missing, (f"docs/cli.md's section `{heading}` lacks {missing}: run "
                         f".venv/bin/python scripts/cli_reference.py")


def test_a_flag_missing_from_a_section_is_caught():
    """Negative control: the check above reads the section, not the whole page."""
    sections = _sections("## a\n\n| `--x` |\n\n### a b\n\n| `--y` |\n")
    assert "`--x`" not in sections["a b"] and "`--y`" in sections["a b"]


def test_the_docs_index_links_every_page_under_docs():
    index = (DOCS / "README.md").read_text()
    linked = set(re.findall(r"\]\(([^)#]+)", index))
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.glob("*.md")} - {"README.md"}
    assert pages <= linked, f"docs/README.md does not link {sorted(pages - linked)}"
    broken = [link for link in linked if not link.startswith("http")
              and link != "benchmarks.md" and not (DOCS / link).exists()]
    assert not broken, f"docs/README.md links pages that do not exist: {broken}"


def test_the_benchmark_record_is_the_only_record_of_gpu_runs():
    """Figures live in bench/results/<device>.jsonl (docs/benchmarks.md is generated from it) and
    runs in bench/results/sessions/; no page keeps raw logs or names one."""
    assert not (DOCS / "gpu").exists(), "docs/gpu/ holds raw logs: the record replaces them"
    pages = [*DOCS.glob("*.md"), ROOT / "README.md"]
    named = [f"{p.name}:{i}" for p in pages
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"docs/gpu/|\]\(gpu/", line)]
    assert not named, f"pages name raw GPU logs the record replaced: {named}"


def test_the_front_door_points_only_inside_the_repository_and_at_the_docs_index():
    readme = (ROOT / "README.md").read_text()
    assert "../" not in readme, "README.md names a path outside the repository"
    assert "](docs/README.md)" in readme, "README.md does not link the docs index"
    for path in re.findall(r"`((?:docs|tests|bench|deploy)/[\w./-]+)`", readme):
        assert (ROOT / path.rstrip("/.")).exists(), f"README.md names {path}, which does not exist"


def test_the_front_door_defines_every_variable_it_uses_and_writes_no_alternatives_as_pipes():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```(?:sh|bash)?\n(.*?)```", readme, flags=re.DOTALL)
    text = "\n".join(blocks)
    defined = set(re.findall(r"^(?:export )?([A-Z_][A-Z0-9_]*)=", text, flags=re.MULTILINE))
    used = set(re.findall(r"\$\{?([A-Z_][A-Z0-9_]*)", text))
    assert used <= defined, f"README.md uses {sorted(used - defined)} without defining them"
    piped = [line for line in text.splitlines() if re.search(r"\s\|\s", line.split("#")[0])]
    assert not piped, f"README.md writes alternatives a shell would run as a pipe: {piped}"


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_docs_carry_no_development_history(page):
    lines = (DOCS / page).read_text().splitlines()
    found = [f"{page}:{i}: {line.strip()[:100]}" for i, line in enumerate(lines, 1)
             if HISTORY.search(line)]
    assert not found, "development history belongs in git log:\n" + "\n".join(found)
