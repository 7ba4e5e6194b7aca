"""Are the losses of memory_fit.py's recovery run what the same steps give without running out of memory?

memory_fit.py's recovery on an H200 (benchmarks/results/memory-fit-cuda-h200.md) trained one repeated batch of
GPT-2-small-shaped chargpt three times and logged losses 4.57, 4.63, 6.82: the third well above the first. This
runs the same three AdamW steps (lr 1e-3, the example's default) on a CPU at a shorter context, as one whole batch
and as micro-batches of 2 (what the recovery falls back to), with no out-of-memory at all. Where both rise at the
third step alike, the rise is the optimizer's on this model and rate, not the recovery's.

python benchmarks/recovery_losses.py
"""

from __future__ import annotations

import time

import torch

from redline.examples.chargpt import chargpt
from redline.memory.search import real_batch
from redline.runtime.options import RuntimeOptions
from redline.runtime.runtime import Runtime


def main() -> None:
    task = chargpt(n_layer=12, n_head=12, n_embd=768, block_size=128, batch_size=8)
    batch, _ = real_batch(task.train_data, 8)
    for micro in (None, 2):
        torch.manual_seed(0)
        began = time.perf_counter()
        with Runtime(RuntimeOptions(devices="cpu", precision="fp32", compile="off", micro_batch=micro)) as rt:
            model, optimizer = rt.setup(task.build_model(), task.optimizer)

            def loss_of(part: tuple[torch.Tensor, torch.Tensor], model: torch.nn.Module = model) -> torch.Tensor:
                return task.loss_fn(model(part[0]), part[1])

            losses = []
            for _ in range(3):
                losses.append(float(rt.train_step(loss_of, batch)))
                rt.step(optimizer)
        shown = ", ".join(f"{loss:.4f}" for loss in losses)
        print(f"micro_batch={micro}: losses {shown} ({time.perf_counter() - began:.0f} s)")


if __name__ == "__main__":
    main()
