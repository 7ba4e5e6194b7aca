"""CUDA graphs for training: the axis's rules, the record that routes each forward, and the check that keeps the
fastest form. CUDA is stood in for: a capture here returns a forward that counts its calls (tests/gpu captures for
real)."""

from __future__ import annotations

import functools
import logging
import random as py_random

import pytest
import torch
from torch import nn

import redline.runtime.graphs as graphs_home
import redline.runtime.runtime as runtime_home
from devices import CPU_AVX2, H100
from graph_standins import Capture, Net
from redline.errors import ConfigError
from redline.plan import Choice
from redline.plan.graphs import resolve_graphs
from redline.runtime.compile import CompileRecord
from redline.runtime.compile_check import EAGER_END, PHASE, STEPS, CompileCheck
from redline.runtime.graphs import GraphRecord, capture_graphs
from redline.runtime.options import RuntimeOptions
from redline.runtime.runtime import Runtime
from redline.runtime.stopwatch import StepTimer, Stopwatch

# -- the axis -------------------------------------------------------------------------------------


def test_auto_proposes_graphs_on_a_cuda_device_and_not_elsewhere():
    assert resolve_graphs("auto", H100, compile="auto").value is True
    off = resolve_graphs("auto", CPU_AVX2, compile="auto")
    assert off.value is False and "need a CUDA device, this is cpu" in off.reason
    assert resolve_graphs("off", H100, compile="auto") == Choice(False, "requested")
    assert resolve_graphs(True, H100, compile="off") == Choice(True, "requested")


@pytest.mark.parametrize(
    ("run", "said"),
    [
        ({"world_size": 2}, "2 processes"),
        ({"grad_accum": 4}, "grad_accum=4"),
        ({"micro_batch": "auto"}, "micro_batch='auto'"),
        ({"checkpointing": "on"}, "activation checkpointing"),
    ],
)
def test_what_a_graphed_step_cannot_follow_keeps_auto_off_and_refuses_on(run, said):
    off = resolve_graphs("auto", H100, compile="auto", **run)
    assert off.value is False and said in off.reason
    with pytest.raises(ConfigError, match=said) as refused:
        resolve_graphs("on", H100, compile="off", **run)
    assert "hint: pass cuda_graphs='auto' or 'off'" in str(refused.value)


def test_graphs_and_a_requested_compile_are_one_too_many():
    assert resolve_graphs("auto", H100, compile="on").value is False
    with pytest.raises(ConfigError, match="reduce-overhead"):
        resolve_graphs("on", H100, compile="on")


def test_graphs_asked_of_a_cpu_are_refused_when_the_runtime_is_built():
    with pytest.raises(ConfigError, match="cuda_graphs") as refused:
        Runtime(devices="cpu", cuda_graphs="on")
    assert "CUDA graphs need a CUDA device" in str(refused.value)


def test_on_a_cpu_the_plan_says_why_graphs_are_off():
    rt = Runtime(devices="cpu", precision="fp32", compile="off")
    model = nn.Linear(4, 2)
    rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    plan = rt.explain()
    assert plan.cuda_graphs is not None and plan.cuda_graphs.value is False
    assert "need a CUDA device" in plan.cuda_graphs.reason
    assert "cuda_graphs" in plan.to_dict()


# -- the record -------------------------------------------------------------------------------------


def graphed(capture: Capture) -> tuple[Net, GraphRecord]:
    net = Net()
    record = GraphRecord(net, net.forward, capture=capture)
    record.use_graphed()
    return net, record


def test_the_first_training_forward_captures_on_a_copy_of_its_inputs_and_later_steps_replay():
    capture = Capture()
    net, record = graphed(capture)
    x = torch.randn(3, 4)
    for _ in range(3):
        net(x).sum().backward()
        record.stepped()
    assert len(capture.samples) == 1 and record.replays == 3 and capture.replays == 3 + 1  # and the comparison
    sample = capture.samples[0][0]
    assert torch.equal(sample, x) and sample.data_ptr() != x.data_ptr()  # the graph's buffer, not the batch


