"""Other work on the CPUs a trial times: read from /proc (hardware/contention.py), said in the Plan, measured again."""

import pytest
from test_trial import measured, tiny_task  # the same tiny task, and a trial's numbers

from redline.errors import ConfigError
from redline.hardware import contention
from redline.hardware.contention import ENV, Contention, Sampler, Stalls
from redline.parallel.env import DistEnv
from redline.runtime import measure
from redline.runtime.measure import measure_auto, measure_run
from redline.runtime.options import RuntimeOptions


class Machine:
    """A fake /proc of two CPUs (and a third this process may not run on), whose counts the test moves on."""

    def __init__(self, root):
        self.root, self.now = root, 0.0
        (root / "proc/self").mkdir(parents=True)
        self.busy = {0: 1000, 1: 2000, 2: 0}
        self.own = 500
        self.write()

    def write(self):
        lines = ["cpu  9 9 9 9 9 9 9 9 0 0"]  # the total line: not counted (it holds the CPU this process cannot use)
        lines += [f"cpu{n} {b} 0 0 777 5 0 0 0 0 0" for n, b in self.busy.items()]
        (self.root / "proc/stat").write_text("\n".join([*lines, "intr 1 2 3", "procs_running 3"]) + "\n")
        fields = ["S", *["0"] * 10, str(self.own), "0", *["0"] * 30]  # utime (field 14) holds all: stime 0
        (self.root / "proc/self/stat").write_text(f"42 (py thon) ) {' '.join(fields)}\n")

    def run(self, seconds, *, own_cores, other_cores, elsewhere=0.0):
        """``seconds`` pass: this process keeps ``own_cores`` busy, other work ``other_cores`` of its two CPUs, and
        ``elsewhere`` of the third."""
        ticks = seconds * 100
        self.busy[0] += round((own_cores + other_cores) * ticks / 2)
        self.busy[1] += round((own_cores + other_cores) * ticks / 2)
        self.busy[2] += round(elsewhere * ticks)
        self.own += round(own_cores * ticks)
        self.now += seconds
        self.write()

    def sampler(self):
        return Sampler(root=self.root, clock=lambda: self.now, cpus={0, 1})


@pytest.fixture
def machine(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)  # the suite turns the check off: these tests are of the check
    monkeypatch.setattr(contention, "_ticks_per_second", lambda: 100)
    return Machine(tmp_path)


def test_other_work_on_the_processs_cpus_is_counted_and_on_others_is_not(machine):
    sampler = machine.sampler().start()
    machine.run(2.0, own_cores=2.0, other_cores=0.0, elsewhere=1.0)  # a quiet machine; the third CPU busy: not ours
    quiet = sampler.stop(threads=2)
    assert quiet == Contention(others=0.0, cpus=2, threads=2) and not quiet.contended
    sampler = machine.sampler().start()
    machine.run(2.0, own_cores=0.4, other_cores=1.6)  # three other processes squeezed ours
    busy = sampler.stop(threads=2)
    assert busy is not None and busy.others == pytest.approx(1.6) and busy.contended
    assert str(busy) == "other processes kept 1.6 of the 2 CPU(s) it may run on busy"


def test_a_neighbour_on_a_cpu_the_process_does_not_need_takes_nothing_from_it(machine):
    sampler = machine.sampler().start()
    machine.run(2.0, own_cores=1.0, other_cores=1.0)  # one thread here, one process beside it (xdist's other worker)
    found = sampler.stop(threads=1)
    assert found is not None and found.others == pytest.approx(1.0) and not found.contended
    assert Contention(others=1.0, cpus=2, threads=2).contended  # two threads would have wanted that CPU


def test_nothing_is_known_from_too_short_an_interval_unreadable_counts_or_with_the_check_off(machine, monkeypatch):
    sampler = machine.sampler().start()
    machine.run(0.4, own_cores=0.0, other_cores=2.0)  # 80 ticks: too coarse to tell
    assert sampler.stop(threads=2) is None
    (machine.root / "proc/stat").write_text("cpu0 garbage\n")
    assert machine.sampler().read() is None
    machine.write()
    assert machine.sampler().read() is not None
    monkeypatch.setenv(ENV, "off")
    assert machine.sampler().read() is None
    assert Sampler(root=machine.root / "nowhere").start().stop(threads=2) is None


def test_the_processs_children_and_their_children_are_counted_as_its_own_work_and_others_not(machine):
    def process(pid, parent, ticks):  # a /proc/PID/stat of a process that ran ``ticks`` (utime alone)
        (machine.root / f"proc/{pid}").mkdir(exist_ok=True)
        fields = ["R", str(parent), *["0"] * 9, str(ticks), "0", "0", "0", *["0"] * 30]
        (machine.root / f"proc/{pid}/stat").write_text(f"{pid} (row (1)) {' '.join(fields)}\n")

    for pid, parent in ((42, 1), (43, 42), (44, 43), (99, 1)):  # this process, a row, its compile worker, a stranger
        process(pid, parent, 0)
    sampler = machine.sampler().start()
    machine.run(2.0, own_cores=0.0, other_cores=2.0)  # both CPUs busy: 400 ticks, none of them this process's own
    for pid, ticks in ((43, 250), (44, 100), (99, 50)):
        process(pid, 42 if pid == 43 else 43 if pid == 44 else 1, ticks)
    found = sampler.stop(threads=2)
    assert found is not None and found.others == pytest.approx(0.25)  # the stranger's 50 ticks, of 200 a CPU


