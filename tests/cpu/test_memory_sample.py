"""The memory estimate traces the largest items' batch, where items differ in size: a dataset whose first items
are short is weighed as its long ones make a padded batch, not 30 times under."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

import redline
from redline.memory.estimate import estimate_memory
from redline.memory.fit import fit_memory


class Texts(Dataset):  # type: ignore[type-arg]
    """Token-id sequences of the lengths given, in that order."""

    def __init__(self, lengths: list[int]) -> None:
        self.items = [
            torch.randint(1, 50, (n,), generator=torch.Generator().manual_seed(i)) for i, n in enumerate(lengths)
        ]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.items[index]
        return ids, ids[0] % 2


class Stream(IterableDataset):  # type: ignore[type-arg]
    def __init__(self, texts: Texts) -> None:
        self.texts = texts

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.texts[i] for i in range(len(self.texts)))


def pad(items: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    longest = max(len(ids) for ids, _ in items)
    padded = torch.zeros(len(items), longest, dtype=torch.long)
    for row, (ids, _) in enumerate(items):
        padded[row, : len(ids)] = ids
    return {"input_ids": padded}, torch.stack([label for _, label in items])


class Pooled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.mlp, self.head = nn.Embedding(50, 64), nn.Linear(64, 256), nn.Linear(256, 2)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.head(torch.relu(self.mlp(self.embed(batch["input_ids"]))).mean(1))


def texts_task(data: Dataset | IterableDataset) -> redline.Task:  # type: ignore[type-arg]
    return redline.Task(model=Pooled, loss_fn=nn.functional.cross_entropy, train_data=data, collate_fn=pad,
                        batch_size=16, name="texts")  # fmt: skip


def weighed(estimate: redline.MemoryEstimate) -> dict[str, object]:
    return {key: value for key, value in dataclasses.asdict(estimate).items() if key != "notes"}


def test_a_dataset_of_short_items_first_is_weighed_as_its_long_ones_make_a_batch():
    short_first = estimate_memory(texts_task(Texts([4] * 16 + [512] * 240)), batch_size=16)
    all_long = estimate_memory(texts_task(Texts([512] * 256)), batch_size=16)
    assert weighed(short_first) == weighed(all_long)
    said = "samples differ in size: traced on the 16 largest of 256 samples: input_ids (16, 512)"
    assert said in short_first.notes and not any("differ in size" in note for note in all_long.notes)


def test_the_largest_batch_predicted_to_fit_is_the_long_items_one():
    short_first = fit_memory(texts_task(Texts([4] * 1024 + [512] * 1024)), device="a GPU", mem_gib=1.5, target="cuda")
    all_long = fit_memory(texts_task(Texts([512] * 2048)), device="a GPU", mem_gib=1.5, target="cuda")
    assert short_first.rows[0].largest_batch == all_long.rows[0].largest_batch < 1024  # a batch of long items


def test_items_of_one_size_are_weighed_on_the_first_ones_as_before():
    texts = Texts([64] * 256)
    first = estimate_memory(texts_task(texts), batch_size=16)
    assert first == estimate_memory(texts_task(Texts([64] * 16)), batch_size=16)  # the first batch alone


def test_a_stream_is_weighed_on_its_first_batch_and_says_so():
    estimate = estimate_memory(texts_task(Stream(Texts([4] * 16 + [512] * 16))), batch_size=16)
    assert estimate.activations < estimate_memory(texts_task(Texts([512] * 16)), batch_size=16).activations
    said = "train_data is a stream: traced on its first batch (input_ids (16, 4)); later items of other "
    assert said + "sizes are not searched for the largest" in estimate.notes


def test_a_large_dataset_is_looked_at_through_an_even_sample():
    from redline.memory.sample import LOOKED_AT, _looked_at

    assert _looked_at(10) == list(range(10))
    spread = _looked_at(3 * LOOKED_AT)
    assert len(spread) == LOOKED_AT and spread[:2] == [0, 3] and spread[-1] == 3 * LOOKED_AT - 3
    estimate = estimate_memory(texts_task(Texts([4] * LOOKED_AT + [64] * LOOKED_AT)), batch_size=16)
    said = f"traced on the 16 largest of {LOOKED_AT:,} samples spread evenly over {2 * LOOKED_AT:,}: input_ids (16, 64)"
    assert any(note.endswith(said) for note in estimate.notes)


class Seen(Pooled):
    """Pooled, noting the sequence length of each batch it trains on."""

    lengths: ClassVar[list[int]] = []

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        Seen.lengths.append(batch["input_ids"].shape[1])
        return super().forward(batch)


def test_the_measured_search_tries_each_batch_size_on_the_largest_items_not_the_first():
    # `redline memory --measure` ran its steps on the first items: four tokens long, where the run's batches hold 512
    Seen.lengths = []
    task = dataclasses.replace(texts_task(Texts([4] * 16 + [512] * 240)), model=Seen)
    fp32 = redline.RuntimeOptions(devices="cpu", precision="fp32")
    found = redline.find_batch_size(task, options=fp32, max_batch_size=4)
    assert found.largest == 4 and Seen.lengths and set(Seen.lengths) == {512}
    assert "samples differ in size: each batch size was tried on the largest of 256 samples" in found.notes
    Seen.lengths = []
    even = redline.find_batch_size(
        dataclasses.replace(task, train_data=Texts([64] * 32)), options=fp32, max_batch_size=4
    )
    assert set(Seen.lengths) == {64} and not any("differ in size" in note for note in even.notes)


class Augmented(Texts):
    """Texts whose items draw from torch's global stream as they are read (an augmentation), or fail at ``bad``."""

    def __init__(self, lengths: list[int], bad: int | None = None) -> None:
        super().__init__(lengths)
        self.bad = bad

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index == self.bad:
            raise ValueError(f"corrupt item {index}")
        torch.rand(1)
        return super().__getitem__(index)


def test_the_measured_search_leaves_the_callers_random_streams_where_they_were():
    task = texts_task(Augmented([4] * 16 + [64] * 48))
    torch.manual_seed(7)
    before = torch.get_rng_state()
    redline.find_batch_size(task, options=redline.RuntimeOptions(devices="cpu", precision="fp32"), max_batch_size=2)
    assert torch.equal(torch.get_rng_state(), before)  # ranking the items read them, and their draws, inside the save


def test_an_item_that_fails_as_the_largest_are_looked_for_is_named_with_the_datasets_hint():
    task = texts_task(Augmented([4] * 16 + [64] * 48, bad=50))
    with pytest.raises(redline.TaskError, match="reading item 50 of train_data, to find its largest items, raised "
                                                "ValueError: corrupt item 50") as failed:  # fmt: skip
        redline.find_batch_size(task, options=redline.RuntimeOptions(devices="cpu", precision="fp32"), max_batch_size=2)
    assert "hint: the error is in the dataset's own code" in str(failed.value)


def test_a_batch_of_texts_the_model_tokenizes_itself_is_told_by_their_count_and_longest():
    # The note ended "traced on the 8 largest of 50 samples: " with nothing after it
    from redline.memory.sample import trace_batch

    words = [("word " * n).strip() for n in range(1, 51)]
    items = [(text, torch.tensor(float(len(text)))) for text in words]

    def collate(batch):
        return [text for text, _ in batch], torch.stack([target for _, target in batch])

    _, _, note = trace_batch(items, 8, collate)
    assert note == (
        "samples differ in size: traced on the 8 largest of 50 samples: 8 texts, the longest 249 characters",
    )
