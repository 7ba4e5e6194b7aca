"""The layout follows the precision the run's first steps switch to: on a CPU with AMX, "auto" lays a convolutional
model out channels_last for bf16-mixed and NCHW for fp32, so the precision check's bf16 steps, and a run that keeps
them, are laid out as bf16's own; a layout given stays as it is."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import pickle
import weakref

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from devices import CPU_AMX
from redline.runtime.compile_check import EAGER_END, PHASE
from redline.runtime.layout import Layout, lay_out
from redline.runtime.loading import DeviceLoader
from redline.runtime.optimizer import match_state_layout
from redline.runtime.probe import probe_forward
from redline.runtime.runtime import Runtime
from redline.runtime.weak_hook import unchecked

NHWC = torch.channels_last


def conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2))


def is_nhwc(tensor: torch.Tensor) -> bool:
    return tensor.is_contiguous(memory_format=NHWC) and not tensor.is_contiguous()


def test_lay_out_moves_weights_gradients_and_the_optimizer_state_of_their_shape_and_keeps_the_parameters():
    net = conv_net()
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    net(torch.randn(2, 3, 4, 4)).sum().backward()
    optimizer.step()
    params = list(net.parameters())
    weight = net[0].weight
    lay_out(net, optimizer, channels_last=True)
    assert list(net.parameters()) == params and optimizer.param_groups[0]["params"][0] is weight
    assert is_nhwc(weight) and weight.grad is not None and is_nhwc(weight.grad)
    assert is_nhwc(optimizer.state[weight]["exp_avg"]) and is_nhwc(optimizer.state[weight]["exp_avg_sq"])
    assert optimizer.state[weight]["step"].dim() == 0  # a step count is no image
    lay_out(net, optimizer, channels_last=False)
    assert weight.is_contiguous() and optimizer.state[weight]["exp_avg"].is_contiguous()


def test_training_goes_on_alike_after_the_layout_changes():
    def run(relay: bool) -> list[torch.Tensor]:
        net = conv_net()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        torch.manual_seed(1)
        batches = [torch.randn(4, 3, 4, 4) for _ in range(4)]
        for index, batch in enumerate(batches):
            if relay and index == 2:  # between two optimizer steps, as the precision check switches
                lay_out(net, optimizer, channels_last=True)
                weight = net[0].weight  # the momentum laid out with it: the steps after go on alike
                assert is_nhwc(weight) and is_nhwc(optimizer.state[weight]["momentum_buffer"])
                batch = batch.contiguous(memory_format=NHWC)
            optimizer.zero_grad()
            net(batch).square().mean().backward()
            optimizer.step()
        assert is_nhwc(net[0].weight) == relay  # the steps after kept the layout
        return [p.detach().clone() for p in net.parameters()]

    for kept, relaid in zip(run(False), run(True), strict=True):
        torch.testing.assert_close(relaid, kept, rtol=1e-5, atol=1e-6)


def test_a_device_loader_lays_out_the_batches_after_a_change_even_within_an_epoch():
    loader = DeviceLoader([(torch.randn(2, 3, 4, 4), torch.zeros(2)) for _ in range(3)], torch.device("cpu"))
    batches = iter(loader)
    assert next(batches)[0].is_contiguous()
    loader.channels_last = True
    inputs, targets = next(batches)
    assert is_nhwc(inputs) and targets.shape == (2,)


def train(rt: Runtime, steps: int, costs: dict[str, float]) -> tuple[nn.Module, list[bool], list[bool]]:
    """Train ``conv_net`` ``steps`` steps from a loader the Runtime set up, each step costing ``costs[precision]``
    seconds on the check's clock; return the model, and whether each step's inputs and weights were NHWC."""
    net = conv_net()
    model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9))
    now = [0.0]
    if rt._compile_check is not None:
        rt._compile_check.timer.stopwatch.clock = lambda: now[0]
    data = TensorDataset(torch.randn(steps * 4, 3, 4, 4), torch.randint(0, 2, (steps * 4,)))
    inputs_nhwc, weights_nhwc = [], []
    for inputs, targets in rt.setup_loader(DataLoader(data, batch_size=4)):
        inputs_nhwc.append(is_nhwc(inputs))
        weights_nhwc.append(is_nhwc(net[0].weight))
        with rt.autocast():
            loss = nn.functional.cross_entropy(model(inputs).float(), targets)
        rt.backward(loss)
        now[0] += costs[rt.precision.name]
        rt.step(optimizer)
    return net, inputs_nhwc, weights_nhwc


def test_on_an_amx_cpu_the_bf16_phase_and_the_bf16_kept_run_channels_last(monkeypatch):
    monkeypatch.setenv("REDLINE_CPU", "amx")
    with Runtime(devices="cpu", compile="off") as rt:
        assert rt._layout.channels_last is False
        _, inputs, weights = train(rt, EAGER_END + PHASE + 3, {"fp32": 0.004, "bf16-mixed": 0.0025})
        assert rt.precision.name == "bf16-mixed"
        # laid out at step 19's training forward, which is checked then: its batch and weights were NCHW before it
        assert inputs == weights == [False] * (EAGER_END + 1) + [True] * (PHASE + 2)
        layout = rt.explain().channels_last
        assert layout.value is True
        assert layout.reason == (
            f"auto: bf16 convolutions run on this CPU's AMX tiles, which want NHWC: laid out so from step "
            f"{EAGER_END + 1}, with bf16-mixed"
        )


def test_on_an_amx_cpu_fp32_kept_lays_the_model_back_out_nchw_after_the_phase(monkeypatch):
    monkeypatch.setenv("REDLINE_CPU", "amx")
    with Runtime(devices="cpu", compile="off") as rt:
        net, inputs, weights = train(rt, EAGER_END + PHASE + 3, {"fp32": 0.004, "bf16-mixed": 0.006})
        assert rt.precision.name == "fp32" and net[0].weight.is_contiguous()
        phase = sum(inputs)  # the phase stopped after its first block, far from winning
        assert 0 < phase < PHASE and inputs == weights == [False] * (EAGER_END + 1) + [True] * phase + [False] * (
            PHASE + 2 - phase
        )
        layout = rt.explain().channels_last
        assert layout.value is False and layout.reason == "auto: NCHW is as fast for fp32 convolutions on this CPU"


@pytest.mark.parametrize("given", ["on", "off"])
def test_a_layout_given_stays_whatever_the_precision(monkeypatch, given):
    monkeypatch.setenv("REDLINE_CPU", "amx")
    with Runtime(devices="cpu", compile="off", channels_last=given) as rt:
        _, inputs, weights = train(rt, EAGER_END + PHASE + 3, {"fp32": 0.004, "bf16-mixed": 0.0025})
        assert rt.precision.name == "bf16-mixed"
        assert set(inputs) == set(weights) == {given == "on"}
        assert rt.explain().channels_last.reason == "requested"


def test_a_runtime_closed_during_the_bf16_phase_leaves_the_model_as_the_rule_laid_it_out(monkeypatch):
    monkeypatch.setenv("REDLINE_CPU", "amx")
    rt = Runtime(devices="cpu", compile="off")
    net, _, weights = train(rt, EAGER_END + 4, {"fp32": 0.004, "bf16-mixed": 0.0025})
    assert weights[-1] and is_nhwc(net[0].weight)
    rt.close()
    assert net[0].weight.is_contiguous() and rt.precision.name == "fp32"
    assert rt.explain().channels_last.value is False


def test_a_model_set_up_again_follows_with_its_new_optimizer(monkeypatch):
    monkeypatch.setenv("REDLINE_CPU", "amx")
    with Runtime(devices="cpu", compile="off") as rt:
        net = conv_net()
        rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
        optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
        model, optimizer = rt.setup(net, optimizer)
        now = [0.0]
        assert rt._compile_check is not None
        rt._compile_check.timer.stopwatch.clock = lambda: now[0]
        x = torch.randn(4, 3, 4, 4)
        for _ in range(EAGER_END + 3):
            with rt.autocast():
                loss = model(rt.to_device(x)).float().square().mean()
            rt.backward(loss)
            now[0] += 0.004 if rt.precision.name == "fp32" else 0.002
            rt.step(optimizer)
        assert is_nhwc(net[0].weight) and is_nhwc(optimizer.state[net[0].weight]["exp_avg"])
        assert is_nhwc(rt.to_device(x))


def test_a_second_model_set_up_during_the_bf16_phase_lays_the_first_back_out_as_fp32_runs_it(monkeypatch):
    monkeypatch.setenv("REDLINE_CPU", "amx")
    with Runtime(devices="cpu", compile="off") as rt:
        first, _, weights = train(rt, EAGER_END + 4, {"fp32": 0.004, "bf16-mixed": 0.0025})
        assert weights[-1] and is_nhwc(first[0].weight) and rt.precision.name == "bf16-mixed"
        second = conv_net()
        rt.setup(second, torch.optim.SGD(second.parameters(), lr=0.01))
        assert rt.precision.name == "fp32" and first[0].weight.is_contiguous() and second[0].weight.is_contiguous()
        assert rt.explain().channels_last.value is False


# -- "auto" checks that the model runs in NHWC ---------------------------------------------------------------------


class Flattens(nn.Module):
    """Flattens a convolution's output with ``view``, as old tutorials write: NHWC memory cannot be viewed so."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(64, 2)
        self.forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        return self.head(torch.relu(self.conv(x)).view(len(x), -1))


