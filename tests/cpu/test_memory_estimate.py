"""estimate_memory: a training step's peak, traced on fake tensors, against an independent measurement."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.data import TensorDataset

from redline.errors import ConfigError, RedlineError, TrainingError
from redline.memory.estimate import estimate_memory
from redline.task import Task, load_task

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).parent))
from mistake_tasks import mistake

import memory_accuracy


def small_gpt() -> Task:
    return load_task("example:chargpt", n_layer=2, n_head=2, n_embd=64, block_size=32, max_chars=20_000)


def mlp_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))


def mlp(model: nn.Module | None = None) -> Task:
    data = TensorDataset(torch.randn(256, 64), torch.randint(0, 10, (256,)))
    return Task(
        model=model if model is not None else mlp_model,
        loss_fn=nn.functional.cross_entropy,
        train_data=data,
        batch_size=32,
        name="mlp",
    )


@pytest.mark.parametrize(
    ("task", "precision", "batch"),
    [
        (mlp, "fp32", 64),
        (small_gpt, "fp32", 16),
        (small_gpt, "bf16-mixed", 16),
        (lambda: load_task("example:digits"), "fp32", 128),
    ],
)
def test_the_estimate_is_within_ten_percent_of_the_profiler(task, precision, batch) -> None:
    built = task()
    estimate = estimate_memory(built, batch_size=batch, precision=precision, target="cpu")
    measured = memory_accuracy.measured_peak(built, batch, precision, "cpu")
    assert abs(estimate.peak / measured - 1) <= 0.10, (estimate.peak, measured)
    assert estimate.total == estimate.peak  # no workspace allowance on a CPU


def test_model_states_are_counted_exactly() -> None:
    task = mlp()
    param_bytes = sum(p.numel() * 4 for p in task.build_model().parameters())
    estimate = estimate_memory(task, batch_size=32, target="cuda")
    assert estimate.params == param_bytes
    # AdamW keeps two moments per parameter, plus a step count per tensor
    assert 2 * param_bytes <= estimate.optimizer_state <= 2 * param_bytes + 4 * 64
    states = estimate.params + estimate.buffers + estimate.gradients + estimate.optimizer_state
    assert estimate.peak == states + estimate.activations
    assert estimate.workspace > 0 and estimate.total == estimate.peak + estimate.workspace


class WithTable(nn.Module):
    """An MLP that keeps a lookup table as a buffer: a model state, not an activation."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = mlp_model()
        self.register_buffer("table", torch.zeros(1000, 1000, dtype=torch.int8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


def test_buffers_are_counted_as_buffers_not_activations() -> None:
    plain = estimate_memory(mlp(), target="cpu")
    estimate = estimate_memory(mlp(WithTable), target="cpu")
    assert estimate.buffers == 1000 * 1000 and plain.buffers == 0
    assert estimate.activations == plain.activations and estimate.params == plain.params


def test_activations_follow_the_batch_the_precision_and_checkpointing() -> None:
    task = small_gpt()
    base = estimate_memory(task, batch_size=8)
    double = estimate_memory(task, batch_size=16)
    assert 1.7 < double.activations / base.activations < 2.3
    assert estimate_memory(task, batch_size=16, precision="bf16-mixed").activations < double.activations
    checkpointed = estimate_memory(task, batch_size=16, activation_checkpointing=True)
    assert checkpointed.activations < double.activations
    assert base.top_modules and all(name for name, _ in base.top_modules)
    assert base.top_modules[0][0].startswith("blocks.")


def test_fsdp_shards_the_model_states_and_ddp_holds_the_gradients() -> None:
    task = load_task("example:chargpt", n_layer=8, n_head=2, n_embd=64, block_size=32, max_chars=20_000)
    single = estimate_memory(task, batch_size=16, target="cuda")
    sharded = estimate_memory(task, batch_size=16, strategy="fsdp", world_size=4, target="cuda")
    assert sharded.optimizer_state == pytest.approx(single.optimizer_state / 4, abs=4)
    model = task.build_model()
    block = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    in_blocks = {id(p) for p in model.blocks.parameters()}
    root = sum(p.numel() * 4 for p in model.parameters() if id(p) not in in_blocks)  # embeddings, tied head, norm
    assert root > 0
    # its shard, two blocks gathered whole, and the root's own, held from the forward to the backward
    assert sharded.params == -(-single.params // 4) + 2 * block + root
    assert sharded.peak < single.peak
    ddp = estimate_memory(task, batch_size=16, strategy="ddp", world_size=2, target="cuda")
    assert ddp.gradients >= single.params  # DDP's buckets hold them through the step


def test_micro_batches_accumulating_a_step_hold_the_gradients_through_it_under_fsdp_unsharded() -> None:
    task = load_task("example:chargpt", n_layer=8, n_head=2, n_embd=64, block_size=32, max_chars=20_000)
    single = estimate_memory(task, batch_size=8, target="cuda")
    assert single.gradients < single.params  # CUDA frees them right after the step: not all alive at its peak
    accumulating = estimate_memory(task, batch_size=8, target="cuda", grad_accum=4)
    assert accumulating.gradients == single.params  # fp32: one gradient per trainable parameter
    assert accumulating.peak == single.peak + single.params - single.gradients
    assert accumulating.grad_accum == 4 and any("accumulates 4 micro-batches" in n for n in accumulating.notes)
    sharded = estimate_memory(task, batch_size=8, strategy="fsdp", world_size=4, target="cuda")
    unsynced = estimate_memory(task, batch_size=8, strategy="fsdp", world_size=4, target="cuda", grad_accum=4)
    assert sharded.gradients <= -(-single.params // 4) < unsynced.gradients == single.params
    with pytest.raises(ConfigError, match="grad_accum"):
        estimate_memory(task, batch_size=8, grad_accum=0)


def test_a_given_module_is_traced_on_a_copy_and_left_as_it_was() -> None:
    model = mlp_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    given = estimate_memory(mlp(model), batch_size=32)
    built = estimate_memory(mlp(), batch_size=32)
    assert given.peak == built.peak
    for name, tensor in model.state_dict().items():
        assert not isinstance(tensor, FakeTensor) and torch.equal(tensor, before[name])


class Uncopyable(nn.Parameter):
    """A weight that refuses to be copied, as a large model on a GPU should not be: copying it would take the
    memory being estimated."""

    def __deepcopy__(self, memo: dict[int, object]) -> nn.Parameter:
        raise AssertionError("the estimate copied the model's weights")


def test_a_given_module_s_weights_are_not_copied_for_the_trace() -> None:
    model = mlp_model()
    tied = Uncopyable(model[0].weight.detach())
    model[0].weight = tied
    estimate = estimate_memory(mlp(model), batch_size=32, target="cuda")
    assert estimate.params == estimate_memory(mlp(), batch_size=32, target="cuda").params
    assert model[0].weight is tied


def tied_model() -> nn.Module:
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    model[2].weight = model[0].weight
    return model


@pytest.mark.parametrize("given", [False, True])
def test_tied_weights_are_counted_once(given: bool) -> None:
    estimate = estimate_memory(mlp(tied_model() if given else tied_model), batch_size=32, target="cuda")
    assert estimate.params == (64 * 64 + 64 + 64 + 64 * 10 + 10) * 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"precision": "fp8"}, "precision='fp8'"),
        ({"strategy": "single", "world_size": 2}, "world_size=2"),
        ({"target": "tpu"}, "target='tpu'"),
        ({"batch_size": 0}, "batch_size"),
        # an optimizer already built (on other parameters) where a factory belongs, named before any trace
        ({"optimizer": torch.optim.SGD(nn.Linear(2, 2).parameters())}, r"optimizer=<SGD> is not.*\n.*lambda params"),
        ({"optimizer": "adamw"}, "optimizer='adamw'"),
        ({"activation_checkpointing": "off"}, "activation_checkpointing='off' is not allowed; expected True or False"),
    ],
)
def test_bad_arguments_name_the_problem(kwargs, message) -> None:
    with pytest.raises(ConfigError, match=message):
        estimate_memory(mlp(), **kwargs)


