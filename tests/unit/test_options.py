"""The options objects: validated once, and the command line derived from them so the two cannot drift."""

import dataclasses
import enum
from pathlib import Path

import pytest
import typer

from redline.cli import task_args
from redline.cli import train as train_cli
from redline.cli.launch import launch_command
from redline.errors import ConfigError
from redline.launch.torchrun import LaunchConfig
from redline.runtime.options import RuntimeOptions
from redline.train.callbacks import EarlyStopping
from redline.train.config import TrainerConfig


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("precision", "bf16", "precision='bf16'"),
        ("devices", "gpu", "devices='gpu'"),
        ("compile", "maybe", "compile='maybe'"),
        ("strategy", "zero3", "strategy='zero3'"),
        ("grad_accum", 0, "grad_accum=0"),
        ("grad_accum", True, "grad_accum=True"),
        ("clip_grad_norm", -1.0, "clip_grad_norm=-1.0"),
        ("seed", "7", "seed='7'"),
        ("seed", 2**64, "seed=18446744073709551616 is not allowed; expected an integer from -9223372036854775808 to"),
        ("deterministic", "yes", "deterministic='yes'"),
        ("find_unused_parameters", "yes", "find_unused_parameters='yes'"),
        ("micro_batch", 0, "micro_batch=0"),
        ("micro_batch", "half", "micro_batch='half'"),
        ("micro_batch", True, "micro_batch=True"),
    ],
)
def test_runtime_options_name_the_bad_field_and_what_is_allowed(field, value, message):
    with pytest.raises(ConfigError, match=message):
        RuntimeOptions(**{field: value})


def test_runtime_options_keep_switches_as_words_and_build_from_changes():
    options = RuntimeOptions(compile=True, channels_last=False)
    assert (options.compile, options.channels_last) == ("on", "off")
    assert RuntimeOptions.build(options, seed=3) == dataclasses.replace(options, seed=3)
    listed = "a Runtime option: activation_checkpointing, attention, channels_last, clip_grad_norm"
    with pytest.raises(ConfigError, match=listed):
        RuntimeOptions.build(precison="fp32")
    with pytest.raises(ConfigError, match=r"\nhint: did you mean precision='fp32'\?$"):
        RuntimeOptions.build(precison="fp32")


def test_a_stored_plan_fixes_the_numerics_and_the_data_order_and_keeps_this_runs_strategy():
    plan = {
        "device": {"value": "cpu"}, "precision": {"value": "bf16-mixed"}, "compile": {"value": True},
        "channels_last": {"value": False}, "grad_accum": {"value": 4}, "clip_grad_norm": {"value": 1.0},
        "seed": {"value": 3},
    }  # fmt: skip
    now = RuntimeOptions(seed=9, strategy="fsdp", deterministic=True, precision="fp32")
    resumed = now.with_plan(plan)
    assert (resumed.precision, resumed.compile, resumed.channels_last) == ("bf16-mixed", "on", "off")
    assert (resumed.grad_accum, resumed.clip_grad_norm, resumed.seed) == (4, 1.0, 3)
    assert (resumed.strategy, resumed.deterministic) == ("fsdp", True)
    del plan["seed"]  # a Plan of an earlier version: the seed asked for now
    assert now.with_plan(plan).seed == 9


def test_a_layout_auto_chose_stays_auto_in_a_resumed_run_and_one_asked_for_stays_as_asked():
    # a resumed run got "on" for auto's NHWC: no NCHW fallback, and its image outputs came out NHWC, where a loss's
    # logits.view(len(logits), -1) that ran before the resume then failed
    plan = {
        "device": {"value": "cpu"}, "precision": {"value": "bf16-mixed"}, "compile": {"value": False},
        "grad_accum": {"value": 1}, "clip_grad_norm": {"value": None},
    }  # fmt: skip
    for value, reason, resumed in [
        (True, "auto: bf16 convolutions run on this CPU's AMX tiles, which want NHWC", "auto"),
        (False, "auto: ..., but the model's forward failed so (RuntimeError: view size): NCHW", "auto"),
        (True, "from checkpoint step 10: auto: bf16 convolutions run on ...", "auto"),  # resumed before: its note
        (True, "requested", "on"),
        (False, "from checkpoint step 10: requested", "off"),
    ]:
        stored = {**plan, "channels_last": {"value": value, "reason": reason}}
        assert RuntimeOptions().with_plan(stored).channels_last == resumed


