"""`redline predict --weights` of a checkpoint: checked against its manifest, and a sharded (FSDP) one read whole."""

import numpy as np
import pytest
import torch
from safetensors.torch import save_model
from torch import nn
from typer.testing import CliRunner

import redline
from redline.checkpoint import step_dir
from redline.checkpoint.sharded import save_sharded
from redline.cli.main import app
from redline.errors import ConfigError
from redline.serve.servable import UNTRAINED_SEED

FACTORY = """
import torch
from torch import nn
from redline.serve.servable import Servable


def make():
    return Servable(model=nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)), input_shape=(3,))
"""
FAST = ("--precision", "fp32", "--compile", "off")
INPUT = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)


@pytest.fixture
def spec(tmp_path):
    (tmp_path / "tiny.py").write_text(FACTORY)
    return f"{tmp_path / 'tiny.py'}:make"


def trained(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))


def predict(tmp_path, spec, weights, *more):
    np.save(tmp_path / "x.npy", INPUT)
    out = tmp_path / "y.npy"
    out.unlink(missing_ok=True)
    result = CliRunner().invoke(app, ["predict", spec, "--input", str(tmp_path / "x.npy"), "--output", str(out),
                                      "--weights", str(weights), *FAST, *more])  # fmt: skip
    return result, (np.load(out) if result.exit_code == 0 else None)


def whole_run(root, steps=(3, 7)):
    """A killed run's checkpoints, one process: each step's weights those of the model seeded with the step."""
    for step in steps:
        with redline.Runtime(devices="cpu", compile="off") as rt:
            rt.setup(trained(step), lambda params: torch.optim.SGD(params, lr=0.1))
            rt.save(step_dir(root / "checkpoints", step), step=step)


def sharded_run(root, steps=(3, 7)):
    """An FSDP run's checkpoints (DCP's files, no model.safetensors), written by the sharded writer."""
    for step in steps:
        model = trained(step)
        optimizer = torch.optim.AdamW(model.parameters())
        save_sharded(step_dir(root / "checkpoints", step), model, optimizer, runtime_state={}, extra={}, plan={},
                     step=step)  # fmt: skip


def forward(model: nn.Module) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(INPUT)).numpy()


def expected(seed):
    """The trained model's own outputs, in plain torch; asserted unlike the untrained model's, which a predict that
    loaded no weights would give."""
    outputs = forward(trained(seed))
    assert not np.allclose(outputs, forward(trained(UNTRAINED_SEED)), atol=1e-3)
    return outputs


def assert_predicted(outputs, seed):
    np.testing.assert_allclose(outputs, expected(seed), rtol=1e-5, atol=1e-6)


def flip_near_the_end(path):
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10  # inside the last tensor's numbers: safetensors alone reads it without complaint
    path.write_bytes(bytes(data))


def test_a_corrupt_checkpoint_weights_file_is_refused_naming_the_newest_that_verifies(tmp_path, spec):
    whole_run(tmp_path / "run", steps=(3, 5, 7))
    newest, earliest = (
        tmp_path / "run" / "checkpoints" / "step-00000007",
        tmp_path / "run" / "checkpoints" / "step-00000003",
    )
    flip_near_the_end(newest / "model.safetensors")
    flip_near_the_end(tmp_path / "run" / "checkpoints" / "step-00000005" / "model.safetensors")
    for weights in (newest / "model.safetensors", newest):
        result, _ = predict(tmp_path, spec, weights)
        assert isinstance(result.exception, ConfigError), result.output  # before: exit 0, with logits of 1e36
        assert str(result.exception) == (
            f"--weights {str(weights)!r}: the checkpoint {newest} is corrupt: model.safetensors does not match its "
            "checksum (corrupt) (checked against its manifest.json)\nhint: load the newest earlier checkpoint whose "
            f"weights verify, of step 3: --weights {earliest / 'model.safetensors'}"
        )
    result, outputs = predict(tmp_path, spec, earliest / "model.safetensors")
    assert result.exit_code == 0, result.output
    assert_predicted(outputs, 3)