@pytest.fixture
def busy_then_quiet(tmp_path, monkeypatch):
    """Plan as on an AMX CPU, fake the trial (bf16 at 0.7 of fp32), and the machine: the first trial's CPUs shared
    with other work (1.6 of 2), every later one's quiet. Returns the trials run."""
    monkeypatch.setenv("REDLINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("REDLINE_CPU", "amx")
    trials = []

    def fake_trial(model, optimizer, loss_fn, batch, device, candidates, **_):
        trials.append(candidates)
        return [measured("fp32", 10.0), measured("bf16-mixed", 7.0)]

    class FakeSampler:
        def start(self):
            return self

        def stop(self, threads):
            others = 1.6 if len(trials) == 1 else 0.0
            return Contention(others=others, cpus=2, threads=threads)

    monkeypatch.setattr(measure, "run_trial", fake_trial)
    monkeypatch.setattr(measure, "Sampler", FakeSampler)
    return trials


def test_a_trial_on_a_busy_machine_says_so_and_the_next_run_that_repays_one_measures_again(busy_then_quiet):
    def run(planned):
        options = RuntimeOptions(devices="cpu")
        return measure_run(tiny_task(), options, 16, planned, DistEnv(), trial="auto")[0]["precision"]

    note = "; measured while other processes kept 1.6 of the 2 CPU(s) it may run on busy, so a run that repays a trial"
    first = run(1000)
    assert first.value == "bf16-mixed" and first.reason.endswith(f"{note} measures again")
    short = run(50)  # too short to measure: takes the busy verdict, and says how it was measured
    assert f"{note} measures again; cached from " in short.reason and len(busy_then_quiet) == 1
    again = run(1000)  # repays a trial: measures on the (now quiet) machine
    assert len(busy_then_quiet) == 2 and "measured while" not in again.reason and "cached" not in again.reason
    quiet = run(1000)  # the quiet verdict is final
    assert len(busy_then_quiet) == 2 and "cached from" in quiet.reason and "measured while" not in quiet.reason


def test_a_trial_whose_load_could_not_be_read_leaves_an_earlier_busy_note_standing(busy_then_quiet, monkeypatch):
    def run(trial):
        return measure_auto(tiny_task(), RuntimeOptions(devices="cpu"), 16, 1000, DistEnv(), trial=trial)["precision"]

    assert "measured while" in run("auto").reason
    monkeypatch.setattr(measure.Sampler, "stop", lambda self, threads: None)  # too short to tell, or no /proc
    assert "measured while" not in run("fresh").reason and len(busy_then_quiet) == 2
    run("auto")  # the fresh trial was not known to be quiet: the busy note stands, and a run that repays one measures
    assert len(busy_then_quiet) == 3


def test_stalls_read_the_share_of_an_interval_in_which_tasks_waited_for_a_cpu(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    pressure, now = tmp_path / "proc/pressure/cpu", [10.0]
    pressure.parent.mkdir(parents=True)

    def waited(total_us: int) -> None:
        pressure.write_text(f"some avg10=1.00 avg60=0.50 avg300=0.10 total={total_us}\nfull avg10=0 total=0\n")

    waited(5_000_000)
    stalls = Stalls(root=tmp_path, clock=lambda: now[0]).start()
    now[0] += 0.05
    waited(5_000_000 + 25_000)  # 25 ms of the 50 ms: another process's loop on one of two CPUs
    assert stalls.stop() == pytest.approx(0.5)
    stalls = Stalls(root=tmp_path, clock=lambda: now[0]).start()
    now[0] += 0.05
    assert stalls.stop() == 0.0  # nothing waited: a quiet machine
    pressure.unlink()  # no PSI (not Linux, or a kernel without it): nothing known
    assert Stalls(root=tmp_path, clock=lambda: now[0]).start().stop() is None
    waited(1)
    monkeypatch.setenv(ENV, "off")
    assert Stalls(root=tmp_path, clock=lambda: now[0]).start().stop() is None


def test_stalls_count_the_intervals_they_are_entered_for_and_read_the_processs_own_cgroup(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text("1:cpu:/\n0::/user.slice/job.scope\n")
    own = tmp_path / "sys/fs/cgroup/unified/user.slice/job.scope/cpu.pressure"  # a hybrid system's v2 mount
    own.parent.mkdir(parents=True)
    (tmp_path / "proc/pressure").mkdir()
    (tmp_path / "proc/pressure/cpu").write_text("some avg10=0.00 total=0\n")  # the machine's: not read
    now, total = [0.0], [1_000]

    def moves(seconds: float, waited_us: int) -> None:
        now[0] += seconds
        total[0] += waited_us
        own.write_text(f"some avg10=0.00 avg60=0.00 avg300=0.00 total={total[0]}\nfull avg10=0 total=0\n")

    moves(0.0, 0)
    stalls = Stalls(root=tmp_path, clock=lambda: now[0])
    assert stalls.file == own and stalls.share() is None  # nothing counted yet
    with stalls.counting():
        moves(0.1, 10_000)  # a tenth of the timed round waited
    moves(5.0, 4_000_000)  # a compile between the rounds, its workers waiting: not counted
    with stalls.counting():
        moves(0.1, 30_000)
    assert stalls.share() == pytest.approx(0.2)
    (tmp_path / "proc/self/cgroup").write_text("0::/\n")  # the root group, which keeps no file of its own here
    assert Stalls(root=tmp_path).file == tmp_path / "proc/pressure/cpu"


@pytest.mark.parametrize(("value", "off"), [("off", True), ("OFF", True), ("on", False), ("", False)])
def test_the_switch_reads_off_and_on_and_refuses_anything_else(monkeypatch, value, off):
    # REDLINE_CONTENTION=bogus was read as on, without a word
    monkeypatch.setenv(ENV, value)
    assert contention.contention_off() is off
    monkeypatch.setenv(ENV, "bogus")
    with pytest.raises(ConfigError, match=r"REDLINE_CONTENTION='bogus' is not allowed; expected off or on"):
        contention.contention_off()
