"""Checks of the NVIDIA stack: driver, torch build, CUDA start-up, driver vs runtime, GPU architecture."""

from __future__ import annotations

from collections import Counter

from redline.doctor.checks.machine import (
    DRIVER_DOWNLOAD,
    HANG_FIX,
    NOT_IMPORTED,
    Machine,
    device_ranges,
    first_line,
    mentions,
)
from redline.doctor.checks.rocm import rocm_arch_supported, rocm_start_fix
from redline.doctor.checks.visible import hides_every_gpu
from redline.doctor.compat import (
    INDEX_URL,
    MINOR_COMPAT,
    arch_support,
    best_channel,
    compat_floor,
    compatible_channel,
    is_index_tag,
    min_driver,
    parse_version,
)
from redline.doctor.report import Check, fail, ok, skip, warn

# nvidia-smi itself answers a lost GPU with "Reboot the system to recover this GPU": a reset cannot reach it.
GPU_LOST_FIX = (
    "find it with `sudo dmesg | grep -i -e xid -e 'fallen off'` (Xid 79) and reboot to recover it; if it "
    "happens again, check the GPU's seating, power and cooling"
)
PERMISSION_FIX = (
    "`ls -l /dev/nvidia*` shows the group that may open them: join it (`sudo usermod -aG video $USER`, "
    "then log in again) or ask an administrator"
)
MODULE_FIX = (
    "load it with `sudo modprobe nvidia`; if that says 'Key was rejected by service', Secure Boot refuses the "
    "unsigned module: enroll the key DKMS signs it with (`sudo mokutil --import /var/lib/shim-signed/mok/MOK.der` on "
    "Ubuntu) or turn Secure Boot off; after a kernel upgrade, "
    "rebuild it with `sudo dkms autoinstall`"
)
# NVIDIA/nvidia-container-toolkit#48: systemd, reloading its units, drops the container's access to the GPUs.
DETACHED_FIX = (
    "delete the container and start it again; NVIDIA/nvidia-container-toolkit#48 gives the host's workaround "
    "that keeps it from happening again"
)
REBOOT_FIX = (
    "reboot; or, with no GPU process running, reload the driver: "
    "`sudo rmmod nvidia_uvm nvidia_drm nvidia_modeset nvidia && sudo modprobe nvidia nvidia_uvm`; "
    "then `sudo apt-mark hold` the driver packages so unattended upgrades do not do it again"
)


def nvidia_driver(m: Machine) -> Check:
    driver = m.snap.driver
    if driver.source is None:
        error = driver.error or "no answer"
        if mentions(error, "mismatch"):
            return fail("nvidia-driver", f"the kernel module and the driver library differ: {error}", REBOOT_FIX)
        if mentions(error, "hung", "no answer within"):
            return fail("nvidia-driver", f"the driver did not answer: {error}", HANG_FIX)
        if (refused := driver_refused(m, error)) is not None:
            return refused
        if driver.device_nodes and (seen := torch_sees(m)):
            detail = f"torch runs on {seen}, but NVIDIA's management library (NVML) cannot be read: {error}"
            return warn("nvidia-driver", f"{detail}; nvidia-smi and the driver's checks go without it", nvml_fix(m))
        if driver.device_nodes:
            if m.snap.system.wsl:
                step = "install the NVIDIA driver on Windows, never inside WSL (/usr/lib/wsl/lib holds its libraries)"
            elif m.snap.system.container:
                step = f"{m.container_gpus()}, which mounts the host's driver libraries into it"
            else:
                step = "install the utilities of the loaded driver (e.g. `sudo apt install nvidia-utils-<branch>`)"
            return fail(
                "nvidia-driver", f"NVIDIA device files exist but the driver library cannot be read: {error}", step
            )
        hint = f"; in a container, {m.container_gpus()}" if m.snap.system.container else ""
        return skip("nvidia-driver", f"no NVIDIA driver ({error}){hint}")
    module = driver.kernel_module_version
    if module and driver.version and module != driver.version:
        detail = f"kernel module {module} but driver library {driver.version}: upgraded without a reboot"
        return fail("nvidia-driver", detail, REBOOT_FIX)
    runs = f" (runs CUDA {driver.cuda_version} and older)" if driver.cuda_version else ""
    if not m.gpus:
        return warn(
            "nvidia-driver",
            f"driver {driver.version}{runs} lists no GPU",
            "run `nvidia-smi -L`" + (f"; {m.container_gpus()}" if m.snap.system.container else ""),
        )
    return ok("nvidia-driver", f"driver {driver.version}{runs} via {driver.source}: {m.gpu_summary()}")


