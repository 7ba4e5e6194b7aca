"""A Task's own collate_fn: items of different lengths, padded into a batch, through every tool that reads batches."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

import redline
from redline.bench import benchmark
from redline.memory.estimate import estimate_memory


class Sentences(Dataset):  # type: ignore[type-arg]
    """Token-id sequences of 3 to 9 tokens, labelled by whether their first token is even."""

    def __init__(self, count: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        lengths = torch.randint(3, 10, (count,), generator=generator)
        self.items = [torch.randint(0, 50, (int(n),), generator=generator) for n in lengths]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.items[index]
        return ids, ids[0] % 2


def pad(items: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    longest = max(len(ids) for ids, _ in items)
    padded = torch.zeros(len(items), longest, dtype=torch.long)
    mask = torch.zeros(len(items), longest)
    for row, (ids, _) in enumerate(items):
        padded[row, : len(ids)], mask[row, : len(ids)] = ids, 1.0
    return {"ids": padded, "mask": mask}, torch.stack([label for _, label in items])


class Pooled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(50, 16), nn.Linear(16, 2)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        mask = batch["mask"].unsqueeze(-1)
        return self.head((self.embed(batch["ids"]) * mask).sum(1) / mask.sum(1))


def sentences_task() -> redline.Task:
    return redline.Task(
        model=Pooled, loss_fn=nn.functional.cross_entropy, train_data=Sentences(96, 0), val_data=Sentences(32, 1),
        collate_fn=pad, batch_size=16, name="sentences",
    )  # fmt: skip


def test_the_trainer_batches_items_of_different_lengths_with_the_tasks_collate_fn(tmp_path):
    config = redline.TrainerConfig(  # the precision trial reads its batch with the collate too, where it runs
        max_steps=8, out_dir=tmp_path, progress=False, trial="on", runtime=redline.RuntimeOptions(devices="cpu")
    )
    with redline.Trainer(sentences_task(), config) as trainer:
        summary = trainer.fit()
        metrics = trainer.evaluate()
    assert summary.steps == 8 and math.isfinite(summary.final_loss)
    assert metrics["val_loss"] is not None and math.isfinite(metrics["val_loss"])


class CharCounts(nn.Module):
    """A text model that reads raw strings: each one's length, through one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.0))

    def forward(self, texts: list[str]) -> torch.Tensor:
        return self.scale * torch.tensor([float(len(text)) for text in texts])


def test_a_batch_of_strings_counts_its_strings_as_its_samples_and_evaluation_weighs_them_so(tmp_path):
    # A list of strings holds no tensor: its first string's characters were counted as the batch's samples, which
    # inflated `samples` and weighed each evaluation batch by the length of its first text.
    words = ["a", "bb", "ccccccccccccccc", "dd", "eeeeeeeeeeee", "f", "ggggggg", "h", "iii", "j"]
    val = [("z" * 20, 1.0), ("y", 2.0), ("x", 3.0), ("w", 4.0), ("v" * 10, 50.0)]  # batches of 4 and 1

    def texts(items):
        return [text for text, _ in items], torch.tensor([float(target) for _, target in items])

    task = redline.Task(
        model=CharCounts, loss_fn=nn.functional.mse_loss, train_data=[(w, 0.0) for w in words], val_data=val,
        collate_fn=texts, batch_size=4, optimizer=lambda params: torch.optim.SGD(params, lr=0.0), name="texts",
    )  # fmt: skip
    config = redline.TrainerConfig(
        max_epochs=1, out_dir=tmp_path, progress=False, runtime=redline.RuntimeOptions(devices="cpu", precision="fp32")
    )
    with redline.Trainer(task, config) as trainer:
        summary = trainer.fit()
    per_sample = [(len(text) - target) ** 2 for text, target in val]  # the weight stays 1 (lr 0)
    assert summary.samples == len(words)
    assert summary.val_loss == pytest.approx(sum(per_sample) / len(val))


