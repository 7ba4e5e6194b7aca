"""docs/bench.md names every key of `redline bench --json`, the file `redline report BENCH.json` reads."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from redline.bench.result import BenchResult, BenchRow

ROOT = Path(__file__).resolve().parents[2]


def test_the_bench_page_names_every_key_of_the_json_and_no_other():
    text = " ".join((ROOT / "docs/bench.md").read_text().split())
    section = text.split("## The JSON", 1)[1].split(" ## ", 1)[0]
    result_part, row_part = section.split(" Each row has ", 1)
    words = {"naive", "explicit", "auto", "allocated", "resident"}  # values the page quotes, not keys
    machine = {"cpu", "gpu", "threads", "others_cpus", "busy"}  # the keys inside `machine`
    named_result = set(re.findall(r"`([a-z_0-9]+)`", result_part)) - machine - words
    named_row = set(re.findall(r"`([a-z_0-9]+)`", row_part)) - words
    assert named_result == {f.name for f in dataclasses.fields(BenchResult)}
    assert named_row == {f.name for f in dataclasses.fields(BenchRow)}