def test_a_compile_mode_with_compile_off_is_refused_and_a_resumed_eager_run_drops_the_mode_asked_now():
    with pytest.raises(ConfigError, match=r"compile_mode='max-autotune' is not allowed; expected 'default' when"):
        RuntimeOptions(compile="off", compile_mode="max-autotune")
    assert RuntimeOptions(compile="auto", compile_mode="reduce-overhead").compile_mode == "reduce-overhead"
    plan = {
        "device": {"value": "cpu"}, "precision": {"value": "fp32"}, "compile": {"value": False},
        "channels_last": {"value": False}, "grad_accum": {"value": 1}, "clip_grad_norm": {"value": None},
    }  # fmt: skip
    resumed = RuntimeOptions(compile_mode="max-autotune").with_plan(plan)  # the stored run ran eager, and still does
    assert (resumed.compile, resumed.compile_mode) == ("off", "default")
    plan["compile"] = {"value": True}
    assert RuntimeOptions(compile_mode="max-autotune").with_plan(plan).compile_mode == "max-autotune"
    # reduce-overhead kept auto's CUDA graphs off in the run that ran eager: the resumed run goes on without them
    eager = {**plan, "compile": {"value": False}, "cuda_graphs": {"value": False}}
    resumed = RuntimeOptions(compile_mode="reduce-overhead").with_plan(eager)
    assert (resumed.compile_mode, resumed.cuda_graphs) == ("default", "off")
    graphed = {**eager, "cuda_graphs": {"value": True}}  # the run's auto took them: auto checks them again
    assert RuntimeOptions(compile_mode="reduce-overhead").with_plan(graphed).cuda_graphs == "auto"


def test_a_tune_that_chose_eager_drops_a_compile_mode_asked_with_compile_left_to_auto():
    from redline.runtime.tuned import Candidate, TunedPlan

    tuned = TunedPlan(task="t", device="cuda", batch_size=8, planned_steps=100, measured_at="then",
                      best=Candidate(precision="bf16-mixed", compile=False), reasons={}, trials=())  # fmt: skip
    applied = tuned.apply(RuntimeOptions(compile_mode="reduce-overhead"))  # --plan tuned --compile-mode: it raised
    assert (applied.compile, applied.compile_mode, applied.precision) == ("off", "default", "bf16-mixed")
    asked = tuned.apply(RuntimeOptions(compile="on", compile_mode="max-autotune"))  # an explicit compile wins
    assert (asked.compile, asked.compile_mode) == ("on", "max-autotune")


def test_a_compile_mode_given_as_the_default_wins_over_a_tuned_one():
    from redline.runtime.tuned import Candidate, TunedPlan

    best = Candidate(precision="bf16-mixed", compile=True, compile_mode="reduce-overhead")
    tuned = TunedPlan(task="t", device="cuda", batch_size=8, planned_steps=100, measured_at="then", best=best,
                      reasons={}, trials=())  # fmt: skip
    assert tuned.apply(RuntimeOptions()).compile_mode == "reduce-overhead"
    given = tuned.apply(RuntimeOptions(compile_mode="default"))  # --compile-mode default: it read as left to auto
    assert (given.compile, given.compile_mode, given.precision) == ("on", "default", "bf16-mixed")


def test_a_device_asked_for_now_moves_a_resumed_run_and_auto_keeps_the_stored_one():
    plan = {
        "device": {"value": "cuda:0"}, "precision": {"value": "fp32"}, "compile": {"value": False},
        "channels_last": {"value": False}, "grad_accum": {"value": 1}, "clip_grad_norm": {"value": None},
    }  # fmt: skip
    assert RuntimeOptions(devices="cpu").with_plan(plan).devices == "cpu"
    assert RuntimeOptions().with_plan(plan).devices == "cuda:0"