def test_what_the_graph_cannot_follow_runs_the_modules_own_forward():
    capture = Capture()
    net, record = graphed(capture)
    net(torch.randn(3, 4))  # captured at batch 3
    record.stepped()
    net(torch.randn(2, 4))  # a partial last batch
    with torch.no_grad():
        net(torch.randn(3, 4))  # evaluation
    net.eval()
    net(torch.randn(3, 4))
    net.train()
    net(torch.randn(3, 4), **{})  # a keyword-free call in train mode: graphed
    net(torch.randn(3, 4))  # a second forward before the step
    record.stepped()
    net(torch.randn(3, 4).double())  # another dtype
    assert record.replays == 2 and record.eager_calls == 5


def test_a_failed_capture_leaves_the_model_on_its_own_forward_and_says_why(caplog):
    capture = Capture(fail=RuntimeError("operation not permitted when stream is capturing"))
    net, record = graphed(capture)
    with caplog.at_level(logging.WARNING, logger="redline"):
        out = net(torch.randn(3, 4))
    assert out.shape == (3, 2) and record.failed is not None and "operation not permitted" in record.failed
    assert net.forward == record.eager and not record.on
    net(torch.randn(3, 4))
    assert len(capture.samples) == 1  # never tried again
    assert "hint: pass cuda_graphs='off'" in caplog.text
    record.use_graphed()  # a check switching forms does not bring back a graph that failed
    assert net.forward == record.eager


def test_hooks_on_the_models_layers_keep_graphs_off_as_a_replay_would_never_call_them(caplog):
    # a replay calls none of the model's layers: a feature tap on one ran once, at the capture, and never again
    capture = Capture()
    net, record = graphed(capture)
    seen = []
    net.layer.register_forward_hook(lambda module, inputs, output: seen.append(output.shape[0]))
    with caplog.at_level(logging.WARNING, logger="redline"):
        for batch in (3, 3):
            net(torch.randn(batch, 4)).sum().backward()
            record.stepped()
    assert seen == [3, 3] and not capture.samples and net.forward == record.eager  # the hook saw every step
    assert (
        record.failed == "the hooks on its layer(s) layer would run while the graphs are captured and never as they "
        "replay"
    )
    assert "CUDA graphs are not used for Net" in caplog.text
    assert "the hooks on its layer(s) layer would run" in record.explain(Choice(True, "auto: ...")).reason


def test_hooks_on_every_module_keep_graphs_off_too():
    capture = Capture()
    net, record = graphed(capture)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, inputs, output: None)
    try:
        net(torch.randn(3, 4))
    finally:
        handle.remove()
    assert not capture.samples and "the hooks on every module" in str(record.failed)
    hooked, plain = graphed(Capture())  # the model's own hooks run around the replay, as around its forward
    hooked.register_forward_hook(lambda module, inputs, output: None)
    hooked(torch.randn(3, 4))
    assert plain.failed is None and plain.replays == 1


def test_graphs_that_compute_something_else_than_the_model_are_never_used(caplog):
    capture = Capture(scale=2.0)
    net, record = graphed(capture)
    x = torch.randn(3, 4)
    with caplog.at_level(logging.WARNING, logger="redline"):
        out = net(x)
    assert torch.allclose(out, net.layer(x))  # this step ran the model's own forward
    assert record.failed is not None and "differ from the model's own (by 1 at most, more than 0.01)" in record.failed
    assert net.forward == record.eager and "are not used" in caplog.text


def test_graphs_that_match_say_by_how_much_and_a_random_forward_is_held_by_its_shapes():
    net, record = graphed(Capture())
    net(torch.randn(3, 4))
    assert record.compared == "outputs and gradients match the model's own forward within 0"
    dropout = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5))
    random = GraphRecord(dropout, dropout.forward, capture=Capture())
    random.use_graphed()
    dropout(torch.randn(16, 4))
    assert random.failed is None and "not compared by value" in random.compared


class HostRandom(nn.Module):
    """Teacher forcing by Python's ``random`` (or a step counter): a graph would capture one branch and replay it."""

    def __init__(self, counter: bool) -> None:
        super().__init__()
        self.layer, self.counter, self.calls = nn.Linear(4, 4), counter, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.counter:
            return self.layer(x) * self.calls
        return self.layer(x) if py_random.random() < 0.5 else self.layer(x).relu()


