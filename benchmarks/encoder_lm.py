"""A task whose model is built from torch's own layers: a character language model on ``nn.TransformerEncoder`` (a
causal mask), trained on ``example:chargpt``'s data. Its attention runs inside ``nn.MultiheadAttention``, as in the
many models written with ``nn.Transformer*`` layers rather than a call of their own to the attention function.

    python benchmarks/attention_speed.py --tasks "benchmarks/encoder_lm.py:encoder_lm"
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import nn

from redline.examples.chargpt import chargpt
from redline.task import Task


class EncoderLM(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, n_embd)
        self.position = nn.Parameter(torch.zeros(block_size, n_embd))
        layer = nn.TransformerEncoderLayer(
            n_embd, n_head, 4 * n_embd, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.layers = nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)
        self.head = nn.Linear(n_embd, vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        length = ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=ids.device)
        x = self.embed(ids) + self.position[:length]
        return self.head(self.layers(x, mask=mask, is_causal=True))


def encoder_lm(
    *, n_layer: int = 4, n_head: int = 4, n_embd: int = 256, block_size: int = 128, batch_size: int = 32
) -> Task:
    base = chargpt(block_size=block_size, batch_size=batch_size)
    vocab = base.sample.vocab.size  # type: ignore[union-attr]
    model = functools.partial(EncoderLM, vocab, block_size, n_layer, n_head, n_embd)
    return dataclasses.replace(base, model=model, sample=None, name="encoder-lm")
