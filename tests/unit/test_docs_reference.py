"""The reference parts of the README and docs/ agree with the code they describe.

A synopsis that names a flag the command lacks sends a user to an error; a table or synopsis that
leaves an option out hides it. Each check reads the docs as a user would and compares them with
the command's own parameters or the options' own fields.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest

from redline.cli.main import SUBCOMMANDS, LazyCommand
from redline.errors import RedlineError, TaskSpecError
from redline.runtime.options import RuntimeOptions
from redline.task import load_task

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
COMMAND_LINE = re.compile(r"^(?:\$ )?redline (\w+)\b")


def command_params(command: str) -> list[tuple[str, ...]]:
    """Each parameter of ``redline COMMAND`` as the flags that set it (``--progress``, ``--no-progress``)."""
    loaded = LazyCommand(command, SUBCOMMANDS[command]).load()
    flags = [tuple(f for f in (*p.opts, *p.secondary_opts) if f.startswith("--")) for p in loaded.params]
    return [f for f in flags if f]


def code_blocks(text: str) -> list[list[str]]:
    """The lines of each fenced block of ``text``."""
    blocks: list[list[str]] = []
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("```"):
            if current is None:
                current = []
            else:
                blocks.append(current)
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def synopses(text: str) -> dict[str, set[str]]:
    """The flags each ``redline COMMAND ...`` line of a code block names (with its indented continuation lines),
    comments left out."""
    found: dict[str, set[str]] = {}
    for block in code_blocks(text):
        command = None
        for line in block:
            match = COMMAND_LINE.match(line)
            command = match.group(1) if match else (command if line.startswith(" ") else None)
            if command in SUBCOMMANDS:
                found.setdefault(command, set()).update(re.findall(r"--[a-z][a-z0-9-]*", line.split(" #")[0]))
    return found


@pytest.mark.parametrize("doc", DOCS)
def test_every_flag_a_synopsis_names_exists(doc):
    for command, named in synopses((ROOT / doc).read_text()).items():
        known = {flag for flags in command_params(command) for flag in flags} | {"--help"}
        assert named <= known, f"{doc}: `redline {command}` has no {sorted(named - known)}"


def test_the_readme_train_synopsis_names_every_train_flag():
    named = synopses((ROOT / "README.md").read_text())["train"]
    missing = [flags[0] for flags in command_params("train") if not named & set(flags)]
    assert not missing, f"README's `redline train` synopsis leaves out {missing}"


def test_the_readme_runtime_table_lists_every_runtime_option():
    text = (ROOT / "README.md").read_text()
    table = text.split('| option | values | what "auto" does |', 1)[1].split("\n\n", 1)[0]
    listed = re.findall(r"^\| `(\w+)` \|", table, re.MULTILINE)
    fields = [f.name for f in dataclasses.fields(RuntimeOptions) if f.metadata.get("help")]  # not left_out, a note
    assert sorted(listed) == sorted(fields), "the table's options are RuntimeOptions' fields, no more and no fewer"


def test_the_readme_states_the_stop_vote_cost_the_cited_results_measured():
    results = (ROOT / "benchmarks/results/stop-vote-cpu.md").read_text()
    rows = ("every step", r"every \d+ steps")  # voting every step, and paced as the Trainer paces it
    every_step, paced = (re.search(rf"^\| {row}[^|]* \| ([\d.]+ us) \|", results, re.MULTILINE) for row in rows)
    assert every_step and paced, "the results table has a row for a vote every step and one for paced votes"
    readme = " ".join((ROOT / "README.md").read_text().split())
    cited = readme.split("`benchmarks/results/stop-vote-cpu.md`")[0][-400:]  # the sentence that cites it
    assert every_step.group(1) in cited and paced.group(1) in cited


def test_every_error_the_errors_page_lists_is_imported_from_where_it_says():
    table = (ROOT / "docs/errors.md").read_text().split("| type | import it from | raised when |", 1)[1]
    rows = re.findall(r"^\| `(\w+)` \| `([\w.]+)` \|", table.split("\n\n", 1)[0], re.MULTILINE)
    assert len(rows) >= 10, "the table names each error and its module"
    for name, module in rows:
        error = getattr(importlib.import_module(module), name, None)
        assert isinstance(error, type) and issubclass(error, RedlineError), f"`from {module} import {name}` fails"
        assert module == "redline", f"{name} is exported by redline: `except redline.{name}` is the way to catch it"


@pytest.mark.parametrize(
    ("spec", "quoted"),
    [
        ("tasks.py", "task spec 'x' has no ':'"),
        ("example:digit", "no built-in example 'y'"),
        ("missing.py:make", "file 'tasks.py' does not exist"),
        ("tasks.py:mak", "tasks.py has no callable 'mak'; defined there: make"),
    ],
)
def test_the_errors_page_quotes_the_task_spec_errors_as_they_are_said(spec, quoted, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tasks.py").write_text("import torch\n\n\ndef make():\n    pass\n")
    assert f"**`{quoted}`**" in (ROOT / "docs/errors.md").read_text()
    with pytest.raises(TaskSpecError) as raised:
        load_task(spec)
    said = re.escape(quoted).replace("'x'", "'[^']+'").replace("'y'", "'[^']+'").replace("tasks\\.py", r"\S+")
    assert re.search(said, str(raised.value)), f"{str(raised.value)!r} is not {quoted!r}"


def test_the_readme_names_the_torch_that_make_installs_and_how_to_get_its_cpu_build():
    pinned = re.search(r"^torch==([\d.]+)$", (ROOT / "constraints.txt").read_text(), re.MULTILINE)
    assert pinned, "constraints.txt pins torch"
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"`constraints.txt` ({pinned.group(1)})" in readme
    assert "https://download.pytorch.org/whl/cpu" in readme, "the CPU build: how to get it"


def test_the_readme_task_example_names_every_field_and_its_defaults():
    from redline.task import Task

    readme = (ROOT / "README.md").read_text()
    call = readme.split("task = redline.Task(", 1)[1].split("\ntask = ", 1)[0]
    named = [keyword.arg for keyword in ast.parse("Task(" + call).body[0].value.keywords]
    fields = {f.name: f.default for f in dataclasses.fields(Task)}
    assert sorted(named) == sorted(fields), "the example shows every field of Task"
    said = " ".join(readme.split())
    assert f"`batch_size` {fields['batch_size']} and `epochs` {fields['epochs']}" in said
    assert f"`name` (default `{fields['name']!r}`)".replace("'", '"') in said


def test_the_readme_gives_each_callback_hook_as_the_trainer_calls_it():
    from redline.train.callbacks import Callback

    readme = " ".join((ROOT / "README.md").read_text().split())
    hooks = [name for name in vars(Callback) if name.startswith("on_")]
    assert hooks, "Callback has hooks"
    for name in hooks:
        params = ", ".join(p for p in inspect.signature(getattr(Callback, name)).parameters if p != "self")
        assert f"`{name}({params})`" in readme, f"README gives {name}({params})"


@pytest.mark.parametrize("doc", DOCS)
def test_every_file_a_page_names_is_in_the_repository(doc):
    text = (ROOT / doc).read_text()
    named = re.findall(r"(?<![\w/.])((?:\.\./|src/|tests/|benchmarks/|docs/)[\w./-]*\w)", text)
    linked = [str(Path(doc).parent / link) for link in re.findall(r"\]\(([\w./-]+\.md)\)", text)]
    inside = [(ROOT / path).resolve() for path in [*named, *linked]]
    missing = [str(path) for path in inside if not (path.is_relative_to(ROOT) and path.exists())]
    assert not missing, f"{doc} names files a clone does not have: {missing}"


def test_no_file_of_the_project_cites_notes_that_live_outside_it():
    """A clone has the repository alone: a comment or page that points outside it points at nothing."""
    here = [
        path
        for folder in ("src", "benchmarks", "docs", "tests")
        for path in (ROOT / folder).rglob("*")
        if path.suffix in {".py", ".md", ".toml", ".sh", ".txt"} and "egg-info" not in str(path)
    ]
    here += [ROOT / "README.md", ROOT / "constraints.txt", ROOT / "pyproject.toml", ROOT / "Makefile"]
    outside = "shared/" + "reference"  # spelled apart, so this file does not name it
    citing = [str(p.relative_to(ROOT)) for p in here if outside in p.read_text(encoding="utf-8", errors="replace")]
    assert not citing, f"{citing} cite notes outside the repository"
