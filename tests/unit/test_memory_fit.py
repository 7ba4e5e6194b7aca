"""The largest batch that fits: found from traces of a step's memory, whatever shape its growth has."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

from redline.errors import ConfigError
from redline.memory.estimate import MemoryEstimate
from redline.memory.fit import GIB, available_bytes, catalog_memory_note, fit_memory, gpu_facts, largest_batch
from redline.task import Task


def estimator(total: Callable[[int], float]) -> tuple[Callable[..., MemoryEstimate], list[int]]:
    traced: list[int] = []

    def estimate_at(*, batch_size: int) -> MemoryEstimate:
        traced.append(batch_size)
        peak = int(total(batch_size))
        return MemoryEstimate(
            batch_size=batch_size, precision="fp32", target="cuda", strategy="single", world_size=1,
            activation_checkpointing=False, params=0, gradients=0, optimizer_state=0, activations=peak,
            workspace=0, peak=peak,
        )  # fmt: skip

    return estimate_at, traced


def test_a_straight_line_is_solved_in_a_few_traces() -> None:
    estimate_at, traced = estimator(lambda b: 1000 + 10 * b)
    assert largest_batch(estimate_at, estimate_at(batch_size=16), 5000) == 400
    assert len(traced) <= 5


def test_a_peak_that_moves_as_the_batch_grows_is_still_found() -> None:
    # small batches peak in the optimizer step, large ones in backward: the line from small batches is wrong
    def total(b: int) -> float:
        return max(5000 + 10 * b, 1000 + 60 * b)

    estimate_at, _ = estimator(total)
    found = largest_batch(estimate_at, estimate_at(batch_size=8), 100_000)
    assert found is not None
    assert total(found) <= 100_000 < total(int(found * 1.02) + 1)


def test_a_batch_asked_for_that_does_not_fit_searches_downward() -> None:
    estimate_at, _ = estimator(lambda b: 1000 + 100 * b)
    assert largest_batch(estimate_at, estimate_at(batch_size=512), 10_000) == 90


def test_model_states_alone_too_large_means_no_batch() -> None:
    estimate_at, _ = estimator(lambda b: 10_000 + b)
    assert largest_batch(estimate_at, estimate_at(batch_size=4), 9_000) is None


def test_ranks_get_a_multiple_of_their_number() -> None:
    estimate_at, _ = estimator(lambda b: 1000 + 10 * b)
    assert largest_batch(estimate_at, estimate_at(batch_size=16), 5000, multiple=8) == 400
    found = largest_batch(estimate_at, estimate_at(batch_size=16), 4990, multiple=8)
    assert found == 392


def test_the_budget_leaves_out_the_cuda_context_and_the_allocator_margin() -> None:
    assert available_bytes(80, "cuda") < available_bytes(80, "cpu") < 80 * GIB
    assert available_bytes(80, "cpu") - available_bytes(80, "cuda") == pytest.approx(0.95 * GIB, rel=1e-6)
    assert available_bytes(0.5, "cuda") == 0


def test_a_gpu_is_found_by_id_or_by_the_name_torch_reports() -> None:
    spec, facts = gpu_facts("h100-sxm")
    assert spec.mem_gib == 80 and facts.capability == (9, 0) and facts.bf16
    assert gpu_facts("NVIDIA H100 80GB HBM3")[0].id == "h100-sxm"
    spec, facts = gpu_facts("AMD Instinct MI300X")  # what torch on ROCm reports
    assert spec.mem_gib == 192 and facts.capability == (9, 4) and facts.bf16
    with pytest.raises(ConfigError, match=r"(?s)not in the GPU catalog.*h100-sxm.*--mem-gib"):
        gpu_facts("voodoo-2")


@pytest.mark.parametrize(
    ("name", "reads", "note"),
    [("l4", 22.03, "against the 22.03 GiB torch reports on one (total_memory), not the 24 GB it is sold with"),
     ("t4", 14.56, "against the 14.56 GiB torch reports"), ("h200-sxm", 139.8, "not the 141 GB"),
     ("h100-pcie", 79.11, "against the 79.11 GiB"),  # the H100 SXM's reading: the same chip and memory
     ("mi300x", 192, "against the 192 GiB of its datasheet: the catalog holds no reading")],
)  # fmt: skip
def test_a_catalog_gpu_is_weighed_at_the_memory_torch_reads_on_it(name, reads, note) -> None:
    # ECC on a GDDR card takes a sixteenth of it, and the driver keeps some of every card: weighed at the
    # datasheet's 24 GiB, an L4's largest batch came out 8% more than fits in the 22.03 GiB torch reports
    spec, facts = gpu_facts(name)
    assert facts.mem_gib == spec.weighed_gib == reads
    assert note in catalog_memory_note(spec)


@pytest.mark.parametrize(
    ("name", "expected"),
    [("RTX 4090", "rtx-4090"), ("h200 sxm", "h200-sxm"), ("H100 NVL", "h100-nvl"), ("A100 SXM4 80GB", "a100-sxm4-80gb"),
     ("H100_SXM", "h100-sxm"), ("L4", "l4"), ("t4", "t4"), ("rtx4090", "rtx-4090"), ("h100nvl", "h100-nvl"),
     ("GH200 144GB", "gh200-144gb"), ("tesla t4", "t4"), ("a10", "a10"),
     ("RTX 6000 Ada", "rtx-6000-ada"), ("MI300X", "mi300x"), ("AMD MI300X", "mi300x"),
     # a card's memory, and the words of the name torch reports, are words a person types too
     ("T4 16GB", "t4"), ("L40S 48GB", "l40s"), ("B200 180GB", "b200"), ("a10 24gb", "a10"),
     # "sxm" for the A100's SXM4, the one SXM form it is sold in, as for the H100's SXM5
     ("a100 sxm 80gb", "a100-sxm4-80gb"), ("A100 SXM 40GB", "a100-sxm4-40gb"), ("h100 sxm5", "h100-sxm")],
)  # fmt: skip
def test_a_gpu_is_found_by_the_words_a_person_types(name, expected) -> None:
    assert gpu_facts(name)[0].id == expected


@pytest.mark.parametrize(
    ("name", "nearest"), [("h10-sxm", "h100-sxm, h200-sxm"), ("a10x", "a10, a10g"), ("l40", "l40s, l4")]
)
def test_a_name_in_no_row_names_the_nearest_rows(name, nearest) -> None:
    message = rf"(?s)--gpu '{name}' is not in the GPU catalog; nearest: {nearest};.*--mem-gib"
    with pytest.raises(ConfigError, match=message):
        gpu_facts(name)


@pytest.mark.parametrize(
    ("name", "row"),
    [("4090", "rtx-4090"), ("rtx 6000", "rtx-6000-ada"), ("H100 80GB HBM3", "h100-sxm"), ("4090 24GB", "rtx-4090"),
     ("v100 sxm 32gb", "v100-sxm2-32gb")],  # the V100 came in SXM2 and SXM3 (the DGX-2's), and the catalog lacks SXM3
)  # fmt: skip
def test_a_name_that_is_only_part_of_a_row_s_names_the_row_instead_of_taking_it(name, row) -> None:
    # "rtx 6000" is the 48 GB Ada card of the catalog, or the 24 GB Quadro RTX 6000 it lacks: weighing a model
    # against the wrong one answers "fits" for a card that cannot hold it
    with pytest.raises(ConfigError, match=rf"(?s)--gpu '{name}' names {row} .* only in part.*hint: --gpu {row} "):
        gpu_facts(name)


@pytest.mark.parametrize(
    ("name", "rows"),
    [("H100", "h100-sxm, h100-nvl, h100-pcie"), ("h200", "h200-sxm, h200-nvl"), ("gh200", "gh200-96gb, gh200-144gb"),
     ("a100 80gb", "a100-sxm4-80gb, a100-pcie-80gb"),
     ("Tesla V100", "v100-sxm2-16gb, v100-sxm2-32gb, v100-pcie-16gb, v100-pcie-32gb"),
     ("v100 32gb", "v100-sxm2-32gb, v100-pcie-32gb"), ("H200 141GB", "h200-sxm, h200-nvl")],
)  # fmt: skip
def test_a_name_several_gpus_fit_lists_them_instead_of_guessing(name, rows) -> None:
    with pytest.raises(ConfigError, match=f"could be any of: {rows}"):
        gpu_facts(name)


def test_a_mig_slice_or_several_gpus_say_what_to_give_instead() -> None:
    # a MIG slice said "not in the GPU catalog", and "h100,l4" was looked up as one name
    with pytest.raises(ConfigError, match=r"(?s)is a MIG slice of an NVIDIA H100 SXM5 80GB.*--mem-gib .*'10gb'"):
        gpu_facts("NVIDIA H100 80GB HBM3 MIG 1g.10gb")
    with pytest.raises(ConfigError, match=r"(?s)--gpu 'h100,l4' names several GPUs; a call weighs one.*per call"):
        gpu_facts("h100,l4")


@pytest.mark.parametrize(
    ("name", "family", "rows"),
    [("hopper", "Hopper", "h200-sxm, h200-nvl, h100-sxm, h100-nvl, gh200-96gb, gh200-144gb, h100-pcie"),
     ("ada", "Ada Lovelace", "l40s, l4, rtx-6000-ada, rtx-4090"), ("Ada Lovelace", "Ada Lovelace", "l40s, l4"),
     ("volta", "Volta", "v100-sxm2-16gb"), ("cdna3", "CDNA 3", "mi300x"), ("blackwell", "Blackwell", "b200")],
)  # fmt: skip
def test_an_architecture_lists_every_card_of_it_not_those_that_hold_its_word(name, family, rows) -> None:
    # "hopper" listed only the GH200s ("Grace Hopper" in their names), "ada" named rtx-6000-ada only in part
    with pytest.raises(ConfigError, match=rf"(?s)--gpu '{name}' names the {family} architecture, not a card; "
                       rf"the catalog's {family} cards: {rows}.*hint: name one"):  # fmt: skip
        gpu_facts(name)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": 0}, "batch_size=0"),
        ({"batch_size": -8}, "batch_size=-8"),
        ({"mem_gib": float("inf")}, "mem_gib=inf"),
        ({"mem_gib": 0}, "mem_gib=0"),
        ({"mem_gib": 1e308}, "mem_gib=1e+308 is not allowed; expected at most 1048576 GiB"),  # infinite bytes
        ({"gpus": 0}, "gpus=0"),
        ({"target": "tpu"}, "target='tpu'"),
    ],
)
def test_fit_memory_refuses_bad_arguments_instead_of_tracing_something_else(kwargs, message) -> None:
    data = TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    task = Task(model=lambda: nn.Linear(4, 2), loss_fn=nn.functional.cross_entropy, train_data=data, batch_size=4)
    args = {"device": "a CPU", "mem_gib": 0.01, "target": "cpu", **kwargs}
    with pytest.raises(ConfigError, match=re.escape(message)):
        fit_memory(task, **args)


def test_a_first_batch_at_the_smallest_size_that_does_not_fit_is_not_traced_again() -> None:
    estimate_at, traced = estimator(lambda b: 10_000 + b)
    assert largest_batch(estimate_at, estimate_at(batch_size=1), 9_000) is None
    assert largest_batch(estimate_at, estimate_at(batch_size=8), 9_000, multiple=8) is None
    assert traced == [1, 8]  # the two first estimates only: nothing smaller is left to try


def test_the_search_stops_at_the_cap_and_traces_nothing_past_it() -> None:
    estimate_at, traced = estimator(lambda b: 1000 + 10 * b)
    assert largest_batch(estimate_at, estimate_at(batch_size=16), 10**9, cap=100) == 100
    assert max(traced) == 100
    traced.clear()
    assert largest_batch(estimate_at, estimate_at(batch_size=500), 10**9, cap=100) == 100
    assert traced == [500]  # a smaller batch than one that fits needs no trace
    assert largest_batch(estimate_at, estimate_at(batch_size=16), 10**9, multiple=8, cap=100) == 96
    assert largest_batch(estimate_at, estimate_at(batch_size=16), 2000, cap=100) == 100  # the cap itself fits
    assert largest_batch(estimate_at, estimate_at(batch_size=16), 1500, cap=100) == 50  # below the cap: the line


def test_fit_memory_predicts_no_batch_larger_than_the_training_set() -> None:
    data = TensorDataset(torch.randn(100, 4), torch.randint(0, 2, (100,)))
    task = Task(model=lambda: nn.Linear(4, 2), loss_fn=nn.functional.cross_entropy, train_data=data, batch_size=8)
    rows = fit_memory(task, device="a GPU", mem_gib=80, target="cuda", gpus=8).rows
    assert [(row.label, row.largest_batch, row.cap) for row in rows] == [
        ("as it stands", 100, 100),
        ("FSDP over 8 GPUs", 96, 96),  # a batch the 8 ranks share evenly
    ]


def test_a_batch_larger_than_the_training_set_is_estimated_as_asked_and_noted() -> None:
    data = TensorDataset(torch.randn(100, 4), torch.randint(0, 2, (100,)))
    task = Task(model=lambda: nn.Linear(4, 2), loss_fn=nn.functional.cross_entropy, train_data=data, batch_size=8)
    result = fit_memory(task, device="a GPU", mem_gib=80, target="cuda", batch_size=1000, gpus=1)
    assert result.rows[0].estimate.batch_size == 1000 and result.rows[0].largest_batch == 100
    (note,) = result.notes
    assert note.startswith("batch 1000 is more than train_data holds (100 items): a run's batches stop at 100")
    assert result.to_dict()["notes"] == list(result.notes)
    assert fit_memory(task, device="a GPU", mem_gib=80, target="cuda", batch_size=100, gpus=1).notes == ()


def test_with_micro_batches_the_largest_batch_stops_where_a_step_takes_the_whole_training_set() -> None:
    """Before, a micro-batch was capped at the whole set: "256 (all of train_data)", a step then taking 512."""
    data = TensorDataset(torch.randn(256, 4), torch.randint(0, 2, (256,)))
    task = Task(model=lambda: nn.Linear(4, 2), loss_fn=nn.functional.cross_entropy, train_data=data, batch_size=8)
    result = fit_memory(task, device="a GPU", mem_gib=80, target="cuda", batch_size=8, grad_accum=2, gpus=3)
    assert [(row.label, row.largest_batch, row.cap) for row in result.rows] == [
        ("as it stands", 128, 128),
        ("FSDP over 3 GPUs", 126, 126),  # 2 micro-batches of 126 over 3 ranks: the most the data gives each step
    ]
    assert result.notes[0].endswith("(a step trains on 2 times as many samples: at most 128 each, as 2 of them take "
                                    "all of train_data)")  # fmt: skip
    over = fit_memory(task, device="a GPU", mem_gib=80, target="cuda", batch_size=200, grad_accum=2, gpus=1)
    assert over.notes[1] == (
        "2 micro-batches of 200 are more than train_data holds (256 items): a step's micro-batches stop at 128, so "
        "the largest batch does too"
    )


def test_a_gpu_whose_context_takes_all_its_memory_says_so() -> None:
    data = TensorDataset(torch.randn(100, 4), torch.randint(0, 2, (100,)))
    task = Task(model=lambda: nn.Linear(4, 2), loss_fn=nn.functional.cross_entropy, train_data=data, batch_size=8)
    result = fit_memory(task, device="a 0.5 GiB GPU", mem_gib=0.5, target="cuda", gpus=1)
    assert result.rows[0].available == 0 and result.rows[0].largest_batch is None
    assert result.notes == (
        "a 0.5 GiB GPU leaves no memory for tensors: the CUDA context takes about 1 GiB of it before any tensor",
    )
    assert fit_memory(task, device="a CPU", mem_gib=0.5, target="cpu").notes == ()


def test_a_batch_smaller_than_the_gpus_says_why_the_fsdp_rows_weigh_more() -> None:
    data = TensorDataset(torch.randn(100, 4), torch.randint(0, 2, (100,)))
    task = Task(model=lambda: nn.Linear(4, 2), loss_fn=nn.functional.cross_entropy, train_data=data, batch_size=8)
    result = fit_memory(task, device="a GPU", mem_gib=80, target="cuda", batch_size=4, gpus=8)
    assert [row.estimate.batch_size for row in result.rows] == [4, 8]
    assert result.notes == (
        "batch 4 leaves some of the 8 GPUs without a sample, so the FSDP rows weigh a batch of 8, one sample on each",
    )
    assert fit_memory(task, device="a GPU", mem_gib=80, target="cuda", batch_size=8, gpus=8).notes == ()


class Stream(IterableDataset):
    """A stream that states its length, as the DataLoader reads it: a run's batches stop at its 100 items."""

    def __len__(self) -> int:
        return 100

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(100):
            yield torch.randn(4), torch.tensor(i % 2)


