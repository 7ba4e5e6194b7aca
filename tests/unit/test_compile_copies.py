"""A compiled module's copies (an EMA, a teacher) and pickles run their own weights, eagerly."""

import copy
import io

import torch
from torch import nn

from redline.runtime.compile import compile_module


def backend(graph, example_inputs):
    return graph.forward  # the graph as traced: no compiler to wait for


def test_a_deepcopy_of_a_compiled_model_runs_its_own_weights_and_leaves_the_originals_counts():
    # The copy's forward was the original's compiled call: an EMA's outputs were the live model's, silently.
    model = nn.Sequential(nn.Linear(8, 4))
    record = compile_module(model, backend=backend)
    x = torch.randn(3, 8)
    model(x)
    ema = copy.deepcopy(model)
    with torch.no_grad():
        for p in ema.parameters():
            p.zero_()
    assert torch.count_nonzero(ema(x)) == 0 and torch.count_nonzero(model(x)) > 0
    assert record.calls == 2  # the copy's call was not the original's


def test_a_compiled_model_saved_whole_loads_as_a_plain_module():
    # torch.save(model) raised "Can't pickle local object 'compile_module.<locals>.counted'"
    model = nn.Sequential(nn.Linear(8, 4))
    compile_module(model, backend=backend)
    x = torch.randn(3, 8)
    expected = model(x)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(loaded(x), expected)