def test_the_requests_a_resumed_run_overrides_are_named_and_a_repeated_command_names_none():
    from redline.train.resume import overridden_requests

    plan = {
        "precision": {"value": "fp32", "reason": "auto: ..."}, "grad_accum": {"value": 2, "reason": "requested"},
        "compile": {"value": False, "reason": "requested, but no C compiler; running eagerly"},
        "channels_last": {"value": True, "reason": "requested"}, "clip_grad_norm": {"value": None, "reason": ""},
    }  # fmt: skip
    asked = RuntimeOptions(precision="bf16-mixed", channels_last="off", clip_grad_norm=1.0, compile="on")
    assert overridden_requests(asked, plan) == [
        "--precision bf16-mixed asked, the checkpoint's fp32 kept",
        "--channels-last off asked, the checkpoint's on kept",
        "--clip-grad-norm 1.0 asked, the checkpoint's none kept",
    ]
    same = RuntimeOptions(precision="fp32", compile="on", channels_last="on", grad_accum=2)  # as the run was started
    assert overridden_requests(same, plan) == []
    plan["seed"] = {"value": None, "reason": ""}  # no seed asked: the data order's is 0
    assert overridden_requests(RuntimeOptions(seed=0), plan) == []
    assert overridden_requests(RuntimeOptions(seed=7), plan) == ["--seed 7 asked, the checkpoint's 0 kept"]
    assert overridden_requests(RuntimeOptions(), plan) == []  # nothing asked: the Plan goes on quietly


def test_a_switch_asked_on_where_the_stored_run_asked_it_off_is_named():
    from redline.train.resume import overridden_requests

    off = {"value": False, "reason": "requested"}  # the first run asked --compile off --channels-last off
    plan = {"compile": off, "channels_last": off}
    assert overridden_requests(RuntimeOptions(compile="on", channels_last="on"), plan) == [
        "--compile on asked, the checkpoint's off kept",
        "--channels-last on asked, the checkpoint's off kept",
    ]


def test_trainer_config_checks_and_normalises():
    with pytest.raises(ConfigError, match="max_steps=0"):
        TrainerConfig(max_steps=0)
    # asked for without out_dir, each would do nothing, unnoticed
    # (the defaults' own values included: --keep-checkpoints 3 or --checkpoint-minutes 30 typed is asked for too)
    asking = ({"resume": "auto"}, {"checkpoint_every": 5}, {"keep_checkpoints": 1}, {"checkpoint_minutes": 5},
              {"keep_checkpoints": 3}, {"checkpoint_minutes": 30})  # fmt: skip
    for asked in (*asking, {"memory_history": True}):  # an out-of-memory wrote its snapshot nowhere
        with pytest.raises(ConfigError, match=f"{next(iter(asked))}=.* expected it with out_dir=DIR"):
            TrainerConfig(**asked)  # type: ignore[arg-type]
        TrainerConfig(**asked, out_dir="runs/x")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="loggers='wandb'"):
        TrainerConfig(loggers=("csv", "wandb"))
    config = TrainerConfig(out_dir="runs/x", loggers="csv")  # type: ignore[arg-type]
    assert config.out_dir == Path("runs/x") and config.loggers == ("csv",)
    assert (config.checkpoints_kept, config.checkpoint_period_minutes) == (3, 30.0)  # the defaults, not given
    never = TrainerConfig(out_dir="runs/x", keep_checkpoints=1, checkpoint_minutes=0)
    assert (never.checkpoints_kept, never.checkpoint_period_minutes) == (1, 0.0)  # 0 is "never", not "not given"
    with pytest.raises(ConfigError, match=r"(?s)precision=.*hint: precision is a Runtime option: pass runtime="):
        TrainerConfig.build(precision="fp32")


def test_a_misspelt_value_is_refused_for_itself_before_it_is_asked_for_an_out_dir():
    # --keep-best val_los without --out said "expected it with --out DIR", and its "did you mean" only after that
    with pytest.raises(ConfigError, match=r"keep_best='val_los' is not allowed; expected one of"):
        TrainerConfig(keep_best="val_los")