@pytest.mark.parametrize("precision", ["fp16-mixed", "bf16-mixed"])
def test_a_half_model_under_mixed_precision_is_refused_as_a_run_refuses_it(precision) -> None:
    half = mlp(lambda: mlp_model().half())
    with pytest.raises(ConfigError, match=rf"precision='{precision}' got a model with 19,210 float16 parameters"):
        estimate_memory(half, precision=precision)
    assert estimate_memory(half, precision="fp32").params == 19_210 * 2, "fp32 trains it as it is"


@pytest.mark.parametrize(
    ("kwargs", "hint"),
    [
        ({"precision": "bf16"}, "did you mean precision='bf16-mixed'?"),
        ({"precision": "auto"}, "auto is resolved on the device: pass what it picks there ('bf16-mixed' on an"),
        ({"strategy": "fsdp2", "world_size": 2}, "did you mean strategy='fsdp'?"),
        ({"target": "gpu"}, "did you mean target='cuda'?"),  # not 'cpu', the closest in spelling
    ],
)
def test_a_value_close_to_an_allowed_one_is_refused_with_the_one_it_meant(kwargs, hint) -> None:
    with pytest.raises(ConfigError) as refused:
        estimate_memory(mlp(), **kwargs)
    assert str(refused.value).split("\nhint: ")[1].startswith(hint)


