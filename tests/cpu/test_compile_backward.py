"""A training compile's time includes its backward's, and a backward that fails to compile runs the model eagerly.

torch compiles a graph's backward when it first runs, and times that compile in its own metrics, which the compile
records read; redline has it compile the first training graph's backward with its forward, so that a failure falls
back to eager like the forward's own."""

import contextlib
import copy
import logging
import threading
import time

import pytest
import torch
import torch._dynamo.utils as dynamo_utils
import torch._functorch.config as functorch_config
from torch import nn

from redline.runtime import compile as compiling
from redline.runtime import compiler_facts
from redline.runtime.compile import compile_module, compile_seconds

KEY = "compile_fx.<locals>.bw_compiler"  # the name torch's inductor times its backward compiles under


@pytest.fixture
def metrics(monkeypatch):
    """torch's compile-time metrics, fresh for the test, and the records' view of them reset."""
    fresh: dict[str, list[float]] = {}
    monkeypatch.setattr(dynamo_utils, "compilation_time_metrics", fresh)
    for name, value in (("seen", 0.0), ("latest", None), ("keys", []), ("size", -1)):
        monkeypatch.setattr(compiling._BackwardCompiles, name, value)
    return fresh


def backend(metrics: dict[str, list[float]], seconds: float):
    """A torch.compile backend that runs the graphs as traced; its backward compiler, which torch calls at the
    first backward, takes ``seconds`` and records them as inductor's does."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def forward_compiler(graph, example_inputs):
        return make_boxed_func(graph.forward)

    def backward_compiler(graph, example_inputs):
        time.sleep(seconds)
        metrics.setdefault(KEY, []).append(seconds)
        return make_boxed_func(graph.forward)

    return aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler)


# dynamic=False: a recompile at another shape is a graph of fixed shapes too, whose backward torch compiles at its
# first backward (unless the graph saves sizes for it, as under dynamic shapes: then with the forward, in the call)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def lowers_backward_with_forward() -> bool:
    return hasattr(functorch_config, compiler_facts.LOWER_BACKWARD)


def test_the_first_training_graph_compiles_its_backward_in_the_forwards_call(metrics):
    if not lowers_backward_with_forward():
        pytest.skip("this torch compiles a backward at its first backward only")
    model = mlp()
    record = compile_module(model, backend=backend(metrics, 0.3), dynamic=False)
    loss = model(torch.randn(4, 8)).sum()
    assert metrics[KEY] == [0.3]  # compiled with the forward
    with_forward = compile_seconds([record], training=True)
    assert with_forward >= 0.3 and record.compiles == 1
    loss.backward()
    assert compile_seconds([record]) == with_forward  # timed in the call, not counted again
    assert not getattr(functorch_config, compiler_facts.LOWER_BACKWARD)  # torch's setting is put back after the call


@functorch_config.patch(donated_buffer=False)  # else torch refuses a second backward through the graph
def test_a_backward_compiled_at_its_first_backward_is_the_training_compiles_time(metrics):
    # The summary's compile time counted the forward's call alone: on a CPU inductor spent a second more compiling
    # the backward at the first backward, counted as a training step's time. The first training graph's backward
    # compiles with its forward now; a recompile's (another shape) still at its first backward.
    model = mlp()
    record = compile_module(model, backend=backend(metrics, 0.3), dynamic=False)
    model(torch.randn(4, 8)).sum().backward()
    x = torch.randn(5, 8)
    loss = model(x).sum()
    forward_only = compile_seconds([record])
    assert forward_only == record.training_seconds
    loss.backward(retain_graph=True)
    assert compile_seconds([record]) == pytest.approx(forward_only + 0.3)
    assert compile_seconds([record], training=True) == pytest.approx(forward_only + 0.3)
    assert record.compiles == 2 and len(record.recompiles) == 1  # the recompile, and its backward no other
    time.sleep(0.2)
    loss.backward()  # through the same graph again, as a second loss of the batch does: nothing compiles
    model(x).sum().backward()
    assert compile_seconds([record]) == pytest.approx(forward_only + 0.3)


def test_several_forwards_before_one_backward_count_it_once_and_evaluation_has_none(metrics):
    model = mlp()
    record = compile_module(model, backend=backend(metrics, 0.2), dynamic=False)
    sum(model(torch.randn(4, 8)).sum() for _ in range(3)).backward()  # accumulated, one backward
    counted = compile_seconds([record], training=True)
    assert counted >= 0.2 and record.compiles == 1
    with torch.no_grad():
        model(torch.randn(4, 8))  # an evaluation's graph: compiled, with no backward
    assert record.compiles == 2 and compile_seconds([record], training=True) == counted


def test_each_backward_compile_goes_to_the_model_that_compiled_for_training_last(metrics):
    first, second = mlp(), mlp()
    one, other = (compile_module(m, backend=backend(metrics, 0.1), dynamic=False) for m in (first, second))
    for model in (first, second):
        model(torch.randn(4, 8)).sum().backward()  # each one's first training graph
    first(torch.randn(5, 8)).sum().backward()  # recompiled, its backward compiled at the backward
    alone = compile_seconds([one])
    second(torch.randn(5, 8)).sum().backward()
    assert compile_seconds([one]) == alone  # the second model's backward compile is not the first's
    assert compile_seconds([other], training=True) >= 0.2


def failing_backward(calls: list[str]):
    """A torch.compile backend whose forward compiler works and whose backward compiler raises."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def forward_compiler(graph, example_inputs):
        calls.append("forward")
        return make_boxed_func(graph.forward)

    def backward_compiler(graph, example_inputs):
        calls.append("backward")
        raise RuntimeError("no kernel for this backward")

    return aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler)


