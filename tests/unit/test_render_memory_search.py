"""The batch-size search's table: each size in order, the answer and its notes."""

from rich.console import Console

from redline.memory.search import BatchSearch
from redline.render.memory_search import batch_search_table


def test_the_table_lists_the_sizes_in_order_and_the_answer_with_its_notes():
    oom = "rank 1: OutOfMemoryError: CUDA out of memory [pool]"
    search = BatchSearch(
        largest=9, tried=((8, True, ""), (16, False, oom), (9, True, "")), device="cuda:0", precision="bf16-mixed",
        precision_reason="measured: bf16-mixed ran 1.40x fp32", seconds=1.5, reason="9 fits; 10 ran out of memory",
        cap=None, steps=2, world_size=2,
        notes=("compile off: it changes memory",),
    )  # fmt: skip
    console = Console(record=True, width=200)
    console.print(batch_search_table(search.to_dict()))
    text = console.export_text()
    assert "on cuda:0 (bf16-mixed on each of 2 processes), 2 training steps per size" in " ".join(text.split())
    rows = [[cell.strip() for cell in line.split("│")[1:3]] for line in text.splitlines() if line.startswith("│")]
    assert rows == [["8", "yes"], ["16", "no"], ["9", "yes"]]
    assert oom in text  # the error's brackets are not taken for markup
    assert "largest batch: 9 fits; 10 ran out of memory" in text and "- compile off: it changes memory" in text
    assert "precision bf16-mixed: measured: bf16-mixed ran 1.40x fp32" in text  # why the search ran in it


def test_a_narrow_table_keeps_its_title_and_answer_on_one_line_each():
    search = BatchSearch(
        largest=1438, tried=((1024, True, ""), (1438, True, "")), device="cpu", precision="fp32",
        precision_reason="requested", seconds=9.0,
        reason="1438 fits: the cap (max_batch_size=1438) stopped the search", cap=1438, steps=2,
        notes=("max_batch_size defaults to the dataset's size (1438) on a CPU, whose out-of-memory kills the process",),
    )  # fmt: skip
    console = Console(record=True, width=200)
    console.print(batch_search_table(search.to_dict()))
    lines = [line.strip() for line in console.export_text().splitlines()]
    assert "Batch-size search on cpu (fp32), 2 training steps per size" in lines
    assert "largest batch: 1438 fits: the cap (max_batch_size=1438) stopped the search" in lines
    assert f"- {search.notes[0]}" in lines
