"""ROCm's checks: can this process open the device files a ROCm build of torch needs (rocm-devices), and
has the wheel kernels for each AMD GPU's target (gpu-arch-supported under a ROCm build)?

ROCm reaches an AMD GPU through /dev/kfd (the compute driver, one for the machine) and a DRM render node
per GPU (/dev/dri/renderD128, ...). Both belong to the `render` group (`video` on older systems), so a
user outside it gets "Unable to open /dev/kfd read-write: Permission denied" and torch sees no GPU
(ROCm/ROCT-Thunk-Interface README; ROCm/ROCm-docker#90). A container sees them only when they are passed
in: `docker run --device=/dev/kfd --device=/dev/dri --group-add video` (ROCm/ROCm-docker README).
"""

from __future__ import annotations

import re

from redline.doctor.checks.machine import NOT_IMPORTED, Machine
from redline.doctor.report import Check, fail, ok, skip, warn

DEVICE_FLAGS = "--device=/dev/kfd --device=/dev/dri"
GROUP_FLAGS = "--group-add video --group-add render"
LIST_NODES = "`ls -l /dev/kfd /dev/dri` shows their groups"


def access_fix(m: Machine) -> str:
    """Return how to get read-write access to /dev/kfd and the render nodes."""
    if m.snap.system.container == "kubernetes":  # the device plugin passes them owned by the host's render GID
        return (
            "run the pod in the host's render group: `securityContext: supplementalGroups: [<GID>]` with the GID "
            "of `getent group render` on the node (ROCm/k8s-device-plugin#39)"
        )
    if m.snap.system.container and not m.apptainer:  # Apptainer runs as the host's user, in the host's groups
        return (
            f"start the container with `{DEVICE_FLAGS} {GROUP_FLAGS}` (the host's render GID, "
            "from `getent group render`, where the image has no render group)"
        )
    return f"add yourself to their groups: `sudo usermod -aG render,video $USER`, then log in again ({LIST_NODES})"


def container_devices(m: Machine) -> str:
    """Say how this container is given AMD's device files, in its own runtime's terms."""
    if m.apptainer:
        return "run the container with `apptainer exec --rocm`"
    if m.snap.system.container == "kubernetes":  # AMD's device plugin (ROCm/k8s-device-plugin) serves amd.com/gpu
        return "request the GPUs in the pod spec (`resources: limits: amd.com/gpu: 1`)"
    return f"start the container with `docker run {DEVICE_FLAGS}`"


def missing_hint(m: Machine) -> str:
    return f"; in a container, {container_devices(m)}" if m.snap.system.container else ""


def rocm_start_fix(m: Machine) -> str:
    """Name the fix for a ROCm build of torch that sees no GPU: access first, then what ROCm itself says."""
    amd = m.snap.amd
    if amd is not None and amd.kfd and not (amd.kfd_access and amd.render_access):
        return access_fix(m)
    return (
        "run `rocminfo`: it says why the ROCm runtime finds no GPU agent; check that HIP_VISIBLE_DEVICES and "
        f"ROCR_VISIBLE_DEVICES do not hide the GPUs, and {LIST_NODES} (you need read-write access)"
    )