class Boxes(nn.Module):
    """A detection-shaped model: a tuple of 3-channel images of their own sizes in, one score per image out."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(3, 1)

    def forward(self, images: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.cat([self.head(image.mean((1, 2))) for image in images])


def test_a_detection_batch_counts_its_images_as_its_samples_not_their_channels(tmp_path):
    # torchvision's detection collation, tuple(zip(*samples)): the first image's 3 channels were counted as the
    # batch's samples, so samples (and samples/s) read 3 per batch of 5 images, and evaluation weighed a batch of 2
    # images as 3.
    gen = torch.Generator().manual_seed(0)

    def images(count: int, scale: float) -> list:
        return [
            (torch.randn(3, 4 + i % 3, 5, generator=gen), {"score": torch.tensor([scale * i])}) for i in range(count)
        ]

    def loss(outputs: torch.Tensor, targets: tuple[dict, ...]) -> torch.Tensor:
        return nn.functional.mse_loss(outputs, torch.cat([t["score"] for t in targets]))

    val = images(7, 1.0)  # batches of 5 and 2
    task = redline.Task(
        model=Boxes, loss_fn=loss, train_data=images(10, 0.1), val_data=val,
        collate_fn=lambda b: tuple(zip(*b, strict=True)), batch_size=5,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.0), name="boxes",
    )  # fmt: skip
    config = redline.TrainerConfig(
        max_epochs=1, out_dir=tmp_path, progress=False, runtime=redline.RuntimeOptions(devices="cpu", precision="fp32")
    )
    with redline.Trainer(task, config) as trainer:
        summary = trainer.fit()
        model = trainer.model
    with torch.no_grad():  # lr 0: the model is as built, and each image's squared error weighs one
        errors = [(model((image,)) - target["score"]).square().item() for image, target in val]
    assert summary.samples == 10
    assert summary.val_loss == pytest.approx(sum(errors) / len(val), rel=1e-5)


def test_the_bench_and_the_memory_estimate_collate_with_it_too():
    result = benchmark(sentences_task(), devices="cpu", precisions=["fp32"], compiles=[False], steps=2, window=1)
    assert [row.error for row in result.rows] == ["", "", ""]
    estimate = estimate_memory(sentences_task(), batch_size=16, precision="fp32")
    assert estimate.activations > 0 and estimate.total > estimate.params


def test_the_collate_fn_is_part_of_the_tasks_fingerprint():
    padded = sentences_task()
    assert dataclasses.replace(padded, collate_fn=None).fingerprint() != padded.fingerprint()


def test_items_of_different_lengths_without_a_collate_fn_name_the_tasks():
    stacked = dataclasses.replace(sentences_task(), collate_fn=None)
    config = redline.TrainerConfig(
        max_steps=1, progress=False, trial="off", runtime=redline.RuntimeOptions(devices="cpu")
    )
    said = r"stack expects each tensor(.|\n)*Task\(collate_fn=\.\.\.\) pads"
    with redline.Trainer(stacked, config) as trainer, pytest.raises(redline.TrainingError, match=said):
        trainer.fit()


def quiet_config(**fields) -> redline.TrainerConfig:
    return redline.TrainerConfig(progress=False, trial="off", runtime=redline.RuntimeOptions(devices="cpu"), **fields)


def test_predict_batches_items_of_different_lengths_with_the_tasks_collate_fn_as_evaluation_does():
    """predict stacked the items itself: 'stack expects each tensor to be equal size', hinting at the collate_fn."""
    task = sentences_task()
    with redline.Trainer(task, quiet_config(max_steps=2)) as trainer:
        trainer.fit()
        predicted = trainer.predict(task.val_data, batch_size=8)
        assert trainer.model is not None
        with torch.no_grad():
            first = trainer.model(pad([task.val_data[i] for i in range(8)])[0])
    assert predicted.shape == (32, 2)
    torch.testing.assert_close(predicted[:8], first)


def test_predict_names_the_collate_fn_when_it_cannot_batch_the_items_given():
    with redline.Trainer(sentences_task(), quiet_config(max_steps=1)) as trainer:
        trainer.fit()
        with pytest.raises(redline.TrainingError, match=r"predict batches the items with the Task's collate_fn"):
            trainer.predict([(torch.tensor([1, 2, 3]), "a"), (torch.tensor([4, 5]), "b")])  # labels pad cannot stack
        # token ids alone, of two lengths: stacked, as the collate_fn (written for pairs) could not read them
        with pytest.raises(redline.TrainingError, match=r"holds, \(inputs, targets\) pairs: give predict such items"):
            trainer.predict([torch.tensor([1, 2, 3]), torch.tensor([4, 5])])


def pad_ids(items: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    ids, labels = zip(*items, strict=True)
    return nn.utils.rnn.pad_sequence(list(ids), batch_first=True), torch.stack(list(labels))


def test_predict_stacks_bare_inputs_of_a_task_whose_collate_fn_takes_pairs():
    """With the Task's collate_fn used for every predict, bare inputs failed: 'too many values to unpack'."""
    data = Sentences(16, seed=0)
    task = redline.Task(
        model=lambda: nn.Sequential(nn.EmbeddingBag(50, 4), nn.Linear(4, 2)),  # (batch, length) ids: their mean
        loss_fn=nn.functional.cross_entropy, train_data=data, batch_size=4, collate_fn=pad_ids,
    )  # fmt: skip
    with redline.Trainer(task, quiet_config(max_steps=1)) as trainer:
        trainer.fit()
        ids = [torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6, 7, 8])]
        assert trainer.predict(ids).shape == (2, 2)  # stacked, as before the collate_fn was used
        assert trainer.predict(data, batch_size=4).shape == (16, 2)  # pairs of two lengths: padded by it