def run(rt: Runtime, net: nn.Module, steps: int, costs: dict[str, float] | None = None) -> list[bool]:
    """Train ``net`` ``steps`` steps on one batch through ``rt.to_device``; whether its weights were NHWC after each."""
    model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
    now = [0.0]
    if rt._compile_check is not None:
        rt._compile_check.timer.stopwatch.clock = lambda: now[0]
    x = torch.randn(4, 3, 4, 4)
    nhwc = []
    for _ in range(steps):
        with rt.autocast():
            loss = model(rt.to_device(x)).float().square().mean()
        rt.backward(loss)
        now[0] += (costs or {}).get(rt.precision.name, 0.004)
        rt.step(optimizer)
        nhwc.append(is_nhwc(net.conv.weight))
    return nhwc


def test_a_model_whose_forward_fails_in_nhwc_goes_back_to_nchw_for_good_when_the_bf16_phase_begins(monkeypatch):
    monkeypatch.setenv("REDLINE_CPU", "amx")
    net = Flattens()
    with Runtime(devices="cpu", compile="off") as rt:
        nhwc = run(rt, net, EAGER_END + PHASE + 3, {"fp32": 0.004, "bf16-mixed": 0.0025})
        assert nhwc == [False] * (EAGER_END + PHASE + 3)  # laid out at step 19's forward, and back before it ran
        assert rt.precision.name == "bf16-mixed"  # timed and kept in NCHW, where it runs
        switch = rt._compile_check.precision if rt._compile_check is not None else None
        assert switch is not None and switch.failed is None and switch.compared.startswith("outputs within")
        layout = rt.explain().channels_last
        assert layout.value is False
        assert layout.reason.startswith(
            "auto: bf16 convolutions run on this CPU's AMX tiles, which want NHWC: laid out so from step "
            f"{EAGER_END + 1}, with bf16-mixed, but the model's forward failed so (RuntimeError: view size is not"
        )
        assert layout.reason.endswith("): NCHW")
        assert is_nhwc(rt.to_device(torch.randn(2, 3, 4, 4))) is False


