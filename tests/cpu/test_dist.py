"""Distributed training on CPU with gloo: 2 processes equal 1, resume across world sizes, restarts, 2 nodes."""

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from redline.errors import ConfigError
from redline.launch.torchrun import LaunchConfig, processes_per_node, torchrun_args

JOB = str(Path(__file__).with_name("dist_job.py"))
STEPS = 10
# DDP averages per-rank gradients where one process sums the global batch at once: the same numbers,
# added in another order. Measured: 6e-8 after 10 AdamW steps.
ATOL = 1e-6


def launch(*args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "redline", "launch", *args], capture_output=True, text=True, timeout=timeout
    )


def alone(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, JOB, str(out), *args], capture_output=True, text=True, timeout=120)


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "model.safetensors")


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=0, atol=ATOL), f"{name}: {(a[name] - b[name]).abs().max():.3g}"


def manifest(checkpoint: Path) -> dict:
    import json

    return json.loads((checkpoint / "manifest.json").read_text())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("one")
    result = alone(out, str(STEPS))
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("two")
    result = launch("--nproc", "2", JOB, str(out), str(STEPS), "--evaluate")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count(f"done steps={STEPS}") == 2
    return out


def test_two_processes_give_the_weights_and_metrics_of_one(one_process, two_processes):
    assert_close(weights(two_processes), weights(one_process))
    import json

    one = json.loads((one_process / "summary.json").read_text())
    two = json.loads((two_processes / "summary.json").read_text())
    assert two["plan"]["strategy"]["value"] == "ddp" and one["plan"]["strategy"]["value"] == "single"
    # 41 validation samples over 2 ranks: each counted exactly once, so the loss is the same
    assert two["val_loss"] == pytest.approx(one["val_loss"], abs=1e-6)
    # each rank saw half of every global batch; the job's count is the whole: the same as one process's
    assert two["samples"] == one["samples"] == STEPS * 16
    assert two["epochs"] == one["epochs"]


def test_evaluate_after_fit_counts_each_sample_once_over_the_ranks(two_processes):
    import json

    found = {rank: json.loads((two_processes / f"evaluate-rank{rank}.json").read_text()) for rank in (0, 1)}
    assert {rank: result["samples"] for rank, result in found.items()} == {0: 20, 1: 21}  # 41, each rank its share
    summary = json.loads((two_processes / "summary.json").read_text())
    assert all(result["val_loss"] == pytest.approx(summary["val_loss"], abs=1e-6) for result in found.values())


