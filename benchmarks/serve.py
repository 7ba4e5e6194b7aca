"""Serving throughput and tail latency: redline serve vs LitServe (batching on) vs a plain FastAPI endpoint.

The same model with the same weights (serve_models.py: the digits CNN and a 4096-wide MLP) is served
by each in turn, on this machine, one at a time, and loaded by the same clients in one run:
- `redline loadtest`'s closed loop at concurrency 64 (the issue's comparison), then its open loop
  at a fixed rate below every server's capacity (the latency a stream of users would see);
- wrk (a C client, Debian's package) at 64 connections, as a cross-check that the Python client is
  not what limits the numbers.
Each server answers one request before it is timed and gets the same warm-up. Servers, clients and
the model share the machine's cores, as they would on one host; only the ratios carry over.

    .venv-peers/bin/python benchmarks/serve.py [--models digits,mlp] [--duration 15] [--write serve]

On a GPU (benchmarks/gpu/serve.sh) redline's settings are compared with one another instead:
    python3 benchmarks/serve.py --device cuda --servers redline-eager,redline-fast,redline --write serve-cuda
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import environment
from redline.serve.engine import InferenceEngine
from redline.serve.loadtest import Payload, run_load
from serve_models import SERVABLES, SHAPES

HERE = Path(__file__).parent
SERVERS = ("redline", "litserve", "fastapi")
# redline with its choices fixed, for the GPU check: eager fp32 against bf16, compile and CUDA graphs.
VARIANTS = {
    "redline": [],
    "redline-eager": [
        "--precision",
        "fp32",
        "--compile",
        "off",
        "--cuda-graphs",
        "off",
        "--measure",
        "off",
        "--channels-last",
        "off",
    ],
    "redline-fast": ["--precision", "bf16-mixed", "--compile", "on", "--cuda-graphs", "on", "--measure", "off"],
}
CONCURRENCY = 64
OPEN_RATE = {"digits": 200.0, "mlp": 100.0, "cnn": 50.0}  # requests/s: below every server's capacity here


def command(server: str, model: str, port: int, device: str | None = None) -> list[str]:
    if server in VARIANTS:
        return [
            sys.executable, "-m", "redline", "serve", f"{HERE / 'serve_models.py'}:{model}", "--port", str(port),
            "--max-batch-size", "32", "--max-wait-ms", "5", *VARIANTS[server],
            *(["--device", device] if device else []),
        ]  # fmt: skip
    if device not in (None, "cpu"):
        raise SystemExit(f"{server} is run on the CPU only here; --device {device} is for redline's variants")
    return [sys.executable, str(HERE / "serve_peers.py"), server, model, str(port)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def post(url: str, body: bytes) -> int:
    request = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as response:
        return int(response.status)


@contextlib.contextmanager
def serving(server: str, model: str, body: bytes, device: str | None = None) -> Iterator[str]:
    """Start ``server`` on a free port; yield its predict URL once it answered a request; stop it after."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/{'v1/predict' if server in VARIANTS else 'predict'}"
    log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in the finally below, after the process)
    process = subprocess.Popen(
        command(server, model, port, device), cwd=HERE, stdout=log, stderr=log, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 300  # compiling every bucket of a GPU model takes a while
        while True:
            if process.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"{server} exited with {process.returncode}:\n{log.read().decode()[-3000:]}")
            with contextlib.suppress(OSError):
                if post(url, body) == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{server} did not answer within 300 s")
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.close()


def wrk(url: str, body: bytes, duration: float) -> dict[str, float] | None:
    """requests/s and p99 (ms) from wrk at 64 connections; None where wrk is not installed."""
    if shutil.which("wrk") is None:
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(
            f'wrk.method = "POST"\nwrk.body = {json.dumps(body.decode())}\n'
            'wrk.headers["Content-Type"] = "application/json"\n'
        )
    try:
        done = subprocess.run(
            ["wrk", "-t1", f"-c{CONCURRENCY}", f"-d{int(duration)}s", "--latency", "-s", script.name, url],
            capture_output=True, text=True, timeout=duration + 60,
        )  # fmt: skip
    finally:
        os.unlink(script.name)
    rps = re.search(r"Requests/sec:\s+([\d.]+)", done.stdout)
    p99 = re.search(r"99%\s+([\d.]+)(us|ms|s)\b", done.stdout)
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", done.stdout)
    if rps is None or p99 is None:
        raise RuntimeError(f"wrk printed no figures:\n{done.stdout}\n{done.stderr}")
    scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}[p99.group(2)]
    return {
        "rps": float(rps.group(1)),
        "p99": float(p99.group(1)) * scale,
        "non2xx": int(errors.group(1)) if errors else 0,
    }


