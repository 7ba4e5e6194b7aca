"""Is the memory estimate right? Predicted vs measured peak of a training step, for four models.

The models: an MLP, the digits CNN, chargpt, and GPT-2 from Hugging Face transformers built from its
config (no weights; skipped where transformers is not installed: see peers-requirements.txt). Each
is weighed at two batch sizes in fp32 and bf16-mixed. Asked for by name (`--models lstm,bilstm`), two
LSTM taggers too, whose CPU kernel (oneDNN's) holds a workspace the meta kernels do not show.

The measurement is independent of the estimator's tracker: the step runs for real through redline's
Runtime (the path `redline train` takes), and its peak is read
- on a CPU, from torch.profiler's memory events (every allocation and free the CPU allocator reports,
  summed in order) on top of the tensors alive before the step (weights, gradients, optimizer state,
  the batch);
- on a GPU, from torch.cuda.max_memory_allocated, against the estimate's total (workspace included).
The second step is the one measured, as in the estimate: by then the optimizer holds its state.
``--attention KERNEL`` runs (and weighs) every step with that attention kernel preferred, as `--attention` does
for a run: math keeps the (batch, heads, seq, seq) weights the fused kernels do not.

    python benchmarks/memory_accuracy.py [--device cpu|cuda] [--models mlp,digits,chargpt,gpt2] [--attention auto]
                                         [--write memory]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils.data import TensorDataset

import environment
from redline import Runtime, Task, load_task
from redline.memory.estimate import estimate_memory
from redline.memory.search import real_batch
from redline.plan import Choice
from redline.plan.attention import DEFAULT
from redline.runtime.contract import split_batch

GOAL = 0.10  # within 10% of the measured peak
MIB = 2**20
SECOND_STEP = "memory-accuracy: second step"


def mlp(batch_size: int = 256) -> Task:
    """A 3-layer MLP on random features: the plainest model a formula also gets right."""
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(1024, 512, generator=gen), torch.randint(0, 10, (1024,), generator=gen))
    return Task(
        model=lambda: nn.Sequential(
            nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 2048), nn.GELU(), nn.Linear(2048, 10)
        ),
        loss_fn=nn.functional.cross_entropy,
        train_data=data,
        batch_size=batch_size,
        name="mlp",
    )


def gpt2(large: bool) -> Task | None:
    """GPT-2 from Hugging Face transformers, built from its config with random weights (nothing downloaded)."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return None
    shape = dict(n_layer=12, n_head=12, n_embd=768, n_positions=1024) if large else dict(
        n_layer=4, n_head=4, n_embd=256, n_positions=128
    )  # fmt: skip
    config = GPT2Config(vocab_size=8192, attn_implementation="sdpa", **shape)
    seq = config.n_positions
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (64, seq + 1), generator=gen)

    def loss(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        logits = outputs.logits
        return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    return Task(
        model=lambda: GPT2LMHeadModel(config),
        loss_fn=loss,
        train_data=TensorDataset(tokens[:, :-1], tokens[:, 1:]),
        batch_size=8,
        name="gpt2 (transformers)",
    )


class Tagger(nn.Module):
    """Embeddings of 80 tokens through an LSTM, its last step into a linear head."""

    def __init__(self, width: int, hidden: int, layers: int, bidirectional: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(1000, width)
        self.lstm = nn.LSTM(width, hidden, num_layers=layers, bidirectional=bidirectional, batch_first=True)
        self.head = nn.Linear(hidden * (2 if bidirectional else 1), 1000)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.emb(tokens))
        return self.head(out[:, -1])


def tagger(name: str, width: int, hidden: int, layers: int = 1, bidirectional: bool = False) -> Task:
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randint(0, 1000, (512, 80), generator=gen), torch.randint(0, 1000, (512,), generator=gen)
    )
    return Task(
        model=lambda: Tagger(width, hidden, layers, bidirectional),
        loss_fn=nn.functional.cross_entropy,
        train_data=data,
        batch_size=64,
        name=name,
    )


def models(device: str) -> dict[str, tuple[Task | None, tuple[int, int]]]:
    """Each model with its two batch sizes; on a GPU, chargpt and GPT-2 at GPT-2 small's shape."""
    large = device == "cuda"
    gpt = dict(n_layer=12, n_head=12, n_embd=768, block_size=1024) if large else dict(
        n_layer=4, n_head=4, n_embd=256, block_size=128
    )  # fmt: skip
    return {
        "mlp": (mlp(), (64, 256)),
        "digits": (load_task("example:digits"), (64, 512)),
        "chargpt": (load_task("example:chargpt", **gpt), (8, 16) if large else (16, 32)),
        "gpt2": (gpt2(large), (4, 8) if large else (8, 16)),
        "lstm": (tagger("lstm", 128, 256), (64, 256)),
        "bilstm": (tagger("bilstm (2 layers, both directions)", 64, 128, layers=2, bidirectional=True), (64, 256)),
    }