def rocm_devices(m: Machine) -> Check:
    if not m.linux:
        return skip("rocm-devices", f"ROCm runs on Linux only, not {m.snap.system.os or 'this OS'}")
    amd = m.snap.amd
    if amd is None:
        return skip("rocm-devices", "the snapshot has no facts of AMD's device files (taken by an older redline)")
    if m.build == "cuda" and not (amd.kfd and not m.gpus):
        return skip("rocm-devices", "a CUDA build of torch, which does not use AMD GPUs")
    if not amd.kfd:
        if m.build == "rocm":
            return skip("rocm-devices", f"a ROCm build of torch, but no AMD GPU here (no /dev/kfd){missing_hint(m)}")
        return skip("rocm-devices", f"no AMD GPU (no /dev/kfd){missing_hint(m)}")
    if m.build in ("cpu", "cuda"):  # a CUDA build here: a plain `pip install torch` on Linux, the common slip
        if m.gpus:
            return skip("rocm-devices", "a CPU-only torch on a machine with NVIDIA GPUs (see torch-build)")
        kind = "a CPU-only build" if m.build == "cpu" else "a CUDA build, which runs on NVIDIA GPUs alone"
        return warn(
            "rocm-devices",
            f"an AMD GPU (/dev/kfd) but torch {m.torch_version} is {kind}, so it runs on the CPU",
            "install a ROCm build of torch: https://pytorch.org/get-started/locally/ gives the --index-url "
            "(download.pytorch.org/whl/rocmX.Y) for your ROCm",
        )
    if not amd.kfd_access:
        detail = "/dev/kfd exists but you cannot open it read-write, so ROCm sees no GPU"
        return fail("rocm-devices", detail, access_fix(m))
    if not amd.render_nodes:
        fix = (
            container_devices(m)
            if m.snap.system.container
            else "load AMD's display driver: `sudo modprobe amdgpu` (`amdgpu-install --usecase=rocm` installs it)"
        )
        return fail("rocm-devices", "/dev/kfd but no GPU render node (/dev/dri/renderD*), so ROCm sees no GPU", fix)
    if not amd.render_access:
        listed = ", ".join(amd.render_nodes)
        return fail("rocm-devices", f"you cannot open the render nodes read-write ({listed})", access_fix(m))
    count = len(amd.render_access)
    return ok("rocm-devices", f"/dev/kfd and {count} render node{'s' if count > 1 else ''} open read-write")


def gfx_version(target: str) -> tuple[int, int, int] | None:
    """Read an AMD GPU target as ROCm numbers it: "gfx90a:sramecc+:xnack-" -> (9, 0, 10), "gfx1031" -> (10, 3, 1)."""
    match = re.fullmatch(r"gfx(\d{1,2})([0-9a-f])([0-9a-f])", target.partition(":")[0].strip().lower())
    return (int(match[1]), int(match[2], 16), int(match[3], 16)) if match else None


def override_fix(missing: list[str], built: list[str]) -> str:
    """Return how to run GPUs whose target the wheel lacks: the kernels of a sibling target, else another build.

    A target the wheel lacks (gfx1031, an RX 6700 XT) often runs the kernels of the first of its family the
    wheel has (gfx1030) once HSA_OVERRIDE_GFX_VERSION makes the runtime report that one; unofficial, but the
    usual answer to "HIP error: invalid device function" (pytorch/pytorch#132570, #164346).
    """
    steps = []
    for arch in dict.fromkeys(missing):
        have = gfx_version(arch)
        siblings = sorted(v for t in built if (v := gfx_version(t)) and have and v[:2] == have[:2])
        if siblings:
            major, minor, stepping = siblings[0]
            steps.append(
                f"`export HSA_OVERRIDE_GFX_VERSION={major}.{minor}.{stepping}` runs the wheel's "
                f"gfx{major}{minor:x}{stepping:x} kernels on {arch} (unofficial)"
            )
        else:
            steps.append(
                f"no kernels of {arch}'s family in this wheel: build torch with PYTORCH_ROCM_ARCH={arch}, "
                "or use a GPU on ROCm's support list"
            )
    return "; ".join(steps)


def rocm_arch_supported(m: Machine) -> Check:
    """Judge each AMD GPU's target against the targets the ROCm wheel was built for."""
    facts = m.torch
    if facts is None or not m.imported:
        return skip(
            "gpu-arch-supported", NOT_IMPORTED if facts is not None else "torch did not import (see torch-build)"
        )
    gpus = {f"{d.name} ({d.arch.partition(':')[0]})": d.arch.partition(":")[0] for d in facts.devices if d.arch}
    if not gpus:
        return skip("gpu-arch-supported", "torch reported no AMD GPU target to check (see cuda-available)")
    built = [entry.partition(":")[0] for entry in facts.arch_list]
    if not built:
        return skip("gpu-arch-supported", "torch did not report the targets it was built for")
    shown = " ".join(built)
    missing = {gpu: arch for gpu, arch in gpus.items() if arch not in built}
    if missing:
        detail = f"{', '.join(missing)} not among the wheel's targets ({shown}): 'HIP error: invalid device function'"
        return fail("gpu-arch-supported", detail, override_fix(list(missing.values()), built))
    return ok("gpu-arch-supported", f"{', '.join(gpus)} covered by the wheel's kernels ({shown})")
