"""The profile's operators table in a narrow terminal: an operator's name whole, never cut to "…"."""

from rich.console import Console

from redline.render.console import print_uncut
from redline.render.profile import ops_table


def test_a_narrow_terminal_cuts_no_operator_name():
    """Before, at 60 columns `aten::convolution_backward` read `aten::convolution_backw…`."""
    names = ["aten::convolution_backward", "aten::max_pool2d_with_indices", "aten::addmm"]
    ops = [{"name": name, "self_ms": 1.5, "calls": 2.0, "share": 0.25} for name in names]
    for width in (40, 60):
        console = Console(width=width, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
        print_uncut(console, ops_table({"breakdown": {"device_busy": None}, "ops_on": "host", "ops": ops}))
        text = console.export_text()
        assert "…" not in text, text
        assert [line.split()[0] for line in text.splitlines() if "1.500" in line] == names
