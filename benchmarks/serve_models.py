"""The models benchmarks/serve.py serves, the same weights in every server: the digits CNN and a larger MLP.

Each factory seeds its own weights, so redline, LitServe and FastAPI load the same model.
    redline serve benchmarks/serve_models.py:digits
"""

from __future__ import annotations

import torch
from torch import nn

from redline.examples.digits import DigitsCNN
from redline.serve.servable import Servable

MLP_WIDTH = 4096
MLP_INPUT = 1024


def digits_model() -> nn.Module:
    torch.manual_seed(0)
    return DigitsCNN(width=32).eval()


def mlp_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(MLP_INPUT, MLP_WIDTH), nn.GELU(), nn.Linear(MLP_WIDTH, MLP_WIDTH), nn.GELU(), nn.Linear(MLP_WIDTH, 10)
    ).eval()


SHAPES = {"digits": (1, 8, 8), "mlp": (MLP_INPUT,)}
MODELS = {"digits": digits_model, "mlp": mlp_model}


def digits() -> Servable:
    return Servable(model=digits_model(), input_shape=SHAPES["digits"], name="digits")


def mlp() -> Servable:
    return Servable(model=mlp_model(), input_shape=SHAPES["mlp"], name="mlp")