def test_a_model_laid_out_nhwc_at_setup_is_checked_once_at_its_first_forward(monkeypatch):
    monkeypatch.setenv("REDLINE_CPU", "amx")
    with Runtime(devices="cpu", precision="bf16-mixed") as rt:  # "auto" lays bf16 convolutions out NHWC here
        failing = run(rt, Flattens(), 3)
    assert failing == [False] * 3 and rt.explain().channels_last.value is False
    net = Flattens()
    net.head = nn.Sequential(nn.Flatten(), net.head)
    net.forward = lambda x: net.head(torch.relu(net.conv(x)))  # type: ignore[method-assign]
    calls = []
    net.conv.register_forward_hook(lambda *_: calls.append(1))
    with Runtime(devices="cpu", precision="bf16-mixed") as rt:
        assert run(rt, net, 3) == [True] * 3
    assert len(calls) == 4  # one forward on copies, before the first step's, then none
    assert rt.explain().channels_last.reason == "auto: bf16 convolutions run on this CPU's AMX tiles, which want NHWC"


def test_a_layout_asked_for_is_not_checked_and_a_model_failing_either_way_raises_its_own_error(monkeypatch):
    monkeypatch.setenv("REDLINE_CPU", "amx")
    with Runtime(devices="cpu", precision="bf16-mixed", channels_last="on") as rt, pytest.raises(RuntimeError) as err:
        run(rt, Flattens(), 1)
    assert "view size is not compatible" in str(err.value)

    class Broken(Flattens):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("the model's own bug")

    net = Broken()
    with Runtime(devices="cpu", precision="bf16-mixed") as rt:
        with pytest.raises(ValueError, match="own bug"):
            run(rt, net, 1)
        assert is_nhwc(net.conv.weight) and rt.explain().channels_last.value is True


def test_a_model_with_5d_tensors_beside_its_convolutions_is_laid_out_in_its_4d_ones():
    net = nn.Sequential(nn.Conv3d(2, 2, 1), nn.Flatten(0, 1), nn.Conv2d(2, 2, 1))
    lay_out(net, None, channels_last=True)
    assert net[0].weight.dim() == 5 and net[0].weight.is_contiguous() and net[2].weight.dim() == 4


def test_an_optimizer_state_loaded_in_another_layout_takes_its_parameters_and_fused_adam_steps_right():
    def stepped(relaid: bool) -> torch.Tensor:
        torch.manual_seed(0)
        weight = nn.Parameter(torch.randn(8, 3, 3, 3))
        optimizer = torch.optim.Adam([weight], lr=0.1, fused=True)
        weight.grad = torch.randn(8, 3, 3, 3)
        optimizer.step()
        if relaid:  # as a checkpoint written channels_last loads into an NCHW run
            state = optimizer.state[weight]
            state["exp_avg"] = state["exp_avg"].contiguous(memory_format=NHWC)
            match_state_layout(optimizer)
            assert state["exp_avg"].stride() == weight.stride()
        weight.grad = torch.randn(8, 3, 3, 3)
        optimizer.step()
        return weight.detach()

    torch.testing.assert_close(stepped(True), stepped(False), rtol=0, atol=0)