@pytest.mark.parametrize("given", ["", "  ", 123, b"runs/x"])
def test_an_out_dir_that_names_no_folder_is_refused_not_read_as_the_current_one(given):
    """out_dir="" wrote the whole run (checkpoints, logs, weights) into the current folder; 123 was a TypeError,
    then refused as an empty path set by an unset shell variable."""
    with pytest.raises(ConfigError) as refused:
        TrainerConfig(out_dir=given)  # type: ignore[arg-type]
    if isinstance(given, str):
        assert str(refused.value) == (
            f"out_dir={given!r} is not allowed; expected a folder's path, not an empty one\n"
            "hint: name it; an empty value is often a shell variable that is not set"
        )
    else:
        assert str(refused.value) == (
            f"out_dir={given!r} is not allowed; expected a folder's path\n"
            f"hint: pass a str or a Path (this is of type {type(given).__name__})"
        )
    assert TrainerConfig(out_dir=Path("runs/x")).out_dir == Path("runs/x")


def test_a_logger_asked_for_by_name_needs_an_out_dir():
    with pytest.raises(ConfigError) as info:
        TrainerConfig(loggers=("csv", "tensorboard"))
    assert "logger 'tensorboard' writes its files under out_dir, and out_dir is None" in str(info.value)
    assert "\nhint: pass --out DIR" in str(info.value)
    assert TrainerConfig(loggers=("tensorboard",), out_dir="runs/x").loggers == ("tensorboard",)
    assert TrainerConfig().out_dir is None and TrainerConfig(loggers=()).loggers == ()  # nothing asked: fine
    # a default logger named alone (--logger csv) is asked for too: it wrote nothing and said nothing
    with pytest.raises(ConfigError, match="logger 'csv' writes its files under out_dir, and out_dir is None"):
        TrainerConfig(loggers=("csv",))
    assert TrainerConfig(loggers=("csv", "jsonl")).out_dir is None  # the default, spelled out
    assert TrainerConfig(loggers=("jsonl", "csv")).out_dir is None  # in either order


def test_launch_config_reads_nproc_as_text_and_checks_it():
    assert LaunchConfig(nproc="4").nproc == 4  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="nproc='many'"):
        LaunchConfig(nproc="many")
    with pytest.raises(ConfigError, match="max_restarts=-1"):
        LaunchConfig(max_restarts=-1)


# -- the command line cannot drift from the options objects -------------------------------------


def click_params(command) -> dict[str, object]:
    app = typer.Typer()
    app.command()(command)
    return {p.name: p for p in typer.main.get_command(app).params}


def cli_fields(owner: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(owner) if f.init and f.metadata.get("cli")]


@pytest.mark.parametrize("owner", [TrainerConfig, RuntimeOptions])
def test_every_field_of_the_trainer_and_runtime_is_a_train_flag_with_its_default(owner):
    params = click_params(train_cli.train)
    for field in cli_fields(owner):
        assert field.name in params, f"{owner.__name__}.{field.name} has no `redline train` flag"
        default = params[field.name].default
        default = default.value if isinstance(default, enum.Enum) else default
        default = tuple(default) if isinstance(default, list) else default  # a repeatable flag
        assert default == field.default, f"--{field.name}: default {default!r}, field {field.default!r}"
        assert params[field.name].help.startswith(field.metadata["help"].rstrip("."))  # a bound is added to it
    uncovered = [f.name for f in dataclasses.fields(owner) if f.init and not f.metadata.get("cli")]
    # nested; the launcher's job; which options were left out, which __post_init__ notes
    assert set(uncovered) <= {"runtime", "hang_timeout_s", "hang_start_timeout_s", "left_out"}


def test_every_launch_field_is_a_launch_flag_and_train_takes_the_one_machine_ones():
    launch_params, train_params = click_params(launch_command), click_params(train_cli.train)
    assert {f.name for f in cli_fields(LaunchConfig)} <= set(launch_params)
    assert {"nproc", "max_restarts", "hang_timeout_s", "hang_start_timeout_s"} <= set(train_params)
    assert train_cli.LAUNCH_OPTIONS == ("--nproc", "--max-restarts", "--hang-timeout", "--hang-start-timeout")
    assert {f"early_stopping_{f.name}" for f in cli_fields(EarlyStopping)} <= set(train_params)


