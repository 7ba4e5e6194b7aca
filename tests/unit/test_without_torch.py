"""Where `import torch` fails, `import redline`, `redline --help` and `redline doctor` still work and say why."""

import ast
import inspect
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import redline
from redline.cli.main import SUBCOMMANDS
from redline.doctor.checks.machine import NOT_IMPORTED

PACKAGE = Path(redline.__file__).parent
LIBCUDART_ERROR = "libcudart.so.12: cannot open shared object file: No such file or directory"


@pytest.fixture
def broken_torch_env(tmp_path) -> dict[str, str]:
    """Return an environment whose `import torch` raises what a CUDA wheel without its runtime library raises."""
    fake = tmp_path / "site" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(f"raise ImportError({LIBCUDART_ERROR!r})\n")
    (fake / "version.py").write_text("__version__ = '2.5.1+cu124'\ncuda = '12.4'\nhip = None\n")
    env = {name: value for name, value in os.environ.items() if name != "LD_LIBRARY_PATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), *filter(None, [env.get("PYTHONPATH")])])
    return env


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, env=env)


def test_the_fake_torch_really_fails_to_import(broken_torch_env):
    result = run(["-c", "import torch"], broken_torch_env)
    assert result.returncode == 1 and LIBCUDART_ERROR in result.stderr


# Import every module the doctor's command line needs; with torch blocked, any `import torch` among them raises.
IMPORT_ALL = """
import importlib, json, sys
sys.modules["torch"] = None  # `import torch` now raises ImportError
import redline
names = sys.argv[1:]
for name in names:
    importlib.import_module(name)
print(json.dumps({"version": redline.__version__, "check_machine": callable(redline.doctor.check_machine),
                  "torch": sorted(m for m, mod in sys.modules.items() if mod and m.split(".")[0] == "torch")}))
"""


def doctor_modules() -> list[str]:
    found = []
    for path in sorted((PACKAGE / "doctor").rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


def test_the_doctor_and_its_command_line_import_no_torch():
    modules = [*doctor_modules(), "redline.render.doctor", "redline.cli.doctor", "redline.cli.main"]
    assert "redline.doctor.probes" in modules and "redline.doctor.checks.cuda" in modules
    out = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, *modules], capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(out.stdout) == {"version": redline.__version__, "check_machine": True, "torch": []}


def test_import_redline_loads_no_torch():
    code = "import sys, redline; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_type_checkers_see_every_public_name_from_the_module_that_defines_it():
    # py.typed ships: a lazy name missing from the TYPE_CHECKING imports types as `object` in users' code.
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    block = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    seen = {}
    for node in ast.walk(block):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                seen[alias.name] = node.module if node.module != "redline" else f"redline.{alias.name}"
    assert seen == redline._LAZY


def test_every_public_name_resolves_and_doctor_is_the_subpackage():
    for name in redline.__all__:
        assert getattr(redline, name) is not None, name
    assert set(redline.__all__) <= set(dir(redline))
    assert isinstance(redline.doctor, types.ModuleType) and redline.doctor.__name__ == "redline.doctor"
    from redline.doctor import check_machine

    assert redline.doctor.check_machine is check_machine
    assert list(inspect.signature(check_machine).parameters) == ["quick", "probe_file"]
    assert redline.Runtime.__module__ == "redline.runtime.runtime"
    with pytest.raises(AttributeError, match="no attribute 'doctorr'"):
        _ = redline.doctorr


def test_each_subcommand_summary_is_the_first_line_of_its_docstring():
    for name, spec in SUBCOMMANDS.items():
        function = getattr(__import__(spec.module, fromlist=[spec.function]), spec.function)
        assert spec.summary == inspect.getdoc(function).splitlines()[0], name


HELP = """
import sys
from redline.cli.main import main
sys.argv = ["redline", "--help"]
try:
    main()
finally:  # typer exits after printing the help
    print(sorted(m for m in sys.modules if m.startswith(("redline.cli.", "torch"))), file=sys.stderr)
"""


def test_help_lists_every_command_without_importing_one(broken_torch_env):
    result = run(["-c", HELP], {**broken_torch_env, "COLUMNS": "160"})
    assert result.returncode == 0, result.stderr
    listed = " ".join(result.stdout.split())  # a summary wider than the help wraps onto a second line
    for name, spec in SUBCOMMANDS.items():
        assert f"{name} {spec.summary}" in listed
    assert ast.literal_eval(result.stderr.strip().splitlines()[-1]) == ["redline.cli.main"]


def test_version_names_redline_torch_and_python_without_importing_torch(broken_torch_env):
    from importlib.metadata import version

    from redline.version import __version__

    script = HELP.replace('"--help"', '"--version"')
    result = run(["-c", script], broken_torch_env)
    assert result.returncode == 0, result.stderr
    python = ".".join(map(str, sys.version_info[:3]))
    assert result.stdout == f"redline {__version__} (torch {version('torch')}, Python {python})\n"
    assert ast.literal_eval(result.stderr.strip().splitlines()[-1]) == ["redline.cli.main"]


def test_full_doctor_reports_the_broken_torch_with_its_fix(broken_torch_env):
    result = run(["-m", "redline", "doctor", "--json"], broken_torch_env)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    checks = {c["id"]: c for c in json.loads(result.stdout)["checks"]}
    torch_build = checks["torch-build"]
    assert torch_build["status"] == "fail"
    assert f"import torch failed: ImportError: {LIBCUDART_ERROR}" in torch_build["detail"]
    assert "pip install --force-reinstall torch" in torch_build["fix"]
    assert checks["cuda-available"] == {
        "id": "cuda-available",
        "status": "skip",
        "detail": "torch did not import (see torch-build)",
        "fix": None,
    }


def test_a_command_that_needs_torch_says_to_run_the_doctor(broken_torch_env):
    result = run(["-m", "redline", "train", "--task", "example:digits"], broken_torch_env)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert LIBCUDART_ERROR in result.stderr and "run `redline doctor`" in result.stderr


def test_quick_doctor_reads_the_broken_torchs_build_without_importing_it(broken_torch_env):
    result = run(["-m", "redline", "doctor", "--json", "--quick"], broken_torch_env)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    checks = {c["id"]: c for c in json.loads(result.stdout)["checks"]}
    torch_build = checks["torch-build"]
    assert torch_build["status"] == "ok" and torch_build["detail"].startswith("torch 2.5.1+cu124: a CUDA 12.4 build")
    assert "--quick does not import torch" in torch_build["detail"]
    assert checks["cuda-available"]["status"] == "skip"
    assert checks["cuda-available"]["detail"] == NOT_IMPORTED and "run `redline doctor`" in NOT_IMPORTED


def test_the_exceptions_the_docs_tell_scripts_to_catch_are_public_names():
    # docs/bench.md and docs/errors.md name them for scripts to catch; they were reachable only from their modules
    named = (("BenchInterrupted", "bench.md"), ("TuneInterrupted", "bench.md"), ("ResultsSkipped", "errors.md"))
    for name, doc in named:
        assert f"`{name}`" in (PACKAGE.parents[1] / "docs" / doc).read_text(), name
        assert name in redline.__all__ and issubclass(getattr(redline, name), BaseException), name
    assert issubclass(redline.BenchInterrupted, redline.StoppedBySignal)
    assert issubclass(redline.TuneInterrupted, redline.StoppedBySignal)