@pytest.mark.parametrize("counter", [False, True])
def test_a_forward_random_on_the_host_is_refused_and_device_dropout_is_not(counter, caplog):
    py_random.seed(1)  # draws 0.13, 0.85, 0.76: the second and third forwards take the other branch than the first
    net = HostRandom(counter)
    record = GraphRecord(net, net.forward, capture=Capture())
    record.use_graphed()
    with caplog.at_level(logging.WARNING, logger="redline"):
        net(torch.randn(3, 4))
    assert record.failed is not None and "its randomness is the host's" in record.failed
    assert "by inf" not in record.failed and "are not used" in caplog.text
    dropout = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5))  # draws from the device's generator: allowed
    random = GraphRecord(dropout, dropout.forward, capture=Capture())
    random.use_graphed()
    dropout(torch.randn(16, 4))
    assert random.failed is None and "not compared by value" in random.compared


def test_the_outputs_are_copies_a_later_replay_does_not_overwrite():
    net, record = graphed(Capture(static=True))
    x1, x2 = torch.randn(3, 4), torch.randn(3, 4)
    first = net(x1)
    kept = first.detach().clone()
    first.sum().backward()  # the gradient flows through the copy into the graph
    assert net.layer.weight.grad is not None
    record.stepped()
    net(x2)
    assert torch.equal(first.detach(), kept)


def test_the_capture_puts_back_the_buffers_its_warm_up_moved(monkeypatch):
    bn = nn.BatchNorm1d(4)
    before = bn.running_mean.clone()

    def make_graphed_callables(module, sample, **_):
        for _ in range(3):  # torch's warm-up runs the forward on the sample
            module(*sample)
        return module

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", make_graphed_callables)
    own = bn.forward
    capture_graphs(bn, (torch.randn(8, 4) + 5,))
    assert torch.equal(bn.running_mean, before) and int(bn.num_batches_tracked) == 0
    assert bn.forward == own


def test_eagerly_runs_the_modules_own_forward_inside_and_the_graphs_after():
    capture = Capture()
    net, record = graphed(capture)
    with record.eagerly():
        assert net.forward == record.eager
    assert record.on and net.forward != record.eager


# -- the check ---------------------------------------------------------------------------------------

PLANNED = Choice(True, "auto: 5000 steps on NVIDIA H100 repay the compile time")
GRAPHS = Choice(True, "auto: graphs")


def drive(
    eager_ms: float, graphed_ms: float, compiled_ms: float | None, steps: int, *, fail: bool = False
) -> tuple[CompileCheck, GraphRecord, list[str]]:
    """Run a check on a fake clock for ``steps`` steps: each step costs what the model's current form costs.
    ``compiled_ms`` None: the compile is no candidate (the rule said no)."""
    net = Net()
    capture = Capture(fail=RuntimeError("capture failed") if fail else None)
    graphs = GraphRecord(net, net.forward, capture=capture)
    now = [0.0]
    planned = PLANNED if compiled_ms is not None else Choice(False, "auto: 600 steps are too few")
    check = CompileCheck(planned, 100_000, StepTimer(Stopwatch(clock=lambda: now[0])))
    compiled = None
    if compiled_ms is not None:
        own = net.forward

        def compiled_forward(*args):
            return own(*args)

        net.forward = compiled_forward
        compiled = CompileRecord(module=net, eager=own, seconds=4.0, compiles=1, training=1)
        check.add(compiled)
    check.add_graphs(graphs, GRAPHS)
    ran = []
    x = torch.randn(2, 4)
    for _ in range(steps):
        if compiled is not None and net.forward is compiled_forward:
            form, cost = "compiled", compiled_ms
        elif graphs.on:
            form, cost = "graphs", graphed_ms
        else:
            form, cost = "eager", eager_ms
        net(x)
        graphs.stepped()
        ran.append(form)
        now[0] += float(cost or 0.0) / 1e3
        check.after_step()
    return check, graphs, ran