def test_a_stream_that_states_its_length_caps_the_largest_batch_as_a_dataset_does() -> None:
    task = Task(model=lambda: nn.Linear(4, 2), loss_fn=nn.functional.cross_entropy, train_data=Stream(), batch_size=8)
    rows = fit_memory(task, device="a GPU", mem_gib=80, target="cuda", gpus=8).rows
    assert [(row.largest_batch, row.cap) for row in rows] == [(100, 100), (96, 96)]
    (note,) = fit_memory(task, device="a GPU", mem_gib=80, target="cuda", batch_size=1000, gpus=1).notes
    assert note.startswith("batch 1000 is more than train_data holds (100 items)")


def normed_task(norm: nn.Module, shape: tuple[int, ...]) -> Task:
    data = TensorDataset(torch.randn(100, *shape), torch.randint(0, 2, (100,)))
    model = nn.Sequential(norm, nn.Flatten(), nn.Linear(math.prod(shape), 2))
    return Task(model=lambda: model, loss_fn=nn.functional.cross_entropy, train_data=data, batch_size=8)


def test_a_model_that_cannot_train_on_one_sample_is_weighed_at_two_on_each_device() -> None:
    # BatchNorm1d refuses one value per channel in training: 8 samples over 8 GPUs crashed the whole estimate
    task = normed_task(nn.BatchNorm1d(4), (4,))
    result = fit_memory(task, device="a GPU", mem_gib=80, target="cuda", gpus=8)
    assert [(row.estimate.batch_size, row.largest_batch) for row in result.rows] == [(8, 100), (16, 96)]
    (note,) = result.notes
    assert note.startswith("one sample on a device cannot train (ValueError: Expected more than 1 value per channel")
    assert note.endswith("at least 2 samples on each device; batch 8 is weighed as 16 (FSDP over 8 GPUs)")
    alone = fit_memory(task, device="a GPU", mem_gib=80, target="cuda", batch_size=1, gpus=1)
    assert alone.rows[0].estimate.batch_size == 2 and alone.notes[0].endswith("batch 1 is weighed as 2 (as it stands)")


