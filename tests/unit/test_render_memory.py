"""`redline memory`'s tables: the step's parts, its largest modules and each way to fit, read whole."""

from dataclasses import replace

from rich.console import Console

from redline.memory.estimate import MemoryEstimate
from redline.memory.fit import Fit, MemoryFit
from redline.render.memory import memory_tables


def digits_on_a_cpu(buffers: int = 0) -> MemoryFit:
    estimate = MemoryEstimate(
        batch_size=64, precision="fp32", target="cpu", strategy="single", world_size=1, activation_checkpointing=False,
        params=116_224, buffers=buffers, gradients=40_960, optimizer_state=232_550, activations=3_670_016, workspace=0,
        peak=4_059_750 + buffers, top_modules=(("features", 2_306_867), ("features.2", 1_048_576)),
    )  # fmt: skip
    row = Fit(label="as it stands", estimate=estimate, available=24_000_000_000, largest_batch=416_814)
    return MemoryFit(task="digits", device="this machine's CPU", mem_gib=23.5, target="cpu", rows=(row,))


def text_of(result: MemoryFit) -> list[str]:
    console = Console(record=True, width=200)
    for table in memory_tables(result):
        console.print(table)
    return [line.strip() for line in console.export_text().splitlines()]


def test_each_title_reads_on_one_line_however_narrow_its_table():
    lines = text_of(digits_on_a_cpu())
    assert "digits: one training step at batch 64, fp32" in lines
    assert "modules holding the most activations" in lines
    assert "on this machine's CPU (23.5 GiB, 22.35 GiB for tensors)" in lines


def test_buffers_get_a_row_only_when_the_model_has_some():
    assert not any("buffers" in line for line in text_of(digits_on_a_cpu()))
    assert any(line.startswith("│ buffers") and "976.6 KiB" in line for line in text_of(digits_on_a_cpu(1_000_000)))


def test_a_largest_batch_at_the_training_set_s_size_says_so():
    result = digits_on_a_cpu()
    capped = replace(result.rows[0], largest_batch=1438, cap=1438)
    assert any("│ 1438 (all of train_data) │" in line for line in text_of(replace(result, rows=(capped,))))
    assert any(line.endswith(" 416814 │") for line in text_of(result))
    # over 8 ranks the cap is the data's size rounded down to a multiple of 8: not all of it
    sharded = replace(capped, largest_batch=1432, cap=1432, estimate=replace(capped.estimate, world_size=8))
    assert any(
        "│ 1432 (train_data's most 8 ranks share evenly) │" in line
        for line in text_of(replace(result, rows=(sharded,)))
    )
    # a step of 2 micro-batches takes the whole set at half of it each
    halves = replace(capped, largest_batch=719, cap=719, estimate=replace(capped.estimate, grad_accum=2))
    said = text_of(replace(result, rows=(halves,)))
    assert any("│ 719 (all of train_data in 2 micro-batches) │" in line for line in said)


def test_a_size_the_device_name_holds_is_not_said_twice():
    sized = replace(digits_on_a_cpu(), device="a 23.5 GiB GPU")  # as --mem-gib 23.5 names it
    assert "on a 23.5 GiB GPU (22.35 GiB for tensors)" in text_of(sized)


def test_the_device_s_memory_reads_as_a_plain_number_and_once():
    big = replace(digits_on_a_cpu(), mem_gib=1536.0)  # a host with 1.5 TB of memory
    assert "on this machine's CPU (1536 GiB, 22.35 GiB for tensors)" in text_of(big)
    assert "on this machine's CPU (23.54 GiB, 22.35 GiB for tensors)" in text_of(replace(big, mem_gib=23.5401))
    for typed in (23.54, 1000.0, 2048.5, 1536.123456, 1048576.0):  # --mem-gib names the GPU with the figure as typed
        named = replace(digits_on_a_cpu(), mem_gib=typed, device=f"a {typed:.10g} GiB GPU")
        assert f"on a {typed:.10g} GiB GPU (22.35 GiB for tensors)" in text_of(named)
