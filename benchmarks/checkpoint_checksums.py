"""What the per-file SHA-256 of a checkpoint costs: a sharded save and a verified load, with and without it.

    python benchmarks/checkpoint_checksums.py [--params-m 64] [--rounds 5] [--write NAME]

One process writes a sharded (DCP) checkpoint of a model with ``--params-m`` million parameters and
its AdamW moments (12 bytes a parameter on disk), then loads it back, in rounds that alternate the
two ways: with the checksums redline writes and checks, and with the sizes alone (the manifest
redline 0.1 wrote). Each save fsyncs its files either way; a shard is hashed as it is written, the
small files rank 0 adds are read back. A verified load reads every file once more before DCP reads
what it needs. Reported: the median wall time and CPU time of each; the CPU time is the steady
figure on a machine whose disk speed varies from round to round.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystem

import environment
from redline.checkpoint import layout, read_checkpoint, sharded, verify


def make(params_m: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    width = 4096
    rows = max(1, params_m * 1_000_000 // width // 4)
    model = nn.Sequential(*[nn.Linear(width, rows, bias=False) for _ in range(4)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for param in model.parameters():  # a step gives AdamW its two moments per parameter
        param.grad = torch.ones_like(param)
    optimizer.step()
    return model, optimizer


class _NotHashing(FileSystem):
    """DCP's own file system: it records no checksums while writing."""

    def __init__(self) -> None:
        super().__init__()
        self.entries: dict[str, Any] = {}


def sizes_only(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size}


def timed(action: Callable[[], Any]) -> tuple[float, float]:
    """Run ``action``; return its wall time and this process's CPU time, in seconds."""
    wall, cpu = time.perf_counter(), time.process_time()
    action()
    return time.perf_counter() - wall, time.process_time() - cpu


def one_round(final: Path, mode: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """Save and load once, the manifest holding checksums ("sha") or sizes only ("size")."""
    real_entry, real_fs = layout.file_entry, sharded._HashingFileSystem
    if mode == "size":  # no hashing while writing, and sizes alone for every file
        sharded.file_entry, sharded._HashingFileSystem = sizes_only, _NotHashing  # type: ignore[misc]
    try:
        save = timed(lambda: sharded.save_sharded(final, model, optimizer, runtime_state={}, extra={}, plan={}, step=1))
    finally:
        sharded.file_entry, sharded._HashingFileSystem = real_entry, real_fs  # type: ignore[misc]
    checkpoint = read_checkpoint(final)
    load = timed(lambda: (verify(checkpoint), sharded.load_sharded(checkpoint, model, optimizer)))
    figures = {"save wall": save[0], "save cpu": save[1], "load wall": load[0], "load cpu": load[1]}
    if mode == "sha":  # the hashing alone, on the checkpoint's own bytes already in memory
        blobs = [path.read_bytes() for path in final.iterdir() if path.is_file()]
        figures["hash GB/s"] = (
            sum(map(len, blobs)) / 1e9 / timed(lambda: [hashlib.sha256(b).digest() for b in blobs])[0]
        )
    shutil.rmtree(final)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-m", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--write", default=None)
    args = parser.parse_args()
    model, optimizer = make(args.params_m)
    params = sum(p.numel() for p in model.parameters())
    runs: dict[str, list[dict[str, float]]] = {"sha": [], "size": []}
    with tempfile.TemporaryDirectory(dir=".") as scratch:
        for _ in range(args.rounds):
            for mode in runs:
                runs[mode].append(one_round(Path(scratch) / f"step-{mode}", mode, model, optimizer))

    def med(mode: str, key: str) -> float:
        return environment.median([figures[key] for figures in runs[mode]])

    size_gb = params * 12 / 1e9
    rows = [
        f"| {what} | {med('sha', key):.2f} s | {med('size', key):.2f} s | {med('sha', key) - med('size', key):+.2f} s |"
        for what, key in (
            ("save, wall", "save wall"),
            ("save, CPU", "save cpu"),
            ("load (verify, then read), wall", "load wall"),
            ("load (verify, then read), CPU", "load cpu"),
        )
    ]
    rate = med("sha", "hash GB/s")
    body = [
        f"A sharded checkpoint of {params:,} parameters with AdamW state ({size_gb:.2f} GB on disk), one "
        f"process, {args.rounds} alternating rounds; medians.",
        "",
        "| | with SHA-256 per file | sizes only | difference |",
        "| --- | --- | --- | --- |",
        *rows,
        "",
        f"SHA-256 alone on the checkpoint's bytes in memory: {rate:.2f} GB/s on one core, {size_gb / rate:.2f} s for "
        "this checkpoint, once on save (each rank hashes its own shards as they are written, so on N ranks each "
        "takes 1/N of it) and once on load (the ranks share the files out). The wall times go through this VM's "
        "virtual disk, whose speed varies from round to round; the CPU times are the steadier figure.",
    ]
    environment.publish(args.write, "Checkpoint checksums: what they cost", body)


if __name__ == "__main__":
    main()
