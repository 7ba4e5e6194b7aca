"""A step traced for CUDA keeps what CUDA's kernels keep: fused attention, fused dropout, CUDA autocast's fp32 ops,
and one cuBLAS workspace per thread that multiplies matrices. Every expected figure is computed from the shapes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from redline.errors import ConfigError
from redline.memory.attention import cuda_kernel
from redline.memory.estimate import estimate_memory
from redline.memory.workspace import CUBLAS_WORKSPACE, CUBLASLT_WORKSPACE
from redline.task import Task

B, S, C, H = 2, 512, 32, 4  # batch, sequence, channels, heads: one (B, H, S, S) fp32 matrix is 8 MiB
MATRIX = B * H * S * S * 4
SEED_AND_OFFSET = 2 * 8  # the dropout RNG's state a fused kernel keeps: two int64 scalars


class Attention(nn.Module):
    """transformers' GPT-2 calls scaled_dot_product_attention so in training: is_causal, no mask, dropout 0.1
    (a CPU runs that on its math path); ``mask`` passes an explicit boolean mask instead."""

    def __init__(self, mask: torch.Tensor | None = None, dropout: float = 0.1) -> None:
        super().__init__()
        self.qkv = nn.Linear(C, 3 * C)
        self.mask, self.dropout = mask, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.view(B, S, H, C // H).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        dropout = self.dropout if self.training else 0.0
        if self.mask is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, dropout_p=dropout)
        return y.transpose(1, 2).reshape(B, S, C)


class WithHead(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body
        self.head = nn.Linear(C, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)).flatten(0, 1)


def task(body: nn.Module, shape: tuple[int, ...] = (S, C)) -> Task:
    data = TensorDataset(torch.randn(8, *shape), torch.randint(0, 10, (8, math.prod(shape[:-1]))))
    return Task(
        model=WithHead(body),
        loss_fn=lambda logits, y: F.cross_entropy(logits, y.flatten()),
        train_data=data,
        batch_size=B,
        name="cuda-ops",
    )


def retained(body: nn.Module, precision: str = "fp32", target: str = "cuda", shape: tuple[int, ...] = (S, C)) -> int:
    """The bytes ``body``'s forward left alive (saved for backward, and its output) in a step traced for ``target``."""
    estimate = estimate_memory(task(body, shape), batch_size=B, precision=precision, target=target)
    return dict(estimate.top_modules)["body"]


def test_attention_with_dropout_keeps_no_seq_by_seq_matrix_on_cuda() -> None:
    """fp32 takes the memory-efficient kernel: it keeps its output, a log-sum-exp of (B, H, S rounded up to 32)
    in fp32 and the RNG state; the body keeps its q/k/v projection besides."""
    projection, output = B * S * 3 * C * 4, B * S * C * 4
    lse = B * H * math.ceil(S / 32) * 32 * 4
    assert retained(Attention()) == projection + output + lse + SEED_AND_OFFSET
    assert retained(Attention(), target="cpu") > 2 * MATRIX  # the CPU's math path, for contrast


def test_attention_with_an_explicit_mask_keeps_only_the_mask_made_additive() -> None:
    """A boolean mask sends CUDA to the memory-efficient kernel too; torch makes it additive in the query's dtype (one
    (S, S) copy, kept for backward), never a (B, H, S, S) matrix."""
    mask = torch.ones(S, S, dtype=torch.bool).tril()
    projection, output = B * S * 3 * C * 4, B * S * C * 4
    lse = B * H * math.ceil(S / 32) * 32 * 4
    assert retained(Attention(mask)) == projection + output + lse + SEED_AND_OFFSET + S * S * 4


def test_attention_under_bf16_keeps_no_seq_by_seq_matrix_on_cuda() -> None:
    """bf16 takes flash attention: a bf16 output and a (B, H, S) fp32 log-sum-exp; the projection and autocast's
    copies of the input and the weight in bf16."""
    projection, output, lse = B * S * 3 * C * 2, B * S * C * 2, B * H * S * 4
    casts = B * S * C * 2 + 3 * C * C * 2 + 3 * C * 2
    kept = retained(Attention(), precision="bf16-mixed")
    assert projection + output + lse <= kept <= projection + output + lse + casts + SEED_AND_OFFSET + 64
    assert retained(Attention(), precision="bf16-mixed", target="cpu") > MATRIX // 2  # a bf16 matrix at least