def test_a_checkpoint_written_channels_last_loads_into_an_nchw_run_with_its_state_laid_out_so(monkeypatch, tmp_path):
    monkeypatch.setenv("REDLINE_CPU", "amx")
    with Runtime(devices="cpu", precision="bf16-mixed") as rt:
        net = conv_net()
        model, optimizer = rt.setup(net, lambda params: torch.optim.Adam(params, lr=0.01))
        with rt.autocast():
            loss = model(rt.to_device(torch.randn(4, 3, 4, 4))).float().square().mean()
        rt.backward(loss)
        rt.step(optimizer)
        assert is_nhwc(optimizer.state[net[0].weight]["exp_avg"])
        rt.save(tmp_path / "step-1")
    with Runtime(devices="cpu", precision="fp32") as rt:
        net = conv_net()
        _, optimizer = rt.setup(net, lambda params: torch.optim.Adam(params, lr=0.01))
        rt.load(tmp_path / "step-1")
        weight = net[0].weight
        assert weight.is_contiguous() and optimizer.state[weight]["exp_avg"].stride() == weight.stride()


def test_a_second_setup_that_fails_leaves_the_first_models_check_running(monkeypatch):
    monkeypatch.setenv("REDLINE_CPU", "amx")
    with Runtime(devices="cpu", compile="off") as rt:
        first = conv_net()
        run_into_phase = train(rt, EAGER_END + 2, {"fp32": 0.004, "bf16-mixed": 0.0025})
        assert run_into_phase[2][-1] and rt.precision.name == "bf16-mixed"
        second = conv_net()
        with pytest.raises(Exception):  # noqa: B017 - the optimizer holds another model's parameters
            rt.setup(second, torch.optim.SGD(first.parameters(), lr=0.01))
        assert rt.precision.name == "bf16-mixed" and rt.compile_checking
        assert "being checked on this run" in rt.explain().precision.reason


@pytest.mark.parametrize("given", ["on", True])
def test_a_loader_made_before_setup_lays_its_batches_out_as_the_model_set_up_after_it(monkeypatch, given):
    with Runtime(devices="cpu", channels_last=given) as rt:
        loader = rt.setup_loader([(torch.randn(2, 3, 4, 4), torch.zeros(2))])
        net = conv_net()
        rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
        assert is_nhwc(next(iter(loader))[0])


def test_the_check_runs_the_models_own_forward_where_a_compiled_one_would_compile_for_no_grad():
    inside = []

    @contextlib.contextmanager
    def eagerly():
        inside.append(True)
        yield
        inside.append(False)

    seen = []

    class Records(Flattens):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(bool(inside) and inside[-1])  # inside eagerly() or not
            return self.head(torch.relu(self.conv(x)).reshape(len(x), -1))

    net = Records()
    layout = Layout(CPU_AMX, eagerly=eagerly)
    assert layout.setup(net, "auto", "bf16-mixed").value is True
    net(torch.randn(2, 3, 4, 4).contiguous(memory_format=NHWC))
    assert seen == [True, False] and layout.channels_last  # the probe inside, the forward itself outside; NHWC runs


# -- what the second review found --------------------------------------------------------------------------------


