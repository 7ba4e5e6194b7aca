import gc
import multiprocessing
import os
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from redline.errors import ConfigError
from redline.hardware.contention import ENV as CONTENTION_ENV
from redline.hardware.device import CPU_ISAS, FAKE_CPU_ENV, probe_cpu_isa
from redline.runtime.cache import CACHE_ENV

# The device fixtures in devices.py are shared by the unit and CPU tiers.
sys.path.insert(0, str(Path(__file__).parent))

pytest_plugins = ["pytester"]  # test_cpu_facts.py runs this conftest in an inner pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--redline-cpu",
        choices=CPU_ISAS,
        default=None,
        help=f"plan every run as on this CPU, by setting {FAKE_CPU_ENV} for the tests and the processes they start",
    )


def pytest_configure(config: pytest.Config) -> None:
    # Through the environment, so that `redline train` and `redline launch` children plan the same way;
    # xdist's workers start after this and inherit it too.
    # A shell runs a background job (`make test &`) with SIGINT ignored, and nohup ignores SIGHUP: the processes the
    # tests start would inherit that and shrug off the signals the stop tests send them. Tests run as from a terminal.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
    fake = config.getoption("--redline-cpu")
    if fake:
        os.environ[FAKE_CPU_ENV] = fake
    # Each xdist worker is a process of its own, and torch gives each one a thread per core: two workers on
    # two cores run four threads, and OpenMP's waiting threads slow small ops. The workers share the cores
    # instead. Measured on 2 cores (farm-bench, 3 pairs, the trainer, docs-examples and mistakes tests): 0.93x
    # the wall time on a quiet machine; on one loaded by other work, the README example took 7 s, not 46 s.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))
    # Measured choices are never cached in the developer's own cache (each test has its own: own_measurement_cache).
    os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="redline-test-cache-")
    # A trial's verdict does not hang on the load of the tests beside it (xdist's other worker): measured as on a quiet
    # machine, cached as final (tests/unit/test_contention.py turns the check on).
    os.environ[CONTENTION_ENV] = "off"
    try:
        probe_cpu_isa()
    except ConfigError as exc:  # a bad REDLINE_CPU would otherwise fail every test that plans
        raise pytest.UsageError(str(exc)) from None


@pytest.fixture(autouse=True)
def own_measurement_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test measures into a cache of its own: a trial one test ran for real (`memory --measure` on digits, on a
    CPU where bf16 wins) must not decide the precision of another test's short run of the same model."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("redline-cache")))


@pytest.fixture(autouse=True)
def no_stray_loader_workers() -> Iterator[None]:
    """A test that leaves a DataLoader's worker processes alive (an error's traceback holding its iterator) has them
    collected here: left to a later collection, torch stops them there at 5 s a worker, inside another test's
    timed requests (a load test saw one of its requests time out)."""
    yield
    if multiprocessing.active_children():
        gc.collect()


def pytest_report_header(config: pytest.Config) -> str:
    isa, faked = probe_cpu_isa()
    return f"redline plans as CPU: {isa} ({f'faked by {FAKE_CPU_ENV}' if faked else 'probed'})"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