def test_resume_from_two_processes_on_one(tmp_path, one_process):
    assert launch("--nproc", "2", JOB, str(tmp_path), "6").returncode == 0
    resumed = alone(tmp_path, str(STEPS), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert_close(weights(tmp_path), weights(one_process))


def test_resume_from_one_process_on_two(tmp_path, one_process):
    assert alone(tmp_path, "6").returncode == 0
    resumed = launch("--nproc", "2", JOB, str(tmp_path), str(STEPS), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_close(weights(tmp_path), weights(one_process))


def test_a_killed_worker_is_restarted_and_the_job_completes(tmp_path, two_processes):
    result = launch(
        "--nproc", "2", "--max-restarts", "1", JOB, str(tmp_path), str(STEPS), "--kill-rank", "1", "--kill-step", "6"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "SIGKILL" in result.stderr or "Signals.SIGKILL" in result.stderr or "exitcode" in result.stderr
    assert_close(weights(tmp_path), weights(two_processes))


def test_a_killed_fsdp_worker_is_restarted_from_its_sharded_checkpoint(tmp_path, one_process):
    result = launch(
        "--nproc", "2", "--max-restarts", "1", JOB, str(tmp_path), str(STEPS), "--kill-rank", "1", "--kill-step", "6",
        "--strategy", "fsdp",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count(f"done steps={STEPS}") == 2
    assert_close(weights(tmp_path), weights(one_process))


def test_two_nodes_on_loopback_train_together(tmp_path, two_processes):
    port = str(free_port())
    node = ["--nproc", "1", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port]
    second = subprocess.Popen(
        [sys.executable, "-m", "redline", "launch", *node, "--node-rank", "1", JOB, str(tmp_path), str(STEPS)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = launch(*node, "--node-rank", "0", JOB, str(tmp_path), str(STEPS))
        out, err = second.communicate(timeout=120)
    finally:
        second.kill()
    assert first.returncode == 0, first.stderr[-3000:]
    assert second.returncode == 0, err[-3000:]
    assert "rank 1 done" in out and "rank 0 done" in first.stdout
    assert_close(weights(tmp_path), weights(two_processes))


@pytest.fixture(scope="module")
def one_process_20(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("one-20")
    result = alone(out, "20")
    assert result.returncode == 0, result.stderr
    return out


@pytest.mark.parametrize(
    ("strategy", "pacing", "stops_at"),
    [
        # No log point before the signal: the ranks vote every step. Rank 0 signals the launcher in
        # step 6's forward; all stop at the step that reads a stop vote: 7 (rank 0's vote of step 6),
        # or 6 when rank 1, still finishing step 5, got the signal before it voted.
        ("ddp", ["--log-every", "50", "--checkpoint-every", "50"], (6, 7)),
        # Steps of 70 ms, logged every step: from step 1 on the ranks vote every 2 steps (0.2 s / 70 ms),
        # at 2, 4, 6, 8, so the stop comes at the vote after the one that says stop: 8. (On a loaded
        # machine a step may pass 100 ms: then they vote every step, and stop at 6 or 7 as above.)
        ("fsdp", ["--log-every", "1", "--checkpoint-every", "50", "--step-sleep", "0.07"], (6, 7, 8)),
    ],
)
def test_sigterm_to_the_launcher_stops_every_rank_at_one_step_with_a_checkpoint(
    tmp_path, one_process_20, strategy, pacing, stops_at
):
    import re

    args = [JOB, str(tmp_path), "20", "--strategy", strategy, *pacing]
    stopped = launch("--nproc", "2", *args, "--term-launcher-step", "6")
    assert stopped.returncode == 128 + 15, stopped.stderr[-3000:]
    assert "stopped by SIGTERM" in stopped.stderr and "resume='auto'" in stopped.stderr  # a script of its own
    # (the two ranks' lines may interleave in the shared pipe: match each on its own)
    steps = re.findall(r"rank \d done steps=(\d+) val_loss=\S+ stopped=signal \(agreed by all ranks\)", stopped.stdout)
    assert len(steps) == 2 and steps[0] == steps[1] and int(steps[0]) in stops_at, stopped.stdout
    assert manifest(tmp_path / "checkpoints" / f"step-{int(steps[0]):08d}")["step"] == int(steps[0])
    resumed = launch("--nproc", "2", *args, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_close(weights(tmp_path), weights(one_process_20))


def test_a_checkpoint_one_ranks_clock_calls_for_is_written_by_every_rank_at_the_same_step(tmp_path, one_process_20):
    # Under FSDP every rank writes its shards: had rank 1 gone to checkpoint alone, the job would hang.
    # Steps of 70 ms, so the ranks vote every 2 steps once paced: a checkpoint at several steps before the end.
    args = [JOB, str(tmp_path), "20", "--strategy", "fsdp", "--checkpoint-every", "100", "--step-sleep", "0.07"]
    done = launch("--nproc", "2", *args, "--rank1-checkpoint-minutes", "1e-9", "--keep", "100")
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [int(path.name.removeprefix("step-")) for path in sorted((tmp_path / "checkpoints").glob("step-*"))]
    assert len(steps) >= 3 and steps[-1] == 20, steps  # some before the last step, every one whole
    assert manifest(tmp_path / "checkpoints" / f"step-{steps[0]:08d}")["step"] == steps[0]
    assert_close(weights(tmp_path), weights(one_process_20))  # checkpoints taken along the way change nothing


def test_a_launch_stopped_by_a_signal_leaves_no_rendezvous_thread_to_abort_its_exit(tmp_path):
    # torchrun keeps its rendezvous open when a signal stops the agent, with a thread that sends
    # keep-alives through the store every 5 s; alive at the interpreter's exit, one in a store call
    # aborted the launcher (SIGABRT, "terminate called without an active exception") instead of 143.
    worker = tmp_path / "worker.py"
    worker.write_text(
        "import os, signal, time\n"
        "if os.environ['LOCAL_RANK'] == '0':\n"
        "    os.kill(os.getppid(), signal.SIGTERM)\n"
        "time.sleep(60)\n"
    )
    driver = (
        "import threading\n"
        "from redline.launch.torchrun import LaunchConfig, LaunchStopped, launch\n"
        "try:\n"
        f"    launch(LaunchConfig(nproc=2), [{str(worker)!r}])\n"
        "except LaunchStopped as exc:\n"
        "    print('stopped', exc.exit_code)\n"
        "print('threads', sorted(t.name for t in threading.enumerate()))\n"
    )
    done = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "stopped 143" in done.stdout, done.stdout + done.stderr[-3000:]
    assert "threads ['MainThread']" in done.stdout, done.stdout


def test_a_script_that_never_closes_its_runtime_leaves_the_group_at_exit(tmp_path):
    script = tmp_path / "no_close.py"
    script.write_text(
        "import atexit, torch.distributed as dist, redline\n"
        # atexit runs last-registered first: this check runs after the Runtime's own handler
        "atexit.register(lambda: print(f'group at exit: {dist.is_initialized()}', flush=True))\n"
        "rt = redline.Runtime(devices='cpu').start()\n"
        "print(f'group: {dist.is_initialized()}', flush=True)\n"
    )
    result = launch("--nproc", "2", str(script))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("group: True") == 2 and result.stdout.count("group at exit: False") == 2


def test_a_second_runtime_in_the_same_workers_joins_a_working_group(tmp_path):
    script = tmp_path / "two_runtimes.py"
    script.write_text(
        "import torch, torch.distributed as dist, redline\n"
        "for attempt in range(2):\n"
        "    with redline.Runtime(devices='cpu'):\n"
        "        total = torch.ones(1)\n"
        "        dist.all_reduce(total)\n"
        "        print(f'group {attempt}: {total.item():.0f}', flush=True)\n"
    )
    result = launch("--nproc", "2", str(script), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("group 0: 2") == 2 and result.stdout.count("group 1: 2") == 2


def test_a_batch_that_does_not_split_names_the_fix(tmp_path):
    result = launch("--nproc", "2", JOB, str(tmp_path), "2", "--batch", "15")
    assert result.returncode != 0
    assert "own batch_size=15 is not allowed under 2 processes; expected a multiple of 2" in result.stderr
    assert "hint: pass --batch-size 16 (batch_size=16), or the task's own option for it" in result.stderr


def test_an_error_every_worker_meets_is_printed_once(tmp_path):
    # the task's own batch: the launcher does not load the task, so the workers are the first to see it (a
    # --batch-size 15 is refused before they start, tests/unit/test_cli_refusals.py)
    result = subprocess.run(
        [sys.executable, "-m", "redline", "train", "--task", "example:digits", "--max-steps", "2", "--nproc", "2",
         "--task-arg", "batch_size=15", "--no-progress"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    # named as the task's own (it said --batch-size=15, a flag never passed)
    said = "task 'digits''s own batch_size=15 is not allowed under 2 processes; expected a multiple of 2"
    assert result.stderr.count(said) == 1, result.stderr[-3000:]
    assert "hint: pass --batch-size 16 (batch_size=16), or the task's own option for it" in result.stderr
    assert "the workers' errors are printed above, each once" in result.stderr


# A script's first lines that print its threads at exit: registered first, the hook runs last (after redline's own)
THREADS_AT_EXIT = (
    "import atexit, os\n"
    "def threads():\n"
    "    names = [open(f'/proc/self/task/{t}/comm').read().strip() for t in os.listdir('/proc/self/task')]\n"
    "    os.write(2, f'threads at exit: {sorted(names)}\\n'.encode())\n"
    "atexit.register(threads)\n"
)


def assert_no_gloo_thread_at_exit(tmp_path: Path, body: str, status: int) -> None:
    """Launch ``body`` on 2 workers and check each exits with ``status``, no gloo thread alive at its exit."""
    script = tmp_path / "script.py"
    script.write_text(THREADS_AT_EXIT + body)
    result = launch("--nproc", "2", str(script))
    assert result.returncode == status, result.stderr[-3000:]
    at_exit = [line for line in result.stderr.splitlines() if line.startswith("threads at exit:")]
    assert len(at_exit) == 2, result.stderr[-3000:]
    assert not [line for line in at_exit if "gloo" in line], at_exit


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads the process's threads from /proc")
def test_a_worker_that_fails_leaves_no_gloo_thread_for_the_interpreters_exit(tmp_path):
    # The refused batch's error held the worker's DDP model in its frames, and the model the process group:
    # gloo's threads outlived the interpreter, which then ended by SIGABRT now and then, not with status 2.
    body = (
        "import sys\n"
        "sys.argv = ['redline', 'train', '--task', 'example:digits', '--max-steps', '2', '--task-arg',\n"
        "            'batch_size=15', '--no-progress']\n"
        "from redline.cli.main import main\n"
        "main()\n"
    )
    assert_no_gloo_thread_at_exit(tmp_path, body, status=2)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads the process's threads from /proc")
def test_a_loop_whose_ddp_model_outlives_the_runtime_leaves_no_gloo_thread_for_the_interpreters_exit(tmp_path):
    # The DDP model, held by the loop's frame as its Runtime left the group, kept the group (in cycles once the frame
    # was gone): freed by the interpreter's final collection, gloo's threads ended in it, and it aborted now and then.
    body = (
        "import torch, redline\n"
        "def main():\n"
        "    with redline.Runtime(devices='cpu', compile='off', strategy='ddp') as rt:\n"
        "        model, optimizer = rt.setup(torch.nn.Linear(4, 2), lambda p: torch.optim.SGD(p, lr=0.1))\n"
        "        rt.train_step(lambda batch: model(batch).sum(), torch.ones(2, 4))\n"
        "        rt.step(optimizer)\n"
        "main()\n"
    )
    assert_no_gloo_thread_at_exit(tmp_path, body, status=0)


def test_the_workers_get_their_share_of_the_cores_as_threads(tmp_path):
    import os

    script = tmp_path / "threads.py"
    script.write_text(  # one write: the two workers share the launcher's stdout
        "import os, torch\n"
        "os.write(1, f\"threads {os.environ['OMP_NUM_THREADS']} {torch.get_num_threads()}\\n\".encode())\n"
    )
    share = max(1, len(os.sched_getaffinity(0)) // 2)
    result = launch("--nproc", "2", str(script))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count(f"threads {share} {share}") == 2, result.stdout
    assert "Setting OMP_NUM_THREADS" not in result.stderr  # torchrun's banner: redline said what it chose
    chosen = subprocess.run(
        [sys.executable, "-m", "redline", "launch", "--nproc", "2", str(script)],
        capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "3"},
    )  # fmt: skip
    assert chosen.stdout.count("threads 3 ") == 2, chosen.stdout + chosen.stderr[-2000:]  # torch caps it at the cores


def test_torchrun_arguments():
    assert torchrun_args(LaunchConfig(), 2, ["train.py", "--lr", "1"]) == [
        "--nproc-per-node=2", "--max-restarts=0", "--standalone", "train.py", "--lr", "1"
    ]  # fmt: skip
    two_nodes = LaunchConfig(nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29500, max_restarts=3)
    assert torchrun_args(two_nodes, 8, ["-c", "x"], module=False)[:6] == [
        "--nproc-per-node=8", "--max-restarts=3", "--nnodes=2", "--node-rank=1", "--master-addr=10.0.0.1",
        "--master-port=29500",
    ]  # fmt: skip
    assert "--rdzv-conf=timeout=930" in torchrun_args(two_nodes, 8, ["t.py"])  # after --join-timeout's own end
    rdzv = torchrun_args(LaunchConfig(nnodes=2, rdzv_endpoint="host:29400"), 1, ["redline", "train"], module=True)
    assert "--rdzv-conf=join_timeout=930" in rdzv
    assert "--rdzv-endpoint=host:29400" in rdzv and rdzv[-3:] == ["--module", "redline", "train"]
    assert processes_per_node("auto", 8) == (8, "auto: one process per visible GPU (8)")
    assert processes_per_node("auto", 0)[0] == 1


def test_a_master_addr_alone_on_one_machine_is_used_with_the_default_port():
    """It was dropped for a local rendezvous on a free port, so the workers met on another address than asked."""
    args = torchrun_args(LaunchConfig(master_addr="10.0.0.7"), 2, ["train.py"])
    assert args[2:6] == ["--nnodes=1", "--node-rank=0", "--master-addr=10.0.0.7", "--master-port=29500"]
    assert "--standalone" not in args
    from redline.launch.torchrun import _rendezvous_failure

    error = _rendezvous_failure(LaunchConfig(master_addr="10.0.0.7"), OSError("EADDRINUSE"))
    assert "rendezvous at 10.0.0.7:29500 could not be set up" in str(error)
    assert "pass a free one to --master-port" in str(error)


def test_one_machine_hosts_the_rendezvous_at_its_own_endpoint_and_others_may_host_it():
    """With --nnodes 1 no other machine can host the store, so a port taken is an error rather than a wait."""
    assert "--rdzv-conf=is_host=1" in torchrun_args(LaunchConfig(rdzv_endpoint="127.0.0.1:29400"), 2, ["t.py"])
    assert "--rdzv-conf=is_host=1" in torchrun_args(LaunchConfig(rdzv_endpoint="localhost:29400"), 2, ["t.py"])
    several = torchrun_args(LaunchConfig(nnodes=2, rdzv_endpoint="127.0.0.1:29400"), 1, ["t.py"])
    assert not any("is_host" in arg for arg in several)  # two launchers here: either one hosts it
    from torch.distributed import DistNetworkError
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    from redline.launch.torchrun import _rendezvous_failure

    wrapped = RendezvousConnectionError("The connection to the C10d store has failed. See inner exception.")
    wrapped.__cause__ = DistNetworkError("The server socket has failed to listen: EADDRINUSE, address already in use")
    message = str(_rendezvous_failure(LaunchConfig(rdzv_endpoint="127.0.0.1:29400"), wrapped))
    assert "could not be set up: The server socket has failed to listen: EADDRINUSE" in message
    assert "hint: another process holds that port: pass a free one to --rdzv-endpoint" in message


def test_bad_launch_options_say_what_is_missing():
    with pytest.raises(ConfigError, match="--node-rank --master-addr --master-port"):
        LaunchConfig(nnodes=2)
    with pytest.raises(ConfigError, match="HOST:PORT"):
        LaunchConfig(rdzv_endpoint="nohost")
    with pytest.raises(ConfigError, match="nproc"):
        LaunchConfig(nproc=0)
    with pytest.raises(ConfigError, match=r"master_port=70000 is not allowed; expected a port number, 0\.\.65535"):
        LaunchConfig(master_port=70000)
    with pytest.raises(ConfigError, match="--master-addr and --rdzv-endpoint each say where the workers meet"):
        LaunchConfig(nnodes=2, master_addr="10.0.0.1", rdzv_endpoint="host:29400")  # the address was dropped
    with pytest.raises(ConfigError, match=r"PORT 0\.\.65535"):
        LaunchConfig(nnodes=2, rdzv_endpoint="host:99999")


def test_port_0_for_a_job_on_several_machines_is_refused_as_each_would_take_its_own():
    """Before, node 0 waited for minutes on a port of its own choosing that no other machine could know."""
    with pytest.raises(ConfigError, match=r"master_port=0 is not allowed; expected a fixed port \(1\.\.65535\) for "
                       r"--nnodes 2\nhint: port 0 picks a free port on each machine"):  # fmt: skip
        LaunchConfig(nnodes=2, node_rank=0, master_addr="10.0.0.1", master_port=0)
    with pytest.raises(ConfigError, match=r"rdzv_endpoint='head:0' is not allowed.*\n.*e\.g\. --rdzv-endpoint HOST"):
        LaunchConfig(nnodes=3, rdzv_endpoint="head:0")
    assert LaunchConfig(master_port=0).master_port == 0  # one machine: any free port will do, as before
    assert LaunchConfig(nnodes=2, rdzv_endpoint="head:10").rdzv_endpoint == "head:10"


def test_a_script_that_does_not_exist_is_named_before_any_worker_starts(tmp_path):
    result = launch("--nproc", "2", str(tmp_path / "nosuch.py"), timeout=60)
    assert result.returncode == 2
    assert "nosuch.py' does not exist" in result.stderr and "hint:" in result.stderr
    assert "Traceback" not in result.stderr and "exitcode" not in result.stderr  # no worker was started


def test_a_directory_with_a_main_runs_as_python_runs_it_and_one_without_is_named(tmp_path):
    """Before, a directory was said not to exist, and one with a __main__.py (which python and torchrun run) refused."""
    app = tmp_path / "app"
    app.mkdir()
    (app / "__main__.py").write_text("import os\nprint('main of rank', os.environ['RANK'])\n")
    result = launch("--nproc", "1", str(app), timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "main of rank 0" in result.stdout
    (app / "__main__.py").rename(app / "train.py")
    result = launch("--nproc", "1", str(app), timeout=60)
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"script {str(app)!r} is a directory without a __main__.py" in result.stderr
    assert f"hint: pass one of its Python files ({app / 'train.py'})" in result.stderr
    assert "exitcode" not in result.stderr  # no worker was started


def test_every_argument_after_the_script_is_the_scripts_own(tmp_path):
    """A script's own -m, --nproc or --hang-timeout were taken as the launcher's, or refused by torchrun's parser."""
    script = tmp_path / "argv.py"
    script.write_text("import os, sys\nif os.environ['RANK'] == '0':\n    print('argv', sys.argv[1:])\n")
    result = launch("--nproc", "1", str(script), "--lr", "1", "-m", "resnet", "--nproc", "3", "--hang-timeout", "5")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "argv ['--lr', '1', '-m', 'resnet', '--nproc', '3', '--hang-timeout', '5']" in result.stdout


def test_a_failed_job_exits_with_the_failing_workers_exit_code(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(3)\ntime.sleep(60)\n")
    result = launch("--nproc", "2", str(script), timeout=60)
    assert result.returncode == 3, result.stderr[-3000:]
    assert "rank 1 exited with 3 (then the launcher stopped rank 0)" in result.stderr
    assert "printed above" not in result.stderr  # nothing was: the hint says what the exit code tells instead
    assert "hint: no error of redline's was printed: rank 1's exit code 3 is the script's own" in result.stderr
    assert "closing signal" not in result.stderr, result.stderr  # torchrun's agent's narration of the stop


def test_a_master_addr_of_another_machine_for_one_machine_is_named_by_its_flag_before_any_worker_waits(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    result = launch("--nproc", "2", "--master-addr", "203.0.113.7", str(script), timeout=60)  # TEST-NET-3
    assert result.returncode == 2, result.stderr[-3000:]
    assert "error: --master-addr='203.0.113.7' is not allowed; expected an address or host name of this machine" in (
        result.stderr
    )
    assert "hello" not in result.stdout and "TCPStore" not in result.stderr  # no worker started, none waited


def test_master_port_0_on_one_machine_meets_on_a_free_port(tmp_path):
    """torchrun handed the workers MASTER_PORT=0, and they waited for a store there until it timed out (30 min)."""
    script = tmp_path / "join.py"
    script.write_text(
        "import torch.distributed as dist\ndist.init_process_group('gloo')\nprint('joined', flush=True)\n"
    )
    result = launch("--nproc", "2", "--master-port", "0", str(script), timeout=90)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("joined") == 2
    args = torchrun_args(LaunchConfig(master_addr="10.0.0.7", master_port=0), 2, ["t.py"])
    assert "--rdzv-endpoint=10.0.0.7:0" in args and not any(a.startswith("--master-port") for a in args)


def test_a_master_port_in_use_is_a_clear_error_not_a_traceback(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = launch("--nproc", "1", "--master-port", str(port), str(script), timeout=60)
        # One machine meeting at a c10d endpoint whose port another process holds: torchrun alone waited as a
        # client of that process, in silence, for its whole rendezvous timeout (over ten minutes).
        endpoint = launch("--nproc", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", str(script), timeout=60)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"127.0.0.1:{port}" in result.stderr and "address already in use" in result.stderr
    assert "hint: another process holds that port" in result.stderr
    assert endpoint.returncode == 2 and "Traceback" not in endpoint.stderr, endpoint.stderr[-3000:]
    assert f"rendezvous at 127.0.0.1:{port} could not be set up: " in endpoint.stderr
    assert "address already in use" in endpoint.stderr  # torch's inner reason, not "see inner exception"
    assert "hint: another process holds that port: pass a free one to --rdzv-endpoint" in endpoint.stderr


def test_a_rendezvous_that_cannot_reach_node_0_says_what_to_check():
    from torch.distributed.elastic.rendezvous import RendezvousTimeoutError

    from redline.launch.torchrun import _rendezvous_failure

    two_nodes = LaunchConfig(nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29500)
    error = _rendezvous_failure(two_nodes, RendezvousTimeoutError("timed out waiting for the other nodes"))
    assert str(error) == (
        "the workers' rendezvous at 10.0.0.1:29500 could not be set up: timed out waiting for the other nodes\n"
        "hint: check that the node-rank 0 machine is up and that 10.0.0.1:29500 is reachable from here"
    )


def test_a_stalled_rank_is_named_by_the_hang_watchdog(tmp_path):
    import time

    start = time.monotonic()
    result = launch(
        "--nproc", "2", "--hang-timeout", "5", JOB, str(tmp_path), "20",
        "--kill-rank", "1", "--kill-step", "5", "--sleep", "120",
    )  # fmt: skip
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert elapsed < 60, f"the job took {elapsed:.0f} s; the watchdog should end it within the timeout plus a few s"
    assert "rank 1 stopped at step 5" in result.stderr, result.stderr[-3000:]
    assert "error: hang: rank 1 stopped at step 5" in result.stderr  # said as every error is, not "HangError: ..."
    assert result.stderr.count("hang: rank 1 stopped at step 5") == 1  # by the launcher; rank 0 printed it too
    assert (tmp_path / "hang.txt").is_file() and (tmp_path / "hang-rank1.txt").is_file()
    assert "on_step" in (tmp_path / "hang-rank1.txt").read_text()  # rank 1's own stack shows where it sleeps


def test_train_nproc_1_with_ddp_runs_the_launched_path(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "redline", "train", "--task", "example:digits", "--max-steps", "3", "--nproc", "1",
         "--strategy", "ddp", "--json", "--no-progress", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    import json

    summary = json.loads(result.stdout)
    assert summary["plan"]["strategy"]["value"] == "ddp" and summary["steps"] == 3
    assert not any(name.startswith("module.") for name in weights(tmp_path))  # saved unwrapped


TINY_GPT = ["--task", "example:chargpt", "--task-arg", "n_layer=2", "--task-arg", "n_embd=32", "--task-arg", "n_head=2",
            "--task-arg", "block_size=16", "--task-arg", "batch_size=8", "--task-arg", "max_chars=20000"]  # fmt: skip


def train_json(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "redline", "train", *TINY_GPT, "--max-steps", "4", "--json", "--no-progress",
         "--seed", "0", "--log-every", "1", *args],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip


def test_fsdp_through_the_trainer_matches_ddp():
    import json

    runs = {}
    for strategy in ("fsdp", "ddp"):
        result = train_json("--nproc", "2", "--strategy", strategy)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[strategy] = json.loads(result.stdout)
    fsdp, ddp = runs["fsdp"], runs["ddp"]
    assert fsdp["plan"]["strategy"]["value"] == "fsdp" and ddp["plan"]["strategy"]["value"] == "ddp"
    assert fsdp["final_loss"] == pytest.approx(ddp["final_loss"], abs=1e-5)
    assert fsdp["val_loss"] == pytest.approx(ddp["val_loss"], abs=1e-5)
    assert fsdp["sample"] and fsdp["sample"] == ddp["sample"]


def test_the_plan_states_the_split_and_what_it_changes():
    import json

    result = train_json("--nproc", "2", "--task-arg", "dropout=0.1", "--max-steps", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    loader = json.loads(result.stdout)["plan"]["loader"]["reason"]
    assert "global batch 8 = 2 x 4" in loader and "dropout draws from each rank's own random stream" in loader


def test_fsdp_checkpoints_resume_from_two_processes_on_one(tmp_path, one_process):
    first = launch("--nproc", "2", JOB, str(tmp_path), "6", "--strategy", "fsdp")
    assert first.returncode == 0, first.stderr[-3000:]
    written = sorted((tmp_path / "checkpoints").glob("step-*"))
    assert [p.name for p in written] == ["step-00000004", "step-00000006"]
    assert manifest(written[-1])["format"] == "redline-sharded-2" and manifest(written[-1])["world_size"] == 2
    assert (written[-1] / "plan.json").is_file() and (written[-1] / "__1_0.distcp").is_file()
    resumed = alone(tmp_path, str(STEPS), "--resume")  # one process, no process group: an unsharded model
    assert resumed.returncode == 0, resumed.stderr
    assert_close(weights(tmp_path), weights(one_process))


def test_a_truncated_shard_is_skipped_for_the_checkpoint_before(tmp_path, one_process):
    assert launch("--nproc", "2", JOB, str(tmp_path), "6", "--strategy", "fsdp").returncode == 0
    shard = tmp_path / "checkpoints" / "step-00000006" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-8])  # rank 1's node lost the end of its write
    resumed = launch("--nproc", "2", JOB, str(tmp_path), str(STEPS), "--strategy", "fsdp", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "skipping a corrupt checkpoint" in resumed.stderr
    assert "__1_0.distcp is truncated" in resumed.stderr
    assert resumed.stderr.count("skipping a corrupt checkpoint") == 1  # said by rank 0, not by each rank
    assert_close(weights(tmp_path), weights(one_process))  # resumed from step 4 instead: the same run


def test_fsdp_checkpoints_resume_from_one_process_on_two(tmp_path, one_process):
    first = launch("--nproc", "1", JOB, str(tmp_path), "6", "--strategy", "fsdp")
    assert first.returncode == 0, first.stderr[-3000:]
    assert manifest(tmp_path / "checkpoints" / "step-00000006")["world_size"] == 1
    resumed = launch("--nproc", "2", JOB, str(tmp_path), str(STEPS), "--strategy", "fsdp", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # the final weights are gathered from the 2 ranks' shards into one file, as the unsharded run writes them
    assert_close(weights(tmp_path), weights(one_process))


def test_a_whole_checkpoint_resumes_under_fsdp_on_two(tmp_path, one_process):
    assert alone(tmp_path, "6").returncode == 0  # one process: whole weights and optimizer state
    resumed = launch("--nproc", "2", JOB, str(tmp_path), str(STEPS), "--strategy", "fsdp", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert manifest(tmp_path / "checkpoints" / "step-00000010")["format"] == "redline-sharded-2"
    assert_close(weights(tmp_path), weights(one_process))


def test_fsdp_writes_a_gpt_whose_tied_weights_load_into_the_plain_model(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_model

    from redline.cli.task_args import load_given_task

    result = train_json("--nproc", "2", "--strategy", "fsdp", "--out", str(tmp_path), "--checkpoint-every", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    task = load_given_task("example:chargpt", TINY_GPT[3::2])
    model = task.build_model()
    load_model(model, str(tmp_path / "model.safetensors"), strict=True)  # wte and lm_head: one tensor, both names
    assert model.lm_head.weight is model.wte.weight
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as handle:
        assert handle.metadata()["wte.weight"] == "lm_head.weight"  # the alias noted as save_model notes it
    assert [p.name for p in sorted((tmp_path / "checkpoints").glob("step-*"))] == ["step-00000002", "step-00000004"]


def test_launch_help_names_the_script_and_its_arguments():
    """Before, the usage read `launch [OPTIONS] {target}`, naming neither the script nor its own arguments."""
    result = launch("--help", timeout=60)
    assert result.returncode == 0, result.stderr
    usage = " ".join(result.stdout.split())  # as wrapped at any width
    assert "launch [OPTIONS] {SCRIPT}" in usage and "target" not in usage
    assert "every argument after it is the script's own" in usage


def test_a_machine_whose_others_never_join_ends_after_the_join_timeout_naming_the_fix(tmp_path):
    """Before, node 0 waited 15 minutes in silence, then told itself to check that node rank 0 was up; node 1 alone
    printed a C++ error and stack after 15 minutes, then retried for ever."""
    import time

    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    command = [sys.executable, "-m", "redline", "launch", "--nproc", "1", "--nnodes", "2", "--join-timeout", "3"]
    started = time.monotonic()
    where = ["--master-addr", "127.0.0.1"]
    alone = {
        rank: subprocess.Popen(
            [*command, "--node-rank", rank, *where, "--master-port", str(free_port()), str(script)],
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in ("0", "1")
    }
    try:
        said = {rank: process.communicate(timeout=60)[1] for rank, process in alone.items()}
    finally:
        for process in alone.values():
            process.kill()
    assert time.monotonic() - started < 40
    for rank, process in alone.items():
        assert process.returncode == 2, said[rank][-3000:]
        assert f"(node rank {rank}) waits for the other machine of --nnodes 2 at 127.0.0.1:" in said[rank]
        assert "up to 3 s (--join-timeout)" in said[rank]
        waited = f"(node rank {rank}) waited 3 s (--join-timeout) for the other machine of --nnodes 2, which did not"
        assert waited in said[rank]
        assert "all with the same --nnodes, --master-addr and --master-port" in said[rank]
        assert "frame #" not in said[rank] and "Traceback" not in said[rank] and "hello" not in said[rank]
    assert "check that node rank 0 runs" in said["1"] and "node rank 0 machine is up" not in said["0"]


@pytest.mark.parametrize(("node_rank", "stop"), [("0", "SIGINT"), ("1", "SIGINT"), ("0", "SIGTERM")])
def test_ctrl_c_stops_a_launcher_waiting_for_the_other_machines(tmp_path, node_rank, stop):
    """Before, Ctrl-C did nothing while torchrun's store waited for the others: the launcher sat there for minutes;
    and SIGTERM ended it at once, without a word, its temporary directory left behind."""
    import signal
    import time

    signum = signal.Signals[stop]

    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    where = ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    command = [sys.executable, "-m", "redline", "launch", "--nproc", "1", "--nnodes", "2", "--node-rank", node_rank]
    waiting = subprocess.Popen([*command, *where, str(script)], stderr=subprocess.PIPE, text=True)
    try:
        assert waiting.stderr is not None
        said = waiting.stderr.readline()
        while "waits for the other machine of --nnodes 2" not in said:  # torch may log before it
            assert said, "the launcher ended without saying what it waits for"
            said = waiting.stderr.readline()
        time.sleep(2)  # inside torchrun's wait by now
        waiting.send_signal(signum)
        _, rest = waiting.communicate(timeout=30)
    finally:
        waiting.kill()
    assert waiting.returncode == 128 + signum, rest[-3000:]
    assert f"stopped by {stop} while waiting for the other machines of --nnodes 2: no worker had started" in rest
    assert "hello" not in rest


def test_predict_loads_the_weights_of_a_two_process_fsdp_checkpoint_in_one_process(tmp_path):
    import numpy as np
    from typer.testing import CliRunner

    from redline.cli.main import app

    assert launch("--nproc", "2", JOB, str(tmp_path / "run"), "6", "--strategy", "fsdp").returncode == 0
    step = tmp_path / "run" / "checkpoints" / "step-00000006"
    assert not (step / "model.safetensors").exists() and (step / "__1_0.distcp").is_file()
    (tmp_path / "mlp.py").write_text(
        "from torch import nn\nfrom redline.serve.servable import Servable\n\n\ndef make():\n"
        "    return Servable(model=nn.Sequential(nn.Linear(10, 24), nn.Tanh(), nn.Linear(24, 4)), input_shape=(10,))\n"
    )
    np.save(tmp_path / "x.npy", np.random.default_rng(0).normal(size=(5, 10)).astype(np.float32))
    outputs = {}
    for name, weights in (("checkpoint", step), ("final", tmp_path / "run" / "model.safetensors")):
        result = CliRunner().invoke(app, ["predict", f"{tmp_path / 'mlp.py'}:make", "--input", str(tmp_path / "x.npy"),
                                          "--output", str(tmp_path / f"{name}.npy"), "--weights", str(weights),
                                          "--precision", "fp32", "--compile", "off"])  # fmt: skip
        assert result.exit_code == 0, result.output
        outputs[name] = np.load(tmp_path / f"{name}.npy")
    np.testing.assert_array_equal(outputs["checkpoint"], outputs["final"])  # the run's last step, gathered alike
