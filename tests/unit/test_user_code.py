"""Who an exception is blamed on: the user's model, loss or function, or redline's own code."""

import pytest
import torch
from torch import nn

from redline.errors import ConfigError, TrainingError, describe_error
from redline.runtime.contract import blames_user_code, user_code


def caught(work):
    try:
        work()
    except Exception as exc:
        return exc
    raise AssertionError("nothing was raised")


def users_model():
    raise RuntimeError("a bug in the user's forward")


def test_the_users_code_and_torch_layers_under_it_are_the_users_and_redlines_own_code_is_not():
    assert blames_user_code(caught(users_model))
    # A model of torch layers alone: no frame of the user's, but the error ends in torch's, called by the model.
    assert blames_user_code(caught(lambda: nn.Sequential(nn.Linear(4, 2))(torch.zeros(1, 3))))
    # redline's own code failing in its own frame (describe_error reads None's __cause__): a bug of redline's.
    assert not blames_user_code(caught(lambda: describe_error(None)))
    assert not blames_user_code(ConfigError("a redline error says what it is itself"))


def test_user_code_wraps_the_models_exception_and_lets_redlines_own_through_unchanged():
    inputs, targets = torch.zeros(2, 3), torch.zeros(2)
    blamed = "the model or loss raised RuntimeError: a bug in the user's forward"
    with pytest.raises(TrainingError, match=blamed) as got, user_code("step 1", inputs, targets):
        users_model()
    assert "in users_model: raise RuntimeError" in str(got.value)
    with pytest.raises(AttributeError, match="__cause__"), user_code("step 1", inputs, targets):
        describe_error(None)  # its own traceback reaches the user, not a message blaming the model


def test_an_evaluation_whose_metric_raises_blames_the_metric_with_the_outputs_it_was_given():
    from torch.utils.data import TensorDataset

    from redline.runtime.runtime import Runtime
    from redline.task import Task
    from redline.train.evaluation import evaluate_model

    data = TensorDataset(torch.zeros(4, 2), torch.zeros(4, dtype=torch.long))
    task = Task(model=nn.Linear(2, 3), loss_fn=nn.functional.cross_entropy, train_data=data, val_data=data,
                metric=lambda outputs, targets: 1 / 0)  # fmt: skip
    rt = Runtime(devices="cpu", precision="fp32")
    model, _ = rt.setup(task.build_model(), task.optimizer)
    with pytest.raises(TrainingError) as got:
        evaluate_model(task, model, rt, batch_size=4)
    message = str(got.value)
    assert "evaluation: task.metric raised ZeroDivisionError" in message and "model or loss" not in message
    assert "batch: outputs Tensor(4, 3) float32, targets Tensor(4,) int64" in message


def test_a_stopiteration_from_the_users_code_is_a_training_error_not_a_raw_stopiteration():
    # contextlib re-raises a StopIteration bare where the error raised from it is a RuntimeError (a TrainingError)
    from redline.cli.predict import model_raising
    from redline.errors import InferenceError
    from redline.runtime.contract import users_failure
    from redline.train.callbacks import Callback, call_hooks

    class Sampler(Callback):
        def on_evaluate(self, trainer, step, metrics):
            next(iter([]))  # the prompts used up at the second evaluation

    with pytest.raises(TrainingError, match=r"callback Sampler.on_evaluate raised StopIteration") as got:
        call_hooks([Sampler()], "on_evaluate", None, 4, {})
    assert "in on_evaluate: next(iter([]))" in str(got.value) and isinstance(got.value.__cause__, StopIteration)
    metric = user_code("evaluation", torch.zeros(2), torch.zeros(2), metric=True)
    with pytest.raises(TrainingError, match=r"task\.metric raised StopIteration"), metric:
        next(iter([]))
    with pytest.raises(TrainingError, match="build raised StopIteration"), users_failure("build", "fix"):
        next(iter([]))
    predicting = model_raising("predicting", "check the model")
    with pytest.raises(InferenceError, match="the model raised while predicting: StopIteration"), predicting:
        next(iter([]))


def test_wrapping_errors_passes_on_what_the_generator_raises_again_and_runs_its_end():
    from redline.errors import wrapping_errors

    ended = []

    @wrapping_errors
    def passing(wrap):
        try:
            yield "inside"
        except Exception as exc:
            if wrap:
                raise TrainingError("wrapped") from exc
            raise
        finally:
            ended.append(True)

    with passing(wrap=False) as value:
        assert value == "inside"
    with pytest.raises(StopIteration, match="not the user's"), passing(wrap=False):
        raise StopIteration("not the user's")  # raised again: itself, not PEP 479's RuntimeError
    with pytest.raises(TrainingError, match="wrapped") as got, passing(wrap=True):
        raise StopIteration("the user's")
    assert str(got.value.__cause__) == "the user's" and ended == [True, True, True]


class KeywordModel(nn.Module):
    """A Hugging Face-style forward: the batch's tensors as keyword arguments, not one dict."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 2)

    def forward(self, input_ids, attention_mask=None, labels=None):
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        return self.embed(input_ids) * mask.unsqueeze(-1)


class TwoTensors(nn.Module):
    def forward(self, input_ids, attention_mask):
        return input_ids * attention_mask


@pytest.mark.parametrize("model", [KeywordModel(), TwoTensors(), lambda ids: ids.shape])
def test_a_dict_of_inputs_given_to_a_forward_of_tensors_is_told_to_wrap_the_model(model):
    """The hint was "check that the dataset's items are (inputs, targets) shaped as the model expects", which they
    were: redline calls model(inputs), the dict as one argument."""
    inputs = {"input_ids": torch.zeros(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 3, dtype=torch.long)}
    with pytest.raises(TrainingError) as got, user_code("step 1", inputs, torch.zeros(2)):
        model(inputs)
    message = str(got.value)
    assert "model(inputs), here the whole dict" in message
    assert "def forward(self, batch): return self.model(**batch)" in message
    assert "check that the dataset's items" not in message


def test_an_evaluation_reads_its_summed_loss_once_not_once_a_batch(monkeypatch):
    # loss.item() on each validation batch synchronised a GPU once a batch; the sum is read once, and is what the
    # batches' losses add up to, weighted by their sizes
    from torch.utils.data import TensorDataset

    from redline.runtime.runtime import Runtime
    from redline.task import Task
    from redline.train.evaluation import evaluate_model

    reads = []
    item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda self: reads.append(self.dtype) or item(self))
    torch.manual_seed(0)
    x, y = torch.randn(10, 2), torch.randint(0, 3, (10,))
    task = Task(model=nn.Linear(2, 3), loss_fn=nn.functional.cross_entropy, train_data=TensorDataset(x, y),
                val_data=TensorDataset(x, y))  # fmt: skip
    rt = Runtime(devices="cpu", precision="fp32")
    model, _ = rt.setup(task.build_model(), task.optimizer)
    reads.clear()  # the set-up's own
    got = evaluate_model(task, model, rt, batch_size=3)  # batches of 3, 3, 3 and 1
    assert not [dtype for dtype in reads if dtype.is_floating_point]  # the DataLoader draws its seed with one
    with torch.no_grad():
        expected = sum(nn.functional.cross_entropy(model(x[i : i + 3]), y[i : i + 3]).double() * len(y[i : i + 3])
                       for i in range(0, 10, 3)) / 10  # fmt: skip
    assert got["val_loss"] == pytest.approx(float(expected), rel=1e-12)
