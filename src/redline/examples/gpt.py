"""A small GPT in the style of nanoGPT: the model behind ``example:chargpt``.

Pre-LayerNorm transformer blocks, causal self-attention through
``torch.nn.functional.scaled_dot_product_attention``, a 4x GELU MLP and an lm head tied to the token
embedding. Initialisation follows GPT-2 as nanoGPT does it: https://github.com/karpathy/nanoGPT
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from redline.config import positive_int
from redline.errors import invalid


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """The shape of a GPT. GPT-2 small is n_layer=12, n_head=12, n_embd=768, block_size=1024."""

    vocab_size: int
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            positive_int(name, getattr(self, name))  # n_layer=True is a typo, not a request for one layer
        if self.n_embd % self.n_head:
            raise invalid(
                "n_embd",
                self.n_embd,
                f"a multiple of n_head={self.n_head}, so every head gets n_embd // n_head channels",
                "GPT-2 small uses n_embd=768 with n_head=12 (64 channels a head)",
            )
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise invalid("dropout", self.dropout, "a float in [0, 1)")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which each position sees only itself and earlier positions."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, steps, channels = x.shape
        q, k, v = self.c_attn(x).split(channels, dim=2)
        # (B, T, C) -> (B, n_head, T, head_size), the layout scaled_dot_product_attention expects.
        head_size = channels // self.n_head
        q, k, v = (t.view(batch, steps, self.n_head, head_size).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(batch, steps, channels)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """The feed-forward half of a block: widen 4x, GELU, project back."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One transformer block; LayerNorm comes before each sub-layer (pre-LN, as in GPT-2)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Map token ids (B, T) to next-token logits (B, T, vocab_size)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying (Press & Wolf 2017, https://arxiv.org/abs/1608.05859): one matrix reads tokens
        # in and scores them out, as in GPT-2; it saves vocab_size * n_embd parameters.
        self.lm_head.weight = self.wte.weight
        self.apply(_init_weights)
        # GPT-2 scales the init of each residual projection by 1/sqrt(2 * n_layer), so the residual
        # stream's variance does not grow with depth (two residual adds per block).
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        steps = idx.shape[1]
        if steps > self.config.block_size:
            raise invalid(
                "sequence length",
                steps,
                f"at most block_size={self.config.block_size}",
                "crop the context to its last block_size tokens",
            )
        positions = torch.arange(steps, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.lm_head(self.ln_f(x))
        return logits


def _init_weights(module: nn.Module) -> None:
    # GPT-2's init: N(0, 0.02) for linear and embedding weights, zero biases; LayerNorm keeps 1 and 0.
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