def parsed_train(monkeypatch, argv: list[str]) -> dict:
    """Run the real `redline train` command with the Trainer replaced: what it receives."""
    built = {}

    class Stop(Exception):
        pass

    class FakeTrainer:
        def __init__(self, task, config, *, callbacks):
            built.update(task=task, config=config, callbacks=callbacks)

        def __enter__(self):
            raise Stop

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(train_cli, "Trainer", FakeTrainer)
    monkeypatch.setattr(task_args, "call_factory", lambda spec, factory, options: (spec, options))
    monkeypatch.delenv("RANK", raising=False)
    app = typer.Typer()
    app.command()(train_cli.train)
    with pytest.raises(Stop):
        typer.main.get_command(app).main(argv, standalone_mode=False)
    return built


def test_a_command_line_parses_into_the_options_objects(monkeypatch):
    """The real `redline train` command receives the objects the flags say."""
    argv = [
        "--task", "example:digits", "--task-arg", "width=8", "--max-steps", "7", "--epochs", "2", "--out", "runs/a",
        "--logger", "csv", "--logger", "tensorboard", "--no-progress", "--precision", "bf16-mixed",
        "--compile", "off", "--grad-accum", "2", "--seed", "4", "--deterministic", "--early-stopping-patience", "5",
        "--activation-checkpointing", "on",
    ]  # fmt: skip
    built = parsed_train(monkeypatch, argv)
    assert built["task"] == ("example:digits", {"width": 8})
    assert built["config"] == TrainerConfig(
        max_steps=7, max_epochs=2, out_dir=Path("runs/a"), loggers=("csv", "tensorboard"), progress=False,
        runtime=RuntimeOptions(
            precision="bf16-mixed", compile="off", grad_accum=2, seed=4, deterministic=True,
            activation_checkpointing="on",
        ),
    )  # fmt: skip
    assert built["callbacks"][:-1] == [EarlyStopping(patience=5)]
    assert isinstance(built["callbacks"][-1], train_cli.LastCheckpoint)  # for the message of a second Ctrl-C


def test_grad_accum_and_compile_mode_given_their_defaults_are_told_from_left_out(monkeypatch):
    # --grad-accum 1 read as left out, being the default's value, and a tuned Plan's micro-batches replaced it
    left = parsed_train(monkeypatch, ["--task", "example:digits"])["config"].runtime
    assert (left.grad_accum, left.compile_mode) == (1, "default")
    assert not left.given("grad_accum") and not left.given("compile_mode")
    given = parsed_train(monkeypatch, ["--task", "example:digits", "--grad-accum", "1", "--compile-mode", "default"])
    assert given["config"].runtime.given("grad_accum") and given["config"].runtime.given("compile_mode")
    assert RuntimeOptions(grad_accum=1).given("grad_accum") and not RuntimeOptions().given("grad_accum")
    built = RuntimeOptions.build(RuntimeOptions(), precision="bf16-mixed")  # options built from others keep them out
    assert not built.given("grad_accum") and built.given("precision") and not built.given("compile")
    assert RuntimeOptions.build(built, grad_accum=2).given("grad_accum")


def test_launch_options_are_removed_for_the_workers():
    argv = ["train", "--task", "x", "--nproc", "2", "--max-restarts=1", "--hang-timeout", "9", "--seed", "1"]
    assert train_cli.without_launch_options(argv) == ["train", "--task", "x", "--seed", "1"]


def test_micro_batch_takes_a_number_auto_or_none_and_the_command_lines_text():
    assert RuntimeOptions(micro_batch="8").micro_batch == 8  # --micro-batch 8 arrives as text
    assert RuntimeOptions(micro_batch="auto").micro_batch == "auto" and RuntimeOptions().micro_batch is None
    stored = {"device": {"value": "cpu"}, "precision": {"value": "fp32"}, "grad_accum": {"value": 1},
              "clip_grad_norm": {"value": None}, "micro_batch": {"value": None, "reason": "default"}}  # fmt: skip
    assert RuntimeOptions(micro_batch="auto").with_plan(stored).micro_batch == "auto"  # asked for now: recovery


