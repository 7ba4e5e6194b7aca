"""The terminal's key-value and Plan tables show their text as written: a result's text is not rich markup."""

from rich.console import Console

from redline.plan import Choice
from redline.render.console import key_value_table, plan_table


def shown(table) -> str:
    console = Console(width=300, record=True)
    console.print(table)
    return console.export_text()


def test_figures_and_reasons_with_brackets_print_verbatim():
    path = "runs/[bold]/checkpoints/step-00000002 [/tmp]"
    assert path in shown(key_value_table([("checkpoint", path)], title="Trained [x]"))
    reason = "recompiled: tensor shapes [int] changed; see [/docs]"
    assert reason in shown(plan_table({"compile": Choice(True, reason)}, title="Serving [model]"))