class TorchAttention(nn.Module):
    """torch's own layer, as every nn.TransformerEncoderLayer holds it (dropout 0.1, no weights asked for): its
    call to the attention function is made inside multi_head_attention_forward."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(C, H, dropout=0.1, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention(x, x, x, need_weights=False, is_causal=True, attn_mask=_causal())[0]


def _causal() -> torch.Tensor:
    return nn.Transformer.generate_square_subsequent_mask(S)


def test_the_attention_inside_torchs_multihead_layer_keeps_no_seq_by_seq_matrix_on_cuda() -> None:
    """As above, through nn.MultiheadAttention: the memory-efficient kernel's output and log-sum-exp; the layer keeps
    its input projection's three outputs and the attention's output, reshaped, for its output projection."""
    lse = B * H * math.ceil(S / 32) * 32 * 4
    kept = retained(TorchAttention())
    assert kept < MATRIX // 4  # not one (B, H, S, S) matrix, of the several the CPU's math path keeps
    assert kept >= B * S * 3 * C * 4 + lse
    assert retained(TorchAttention(), target="cpu") > 2 * MATRIX  # the CPU's math path, for contrast
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention  # F's name given back


@pytest.mark.parametrize(
    ("shapes", "kwargs", "kernel"),
    [
        ((torch.bfloat16, 64, 64), {"is_causal": True}, "flash"),
        ((torch.float32, 64, 64), {"is_causal": True}, "efficient"),  # flash needs fp16 or bf16
        ((torch.bfloat16, 64, 64), {"mask": True}, "efficient"),  # flash takes no mask
        ((torch.bfloat16, 512, 512), {}, "efficient"),  # flash's head dimension stops at 256
        ((torch.float32, 62, 62), {}, None),  # the efficient kernel needs a multiple of 4 in fp32: math
        ((torch.bfloat16, 64, 64), {"kv_heads": 2, "enable_gqa": True}, "flash"),  # flash groups heads
        ((torch.float32, 64, 64), {"kv_heads": 2, "enable_gqa": True}, None),  # the efficient kernel does not
        ((torch.float64, 64, 64), {}, None),
        ((torch.bfloat16, 64, 64), {"preferred": "cudnn", "dropout_p": 0.125}, "cudnn"),
        ((torch.bfloat16, 64, 64), {"preferred": "cudnn", "dropout_p": 0.1}, None),  # sixteenths only
        ((torch.bfloat16, 256, 256), {"preferred": "cudnn"}, None),  # flash takes 256
        ((torch.bfloat16, 60, 60), {"preferred": "cudnn"}, None),  # a multiple of 8 (flash pads it)
        ((torch.bfloat16, 64, 64), {"preferred": "cudnn", "mask": True}, None),
        ((torch.bfloat16, 64, 64), {"preferred": "flash", "mask": True}, None),  # auto's efficient is not asked for
        ((torch.float32, 64, 64), {"preferred": "efficient"}, "efficient"),
        ((torch.bfloat16, 64, 64), {"preferred": "math"}, None),
    ],
)
def test_the_kernel_is_the_one_cuda_chooses(shapes, kwargs, kernel) -> None:
    dtype, head_dim, value_dim = shapes
    kv_heads = kwargs.get("kv_heads", H)
    query = torch.empty(B, H, 16, head_dim, dtype=dtype, device="meta")
    key = torch.empty(B, kv_heads, 16, head_dim, dtype=dtype, device="meta")
    value = torch.empty(B, kv_heads, 16, value_dim, dtype=dtype, device="meta")
    mask = torch.empty(16, 16, dtype=torch.bool, device="meta") if kwargs.get("mask") else None
    chosen = cuda_kernel(
        query, key, value, mask, is_causal=kwargs.get("is_causal", False), enable_gqa=kwargs.get("enable_gqa", False),
        dropout_p=kwargs.get("dropout_p", 0.0), preferred=kwargs.get("preferred", "auto"),
    )  # fmt: skip
    assert chosen == kernel


D = 4096  # features of the dropout and autocast examples: an (B, D) fp32 tensor is 32 KiB


class Dropped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(D))  # gives dropout an input that needs a gradient
        self.drop = nn.Dropout(0.1)
        self.out = nn.Linear(D, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(x * self.scale)).unsqueeze(1)


def test_dropout_keeps_a_one_byte_mask_on_cuda_where_a_cpu_keeps_noise() -> None:
    """CUDA's fused dropout keeps a bool mask beside its output; a CPU keeps noise of the input's dtype."""
    assert retained_by("body.drop", Dropped(), "fp32", "cuda") == B * D * 4 + B * D
    assert retained_by("body.drop", Dropped(), "fp32", "cpu") == B * D * 4 * 2


class Op(nn.Module):
    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        assert h.dtype == torch.bfloat16  # a linear layer's output under autocast
        return h**2 if self.op == "pow" else torch.softmax(h, dim=-1)


class Elementwise(nn.Module):
    def __init__(self, op: str) -> None:
        super().__init__()
        self.linear = nn.Linear(D, D)
        self.op = Op(op)
        self.head = nn.Linear(D, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.op(self.linear(x))).unsqueeze(1)


@pytest.mark.parametrize(("op", "on_cuda", "on_cpu"), [("pow", 4 + 4, 2), ("softmax", 4, 2)])
def test_ops_cuda_autocast_runs_in_fp32_keep_fp32_tensors(op, on_cuda, on_cpu) -> None:
    """CUDA's autocast runs pow in fp32 (its input cast to fp32 and kept for backward, and a fp32 output) and softmax
    with dtype=float32 (a fp32 output, kept for backward); the CPU's runs both in bf16. Bytes per element."""
    assert retained_by("body.op", Elementwise(op), "bf16-mixed", "cuda") == on_cuda * B * D
    assert retained_by("body.op", Elementwise(op), "bf16-mixed", "cpu") == on_cpu * B * D