def torch_sees(m: Machine) -> str:
    """The CUDA devices torch started, as "2x NVIDIA H100 80GB HBM3"; "" where it started none."""
    facts = m.torch
    if facts is None or not m.imported or not facts.cuda_available or not facts.devices:
        return ""
    counts = Counter(device.name for device in facts.devices)
    return ", ".join(f"{n}x {name}" if n > 1 else name for name, n in counts.items())


def nvml_fix(m: Machine) -> str:
    """How to get NVML beside a CUDA that works: a container given compute alone lacks the utility libraries."""
    kind = m.snap.system.container
    if kind == "apptainer":
        return "run the container with `apptainer exec --nv`, which binds nvidia-smi and libnvidia-ml too"
    if kind:  # NVIDIA_DRIVER_CAPABILITIES=compute mounts libcuda alone; `utility` adds nvidia-smi and NVML
        return (
            "start the container with `-e NVIDIA_DRIVER_CAPABILITIES=compute,utility` (or `all`), which mounts "
            "nvidia-smi and libnvidia-ml beside libcuda"
        )
    return "install the utilities of the loaded driver (e.g. `sudo apt install nvidia-utils-<branch>`)"


def driver_refused(m: Machine, error: str) -> Check | None:
    """Judge an NVML error that says why an installed driver refused to answer; None for the others.

    The texts are NVML's (nvmlErrorString, as nvidia-ml-py raises them), which nvidia-smi prints too.
    """
    if mentions(error, "GPU is lost", "fallen off the bus"):
        return fail("nvidia-driver", f"a GPU fell off the bus, so the driver lists none: {error}", GPU_LOST_FIX)
    if mentions(error, "Insufficient Permissions", "Permission denied"):
        return fail("nvidia-driver", f"you may not open NVIDIA's device files: {error}", PERMISSION_FIX)
    if mentions(error, "Driver Not Loaded") and m.snap.driver.device_nodes:
        return fail("nvidia-driver", f"the NVIDIA kernel module is not loaded: {error}", MODULE_FIX)
    if mentions(error, "Unknown Error") and m.snap.system.container and m.snap.driver.device_nodes:
        detail = f"the container lost its GPUs (a `systemctl daemon-reload` on the host detaches them): {error}"
        return fail("nvidia-driver", detail, DETACHED_FIX)
    return None


def torch_build(m: Machine) -> Check:
    facts = m.snap.torch
    if facts is None and m.snap.quick:
        error = m.snap.probe_errors.get("torch", "no reason recorded")
        return warn(
            "torch-build",
            f"--quick could not read torch's version without importing it: {first_line(error)}",
            "run `redline doctor` without --quick: it imports torch and reports what fails",
        )
    if facts is None:
        return fail("torch-build", f"importing torch in a child process {m.child_failure()}", m.child_fix())
    if facts.import_error:
        error = first_line(facts.import_error)
        if (setting := m.setting_fix(facts.import_error)) is not None:
            fix = setting
        elif mentions(error, "undefined symbol", "cannot open shared object") and (
            dirs := m.shadowing_dirs(facts.import_error)
        ):
            fix = f"{m.ld_path_without(dirs)} (it hands torch other copies of its libraries)"
        else:
            fix = reinstall_torch(m.snap.packages.get("torch"))
        return fail("torch-build", f"import torch failed: {error}", fix)
    version = facts.version
    # --quick read the build from torch/version.py: say that whether torch imports was not tried.
    read = "" if m.imported else " (read from torch/version.py: --quick does not import torch)"
    if m.build == "rocm":
        if m.gpus:
            return fail("torch-build", f"torch {version} is a ROCm build on a machine with NVIDIA GPUs", m.wheel_fix())
        return ok("torch-build", f"torch {version}: a ROCm {facts.hip} build{read}")
    if m.build == "cuda":
        archs = f" with {' '.join(facts.arch_list) or 'unknown architectures'}" if m.imported else ""
        if m.gpus:
            where = f"for {m.gpu_summary()}"
        elif seen := torch_sees(m):  # the driver's library unread (see nvidia-driver): the GPUs as torch started them
            where = f"for {seen}"
        else:
            where = "(no NVIDIA GPU here, so it runs on the CPU)"
        return ok("torch-build", f"torch {version}: a CUDA {facts.cuda} build{archs} {where}{read}")
    if m.gpus:
        detail = f"torch {version} is a CPU-only build, but the driver lists {len(m.gpus)} NVIDIA GPU(s)"
        return fail("torch-build", detail, m.wheel_fix())
    mps = " with MPS" if facts.mps_built else ""
    return ok("torch-build", f"torch {version}: a CPU-only build{mps}; no NVIDIA GPU found{read}")


