"""The terminal's key-value and Plan tables show their text as written: a result's text is not rich markup."""

from rich.console import Console

from redline.plan import Choice
from redline.render.console import (
    READABLE_WIDTH,
    UNBOUNDED_WIDTH,
    key_value_table,
    output_console,
    plan_table,
    print_uncut,
)


def shown(table) -> str:
    console = Console(width=300, record=True)
    console.print(table)
    return console.export_text()


def test_figures_and_reasons_with_brackets_print_verbatim():
    path = "runs/[bold]/checkpoints/step-00000002 [/tmp]"
    assert path in shown(key_value_table([("checkpoint", path)], title="Trained [x]"))
    reason = "recompiled: tensor shapes [int] changed; see [/docs]"
    assert reason in shown(plan_table({"compile": Choice(True, reason)}, title="Serving [model]"))


def test_in_a_file_or_pipe_a_plan_wraps_its_reasons_at_a_readable_width(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    reason = "auto: " + "a reason long enough to wrap " * 8  # 238 characters
    plan = {"precision": Choice("fp32", reason), "compile": Choice(False, "auto: short")}
    console = output_console()  # stdout is captured here: not a terminal
    assert console.width == UNBOUNDED_WIDTH
    with console.capture() as captured:
        print_uncut(console, plan_table(plan))
    lines = captured.get().splitlines()
    assert max(len(line.rstrip()) for line in lines) <= READABLE_WIDTH, lines
    assert " ".join(reason.split()) in " ".join(" ".join(line.strip("│ ") for line in lines).split())


def test_a_terminal_keeps_its_own_width_for_a_plan():
    reason = "auto: " + "a reason long enough to wrap " * 8
    console = Console(width=160, record=True, force_terminal=True)
    print_uncut(console, plan_table({"precision": Choice("fp32", reason)}))
    widths = [len(line.rstrip()) for line in console.export_text().splitlines()]
    assert READABLE_WIDTH < max(widths) <= 160


def test_in_a_narrow_terminal_the_reasons_keep_a_fair_share_of_the_width():
    """Before, at 50 columns the value took what the terminal left, and the reasons ran one letter a line."""
    plan = {
        "activation_checkpointing": Choice(False, "auto: memory suffices without recomputing"),
        "loader": Choice("2 workers, pinned, prefetch 4", "auto: " + "a reason long enough to wrap " * 3),
    }
    for width in (50, 60, 80):
        console = Console(width=width, record=True, force_terminal=True)
        print_uncut(console, plan_table(plan))
        lines = console.export_text().splitlines()
        assert max(len(line.rstrip()) for line in lines) <= width, lines
        value, why = next(line for line in lines if "value" in line).split("┃")[2:4]
        assert abs(len(value) - len(why)) <= 1, lines  # each wants more than the terminal leaves: halves
        assert "a reason long enough to wrap" in " ".join(" ".join(line.split("│")[3] for line in lines[4:-1]).split())


def loader_plan() -> dict:
    return {
        "activation_checkpointing": Choice(False, "auto: memory suffices without recomputing"),
        "loader": Choice("workers=0 pin_memory=off gather=on", "kept: " + "a reason long enough to wrap " * 3),
    }


def test_a_terminal_narrower_than_the_plan_cuts_no_value_and_no_header():
    """Before, at 60 columns a value read `pin_memory=o…`; at 40 the header read `va…`."""
    for width in (30, 40, 60):
        console = Console(width=width, record=True, force_terminal=True)
        print_uncut(console, plan_table(loader_plan()))
        text = console.export_text()
        assert "…" not in text, text
        assert "pin_memory=off" in text and "value" in text and "activation_checkpointing" in text
        header = next(line for line in text.splitlines() if "value" in line)
        assert len(header.split("┃")[3]) >= 10, text  # "why" folds eight letters a line (and its padding), not one


def test_a_word_longer_than_the_value_column_widens_it_in_a_wide_terminal():
    """The value column wraps at 24 characters; a longer word was cut there even with 200 columns to spare."""
    console = Console(width=200, record=True, force_terminal=True)
    print_uncut(console, plan_table({"compile": Choice("max-autotune-no-cudagraphs", "asked for")}))
    text = console.export_text()
    assert "max-autotune-no-cudagraphs" in text and "…" not in text, text
