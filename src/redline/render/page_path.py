"""Where a page may be written: a file of its own or an earlier page, never a file it would destroy."""

from __future__ import annotations

import os
from pathlib import Path

from redline.errors import ConfigError

MADE_BY = "Made by redline"  # how every page's footer starts (render/page.py): what tells a page redline made
TAIL_BYTES = 64 * 1024  # the footer ends a page; a run's names its directory, a path of up to 4 KiB


def page_target(path: str | os.PathLike[str] | None, default: Path, sources: list[Path]) -> Path:
    """Where the page goes: ``path`` (else ``default``), refused where it is a directory or a file the report was
    made from. A refusal of ``default`` says so: no --html was given to blame."""
    target = default if path is None else Path(path)
    told = f"--html {str(target)!r}" if path is not None else f"the page's default path {str(target)!r}"
    if target.is_dir():  # writing there said "(Is a directory)", and named no file to pass
        fix = "name a file" if path is not None else "pass --html FILE"
        raise ConfigError(f"{told} is a directory\nhint: {fix}, e.g. --html {target / default.name}")
    if target.is_file() and any(source.is_file() and source.samefile(target) for source in sources):
        other = default if path is not None else target.with_name(f"{target.stem}-report.html")
        fix = "name another file" if path is not None else "pass --html FILE"
        raise ConfigError(
            f"{told} is a file the report is made from: the page would replace it\nhint: {fix}, e.g. --html {other}"
        )
    refuse_replacing(target, example=default.name, told=told)
    return target


def refuse_replacing(target: Path, *, example: str = "bench.html", told: str = "", flag: str = "--html ") -> None:
    """Refuse a page's ``target`` that is a file of another kind (a run's model.safetensors, say) or a page redline
    did not make (one written by hand): a page there would replace what it holds. An earlier page of redline's is
    replaced, as a new report should. ``-`` is refused: read as standard output by many tools, it would be a file
    named "-". ``told`` names the target in the error (default: as --html gave it); ``flag`` comes before a path the
    hint gives ("" for a Python caller's)."""
    told = told or f"--html {str(target)!r}"
    if str(target) == "-":
        stdout = "; `redline bench --json` prints the results to standard output" if example == "bench.html" else ""
        raise ConfigError(
            "--html '-' would write a file named '-': the page is written to a file, with its plots inside\nhint: name "
            f"a .html file, e.g. --html {example}{stdout}"
        )
    if not target.is_file():
        return
    if target.suffix.lower() not in (".html", ".htm"):
        raise ConfigError(
            f"{told} is a file that is no page (not .html): the page would replace what it holds\n"
            f"hint: name a .html file, e.g. {flag}{target.with_suffix('.html')}"
        )
    if not made_by_redline(target):
        raise ConfigError(
            f"{told} is a page redline did not make: the report would replace what it holds\n"
            f"hint: name another file, e.g. {flag}{target.with_name(f'{target.stem}-report.html')}, "
            f"or delete {str(target)!r} first"
        )


def made_by_redline(path: Path) -> bool:
    """Whether the file ``path`` is a page redline wrote (its footer says so), or empty: either is replaced freely."""
    try:
        with path.open("rb") as file:
            size = file.seek(0, os.SEEK_END)
            file.seek(max(0, size - TAIL_BYTES))
            tail = file.read()
    except OSError:  # unreadable: what it holds is unknown, so it is kept
        return False
    return size == 0 or f"<footer>{MADE_BY} ".encode() in tail