def reinstall_torch(installed: str | None) -> str:
    """Return the pip command that reinstalls this torch build with the libraries it depends on.

    A local tag names the download.pytorch.org index the build comes from ("2.7.1+cu128" from
    .../whl/cu128); PyPI has no such version, so `pip install torch==2.7.1+cu128` alone finds nothing.
    """
    if installed is None:
        return "pip install --force-reinstall torch"
    version, _, tag = installed.partition("+")
    if tag and not is_index_tag(tag):  # a build of its own (NGC's "+ecf3bae40a.nv25.01", a source "+git1a2b3c")
        return (
            f"torch {installed} was not built by download.pytorch.org: reinstall it as it came (its container image, "
            "or its own build), or install an official build from https://pytorch.org/get-started/locally/"
        )
    index = f" --index-url {INDEX_URL}/{tag}" if tag else ""
    return f"pip install --force-reinstall torch=={version}{index}"


def cuda_available(m: Machine) -> Check:
    facts = m.torch
    if facts is None:
        return skip("cuda-available", "torch did not import (see torch-build)")
    if m.build == "cpu":
        if m.gpus:
            return fail(
                "cuda-available", f"torch {facts.version} is CPU-only, so it cannot use the GPUs", m.wheel_fix()
            )
        return skip("cuda-available", "no NVIDIA GPU and a CPU-only torch build")
    if not m.imported:
        return skip("cuda-available", NOT_IMPORTED)
    if facts.cuda_available is None:
        return fail("cuda-available", f"starting CUDA {m.child_failure()}", m.child_fix())
    if facts.cuda_available:
        by_name: dict[str, list[str]] = {}
        for device in facts.devices:
            by_name.setdefault(device.name, []).append(f"cuda:{device.index}")
        names = "; ".join(f"{device_ranges(ids)} {name}" for name, ids in by_name.items())
        sees = f"torch sees {facts.device_count} device(s): {names}"
        if m.snap.env.get("CUDA_LAUNCH_BLOCKING", "").strip() == "1":  # left set after a debugging session
            return warn(
                "cuda-available",
                f"{sees}; CUDA_LAUNCH_BLOCKING=1 makes every kernel launch wait for the GPU, which slows a run "
                "several times over",
                "unset CUDA_LAUNCH_BLOCKING: it is for debugging, where it makes a CUDA error name the kernel that "
                "raised it",
            )
        return ok("cuda-available", sees)
    amd = m.snap.amd
    if m.build == "rocm" and amd is not None:  # ROCm reaches AMD GPUs through /dev/kfd, not NVIDIA's files
        if not amd.kfd:
            return skip("cuda-available", "a ROCm build of torch, but no AMD GPU here (see rocm-devices)")
    elif not m.gpus and not m.snap.driver.device_nodes:
        return skip("cuda-available", f"a {m.build} build of torch, but no GPU on this machine")
    reasons = [text for text in (facts.cuda_error, *facts.warnings) if text]
    detail = "torch.cuda.is_available() is False" + (f": {first_line(reasons[0])}" if reasons else "")
    return fail("cuda-available", detail, cuda_start_fix(m, " ".join(reasons)))


def cuda_start_fix(m: Machine, text: str) -> str:
    """Name the fix for a CUDA that will not start, from what torch said (see docs/doctor.md)."""
    if m.build == "rocm":
        return rocm_start_fix(m)
    refused = driver_refused(m, m.snap.driver.error or "") if m.snap.driver.source is None else None
    if refused is not None and refused.fix:  # the driver said why first: torch's message only repeats it
        return refused.fix
    if (setting := m.setting_fix(text)) is not None:
        return setting
    if mentions(text, "too old", "insufficient"):
        return driver_upgrade_fix(m)
    if mentions(m.snap.driver.error or "", "mismatch") or mentions(text, r"\b804\b"):
        return REBOOT_FIX
    if mentions(text, r"\b802\b", "not yet initialized"):
        return (
            f"start NVIDIA Fabric Manager of the driver's version ({m.snap.driver.version}): install "
            "nvidia-fabricmanager-<branch>, then `sudo systemctl enable --now nvidia-fabricmanager`"
        )
    if mentions(text, r"\b803\b", "unsupported display driver"):
        return (
            "a CUDA forward-compatibility library (cuda-compat) does not fit this driver: drop it from LD_LIBRARY_PATH"
        )
    if mentions(text, "unknown error", r"\b999\b"):
        return (
            "reload the unified-memory module (suspend breaks it): `sudo rmmod nvidia_uvm && sudo modprobe nvidia_uvm`"
        )
    visible = m.snap.env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and hides_every_gpu(visible, m.gpus):  # a list naming real GPUs is not the cause
        return "CUDA_VISIBLE_DEVICES hides the GPUs (see visible-devices): `unset CUDA_VISIBLE_DEVICES`"
    if m.snap.system.container and not m.snap.driver.device_nodes:
        return m.container_gpus()
    return (
        "run `nvidia-smi`: if it fails, reinstall the driver or reboot; check `ls -l /dev/nvidia*` is readable by you"
    )


