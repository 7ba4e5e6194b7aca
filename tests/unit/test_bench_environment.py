"""benchmarks/environment.py: what a result's header records, and the fresh caches each timed run gets."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

import environment  # the benchmarks folder is not a package

ROOT = Path(__file__).parents[2].resolve()


def test_the_recorded_command_runs_as_typed_from_the_repository_root_wherever_it_was_run():
    argv = ["speedup.py", "--steps", "400", "--options", "precision=bf16-mixed,attention=flash", "--write", "a b"]
    said = environment.command_line(argv, {"PYTHONPATH": "../src"}, ROOT / "benchmarks", ROOT)
    expected = "PYTHONPATH=src python benchmarks/speedup.py --steps 400 --options precision=bf16-mixed,attention=flash"
    assert said == f"{expected} --write 'a b'"


def test_the_header_names_the_commit_and_each_cache_set_or_left_to_its_default():
    lines = environment.describe("cpu")
    assert any(line.startswith("- commit: ") and "unknown" not in line for line in lines)
    said = environment.caches({"TORCHINDUCTOR_CACHE_DIR": "/tmp/ind"})
    assert said == "TORCHINDUCTOR_CACHE_DIR=/tmp/ind; REDLINE_CACHE_DIR unset (~/.cache/redline, kept between runs)"


def test_each_run_gets_empty_compile_and_trial_caches_of_its_own_removed_after():
    with environment.fresh_caches() as first, environment.fresh_caches() as second:
        for name in ("TORCHINDUCTOR_CACHE_DIR", "REDLINE_CACHE_DIR"):
            assert first[name] != second[name]
            assert not Path(first[name]).exists() or not any(Path(first[name]).iterdir())
        assert first["PYTHONPATH"].split(":")[0] == str(ROOT / "src")
    assert not Path(first["REDLINE_CACHE_DIR"]).parent.exists()
