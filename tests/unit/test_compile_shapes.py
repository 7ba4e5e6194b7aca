"""Each compiled model's shapes are its own: a second model of a class, at another batch size, compiles static."""

import torch
from torch import nn

from redline.runtime.compile import compile_module


def test_a_second_model_of_a_class_at_another_batch_size_gets_a_graph_of_fixed_shapes():
    # torch keys the shapes it saw by a code's file, line and name: every model of a class shared one, so a bench's
    # or a tune's next compiled row at another batch size got a graph for dynamic shapes (its batch a SymInt)
    inputs: list[list[str]] = []

    def backend(graph, example_inputs):
        inputs.append([type(value).__name__ for value in example_inputs])
        return graph.forward

    first, second = nn.Sequential(nn.Linear(8, 4)), nn.Sequential(nn.Linear(8, 4))
    compile_module(first, backend=backend)
    compile_module(second, backend=backend)
    first(torch.randn(8, 8))
    second(torch.randn(4, 8))
    assert len(inputs) == 2 and not any("SymInt" in kinds for kinds in inputs)


def test_a_recompiles_cause_is_its_own_models_not_the_last_one_torch_recorded():
    # torch keeps the failed guards per code; the cause read the newest of all, another model's "size mismatch",
    # and with it the hint to pad the batches
    first, second = nn.Sequential(nn.Linear(8, 2)), nn.Sequential(nn.Linear(8, 2))
    one = compile_module(first, backend="eager", dynamic=False)
    other = compile_module(second, backend="eager", dynamic=False)
    first(torch.randn(4, 8))
    second(torch.randn(4, 8))
    second(torch.randn(5, 8))  # the second model recompiles for its batch size
    with torch.no_grad():
        first(torch.randn(4, 8))  # the first for grad mode
    assert "grad_mode" in one.recompiles[-1] and "size mismatch" not in one.recompiles[-1]
    assert "size mismatch" in other.recompiles[-1]