def driver_runtime_compat(m: Machine) -> Check:
    facts, driver = m.torch, m.snap.driver
    if facts is None or not facts.cuda:
        return skip("driver-runtime-compat", "no CUDA build of torch")
    if driver.version is None:
        return skip("driver-runtime-compat", "no NVIDIA driver found")
    runtime, have = parse_version(facts.cuda), parse_version(driver.version)
    if runtime is None or have is None:
        return skip("driver-runtime-compat", f"cannot read driver {driver.version!r} or CUDA {facts.cuda!r}")
    detail = f"driver {driver.version} for the wheel's CUDA {facts.cuda} runtime"
    need, floor = min_driver(runtime, m.windows), compat_floor(runtime[0], m.windows)
    need_v, floor_v = parse_version(need), parse_version(floor)
    if need_v is None:  # a CUDA newer than the table: trust what the driver says it runs
        if m.max_cuda is not None and m.max_cuda >= runtime[:2]:
            return ok("driver-runtime-compat", f"{detail}; the driver runs CUDA {driver.cuda_version}")
        return skip("driver-runtime-compat", f"{detail}: redline's driver table does not cover CUDA {facts.cuda}")
    if have >= need_v:
        return ok("driver-runtime-compat", f"{detail} (needs {need} or newer)")
    if floor_v is not None and have >= floor_v:
        detail += f": below the {need} it asks for, so it runs in {MINOR_COMPAT}"
        return warn("driver-runtime-compat", detail, driver_upgrade_fix(m))
    detail += f": too old, CUDA {facts.cuda} needs {need} or newer, so CUDA will not start"
    return fail("driver-runtime-compat", detail, driver_upgrade_fix(m))


def driver_upgrade_fix(m: Machine) -> str:
    """Return: upgrade the driver to what the wheel's CUDA needs, or keep it and install a wheel it runs."""
    runtime = parse_version(m.torch.cuda if m.torch else None)
    need = min_driver(runtime, m.windows) if runtime else None
    upgrade = f"upgrade the NVIDIA driver to {need or 'a newer release'} or newer ({DRIVER_DOWNLOAD})"
    channels = m.channels()[0]
    older = best_channel(m.capabilities, m.max_cuda, channels)
    if older:
        return f"{upgrade}; or keep the driver and install a wheel it runs: {m.install(older)}"
    floor, have = parse_version(compat_floor(runtime[0], m.windows) if runtime else None), m.snap.driver.version
    if floor is not None and (parse_version(have) or ()) >= floor:  # it starts this wheel: another such gains nothing
        return upgrade
    started = compatible_channel(m.capabilities, have, channels, m.windows)
    if started is None:
        return upgrade
    keep = f"keep the driver and install a wheel it starts: {m.install(started)}, {m.in_minor_compat(started)}"
    return f"{keep}; or {upgrade}"


def gpu_arch_supported(m: Machine) -> Check:
    if m.build == "rocm":
        return rocm_arch_supported(m)
    facts = m.torch
    if facts is None or not facts.cuda:
        return skip("gpu-arch-supported", "no CUDA build of torch")
    listed = [(g.name, g.capability) for g in m.gpus] or [(d.name, d.capability) for d in facts.devices]
    gpus = [(name, cap) for name, cap in listed if cap is not None]
    if not gpus:
        return skip("gpu-arch-supported", "no NVIDIA GPU with a known compute capability")
    if not m.imported:
        return skip("gpu-arch-supported", NOT_IMPORTED)
    if not facts.arch_list:
        return skip("gpu-arch-supported", "torch did not report the architectures it was built for")
    built = " ".join(facts.arch_list)
    verdicts = {f"{name} (sm_{a}{b})": arch_support(10 * a + b, facts.arch_list) for name, (a, b) in gpus}
    missing = [gpu for gpu, verdict in verdicts.items() if verdict is None]
    if missing:
        detail = f"{', '.join(missing)} not covered by the wheel's kernels ({built}): 'no kernel image is available'"
        return fail("gpu-arch-supported", detail, m.wheel_fix())
    jit = [gpu for gpu, verdict in verdicts.items() if verdict == "ptx"]
    if jit:
        detail = f"{', '.join(jit)} runs the wheel's PTX ({built}), compiled by the driver at start-up: slow first run"
        return warn("gpu-arch-supported", detail, m.wheel_fix())
    return ok("gpu-arch-supported", f"{', '.join(sorted(set(verdicts)))} covered by the wheel's kernels ({built})")
