"""Activation checkpointing on CPU: the blocks it finds, gradients equal to the plain model's, names
unchanged, undone cleanly, and the Runtime's option from the Plan to a training run."""

from __future__ import annotations

import copy
import io
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_model
from torch import nn

import redline
from redline.errors import ConfigError
from redline.examples.digits import DigitsCNN
from redline.examples.gpt import GPT, GPTConfig
from redline.runtime import checkpointing
from redline.runtime.checkpointing import apply_checkpointing, find_blocks, is_checkpointed, remove_checkpointing
from redline.runtime.compile import compile_module

CONFIG = GPTConfig(vocab_size=16, block_size=8, n_layer=3, n_head=2, n_embd=16, dropout=0.1)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Run the tiny models on one thread: on a shared 2-core machine two threads wait on each other 20x longer."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


def tokens(step: int = 0) -> torch.Tensor:
    return torch.randint(
        0, CONFIG.vocab_size, (4, CONFIG.block_size + 1), generator=torch.Generator().manual_seed(step)
    )


def gpt_loss(model: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    logits = model(rows[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())


def gradients(model: nn.Module, rows: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    """One forward and backward with dropout drawn from seed 1: the loss and every parameter's gradient."""
    torch.manual_seed(1)
    loss = gpt_loss(model, rows)
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_gradients(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, grad in got.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-6, atol=1e-9, msg=f"gradient of {name}")


def count_calls(module: nn.Module) -> list[int]:
    """Count the calls that start ``module``'s forward: a checkpointed block runs its layers again in the backward."""
    calls = [0]
    # A pre-hook: the recompute stops as soon as the backward has what it needs, before the last layer returns.
    module.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


# -- finding the blocks ---------------------------------------------------------------------------


class Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1)
        self.norm = nn.BatchNorm2d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.norm(self.conv(x)))


class Stages(nn.Module):
    """torchvision's ResNet in small: a stem, then stages of residual blocks, the widest stage the largest."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.layer1 = nn.Sequential(Residual(4), Residual(4))
        self.layer2 = nn.Sequential(Residual(8), Residual(8), Residual(8))


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.small = nn.ModuleList([nn.LayerNorm(4), nn.LayerNorm(4), nn.LayerNorm(4)])


def test_the_blocks_of_the_example_gpt_are_its_transformer_layers() -> None:
    model = make_gpt()
    found = find_blocks(model)
    assert [name for name, _ in found] == ["blocks.0", "blocks.1", "blocks.2"]
    assert [block for _, block in found] == list(model.blocks)


def test_the_digits_cnn_and_a_small_mlp_have_no_blocks_to_recompute() -> None:
    assert find_blocks(DigitsCNN(width=4)) == []
    assert find_blocks(nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2))) == []
    assert find_blocks(nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))) == []


def test_the_blocks_are_the_largest_stage_by_parameters_with_nested_names() -> None:
    model = Stages()
    assert [name for name, _ in find_blocks(model)] == ["layer2.0", "layer2.1", "layer2.2"]


def test_with_layers_single_layers_count_as_blocks_as_fsdp_shards_them() -> None:
    mlp = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    assert find_blocks(mlp, layers=True) == [("0", mlp[0]), ("2", mlp[2]), ("4", mlp[4])]
    assert [name for name, _ in find_blocks(Pair(), layers=True)] == ["layers.0", "layers.1"]
    assert find_blocks(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Dropout()), layers=True) == []
    model = make_gpt()
    assert find_blocks(model, layers=True) == find_blocks(model)


def test_blocks_that_share_a_parameter_are_skipped() -> None:
    model = Pair()
    model.layers[1].weight = model.layers[0].weight  # FSDP could not shard either block alone
    assert [name for name, _ in find_blocks(model, layers=True)] == ["small.0", "small.1", "small.2"]


# -- recomputing ----------------------------------------------------------------------------------


def test_recomputed_blocks_give_the_plain_gradients_with_dropout_and_keep_less_for_backward() -> None:
    plain, checkpointed = make_gpt(), make_gpt()
    assert apply_checkpointing(checkpointed, find_blocks(checkpointed)) == 3
    kept = {}
    for name, model in (("plain", plain), ("checkpointed", checkpointed)):
        weights = {p.data_ptr() for p in model.parameters()}
        saved = []

        def pack(t: torch.Tensor, saved: list[int] = saved, weights: set[int] = weights) -> torch.Tensor:
            if t.data_ptr() not in weights:
                saved.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            torch.manual_seed(1)
            loss = gpt_loss(model, tokens())
        kept[name] = (loss.item(), sum(saved))
        loss.backward()
    assert kept["checkpointed"][0] == kept["plain"][0]
    assert kept["checkpointed"][1] < kept["plain"][1] / 4  # the blocks keep only their inputs
    assert_same_gradients(
        {n: p.grad for n, p in checkpointed.named_parameters()}, {n: p.grad for n, p in plain.named_parameters()}
    )  # the same dropout masks in the recompute: the RNG state was restored


def test_recomputed_blocks_give_the_plain_gradients_under_bf16_autocast() -> None:
    plain, checkpointed = make_gpt(), make_gpt()
    apply_checkpointing(checkpointed, find_blocks(checkpointed))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = gradients(plain, tokens()), gradients(checkpointed, tokens())
    assert got[0] == expected[0]
    assert_same_gradients(got[1], expected[1])


class NormedBlock(nn.Module):
    """A residual block with batch norm, as a ResNet stage's."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.norm = nn.Linear(8, 8), nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.norm(self.linear(x)))


def test_recomputed_blocks_update_batch_norm_statistics_once_a_step() -> None:
    # The recomputed forward in backward updated every running mean and variance a second time: the weights were
    # equal, the statistics (and so evaluation and serving) were not, and num_batches_tracked counted 2 a step.
    torch.manual_seed(0)
    plain = nn.Sequential(NormedBlock(), NormedBlock())
    checkpointed = copy.deepcopy(plain)
    assert apply_checkpointing(checkpointed, [("0", checkpointed[0]), ("1", checkpointed[1])]) == 2
    for _ in range(3):
        x = torch.randn(16, 8)
        for model in (plain, checkpointed):
            model(x).sum().backward()
    expected = plain.state_dict()
    for name, value in checkpointed.state_dict().items():
        assert torch.equal(value, expected[name]), name
    assert int(checkpointed[0].norm.num_batches_tracked) == 3


def test_a_block_runs_again_in_backward_only_while_training_with_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_gpt()
    apply_checkpointing(model, find_blocks(model))
    calls = count_calls(model.blocks[0].mlp)
    gradients(model, tokens())
    assert calls[0] == 2  # the forward, then the recompute in backward
    checkpoints = []
    monkeypatch.setattr(checkpointing, "checkpoint", lambda *a, **k: checkpoints.append(a))
    with torch.no_grad():
        model(tokens()[:, :-1])
    with torch.inference_mode():
        model(tokens()[:, :-1])
    model.eval()
    model(tokens()[:, :-1])
    assert checkpoints == [] and calls[0] == 5  # each a plain forward


def test_names_and_state_dicts_are_unchanged_and_load_either_way() -> None:
    plain, checkpointed = make_gpt(), make_gpt()
    apply_checkpointing(checkpointed, find_blocks(checkpointed))
    assert [n for n, _ in checkpointed.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert [n for n, _ in checkpointed.named_modules()] == [n for n, _ in plain.named_modules()]
    gradients(checkpointed, tokens())
    torch.optim.SGD(checkpointed.parameters(), lr=0.1).step()
    fresh = GPT(CONFIG)
    fresh.load_state_dict(checkpointed.state_dict())  # strict: no key added or lost
    assert all(
        torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), checkpointed.state_dict().values(), strict=True)
    )
    checkpointed.load_state_dict(plain.state_dict())
    assert all(
        torch.equal(a, b) for a, b in zip(plain.state_dict().values(), checkpointed.state_dict().values(), strict=True)
    )


