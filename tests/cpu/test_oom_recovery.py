"""Out-of-memory recovery: "auto" halves the micro-batch and redoes the batch, ending where the small size would.

The models raise torch.OutOfMemoryError above a batch size, in forward or (through a custom autograd
function) in backward, so the real recovery path runs on the CPU.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader

import redline
from redline.errors import OutOfMemory, TaskError, TrainingError
from redline.plan import Choice
from redline.runtime import snapshot
from redline.runtime.micro import BatchRun, MicroBatcher, OomEvent
from redline.runtime.precision import Precision
from redline.runtime.samples import batch_length, take
from redline.runtime.strategy.single import SingleDevice
from redline.train.summary import TrainSummary
from redline.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from oom_models import RecomputeLimit, make_data, make_model, oom_task, out_of_memory

BATCH, STEPS = 16, 4
KINDS = ["forward", "backward"]


def batches(steps: int = STEPS, batch: int = BATCH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = make_data(steps * batch)
    return [data[i : i + batch] for i in range(0, steps * batch, batch)]


def loss_fn(model: nn.Module):
    return lambda batch: nn.functional.cross_entropy(model(batch[0]), batch[1])


def train(kind: str, limit: int | None, **options) -> tuple[redline.Runtime, nn.Module, list[float]]:
    """Train the model that runs out of memory above ``limit`` with train_step; return the Runtime, model, losses."""
    rt = redline.Runtime(devices="cpu", compile="off", **options)
    model, optimizer = rt.setup(make_model(kind, limit), lambda params: torch.optim.AdamW(params, lr=1e-2))
    losses = []
    for batch in batches():
        losses.append(rt.train_step(loss_fn(model), batch).item())
        rt.step(optimizer)
    return rt, model, losses


def assert_equal_weights(a: nn.Module, b: nn.Module, atol: float = 0.0) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.allclose(x, y, rtol=0, atol=atol), f"{name} differs by {(x - y).abs().max():.3g}"


@pytest.mark.parametrize("kind", KINDS)
def test_auto_halves_and_ends_with_the_weights_of_the_small_micro_batch_from_the_start(kind, caplog):
    _, small, small_losses = train(kind, limit=5, micro_batch=4)
    with caplog.at_level(logging.WARNING, logger="redline"):
        rt, auto, auto_losses = train(kind, limit=5, micro_batch="auto")
    # 16 and 8 ran out of memory in the first step; 4 fits: the same steps as micro-batches of 4 from the start
    assert rt.oom_events == [OomEvent(1, 16, 8, kind), OomEvent(1, 8, 4, kind)]
    assert_equal_weights(auto, small)  # the failed attempts left nothing behind: bitwise the same
    assert auto_losses == small_losses
    tried = [16, 8] if kind == "backward" else []  # a forward that fails runs no further than the check
    assert auto.sizes == [*tried, *[4] * (STEPS * 4)] and small.sizes == [4] * (STEPS * 4)
    assert rt.explain().micro_batch == Choice(4, "auto: 4 after out-of-memory at 16 (step 1), 8 (step 1)")
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and f"in {kind}): freed the memory, halved them to 8" in warnings[0]


def test_a_model_with_trainable_parameters_no_optimizer_steps_still_recovers_from_a_backward_out_of_memory():
    # Fine-tuning a head, its backbone left trainable: the backbone's gradients are never freed, which made every
    # batch after the first look mid-cycle, where a backward that failed half-way cannot be taken back.
    def run(micro_batch, limit: int | None) -> tuple[redline.Runtime, nn.Module]:
        rt = redline.Runtime(devices="cpu", compile="off", micro_batch=micro_batch)
        model = make_model("backward", limit=None)
        model, optimizer = rt.setup(model, torch.optim.AdamW(model.head.parameters(), lr=1e-2))
        for step, batch in enumerate(batches()):
            model.limit = None if step == 0 else limit  # the first step fits whole; then memory runs short
            rt.train_step(loss_fn(model), batch)
            rt.step(optimizer)
        return rt, model

    rt, auto = run("auto", limit=5)
    _, whole = run(None, limit=None)
    assert rt.oom_events == [OomEvent(2, 16, 8, "backward"), OomEvent(2, 8, 4, "backward")]
    assert_equal_weights(auto.head, whole.head, atol=1e-6)  # micro-batches of 4 from step 2: the same steps
    assert torch.equal(auto.body.weight, whole.body.weight)  # no optimizer: untouched


def recompute_run(**options) -> tuple[redline.Runtime, nn.Module]:
    rt = redline.Runtime(devices="cpu", compile="off", **options)
    torch.manual_seed(0)
    model, optimizer = rt.setup(RecomputeLimit(), lambda params: torch.optim.AdamW(params, lr=1e-2))
    for batch in batches():
        rt.train_step(loss_fn(model), batch)
        rt.step(optimizer)
    return rt, model


def test_at_one_sample_auto_turns_activation_checkpointing_on_and_redoes_the_batch_whole(caplog):
    _, reference = recompute_run(activation_checkpointing="on")
    with caplog.at_level(logging.WARNING, logger="redline"):
        rt, model = recompute_run(micro_batch="auto")
    halvings = [OomEvent(1, size, size // 2, "forward") for size in (16, 8, 4, 2)]
    assert rt.oom_events == [*halvings, OomEvent(1, 1, 16, "forward", checkpointing=True)]
    assert_equal_weights(
        model, reference
    )  # the whole batch, recomputed: as if checkpointing had been on from the start
    plan = rt.explain()
    assert plan.activation_checkpointing is not None and plan.activation_checkpointing.value is True
    assert "even micro-batches of 1 sample ran out of memory" in plan.activation_checkpointing.reason
    assert plan.micro_batch.value == "auto"  # the batches run whole again: not "1 after out-of-memory ..."
    assert plan.micro_batch.reason.startswith(
        "auto: the whole batch again from step 1, its activations recomputed: after out-of-memory at 16 (step 1), "
        "8 (step 1), 4 (step 1), 2 (step 1), even 1 sample did not fit"
    )
    assert "turned activation checkpointing on" in caplog.records[-1].getMessage()


def test_checkpointing_turned_off_leaves_the_error_at_one_sample():
    with pytest.raises(OutOfMemory, match="even one sample does not fit"):
        recompute_run(micro_batch="auto", activation_checkpointing="off")


@pytest.mark.parametrize(
    ("size", "sizes"),
    [(4, [4, 4, 4, 4]), (7, [6, 5, 5])],  # at 7, evened out: before, 7, 7 and 2 (8 at 7 was 7 and 1: no BatchNorm)
)
def test_a_fixed_micro_batch_steps_as_the_plain_loop_on_the_whole_batch(size, sizes):
    torch.manual_seed(0)
    plain = make_model()
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    plain_losses = []
    for inputs, targets in batches():
        loss = nn.functional.cross_entropy(plain(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        plain_losses.append(loss.item())
    rt, micro, losses = train("forward", limit=None, micro_batch=size)
    assert micro.sizes == sizes * STEPS and rt.oom_events == []
    assert_equal_weights(micro, plain, atol=1e-6)
    assert losses == pytest.approx(plain_losses, abs=1e-6)  # the batch's mean loss, from its micro-batches
    assert rt.explain().micro_batch.reason.startswith(f"requested: micro-batches of at most {size} samples")


class RecordingDDP(SingleDevice):
    """A one-process stand-in named "ddp" that records how the micro-batcher asks for gradient sync."""

    name = "ddp"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def gradient_sync(self, model, enabled):
        self.calls.append("sync" if enabled else "no_sync")
        return super().gradient_sync(model, enabled)

    def accumulate_locally(self, model):
        self.calls.append("local")
        return super().accumulate_locally(model)

    def average_gradients(self, model):
        self.calls.append("average")


@pytest.mark.parametrize(
    ("requested", "calls"),
    [
        (4, ["no_sync", "no_sync", "no_sync", "sync"]),  # DDP's own all-reduce runs in the last backward
        ("auto", ["local", "average"]),  # nothing communicated until the ranks agree no rank ran out of memory
    ],
)
def test_under_ddp_only_auto_gives_up_the_all_reduce_overlap(requested, calls):
    model = make_model()
    strategy = RecordingDDP()
    how = BatchRun(precision=Precision("fp32", "cpu"), strategy=strategy, models=[model], device=torch.device("cpu"),
                   accum=1, sync=True, step=1, fresh=True, snapshot_dir=None)  # fmt: skip
    MicroBatcher(requested).run(loss_fn(model), batches(steps=1)[0], how)
    assert strategy.calls == calls
    assert model.sizes == ([4] * 4 if requested == 4 else [BATCH])


def test_when_not_even_one_sample_fits_the_error_names_the_options():
    with pytest.raises(OutOfMemory) as caught:
        train("forward", limit=0, micro_batch="auto")
    message = " ".join(str(caught.value).split())
    assert "out of memory with micro-batches of 1 sample (step 1, in forward): even one sample does not fit" in message
    for option in ("bf16-mixed", "activation checkpointing", "FSDP", "redline launch --nproc N", "--strategy fsdp",
                   "a GPU with more memory", "redline memory --task SPEC"):  # fmt: skip
        assert option in message, option


def test_a_fixed_micro_batch_that_does_not_fit_points_to_auto():
    with pytest.raises(
        OutOfMemory, match=r"(?s)micro-batches of 8 samples \(step 1, in backward\).*--micro-batch auto"
    ):
        train("backward", limit=5, micro_batch=8)


def test_without_micro_batch_an_out_of_memory_propagates_as_it_was():
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        train("forward", limit=5)


def test_mid_accumulation_a_forward_out_of_memory_goes_on_with_the_rest_of_the_batch():
    """Gradients of an earlier batch of the cycle exist: the finished micro-batches stand, the rest runs halved."""
    _, small, small_losses = train("forward", limit=5, micro_batch=4, grad_accum=2)
    rt = redline.Runtime(devices="cpu", compile="off", micro_batch="auto", grad_accum=2)
    model, optimizer = rt.setup(make_model("forward", 5), lambda params: torch.optim.AdamW(params, lr=1e-2))
    fail_at = [8]  # the 2nd micro-batch of batch 2: batch 1 called forward 6 times (16 and 8 failed), batch 2 once

    def once(module: nn.Module, args: tuple[torch.Tensor]) -> None:
        fail_at[0] -= 1
        if fail_at[0] == 0:
            raise out_of_memory(args[0].shape[0])

    model.register_forward_pre_hook(once)
    losses = []
    for batch in batches():
        losses.append(rt.train_step(loss_fn(model), batch).item())
        rt.step(optimizer)
    assert [(e.from_size, e.to_size, e.step) for e in rt.oom_events] == [(16, 8, 1), (8, 4, 1), (4, 2, 1)]
    assert model.sizes[:8] == [4, 4, 4, 4, 4, 2, 2, 2]  # batch 2: one micro-batch of 4, then its 12 samples by 2
    assert_equal_weights(model, small, atol=1e-6)
    assert losses == pytest.approx(small_losses, abs=1e-6)


def test_mid_accumulation_a_backward_out_of_memory_cannot_be_undone():
    rt = redline.Runtime(devices="cpu", compile="off", micro_batch="auto", grad_accum=2)
    model, _ = rt.setup(make_model("backward", 5), lambda params: torch.optim.AdamW(params, lr=1e-2))
    inputs, targets = batches()[0]
    rt.train_step(loss_fn(model), (inputs[:4], targets[:4]))  # fits: its gradients wait for the second batch
    with pytest.raises(OutOfMemory) as caught:
        rt.train_step(loss_fn(model), (inputs, targets))
    message = str(caught.value)
    assert "accumulation cycle (grad_accum=2)" in message and "cannot be taken back" in message
    assert "hint: start with micro-batches that fit: --micro-batch 8" in message


def test_a_batch_is_split_along_its_first_axis_in_any_container():
    rt = redline.Runtime(devices="cpu", compile="off", micro_batch=3)
    model, _ = rt.setup(make_model(), lambda params: torch.optim.SGD(params, lr=0.1))
    seen = []

    def step_fn(batch: dict) -> torch.Tensor:
        seen.append((batch["x"].shape[0], batch["pair"][1].shape[0], batch["weight"].shape, batch["name"]))
        return nn.functional.cross_entropy(model(batch["x"]), batch["pair"][1]) * batch["weight"]

    x, y = make_data(8)[:]
    rt.train_step(step_fn, {"x": x, "pair": (x, y), "weight": torch.tensor(2.0), "name": "kept"})
    assert seen == [(3, 3, (), "kept"), (3, 3, (), "kept"), (2, 2, (), "kept")]


def test_a_field_of_plain_values_per_sample_is_split_with_the_tensors():
    """default_collate batches a string (or number) field of the samples into a list as long as the batch: each
    micro-batch gets its own samples' values, as a Hugging Face style batch's ids or texts beside its tensors."""
    rt = redline.Runtime(devices="cpu", compile="off", micro_batch=3)
    model, _ = rt.setup(make_model(), lambda params: torch.optim.SGD(params, lr=0.1))
    x, y = make_data(8)[:]
    ids = [f"sample-{i}" for i in range(8)]
    loader = DataLoader([{"x": x[i], "y": y[i], "id": ids[i], "weight": float(i)} for i in range(8)], batch_size=8)
    batch = next(iter(loader))
    assert batch["id"] == ids and isinstance(batch["weight"], torch.Tensor)  # numbers collate to a tensor
    batch["shape"], batch["tags"] = [4, 4], ("a", "b", "c", "d", "e", "f", "g", "h")  # a shared value; a tuple
    seen = []

    def step_fn(part: dict) -> torch.Tensor:
        assert len(part["id"]) == part["x"].shape[0] == len(part["tags"])
        seen.append((part["id"], part["shape"], part["tags"]))
        return nn.functional.cross_entropy(model(part["x"]), part["y"])

    rt.train_step(step_fn, batch)
    assert [ids for ids, _, _ in seen] == [ids[0:3], ids[3:6], ids[6:8]]
    assert all(shape == [4, 4] for _, shape, _ in seen)  # not as long as the batch: given whole
    assert seen[2][2] == ("g", "h")


def test_a_list_of_one_target_per_sample_is_split_with_its_samples_and_steps_as_the_whole_batch():
    """A detection-style batch: images and a list of one target per sample, of different lengths (tensors, or
    dicts of tensors). Each micro-batch gets its own samples' targets, not every sample's, nor the rows of a
    target whose length happens to be the batch's; and the step is the whole batch's."""
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(4, 3, generator=gen)
    lengths = (2, 4, 1, 3)  # the second has 4 rows: as many as the batch has samples
    targets = [torch.randn(n, 1, generator=gen) for n in lengths]
    boxes = [{"boxes": t, "labels": torch.zeros(len(t), dtype=torch.long)} for t in targets]

    def grads(micro_batch, which) -> tuple[torch.Tensor, list]:
        rt = redline.Runtime(devices="cpu", compile="off", micro_batch=micro_batch)
        torch.manual_seed(0)
        model, _ = rt.setup(nn.Linear(3, 1), lambda params: torch.optim.SGD(params, lr=0.1))
        seen = []

        def step_fn(batch) -> torch.Tensor:
            x, per_sample, meta = batch
            ys = [t["boxes"] if isinstance(t, dict) else t for t in per_sample]
            seen.append(([len(y) for y in ys], [m["id"] for m in meta]))
            out = model(x)
            return torch.stack([((out[i] - ys[i]) ** 2).mean() for i in range(len(x))]).mean()

        meta = [{"id": f"image-{i}"} for i in range(4)]  # one dict of plain values per sample
        rt.train_step(step_fn, (images, which, meta))
        return model.weight.grad.clone(), seen

    for which in (targets, boxes):
        whole, _ = grads(None, which)
        split, seen = grads(2, which)
        assert seen == [([2, 4], ["image-0", "image-1"]), ([1, 3], ["image-2", "image-3"])]
        assert torch.allclose(split, whole, rtol=0, atol=1e-6), (split, whole)


def detection_step(model: nn.Module, seen: list):
    def step_fn(batch) -> torch.Tensor:
        images, targets = ([s["image"] for s in batch], batch) if isinstance(batch, list) else batch
        seen.append([tuple(image.shape) for image in images])
        pairs = zip(images, targets, strict=True)
        losses = [((model(image.mean((1, 2))) - t["boxes"]) ** 2).mean() for image, t in pairs]
        return torch.stack(losses).mean()

    return step_fn


@pytest.mark.parametrize("form", ["zip", "dicts"])
def test_a_batch_of_per_sample_images_and_targets_is_cut_by_sample_not_by_channel(form):
    """torchvision's detection collation (``tuple(zip(*samples))``: a tuple of images of their own sizes, one of
    target dicts) and a plain list of per-sample dicts hold 4 samples of 3 channels: cut by channel, each micro-batch
    had every image, with one or two of its channels."""
    gen = torch.Generator().manual_seed(0)
    images = tuple(torch.randn(3, 5 + i, 5, generator=gen) for i in range(4))
    targets = tuple({"boxes": torch.randn(i + 1, 1, generator=gen)} for i in range(4))
    batch = (images, targets) if form == "zip" else [{"image": x, **t} for x, t in zip(images, targets, strict=True)]

    def grads(micro_batch) -> tuple[torch.Tensor, list]:
        rt = redline.Runtime(devices="cpu", compile="off", micro_batch=micro_batch)
        torch.manual_seed(0)
        model, _ = rt.setup(nn.Linear(3, 1), lambda params: torch.optim.SGD(params, lr=0.1))
        seen: list = []
        rt.train_step(detection_step(model, seen), batch)
        return model.weight.grad.clone(), seen

    whole, _ = grads(None)
    split, seen = grads(2)
    assert seen == [[(3, 5, 5), (3, 6, 5)], [(3, 7, 5), (3, 8, 5)]]
    assert torch.allclose(split, whole, rtol=0, atol=1e-6), (split, whole)


def test_a_batch_whose_parts_agree_on_no_sample_count_is_refused_not_cut_by_channel():
    images = tuple(torch.randn(3, 5 + i, 5) for i in range(4))
    targets = tuple({"boxes": torch.randn(i + 1, 1)} for i in range(5))  # five targets for four images
    rt = redline.Runtime(devices="cpu", compile="off", micro_batch=2)
    model, _ = rt.setup(nn.Linear(3, 1), lambda params: torch.optim.SGD(params, lr=0.1))
    with pytest.raises(TaskError, match=r"cannot tell how many samples(.|\n)*torch.stack\(images\)"):
        rt.train_step(detection_step(model, []), (images, targets))


def test_a_pair_of_dicts_holding_the_batch_is_read_as_its_fields():
    ids, labels = torch.zeros(8, 5, dtype=torch.long), torch.zeros(8, dtype=torch.long)
    assert batch_length(({"input_ids": ids}, {"labels": labels})) == 8  # not two samples
    assert batch_length([{"input_ids": ids[i], "label": 1} for i in range(8)]) == 8


def test_a_tensor_shared_by_the_samples_beside_the_inputs_is_given_whole_not_refused():
    # A tuple of inputs holding a tensor that is not per sample (a position table, a temperature, class embeddings)
    # read as a list of one tensor per sample of another length: the batch was refused at step 1.
    x, y = torch.zeros(8, 5), torch.zeros(8)
    for shared in (torch.arange(5), torch.tensor(0.5), torch.zeros(10, 3)):
        batch = ((x, shared), y)
        assert batch_length(batch) == 8
        (cut_x, cut_shared), cut_y = take(batch, 2, 6, 8)
        assert cut_x.shape[0] == cut_y.shape[0] == 4 and cut_shared is shared


@pytest.mark.parametrize("channels", [1, 3])
def test_a_detection_batch_whose_targets_have_as_many_boxes_as_the_images_channels_counts_its_images(channels):
    # Every target holding `channels` boxes: the images' shared first axis (their channels) fitted every part, so
    # a batch of 8 was read as 3 (or 1) samples and cut by channel.
    images = tuple(torch.zeros(channels, 6 + i, 6) for i in range(8))
    targets = tuple({"boxes": torch.zeros(channels, 4), "labels": torch.zeros(channels)} for _ in range(8))
    assert batch_length((images, targets)) == 8
    cut_images, cut_targets = take((images, targets), 0, 4, 8)
    assert [tuple(i.shape) for i in cut_images] == [(channels, 6 + i, 6) for i in range(4)]
    assert len(cut_targets) == 4 and cut_targets[0]["boxes"].shape == (channels, 4)


# -- the memory snapshot ------------------------------------------------------------------------


def test_a_snapshot_is_written_on_cuda_only(tmp_path, monkeypatch):
    assert snapshot.write_memory_snapshot(torch.device("cpu"), tmp_path, "x") is None
    assert list(tmp_path.iterdir()) == []
    dumped, recorded = [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: (dumped.append(path), Path(path).touch()))
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **k: recorded.append(k))
    path = snapshot.write_memory_snapshot(torch.device("cuda"), tmp_path / "run", "memory-snapshot-step3")
    assert path == tmp_path / "run" / "memory-snapshot-step3.pickle" and dumped == [str(path)] and path.exists()
    assert snapshot.write_memory_snapshot(torch.device("cuda"), None, "x") is None  # no directory: nothing
    with snapshot.record_memory_history(torch.device("cuda")):
        assert recorded == [{"max_entries": 100_000}]
    assert recorded[-1] == {"enabled": None}  # recording stops when the run does
    with snapshot.record_memory_history(torch.device("cpu")):
        pass
    assert len(recorded) == 2


def test_a_snapshot_that_fails_is_a_warning_not_a_second_error(tmp_path, monkeypatch, caplog):
    def broken(path: str) -> None:
        raise RuntimeError("no history")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", broken)
    with caplog.at_level(logging.WARNING, logger="redline"):
        assert snapshot.write_memory_snapshot(torch.device("cuda"), tmp_path, "x") is None
    assert "could not write the memory snapshot" in caplog.text and "no history" in caplog.text


def test_each_out_of_memory_writes_a_snapshot_that_its_event_and_error_name(tmp_path, monkeypatch):
    written = []

    def fake(device: torch.device, directory: Path | None, name: str) -> Path:
        written.append((directory, name))
        return tmp_path / f"{name}.pickle"

    monkeypatch.setattr("redline.runtime.micro.write_memory_snapshot", fake)
    rt = redline.Runtime(devices="cpu", compile="off", micro_batch="auto")
    rt.snapshot_dir = tmp_path
    model, _ = rt.setup(make_model("forward", 0), lambda params: torch.optim.SGD(params, lr=0.1))
    with pytest.raises(OutOfMemory, match=r"memory snapshot: .*memory-snapshot-step1-micro1\.pickle"):
        rt.train_step(loss_fn(model), batches()[0])
    assert [name for _, name in written] == [f"memory-snapshot-step1-micro{n}" for n in (16, 8, 4, 2, 1)]
    assert {directory for directory, _ in written} == {tmp_path}
    assert rt.oom_events[0].snapshot == tmp_path / "memory-snapshot-step1-micro16.pickle"


# -- the Trainer --------------------------------------------------------------------------------


def fit(micro_batch, kind: str = "forward", limit: int | None = 5, **config) -> tuple[Trainer, TrainSummary]:
    trainer = Trainer(
        oom_task(kind, limit),
        runtime=redline.RuntimeOptions(devices="cpu", compile="off", seed=0, micro_batch=micro_batch),
        **{"max_steps": STEPS, **config},
        trial="off",
        progress=False,
    )
    with trainer:
        return trainer, trainer.fit()


@pytest.mark.parametrize("kind", KINDS)
def test_the_trainer_recovers_and_ends_with_the_weights_of_the_small_micro_batch(kind):
    (auto, summary), (small, small_summary) = fit("auto", kind), fit(4, kind)
    assert auto.rt is not None and small.rt is not None
    assert_equal_weights(auto.rt.module, small.rt.module)
    recovered = [(r["step"], r["from_size"], r["to_size"], r["where"]) for r in summary.oom_recoveries]
    assert recovered == [(1, 16, 8, kind), (1, 8, 4, kind)] and small_summary.oom_recoveries == []
    assert summary.plan.micro_batch.value == 4 and summary.steps == STEPS
    assert summary.final_loss == small_summary.final_loss


def test_the_trainer_without_micro_batch_says_how_to_recover():
    with pytest.raises(OutOfMemory) as caught:
        fit(None)
    message = str(caught.value)
    assert message.startswith("step 1: the device ran out of memory: OutOfMemoryError: CUDA out of memory")
    assert "hint: --micro-batch auto" in message
    assert isinstance(caught.value, TrainingError) and isinstance(caught.value.__cause__, torch.OutOfMemoryError)


def test_a_resumed_auto_run_starts_from_the_size_it_had_found(tmp_path):
    fit("auto", out_dir=tmp_path, checkpoint_every=2)
    resumed = Trainer(
        oom_task("forward", 5),
        runtime=redline.RuntimeOptions(devices="cpu", compile="off", seed=0, micro_batch="auto"),
        max_steps=STEPS + 2,
        trial="off",
        progress=False,
        out_dir=tmp_path,
        resume="auto",
    )
    with resumed:
        summary = resumed.fit()
    assert resumed.rt is not None  # no size that had failed is tried again: the recoveries are the first run's
    assert [(e.step, e.from_size) for e in resumed.rt.oom_events] == [(1, 16), (1, 8)]
    assert set(resumed.rt.module.sizes) == {4}
    micro = summary.plan.micro_batch
    assert micro.value == 4
    assert micro.reason == f"from checkpoint step {STEPS}: auto: 4 after out-of-memory at 16 (step 1), 8 (step 1)"
    stored = json.loads((tmp_path / "summary.json").read_text())
    assert stored["plan"]["micro_batch"] == {"value": 4, "reason": micro.reason}


# -- distributed: two gloo processes, one of which runs out of memory ------------------------------

JOB = str(Path(__file__).with_name("oom_job.py"))


def run_job(out: Path, *args: str, nproc: int | None = 2) -> list[dict]:
    """Run the job (under launch with ``nproc``) and return each rank's findings; a hang fails after 120 s."""
    launch = [sys.executable, "-m", "redline", "launch", "--nproc", str(nproc)] if nproc else [sys.executable]
    job = subprocess.Popen(
        [*launch, JOB, str(out), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # a hung job's workers are ended with it
    )  # fmt: skip
    try:
        _, stderr = job.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        job.communicate()
        pytest.fail(f"the job hung: {' '.join(args)}")
    assert job.returncode == 0, stderr[-3000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(nproc or 1)]


def weights_of(out: Path, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(out / f"weights-rank{rank}.pt")


@pytest.fixture(scope="module")
def small_from_the_start(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("small")
    run_job(out, "--micro-batch", "4")
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_two_processes_agree_when_one_runs_out_of_memory(tmp_path, kind, small_from_the_start):
    ranks = run_job(tmp_path, "--micro-batch", "auto", "--fail-rank", "1", "--kind", kind)  # no hang: it returns
    for found in ranks:
        assert [(e["from_size"], e["to_size"], e["where"]) for e in found["events"]] == [(16, 8, kind), (8, 4, kind)]
        assert found["micro_batch"]["value"] == 4 and "DDP" in found["micro_batch"]["reason"]
    assert ranks[0]["sizes"][:7] == [16, 8, 8, 4, 4, 4, 4]  # rank 0 had room, and went the way rank 1 needed
    assert set(ranks[1]["sizes"]) == ({4} if kind == "forward" else {16, 8, 4})
    for rank in (0, 1):
        for name, tensor in weights_of(small_from_the_start, 0).items():
            assert torch.equal(weights_of(tmp_path, rank)[name], tensor), (rank, name)


def test_two_processes_with_micro_batches_average_the_gradients_as_one_process(tmp_path, small_from_the_start):
    """Gradients accumulated locally and all-reduced once give the weights of one process with the whole batch."""
    (tmp_path / "one").mkdir()
    run_job(tmp_path / "one", "--micro-batch", "4", nproc=None)
    one, two = weights_of(tmp_path / "one", 0), weights_of(small_from_the_start, 0)
    for name, tensor in one.items():
        assert torch.allclose(two[name], tensor, rtol=0, atol=1e-6), name
    assert all(torch.equal(weights_of(small_from_the_start, 1)[n], t) for n, t in two.items())


def test_fsdp_takes_a_fixed_micro_batch_and_refuses_auto(tmp_path, small_from_the_start):
    ranks = run_job(tmp_path, "--micro-batch", "4", "--strategy", "fsdp")  # reduced in the last one's backward
    assert all(set(found["sizes"]) == {4} and "FSDP" in found["micro_batch"]["reason"] for found in ranks)
    fsdp, ddp = load_file(tmp_path / "model.safetensors"), load_file(small_from_the_start / "model.safetensors")
    for name, tensor in ddp.items():
        assert torch.allclose(fsdp[name], tensor, rtol=0, atol=1e-6), name
    refused = subprocess.run(
        [sys.executable, "-m", "redline", "launch", "--nproc", "2", JOB, str(tmp_path), "--strategy", "fsdp"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert refused.returncode != 0 and "micro_batch='auto' is not supported with strategy 'fsdp'" in refused.stderr


# -- the command line ---------------------------------------------------------------------------


def test_redline_train_takes_micro_batch_auto(tmp_path, redline_here):
    spec = f"{Path(__file__).with_name('oom_models.py')}:oom_task"
    args = ["train", "--task", spec, "--max-steps", "2", "--trial", "off", "--no-progress", "--json"]
    result = redline_here(*args, "--micro-batch", "auto")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["plan"]["micro_batch"]["value"] == 4 and len(summary["oom_recoveries"]) == 2
    assert "halved them to 8" in result.stderr
    wrong = redline_here(*args, "--micro-batch", "half")
    assert (
        wrong.returncode == 2
        and "--micro-batch='half' is not allowed; expected 'auto', a positive number of samples\n" in wrong.stderr
        and "Traceback" not in wrong.stderr
    )


def test_auto_halving_a_batch_norm_model_to_one_sample_ends_in_out_of_memory_not_torchs_value_error():
    class NormedLimit(nn.Module):  # a BatchNorm1d over (N, C) refuses one sample in training
        def __init__(self) -> None:
            super().__init__()
            self.body, self.norm, self.head = nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Linear(16, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.training and x.shape[0] > 1:
                raise out_of_memory(x.shape[0])
            return self.head(self.norm(self.body(x)))

    said = (
        r"micro-batches of 2 samples \(step 1\), and the model cannot train on 1: "
        r"Expected more than 1 value per channel.*\nhint: make a sample need less memory"
    )
    rt = redline.Runtime(devices="cpu", compile="off", micro_batch="auto", activation_checkpointing="off")
    model, _ = rt.setup(NormedLimit(), lambda params: torch.optim.AdamW(params, lr=1e-2))
    with pytest.raises(OutOfMemory, match=said):
        rt.train_step(loss_fn(model), batches()[0])
    task = redline.Task(model=NormedLimit, loss_fn=nn.functional.cross_entropy, train_data=make_data(16), batch_size=8)
    options = redline.RuntimeOptions(devices="cpu", micro_batch="auto", activation_checkpointing="off")
    with pytest.raises(OutOfMemory, match=said), Trainer(task, runtime=options, max_steps=1, progress=False) as run:
        run.fit()  # through the Trainer, whose loop wraps the model's own errors


def test_a_resumed_run_keeps_the_out_of_memory_recoveries_of_the_run_it_goes_on(tmp_path):
    """The summary of a resumed run listed none: the recoveries lived in the first process only."""
    _, summary = fit("auto", max_steps=2, out_dir=tmp_path / "run", checkpoint_every=2)
    assert len(summary.oom_recoveries) == 2
    again, resumed = fit("auto", max_steps=STEPS, out_dir=tmp_path / "run", resume="auto")
    assert resumed.resumed_from is not None and resumed.oom_recoveries == summary.oom_recoveries
    assert again.rt is not None and again.rt.oom_events[0].from_size == 16