class Gray(Flattens):
    """One channel, as the MNIST tutorial's: its NHWC weight and images count as contiguous in either layout."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)


def bf16_nhwc(**fields) -> Runtime:
    return Runtime(devices="cpu", precision="bf16-mixed", **fields)  # "auto" lays bf16 convolutions out NHWC (AMX)


def step(rt: Runtime, model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    with rt.autocast():
        loss = model(x).float().square().mean()
    rt.backward(loss)
    rt.step(optimizer)


def test_a_one_channel_model_goes_back_to_nchw_too(monkeypatch):
    monkeypatch.setenv("REDLINE_CPU", "amx")
    net = Gray()
    with bf16_nhwc() as rt:
        model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
        step(rt, model, optimizer, rt.to_device(torch.randn(4, 1, 4, 4)))
        assert net.conv.weight.stride() == (9, 9, 3, 1) and rt.explain().channels_last.value is False


def test_a_refused_model_gets_nchw_inputs_at_every_forward_a_batch_moved_before_or_another_models_output(
    monkeypatch,
):
    monkeypatch.setenv("REDLINE_CPU", "amx")
    net = Flattens()
    with bf16_nhwc() as rt:
        model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
        x = torch.randn(4, 3, 4, 4).contiguous(memory_format=NHWC)  # as a batch moved while the model ran NHWC
        for _ in range(3):
            step(rt, model, optimizer, x)
        assert rt.explain().channels_last.value is False and net.forwards == 3 + 2  # and the two checks'


def test_an_evaluation_first_does_not_stand_for_the_training_forward(monkeypatch):
    monkeypatch.setenv("REDLINE_CPU", "amx")

    class TrainsOtherwise(Flattens):  # a head used in training only, say an auxiliary loss's
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            features = torch.relu(self.conv(x))
            return self.head(features.view(len(x), -1) if self.training else features.flatten(1))

    net = TrainsOtherwise()
    with bf16_nhwc() as rt:
        model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
        x = rt.to_device(torch.randn(4, 3, 4, 4))
        model.eval()
        with torch.no_grad(), rt.autocast():
            model(x)
        assert not is_nhwc(net.conv.weight)  # the evaluation runs NCHW: auto's NHWC waits for a training forward
        model.train()
        step(rt, model, optimizer, x)
        assert not is_nhwc(net.conv.weight) and rt.explain().channels_last.value is False


def test_a_fallback_inside_inference_mode_leaves_the_weights_trainable(monkeypatch):
    monkeypatch.setenv("REDLINE_CPU", "amx")
    net = Flattens()
    with bf16_nhwc() as rt:
        model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
        with torch.inference_mode(), rt.autocast():
            model(rt.to_device(torch.randn(4, 3, 4, 4)))
        assert not net.conv.weight.is_inference() and not is_nhwc(net.conv.weight)
        before = net.conv.weight.detach().clone()
        step(rt, model, optimizer, rt.to_device(torch.randn(4, 3, 4, 4)))
        assert not torch.equal(net.conv.weight, before)


def test_an_out_of_memory_in_the_check_leaves_the_next_forward_checked(monkeypatch):
    monkeypatch.setenv("REDLINE_CPU", "amx")

    class ShortOnce(Flattens):
        short = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if ShortOnce.short and not torch.is_grad_enabled():  # the check's forward, the first time
                ShortOnce.short = False
                raise torch.OutOfMemoryError("out of memory (a stand-in)")
            return super().forward(x)

    net = ShortOnce()
    with bf16_nhwc() as rt:
        model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
        with pytest.raises(RuntimeError, match="view size"):  # the forward itself, in NHWC
            step(rt, model, optimizer, rt.to_device(torch.randn(4, 3, 4, 4)))
        step(rt, model, optimizer, rt.to_device(torch.randn(4, 3, 4, 4)))  # checked: back to NCHW
        assert rt.explain().channels_last.value is False


def test_the_check_leaves_a_buffer_a_forward_assigns_anew_and_an_input_it_changes_as_one_forward_would(monkeypatch):
    monkeypatch.setenv("REDLINE_CPU", "amx")

    @dataclasses.dataclass
    class Images:
        pixels: torch.Tensor

    class Counts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)
            self.register_buffer("seen", torch.zeros(()))

        def forward(self, batch: Images) -> torch.Tensor:
            self.seen = self.seen + 1
            batch.pixels.mul_(2)
            return self.conv(batch.pixels).flatten(1)

    net = Counts()
    with bf16_nhwc() as rt:
        model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
        batch = rt.to_device(Images(torch.ones(2, 3, 4, 4).contiguous(memory_format=NHWC)))  # as the model runs
        with rt.autocast():
            loss = model(batch).float().square().mean()
        assert float(net.seen) == 1 and float(batch.pixels.mean()) == 2
        rt.backward(loss)
        rt.step(optimizer)


def test_a_copy_made_during_the_run_carries_no_runtime_and_a_closed_runtime_leaves_no_hook(monkeypatch):
    monkeypatch.setenv("REDLINE_CPU", "amx")
    net = Flattens()
    rt = bf16_nhwc()
    model, optimizer = rt.setup(net, torch.optim.Adam(net.parameters(), lr=0.01))
    pending = copy.deepcopy(model)  # an EMA's copy, before any check ran: it holds neither the Runtime nor the check
    assert list(pending._forward_pre_hooks.values()) == [unchecked]
    assert pickle.loads(pickle.dumps(model))._forward_pre_hooks  # torch.save(model) mid-run
    step(rt, model, optimizer, rt.to_device(torch.randn(4, 3, 4, 4)))  # refused: NCHW from now on
    refused = copy.deepcopy(model)
    assert refused(torch.randn(4, 3, 4, 4).contiguous(memory_format=NHWC)).shape == (4, 2)  # its inputs NCHW too
    rt.close()
    assert not net._forward_pre_hooks and not net._forward_hooks
    done = weakref.ref(rt)
    del rt, model, optimizer
    gc.collect()
    assert done() is None  # nothing of the model keeps the Runtime


def test_a_sparse_momentum_is_left_as_it_is():
    embedding = nn.Embedding(10, 4, sparse=True)
    optimizer = torch.optim.SGD(embedding.parameters(), lr=0.1, momentum=0.9)
    embedding(torch.tensor([1, 2])).sum().backward()
    optimizer.step()
    match_state_layout(optimizer)
    assert optimizer.state[embedding.weight]["momentum_buffer"].is_sparse


def test_the_check_takes_off_a_buffer_its_forward_registered_or_filled():
    class Lazy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("total", None)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.total = x.sum() if self.total is None else self.total + x.sum()
            self.register_buffer("extra", torch.ones(()))
            return x

    net = Lazy()
    probe_forward(net, (torch.ones(2),), {})
    assert net.total is None and "extra" not in net._buffers


@pytest.mark.parametrize("given", ["auto", "on"])
def test_autos_nhwc_stays_inside_the_model_and_its_image_outputs_come_back_nchw(monkeypatch, given):
    # a segmentation loss's logits.view(len(logits), -1) failed on the NHWC outputs from the step auto laid it out
    monkeypatch.setenv("REDLINE_CPU", "amx")
    torch.manual_seed(0)
    with Runtime(devices="cpu", compile="off", precision="bf16-mixed", channels_last=given) as rt:
        net, _ = rt.setup(nn.Conv2d(3, 4, 3, padding=1), lambda params: torch.optim.SGD(params, lr=0.1))
        with rt.autocast():
            out = net(torch.randn(2, 3, 5, 5).to(memory_format=NHWC))
        assert is_nhwc(net.weight)  # auto's: laid out at this first training forward
    if given == "auto":
        assert out.is_contiguous() and out.view(2, -1).shape == (2, 100)
    else:
        assert is_nhwc(out)  # asked for: the outputs are as the model gives them
    assert not net._forward_hooks  # closed: nothing of the run's stays on the model


@pytest.mark.parametrize("given", ["auto", "on"])
def test_a_closed_runtime_gives_autos_nhwc_model_back_nchw_and_keeps_a_layout_asked_for(monkeypatch, given):
    # after `with rt:` the model's outputs came out NHWC (a .view failed) and safetensors refused its weights
    monkeypatch.setenv("REDLINE_CPU", "amx")
    net = conv_net()
    with bf16_nhwc(compile="off", channels_last=given) as rt:
        model, optimizer = rt.setup(net, lambda params: torch.optim.Adam(params, lr=0.01, fused=True))
        step(rt, model, optimizer, rt.to_device(torch.randn(4, 3, 4, 4)))
        assert is_nhwc(net[0].weight) and is_nhwc(optimizer.state[net[0].weight]["exp_avg"])
    weight = net[0].weight
    if given == "on":  # asked for: the model stays as the user asked it laid out
        assert is_nhwc(weight) and is_nhwc(optimizer.state[weight]["exp_avg"])
        return
    assert weight.is_contiguous() and weight.grad is not None and weight.grad.is_contiguous()
    assert optimizer.state[weight]["exp_avg"].is_contiguous()  # fused Adam reads it as flat memory, as the weight
    assert all(t.is_contiguous() for t in net.state_dict().values())  # safetensors.save_file takes them
    out = net[0](torch.randn(2, 3, 4, 4))
    assert out.view(2, -1).shape == (2, 64)


def test_a_loader_set_up_in_the_run_gives_nchw_batches_once_the_runtime_closed(monkeypatch):
    # its batches came NHWC after `with rt:`, and so did the NCHW model's conv outputs on them: a .view failed
    monkeypatch.setenv("REDLINE_CPU", "amx")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 3, 3, padding=1))  # 4-d outputs
    data = TensorDataset(torch.randn(8, 3, 4, 4), torch.randn(8, 3, 4, 4))
    with bf16_nhwc(compile="off") as rt:
        model, optimizer = rt.setup(net, lambda params: torch.optim.SGD(params, lr=0.1))
        batches = rt.setup_loader(DataLoader(data, batch_size=4))
        x, _ = next(iter(batches))
        step(rt, model, optimizer, x)
        assert is_nhwc(net[0].weight) and is_nhwc(next(iter(batches))[0])
    x, _ = next(iter(batches))
    assert x.is_contiguous() and rt.to_device(torch.randn(2, 3, 4, 4)).is_contiguous()
    with torch.no_grad():
        assert net(x).view(4, -1).shape == (4, 48)


class EncodesDecodes(nn.Module):
    """A convolutional autoencoder a loop trains through its methods, not its forward (``decode(encode(x))``), its
    encoder flattening a convolution's output with ``view``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.down = nn.Linear(64, 8)
        self.up = nn.Linear(8, 48)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.conv(x)).view(len(x), -1))

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.up(z).view(len(z), 3, 4, 4)


