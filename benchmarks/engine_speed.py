"""The InferenceEngine's own speed, without HTTP: eager fp32 against CUDA graphs, bf16 (autocast or weights cast
once), channels_last and compile, and auto.

Each setting gets its own engine over the same model (serve_models.py), warmed up on every bucket;
then the engines take turns, round after round in rotated order, each timing a block of ``predict`` calls on the
same batch (outputs come back on the CPU, so each call ends synchronised). The table gives the
median ms per call, samples/s and the ratio to eager fp32 measured in the same rounds, and how far
each setting's outputs are from eager fp32's. Settings that need CUDA are left out on a CPU, and compiles
without CUDA graphs (whether auto is right never to compile on a CPU) run on a CPU only.

    PYTHONPATH=src python3 benchmarks/engine_speed.py --device cuda [--models digits,mlp] [--write engine-cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

import environment
from redline.serve.engine import InferenceEngine
from serve_models import SERVABLES, SHAPES

TITLE = "InferenceEngine: eager fp32 vs CUDA graphs, bf16, channels_last, compile and auto"
# name -> (engine keywords, needs CUDA); "eager fp32" is the reference every ratio is against. Every fixed setting
# gives its layout (the rule alone would lay a CNN out channels_last on a GPU); "+cl" settings run for CNNs only.
FIXED = {"compile": "off", "measure": "off", "channels_last": "off"}
SETTINGS: dict[str, tuple[dict[str, Any], bool]] = {
    "eager fp32": ({**FIXED, "precision": "fp32", "cuda_graphs": "off"}, False),
    "eager fp32+cl": ({**FIXED, "precision": "fp32", "cuda_graphs": "off", "channels_last": "on"}, False),
    "eager bf16": ({**FIXED, "precision": "bf16-mixed", "cuda_graphs": "off"}, False),
    "eager bf16-true": ({**FIXED, "precision": "bf16-true", "cuda_graphs": "off"}, False),
    "eager bf16-true+cl": ({**FIXED, "precision": "bf16-true", "cuda_graphs": "off", "channels_last": "on"}, False),
    "graphs fp32": ({**FIXED, "precision": "fp32", "cuda_graphs": "on"}, True),
    "graphs bf16": ({**FIXED, "precision": "bf16-mixed", "cuda_graphs": "on"}, True),
    "graphs bf16-true": ({**FIXED, "precision": "bf16-true", "cuda_graphs": "on"}, True),
    "graphs bf16-true+cl": ({**FIXED, "precision": "bf16-true", "cuda_graphs": "on", "channels_last": "on"}, True),
    "compile+graphs bf16": ({**FIXED, "precision": "bf16-mixed", "compile": "on", "cuda_graphs": "on"}, True),
    "compiled fp32": ({**FIXED, "precision": "fp32", "compile": "on", "cuda_graphs": "off"}, False),
    "compiled bf16-true": ({**FIXED, "precision": "bf16-true", "compile": "on", "cuda_graphs": "off"}, False),
    "compiled bf16-true+cl": (
        {**FIXED, "precision": "bf16-true", "compile": "on", "cuda_graphs": "off", "channels_last": "on"},
        False,
    ),
    "auto": ({}, False),
}
CONVOLUTIONAL = {"digits", "cnn"}  # the models a "+cl" setting lays out
# Timed on a CPU only, where auto never compiles (a GPU run times compile with CUDA graphs, in its budget).
CPU_ONLY = {"compiled fp32", "compiled bf16-true", "compiled bf16-true+cl"}
PLAN_AXES = ("precision", "channels_last", "compile", "cuda_graphs", "small_batches")  # the last when measured


def build(model: str, device: str, settings: dict[str, Any], max_batch: int) -> tuple[InferenceEngine, float]:
    started = time.perf_counter()
    engine = InferenceEngine(SERVABLES[model](), device=device, max_batch_size=max_batch, **settings)
    engine.warm_up()
    return engine, time.perf_counter() - started


def time_rounds(engines: dict[str, InferenceEngine], batch: torch.Tensor, rounds: int, calls: int) -> dict[str, float]:
    """Median seconds per call of each engine, the engines taking turns in every round.

    The order rotates from round to round (as runtime/trial.py's time_steps does), so a machine whose speed drifts
    weighs on every engine alike, and no engine always follows the same one.
    """
    per_call: dict[str, list[float]] = {name: [] for name in engines}
    names = list(engines)
    for round_ in range(rounds):
        for offset in range(len(names)):
            name = names[(round_ + offset) % len(names)]
            engine = engines[name]
            engine.predict(batch)  # settle: the first call after another engine's block
            started = time.perf_counter()
            for _ in range(calls):
                engine.predict(batch)
            per_call[name].append((time.perf_counter() - started) / calls)
    return {name: statistics.median(times) for name, times in per_call.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--models", default="digits,mlp")
    parser.add_argument("--batch-sizes", default="1,4,32")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--write", metavar="NAME", help="also write benchmarks/results/NAME.md")
    parser.add_argument(
        "--skip", default="", metavar="WORD,...",
        help="leave out the settings whose name holds one of these words: bf16 on an AVX2-only CPU, where each runs "
        "about 30x slower than fp32 and the rounds would take hours",
    )  # fmt: skip
    args = parser.parse_args(argv)
    skipped = [word for word in args.skip.split(",") if word]
    on_cuda = args.device.startswith("cuda")
    sizes = [int(size) for size in args.batch_sizes.split(",")]
    lines = [
        f"Each engine warmed up on every bucket (powers of two up to {max(sizes)}); then {args.rounds} rounds, "
        f"each engine timing {args.calls} `predict` calls per round in turn, the order rotated each round; "
        "median ms per call. Ratios are "
        "to eager fp32 in the same rounds; `max |diff|` is the largest output difference from eager fp32 "
        "on a seeded random batch.",
        "",
        "| model | setting | batch | ms per call | samples/s | vs eager fp32 | max abs diff | build+warm-up s | plan |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    notes: list[str] = []
    models = args.models.split(",")
    for model in models:
        engines, built = {}, {}
        for name, (settings, needs_cuda) in SETTINGS.items():
            if (needs_cuda and not on_cuda) or (name in CPU_ONLY and on_cuda):
                continue
            if ("+cl" in name and model not in CONVOLUTIONAL) or any(word in name for word in skipped):
                continue
            print(f"{model}: building {name} ...", flush=True)
            try:
                engines[name], built[name] = build(model, args.device, settings, max(sizes))
            except Exception as exc:  # one setting failing is a result too; the others run
                lines.append(f"| {model} | {name} | - | failed: {type(exc).__name__}: {str(exc)[:120]} | | | | | |")
        generator = torch.Generator().manual_seed(0)
        for size in sizes:
            batch = torch.randn((size, *SHAPES[model]), generator=generator)
            reference = engines["eager fp32"].predict(batch)
            seconds = time_rounds(engines, batch, args.rounds, args.calls)
            for name, engine in engines.items():
                diff = (engine.predict(batch).float() - reference.float()).abs().max().item()
                plan = ", ".join(f"{axis}={engine.plan[axis].value}" for axis in PLAN_AXES if axis in engine.plan)
                lines.append(
                    f"| {model} | {name} | {size} | {seconds[name] * 1e3:.3f} | {size / seconds[name]:,.0f} "
                    f"| **{seconds['eager fp32'] / seconds[name]:.2f}x** | {diff:.2e} | {built[name]:.1f} | {plan} |"
                )
        auto = engines.get("auto")
        if auto is not None:
            notes += ["", f"{model}, auto's plan:", ""]
            notes += [f"- {axis}: {choice.value} ({choice.reason})" for axis, choice in auto.plan.items()]
        if args.write and model != models[-1]:  # a run cut short by its time limit keeps the models done
            partial = [*lines, *notes, "", f"(written after {model}; the models after it had not run yet)"]
            environment.write(args.write, TITLE, partial, device=args.device)
    environment.publish(args.write, TITLE, lines + notes, device=args.device)


if __name__ == "__main__":
    main()
