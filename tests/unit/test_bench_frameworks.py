"""benchmarks/frameworks.py: what its notes say of the one `redline tune` it runs before the tuned entry."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

from frameworks import tune_once  # the benchmarks folder is not a package


def test_a_tune_that_fails_is_noted_by_its_error_line_not_the_hint_under_it(tmp_path):
    failing = tmp_path / "python"  # stands in for the peers' Python: prints what the command line prints, exits 2
    failing.write_text(
        "#!/bin/sh\n"
        'echo "error: --budget=120.0 is not allowed; expected enough seconds to measure every axis" >&2\n'
        "echo 'hint: e.g. --budget 300' >&2\n"
        "exit 2\n"
    )
    failing.chmod(0o755)
    told = tune_once(str(failing), "example:digits", 100, "cpu", tmp_path / "cache", 30)
    error = "error: --budget=120.0 is not allowed; expected enough seconds to measure every axis"
    assert told == f"redline tune failed: {error}"