def autoencoder_step(rt: Runtime, net: EncodesDecodes, optimizer: torch.optim.Optimizer) -> None:
    """One step of ``net`` trained through its methods on a batch ``rt.to_device`` moved."""
    x = rt.to_device(torch.randn(4, 3, 4, 4))
    with rt.autocast():
        loss = (net.decode(net.encode(x)).float() - x).square().mean()
    rt.backward(loss)
    rt.step(optimizer)


def train_through_methods(rt: Runtime, steps: int, costs: dict[str, float] | None = None) -> nn.Module:
    net = EncodesDecodes()
    _, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
    now = [0.0]
    if rt._compile_check is not None:
        rt._compile_check.timer.stopwatch.clock = lambda: now[0]
    for _ in range(steps):
        x = rt.to_device(torch.randn(4, 3, 4, 4))
        with rt.autocast():
            loss = (net.decode(net.encode(x)).float() - x).square().mean()
        rt.backward(loss)
        now[0] += (costs or {}).get(rt.precision.name, 0.004)
        rt.step(optimizer)
    return net


def test_a_model_trained_through_other_methods_than_forward_is_never_laid_out_nhwc_unchecked(monkeypatch):
    # decode(encode(x)) with a view in encode failed at its first step where auto laid the model out NHWC at setup
    # (a GPU's tensor cores, bf16 on a CPU with AMX): its forward, which the check runs on copies, never ran.
    monkeypatch.setenv("REDLINE_CPU", "amx")
    with bf16_nhwc() as rt:
        net = train_through_methods(rt, 3)
        layout = rt.explain().channels_last
        assert layout.value is False and not is_nhwc(net.conv.weight)
        assert layout.reason == (
            "auto: bf16 convolutions run on this CPU's AMX tiles, which want NHWC, but its optimizer stepped on "
            "gradients before any forward of the model with autograd: the loop trains it through other methods "
            "(model.decode(model.encode(x))), which the check cannot run on NHWC copies first: NCHW "
            "(channels_last='on' lays it out anyway, unchecked)"
        )
        assert not is_nhwc(rt.to_device(torch.randn(2, 3, 4, 4)))
    assert not net._forward_pre_hooks and not net._forward_hooks