def test_a_whole_checkpoint_directory_loads_its_weights(tmp_path, spec):
    whole_run(tmp_path / "run")
    result, outputs = predict(tmp_path, spec, tmp_path / "run" / "checkpoints" / "step-00000007")
    assert result.exit_code == 0, result.output
    assert_predicted(outputs, 7)


def test_a_sharded_checkpoint_directory_loads_its_weights_whole_in_one_process(tmp_path, spec):
    sharded_run(tmp_path / "run")
    result, outputs = predict(tmp_path, spec, tmp_path / "run" / "checkpoints" / "step-00000007")
    assert result.exit_code == 0, result.output
    assert_predicted(outputs, 7)


def test_a_corrupt_sharded_checkpoint_is_refused_naming_the_one_before(tmp_path, spec):
    sharded_run(tmp_path / "run")
    newest = tmp_path / "run" / "checkpoints" / "step-00000007"
    flip_near_the_end(next(newest.glob("*.distcp")))
    result, _ = predict(tmp_path, spec, newest)
    assert isinstance(result.exception, ConfigError), result.output
    message = str(result.exception)
    assert message.startswith(f"--weights {str(newest)!r}: the checkpoint {newest} is corrupt: __0_0.distcp does not")
    assert message.endswith(f"of step 3: --weights {tmp_path / 'run' / 'checkpoints' / 'step-00000003'}")


@pytest.mark.parametrize("asked", ["run", "run/model.safetensors", "run/checkpoints/step-00000007/model.safetensors"])
def test_weights_missing_from_a_run_with_sharded_checkpoints_name_the_checkpoint_directory(tmp_path, spec, asked):
    # before: "redline train --out DIR writes DIR/model.safetensors", which a killed FSDP run never wrote
    sharded_run(tmp_path / "run")
    result, _ = predict(tmp_path, spec, tmp_path / asked)
    assert isinstance(result.exception, ConfigError), result.output
    newest = tmp_path / "run" / "checkpoints" / "step-00000007"
    assert str(result.exception).endswith(f"--weights {newest}")


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata", "runtime.pt"])
def test_a_file_of_a_sharded_checkpoint_names_its_directory(tmp_path, spec, name):
    # before: "written by torch.save", with a conversion that fails on DCP's files
    sharded_run(tmp_path / "run", steps=(7,))
    step = tmp_path / "run" / "checkpoints" / "step-00000007"
    result, _ = predict(tmp_path, spec, step / name)
    assert isinstance(result.exception, ConfigError), result.output
    assert str(result.exception) == (
        f"--weights {str(step / name)!r} is one file of a sharded (FSDP) checkpoint, whose weights its files hold "
        f"together\nhint: pass the checkpoint directory itself: --weights {step}"
    )


def test_another_tools_manifest_beside_the_weights_is_not_read_as_a_checkpoints(tmp_path, spec):
    # An export bundle's manifest.json: read as a redline checkpoint's, it refused weights that loaded before.
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    save_model(trained(7), str(bundle / "model.safetensors"))
    (bundle / "manifest.json").write_text('{"name": "my exported model", "version": 2}')
    result, outputs = predict(tmp_path, spec, bundle / "model.safetensors")
    assert result.exit_code == 0, result.output
    assert_predicted(outputs, 7)


def test_a_checkpoint_kept_under_another_name_is_still_checked_and_its_other_files_refused(tmp_path, spec):
    whole_run(tmp_path / "run", steps=(7,))
    kept = tmp_path / "best"
    (tmp_path / "run" / "checkpoints" / "step-00000007").rename(kept)  # its manifest names redline's format
    result, _ = predict(tmp_path, spec, kept / "optimizer.pt")
    assert isinstance(result.exception, ConfigError), result.output  # before: its model.safetensors, silently
    assert "written by torch.save" in str(result.exception)
    flip_near_the_end(kept / "model.safetensors")
    result, _ = predict(tmp_path, spec, kept / "model.safetensors")
    assert isinstance(result.exception, ConfigError), result.output
    assert "model.safetensors does not match its checksum" in str(result.exception)
