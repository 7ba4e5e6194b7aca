"""The attention kernels on a GPU: each one that takes a small GPT's calls trains it as torch's pick does, and the
Trainer's precision trial times them and runs the one it keeps."""

import contextlib

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from redline.examples.gpt import GPT, GPTConfig
from redline.parallel.env import DistEnv
from redline.runtime.attention import attention_calls, kernels_taking, prefer_kernel
from redline.runtime.measure import measure_auto
from redline.runtime.options import RuntimeOptions
from redline.runtime.runtime import Runtime
from redline.task import Task

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def small_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=128, n_layer=2, n_head=4, n_embd=128))


def gpt_task() -> Task:
    tokens = torch.randint(0, 64, (256, 129), generator=torch.Generator().manual_seed(0))

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    return Task(model=small_gpt, loss_fn=loss, train_data=TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=16)


def test_every_kernel_that_takes_the_calls_gives_the_loss_torchs_pick_gives():
    tokens = torch.randint(0, 64, (16, 129), generator=torch.Generator().manual_seed(1)).cuda()
    calls = attention_calls(small_gpt().cuda(), tokens[:2, :-1])
    kernels = kernels_taking(calls, CUDA, torch.bfloat16)
    print("kernels taking the calls in bf16:", kernels)
    assert "flash" in kernels and "math" in kernels  # an H100/H200: flash takes causal bf16 attention

    def losses(kernel: str | None) -> list[float]:
        model = small_gpt().cuda()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        out = []
        for _ in range(5):
            with prefer_kernel(kernel) if kernel else contextlib.nullcontext():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(tokens[:, :-1])
                loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            out.append(float(loss))
        return out

    reference = losses(None)
    for kernel in kernels:
        found = losses(kernel)
        print(kernel, found, "vs", reference)
        assert all(abs(a - b) <= 0.02 * abs(b) for a, b in zip(found, reference, strict=True)), kernel


def test_the_trial_times_the_kernels_on_a_gpu_and_the_run_prefers_the_one_it_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("REDLINE_CACHE_DIR", str(tmp_path))
    found = measure_auto(gpt_task(), RuntimeOptions(devices="cuda"), 16, 5000, DistEnv(), trial="on")
    print(found)
    assert set(found) == {"precision", "attention"}
    assert found["attention"].value in ("default", "flash", "efficient", "cudnn")  # math is not timed on CUDA
    with Runtime(devices="cuda", measured=found) as rt:
        model, optimizer = rt.setup(small_gpt(), lambda params: torch.optim.AdamW(params, lr=1e-3))
        tokens = torch.randint(0, 64, (16, 129), device="cuda")
        with rt.autocast():
            loss = nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
        rt.backward(loss)
        rt.step(optimizer)
        assert rt.explain().attention.value == found["attention"].value and torch.isfinite(loss)
