"""The models benchmarks/serve.py serves, the same weights in every server: the digits CNN and a larger MLP;
and a VGG-style CNN on 64x64 images, which benchmarks/engine_speed.py times too (--models digits,mlp,cnn).

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


def cnn_model() -> nn.Module:
    """Four conv-BN-ReLU-pool blocks (64-256 channels) and a linear head: 1.4M weights, a small vision model."""
    torch.manual_seed(0)

    def block(given: int, made: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(given, made, 3, padding=1), nn.BatchNorm2d(made), nn.ReLU(), nn.MaxPool2d(2))

    blocks = [block(3, 64), block(64, 128), block(128, 256), block(256, 256)]
    return nn.Sequential(*blocks, nn.Flatten(), nn.Linear(256 * 4 * 4, 100)).eval()


SHAPES = {"digits": (1, 8, 8), "mlp": (MLP_INPUT,), "cnn": (3, 64, 64)}
MODELS = {"digits": digits_model, "mlp": mlp_model, "cnn": cnn_model}


def digits() -> Servable:
    return Servable(model=digits_model(), input_shape=SHAPES["digits"], name="digits")


def mlp() -> Servable:
    return Servable(model=mlp_model(), input_shape=SHAPES["mlp"], name="mlp")


def cnn() -> Servable:
    return Servable(model=cnn_model(), input_shape=SHAPES["cnn"], name="cnn")


SERVABLES = {"digits": digits, "mlp": mlp, "cnn": cnn}