def test_faster_graphs_are_kept_where_no_compile_is_planned():
    check, graphs, ran = drive(eager_ms=2.2, graphed_ms=1.0, compiled_ms=None, steps=STEPS + 5)
    assert ran[:EAGER_END] == ["eager"] * EAGER_END and set(ran[EAGER_END:]) == {"graphs"}
    assert check.decided and check.graphed == [pytest.approx(0.001)] * 3
    choice = check.explain_graphs()
    assert choice is not None and choice.value is True and graphs.on
    assert "confirmed on this run: graphed steps ran 2.20x eager (1 against 2.2 ms" in choice.reason
    assert check.explain() == check.planned  # the compile was never a candidate


def test_graphs_then_the_compile_are_timed_and_the_fastest_form_stays():
    check, graphs, ran = drive(eager_ms=3.0, graphed_ms=2.0, compiled_ms=1.5, steps=EAGER_END + 2 * PHASE + 3)
    assert ran[EAGER_END : EAGER_END + PHASE] == ["graphs"] * PHASE
    assert set(ran[EAGER_END + PHASE :]) == {"compiled"}
    compile_choice, graphs_choice = check.explain(), check.explain_graphs()
    assert compile_choice.value is True and "compiled steps ran 2.00x eager" in compile_choice.reason
    assert graphs_choice is not None and graphs_choice.value is False and not graphs.on
    assert f"the compiled forward from step {EAGER_END + 2 * PHASE + 1}" in graphs_choice.reason


def test_graphs_that_beat_the_compile_stay_and_the_compile_is_dropped():
    check, graphs, ran = drive(eager_ms=3.0, graphed_ms=1.0, compiled_ms=2.5, steps=EAGER_END + 2 * PHASE + 3)
    assert ran[-3:] == ["graphs"] * 3 and graphs.on
    compile_choice = check.explain()
    assert compile_choice.value is False and "and graphed steps ran 3.00x eager" in compile_choice.reason
    assert f"CUDA graphs from step {EAGER_END + 2 * PHASE + 1} (the compile took 4.0 s)" in compile_choice.reason


def test_slower_graphs_give_the_model_back_its_own_forward():
    check, graphs, ran = drive(eager_ms=2.0, graphed_ms=2.5, compiled_ms=None, steps=STEPS + 3)
    assert ran[-3:] == ["eager"] * 3 and not graphs.on
    choice = check.explain_graphs()
    assert choice is not None and choice.value is False
    assert "graphed steps ran 0.80x eager" in choice.reason and "the model's own forward from step" in choice.reason


def test_a_failed_capture_is_not_timed_as_graphs():
    check, _, _ = drive(eager_ms=2.0, graphed_ms=0.5, compiled_ms=None, steps=STEPS + 1, fail=True)
    choice = check.explain_graphs()
    assert check.decided and choice is not None and choice.value is False
    assert "but off: the capture failed: RuntimeError: capture failed" in choice.reason


def test_until_it_decides_the_plan_says_graphs_are_being_checked():
    check, _, _ = drive(eager_ms=2.0, graphed_ms=1.0, compiled_ms=None, steps=EAGER_END + 3)
    choice = check.explain_graphs()
    assert choice is not None and f"being checked on this run (step {EAGER_END + 3} of {STEPS})" in choice.reason


# -- the Runtime, with CUDA stood in for ----------------------------------------------------------------


@pytest.fixture
def graphs_proposed(monkeypatch):
    """The Runtime on a CPU proposes graphs as on a CUDA device, and captures with a stand-in."""
    capture = Capture()

    def resolve(requested, facts, **_):
        return Choice(requested != "off", "auto: graphs" if requested == "auto" else "requested")

    monkeypatch.setattr(graphs_home, "resolve_graphs", resolve)
    monkeypatch.setattr(runtime_home, "check_cuda_graphs", lambda requested, device_type: None)
    monkeypatch.setattr(graphs_home, "GraphRecord", functools.partial(GraphRecord, capture=capture))
    return capture


