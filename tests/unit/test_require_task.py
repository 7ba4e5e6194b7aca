"""Every public function that takes a Task refuses anything else with the way to make one."""

import pytest

import redline
from redline.bench.tune import tune
from redline.errors import ConfigError
from redline.memory.fit import fit_memory

TAKERS = {
    "benchmark": lambda task: redline.benchmark(task),
    "tune": lambda task: tune(task),
    "estimate_memory": lambda task: redline.estimate_memory(task),
    "find_batch_size": lambda task: redline.find_batch_size(task),
    "fit_memory": lambda task: fit_memory(task, device="a GPU", mem_gib=24, target="cuda"),
    "Trainer": lambda task: redline.Trainer(task),
}


@pytest.mark.parametrize("taker", TAKERS)
def test_a_spec_string_is_refused_with_the_load_task_call_that_makes_it_a_task(taker):
    with pytest.raises(ConfigError, match=r"(?s)task='example:digits'.*redline\.load_task\('example:digits'\)"):
        TAKERS[taker]("example:digits")


@pytest.mark.parametrize("taker", TAKERS)
def test_something_else_is_refused_by_its_type(taker):
    with pytest.raises(ConfigError, match=r"task='dict' is not allowed; expected a redline\.Task"):
        TAKERS[taker]({"model": None})
