"""A command the README or docs/ name in running text (`redline memory --measure`) has the flags it is shown with.

tests/unit/test_docs_reference.py holds the fenced synopses to the commands' parameters; a page also names
commands inline, in backticks (docs/memory.md's and docs/loadtest.md's synopses are written so), and a
flag renamed or removed there would send a reader to an error as surely.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from redline.cli.main import SUBCOMMANDS, LazyCommand

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def inline_commands(text: str) -> list[tuple[str, str]]:
    """Each ``redline COMMAND ...`` written in backticks outside the fenced blocks: (command, the span)."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    spans = re.findall(r"`([^`]+)`", " ".join(prose.split()))
    return [(match.group(1), span) for span in spans if (match := re.match(r"(?:\$ )?redline (\w+)", span))]


def flags_of(command: str) -> set[str]:
    loaded = LazyCommand(command, SUBCOMMANDS[command]).load()
    return {flag for p in loaded.params for flag in (*p.opts, *p.secondary_opts) if flag.startswith("--")}


@pytest.mark.parametrize("doc", DOCS)
def test_every_command_a_page_names_inline_exists_with_the_flags_it_is_shown_with(doc):
    for command, span in inline_commands((ROOT / doc).read_text()):
        assert command in SUBCOMMANDS, f"{doc}: `{span}`: redline has no command {command!r}"
        unknown = sorted(set(FLAG.findall(span)) - flags_of(command) - {"--help"})
        assert not unknown, f"{doc}: `{span}`: `redline {command}` has no {unknown}"


def test_the_inline_reading_finds_the_synopses_written_in_running_text():
    memory = [span for command, span in inline_commands((ROOT / "docs/memory.md").read_text()) if command == "memory"]
    assert any("--mem-gib G" in span for span in memory), "docs/memory.md's synopsis is read"
    said = inline_commands("see `redline bench --html FILE`, not\n```\nredline bench --nothing\n```\n")
    assert said == [("bench", "redline bench --html FILE")], "fenced blocks are test_docs_reference.py's"
