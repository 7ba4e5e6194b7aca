"""The Runtime on a CUDA device: bf16 parity, the fused optimizer, side-stream loading, TF32."""

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import redline

pytestmark = pytest.mark.gpu

# bf16 autocast in both loops; redline's fused AdamW rounds differently from the default foreach
# implementation, so weights agree to this tolerance rather than bitwise.
BF16_ATOL = 2e-3


def make_model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 64, 10))


def make_loader() -> DataLoader:
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(256, 1, 8, 8, generator=gen), torch.randint(0, 10, (256,), generator=gen))
    return DataLoader(data, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0))


def test_bf16_parity_with_the_plain_autocast_loop():
    torch.manual_seed(0)
    initial = make_model()
    plain = copy.deepcopy(initial).cuda()
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    for inputs, targets in make_loader():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(plain(inputs.cuda()), targets.cuda())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    rt = redline.Runtime(devices="cuda", precision="bf16-mixed", compile="off")
    model, opt = rt.setup(copy.deepcopy(initial), lambda params: torch.optim.AdamW(params, lr=1e-3))
    for inputs, targets in rt.setup_loader(make_loader()):
        assert inputs.is_cuda and targets.is_cuda
        with rt.autocast():
            loss = nn.functional.cross_entropy(model(inputs), targets)
        rt.backward(loss)
        rt.step(opt)
    worst = max((a - b).abs().max().item() for a, b in zip(model.parameters(), plain.parameters(), strict=True))
    print(f"bf16 parity: max abs weight difference {worst:.3g} (tolerance {BF16_ATOL})")
    assert worst <= BF16_ATOL
    plan = rt.explain()
    assert plan.optimizer.value == "fused" and plan.tf32.value is True
    assert plan.channels_last.value is True


def test_side_stream_loader_delivers_the_same_batches():
    rt = redline.Runtime(devices="cuda", precision="fp32", compile="off", channels_last="off")
    expected = list(make_loader())
    got = [(x.cpu(), y.cpu()) for x, y in rt.setup_loader(make_loader())]
    assert len(got) == len(expected)
    for (a, b), (c, d) in zip(got, expected, strict=True):
        assert torch.equal(a, c) and torch.equal(b, d)
    assert rt.explain().loader.value.pin_memory is True


def test_auto_plan_on_this_gpu_is_explained():
    rt = redline.Runtime(planned_steps=10_000)
    rt.setup(make_model(), lambda params: torch.optim.AdamW(params))
    plan = rt.explain()
    print(plan)
    assert plan.device.value.startswith("cuda")
    major, _ = torch.cuda.get_device_capability()
    assert plan.precision.value == ("bf16-mixed" if major >= 8 else "fp16-mixed")


def train_steps(rt: redline.Runtime, steps: int, model: nn.Module | None = None) -> nn.Module:
    torch.manual_seed(0)
    model, opt = rt.setup(model or make_model(), lambda params: torch.optim.AdamW(params, lr=1e-3))
    batches = iter(rt.setup_loader(make_loader()))
    for _ in range(steps):
        try:
            inputs, targets = next(batches)
        except StopIteration:
            batches = iter(rt.setup_loader(make_loader()))
            inputs, targets = next(batches)
        with rt.autocast():
            loss = nn.functional.cross_entropy(model(inputs), targets)
        rt.backward(loss)
        rt.step(opt)
    return model


def test_an_automatic_compile_is_checked_on_the_first_steps_and_kept_only_if_faster():
    # A model this small is bound by kernel launches: whichever form wins here, the Plan says which with both figures.
    from redline.runtime.compile_check import STEPS

    rt = redline.Runtime(devices="cuda", precision="fp32", planned_steps=1_000_000, cuda_graphs="off")  # long enough
    train_steps(rt, STEPS + 5)
    plan = rt.explain().compile
    print(plan)
    assert not rt.compile_checking
    assert "compiled steps ran" in plan.reason and "eager (" in plan.reason
    assert ("confirmed on this run" in plan.reason) == plan.value


