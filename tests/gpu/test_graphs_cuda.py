"""Training under CUDA graphs captured from the model's own forward (runtime/graphs.py): the same weights as eager,
autocast, BatchNorm, a partial last batch, a forward the graph cannot capture, and auto's check on the first steps."""

import pytest
import torch
from test_runtime_cuda import make_loader, make_model, train_steps
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import redline
from redline.runtime.compile_check import EAGER_END, PHASE

pytestmark = pytest.mark.gpu


def worst_difference(a: nn.Module, b: nn.Module) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_training_under_captured_graphs_matches_eager_weights():
    eager = train_steps(redline.Runtime(devices="cuda", precision="fp32", compile="off", cuda_graphs="off", seed=0), 24)
    rt = redline.Runtime(devices="cuda", precision="fp32", compile="off", cuda_graphs="on", seed=0)
    graphed = train_steps(rt, 24)
    worst = worst_difference(graphed, eager)
    plan = rt.explain().cuda_graphs
    print(f"CUDA graphs (captured) vs eager: max abs weight difference {worst:.3g}; {plan}")
    assert plan is not None and plan.value is True and "24 forward(s) replayed" in plan.reason
    assert worst <= 1e-3  # as compile_mode="reduce-overhead" against eager (test_runtime_cuda.py)


def test_graphs_capture_under_bf16_autocast_and_keep_batchnorm_statistics_as_eager():
    def model() -> nn.Module:
        torch.manual_seed(0)
        layers = [nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(512, 10)]
        return nn.Sequential(*layers)

    def run(graphs: str) -> tuple[nn.Module, redline.Runtime]:
        rt = redline.Runtime(devices="cuda", precision="bf16-mixed", compile="off", cuda_graphs=graphs, seed=0)
        net, opt = rt.setup(model(), lambda params: torch.optim.SGD(params, lr=0.05))
        for inputs, targets in rt.setup_loader(make_loader()):
            with rt.autocast():
                loss = nn.functional.cross_entropy(net(inputs), targets)
            rt.backward(loss)
            rt.step(opt)
        return net, rt

    eager, _ = run("off")
    graphed, rt = run("on")
    bn_eager, bn_graphed = eager[1], graphed[1]
    print(rt.explain().cuda_graphs, worst_difference(graphed, eager))
    assert rt._graphs is not None and rt._graphs.replays == 8 and rt._graphs.failed is None
    assert int(bn_graphed.num_batches_tracked) == int(bn_eager.num_batches_tracked) == 8  # the warm-up's put back
    assert torch.allclose(bn_graphed.running_mean, bn_eager.running_mean, atol=1e-2)
    assert worst_difference(graphed, eager) <= 5e-2  # bf16 rounding, not a different computation


def test_a_partial_last_batch_and_evaluation_run_the_models_own_forward():
    rt = redline.Runtime(devices="cuda", precision="fp32", compile="off", cuda_graphs="on", seed=0)
    net, opt = rt.setup(make_model(), lambda params: torch.optim.AdamW(params, lr=1e-3))
    gen = torch.Generator().manual_seed(2)
    data = TensorDataset(torch.randn(80, 1, 8, 8, generator=gen), torch.randint(0, 10, (80,), generator=gen))
    for inputs, targets in rt.setup_loader(DataLoader(data, batch_size=32)):  # 32, 32, 16
        loss = nn.functional.cross_entropy(net(inputs), targets)
        rt.backward(loss)
        rt.step(opt)
        with rt.eager(), torch.no_grad():
            assert net(inputs).shape == (len(inputs), 10)
    record = rt._graphs
    assert record is not None and record.replays == 2 and record.eager_calls == 1
    assert all(torch.isfinite(p).all() for p in net.parameters())


class Syncs(nn.Module):
    """A forward that reads a value back to the host: a CUDA graph cannot capture it."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer(x)
        return out * 2 if out.sum().item() > 1e9 else out


def test_a_forward_the_graph_cannot_capture_trains_on_eagerly_and_the_plan_says_why():
    rt = redline.Runtime(devices="cuda", precision="fp32", compile="off", cuda_graphs="on", seed=0)
    net, opt = rt.setup(Syncs(), lambda params: torch.optim.SGD(params, lr=0.1))
    x, y = torch.randn(16, 8, device="cuda"), torch.randn(16, 2, device="cuda")
    losses = []
    for _ in range(5):
        loss = nn.functional.mse_loss(net(x), y)
        rt.backward(loss)
        rt.step(opt)
        losses.append(loss.item())
    plan = rt.explain().cuda_graphs
    print(plan, losses)
    assert plan is not None and plan.value is False and "the capture failed" in plan.reason
    assert losses[-1] < losses[0]


def test_auto_times_graphs_on_the_first_steps_and_says_what_it_kept():
    rt = redline.Runtime(devices="cuda", precision="fp32", planned_steps=2000)
    train_steps(rt, EAGER_END + 2 * PHASE + 2)  # graphs, then a compile if the eager steps show one worth it
    plan = rt.explain()
    print(plan.cuda_graphs, plan.compile, sep="\n")
    assert not rt.compile_checking
    assert plan.cuda_graphs is not None and "graphed steps ran" in plan.cuda_graphs.reason
    assert ("confirmed on this run" in plan.cuda_graphs.reason) == plan.cuda_graphs.value


def test_a_capture_beside_a_pin_memory_thread_neither_fails_nor_breaks_the_loader():
    # Loader workers with pinned memory: a thread pins each batch while the step captures; a capture in torch's
    # "global" mode would fail that thread's CUDA calls (runtime/graphs.py captures "thread_local").
    rt = redline.Runtime(devices="cuda", precision="fp32", compile="off", cuda_graphs="on", seed=0, loader_workers=2)
    net, opt = rt.setup(make_model(), lambda params: torch.optim.AdamW(params, lr=1e-3))
    gen = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(512, 1, 8, 8, generator=gen), torch.randint(0, 10, (512,), generator=gen))
    loader = DataLoader(data, batch_size=32, num_workers=2, pin_memory=True, drop_last=True)
    steps = 0
    for inputs, targets in rt.setup_loader(loader):
        loss = nn.functional.cross_entropy(net(inputs), targets)
        rt.backward(loss)
        rt.step(opt)
        steps += 1
    plan = rt.explain()
    print(plan.cuda_graphs, plan.loader)
    assert steps == 16 and rt._graphs is not None and rt._graphs.failed is None and rt._graphs.replays == 16


def test_a_bench_row_with_graphs_on_replays_them_between_other_rows_turns():
    # A bench's (and a tune's) rows take turns in one process: each row's Runtime leaves the process settings
    # between turns, and its model keeps its graphs. Closing it instead had turned them off before its first step.
    from redline.bench.loops import runtime_runner
    from redline.bench.matrix import Setting
    from redline.runtime.options import RuntimeOptions
    from redline.task import Task

    task = Task(model=make_model, loss_fn=nn.functional.cross_entropy, train_data=make_loader().dataset,
                batch_size=32, name="graphed")  # fmt: skip
    setting = Setting("explicit", "cuda", "fp32", False, 32)
    options = RuntimeOptions(devices="cuda", precision="fp32", compile="off", cuda_graphs="on")
    runner = runtime_runner(task, setting, seed=0, planned_steps=None, options=options)
    runner.run(6)
    assert runner.runtime is not None and runner.runtime.graphed_forwards >= 4