def test_a_batchnorm_over_images_trains_on_one_sample_and_is_weighed_as_asked() -> None:
    task = normed_task(nn.BatchNorm2d(3), (3, 4, 4))  # 16 values per channel in one sample
    result = fit_memory(task, device="a GPU", mem_gib=80, target="cuda", gpus=8)
    assert [row.estimate.batch_size for row in result.rows] == [8, 8] and result.notes == ()


def test_the_search_traces_nothing_below_the_smallest_batch_a_model_trains_on() -> None:
    estimate_at, traced = estimator(lambda b: 1000 + 100 * b)
    assert largest_batch(estimate_at, estimate_at(batch_size=16), 1150, smallest=2) is None
    assert min(traced) == 2
    assert largest_batch(estimate_at, estimate_at(batch_size=16), 1250, smallest=2) == 2


def test_a_stream_of_no_length_says_its_largest_batch_is_not_capped() -> None:
    class Unsized(IterableDataset):
        def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            yield from Stream()

    task = Task(model=lambda: nn.Linear(4, 2), loss_fn=nn.functional.cross_entropy, train_data=Unsized(), batch_size=8)
    result = fit_memory(task, device="a GPU", mem_gib=1.5, target="cuda", gpus=1)
    assert result.rows[0].cap is None and result.rows[0].largest_batch is not None
    assert result.notes == (
        "train_data is a stream with no length, so the largest batch is not capped at its size, as a dataset's is: "
        "a run's batches stop where the stream ends (give it __len__ to cap the prediction)",
    )