@pytest.mark.parametrize("evaluated_first", [False, True])
def test_a_backward_that_fails_to_compile_runs_the_model_eagerly_instead_of_failing_the_step(evaluated_first, caplog):
    # The backward compiled at the first backward, where a failure raised the compiler's error out of the user's
    # loss.backward(), past the fall back to eager that a forward's failure gets. With the forward's call now.
    if not lowers_backward_with_forward():
        pytest.skip("this torch compiles a backward at its first backward only")
    torch.manual_seed(0)
    model, calls = mlp(), []
    reference = copy.deepcopy(model)
    record = compile_module(model, backend=failing_backward(calls), dynamic=False)
    x = torch.randn(4, 8)
    if evaluated_first:
        with torch.no_grad():
            model(x)  # an evaluation's graph, compiled: there is no backward to fail
        assert record.compiles == 1 and record.fell_back is None
    with caplog.at_level(logging.WARNING, logger="redline"):
        model(x).sum().backward()
    reference(x).sum().backward()
    assert "backward" in calls and "no kernel for this backward" in (record.fell_back or "")
    assert "running eagerly" in caplog.text
    for got, expected in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(got.grad, expected.grad)  # the step's gradients, from the eager forward
    calls.clear()
    model(x).sum().backward()
    assert calls == [] and record.calls == 1 + evaluated_first  # eager from then on: nothing compiled or called
    assert record.seconds is not None and record.seconds > 0


def test_torchs_inductor_still_times_its_backward_compiles_under_the_name_read(monkeypatch):
    # The records read torch's own metrics: a torch that renamed them would leave the backward's compile uncounted.
    def backward_compiles() -> float:
        return sum(
            t for key, ts in dynamo_utils.compilation_time_metrics.items() if key.endswith("bw_compiler") for t in ts
        )

    import torch._inductor.config as inductor_config

    model = mlp()
    record = compile_module(model)
    # at the first backward, as torch compiles a recompile's (its first training graph's compiles with the forward)
    monkeypatch.setattr(compiling, "backward_with_forward", contextlib.nullcontext)
    before = backward_compiles()
    # compiled, not served from torch's on-disk caches (an earlier run's), where nothing compiles to be timed
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        loss = model(torch.randn(4, 8)).sum()
        forward_only, after_forward = compile_seconds([record]), backward_compiles()
        loss.backward()
    assert after_forward == before and backward_compiles() > before  # compiled at the backward, timed by this name
    assert compile_seconds([record]) == pytest.approx(forward_only + backward_compiles() - after_forward)