@pytest.mark.parametrize("steps", [EAGER_END + 3, EAGER_END + PHASE + 3])  # in bf16's phase, and after it
def test_nor_when_the_precision_check_switches_to_bf16_after_its_fp32_steps(monkeypatch, steps):
    monkeypatch.setenv("REDLINE_CPU", "amx")
    with Runtime(devices="cpu", compile="off") as rt:
        net = train_through_methods(rt, steps, {"fp32": 0.004, "bf16-mixed": 0.0025})
        assert not is_nhwc(net.conv.weight)
        layout = rt.explain().channels_last
        assert layout.value is False and "its optimizer stepped on gradients before any forward" in layout.reason
        assert "laid out so from step" not in layout.reason  # it never was
        # no forward compared bf16's outputs with fp32's, so bf16, faster, is not kept after its phase
        assert rt.precision.name == ("bf16-mixed" if steps < EAGER_END + PHASE else "fp32")


def test_autos_nhwc_is_laid_out_at_the_first_training_forward_and_the_batches_follow(monkeypatch):
    monkeypatch.setenv("REDLINE_CPU", "amx")
    net = conv_net()
    with bf16_nhwc() as rt:
        model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9))
        assert not is_nhwc(net[0].weight) and not is_nhwc(rt.to_device(torch.randn(2, 3, 4, 4)))
        assert optimizer._optimizer_step_post_hooks  # a step before any forward would end the wait
        model.eval()
        with torch.no_grad(), rt.autocast():
            model(torch.randn(2, 3, 4, 4))  # an evaluation first: not how the model trains
        assert not is_nhwc(net[0].weight)
        model.train()
        step(rt, model, optimizer, rt.to_device(torch.randn(2, 3, 4, 4)))
        assert is_nhwc(net[0].weight) and is_nhwc(optimizer.state[net[0].weight]["momentum_buffer"])
        assert is_nhwc(rt.to_device(torch.randn(2, 3, 4, 4))) and not optimizer._optimizer_step_post_hooks
        assert rt.explain().channels_last.value is True


def test_a_second_model_waits_for_its_own_forward_not_the_first_models_step(monkeypatch):
    monkeypatch.setenv("REDLINE_CPU", "amx")
    first, second = conv_net(), conv_net()
    with bf16_nhwc() as rt:
        d, d_optimizer = rt.setup(first, torch.optim.SGD(first.parameters(), lr=0.01))
        g, g_optimizer = rt.setup(second, torch.optim.SGD(second.parameters(), lr=0.01))
        x = rt.to_device(torch.randn(2, 3, 4, 4))
        step(rt, d, d_optimizer, x)  # the discriminator's step, before the generator's first forward
        step(rt, g, g_optimizer, x)
        assert is_nhwc(first[0].weight) and is_nhwc(second[0].weight)
        assert rt.explain().channels_last.value is True


