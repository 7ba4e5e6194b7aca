"""Importing redline is cheap and safe, and the package's layers import one way only."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import redline
from devices import CUDA_SPY

PACKAGE = Path(redline.__file__).parent

# Modules that belong to optional extras, the CLI, or the compiler stack: none loads on `import redline`.
NOT_ON_IMPORT = [
    "matplotlib",
    "starlette",
    "uvicorn",
    "aiohttp",
    "prometheus_client",
    "orjson",
    "tensorboard",
    "pynvml",
    "sklearn",
    "triton",
    "typer",
    "rich",
    "torch._dynamo",
    "torch._inductor",
    "redline.cli",
    "redline.examples",
]

PROBE = (
    CUDA_SPY
    + """
before = set(sys.modules)  # torch itself may import some (torch.cuda tries pynvml)
import redline
print(json.dumps({
    "cuda_calls": calls,
    "cuda_initialized": torch.cuda.is_initialized(),
    "loaded": sorted(m for m in %r if m in set(sys.modules) - before),
}))
"""
)


def test_import_touches_no_cuda_and_no_optional_extra():
    out = subprocess.run(
        [sys.executable, "-c", PROBE % (NOT_ON_IMPORT,)], capture_output=True, text=True, check=True, timeout=120
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["cuda_calls"] == [], "import redline queried CUDA"
    assert result["cuda_initialized"] is False
    assert result["loaded"] == []


# The layers (README.md, "Layout and tests"): Face -> Apps -> Core -> torch. A Core module never imports an App
# or the Face; an App imports Core only, never another App (what two Apps share belongs in Core).
FACE = {"cli", "render", "__init__", "__main__"}
APPS = {"train", "launch", "doctor", "memory", "bench", "serve", "advise", "profile"}
CORE = {
    "plan", "runtime", "parallel", "checkpoint", "hardware", "task", "examples", "errors", "atomic", "config", "brief",
    "version",
}  # fmt: skip
FORBIDDEN_FOLDERS = {"dist", "build"}  # packaging tools own these names


def redline_imports(path: Path) -> set[str]:
    """Return the redline sub-packages a module imports, as their top-level names ("" for `from redline import`)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "redline":  # `from redline import checkpoint` names a sub-package, or the face
                names = [f"redline.{alias.name}" for alias in node.names if (PACKAGE / alias.name).is_dir()]
                names += ["redline"] * any(not (PACKAGE / alias.name).is_dir() for alias in node.names)
            else:
                names = [node.module]
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            raise AssertionError(f"{path}: use absolute imports (from redline.x import y)")
        for name in names:
            parts = name.split(".")
            if parts[0] == "redline":
                found.add(parts[1] if len(parts) > 1 else "")
    return found


def layer_of(path: Path) -> str:
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def kind_of(name: str) -> str:
    for kind, members in (("face", FACE), ("app", APPS), ("core", CORE)):
        if name in members:
            return kind
    raise AssertionError(f"redline.{name} has no layer; place it in FACE, APPS or CORE")


MODULES = sorted(PACKAGE.rglob("*.py"))


def allowed(source: str, target: str) -> bool:
    """Whether a module of ``source`` may import ``target`` (both top-level names under redline)."""
    if target == "":
        return source in ("__main__",)  # inside the package, import what you need from where it lives
    if source == target:
        return True
    kinds = kind_of(source), kind_of(target)
    return kinds[0] == "face" or (kinds[1] == "core" and kinds[0] in ("app", "core"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_flow_one_way(path):
    source = layer_of(path)
    kind_of(source)
    for target in redline_imports(path):
        if target:
            kind_of(target)
        assert allowed(source, target), (
            f"{path.relative_to(PACKAGE)} ({kind_of(source)} {source}) imports "
            f"redline.{target or '(the package)'}: {'a higher layer' if target else 'import from the module itself'}"
        )


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in MODULES:
        source = layer_of(path)
        graph.setdefault(source, set()).update(t for t in redline_imports(path) if t and t != source)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """Return one cycle of the graph as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if state.get(nxt) is None and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if state.get(node) is None and (cycle := visit(node)):
            return cycle
    return None


def test_the_sub_packages_import_each_other_without_a_cycle():
    assert find_cycle(package_graph()) is None, f"package cycle: {' -> '.join(find_cycle(package_graph()) or [])}"


def test_no_folder_takes_a_name_packaging_tools_own():
    assert not {p.name for p in PACKAGE.iterdir() if p.is_dir()} & FORBIDDEN_FOLDERS


def test_the_layer_checks_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from redline.cli.main import app\nimport redline.train.loop\nfrom redline import Runtime\n")
    assert redline_imports(bad) == {"cli", "train", ""}
    assert not allowed("runtime", "train") and not allowed("train", "doctor") and not allowed("train", "cli")
    assert not allowed("runtime", "") and allowed("cli", "train") and allowed("train", "runtime")
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}}) is None


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_is_over_500_lines(path):
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= 500, f"{path.relative_to(PACKAGE)} has {lines} lines: it is asking for a concept of its own"