def test_training_under_cuda_graphs_matches_eager():
    # compile_mode="reduce-overhead": the step's forward and backward replay as CUDA graphs; the batches have one
    # shape (256 samples in batches of 32), so the weights after 16 steps agree with eager fp32's.
    eager = train_steps(redline.Runtime(devices="cuda", precision="fp32", compile="off", seed=0), 16)
    graphs = train_steps(
        redline.Runtime(devices="cuda", precision="fp32", compile="on", compile_mode="reduce-overhead", seed=0), 16
    )
    worst = max((a - b).abs().max().item() for a, b in zip(graphs.parameters(), eager.parameters(), strict=True))
    print(f"CUDA graphs vs eager: max abs weight difference {worst:.3g}")
    assert worst <= 1e-3


def test_an_unmeasured_auto_precision_is_checked_on_the_first_steps_and_dropout_compares_alike():
    # The rule picks bf16-mixed on this GPU; with no trial, the run's own first steps time fp32 against it, and the
    # phase's first forward holds the two precisions' outputs against each other on one batch: the random streams
    # put back, dropout must draw the same mask in both, or the comparison would drop bf16 for a reason not its own.
    from redline.runtime.compile_check import EAGER_END, PHASE

    rt = redline.Runtime(devices="cuda", compile="off", cuda_graphs="off", seed=0)
    torch.manual_seed(0)
    train_steps(rt, EAGER_END + PHASE + 2, nn.Sequential(make_model(), nn.Dropout(0.2)))
    plan = rt.explain().precision
    print(plan)
    assert not rt.compile_checking and "on this run" in plan.reason
    assert "outputs within" in plan.reason and "dropped" not in plan.reason
    assert rt.precision.name == plan.value


class Flattens(nn.Module):
    """The digits-sized CNN flattening its convolution's output with ``view``, which NHWC memory cannot take."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 16, 3, padding=1)
        self.head = nn.Linear(16 * 64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)).view(len(x), -1))


def test_a_model_that_cannot_run_channels_last_runs_nchw_under_auto_through_the_first_steps_checks():
    # "auto" lays convolutions out NHWC on tensor cores; this model's first forward fails so on copies of its inputs,
    # and the run goes on in NCHW through the precision, graphs and compile checks.
    from redline.runtime.compile_check import EAGER_END, PHASE

    for options in ({"precision": "bf16-mixed", "compile": "off", "cuda_graphs": "off"}, {"planned_steps": 200}):
        rt = redline.Runtime(devices="cuda", seed=0, **options)
        net = Flattens()
        train_steps(rt, EAGER_END + 3 * PHASE + 2, net)
        plan = rt.explain().channels_last
        print(options, plan)
        assert plan.value is False and "forward failed so (RuntimeError: view size" in plan.reason
        assert net.conv.weight.is_contiguous()
        rt.close()


def test_a_step_is_timed_on_the_device_from_its_forward_so_the_wait_before_it_is_left_out():
    import time

    from redline.runtime.stopwatch import StepTimer, Stopwatch

    model = nn.Linear(256, 256).cuda()
    x = torch.randn(512, 256, device="cuda")
    timer = StepTimer(Stopwatch(device=torch.device("cuda")))
    timer.watch(model)
    timer.stepped()
    time.sleep(0.2)  # the loop's own work between steps, with the device idle
    model(x).sum().backward()
    timer.stepped()
    spent = timer.block()
    assert 0.0 < spent < 0.1
    time.sleep(0.2)
    timer.stepped()  # a step no watched model ran: timed from the step before, the wait included
    assert timer.block() >= 0.2


def test_a_batch_copied_ahead_before_the_model_was_laid_out_nhwc_comes_nhwc_as_the_next_ones():
    from redline.runtime.loading import DeviceLoader

    data = TensorDataset(torch.randn(12, 3, 4, 4), torch.randint(0, 2, (12,)))
    loader = DeviceLoader(DataLoader(data, batch_size=4), torch.device("cuda"))
    batches = iter(loader)
    first, _ = next(batches)  # the second is copied already, NCHW
    loader.channels_last = True  # the model's first training forward laid it out
    later = [inputs for inputs, _ in batches]
    assert first.is_contiguous() and all(x.is_contiguous(memory_format=torch.channels_last) for x in later)