def train(rt: Runtime, steps: int) -> tuple[Net, GraphRecord | None]:
    torch.manual_seed(0)
    net = Net()
    model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    for _ in range(steps):
        rt.backward(nn.functional.mse_loss(model(x), y))
        rt.step(optimizer)
        with rt.eager(), torch.no_grad():
            model(x)  # evaluation in between runs the model's own forward
    return net, rt._graphs


def test_the_runtime_times_graphs_on_its_first_steps_and_keeps_them_when_faster(graphs_proposed, monkeypatch):
    monkeypatch.setattr("redline.runtime.compile_check.KEEP", 0.0)  # kept whatever this machine's timing
    rt = Runtime(devices="cpu", precision="fp32", compile="off")
    assert rt.compile_checking is False
    _, record = train(rt, STEPS + 4)
    assert record is not None and record.on and not rt.compile_checking
    assert len(graphs_proposed.samples) == 1 and record.replays == STEPS + 4 - EAGER_END
    plan = rt.explain().cuda_graphs
    assert plan is not None and plan.value is True and "confirmed on this run: graphed steps ran" in plan.reason


def test_graphs_asked_for_replay_from_the_first_step_unchecked(graphs_proposed):
    rt = Runtime(devices="cpu", precision="fp32", cuda_graphs="on", planned_steps=10**6)
    _, record = train(rt, 5)
    assert record is not None and record.replays == 5 and rt._compile_check is None
    plan = rt.explain()
    assert plan.cuda_graphs is not None and "requested; captured 1 time(s) in" in plan.cuda_graphs.reason
    assert plan.compile is not None and plan.compile.value is False and "cuda_graphs='on'" in plan.compile.reason


def test_captures_refuse_unsafe_cuda_calls_in_the_capturing_thread_only(monkeypatch):
    made = []

    class Graph:  # stands in for torch.cuda.graph, with its signature
        def __init__(self, cuda_graph, pool=None, stream=None, capture_error_mode="global"):
            made.append(capture_error_mode)

    monkeypatch.setattr(torch.cuda, "graph", Graph)
    with graphs_home._thread_local_capture():
        torch.cuda.graph(object(), pool=None)  # as make_graphed_callables calls it
        torch.cuda.graph(object(), capture_error_mode="relaxed")  # a mode given stays
    assert made == ["thread_local", "relaxed"] and torch.cuda.graph is Graph


class Faithful:
    """Stands in for torch's capture as its graphed function behaves: the output and every parameter's gradient live
    in one buffer each, which each replay overwrites, and are handed out detached, as views of those buffers (so
    autograd keeps the gradient buffer itself as ``.grad``)."""

    def __call__(self, module: nn.Module, sample: tuple[torch.Tensor, ...]):
        own, params = module.forward, [p for p in module.parameters() if p.requires_grad]
        grads = [torch.zeros_like(p) for p in params]
        out_buffer: list[torch.Tensor] = []
        saved: list[torch.Tensor] = []

        class Graphed(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, *_params):
                with torch.enable_grad():
                    out = own(x.detach())
                saved[:] = [out]  # the graph's saved activations: one set, the last replay's
                if not out_buffer:
                    out_buffer.append(torch.empty_like(out.detach()))
                out_buffer[0].copy_(out.detach())
                return out_buffer[0].detach()

            @staticmethod
            def backward(ctx, grad):
                computed = torch.autograd.grad(saved[0], params, grad, retain_graph=True)  # a graph replays again
                for buffer, value in zip(grads, computed, strict=True):
                    buffer.copy_(value)
                return (None, *(buffer.detach() for buffer in grads))

        return lambda x: Graphed.apply(x, *params)