def measured_peak(task: Task, batch_size: int, precision: str, device: str, attention: str = "auto") -> int:
    """The peak bytes of the second training step, run for real through the Runtime on ``device``."""
    peak = _run_two_steps(task, batch_size, precision, device, attention)
    gc.collect()  # the steps' model and optimizer are gone before the next configuration
    return peak


def _run_two_steps(task: Task, batch_size: int, precision: str, device: str, attention: str) -> int:
    # "auto" is weighed as torch's pick per call: the steps run it too, not the kernel a user loop's check would time
    pick = {"attention": Choice(DEFAULT, "torch's pick per call, as the estimate weighs auto")}
    options = {"devices": device, "precision": precision, "compile": "off", "seed": 0, "attention": attention}
    with Runtime(**options, measured=pick) as rt:
        model, optimizer = rt.setup(task.build_model(), task.optimizer)
        model.train()
        inputs, targets = split_batch(rt.to_device(real_batch(task.train_data, batch_size)[0]), "train_data")

        def step() -> None:
            with rt.autocast():
                loss = task.loss_fn(model(inputs), targets)
            rt.backward(loss)
            del loss
            rt.step(optimizer)

        with _peak(device, [*model.parameters(), *model.buffers(), inputs, targets]) as peak:
            step()
            with record_function(SECOND_STEP):
                step()
    return peak[0]


@contextlib.contextmanager
def _peak(device: str, tensors: list[torch.Tensor]) -> Iterator[list[int]]:
    """Yield a list that holds, after the block, the peak bytes of the block's second step.

    On a CPU both steps run under the profiler, so every gradient and optimizer state is allocated and
    freed inside it (the profiler cannot see the free of a block allocated before it started); what was
    alive before (``tensors``: weights and batch) is added once.
    """
    result = [0]
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()  # the peak since now: the configurations before this one left theirs
        yield result
        torch.cuda.synchronize()
        result[0] = torch.cuda.max_memory_allocated()  # the second step is at least the first's peak
        return
    before = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield result
    events = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())  # type: ignore[union-attr]
    second = min(e.start_ns() for e in events if e.name() == SECOND_STEP)
    current = highest = 0
    for event in events:
        if event.name() == "[memory]":
            current += event.nbytes()
            if event.start_ns() >= second:
                highest = max(highest, current)
    result[0] = before + highest


def compare(task: Task, batch_size: int, precision: str, device: str, attention: str = "auto") -> tuple[int, int]:
    """(predicted, measured) peak bytes for one configuration."""
    estimate = estimate_memory(task, batch_size=batch_size, precision=precision, target=device, attention=attention)
    predicted = estimate.total if device == "cuda" else estimate.peak
    return predicted, measured_peak(task, batch_size, precision, device, attention)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--models", default="mlp,digits,chargpt,gpt2")
    parser.add_argument("--precisions", default="fp32,bf16-mixed")
    parser.add_argument("--attention", default="auto", help="the attention kernel every step prefers")
    parser.add_argument("--write", metavar="NAME", help="also write benchmarks/results/NAME.md")
    args = parser.parse_args(argv)
    wanted = args.models.split(",")
    lines = [
        "| model | batch | precision | attention | predicted MiB | measured MiB | error | within 10% |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    errors: list[float] = []
    skipped: list[str] = []
    for name, (task, sizes) in models(args.device).items():
        if name not in wanted:
            continue
        if task is None:
            skipped.append(f"- {name}: skipped, transformers is not installed in this environment")
            continue
        for precision in args.precisions.split(","):
            for size in sizes:
                predicted, measured = compare(task, size, precision, args.device, args.attention)
                error = predicted / measured - 1
                errors.append(abs(error))
                lines.append(
                    f"| {name} | {size} | {precision} | {args.attention} | {predicted / MIB:,.1f} "
                    f"| {measured / MIB:,.1f} "
                    f"| {error:+.1%} | {'yes' if abs(error) <= GOAL else '**no**'} |"
                )
                print(lines[-1], flush=True)
    met = sum(e <= GOAL for e in errors)
    lines += ["", f"- {met} of {len(errors)} within {GOAL:.0%}; largest error {max(errors, default=0):.1%}.", *skipped]
    environment.publish(args.write, "Memory estimate vs measured peak", lines, device=args.device)


if __name__ == "__main__":
    main()