TRAIN_DIGITS = ["train", "--task", "example:digits"]


@pytest.mark.parametrize(
    ("args", "said", "hint"),
    [
        ([*TRAIN_DIGITS, "--clip-grad-norm", "-1"], "--clip-grad-norm=-1.0", "--clip-grad-norm 1.0"),
        ([*TRAIN_DIGITS, "--micro-batch", "half"], "--micro-batch='half'", "--micro-batch auto"),
        ([*TRAIN_DIGITS, "--early-stopping-min-delta", "nan"], "--early-stopping-min-delta=nan", "-min-delta 0.0"),
        (["serve", "example:digits", "--max-wait-ms", "nan"], "--max-wait-ms=nan", "--max-wait-ms 0.0"),
        (["serve", "example:digits", "--port", "70000"], "--port=70000", "--port 0 picks any free port"),
        (["serve", "example:digits", "--timeout-ms", "inf"], "--timeout-ms=inf", "--timeout-ms 1.0"),
        (["loadtest", "http://127.0.0.1:9/", "--duration", "-1"], "--duration=-1.0", "--duration 1.0"),
        (["loadtest", "http://127.0.0.1:9/", "--duration", "inf"], "--duration=inf", "--duration 1.0"),
        (["loadtest", "http://127.0.0.1:9/", "--warmup", "inf"], "--warmup=inf", "--warmup 0.0"),
        (["launch", "--hang-timeout", "0", "script.py"], "--hang-timeout=0.0", ""),
        (["launch", "--hang-start-timeout", "60", "script.py"], "--hang-start-timeout=60.0", "add --hang-timeout S"),
        (["tune", "--task", "example:digits", "--budget", "0"], "--budget=0.0", "--budget 1.0"),
        (["bench", "--task", "example:digits", "--max-seconds", "nan"], "--max-seconds=nan", "--max-seconds 1.0"),
        (["bench", "--task", "example:digits", "--devices", "gpu"], "--devices='gpu'", ""),
        (["tune", "--task", "example:digits", "--devices", "tpu"], "--devices='tpu'", ""),
        (["memory", "--task", "example:digits", "--precision", "fp8"], "--precision='fp8'", ""),
        (["memory", "--task", "example:digits", "--precision", "fp8", "--measure"], "--precision='fp8'", "--precision"),
        (["memory", "--task", "example:digits", "--mem-gib", "inf"], "--mem-gib=inf", "--mem-gib 24"),
        (
            ["memory", "--task", "example:digits", "--gpu", "t4", "--precision", "bf16-mixed"],
            "--precision='bf16-mixed'",
            "use --precision 'fp16-mixed'",
        ),
        (["memory", "--task", "example:digits", "--attention", "cudnn"], "--attention='cudnn'", "--attention 'math'"),
        (
            ["memory", "--task", "example:digits", "--gpu", "t4", "--attention", "flash"],
            "--attention='flash'",
            "use --attention 'efficient'",
        ),
        (
            ["memory", "--task", "example:digits", "--attention", "flsh", "--measure"],
            "--attention='flsh'",
            "did you mean --attention 'flash'?",
        ),
        ([*TRAIN_DIGITS, "--precision", "bf16"], "--precision='bf16'", "did you mean --precision 'bf16-mixed'?"),
        ([*TRAIN_DIGITS, "--strategy", "ddpp"], "--strategy='ddpp'", "did you mean --strategy 'ddp'?"),
        ([*TRAIN_DIGITS, "--compile", "maybe"], "--compile='maybe'", "e.g. --compile 'auto'"),
        # a yes-or-no word is on or off, not the 'auto' its spelling is nearest
        (
            [*TRAIN_DIGITS, "--activation-checkpointing", "true"],
            "--activation-checkpointing='true'",
            "did you mean --activation-checkpointing 'on'?",
        ),
        ([*TRAIN_DIGITS, "--channels-last", "No"], "--channels-last='No'", "did you mean --channels-last 'off'?"),
        ([*TRAIN_DIGITS, "--trial", "1"], "--trial='1'", "did you mean --trial 'on'?"),
        ([*TRAIN_DIGITS, "--early-stopping-mode", "mn"], "--early-stopping-mode='mn'", "--early-stopping-mode 'min'"),
        (["loadtest", "http://127.0.0.1:9/", "--arrivals", "poison"], "--arrivals='poison'", "--arrivals 'poisson'"),
        ([*TRAIN_DIGITS, "--checkpoint-every", "5"], "--checkpoint-every=5", "add --out DIR"),
        ([*TRAIN_DIGITS, "--keep-checkpoints", "1"], "--keep-checkpoints=1", "add --out DIR"),
        ([*TRAIN_DIGITS, "--resume", "auto"], "--resume='auto'", "add --out DIR"),
        ([*TRAIN_DIGITS, "--checkpoint-minutes", "-1", "--out", "o"], "--checkpoint-minutes=-1.0", ""),
        ([*TRAIN_DIGITS, "--checkpoint-minutes", "nan", "--out", "o"], "--checkpoint-minutes=nan", ""),
        # below a derived flag's bound: the options object says it, not the parser ("Input should be >= 1")
        ([*TRAIN_DIGITS, "--max-steps", "0"], "--max-steps=0", "--max-steps 1"),
        ([*TRAIN_DIGITS, "--grad-accum", "0"], "--grad-accum=0", "--grad-accum 1"),
        ([*TRAIN_DIGITS, "--early-stopping-patience", "0"], "--early-stopping-patience=0", "-patience 1"),
        (["serve", "example:digits", "--max-batch-size", "0"], "--max-batch-size=0", "--max-batch-size 1"),
        (["launch", "--max-restarts", "-1", "script.py"], "--max-restarts=-1", "--max-restarts 0"),
    ],
)
def test_a_refused_value_is_named_by_the_flag_typed_not_the_python_field(args, said, hint):
    from typer.testing import CliRunner

    from redline.cli.main import app

    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, ConfigError), result.output
    message = str(result.exception)
    assert message.startswith(f"{said} is not allowed"), message
    assert hint in message.split("\nhint: ")[-1] if hint else True
    assert "_" not in message.split(" is not allowed")[0]  # no field name such as clip_grad_norm
    assert "None" not in message and ",\n" not in message  # a flag is left out, not set to None
    if "=inf" in said or "=nan" in said:
        assert "finite" in message  # "expected a number > 0" would not say what is wrong with infinity


