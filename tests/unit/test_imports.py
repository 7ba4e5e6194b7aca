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


# Layers of DESIGN.md, lowest first: a module may import its own layer or a lower one, never a higher.
LAYERS = {
    "errors": 0,
    "atomic": 0,
    "config": 0,
    "hardware": 1,
    "task": 2,
    "plan": 2,
    "runtime": 3,
    "parallel": 3,  # the Runtime detects torchrun's environment and wraps for DDP/FSDP
    "checkpoint": 3,
    "examples": 4,
    "train": 4,
    "launch": 4,
    "report": 4,
    "doctor": 4,
    "memory": 4,
    "bench": 4,
    "serve": 4,
    "advise": 4,
    "profile": 4,
    "cli": 5,
    "__main__": 5,
}


def redline_imports(path: Path) -> set[str]:
    """Return the redline sub-packages a module imports, as their top-level names."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            raise AssertionError(f"{path}: use absolute imports (from redline.x import y)")
        for name in names:
            parts = name.split(".")
            if parts[0] == "redline" and len(parts) > 1:
                found.add(parts[1])
    return found


def layer_of(path: Path) -> str:
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py")


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_flow_one_way(path):
    source = layer_of(path)
    assert source in LAYERS, f"{source} has no layer; add it to LAYERS as DESIGN.md places it"
    for target in redline_imports(path):
        assert target in LAYERS, f"{path.name} imports redline.{target}, which has no layer"
        assert LAYERS[target] <= LAYERS[source], (
            f"{path.relative_to(PACKAGE)} (layer {source}) imports redline.{target}, a higher layer"
        )


def test_the_layer_check_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from redline.cli.main import app\nimport redline.train.loop\n")
    assert redline_imports(bad) == {"cli", "train"}
