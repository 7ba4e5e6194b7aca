"""FLOPs of a training step counted on the meta device, against the analytic count; matmul peak; MFU."""

import itertools

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from redline.errors import ConfigError
from redline.examples.gpt import GPT, GPTConfig
from redline.hardware.flops import count_train_flops, matmul_precision, measure_matmul_tflops, mfu, share_of_peak


def mse(outputs, targets):
    return F.mse_loss(outputs, targets)


def token_loss(logits, targets):
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def linear_stack(widths):
    layers = []
    for fan_in, fan_out in itertools.pairwise(widths):
        layers += [nn.Linear(fan_in, fan_out, bias=False), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


@pytest.mark.parametrize("widths", [[32, 64, 48, 16], [100, 10], [8, 256, 256, 256, 4]])
def test_linear_stack_counts_exactly(widths):
    """Bias-free Linear layers d0 -> d1 -> ... on a batch of B rows.

    Forward: 2*B*d_i*d_(i+1) per layer (one multiply-add per weight per row). Backward: the weight
    gradient costs the same again for every layer; the input gradient too, except for the first layer,
    whose input (the data) needs no gradient. So the step is 3 * sum(2*B*d_i*d_(i+1)) - 2*B*d0*d1.
    ReLU and the MSE loss are elementwise and count zero. Counted and analytic agree exactly.
    """
    batch = 8
    per_layer = [2 * batch * a * b for a, b in itertools.pairwise(widths)]
    analytic = 3 * sum(per_layer) - per_layer[0]
    data = (torch.randn(batch, widths[0]), torch.randn(batch, widths[-1]))
    assert count_train_flops(linear_stack(widths), mse, data) == analytic


GPT_SHAPES = [
    # (config, batch, steps): steps shorter than block_size checks that T is the sequence length
    (GPTConfig(vocab_size=65, block_size=64, n_layer=2, n_head=4, n_embd=128), 4, 64),
    (GPTConfig(vocab_size=500, block_size=128, n_layer=3, n_head=6, n_embd=192, dropout=0.1), 2, 96),
]


def gpt_analytic_flops(config, batch, steps):
    """Kaplan et al. 2020 (https://arxiv.org/abs/2001.08361) as PaLM appendix B writes it.

    FLOPs per token = 6*N + 12*n_layer*n_embd*T, where the 6 is 2 forward + 4 backward per weight
    and the second term is attention's QK^T and AV matmuls (forward 4*T*n_embd per token and layer,
    backward twice that). N counts the weights that take part in matmuls: per block c_attn (3C^2),
    attn c_proj (C^2), mlp c_fc (4C^2), mlp c_proj (4C^2), i.e. 12*C^2, plus the lm_head (V*C), a
    matmul even though its weight is tied to the token embedding. Embedding lookups, biases and
    LayerNorm gains (13*C per block + 2*C) are gathers and elementwise work; they are left out, as
    FlopCounterMode leaves them out (with them N grows by under 1%).
    """
    c, layers, tokens = config.n_embd, config.n_layer, batch * steps
    n_matmul = 12 * layers * c * c + config.vocab_size * c
    return 6 * n_matmul * tokens + 12 * layers * c * steps * tokens


@pytest.mark.parametrize(("config", "batch", "steps"), GPT_SHAPES)
def test_gpt_matches_the_6n_plus_attention_estimate(config, batch, steps):
    """Counted vs analytic: 667,090,944 both for the first shape, 1,766,817,792 both for the second.

    scaled_dot_product_attention on meta tensors takes the math path (two bmm per direction), which
    FlopCounterMode counts; it counts the full T x T scores although the mask is causal, as the
    analytic attention term does.
    """
    torch.manual_seed(0)
    model = GPT(config)
    data = (torch.randint(0, config.vocab_size, (batch, steps)), torch.randint(0, config.vocab_size, (batch, steps)))
    counted = count_train_flops(model, token_loss, data)
    analytic = gpt_analytic_flops(config, batch, steps)
    assert counted is not None
    assert abs(counted - analytic) <= 0.05 * analytic, (counted, analytic)
    assert counted == analytic  # and in fact exactly, since both count the same matmuls


def snapshot(model):
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def test_the_real_model_is_untouched():
    """Weights, buffers, gradients, train/eval modes and the global RNG are as they were."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Dropout(0.5), nn.Linear(32, 4))
    model.train()
    model[2].eval()  # a mixed-mode model keeps its mix
    model[0].weight.grad = torch.full_like(model[0].weight, 3.0)  # a gradient from an earlier step stays
    data = (torch.randn(8, 16), torch.randn(8, 4))
    before, modes, rng = snapshot(model), [m.training for m in model.modules()], torch.get_rng_state()

    assert count_train_flops(model, mse, data) is not None

    after = snapshot(model)
    assert all(torch.equal(before[k], after[k]) for k in before)  # incl. BatchNorm's running stats
    assert model[1].num_batches_tracked.item() == 0
    assert torch.equal(model[0].weight.grad, torch.full_like(model[0].weight, 3.0))
    assert all(p.grad is None for name, p in model.named_parameters() if name != "0.weight")
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert [m.training for m in model.modules()] == modes
    assert torch.equal(torch.get_rng_state(), rng)


class StochasticDepth(nn.Module):
    """Skips its layer at random, drawing from the CPU generator the way many models do."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)

    def forward(self, x):
        if self.training and torch.rand(()).item() < 0.5:
            return x
        return self.layer(x)


def test_a_model_that_draws_random_numbers_leaves_the_rng_where_it_was():
    model, data = StochasticDepth(), (torch.randn(4, 8), torch.randn(4, 8))
    rng = torch.get_rng_state()
    assert count_train_flops(model, mse, data) is not None
    assert torch.equal(torch.get_rng_state(), rng)


class CachingModel(nn.Module):
    """Builds a cache on its first forward, as rotary-embedding and mask caches do."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.scale = None

    def forward(self, x):
        if self.scale is None:
            self.scale = torch.ones(8, device=x.device)
        return self.proj(x) * self.scale


def test_what_the_count_caches_stays_on_its_copy():
    model = CachingModel()
    assert count_train_flops(model, mse, (torch.randn(4, 8), torch.randn(4, 8))) == 3 * 2 * 4 * 8 * 8 - 2 * 4 * 8 * 8
    assert model.scale is None
    model(torch.randn(4, 8)).sum().backward()  # the real model still runs on real tensors


def test_a_compiled_forward_is_counted_eagerly_without_recompiling():
    from torch._dynamo.utils import counters

    model = linear_stack([16, 32, 8])
    eager = count_train_flops(model, mse, (torch.randn(4, 16), torch.randn(4, 8)))
    model.forward = torch.compile(model.forward, backend="eager")  # what redline's compile_module does
    model(torch.randn(4, 16))
    graphs = counters["stats"]["unique_graphs"]
    assert count_train_flops(model, mse, (torch.randn(4, 16), torch.randn(4, 8))) == eager
    assert counters["stats"]["unique_graphs"] == graphs
    assert (
        count_train_flops(
            torch.compile(linear_stack([16, 32, 8]), backend="eager"), mse, (torch.randn(4, 16), torch.randn(4, 8))
        )
        == eager
    )


def test_wrappers_and_nested_batches():
    model = linear_stack([16, 32, 8])
    data = (torch.randn(4, 16), torch.randn(4, 8))
    expected = count_train_flops(model, mse, data)
    assert count_train_flops(nn.DataParallel(model), mse, data) == expected

    class DictInput(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, batch):
            return self.inner(batch["features"][0])

    assert count_train_flops(DictInput(), mse, ({"features": [data[0]], "id": "x"}, data[1])) == expected
    weighted = nn.CrossEntropyLoss(weight=torch.ones(8))  # a loss module with its own buffer
    assert count_train_flops(model, weighted, (data[0], torch.randint(0, 8, (4,)))) == expected


class PlainMask(nn.Module):
    """Keeps its mask as a plain attribute, not a buffer: the count's meta copy must not mix it with meta tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8, bias=False)
        self.mask = torch.tril(torch.ones(8, 8))

    def forward(self, x):
        return self.proj(x) * self.mask[0]


def test_a_model_keeping_a_plain_tensor_attribute_is_counted():
    model = PlainMask()
    counted = count_train_flops(model, mse, (torch.randn(4, 8), torch.randn(4, 8)))
    assert counted == count_train_flops(model.proj, mse, (torch.randn(4, 8), torch.randn(4, 8))) == 2 * 2 * 4 * 8 * 8
    assert model.mask.device.type == "cpu" and model.mask.sum() == 36  # the real model's mask is left as it was


class Widened(nn.Module):
    """Takes a constructor argument with a default and draws its weights from the global RNG, as user models do."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, width, 3)
        self.head = nn.Linear(width * 6 * 6, 10)

    def forward(self, x):
        return self.head(self.conv(x).flatten(1))


@pytest.mark.usefixtures("one_rank_group")
def test_an_fsdp_model_counts_as_the_plain_model_and_leaves_the_rng_where_it_was():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from redline.parallel.fsdp import shard

    data = (torch.randn(2, 1, 8, 8), torch.randint(0, 10, (2,)))
    plain = count_train_flops(Widened(width=4), F.cross_entropy, data)
    sharded = shard(Widened(width=4), precision="fp32")
    rng = torch.get_rng_state()
    assert plain is not None and count_train_flops(sharded, F.cross_entropy, data) == plain
    assert torch.equal(torch.get_rng_state(), rng)  # the user's __init__ did not run again
    # A shard of a weight split over two ranks counts as the whole weight: (3, 4) held here, (6, 4) in all.
    layer, mesh = nn.Linear(4, 6, bias=False), init_device_mesh("cpu", (1,))
    half = DTensor.from_local(torch.zeros(3, 4), mesh, [Shard(0)], run_check=False, shape=torch.Size([6, 4]),
                              stride=(4, 1))  # fmt: skip
    layer.weight = nn.Parameter(half)
    assert count_train_flops(layer, mse, (torch.randn(2, 4), torch.randn(2, 6))) == 3 * 2 * 2 * 4 * 6 - 2 * 2 * 4 * 6


def test_a_frozen_model_counts_its_forward_only():
    model = linear_stack([16, 32])
    model.requires_grad_(False)
    assert count_train_flops(model, mse, (torch.randn(4, 16), torch.randn(4, 32))) == 2 * 4 * 16 * 32


class Broken(nn.Module):
    def forward(self, x):
        raise RuntimeError("boom")


class DataDependent(nn.Module):
    """Reads a value out of a tensor, which a meta tensor does not have."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x) * float(x.sum())


@pytest.mark.parametrize(
    ("model", "loss_fn", "batch"),
    [
        (Broken(), mse, (torch.randn(2, 4), torch.randn(2, 4))),
        (DataDependent(), mse, (torch.randn(2, 4), torch.randn(2, 4))),
        (nn.Linear(4, 4), lambda out, _: out, (torch.randn(2, 4), None)),  # a loss that is not a scalar
        (nn.Linear(4, 4), mse, torch.randn(2, 4)),  # not an (inputs, targets) pair
    ],
)
def test_a_model_that_cannot_be_counted_gives_none(model, loss_fn, batch):
    assert count_train_flops(model, loss_fn, batch) is None


def test_matmul_peak_on_cpu_is_positive_and_leaves_the_rng_alone():
    rng = torch.get_rng_state()
    tflops = measure_matmul_tflops(torch.device("cpu"), torch.float32)
    assert 0 < tflops < 100  # a CPU, not a datacenter GPU
    assert torch.equal(torch.get_rng_state(), rng)
    assert measure_matmul_tflops(torch.device("cpu"), torch.float32, size=64, repeats=2) > 0


def test_matmul_peak_is_the_fastest_block_so_one_stall_does_not_sink_it():
    times = iter([0.0, 1.0, 1.0, 1.001, 2.0, 2.002])  # a stalled block of 1 s, then blocks of 1 ms and 2 ms
    tflops = measure_matmul_tflops(
        torch.device("cpu"), torch.float32, size=8, repeats=6, blocks=3, clock=lambda: next(times)
    )
    assert tflops == pytest.approx(2 * 8**3 * 2 / 1e-3 / 1e12)  # two matmuls in the fastest block's 1 ms


@pytest.mark.parametrize(("size", "repeats"), [(0, 1), (64, 0), (True, 1)])
def test_matmul_peak_rejects_bad_sizes(size, repeats):
    with pytest.raises(ConfigError):
        measure_matmul_tflops(torch.device("cpu"), torch.float32, size=size, repeats=repeats)


def test_a_share_of_a_peak_the_run_outpaced_is_none_not_above_100_percent():
    assert share_of_peak(5e12, 10.0) == 0.5
    assert share_of_peak(11e12, 10.0) is None  # no model beats a plain matmul: the peak was stalled
    assert share_of_peak(5e12, None) is None and share_of_peak(5e12, 0.0) is None


def test_a_frozen_bf16_base_with_fp32_adapters_runs_at_the_bf16_peak():
    # Most of the matmuls run through the frozen base's bfloat16 weights: the fp32 peak of the adapters, which
    # train, held such a run to half of its true share on an H100.
    base, adapter = nn.Linear(64, 64).to(torch.bfloat16), nn.Linear(64, 4)
    base.requires_grad_(False)
    model = nn.Sequential(base, adapter)
    assert matmul_precision("fp32", model) == "bf16-mixed"
    mostly_bf16 = nn.Sequential(nn.Linear(4, 4), nn.Linear(64, 64).to(torch.bfloat16))
    assert matmul_precision("fp32", mostly_bf16) == "bf16-mixed"
    assert matmul_precision("fp32", nn.Linear(64, 64).double()) is None  # no float64 peak in any datasheet
    assert matmul_precision("fp16-mixed", model) == "fp16-mixed"  # autocast decides the matmuls' dtype
    assert matmul_precision("fp32", nn.ReLU()) == "fp32"


def test_mfu():
    assert mfu(494.7e12, 989.4) == pytest.approx(0.5)
    assert mfu(1e12, None) is None
