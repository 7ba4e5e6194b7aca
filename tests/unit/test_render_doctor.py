"""The doctor's devices table: figures whole on one line, AMD GPUs named by their target."""

from pathlib import Path

from rich.console import Console

from redline.doctor import check_machine
from redline.render.console import print_uncut
from redline.render.doctor import checks_table, devices_table

FIXTURES = Path(__file__).parent.parent / "fixtures" / "doctor"


def shown(fixture: str, width: int) -> str:
    console = Console(width=width, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    print_uncut(console, devices_table(check_machine(probe_file=FIXTURES / fixture)))
    return console.export_text()


def test_the_figures_of_a_gpu_are_never_cut_or_wrapped():
    for width in (100, 120, 200):
        text = shown("healthy-h200.json", width)
        assert "pageable 5.64 GB/s, pinned 54.4 GB/s" in text  # was squeezed to "pa… 5.… GB…" over six lines
        assert "fp32 50.3 TFLOP/s, bf16 703 TFLOP/s" in text
        assert "…" not in text


def test_an_amd_gpu_is_named_by_its_target_not_a_cuda_capability():
    text = shown("healthy-mi300x8.json", 160)
    assert "AMD Instinct MI300X (gfx942)" in text and "(sm 9.4)" not in text
    report = check_machine(probe_file=FIXTURES / "healthy-mi300x8.json")
    assert report.to_dict()["devices"][1]["arch"] == "gfx942"
    assert check_machine(probe_file=FIXTURES / "healthy-h200.json").to_dict()["devices"][1]["arch"] is None


def test_a_narrow_terminal_cuts_no_word_of_a_check_or_its_fix():
    """Before, at 40 columns the detail read `CP…` `3.…` and the header `de…`."""
    report = check_machine(probe_file=FIXTURES / "driver-too-old.json")
    for width in (40, 60):
        console = Console(width=width, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
        print_uncut(console, checks_table(report))
        shown_words = set(console.export_text().split())
        for check in report.checks:
            words = f"{check.id} {check.status} {check.detail} fix: {check.fix or ''} detail and fix".split()
            assert set(words) <= shown_words, (width, check.id, set(words) - shown_words)