def test_an_infinite_budget_is_refused_as_not_finite_not_as_not_above_zero():
    from typer.testing import CliRunner

    from redline.cli.main import app

    result = CliRunner().invoke(app, ["bench", "--task", "example:digits", "--max-seconds", "inf"])
    assert str(result.exception).startswith("--max-seconds=inf is not allowed; expected a finite number > 0")
    result = CliRunner().invoke(app, ["tune", "--task", "example:digits", "--budget", "-1"])
    assert str(result.exception).startswith("--budget=-1.0 is not allowed; expected a number > 0")


@pytest.mark.parametrize(
    ("args", "said"),
    [
        ([*TRAIN_DIGITS, "--devices", "cuda:1"], "--devices 'cuda:1' was requested"),
        ([*TRAIN_DIGITS, "--devices", "cuda", "--nproc", "2"], "--devices 'cuda' was requested"),  # before any worker
        ([*TRAIN_DIGITS, "--devices", "mps"], "--devices 'mps' was requested"),
        (["bench", "--task", "example:digits", "--devices", "cuda"], "--devices 'cuda' was requested"),
        (["tune", "--task", "example:digits", "--devices", "cuda"], "--devices 'cuda' was requested"),
        (["serve", "example:digits", "--device", "cuda", "--port", "0"], "--device 'cuda' was requested"),
        (["predict", "example:digits", "--device", "cuda", "--input", "IN", "--output", "OUT"], "--device 'cuda'"),
    ],
)
def test_a_device_this_machine_lacks_is_named_by_the_flag_typed(monkeypatch, tmp_path, args, said):
    import numpy as np
    import torch
    from typer.testing import CliRunner

    from redline.cli.main import app
    from redline.errors import DeviceUnavailableError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine with neither GPU nor MPS
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.setattr(train_cli, "launch", lambda *a, **k: pytest.fail("a worker was started"))
    np.save(tmp_path / "in.npy", np.zeros((2, 1, 8, 8), dtype=np.float32))
    args = [str(tmp_path / "in.npy") if a == "IN" else str(tmp_path / "out.npy") if a == "OUT" else a for a in args]
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, DeviceUnavailableError), result.output
    message = str(result.exception)
    assert message.startswith(said), message
    assert "devices=" not in message and "'auto'" in message.split("\nhint: ")[-1]  # the fix, said as a flag