def test_applying_twice_changes_nothing_and_remove_gives_the_plain_forward_back() -> None:
    model = make_gpt()
    own = model.blocks[2].forward = lambda x: type(model.blocks[2]).forward(model.blocks[2], x)  # a user's patch
    calls = count_calls(model.blocks[0].mlp)
    assert apply_checkpointing(model, find_blocks(model)) == 3
    assert apply_checkpointing(model, find_blocks(model)) == 0
    gradients(model, tokens())
    assert calls[0] == 2  # once recomputed, not twice
    assert remove_checkpointing(model) == 3 and remove_checkpointing(model) == 0
    assert not any(is_checkpointed(block) for block in model.blocks)
    assert "forward" not in vars(model.blocks[0]) and model.blocks[2].forward is own
    gradients(model, tokens())
    assert calls[0] == 3


def test_blocks_of_another_model_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"block 'blocks.0' \(Block\) is not a module of GPT\n.*find_blocks"):
        apply_checkpointing(make_gpt(), find_blocks(make_gpt()))


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copy_recomputes_its_own_blocks(how: str) -> None:
    model = make_gpt()
    apply_checkpointing(model, find_blocks(model))
    if how == "deepcopy":
        copied = copy.deepcopy(model)
    else:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        copied = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    assert all(is_checkpointed(block) for block in copied.blocks)
    _, expected = gradients(make_gpt(), tokens())
    _, got = gradients(copied, tokens())
    assert_same_gradients(got, expected)  # the copy's own parameters got them, not the original's
    assert all(p.grad is None for p in model.parameters())