def test_a_cpu_search_is_weighed_against_the_memory_the_machine_has_free(monkeypatch, tmp_path) -> None:
    import redline.memory.host as host

    (tmp_path / "meminfo").write_text("MemTotal:  33554432 kB\nMemFree:  1048576 kB\nMemAvailable:  4194304 kB\n")
    monkeypatch.setattr(host, "MEMINFO", str(tmp_path / "meminfo"), raising=False)
    monkeypatch.setattr(host, "resident_bytes", lambda: 2 * GIB, raising=False)
    monkeypatch.setattr(host, "memory_limit_bytes", lambda: None)
    assert host.host_budget() == int((2 + 4) * GIB * host.HOST_SHARE)  # its own 2 GiB and the 4 GiB free besides
    monkeypatch.setattr(host, "memory_limit_bytes", lambda: 3 * GIB)  # a container's limit below that binds
    assert host.host_budget() == int(3 * GIB * host.HOST_SHARE)


def test_a_cpu_estimate_is_weighed_against_what_is_free_now_not_the_machine_s_total(monkeypatch, tmp_path) -> None:
    """Before, a CPU was weighed against 0.95 x MemTotal, though other processes held some of it."""
    import redline.memory.host as host

    (tmp_path / "meminfo").write_text("MemTotal:  33554432 kB\nMemFree:  1048576 kB\nMemAvailable:  4194304 kB\n")
    monkeypatch.setattr(host, "MEMINFO", str(tmp_path / "meminfo"))
    monkeypatch.setattr(host, "memory_headroom_bytes", lambda: None)
    assert host.free_bytes() == 4 * GIB  # this process's own memory not added: the run needs as much again
    monkeypatch.setattr(host, "memory_headroom_bytes", lambda: 3 * GIB)  # a container's limit less its use binds
    assert host.free_bytes() == 3 * GIB
    task = Task(model=lambda: nn.Linear(4, 2), loss_fn=nn.functional.cross_entropy,
                train_data=TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,))), batch_size=4)  # fmt: skip
    result = fit_memory(task, device="a CPU", mem_gib=32, free_gib=3, target="cpu")
    assert result.rows[0].available == int(3 * GIB * 0.95) and result.to_dict()["free_gib"] == 3