def measure(server: str, model: str, duration: float, device: str | None = None) -> dict[str, Any]:
    body = json.dumps({"inputs": [nested(SHAPES[model])]}).encode()
    payload = Payload(body, "application/json")
    with serving(server, model, body, device) as url:
        closed = run_load(url, concurrency=CONCURRENCY, duration=duration, warmup=3.0, payload=payload)
        opened = run_load(url, rate=OPEN_RATE[model], duration=duration, warmup=2.0, payload=payload)
        cross = wrk(url, body, duration)
    return {"closed": closed.to_dict(), "open": opened.to_dict(), "wrk": cross}


def plan_of(server: str, model: str, device: str | None) -> str:
    """The precision, layout and compile the redline server kept, read back from the measurement it cached (an engine
    with its options, built here, finds the server's entry and times nothing)."""
    flags = dict(zip(VARIANTS[server][::2], VARIANTS[server][1::2], strict=True))
    options = {flag.removeprefix("--").replace("-", "_"): value for flag, value in flags.items()}
    servable = SERVABLES[model]()
    plan = InferenceEngine(servable, device=device or "cpu", max_batch_size=32, **options).plan
    axes = [axis for axis in ("precision", "channels_last", "compile", "small_batches") if axis in plan]
    return "; ".join(f"{axis}={plan[axis].value} ({plan[axis].reason})" for axis in axes)


def nested(shape: tuple[int, ...]) -> object:
    """One sample of ``shape`` as nested lists."""
    return 0.5 if not shape else [nested(shape[1:])] * shape[0]


def row(model: str, server: str, result: dict[str, Any], base: dict[str, Any]) -> str:
    closed, opened, cross = result["closed"], result["open"], result["wrk"]
    ratio = closed["success_rps"] / base["closed"]["success_rps"] if base["closed"]["success_rps"] else math.nan
    statuses = closed["status_counts"].items()
    failed = sum(n for code, n in statuses if not code.startswith("2")) + closed["requests_failed"]
    wrk_text = "n/a" if cross is None else f"{cross['rps']:,.0f} / {cross['p99']:,.1f}"
    if base["wrk"] and cross:
        wrk_text += f" ({cross['rps'] / base['wrk']['rps']:.2f}x)"
    tail, steady = closed["latency_2xx_ms"], opened["latency_2xx_ms"]
    return (
        f"| {model} | {server} | {closed['success_rps']:,.0f} | **{ratio:.2f}x** | {tail['p50_ms']:,.1f} "
        f"| {tail['p99_ms']:,.1f} | {failed} | {steady['p50_ms']:,.1f} | {steady['p99_ms']:,.1f} | {wrk_text} |"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="digits,mlp")
    parser.add_argument("--servers", default=",".join(SERVERS))
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--device", help="redline's --device (its variants only; the peers run on the CPU)")
    parser.add_argument("--base", help="the server ratios are against (default: litserve when run, else the first)")
    parser.add_argument("--write", metavar="NAME", help="also write benchmarks/results/NAME.md")
    args = parser.parse_args(argv)
    servers = args.servers.split(",")
    unknown = [server for server in servers if server not in (*SERVERS, *VARIANTS)]
    if unknown:
        parser.error(f"unknown server(s) {unknown}; choose from {sorted({*SERVERS, *VARIANTS})}")
    base = args.base or ("litserve" if "litserve" in servers else servers[0])
    if base not in servers:
        parser.error(f"--base {base} is not among --servers {args.servers}")
    lines = [
        f"Closed loop: `redline loadtest --concurrency {CONCURRENCY}`; open loop: `--rate R` ("
        f"{', '.join(f'{model} {OPEN_RATE[model]:g}/s' for model in args.models.split(','))}); {args.duration:g} s "
        "each after a warm-up. "
        f"Ratios against {base} in the same run. wrk: requests/s / p99 ms at 64 connections.",
        "",
        f"| model | server | req/s (c=64) | vs {base} | p50 ms | p99 ms | non-2xx | open p50 ms | open p99 ms "
        "| wrk req/s / p99 ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    notes = [""]
    for model in args.models.split(","):
        results = {}
        for server in servers:
            print(f"{model} on {server} ...", flush=True)
            results[server] = measure(server, model, args.duration, args.device)
            if server in VARIANTS:
                notes.append(f"- {model} on {server}: {plan_of(server, model, args.device)}")
        lines += [row(model, server, results[server], results[base]) for server in servers]
    title = "Serving: redline vs LitServe vs FastAPI" if "litserve" in servers else "Serving: redline's settings"
    environment.publish(args.write, title, lines + notes, device=args.device or "cpu")


if __name__ == "__main__":
    main()
