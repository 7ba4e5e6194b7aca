"""`redline memory`'s flags: one that nothing would read is refused by its name, before the task is loaded."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import redline.cli.memory as memory_cli
from redline.cli.main import app
from redline.errors import ConfigError
from redline.hardware.device import Accelerators
from redline.memory.fit import MemoryFit

# A spec that cannot load: a refusal that comes first never meets it.
UNLOADABLE = ["--task", "no/such/file.py:task"]


def refusal(*args: str) -> str:
    result = CliRunner().invoke(app, ["memory", *UNLOADABLE, *args])
    assert isinstance(result.exception, ConfigError), result.output  # main() exits 2 with it
    return str(result.exception)


def test_gpus_with_measure_is_refused_not_ignored() -> None:
    message = refusal("--measure", "--gpus", "4")
    assert message.startswith("--gpus 4 sizes the FSDP rows of an estimate; --measure runs on this machine's device")
    assert "\nhint: drop --gpus" in message


def test_gpus_without_a_gpu_to_weigh_against_is_refused_not_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory_cli, "probe_accelerators", lambda: Accelerators(cuda_count=0))
    message = refusal("--gpus", "4")
    assert message.startswith("--gpus 4 sizes the FSDP rows of a GPU's estimate, but this machine has no GPU")
    assert "\nhint: name the GPU with --gpu NAME or --mem-gib G, or drop --gpus" in message


@pytest.mark.parametrize("where", [["--gpu", "l4"], ["--mem-gib", "24"]])
def test_gpus_with_a_gpu_named_goes_on_to_load_the_task(where: list[str]) -> None:
    result = CliRunner().invoke(app, ["memory", *UNLOADABLE, *where, "--gpus", "4"])
    assert "no/such/file.py" in str(result.exception)  # past the flags, stopped by the spec


def test_a_catalog_gpu_is_weighed_at_what_torch_reads_on_it_and_the_result_says_so(monkeypatch) -> None:
    # An L4 was weighed at its datasheet's 24 GiB, where torch reads 22.03 (ECC and the driver keep the rest): the
    # largest batch of a chargpt came out 279 where 22.03 GiB holds 255.
    def weighed(task, *, device, mem_gib, target, **rest):
        return MemoryFit(task=task.name, device=device, mem_gib=mem_gib, target=target, rows=(), notes=("its own",))

    monkeypatch.setattr(memory_cli, "fit_memory", weighed)
    result = CliRunner().invoke(app, ["memory", "--task", "example:digits", "--gpu", "l4", "--json"])
    assert result.exit_code == 0, result.output
    found = json.loads(result.stdout)
    assert found["device"] == "NVIDIA L4" and found["mem_gib"] == 22.03
    assert found["notes"] == [
        "NVIDIA L4 is weighed against the 22.03 GiB torch reports on one (total_memory), not the 24 GB it is sold "
        "with: ECC and the driver keep the rest",
        "its own",
    ]
    result = CliRunner().invoke(app, ["memory", "--task", "example:digits", "--mem-gib", "24", "--json"])
    assert json.loads(result.stdout)["notes"] == ["its own"]  # a size given is the size weighed: nothing to tell


@pytest.mark.parametrize("size", ["1e308", "2e6", "inf", "0", "-24"])
def test_a_memory_size_no_device_has_is_refused_by_its_flag(size: str) -> None:
    message = refusal("--mem-gib", size)  # 1e308 GiB is more bytes than a float holds: it crashed the fit
    assert (
        message.startswith("--mem-gib=")
        and "expected a finite positive number of GiB, at most 1048576 (1 PiB)" in message
    )


def test_a_cpu_estimate_weighs_against_the_container_s_limit_not_the_host_s_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a container given 8 GiB on a host of hundreds: past 8 GiB the kernel kills the run
    monkeypatch.setattr(memory_cli, "probe_accelerators", lambda: Accelerators(cuda_count=0))
    monkeypatch.setattr(memory_cli, "memory_limit_bytes", lambda: 8 * 2**30)
    name, facts, mem_gib, _ = memory_cli._device(None, None)
    assert mem_gib == 8 and facts.type == "cpu" and name == "this machine's CPU, under its cgroup's memory limit"
    monkeypatch.setattr(memory_cli, "memory_limit_bytes", lambda: None)
    name, _, mem_gib, _ = memory_cli._device(None, None)
    assert name == "this machine's CPU" and mem_gib > 0


def test_a_cpu_estimate_says_and_weighs_what_is_free_now_of_the_machine_s_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(memory_cli, "probe_accelerators", lambda: Accelerators(cuda_count=0))
    monkeypatch.setattr(memory_cli, "memory_limit_bytes", lambda: None)
    monkeypatch.setattr(memory_cli, "machine_memory_bytes", lambda: 32 * 2**30)
    monkeypatch.setattr(memory_cli, "free_bytes", lambda: 20 * 2**30)  # other processes hold the rest
    args = ["memory", "--task", "example:digits", "--precision", "fp32"]
    found = json.loads(CliRunner().invoke(app, [*args, "--json"]).stdout)
    assert found["mem_gib"] == 32 and found["free_gib"] == 20
    assert {row["available"] for row in found["rows"]} == {int(20 * 2**30 * 0.95)}
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert "on this machine's CPU (20 GiB available now, of 32 GiB; 19.00 GiB for tensors)" in result.stdout


def test_a_ctrl_c_while_the_model_is_traced_says_what_it_stopped(monkeypatch):
    # It exited 130 with nothing after the "tracing ..." line.
    from redline.errors import StoppedBySignal

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(memory_cli, "fit_memory", interrupted)
    result = CliRunner().invoke(app, ["memory", "--task", "example:digits", "--gpu", "h100-sxm"])
    assert isinstance(result.exception, StoppedBySignal), result.output
    assert str(result.exception) == "stopped by Ctrl-C while tracing the model: nothing was estimated"
    assert result.exception.exit_code == 130


def test_the_text_prints_the_notes_of_every_row_naming_the_rows_not_all_carry(capsys, monkeypatch) -> None:
    # Only the first row's notes were printed: FSDP's "each rank is weighed with 6 samples" was lost but in --json.
    from dataclasses import replace

    from redline.memory.estimate import MemoryEstimate
    from redline.memory.fit import Fit

    estimate = MemoryEstimate(
        batch_size=16, precision="fp32", target="cuda", strategy="single", world_size=1, activation_checkpointing=False,
        params=1, buffers=0, gradients=1, optimizer_state=2, activations=8, workspace=0, peak=12, top_modules=(),
        notes=("eager model",),
    )  # fmt: skip
    split = "batch 16 over 3 ranks: each rank is weighed with 6 samples (18 in all), its share rounded up"
    sharded = replace(estimate, strategy="fsdp", world_size=3, notes=("eager model", "fsdp modelled", split))
    rows = [
        Fit(label="as it stands", estimate=estimate, available=10**9, largest_batch=256),
        Fit(label="FSDP over 3 GPUs", estimate=sharded, available=10**9, largest_batch=255),
        Fit(label="FSDP over 3 GPUs, checkpointing", estimate=replace(sharded, notes=(split,)), available=10**9,
            largest_batch=255),
    ]  # fmt: skip
    result = MemoryFit(task="mlp", device="L4", mem_gib=24, target="cuda", rows=tuple(rows), notes=("the fit's",))
    monkeypatch.setenv("COLUMNS", "1000")  # a line a narrower console would wrap
    memory_cli._print(result, json_output=False)
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note")]
    assert (
        notes
        == memory_cli.note_lines(result)
        == [
            "note: eager model",
            "note (FSDP over 3 GPUs): fsdp modelled",
            f"note (FSDP over 3 GPUs; FSDP over 3 GPUs, checkpointing): {split}",
            "note: the fit's",
        ]
    )


def test_mem_gib_s_help_says_it_is_gib_as_torch_reads_a_gpu_not_the_size_it_is_sold_with() -> None:
    result = CliRunner().invoke(app, ["memory", "--help"], env={"COLUMNS": "300"})
    help_text = " ".join(result.stdout.replace("│", " ").split())
    assert "this many GiB (2^30 bytes) instead, as torch reports its memory: a 24 GB L4 shows 22.03 GiB" in help_text


def test_the_tracing_line_is_one_line_in_a_log_not_broken_at_80_columns(monkeypatch):
    """Before, stderr in a pipe broke "tracing digits on fake tensors (bf16-mixed: auto: ..." mid-sentence."""

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(memory_cli, "fit_memory", interrupted)
    monkeypatch.delenv("COLUMNS", raising=False)
    result = CliRunner().invoke(app, ["memory", "--task", "example:digits", "--gpu", "h100-sxm"])
    line = result.stderr.splitlines()[0]
    assert line.startswith("tracing digits on fake tensors (bf16-mixed: auto: ") and line.endswith(")"), result.stderr
    assert len(line) > 80
