"""What the HTML report tests share: a bench result as the bench command returns it, and reading a page back."""

from __future__ import annotations

import base64
import copy
import io
import json
from html.parser import HTMLParser
from typing import Any

from redline.train.logs import open_loggers

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _row(name: str, kind: str, samples_per_s: float | None, **extra: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "name": name,
        "kind": kind,
        "device": "cpu",
        "precision": "fp32",
        "compile": False,
        "channels_last": False,
        "batch_size": 64,
        "samples_per_s": samples_per_s,
        "tokens_per_s": None,
        "step_ms_p50": 64_000 / samples_per_s if samples_per_s else None,
        "step_ms_p90": 70_000 / samples_per_s if samples_per_s else None,
        "peak_mem_bytes": 200_000_000 if samples_per_s else None,
        "tflops": 0.12 if samples_per_s else None,
        "mfu": None,
        "mfu_measured": None,
        "compile_s": None,
        "break_even_steps": None,
        "speedup_naive": samples_per_s / 5000.0 if samples_per_s else None,
        "speedup_cpu_fp32": samples_per_s / 5000.0 if samples_per_s else None,
        "plan": None,
        "error": "",
    }
    row.update(extra)
    return row


BENCH_RESULT: dict[str, Any] = {
    "task": "digits",
    "steps": 60,
    "window": 5,
    "measured_at": "2026-12-01 06:10 UTC",
    "machine": {"cpu": "AMD EPYC 7B13 (2 cores, avx512_bf16)", "gpu": None, "threads": 2},
    "versions": {"python": "3.11.7", "torch": "2.13.0", "redline": "0.1.0"},
    "rows": [
        _row("naive cpu fp32", "naive", 5000.0),
        _row("cpu bf16-mixed", "explicit", 6500.0, precision="bf16-mixed", peak_mem_bytes=150_000_000),
        _row("cpu compiled", "explicit", None, compile=True, error="InductorError: no C++ compiler & no cache"),
        _row(
            "auto",
            "auto",
            7000.0,
            precision="bf16-mixed",
            plan={
                "precision": {"value": "bf16-mixed", "reason": "measured: 1.40x fp32 on this CPU, 8 steps each"},
                "compile": {"value": False, "reason": "auto: on cpu the gain rarely repays the compile"},
            },
        ),
    ],
}


def bench_result() -> dict[str, Any]:
    """A fresh copy of a CPU bench result: four rows, one failed, every MFU null."""
    return copy.deepcopy(BENCH_RESULT)


SUMMARY = {
    "task": "digits",
    "device": "cpu",
    "steps": 30,
    "stopped": "max_steps",
    "final_loss": 0.52,
    "val_loss": 0.61,
    "val_metric": 0.81,
    "samples_per_s": 6400.0,
    "tokens_per_s": None,
    "mfu": None,
    "plan": {
        "device": {"value": "cpu", "reason": "auto: no CUDA or MPS device visible"},
        "precision": {"value": "fp32", "reason": "auto: no AMX; bf16 would be slower here"},
        "compile": {"value": False, "reason": "auto: on cpu the gain rarely repays the compile"},
    },
    "sample": None,
}


def _logged(step: int) -> dict[str, Any]:
    speed = 6000.0 + 40 * step
    return {"step": step, "epoch": 0, "loss": 2.3 / step**0.5, "lr": 1e-3, "samples_per_s": speed,
            "tokens_per_s": None, "step_time_ms": 64_000 / speed, "mem_gib": 0.3 + step / 1000}  # fmt: skip


def write_run(out, steps=30, summary=SUMMARY):
    """A run directory as the Trainer writes it, through its own loggers: 30 steps, an eval every 10."""
    with open_loggers(["csv", "jsonl"], out) as logs:
        logs.log([_logged(step) for step in range(1, steps + 1)])
        for step in range(10, steps + 1, 10):
            logs.log_eval(step, {"val_loss": 1.0 / step**0.3, "val_metric": 0.5 + step / 100})
    if summary is not None:
        (out / "summary.json").write_text(json.dumps(summary), encoding="utf-8")
    return out


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.images: list[dict[str, str | None]] = []
        self.links: list[str] = []  # every src and href

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "img":
            self.images.append(found)
        self.links += [value or "" for name, value in attrs if name in ("src", "href")]


def images(doc: str) -> list[dict[str, str | None]]:
    """The attributes of every <img> in the page."""
    parser = _Links()
    parser.feed(doc)
    return parser.images


def links(doc: str) -> list[str]:
    """Every src and href in the page."""
    parser = _Links()
    parser.feed(doc)
    return parser.links


def decoded_png(src: str) -> bytes:
    """The PNG file inside a ``data:image/png;base64,`` URL."""
    prefix = "data:image/png;base64,"
    assert src.startswith(prefix), src[:40]
    return base64.b64decode(src.removeprefix(prefix), validate=True)


def pixel_variance(png: bytes) -> float:
    """The variance of the image's pixels, as matplotlib decodes it: 0 for an image of one colour."""
    from matplotlib.image import imread

    return float(imread(io.BytesIO(png), format="png").var())


def train_digits(out) -> dict[str, Any]:
    """Train the digits example for an epoch (23 steps) on the CPU into ``out``, evaluating every 8 steps and at
    the end; return its summary."""
    from redline.runtime.options import RuntimeOptions
    from redline.task import load_task
    from redline.train.trainer import Trainer

    with Trainer(
        load_task("example:digits"),
        max_epochs=1,
        eval_every=8,
        log_every=5,
        trial="off",  # the report reads a run; timing auto's choices first is not what it tests
        out_dir=out,
        progress=False,
        runtime=RuntimeOptions(devices="cpu", seed=0),
    ) as trainer:
        return trainer.fit().to_dict()