def recorder(graphs: list[str]) -> Callable[..., object]:
    """A torch.compile backend that keeps each graph's code, then runs it through AOT autograd."""
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        graphs.append(gm.code)
        return aot_eager(gm, example_inputs)

    return backend


def test_a_compiled_model_recomputes_with_the_plain_gradients_whether_applied_before_or_after() -> None:
    before: list[str] = []
    after: list[str] = []
    checkpointed, plain = make_gpt(), make_gpt()
    apply_checkpointing(checkpointed, find_blocks(checkpointed))
    compile_module(checkpointed, backend=recorder(before))
    compile_module(plain, backend=recorder(after))
    _, got = gradients(checkpointed, tokens())
    _, expected = gradients(plain, tokens())
    assert_same_gradients(got, expected)  # dropout included: torch.compile restores the RNG state too
    assert len(before) == 1 and "checkpoint" in before[0]
    apply_checkpointing(plain, find_blocks(plain))  # after compiling, as the out-of-memory recovery does
    plain.zero_grad(set_to_none=True)
    _, again = gradients(plain, tokens())
    assert len(after) == 2 and "checkpoint" not in after[0] and "checkpoint" in after[1]  # compiled again
    assert_same_gradients(again, expected)


# -- the Runtime option ---------------------------------------------------------------------------


def train(rt: redline.Runtime, steps: range, enable_at: int | None = None) -> tuple[nn.Module, list[float]]:
    """Train the tiny GPT with dropout under ``rt``; ``enable_at``: the step memory runs short before."""
    model, optimizer = rt.setup(make_gpt(), lambda params: torch.optim.AdamW(params, lr=1e-2))
    losses = []
    for step in steps:
        if step == enable_at:
            assert rt.enable_activation_checkpointing("out of memory at one sample per micro-batch")
        with rt.autocast():
            loss = gpt_loss(model, tokens(step))
        rt.backward(loss)
        rt.step(optimizer)
        losses.append(loss.item())
    return model, losses


def runtime(checkpointing: str) -> redline.Runtime:
    return redline.Runtime(
        devices="cpu", precision="fp32", compile="off", seed=0, activation_checkpointing=checkpointing
    )


def test_the_runtime_option_shows_in_the_plan_and_trains_as_the_plain_run(tmp_path: Path) -> None:
    with runtime("off") as rt:
        plain, expected = train(rt, range(4))
        assert not rt.enable_activation_checkpointing("memory ran short")  # off was asked for
        assert str(rt.explain().activation_checkpointing) == "off: requested: every activation is kept for the backward"
    with runtime("on") as rt:
        model, losses = train(rt, range(4))
        assert str(rt.explain().activation_checkpointing) == (
            "on: requested: 3 blocks recompute their activations in backward (about one more forward of compute)"
        )
        assert not rt.enable_activation_checkpointing("memory ran short")  # on already
        rt.save_weights(tmp_path / "model.safetensors")
    assert all(is_checkpointed(block) for block in model.blocks)
    assert losses == expected
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), plain.state_dict().values(), strict=True))
    load_model(GPT(CONFIG), tmp_path / "model.safetensors")  # strict: the plain model's keys


def test_auto_starts_off_and_turns_on_when_told_memory_runs_short() -> None:
    with runtime("off") as rt:
        _, expected = train(rt, range(6))
    with runtime("auto") as rt:
        model, losses = train(rt, range(6), enable_at=3)
        chosen = rt.explain().activation_checkpointing
        assert not rt.enable_activation_checkpointing("again")
    assert losses == expected
    assert all(is_checkpointed(block) for block in model.blocks)
    assert chosen.value is True and chosen.reason == (
        "auto: memory runs short, so 3 blocks recompute their activations in backward (about one more forward "
        "of compute): out of memory at one sample per micro-batch"
    )
    with runtime("auto") as rt:
        rt.setup(make_gpt(), lambda params: torch.optim.SGD(params, lr=0.1))
        assert str(rt.explain().activation_checkpointing).startswith("off: auto: off while memory suffices")


def test_a_model_without_blocks_refuses_on_and_auto_never_turns_on() -> None:
    with runtime("on") as rt, pytest.raises(ConfigError, match=r"(?s)activation_checkpointing='on'.*none\nhint: wrap"):
        rt.setup(DigitsCNN(width=4), lambda params: torch.optim.SGD(params, lr=0.1))
    with runtime("auto") as rt:
        rt.setup(DigitsCNN(width=4), lambda params: torch.optim.SGD(params, lr=0.1))
        assert not rt.enable_activation_checkpointing("memory ran short")
        assert str(rt.explain().activation_checkpointing) == "off: auto: the model has no repeated blocks to recompute"