def masked(items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([features * mask for features, mask, _ in items]), torch.stack([label for *_, label in items])


def test_predict_batches_items_of_three_with_the_tasks_collate_fn():
    """Items that were no pair were stacked without it: the model got the unmasked features, with no warning."""
    gen = torch.Generator().manual_seed(0)
    features, masks = torch.randn(32, 4, generator=gen), (torch.rand(32, 4, generator=gen) > 0.5).float()
    items = list(zip(features, masks, torch.randint(0, 2, (32,), generator=gen), strict=True))
    task = redline.Task(model=lambda: nn.Linear(4, 2), loss_fn=nn.functional.cross_entropy, train_data=items,
                        val_data=items[:16], collate_fn=masked, batch_size=8)  # fmt: skip
    with redline.Trainer(task, quiet_config(max_steps=2)) as trainer:
        trainer.fit()
        predicted = trainer.predict(task.val_data)
        assert trainer.model is not None
        with torch.no_grad():
            expected = trainer.model(masked(items[:16])[0])
        assert trainer.predict(features[:5]).shape == (5, 2)  # bare features: stacked, as the docs say
    torch.testing.assert_close(predicted, expected)


class Tokens(Dataset):  # type: ignore[type-arg]
    """The Sentences' items as dicts, as a tokenizer's datasets give them."""

    def __init__(self, count: int, seed: int) -> None:
        self.sentences = Sentences(count, seed)

    def __len__(self) -> int:
        return len(self.sentences)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids, label = self.sentences[index]
        return {"ids": ids, "label": label}


def pad_dicts(items: list[dict[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    return pad([(item["ids"], item["label"]) for item in items])


def test_predict_batches_dict_items_with_the_tasks_collate_fn():
    """Dict items were stacked without the collate_fn: 'stack expects each tensor to be equal size', hinting at
    predict(val_data), the very call that failed."""
    task = dataclasses.replace(sentences_task(), train_data=Tokens(32, 0), val_data=Tokens(16, 1), collate_fn=pad_dicts)
    with redline.Trainer(task, quiet_config(max_steps=1)) as trainer:
        trainer.fit()
        predicted = trainer.predict(task.val_data, batch_size=16)
        assert trainer.model is not None
        with torch.no_grad():
            expected = trainer.model(pad_dicts([task.val_data[i] for i in range(16)])[0])
        with pytest.raises(redline.TrainingError, match=r"holds, dicts of 'ids', 'label': give predict such items"):
            trainer.predict([torch.tensor([1, 2, 3]), torch.tensor([4, 5])])  # bare ids of two lengths: stacked
    torch.testing.assert_close(predicted, expected)


class PerToken(nn.Module):
    """A label per token: outputs as long as the inputs; counts its forwards."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.calls = nn.Embedding(50, 2), 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.embed(ids)


def test_outputs_whose_length_differs_between_batches_are_refused_at_the_first_that_differs():
    """They ran every batch, then failed in torch.cat: 'Sizes of tensors must match except in dimension 0'."""
    ids = [torch.arange(n) for n in (5, 5, 3, 5, 5)]
    task = redline.Task(
        model=PerToken, loss_fn=lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()),
        train_data=[(torch.arange(5), torch.zeros(5, dtype=torch.long))] * 4, batch_size=2,
    )  # fmt: skip
    with redline.Trainer(task, quiet_config(max_steps=1)) as trainer:
        trainer.fit()
        assert trainer.predict(ids[:2], batch_size=1).shape == (2, 5, 2)  # one length: joined
        assert trainer.model is not None
        trainer.model.calls = 0
        said = r"the model's output in batch 3 is of shape \(1, 3, 2\), in the first of shape \(1, 5, 2\)"
        with pytest.raises(redline.TaskError, match=said) as refused:
            trainer.predict(ids, batch_size=1)
        assert "hint: pad every batch to one length" in str(refused.value)
        assert trainer.model.calls == 3, "refused at the batch that differs, not after every batch"


class Total(nn.Module):
    """One number for the whole batch."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).sum()


def test_an_output_with_no_batch_axis_is_refused_by_name():
    task = redline.Task(model=Total, loss_fn=lambda out, y: out.square(), train_data=[(torch.ones(4), 0)] * 4,
                        batch_size=2)  # fmt: skip
    with redline.Trainer(task, quiet_config(max_steps=1)) as trainer:
        trainer.fit()
        with pytest.raises(redline.TaskError, match=r"output is a tensor of shape \(\), with no batch axis"):
            trainer.predict([torch.ones(4)], batch_size=1)