def retained_by(module: str, body: nn.Module, precision: str, target: str) -> int:
    estimate = estimate_memory(task(body, (D,)), batch_size=B, precision=precision, target=target)
    return dict(estimate.top_modules)[module]


class Frozen(nn.Module):
    """A frozen linear layer and a trainable scale: the backward multiplies no matrix."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(C, 10).requires_grad_(False)
        self.scale = nn.Parameter(torch.ones(10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


class ConvOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(S, 10, kernel_size=3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).transpose(1, 2)


def linear_task(model: nn.Module) -> Task:
    data = TensorDataset(torch.randn(8, C), torch.randint(0, 10, (8,)))
    return Task(model=model, loss_fn=F.cross_entropy, train_data=data, batch_size=B, name="workspace")


@pytest.mark.parametrize(
    ("model", "workspace"),
    [
        # a forward through cuBLASLt (a bias), a backward through cuBLAS: two threads, two workspaces, one of cuBLASLt
        (lambda: nn.Sequential(nn.Linear(C, 64), nn.Linear(64, 10)), 2 * CUBLAS_WORKSPACE + CUBLASLT_WORKSPACE),
        (lambda: nn.Sequential(nn.Linear(C, 64, bias=False), nn.Linear(64, 10, bias=False)), 2 * CUBLAS_WORKSPACE),
        (Frozen, CUBLAS_WORKSPACE + CUBLASLT_WORKSPACE),  # the forward's thread only
    ],
)
def test_a_cuda_step_holds_one_cublas_workspace_per_thread_that_multiplies(model, workspace) -> None:
    estimate = estimate_memory(linear_task(model()), batch_size=B, target="cuda")
    assert estimate.workspace == workspace
    assert estimate.total == estimate.peak + workspace
    assert estimate_memory(linear_task(model()), batch_size=B, target="cpu").workspace == 0


def test_convolutions_alone_hold_no_workspace_beside_the_step() -> None:
    """cuDNN allocates a convolution's workspace for the length of the call, sized on the device: not counted."""
    data = TensorDataset(torch.randn(8, S, C), torch.randint(0, 10, (8, C)))
    conv = Task(
        model=ConvOnly,
        loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()),
        train_data=data,
        batch_size=B,
        name="conv",
    )
    assert estimate_memory(conv, batch_size=B, target="cuda").workspace == 0


def test_a_kernel_preferred_is_traced_where_it_takes_the_call_and_math_elsewhere() -> None:
    """`--attention KERNEL` runs the kernel on every call it takes and math on the rest: math keeps a (B, H, S, S)
    matrix where torch's own pick kept none; flash takes no mask, so a masked call runs math where auto took the
    memory-efficient kernel; cuDNN keeps what flash keeps, where it takes the call."""
    mask = torch.ones(S, S, dtype=torch.bool).tril()

    def kept(body: nn.Module, precision: str, attention: str) -> int:
        estimate = estimate_memory(task(body), batch_size=B, precision=precision, attention=attention)
        assert estimate.attention == attention
        return dict(estimate.top_modules)["body"]

    auto = kept(Attention(), "bf16-mixed", "auto")
    assert kept(Attention(), "bf16-mixed", "flash") == auto < MATRIX // 4
    assert kept(Attention(), "bf16-mixed", "math") > auto + MATRIX  # fp32 weights: the math path multiplies in fp32
    assert kept(Attention(dropout=0.0), "bf16-mixed", "cudnn") == kept(Attention(dropout=0.0), "bf16-mixed", "flash")
    assert kept(Attention(), "bf16-mixed", "cudnn") > MATRIX  # cuDNN refuses a dropout of 0.1: math runs
    assert kept(Attention(mask), "fp32", "efficient") == kept(Attention(mask), "fp32", "auto") < MATRIX // 4
    assert kept(Attention(mask), "fp32", "flash") > 2 * MATRIX


def test_a_cpu_step_is_traced_on_the_kernel_preferred_and_torchs_flags_come_back() -> None:
    cuda = torch.backends.cuda
    before = (cuda.flash_sdp_enabled(), cuda.math_sdp_enabled())

    def kept(attention: str) -> int:  # no dropout: the CPU's flash kernel takes the call
        estimate = estimate_memory(task(Attention(dropout=0.0)), batch_size=B, target="cpu", attention=attention)
        return dict(estimate.top_modules)["body"]

    assert kept("auto") == kept("flash") < MATRIX // 4
    assert kept("math") > MATRIX
    assert (cuda.flash_sdp_enabled(), cuda.math_sdp_enabled()) == before
    with pytest.raises(ConfigError, match="on a CPU use attention='flash' or attention='math'"):
        estimate_memory(task(Attention()), batch_size=B, target="cpu", attention="cudnn")
    with pytest.raises(ConfigError, match="did you mean attention='flash'"):
        estimate_memory(task(Attention()), batch_size=B, attention="flsh")