def failing_at_call(calls: list[int], failing: int):
    """A torch.compile backend (no AOTAutograd: the graph's backward is eager) that fails its ``failing``-th compile."""

    def compiler(graph, example_inputs):
        calls.append(1)
        if len(calls) == failing:
            raise RuntimeError("no kernel for this shape")
        return graph.forward

    return compiler


def test_a_recompile_that_fails_mid_run_runs_eagerly_and_its_time_is_a_training_compiles(caplog):
    model, calls = mlp(), []
    record = compile_module(model, backend=failing_at_call(calls, failing=2), dynamic=False)
    model(torch.randn(4, 8)).sum().backward()  # the first training graph
    first = compile_seconds([record])
    with caplog.at_level(logging.WARNING, logger="redline"):
        model(torch.randn(5, 8)).sum().backward()  # another shape: the recompile fails, this call runs eagerly
    assert "no kernel for this shape" in (record.fell_back or "") and "running eagerly" in caplog.text
    assert record.compiles == 1 and compile_seconds([record]) > first
    # the failed compile is a training step's, left out of its speed as a compile is
    assert compile_seconds([record], training=True) == pytest.approx(compile_seconds([record]))
    model(torch.randn(4, 8)).sum().backward()
    assert len(calls) == 2 and record.calls == 2  # eager from then on, the shape that compiled too


def test_a_backward_that_fails_in_one_models_call_is_not_counted_to_another(metrics):
    if not lowers_backward_with_forward():
        pytest.skip("this torch compiles a backward at its first backward only")
    first, second = mlp(), mlp()
    one = compile_module(first, backend=backend(metrics, 0.1), dynamic=False)
    compile_module(second, backend=failing_backward([]), dynamic=False)
    first(torch.randn(4, 8)).sum().backward()
    alone = compile_seconds([one])

    def failing_timed(graph, example_inputs):  # as inductor's, timed in torch's metrics even where it fails
        metrics.setdefault(KEY, []).append(0.3)
        raise RuntimeError("no kernel for this backward")

    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    third = mlp()
    compile_module(third, backend=aot_autograd(fw_compiler=lambda g, e: make_boxed_func(g.forward),
                                                bw_compiler=failing_timed), dynamic=False)  # fmt: skip
    third(torch.randn(4, 8)).sum().backward()  # fails with its forward, runs eagerly
    first(torch.randn(4, 8)).sum().backward()
    assert compile_seconds([one]) == alone  # the 0.3 s the third model's failure took is not the first's


def test_torchs_setting_is_put_back_after_an_error_or_an_interrupt_and_is_this_threads_alone():
    if not lowers_backward_with_forward():
        pytest.skip("this torch compiles a backward at its first backward only")
    setting = compiler_facts.LOWER_BACKWARD
    assert getattr(functorch_config, setting) is False
    for raised in (ValueError("the user's"), KeyboardInterrupt()):
        with pytest.raises(type(raised)), compiler_facts.backward_with_forward():
            assert getattr(functorch_config, setting) is True
            raise raised
        assert getattr(functorch_config, setting) is False
    # torch keeps it per thread: a thread inside leaves another thread's compiles as they were
    seen: list[bool] = []

    def other_thread():
        seen.append(getattr(functorch_config, setting))

    with compiler_facts.backward_with_forward():
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join(10)
        seen.append(getattr(functorch_config, setting))
    assert seen == [False, True] and getattr(functorch_config, setting) is False


def test_a_compiled_model_inside_another_compiled_model_is_compiled_with_it():
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.head = mlp(), nn.Linear(2, 2)

        def forward(self, x):
            return self.head(self.inner(x))

    torch.manual_seed(0)
    model = Outer()
    reference = copy.deepcopy(model)
    inner = compile_module(model.inner, backend="eager", dynamic=False)
    outer = compile_module(model, backend="eager", dynamic=False)
    x = torch.randn(4, 8)
    torch.testing.assert_close(model(x), reference(x))
    assert outer.compiles == 1 and outer.fell_back is None and outer.eager_calls == 0
    assert inner.calls == 0 and inner.fell_back is None  # traced into the outer graph, not called on its own