@pytest.fixture
def memory_cli(redline_here):
    """`redline memory ARGS` in this process, on a terminal 120 columns wide."""
    return functools.partial(redline_here, "memory", env={"COLUMNS": "120"})


def test_redline_memory_json_weighs_each_way_against_the_gpu(memory_cli) -> None:
    done = memory_cli("--task", "example:chargpt", "--task-arg", "n_layer=2", "--task-arg", "n_embd=64",
                   "--task-arg", "block_size=32", "--task-arg", "max_chars=20000", "--gpu", "l4", "--gpus", "4",
                   "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["device"] == "NVIDIA L4" and result["target"] == "cuda"
    assert result["mem_gib"] == 22.03  # what torch reads on an L4, not the datasheet's 24
    labels = [row["label"] for row in result["rows"]]
    assert labels == ["as it stands", "activation checkpointing", "FSDP over 4 GPUs", "FSDP over 4 GPUs, checkpointing"]
    first = result["rows"][0]
    assert first["fits"] is True and first["largest_batch"] > first["estimate"]["batch_size"]
    assert first["estimate"]["precision"] == "bf16-mixed"  # what a run on an L4 picks
    assert result["rows"][2]["largest_batch"] % 4 == 0


def test_redline_memory_table_and_a_gpu_too_small(memory_cli) -> None:
    done = memory_cli("--task", "example:digits", "--mem-gib", "0.5")
    assert done.returncode == 0, done.stderr
    assert "total peak" in done.stdout and "largest batch" in done.stdout and "none" in done.stdout


def test_redline_memory_unknown_gpu_is_one_clear_line(memory_cli) -> None:
    done = memory_cli("--task", "example:digits", "--gpu", "voodoo-2")
    assert done.returncode == 2
    assert "not in the GPU catalog" in done.stderr and "Traceback" not in done.stderr


def test_the_model_is_built_once_for_the_trace_and_once_for_its_structure() -> None:
    calls = []

    def counted() -> nn.Module:
        calls.append(1)
        return mlp_model()

    task = dataclasses.replace(mlp(), model=counted)
    estimate_memory(task, batch_size=8, strategy="ddp", world_size=2, target="cuda")
    assert len(calls) == 2  # one under the fake mode, one on the meta device for DDP's buckets


def test_the_caller_s_no_grad_or_inference_mode_does_not_change_the_estimate() -> None:
    plain = estimate_memory(mlp(), batch_size=16, target="cpu")
    with torch.no_grad():
        assert estimate_memory(mlp(), batch_size=16, target="cpu") == plain
    with torch.inference_mode():
        assert estimate_memory(mlp(), batch_size=16, target="cpu") == plain
    assert torch.is_grad_enabled()


class ReadsValues(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        return out * 2 if out.sum().item() > 0 else out  # data-dependent: fake tensors hold no values


def test_a_model_that_cannot_be_traced_says_so_and_names_the_measured_search() -> None:
    task = dataclasses.replace(mlp(), model=ReadsValues)
    with pytest.raises(TrainingError, match=r"(?s)fake tensors.*DataDependentOutputException.*--measure"):
        estimate_memory(task, target="cpu")


class ClipsByNorm(torch.optim.SGD):
    """An optimizer whose step reads a value, as torch.optim.Adafactor reads its step count and norms."""

    def step(self, closure=None):
        norm = self.param_groups[0]["params"][0].grad.norm().item()
        return super().step(closure) if norm < 1e6 else None


@pytest.mark.parametrize("optimizer", ["Adafactor", "ClipsByNorm"])
def test_an_optimizer_that_reads_values_is_named_as_what_cannot_be_traced(optimizer: str) -> None:
    """Before, the hint blamed an .item() in the user's code for Adafactor's own."""
    made = getattr(torch.optim, optimizer, None) or ClipsByNorm
    if optimizer == "Adafactor" and made is ClipsByNorm:
        pytest.skip("torch.optim.Adafactor is torch 2.5's")
    with pytest.raises(TrainingError) as caught:
        estimate_memory(mlp(), target="cpu", optimizer=lambda params: made(params, lr=0.1))
    message = str(caught.value)
    assert message.startswith(
        f"task 'mlp': the optimizer's step could not be traced on fake tensors: {optimizer}.step reads a tensor's "
        "value (DataDependentOutputException: aten._local_scalar_dense.default), which fake tensors do not hold"
    )
    assert ("in step: norm = " in message) == (optimizer == "ClipsByNorm")  # the user's own line, where theirs
    assert "\nhint: find the largest batch by running training steps on the device instead: redline memory" in message
    assert message.endswith(f"(AdamW, SGD), not {optimizer}")


@pytest.mark.parametrize("batch_size", [2**62, 10**19])  # a batch size typed with zeros too many
def test_a_batch_too_large_for_any_tensor_says_so_instead_of_blaming_the_model(batch_size: int) -> None:
    with pytest.raises(TrainingError, match=r"(?si)overflow.*\nhint: a tensor of this size cannot exist.*smaller"):
        estimate_memory(mlp(), batch_size=batch_size, target="cpu")


def test_a_shape_mistake_is_said_once_without_torch_logging_its_traceback() -> None:
    task = dataclasses.replace(mlp(), model=lambda: nn.Linear(63, 10))  # the data has 64 features
    torch_log = logging.getLogger("torch._subclasses.fake_tensor")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    torch_log.addHandler(handler)
    try:
        with pytest.raises(TrainingError, match=r"could not be traced on fake tensors: RuntimeError: .*\[63, 10\]"):
            estimate_memory(task, target="cpu")
    finally:
        torch_log.removeHandler(handler)
    assert not records, [record.getMessage() for record in records]  # torch's traceback, before the error
    assert not torch_log.disabled  # torch's own logging is left as it was


# kind of tests/cpu/mistake_tasks.py -> what `redline train` says of it too, and the hint's first words
TASK_MISTAKES = {
    "loss_per_sample": (r"returned a tensor of shape \(8,\); expected a scalar", "reduce the per-sample losses"),
    "loss_number": (r"returned float 1\.0; expected a scalar tensor", "compute the loss with torch operations"),
    "loss_detached": (r"does not depend on the model's parameters", "build the loss from the model's outputs"),
    "listed_layers": (r"the model \(ListedLayers\) has no parameters", "make its layers attributes"),
    "key_error": (r"KeyError: 'pixels'\n  at .*mistake_tasks\.py:\d+ in forward", "if the line shown is a bug"),
}


@pytest.mark.parametrize("kind", TASK_MISTAKES)
def test_a_mistake_in_the_task_is_named_as_training_names_it_not_blamed_on_fake_tensors(kind: str) -> None:
    message, hint = TASK_MISTAKES[kind]
    with pytest.raises(RedlineError, match=f"(?s){message}.*\nhint: {hint}") as caught:
        estimate_memory(mistake(kind), target="cpu")
    assert "fake tensors hold no values" not in str(caught.value)


def frozen_first_layer() -> nn.Module:
    model = mlp_model()
    model[0].requires_grad_(False)  # a frozen backbone: no gradient, no DDP bucket
    return model


def test_ddp_buckets_hold_only_the_trainable_parameters_gradients() -> None:
    task = dataclasses.replace(mlp(), model=frozen_first_layer)
    trainable = sum(p.numel() * 4 for p in frozen_first_layer().parameters() if p.requires_grad)
    for target in ("cpu", "cuda"):
        ddp = estimate_memory(task, batch_size=16, strategy="ddp", world_size=2, target=target)
        assert ddp.gradients == trainable


def test_fsdp_without_mixed_precision_gathers_blocks_in_their_own_dtype() -> None:
    data = TensorDataset(torch.randn(64, 64, dtype=torch.bfloat16), torch.randint(0, 10, (64,)))

    def bf16_mlp() -> nn.Module:
        half = torch.bfloat16
        return nn.Sequential(nn.Linear(64, 256, dtype=half), nn.ReLU(), nn.Linear(256, 10, dtype=half))

    task = Task(model=bf16_mlp, loss_fn=nn.functional.cross_entropy, train_data=data, batch_size=16, name="bf16")
    single = estimate_memory(task, target="cuda")
    sharded = estimate_memory(task, strategy="fsdp", world_size=4, target="cuda")
    largest = 256 * 64 + 256  # the first Linear's weights and bias, 2 bytes each: FSDP casts nothing in fp32
    assert sharded.params == -(-single.params // 4) + 2 * largest * 2


class ManyItems(torch.utils.data.Dataset):
    """A dataset of a million items that counts the items read."""

    def __init__(self) -> None:
        self.reads = 0

    def __len__(self) -> int:
        return 1_000_000

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads += 1
        return torch.zeros(64), torch.tensor(index % 10)


def test_a_large_batch_is_traced_without_collating_it_for_real() -> None:
    data = ManyItems()
    task = dataclasses.replace(mlp(), train_data=data)
    large = estimate_memory(task, batch_size=2**19, target="cpu")  # 128 MiB of inputs, none of it allocated
    assert data.reads <= 2
    assert large.activations > 2**19 * 64 * 4  # the batch's inputs are still counted, at full size
    small = estimate_memory(mlp(), batch_size=64, target="cpu")
    assert estimate_memory(task, batch_size=64, target="cpu") == small  # the same figure as from real items


@pytest.mark.parametrize("convert", ["to", "half"])
def test_a_factory_that_converts_its_model_is_traced_in_the_dtype_it_chose(convert: str) -> None:
    def converted() -> nn.Module:
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
        return model.to(torch.float16) if convert == "to" else model.half()

    data = TensorDataset(torch.randn(64, 64, dtype=torch.float16), torch.randint(0, 10, (64,)))
    task = Task(model=converted, loss_fn=nn.functional.cross_entropy, train_data=data, batch_size=16, name="half")
    estimate = estimate_memory(task, target="cuda")
    assert estimate.params == (64 * 256 + 256 + 256 * 10 + 10) * 2  # fp16: two bytes a parameter
    assert estimate.gradients == estimate.params


class KeptMask(nn.Module):
    """A model that keeps a tensor as a plain attribute, not a buffer (it does not move with the model)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 10)
        self.mask = torch.ones(10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.mask.to(x.device)


@pytest.mark.parametrize("given", [False, True])
def test_a_model_keeping_a_plain_tensor_attribute_is_traced(given: bool) -> None:
    task = mlp(KeptMask() if given else KeptMask)
    for target in ("cpu", "cuda"):
        estimate = estimate_memory(task, target=target)
        assert estimate.params == (64 * 10 + 10) * 4  # the attribute is no parameter or buffer


def test_a_factory_that_moves_its_model_to_the_cpu_is_traced() -> None:
    def moved() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).to("cpu")

    data = TensorDataset(torch.randn(64, 64), torch.randint(0, 10, (64,)))
    task = Task(model=moved, loss_fn=nn.functional.cross_entropy, train_data=data, batch_size=16, name="moved")
    assert estimate_memory(task, target="cuda").params == (64 * 256 + 256 + 256 * 10 + 10) * 4


class MadeOnTheGpu(nn.Module):
    """A model whose layers and buffer are made where it trains, not moved there."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 10, device="cuda", dtype=torch.bfloat16)
        self.register_buffer("scale", torch.ones(10, device=torch.device("cuda", 0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.to(torch.bfloat16)).float() * self.scale


def test_a_factory_that_makes_its_model_on_a_gpu_is_traced_without_one() -> None:
    # nothing is made on the GPU, here or on a machine that has one: the estimate allocates no device memory
    data = TensorDataset(torch.randn(64, 64), torch.randint(0, 10, (64,)))
    task = Task(model=MadeOnTheGpu, loss_fn=nn.functional.cross_entropy, train_data=data, batch_size=16)
    estimate = estimate_memory(task, target="cuda")
    assert (estimate.params, estimate.buffers) == ((64 * 10 + 10) * 2, 10 * 4)


MOVED_TASK = """
import torch
from torch import nn
from torch.utils.data import TensorDataset
from redline.task import Task

def task():
    def build():
        return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).to("cpu")
    data = TensorDataset(torch.randn(64, 64), torch.randint(0, 10, (64,)))
    return Task(model=build, loss_fn=nn.functional.cross_entropy, train_data=data, batch_size=16, name="moved")
"""


def test_a_factory_that_moves_its_model_is_weighed_by_redline_memory(tmp_path: Path, memory_cli) -> None:
    # in a fresh process, where torch cannot swap a fake parameter for the copy .to() makes
    (tmp_path / "moved.py").write_text(MOVED_TASK, encoding="utf-8")
    done = memory_cli("--task", f"{tmp_path / 'moved.py'}:task", "--gpu", "l4", "--json")
    assert done.returncode == 0, done.stderr
    first = json.loads(done.stdout)["rows"][0]["estimate"]
    assert first["params"] == (64 * 256 + 256 + 256 * 10 + 10) * 4


@pytest.mark.parametrize(
    ("move", "width"),
    [
        (lambda m: m.cuda(), 4),  # a GPU factory estimated on a machine without one
        (lambda m: m.to("cuda", torch.float16), 2),  # the move stays on meta, the dtype applies
        (lambda m: m.cpu().to(torch.device("cpu"), dtype=torch.bfloat16), 2),
        (lambda m: m.to(torch.empty(0, dtype=torch.float16)), 2),  # .to(other): its dtype
    ],
)
def test_a_factory_that_moves_its_model_is_traced_on_meta_with_its_dtype(move, width: int) -> None:
    def build() -> nn.Module:
        return move(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)))

    data = TensorDataset(torch.randn(64, 64), torch.randint(0, 10, (64,)))
    task = Task(model=build, loss_fn=nn.functional.cross_entropy, train_data=data, batch_size=16, name="moved")
    estimate = estimate_memory(task, target="cuda", precision="fp32")  # a float16 model is refused under bf16-mixed
    assert estimate.params == (64 * 256 + 256 + 256 * 10 + 10) * width


class SparseBag(nn.Module):
    """A bag of word ids with a sparse embedding: its gradient is a sparse tensor, as SGD trains it."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(1000, 32, sparse=True)
        self.head = nn.Linear(32, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(ids).mean(1))


def test_a_sparse_embedding_is_traced_and_its_gradient_noted() -> None:
    data = TensorDataset(torch.randint(0, 1000, (64, 8)), torch.randint(0, 10, (64,)))
    task = Task(model=SparseBag, loss_fn=nn.functional.cross_entropy, train_data=data, batch_size=16,
                optimizer=lambda params: torch.optim.SGD(params, lr=0.1), name="bag")  # fmt: skip
    estimate = estimate_memory(task, target="cpu")
    assert estimate.params == (1000 * 32 + 32 * 10 + 10) * 4
    assert any("sparse embedding gradients" in note for note in estimate.notes)
    # for a GPU the SGD stays as given: fused SGD refuses sparse gradients (the trace failed on it)
    assert estimate_memory(task, target="cuda").params == estimate.params
    assert not any("sparse" in note for note in estimate_memory(mlp(), target="cpu").notes)


LAZY_DATA = TensorDataset(torch.randn(64, 32), torch.randint(0, 10, (64,)))


def lazy_model(sample: torch.Tensor | None = None) -> nn.Module:
    model = nn.Sequential(nn.LazyLinear(64), nn.ReLU(), nn.LazyLinear(10))
    if sample is not None:
        model(sample)  # the first forward gives the lazy layers their shapes, as a run needs them
    return model


def test_a_factory_that_shapes_its_lazy_layers_on_a_real_sample_is_traced() -> None:
    # built on meta, the forward met a real sample beside meta weights and failed; it trains (redline train)
    task = Task(model=lambda: lazy_model(LAZY_DATA[0][0][None]), loss_fn=nn.functional.cross_entropy,
                train_data=LAZY_DATA, batch_size=16, name="lazy")  # fmt: skip
    assert estimate_memory(task, target="cpu").params == (32 * 64 + 64 + 64 * 10 + 10) * 4


@pytest.mark.parametrize("given", [lazy_model, lazy_model()])
def test_lazy_layers_never_shaped_are_refused_as_a_run_refuses_them(given) -> None:
    task = Task(model=given, loss_fn=nn.functional.cross_entropy, train_data=LAZY_DATA, batch_size=16, name="lazy")
    with pytest.raises(ConfigError, match=r"parameters 0.weight, 0.bias, 2.weight, 2.bias are not initialized yet"):
        estimate_memory(task, target="cpu")


class HeldConstants(nn.Module):
    """Constants kept in a list and a dict beside the registered tensors, one of them a parameter's alias."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(32, 10)
        self.consts = [torch.ones(32)]
        self.table = {"scale": torch.full((10,), 2.0), "weight": self.layer.weight}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x * self.consts[0]) * self.table["scale"] + self.table["weight"].sum()


@pytest.mark.parametrize("given", [HeldConstants, HeldConstants()])
def test_tensors_a_module_keeps_in_a_list_or_a_dict_are_traced_as_its_own(given) -> None:
    # they were left real (or meta) among fake ones: 'Please convert all Tensors to FakeTensors first'
    data = TensorDataset(torch.randn(64, 32), torch.randint(0, 10, (64,)))
    task = Task(model=given, loss_fn=nn.functional.cross_entropy, train_data=data, batch_size=16, name="held")
    estimate = estimate_memory(task, target="cpu")
    assert estimate.params == (32 * 10 + 10) * 4  # the alias is the parameter, counted once
    if isinstance(given, nn.Module):
        assert not given.consts[0].is_meta and given.table["weight"] is given.layer.weight  # the task's own, untouched


CAUSAL = torch.tril(torch.ones(8, 8))  # a module-level constant, as attention code often keeps its mask


class MaskedByAConstant(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.query, self.head = nn.Linear(8, 8), nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = (self.query(x) @ x.transpose(1, 2)).masked_fill(CAUSAL.to(x.device) == 0, float("-inf"))
        return self.head(scores.softmax(-1).flatten(1))


def test_a_constant_the_model_s_code_reads_from_outside_the_model_is_traced() -> None:
    # it trains on any device (moved to the input's), but the trace refused it as a tensor that is not fake
    data = TensorDataset(torch.randn(64, 8, 8), torch.randint(0, 10, (64,)))
    task = Task(model=MaskedByAConstant, loss_fn=nn.functional.cross_entropy, train_data=data, batch_size=16)
    assert estimate_memory(task, target="cpu").params == (8 * 8 + 8 + 64 * 10 + 10) * 4
