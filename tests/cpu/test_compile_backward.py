"""A training compile's time includes its backward's: torch compiles a graph's backward when it first runs."""

import time

import torch
from torch import nn

from redline.runtime.compile import compile_module


def slow_backward_backend(seconds: float):
    """A torch.compile backend that runs the graphs as traced, its backward compiler taking ``seconds``."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def forward_compiler(graph, example_inputs):
        return make_boxed_func(graph.forward)

    def backward_compiler(graph, example_inputs):
        time.sleep(seconds)  # a backward compile of this length, paid at the first backward
        return make_boxed_func(graph.forward)

    return aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler)


def test_the_first_backward_after_a_training_compile_is_counted_as_compile_time():
    # The summary's compile time counted the forward's call only: on a CPU inductor spent a second more compiling
    # the backward at the first backward, counted as a training step's time.
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    record = compile_module(model, backend=slow_backward_backend(0.3))
    x = torch.randn(4, 8)
    loss = model(x).sum()
    forward_only = record.seconds
    assert forward_only is not None and record.training_seconds == forward_only
    loss.backward()
    assert record.seconds - forward_only >= 0.3 and record.training_seconds == record.seconds
    assert record.compiles == 1 and record.recompiles == []  # the same compile, not another
    counted = record.seconds
    model(x).sum().backward()  # the graph and its backward are built: nothing more
    with torch.no_grad():
        model(x)  # an evaluation's graph: its own compile, no backward to wait for
    assert record.compiles == 2 and record.training_seconds == counted


def test_a_forward_under_grad_whose_output_is_never_back_propagated_adds_nothing_later():
    model = nn.Linear(8, 2)
    record = compile_module(model, backend=slow_backward_backend(0.0))
    model(torch.randn(4, 8))  # under grad, its loss dropped (a validation without no_grad)
    seconds = record.seconds
    other = nn.Linear(8, 2)
    other(torch.randn(4, 8)).sum().backward()  # another model's backward: not this record's
    assert record.seconds == seconds
