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
