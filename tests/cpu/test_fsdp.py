"""FSDP2 on CPU over gloo, 2 processes: the weights of DDP and of one process, and sharded checkpoints
that resume on another number of ranks exactly as the unbroken run continues.

The distributed runs are this file run as a script (``python test_fsdp.py PHASE RANK WORLD DIR``), one
process a rank, meeting through a FileStore in the test's directory. Three launches, in order:
"two" (2 ranks), "one" (1 rank: the plain references and the 2 -> 1 resume), "resume" (2 ranks: the
1 -> 2 and 2 -> 2 resumes, and a narrower GPT refusing the checkpoints). Rank 0 writes each run's full
weights to DIR/NAME.pt for the tests to compare.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from redline.checkpoint import CheckpointError, prune, read_checkpoint, step_dir, verify
from redline.checkpoint.sharded import _check_visible, load_sharded, save_sharded
from redline.errors import ConfigError, RedlineError
from redline.examples.gpt import GPT, GPTConfig
from redline.parallel.collectives import gather_objects
from redline.parallel.fsdp import mixed_precision_policy, shard
from redline.runtime.checkpointing import apply_checkpointing, find_blocks
from redline.runtime.strategy.fsdp import FSDP
from redline.runtime.strategy.single import SingleDevice

STEPS = 6  # optimizer steps of every run
SAVE_AT = 3  # the checkpoint the resumed runs start from
BATCH = 8  # the global batch; each of W ranks takes a contiguous 8 / W rows of it
GPT_CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
# fp32 throughout. On two ranks FSDP2 and DDP agree bitwise: both average two gradients (a halving and
# one sum, exact in any order). One process takes the batch mean in another order, a few ulps away, and
# AdamW magnifies those ulps on the attention's key bias, whose true gradient is zero (softmax ignores a
# shift shared by all keys): 4e-5 measured there, under 5e-7 on every other weight.
ATOL_ACROSS_WORLD_SIZES = 1e-4


# -- the workloads, the same in every process ----------------------------------------------------


def make_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPT_CONFIG)


def make_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3))


def gpt_loss(model: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    logits = model(rows[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())


def mlp_loss(model: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(rows[:, :12]), rows[:, 12].long())


def global_batch(kind: str, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    if kind == "gpt":
        return torch.randint(0, GPT_CONFIG.vocab_size, (BATCH, GPT_CONFIG.block_size + 1), generator=gen)
    return torch.cat([torch.randn(BATCH, 12, generator=gen), torch.randint(0, 3, (BATCH, 1), generator=gen)], 1)


def adamw(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    # Adam's step barely depends on the gradient's scale: SGD catches a gradient mean taken wrong.
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


Workload = tuple[
    Callable[[], nn.Module],
    Callable[[nn.Module, torch.Tensor], torch.Tensor],
    Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
]
WORKLOADS: dict[str, Workload] = {"gpt": (make_gpt, gpt_loss, adamw), "mlp": (make_mlp, mlp_loss, sgd)}


def train(
    kind: str, model: nn.Module, optimizer: torch.optim.Optimizer, start: int, stop: int, precision: str = "fp32"
) -> list[float]:
    """Run steps [start, stop): each rank its contiguous share of the global batch, the mean loss."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    loss_fn = WORKLOADS[kind][1]
    losses = []
    for step in range(start, stop):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            loss = loss_fn(model, global_batch(kind, step).chunk(world)[rank])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def save(root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    extra = {"step": step}
    save_sharded(step_dir(root, step), model, optimizer, runtime_state={}, extra=extra, plan={}, step=step)


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Verify the checkpoint at ``path`` against its manifest, load it, and return its extra state."""
    checkpoint = read_checkpoint(path)
    verify(checkpoint)
    return load_sharded(checkpoint, model, optimizer)[1]


def shard_with_optimizer(
    model: nn.Module, optimizer: torch.optim.Optimizer, precision: str
) -> tuple[nn.Module, torch.optim.Optimizer]:
    return FSDP().wrap(model, optimizer, device=torch.device("cpu"), precision=precision)  # type: ignore[arg-type]


def full_weights(model: nn.Module) -> dict[str, Any]:
    """Return the unsharded weights on rank 0 (empty elsewhere): gathered from FSDP, unwrapped from DDP."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


# -- the phases a launch runs --------------------------------------------------------------------


def fsdp_run(
    kind: str,
    out: Path,
    name: str,
    *,
    save_to: Path | None = None,
    resume: Path | None = None,
    checkpointed: bool = False,
) -> None:
    make_model, _, make_optimizer = WORKLOADS[kind]
    model = make_model()
    calls: list[int] = []  # a checkpointed block starts its layers' forward again in the backward
    if checkpointed:
        apply_checkpointing(model, find_blocks(model))
        model.get_submodule("blocks.0.mlp").register_forward_pre_hook(lambda *_: calls.append(1))
    model = shard(model, precision="fp32")
    optimizer = make_optimizer(model.parameters())  # built on the sharded parameters
    start = 0
    if resume is not None:
        start = int(load(resume, model, optimizer)["step"])
    if save_to is not None:
        train(kind, model, optimizer, start, SAVE_AT)
        save(save_to, SAVE_AT, model, optimizer)
        publish(full_weights(model), out / f"{name}-at-save.pt")
        start = SAVE_AT
    train(kind, model, optimizer, start, STEPS)
    publish(full_weights(model), out / f"{name}.pt")
    if checkpointed:
        publish({"calls": len(calls)}, out / f"{name}-calls.pt")


def ddp_run(kind: str, out: Path) -> None:
    make_model, _, make_optimizer = WORKLOADS[kind]
    model = DistributedDataParallel(make_model())
    train(kind, model, make_optimizer(model.parameters()), 0, STEPS)
    publish(full_weights(model), out / f"{kind}-ddp.pt")


def plain_run(kind: str, out: Path) -> None:
    make_model, _, make_optimizer = WORKLOADS[kind]
    model = make_model()
    train(kind, model, make_optimizer(model.parameters()), 0, STEPS)
    publish(model.state_dict(), out / f"{kind}-plain.pt")


def bf16_run(how: str, out: Path) -> None:
    """Train the GPT in bf16-mixed under autocast, FSDP2's policy or DDP; record losses and dtypes."""
    gpt = make_gpt()
    model = shard(gpt, precision="bf16-mixed") if how == "fsdp" else DistributedDataParallel(gpt)
    seen: set[str] = set()  # the dtype of a weight while its forward runs
    gpt.get_submodule("blocks.0.mlp.c_fc").register_forward_pre_hook(
        lambda module, args: seen.add(str(module.weight.dtype))
    )
    losses = train("gpt", model, adamw(model.parameters()), 0, STEPS, precision="bf16-mixed")
    stored = sorted({str(p.dtype) for p in model.parameters()})
    publish({"losses": losses, "stored": stored, "computed": sorted(seen)}, out / f"gpt-bf16-{how}.pt")


def rebuilt_optimizer_run(out: Path) -> None:
    gpt = make_gpt()
    given = adamw(gpt.parameters())  # built before sharding, as a user passes it
    model, optimizer = shard_with_optimizer(gpt, given, precision="fp32")
    sharded = {id(p) for p in model.parameters()}
    assert optimizer is not given and all(id(p) in sharded for p in optimizer.param_groups[0]["params"])
    assert optimizer.defaults["weight_decay"] == 0.1
    train("gpt", model, optimizer, 0, STEPS)
    publish(full_weights(model), out / "gpt-fsdp-rebuilt.pt")


def whole_run(out: Path) -> None:
    """Write the GPT's whole checkpoint (one device's format) for the mismatch run to load under FSDP."""
    model = make_gpt()
    SingleDevice().save(out / "whole" / "step-00000001", model, adamw(model.parameters()), runtime_state={},
                        extra={}, plan={}, step=1)  # fmt: skip


def mismatch_run(out: Path) -> None:
    """Load the GPT's sharded and whole checkpoints into a narrower sharded GPT; publish every rank's error."""
    model, optimizer = shard_with_optimizer(GPT(replace(GPT_CONFIG, n_embd=16)), adamw, precision="fp32")
    errors = {}
    paths = {"sharded": out / "ckpt-2" / f"step-{SAVE_AT:08d}", "whole": out / "whole" / "step-00000001"}
    for format, path in paths.items():
        try:
            FSDP().load(read_checkpoint(path), model, optimizer)
            errors[format] = [f"rank {dist.get_rank()} loaded it"]
        except RedlineError as exc:  # no rank may go on into the load while another one refused
            errors[format] = gather_objects(f"{type(exc).__name__}: {exc}")
    publish(errors, out / "gpt-mismatch.pt")


def publish(result: dict[str, Any], path: Path) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(result, path)


def run_phase(phase: str, out: Path) -> None:
    if phase == "two":
        fsdp_run("gpt", out, "gpt-fsdp-2", save_to=out / "ckpt-2")
        fsdp_run("gpt", out, "gpt-fsdp-2-checkpointed", checkpointed=True)
        ddp_run("gpt", out)
        fsdp_run("mlp", out, "mlp-fsdp-2")
        ddp_run("mlp", out)
        rebuilt_optimizer_run(out)
        bf16_run("fsdp", out)
        bf16_run("ddp", out)
    elif phase == "one":
        plain_run("gpt", out)
        plain_run("mlp", out)
        whole_run(out)
        fsdp_run("gpt", out, "gpt-fsdp-1", save_to=out / "ckpt-1")
        fsdp_run("gpt", out, "gpt-resumed-2to1", resume=out / "ckpt-2" / f"step-{SAVE_AT:08d}")
    elif phase == "resume":
        fsdp_run("gpt", out, "gpt-resumed-1to2", resume=out / "ckpt-1" / f"step-{SAVE_AT:08d}")
        fsdp_run("gpt", out, "gpt-resumed-2to2", resume=out / "ckpt-2" / f"step-{SAVE_AT:08d}")
        mismatch_run(out)


def worker(phase: str, rank: int, world: int, out: Path, store: Path) -> None:
    torch.set_num_threads(1)  # two ranks share two cores
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        run_phase(phase, out)
    finally:
        # FSDP modules sit in reference cycles: freed by the interpreter's last collection, they release
        # gloo work from gloo's threads after Python stopped handing out the GIL, and the process aborts
        # ("terminate called without an active exception", ~5% of runs on torch 2.13). Collect them now.
        gc.collect()
        dist.destroy_process_group()


def launch(phase: str, world: int, out: Path, timeout_s: float = 300) -> None:
    """Run ``phase`` on ``world`` ranks; fail with the ranks' stderr; never leave a child behind."""
    logs = [out / f"{phase}-{rank}.log" for rank in range(world)]
    store = out / f"store-{uuid.uuid4().hex}"  # a FileStore file left by an earlier launch would mislead
    procs = []
    try:
        for rank in range(world):
            with open(logs[rank], "w") as log:
                # -u: unbuffered, so a rank killed at the deadline shows how far it got
                cmd = [sys.executable, "-u", __file__, phase, str(rank), str(world), str(out), str(store)]
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if all(code == 0 for code in codes) or any(code not in (None, 0) for code in codes):
                break  # done, or one rank failed and the others would wait for it forever
            time.sleep(0.05)
    finally:
        late = [p for p in procs if p.poll() is None]  # still running at the deadline: killed, said so below
        for p in procs:
            if p in late:
                p.kill()
            p.wait()
    codes = [p.returncode for p in procs]
    if codes != [0] * world:
        tails = "\n".join(f"--- rank {r} (exit {c}):\n{logs[r].read_text()[-3000:]}" for r, c in enumerate(codes))
        timed_out = f" (killed after {timeout_s:.0f} s)" if late else ""
        raise AssertionError(f"phase {phase!r} failed{timed_out}:\n{tails}")


# -- the tests -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fsdp")
    for phase, world in (("two", 2), ("one", 1), ("resume", 2)):
        launch(phase, world, out)
    return out


def weights(runs: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(runs / f"{name}.pt", weights_only=True)


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_activation_checkpointing_under_fsdp_recomputes_and_trains_to_the_same_weights(runs: Path) -> None:
    assert weights(runs, "gpt-fsdp-2-checkpointed-calls") == {"calls": 2 * STEPS}  # each step's forward, then again
    assert max_difference(weights(runs, "gpt-fsdp-2-checkpointed"), weights(runs, "gpt-fsdp-2")) == 0.0


@pytest.mark.parametrize("kind", ["gpt", "mlp"])
def test_fsdp_trains_to_the_weights_of_ddp_and_of_one_process(runs: Path, kind: str) -> None:
    fsdp, ddp, plain = (weights(runs, f"{kind}-{how}") for how in ("fsdp-2", "ddp", "plain"))
    assert max_difference(fsdp, ddp) == 0.0
    assert max_difference(fsdp, plain) <= ATOL_ACROSS_WORLD_SIZES
    initial = WORKLOADS[kind][0]().state_dict()
    assert max_difference(fsdp, initial) > 1e-2  # it trained


def test_bf16_mixed_fsdp_computes_in_bf16_and_tracks_ddp_under_autocast(runs: Path) -> None:
    fsdp, ddp = (torch.load(runs / f"gpt-bf16-{how}.pt", weights_only=True) for how in ("fsdp", "ddp"))
    # The policy all-gathers bf16 weights for the forward; the sharded fp32 parameters stay the master copy.
    assert fsdp["computed"] == ["torch.bfloat16"] and fsdp["stored"] == ["torch.float32"]
    # Under autocast, the loss is taken in fp32 either way: its steps agree far below a bf16 ulp of 4 (0.03).
    assert max(abs(a - b) for a, b in zip(fsdp["losses"], ddp["losses"], strict=True)) < 3e-3


def test_gpt_keeps_its_tied_weights_under_fsdp(runs: Path) -> None:
    fsdp = weights(runs, "gpt-fsdp-2")
    assert torch.equal(fsdp["lm_head.weight"], fsdp["wte.weight"])


@pytest.mark.parametrize(("resumed", "unbroken"), [("2to1", "gpt-fsdp-2"), ("1to2", "gpt-fsdp-1")])
def test_a_sharded_checkpoint_resumes_on_another_number_of_ranks(runs: Path, resumed: str, unbroken: str) -> None:
    assert max_difference(weights(runs, f"gpt-resumed-{resumed}"), weights(runs, unbroken)) <= ATOL_ACROSS_WORLD_SIZES


def test_a_sharded_checkpoint_resumes_on_the_same_ranks_bitwise(runs: Path) -> None:
    assert max_difference(weights(runs, "gpt-resumed-2to2"), weights(runs, "gpt-fsdp-2")) == 0.0


def test_a_sharded_checkpoint_loads_into_a_plain_model_without_a_process_group(runs: Path) -> None:
    model = make_gpt()
    optimizer = adamw(model.parameters())
    extra = load(runs / "ckpt-2" / f"step-{SAVE_AT:08d}", model, optimizer)
    assert extra == {"step": SAVE_AT}
    assert max_difference(model.state_dict(), weights(runs, "gpt-fsdp-2-at-save")) == 0.0
    assert all(int(state["step"]) == SAVE_AT for state in optimizer.state.values())


def test_a_checkpoint_of_another_model_is_refused_on_every_rank(runs: Path) -> None:
    errors = torch.load(runs / "gpt-mismatch.pt", weights_only=True)
    differs = "the checkpoint's model differs from this run's model: shapes differ: wte.weight ([64, 32] in the "
    differs += "checkpoint, [64, 16] in this model), wpe.weight ([16, 32] in the checkpoint, [16, 16] in this model)"
    sharded, whole = runs / "ckpt-2" / f"step-{SAVE_AT:08d}", runs / "whole" / "step-00000001"
    assert len(errors["sharded"]) == 2, errors  # each rank refuses it on its own, before DCP's collective load
    assert all(e.startswith(f"ModelMismatch: {sharded}: {differs}") for e in errors["sharded"]), errors
    rank_0, rank_1 = errors["whole"]  # rank 0 alone reads a whole checkpoint, and tells the others
    assert rank_0.startswith(f"ModelMismatch: {whole}: {differs}") and "hint: this run's model is not" in rank_0
    assert rank_1.startswith("RankZeroError: reading the whole checkpoint failed on rank 0") and differs in rank_1


def test_an_optimizer_built_before_sharding_is_rebuilt_and_trains_the_same(runs: Path) -> None:
    assert max_difference(weights(runs, "gpt-fsdp-rebuilt"), weights(runs, "gpt-fsdp-2")) == 0.0


def test_an_uncommitted_checkpoint_is_refused(runs: Path, tmp_path: Path) -> None:
    model = make_gpt()
    with pytest.raises(CheckpointError, match="manifest"):
        load(tmp_path, model, adamw(model.parameters()))
    assert not list((runs / "ckpt-2").glob(".tmp-*")), "the temporary directory was left behind"


def test_sharded_checkpoints_keep_the_newest_and_refuse_a_truncated_shard(tmp_path: Path) -> None:
    model = make_mlp()  # one process, no process group: DCP writes a single shard
    optimizer = sgd(model.parameters())
    train("mlp", model, optimizer, 0, 1)
    for step in (1, 2, 3):
        save(tmp_path, step, model, optimizer)
        prune(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000003"]
    shard_file = next((tmp_path / "step-00000003").glob("*.distcp"))
    shard_file.write_bytes(shard_file.read_bytes()[:-1])
    with pytest.raises(CheckpointError, match="truncated"):
        load(tmp_path / "step-00000003", model, optimizer)


def test_a_flipped_bit_inside_a_shard_is_caught_by_its_checksum(tmp_path: Path) -> None:
    model = make_mlp()
    optimizer = sgd(model.parameters())
    train("mlp", model, optimizer, 0, 1)
    save(tmp_path, 1, model, optimizer)
    manifest = read_checkpoint(tmp_path / "step-00000001").manifest
    assert all(len(entry["sha256"]) == 64 for entry in manifest["files"].values()), manifest
    shard_file = next((tmp_path / "step-00000001").glob("*.distcp"))
    blob = bytearray(shard_file.read_bytes())
    blob[len(blob) // 2] ^= 0x01  # one bit, the size unchanged
    shard_file.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match=rf"{shard_file.name} does not match its checksum"):
        load(tmp_path / "step-00000001", model, optimizer)


def test_a_shard_that_rank_0_cannot_see_is_not_committed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from redline.checkpoint import sharded

    def rank_1_wrote_elsewhere(mine: Any) -> list[Any]:  # rank 1's node-local disk holds a shard rank 0 lacks
        return [mine, ({"__1_0.distcp": 6}, {})]

    monkeypatch.setattr(sharded, "gather_objects", rank_1_wrote_elsewhere)
    model = make_mlp()
    with pytest.raises(CheckpointError, match=r"rank 1 wrote __1_0\.distcp.*every rank shares"):
        save(tmp_path, 1, model, sgd(model.parameters()))
    assert not (tmp_path / "step-00000001").exists()
    assert not (tmp_path / ".tmp-step-00000001" / "manifest.json").exists()
    _check_visible(tmp_path, {"__1_0.distcp": 6}, [{"__1_0.distcp": 6}])  # a shared file system: nothing to say


def test_a_checkpoint_before_the_first_step_leaves_the_run_unchanged(tmp_path: Path) -> None:
    runs = []
    for saved in (False, True):
        model = make_gpt()
        optimizer = adamw(model.parameters())
        if saved:  # DCP steps a stateless optimizer once to give it state to save; the run must not see it
            save(tmp_path, 0, model, optimizer)
        train("gpt", model, optimizer, 0, 2)
        runs.append(model.state_dict())
    assert max_difference(*runs) == 0.0


def test_a_checkpoint_before_the_first_step_resumes_as_the_unbroken_run(tmp_path: Path) -> None:
    model = make_gpt()
    optimizer = adamw(model.parameters())
    save(tmp_path, 0, model, optimizer)
    train("gpt", model, optimizer, 0, 2)
    resumed = make_gpt()
    resumed_optimizer = adamw(resumed.parameters())
    load(step_dir(tmp_path, 0), resumed, resumed_optimizer)
    # DCP's placeholder step (Adam's count at 1) must not come back: the first step would be Adam's second
    assert not resumed_optimizer.state
    train("gpt", resumed, resumed_optimizer, 0, 2)
    assert max_difference(resumed.state_dict(), model.state_dict()) == 0.0


def test_the_state_of_an_optimizer_before_its_first_step_leaves_the_run_unchanged() -> None:
    runs = []
    for taken in (False, True):
        model = make_gpt()
        optimizer = adamw(model.parameters())
        if taken:
            FSDP().state_dict(model, optimizer)
        train("gpt", model, optimizer, 0, 2)
        runs.append(model.state_dict())
    assert max_difference(*runs) == 0.0


def test_mixed_precision_maps_onto_fsdp2s_policy() -> None:
    bf16, fp16 = mixed_precision_policy("bf16-mixed"), mixed_precision_policy("fp16-mixed")
    assert bf16 is not None and (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert fp16 is not None and (fp16.param_dtype, fp16.reduce_dtype) == (torch.float16, torch.float32)
    assert mixed_precision_policy("fp32") is None
    with pytest.raises(ConfigError, match="precision='bf16'"):
        mixed_precision_policy("bf16")  # type: ignore[arg-type]


def test_an_optimizer_that_has_stepped_is_refused_before_the_model_changes() -> None:
    model = make_mlp()
    optimizer = sgd(model.parameters())
    train("mlp", model, optimizer, 0, 1)
    with pytest.raises(ConfigError, match="already holds state"):
        shard_with_optimizer(model, optimizer, precision="fp32")
    assert not isinstance(model[0].weight, DTensor)


def test_sharding_without_a_process_group_says_how_to_start_one() -> None:
    with pytest.raises(ConfigError, match="redline launch"):
        shard(make_mlp(), precision="fp32")


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), Path(sys.argv[5]))
