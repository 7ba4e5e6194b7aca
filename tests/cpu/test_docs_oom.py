"""docs/oom.md describes what micro_batch="auto" does at one sample, in the words the run itself uses.

A model that fits only with activation checkpointing runs out of memory at every size; the page must
say that "auto" then turns checkpointing on and redoes the batch whole, quoting the warning, the event
and the Plan's reason as the Runtime gives them.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import sys
from pathlib import Path

import torch
from torch import nn

import redline

sys.path.insert(0, str(Path(__file__).parent))
from oom_models import RecomputeLimit, make_data

ROOT = Path(__file__).resolve().parents[2]


def one_line(text: str) -> str:
    return " ".join(text.split())


def test_the_oom_page_says_what_auto_does_at_one_sample(caplog):
    data = make_data(16)
    with caplog.at_level(logging.WARNING, logger="redline"), redline.Runtime(devices="cpu", micro_batch="auto") as rt:
        model, optimizer = rt.setup(RecomputeLimit(), lambda params: torch.optim.SGD(params, lr=0.1))
        rt.train_step(lambda batch: nn.functional.cross_entropy(model(batch[0]), batch[1]), data[:])
        rt.step(optimizer)
    page = one_line((ROOT / "docs/oom.md").read_text())

    last = rt.oom_events[-1]
    assert last.checkpointing and "`checkpointing=True`" in page
    shown = re.search(r"# \[OomEvent\((.*?)\)\]", page)
    assert shown, "the example prints an event"
    fields = [field.split("=")[0] for field in shown.group(1).split(", ")]
    assert fields == [field.name for field in dataclasses.fields(last)], "the example's event has every field"

    warning = caplog.records[-1].getMessage()
    said = re.sub(r"\(step \d+, in \w+\): ", "", warning.split(" (the repeated")[0])  # the step varies
    assert said.startswith("out of memory with micro-batches of 1 sample turned activation checkpointing on")
    assert "`turned activation checkpointing on ... and redoing the batch whole`" in page

    reason = rt.explain().activation_checkpointing.reason
    tail = re.sub(r"step \d+", "step N", "auto: " + reason.rsplit("auto: ", 1)[1])  # what "auto" itself said
    assert f"`{tail}`" in page, f"the page quotes the Plan's reason: {tail!r}"


def test_the_readme_says_auto_turns_checkpointing_on_where_one_sample_does_not_fit():
    readme = one_line((ROOT / "README.md").read_text())
    bullet = readme.split("**Out of memory without losing a step.**", 1)[1].split("- **", 1)[0]
    assert "even one sample does not fit, it turns activation checkpointing on" in bullet