@pytest.mark.parametrize("backwards", [1, 2])
def test_graphed_steps_train_the_weights_eager_steps_do_though_gradients_live_in_the_graphs_buffers(
    monkeypatch, backwards
):
    # Two backwards per step (a loop that accumulates without telling the Runtime): the second forward runs eagerly
    # and adds to the gradient the graph handed out, before the next replay could overwrite it.
    monkeypatch.setattr(runtime_home, "check_cuda_graphs", lambda requested, device_type: None)
    proposed = lambda requested, facts, **_: Choice(requested == "on", "requested")  # noqa: E731
    monkeypatch.setattr(graphs_home, "resolve_graphs", proposed)
    monkeypatch.setattr(graphs_home, "GraphRecord", functools.partial(GraphRecord, capture=Faithful()))

    def run(graphs: str) -> nn.Module:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        rt = Runtime(devices="cpu", precision="fp32", compile="off", cuda_graphs=graphs)
        model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
        gen = torch.Generator().manual_seed(1)
        for _ in range(6):
            for _ in range(backwards):
                x, y = torch.randn(5, 4, generator=gen), torch.randn(5, 2, generator=gen)
                rt.backward(nn.functional.mse_loss(model(x), y))
            rt.step(optimizer)
        return net

    eager, graphed = run("off"), run("on")
    for a, b in zip(eager.parameters(), graphed.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


class Keyword(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.layer(x) * scale


def test_graphs_that_never_replay_in_their_phase_are_not_kept_on_eager_timing():
    net = Keyword()
    graphs = GraphRecord(net, net.forward, capture=Capture())
    now = [0.0]
    check = CompileCheck(Choice(False, "auto: too few steps"), 100_000, StepTimer(Stopwatch(clock=lambda: now[0])))
    check.add_graphs(graphs, GRAPHS)
    for _ in range(STEPS + 1):
        net(torch.randn(2, 4), scale=0.5)  # a keyword: the graphs cannot take the call
        graphs.stepped()
        now[0] += 0.001 if graphs.on else 0.002  # "faster" in the graphed phase, though no forward replayed
        check.after_step()
    choice = check.explain_graphs()
    assert choice is not None and choice.value is False and graphs.replays == 0 and not graphs.on
    assert f"the graphs replayed 0 of the {PHASE} forwards of their phase" in choice.reason


def test_graphs_stopped_after_the_check_kept_them_are_said_off():
    check, graphs, _ = drive(eager_ms=2.2, graphed_ms=1.0, compiled_ms=None, steps=STEPS + 1)
    assert check.explain_graphs().value is True
    graphs.stop("a second model was set up (a graphed step is one model's forward and backward)")
    choice = check.explain_graphs()
    assert choice.value is False and "a second model was set up" in choice.reason and graphs.graphed is None


def test_unfrozen_parameters_or_inputs_that_stay_other_are_captured_anew():
    capture = Capture()
    net, record = graphed(capture)
    net.layer.bias.requires_grad_(False)
    x = torch.randn(3, 4)
    net(x)
    record.stepped()
    net.layer.bias.requires_grad_(True)  # a second phase unfreezes it: the first graphs give it no gradient
    net(x).sum().backward()
    record.stepped()
    assert record.captures == 2 and net.layer.bias.grad is not None
    for _ in range(2):  # batches of 5 from now on: the first two run eagerly, the third captures at 5
        net(torch.randn(5, 4))
        record.stepped()
    assert record.captures == 2 and record.eager_calls == 2
    net(torch.randn(5, 4))
    assert record.captures == 3 and record.inputs is not None and record.inputs[0][0][0] == (5, 4)


def test_eval_mode_never_captures_and_a_second_model_refuses_graphs_asked_for(monkeypatch):
    capture = Capture()
    net, record = graphed(capture)
    net.eval()
    net(torch.randn(3, 4))
    assert record.captures == 0 and not capture.samples
    monkeypatch.setattr(graphs_home, "resolve_graphs", lambda requested, facts, **_: Choice(True, "requested"))
    options = RuntimeOptions(cuda_graphs="on")
    with pytest.raises(ConfigError, match="a second model was set up"):
        graphs_home.setup_graphs(nn.Linear(2, 2), options, H100, world_size=1, records=[], current=record)


def test_auto_leaves_graphs_to_a_reduce_overhead_compile():
    off = resolve_graphs("auto", H100, compile="auto", compile_mode="reduce-overhead")
    assert off.value is False and "reduce-overhead" in off.reason


def test_a_second_backward_through_one_graphed_forward_counts_both(monkeypatch):
    # retain_graph: the graph's backward replays twice and writes its gradient buffer twice; a copy goes to .grad
    def grads(graphs: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        record = GraphRecord(net, net.forward, capture=Faithful())
        if graphs:
            record.use_graphed()
        out = net(torch.randn(5, 4, generator=torch.Generator().manual_seed(1)))
        assert (record.captures, record.replays) == ((1, 1) if graphs else (0, 0))  # the forward replayed the graph
        out.pow(2).sum().backward(retain_graph=True)
        out.sum().backward()
        return [p.grad.clone() for p in net.parameters()]

    for a, b in zip(grads(False), grads(True), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_a_deep_copy_of_a_graphed_model_runs_its_own_forward_and_leaves_the_originals_graphs_alone():
    import copy

    capture = Capture()
    net, record = graphed(capture)
    x = torch.randn(3, 4)
    net(x)
    record.stepped()
    twin = copy.deepcopy(net)  # an EMA or a teacher
    own = twin.forward.__self__
    assert own is not record and own.module is twin and own.graphed is None and not own.on
    with torch.no_grad():
        twin.layer.weight.add_(1.0)
    assert torch.allclose(twin(x), twin.layer(x)) and own.captures == 0  # its own weights, its own forward
    assert record.captures == 1 and all(p._backward_hooks for p in net.parameters())  # the original's, untouched
    assert torch.allclose(net(x), net.layer(x)) and record.replays == 2


def test_buffers_put_back_do_not_break_the_backward_of_an_earlier_forward():
    bn = nn.BatchNorm1d(4)
    x = torch.randn(8, 4, requires_grad=True)
    y = bn(x)  # its backward saved the running statistics
    with graphs_home.kept_buffers(bn):
        bn(torch.randn(8, 4))  # a capture's warm-up or comparison moves them
    y.sum().backward()  # put back without bumping their version: no "modified by an inplace operation"
    assert x.grad is not None


def test_a_capture_waits_for_the_first_forward_of_a_step_and_a_fitting_call_breaks_a_run_of_others():
    net = Keyword()
    record = GraphRecord(net, net.forward, capture=Capture())
    record.use_graphed()
    x = torch.randn(4, 4)
    net(x, scale=2.0)  # a keyword first: ineligible, and the step now has a forward whose backward is pending
    net(x)  # eligible, but a capture now would put back buffers that forward saved: it runs eagerly
    assert record.captures == 0 and record.eager_calls == 2
    record.stepped()
    net(x)
    assert record.captures == 1
    for _ in range(4):  # epochs of two full batches and a partial one: the partial never builds a run of 3
        for batch in (4, 4, 2):
            record.stepped()
            net(torch.randn(batch, 4))
    assert record.captures == 1 and record.replays == 1 + 8


def test_graphs_stay_off_under_ddp_or_fsdp_and_a_closed_runtime_gives_the_model_its_own_forward(graphs_proposed):
    off = resolve_graphs("auto", H100, compile="auto", strategy="ddp")
    assert off.value is False and "strategy='ddp'" in off.reason
    rt = Runtime(devices="cpu", precision="fp32", cuda_graphs="on")
    net, record = train(rt, 3)
    assert record is not None and record.on and record.graphed is not None
    rt.close()
    assert not record.on and record.graphed is None and net.forward == record.eager
    assert rt.explain().cuda_graphs.value is True  # what the run did stays said


def test_a_module_with_forward_hooks_is_captured_without_them_and_they_run_around_each_replay():
    class Bare(Capture):  # torch refuses to capture a module with hooks
        def __call__(self, module: nn.Module, sample: tuple[torch.Tensor, ...]):
            assert not module._forward_pre_hooks and not module._forward_hooks
            return super().__call__(module, sample)

    capture = Bare()
    net, record = graphed(capture)
    calls = []
    net.register_forward_pre_hook(lambda module, args: calls.append("pre"))
    net.register_forward_hook(lambda module, args, out: calls.append("post"))
    for _ in range(2):
        net(torch.randn(3, 4)).sum().backward()
        record.stepped()
    assert record.failed is None and record.replays == 2 and calls == ["pre", "post"] * 2
