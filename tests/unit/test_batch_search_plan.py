"""The batch-size search's plan: doubling, then bisection, fed a device that fits up to a limit."""

import pytest
import torch
from torch.utils.data import IterableDataset, TensorDataset

from redline.errors import ConfigError
from redline.memory.search import _cap, next_batch_size, search_reason


def plan(limit: int, *, start: int = 1, cap: int | None = None) -> list[int]:
    """The sizes the search tries on a device where every batch up to ``limit`` fits."""
    tried: list[tuple[int, bool]] = []
    while (size := next_batch_size(tried, start=start, cap=cap)) is not None:
        assert size not in [s for s, _ in tried], f"{size} tried twice: {tried}"
        tried.append((size, size <= limit))
        assert len(tried) < 100
    return [size for size, _ in tried]


def largest(limit: int, **kwargs) -> int | None:
    return max((s for s in plan(limit, **kwargs) if s <= limit), default=None)


def test_doubles_until_a_failure_then_bisects_to_the_limit():
    assert plan(21, start=1, cap=64) == [1, 2, 4, 8, 16, 32, 24, 20, 22, 21]
    assert plan(21, start=3) == [3, 6, 12, 24, 18, 21, 22]
    assert plan(16, start=1) == [1, 2, 4, 8, 16, 32, 24, 20, 18, 17]  # a power of two: its neighbour is tried


def test_a_start_that_is_too_large_halves_down_then_bisects():
    assert plan(21, start=64) == [64, 32, 16, 24, 20, 22, 21]
    assert plan(1, start=8) == [8, 4, 2, 1]


def test_nothing_fits():
    assert plan(0, start=8) == [8, 4, 2, 1]
    assert plan(0) == [1]
    assert largest(0, start=8) is None


def test_the_cap_ends_the_doubling_and_is_tried_itself():
    assert plan(100, start=1, cap=40) == [1, 2, 4, 8, 16, 32, 40]
    assert plan(100, start=1, cap=32) == [1, 2, 4, 8, 16, 32]
    assert plan(35, start=1, cap=40) == [1, 2, 4, 8, 16, 32, 40, 36, 34, 35]
    assert plan(100, start=50, cap=40) == [40]  # a start above the cap starts at the cap


@pytest.mark.parametrize("limit", [1, 2, 3, 5, 7, 9, 12, 21, 63, 64, 65, 100, 1000])
@pytest.mark.parametrize("start", [1, 3, 8, 128])
def test_the_answer_is_the_limit_whatever_the_start(limit, start):
    assert largest(limit, start=start) == limit
    assert largest(limit, start=start, cap=50) == min(limit, 50)


def test_the_reason_names_the_answer_and_what_stopped_the_search():
    oom = "OutOfMemoryError: CUDA out of memory"
    assert search_reason([(16, True, ""), (32, False, oom), (24, True, ""), (28, False, "x")], None) == (
        "24 fits; 28 ran out of memory (x)"
    )
    capped = search_reason([(32, True, ""), (40, True, "")], 40)
    assert capped == "40 fits: the cap (max_batch_size=40) stopped the search"
    by_default = search_reason([(32, True, ""), (40, True, "")], 40, cap_given=False)  # never typed: not named so
    assert by_default == "40 fits: the dataset's size (40), the largest batch a run has, stopped the search"
    nothing = search_reason([(2, False, oom), (1, False, oom)], None)
    assert nothing == f"nothing fits: batch size 1 ran out of memory ({oom})"


class Stream(IterableDataset):
    def __iter__(self):
        return iter([(torch.ones(2), 0)])


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_cap_defaults_to_the_dataset_s_size_on_every_device(device):
    # a GPU with room to spare would otherwise double far past any batch a run has, collating each for real
    data = TensorDataset(torch.zeros(1438, 2))
    cap, notes = _cap(data, torch.device(device), None)
    assert cap == 1438 and len(notes) == 1 and "dataset's size (1438)" in notes[0]
    assert _cap(data, torch.device(device), 5000) == (5000, [])  # asked for: past the data, repeating it


def test_a_stream_has_no_default_cap_and_a_cpu_refuses_it():
    assert _cap(Stream(), torch.device("cuda"), None) == (None, [])  # its out-of-memory ends the doubling
    with pytest.raises(ConfigError, match="on a CPU the search needs max_batch_size"):
        _cap(Stream(), torch.device("cpu"), None)