def test_train_options_are_checked_before_any_worker_starts(monkeypatch):
    from typer.testing import CliRunner

    from redline.cli.main import app

    launched = []
    monkeypatch.setattr(train_cli, "launch", lambda *a, **k: launched.append(a))
    result = CliRunner().invoke(app, ["train", "--task", "example:digits", "--nproc", "2", "--clip-grad-norm", "0"])
    assert isinstance(result.exception, ConfigError) and "--clip-grad-norm=0.0" in str(result.exception)
    assert launched == []


def test_a_choice_shows_its_values_in_the_help():
    from typer.testing import CliRunner

    from redline.cli.main import app

    result = CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "200"})
    assert "[auto|fp32|bf16-mixed|fp16-mixed]" in result.output and "[auto|on|off]" in result.output
    assert "--logger <str>" in result.output  # a repeatable flag shows its item, not the Python type
    assert "list[" not in result.output


def test_the_record_of_options_left_out_is_not_an_option_a_user_names_or_is_offered():
    with pytest.raises(ConfigError) as refused:
        RuntimeOptions.build(None, bogus=1)
    assert "grad_accum" in str(refused.value) and "left_out" not in str(refused.value)
    with pytest.raises(ConfigError, match=r"left_out=.* is not allowed"):
        RuntimeOptions.build(None, left_out=("grad_accum",))
    with pytest.raises(ConfigError) as trainer:  # it said "left_out is a Runtime option: pass runtime=..."
        TrainerConfig.build(left_out=("grad_accum",))
    assert "left_out=('grad_accum',) is not allowed" in str(trainer.value)
    assert "Runtime option" not in str(trainer.value) and "runtime=" not in str(trainer.value)


def test_a_default_value_changed_into_options_built_from_others_is_given_as_at_their_making():
    # build(RuntimeOptions(), grad_accum=1) kept grad_accum left out, where build(None, grad_accum=1) gave it: a
    # Runtime(options, grad_accum=1) lost to a tune's micro-batches
    assert RuntimeOptions.build(RuntimeOptions(), grad_accum=1).given("grad_accum")
    assert RuntimeOptions.build(RuntimeOptions(precision="fp32"), compile_mode="default").given("compile_mode")
    kept = RuntimeOptions.build(RuntimeOptions(grad_accum=1), precision="fp32")  # built on: given stays given
    assert kept.given("grad_accum") and not kept.given("compile_mode")
    assert not RuntimeOptions.build(RuntimeOptions(grad_accum=1), grad_accum=None).given("grad_accum")
    assert not dataclasses.replace(RuntimeOptions(), grad_accum=1).given("grad_accum")  # a reset, as code makes one


def test_the_plan_says_grad_accum_1_given_was_requested():
    from redline.runtime.runtime import Runtime

    assert Runtime(RuntimeOptions(devices="cpu", grad_accum=1)).explain().grad_accum.reason == "requested"
    assert Runtime(RuntimeOptions(devices="cpu"), grad_accum=1).explain().grad_accum.reason == "requested"
    assert Runtime(RuntimeOptions(devices="cpu")).explain().grad_accum.reason == "default: a step per batch"