def test_a_row_whose_least_batch_is_more_than_the_training_set_predicts_none_and_says_why() -> None:
    """Before, FSDP over 8 GPUs on 5 items predicted a largest batch of 8, "train_data's most 8 ranks share"."""
    data = TensorDataset(torch.randn(5, 4), torch.randint(0, 2, (5,)))
    task = Task(model=lambda: nn.Linear(4, 2), loss_fn=nn.functional.cross_entropy, train_data=data, batch_size=4)
    result = fit_memory(task, device="a GPU", mem_gib=80, target="cuda", gpus=8)
    assert [(row.label, row.largest_batch) for row in result.rows] == [("as it stands", 5), ("FSDP over 8 GPUs", None)]
    assert "FSDP over 8 GPUs: train_data holds 5 items, and a batch needs at least 8 (1 on each of 8 devices)" in (
        result.notes
    )
    # and its table does not say "fits: yes" beside "largest batch: none": it has no batch to weigh
    from rich.console import Console

    from redline.render.memory import memory_tables

    console = Console(width=200, record=True)
    console.print(memory_tables(result)[-1])
    fsdp = next(line for line in console.export_text().splitlines() if "FSDP over 8 GPUs" in line)
    assert [cell.strip() for cell in fsdp.split("│")[4:6]] == ["n/a", "n/a"]
    assert (result.rows[1].fits, result.rows[0].fits) == (None, True)
    assert result.rows[1].to_dict()["fits"] is None