def test_the_forward_that_lays_the_model_out_gets_its_inputs_nhwc_as_every_later_one(monkeypatch):
    # the first batch was moved NCHW while the model waited: a model compiled on its first call compiled for NCHW,
    # and again for the NHWC batches after it (bench's compile row: "stride mismatch at index 1")
    monkeypatch.setenv("REDLINE_CPU", "amx")
    seen = []

    class Records(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(is_nhwc(x))
            return self.conv(x).flatten(1)

    net = Records()
    data = TensorDataset(torch.randn(12, 3, 4, 4), torch.randint(0, 2, (12,)))
    with bf16_nhwc() as rt:
        model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
        for inputs, _ in rt.setup_loader(DataLoader(data, batch_size=4)):
            step(rt, model, optimizer, inputs)
    assert seen == [True] * 4  # the check's forward on copies, then the three steps'


# -- what the review of the wait for the first forward found ---------------------------------------------------------


def test_a_users_step_hook_beside_the_wait_runs_and_the_step_goes_on(monkeypatch):
    # the wait's own hook took itself off while torch iterated the optimizer's hooks: "OrderedDict mutated"
    monkeypatch.setenv("REDLINE_CPU", "amx")
    net = EncodesDecodes()
    with bf16_nhwc() as rt:
        _, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
        ran = []
        optimizer.register_step_post_hook(lambda *_: ran.append(1))  # an EMA's update, say
        for _ in range(3):
            autoencoder_step(rt, net, optimizer)
        assert ran == [1, 1, 1] and rt.explain().channels_last.value is False


def test_a_model_still_waiting_gets_nchw_batches_while_another_model_runs_nhwc(monkeypatch):
    # a VAE-GAN: the discriminator was laid out at its first forward and every batch came NHWC, so the VAE, trained
    # through its methods and not yet refused, failed on its view at its second micro-batch
    monkeypatch.setenv("REDLINE_CPU", "amx")
    vae, critic = EncodesDecodes(), conv_net()
    with bf16_nhwc(grad_accum=2) as rt:
        d, d_optimizer = rt.setup(critic, torch.optim.SGD(critic.parameters(), lr=0.01))
        _, v_optimizer = rt.setup(vae, torch.optim.SGD(vae.parameters(), lr=0.01))
        for _ in range(2):
            for _ in range(2):  # the critic's cycle first, then the VAE's
                step(rt, d, d_optimizer, rt.to_device(torch.randn(4, 3, 4, 4)))
            assert is_nhwc(critic[0].weight) and not is_nhwc(rt.to_device(torch.randn(4, 3, 4, 4)))
            for _ in range(2):
                autoencoder_step(rt, vae, v_optimizer)
        assert not is_nhwc(vae.conv.weight)


def test_a_model_trained_in_eval_mode_or_stepped_before_its_first_backward_is_still_laid_out(monkeypatch):
    # both were refused as trained "through other methods": a forward with autograd in eval mode (frozen norms) is
    # how such a model trains, and a step before any backward steps on no gradient
    monkeypatch.setenv("REDLINE_CPU", "amx")
    for eval_mode, step_first in [(True, False), (False, True)]:
        net = conv_net()
        with bf16_nhwc() as rt:
            model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
            model.train(not eval_mode)
            if step_first:
                rt.step(optimizer)
            step(rt, model, optimizer, rt.to_device(torch.randn(4, 3, 4, 4)))
            assert is_nhwc(net[0].weight) and rt.explain().channels_last.value is True


def test_the_plan_says_when_a_model_still_waits_to_be_laid_out(monkeypatch):
    monkeypatch.setenv("REDLINE_CPU", "amx")
    net = conv_net()
    with bf16_nhwc() as rt:
        model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
        assert rt.explain().channels_last.reason.endswith("; laid out at the model's first forward with autograd")
        step(rt, model, optimizer, rt.to_device(torch.randn(4, 3, 4, 4)))
        assert rt.explain().channels_last.reason == (
            "auto: bf16 convolutions run on this CPU's AMX tiles, which want NHWC"
        )


def test_to_device_lays_out_the_inputs_of_a_pair_and_not_its_targets_as_the_loader_does(monkeypatch):
    monkeypatch.setenv("REDLINE_CPU", "amx")
    net = conv_net()
    with bf16_nhwc() as rt:
        model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
        step(rt, model, optimizer, rt.to_device(torch.randn(4, 3, 4, 4)))
        images, masks = rt.to_device((torch.randn(2, 3, 4, 4), torch.randn(2, 2, 4, 4)))  # two classes' masks
        assert is_nhwc(images) and not is_nhwc(masks) and masks.view(2, -1).shape == (2, 32)


def test_a_model_the_user_compiles_after_setup_is_checked_eagerly_and_laid_out(monkeypatch):
    # dynamo traced the check's hook, probe forward and all, failed inside ("exception table entry ..."), and the
    # model was refused NHWC for the error of the trace, not its own
    monkeypatch.setenv("REDLINE_CPU", "amx")
    net = conv_net()
    with bf16_nhwc() as rt:
        model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
        compiled = torch.compile(model, backend="eager")
        for _ in range(2):
            step(rt, compiled, optimizer, rt.to_device(torch.randn(4, 3, 4, 4)))
        layout = rt.explain().channels_last
        assert is_nhwc(net[0].weight) and layout.value is True, layout.reason


def test_autos_nhwc_leaves_a_dict_batch_as_it_is_and_on_lays_it_out_whole(monkeypatch):
    # {"noisy": x, "clean": y} from rt.setup_loader: auto laid every 4-d tensor out NHWC, and the loss's
    # clean.view(len(clean), -1) failed from the second step; a pair's targets were kept NCHW already
    monkeypatch.setenv("REDLINE_CPU", "amx")
    data = [{"noisy": torch.randn(3, 4, 4), "clean": torch.randn(3, 4, 4)} for _ in range(12)]
    for given, laid in [("auto", False), ("on", True)]:
        net = nn.Conv2d(3, 3, 3, padding=1)
        with bf16_nhwc(channels_last=given) as rt:
            model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
            for batch in rt.setup_loader(DataLoader(data, batch_size=4)):
                assert is_nhwc(batch["clean"]) is is_nhwc(batch["noisy"]) is (laid and is_nhwc(net.weight))
                with rt.autocast():
                    out = model(batch["noisy"]).float()
                loss = (out.reshape(len(out), -1) - batch["clean"].reshape(len(out), -1)).square().mean()
                rt.backward(loss)
                rt.step(optimizer)
            assert is_nhwc(net.weight)
            assert is_nhwc(rt.to_device({"clean": torch.randn(2, 3, 4, 4)})["clean"]) is laid
