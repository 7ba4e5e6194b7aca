"""Checks of the libraries around torch: cuDNN, NCCL, LD_LIBRARY_PATH shadowing, torchvision and torchaudio."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath

from redline.doctor.checks.machine import NOT_IMPORTED, Machine, device_ranges, first_line, mentions
from redline.doctor.checks.measured import MAX_REL_ERR
from redline.doctor.compat import (
    INDEX_URL,
    Version,
    companion_version,
    dotted,
    is_index_tag,
    local_tag,
    parse_version,
    tag_cuda,
)
from redline.doctor.report import Check, fail, ok, skip, warn
from redline.doctor.snapshot import Measurement

CUDNN_PROBE = "python -c 'import torch; print(torch.backends.cudnn.version())'"
NCCL_SLOW_SWITCHES = ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE")
# NCCL reads each switch as a C integer (strtol, base 0: "0x1" and "01" are 1, "true" is 0) and turns P2P and
# SHM off only at exactly 1, InfiniBand at any number but 0 (NCCL src/graph/paths.cc ncclGetLevel,
# src/transport/shm.cc, src/transport/net_ib: `if (ncclParamIbDisable())`).
_NCCL_OFF_AT_ONE = {"NCCL_P2P_DISABLE": "P2P", "NCCL_SHM_DISABLE": "shared memory"}


def cudnn_text(version: int) -> str:
    """Format torch.backends.cudnn.version(): 90100 -> "9.1.0" (cuDNN 9), 8902 -> "8.9.2" (cuDNN 8)."""
    if version >= 10000:
        return f"{version // 10000}.{version % 10000 // 100}.{version % 100}"
    return f"{version // 1000}.{version % 1000 // 100}.{version % 100}"


def miopen_text(version: int) -> str:
    """Format torch.backends.cudnn.version() under ROCm, where it is MIOpen's: 3003000 -> "3.3.0".

    torch encodes it as major * 1000000 + minor * 1000 + patch (torch/csrc/cuda/shared/cudnn.cpp).
    """
    return f"{version // 1000000}.{version // 1000 % 1000}.{version % 1000}"


def cudnn(m: Machine) -> Check:
    facts = m.torch
    if facts is None:
        return skip("cudnn", "torch did not import (see torch-build)")
    if m.build == "rocm":
        return miopen(m)
    if m.build != "cuda":
        return skip("cudnn", "CPU-only torch build")
    if not m.imported:
        return skip("cudnn", NOT_IMPORTED)
    system_copies = [e.path for e in m.snap.library_path if any(lib.startswith("libcudnn") for lib in e.libs)]
    reinstall = m.install(facts.cuda)
    if facts.cudnn_error:
        fix = m.ld_path_without(system_copies) if system_copies else reinstall
        return fail("cudnn", f"torch cannot use cuDNN: {first_line(facts.cudnn_error)}", fix)
    if facts.cudnn_version is None:
        return fail(
            "cudnn",
            "torch found no cuDNN it can load",
            m.ld_path_without(system_copies) if system_copies else reinstall,
        )
    loaded = cudnn_text(facts.cudnn_version)
    convs, bad = convolutions(m)
    if bad:
        return fail(
            "cudnn",
            f"cuDNN {loaded}: a convolution on {', '.join(bad)} disagrees with the CPU",
            "look for ECC and Xid errors: `nvidia-smi -q -d ECC` and `sudo dmesg | grep -i xid`",
        )
    # nvidia-cudnn-cu12, nvidia-cudnn-cu13; not nvidia-cudnn-frontend, a 1.x header library.
    wheel = next(((n, v) for n, v in m.snap.packages.items() if re.fullmatch(r"nvidia-cudnn-cu\d+", n)), None)
    wheel_v = parse_version(wheel[1]) if wheel else None
    if wheel and wheel_v and wheel_v[:2] != (parse_version(loaded) or ())[:2]:
        find = f"find the copy that loads and remove it: `LD_DEBUG=libs {CUDNN_PROBE} 2>&1 | grep -i libcudnn`"
        fix = m.ld_path_without(system_copies) if system_copies else find
        return warn("cudnn", f"torch loaded cuDNN {loaded}, but the wheel {wheel[0]} is {wheel[1]}", fix)
    tested = f"; a convolution on {convs[0].device} matches the CPU" if convs else ""
    return ok("cudnn", f"cuDNN {loaded}{tested}")


def convolutions(m: Machine) -> tuple[list[Measurement], list[str]]:
    """Return the GPUs' convolutions checked against the CPU, and the devices whose result was wrong."""
    convs = [r for r in m.snap.measurements if r.device.startswith("cuda:") and r.conv_rel_err is not None]
    return convs, [r.device for r in convs if not (r.conv_rel_err is not None and r.conv_rel_err <= MAX_REL_ERR)]


def miopen(m: Machine) -> Check:
    """Judge a ROCm build's convolutions, which run on MIOpen, ROCm's cuDNN, as the cuDNN check judges CUDA's."""
    if not m.imported:
        return skip("cudnn", NOT_IMPORTED)
    convs, bad = convolutions(m)
    if bad:
        return fail(
            "cudnn",
            f"ROCm build: a convolution (MIOpen) on {', '.join(bad)} disagrees with the CPU",
            "look for GPU errors with `sudo dmesg | grep -i amdgpu`, and keep work off the device until it is reset "
            "or replaced",
        )
    version = f" {miopen_text(m.torch.cudnn_version)}" if m.torch and m.torch.cudnn_version else ""
    if not convs:
        return skip("cudnn", f"ROCm build: MIOpen{version} instead of cuDNN, and no convolution was measured")
    devices = device_ranges([r.device for r in convs])
    return ok("cudnn", f"ROCm build, MIOpen{version} instead of cuDNN: a convolution on {devices} matches the CPU")


def nccl(m: Machine) -> Check:
    if not m.linux:
        return skip("nccl", f"NCCL runs on Linux only, not {m.snap.system.os or 'this OS'}")
    facts = m.torch
    if facts is None or m.build != "cuda":
        return skip("nccl", "no CUDA build of torch")
    if not m.imported:
        return skip("nccl", NOT_IMPORTED)
    if facts.nccl_version is None:
        detail = "this torch build has no NCCL, so multi-GPU training falls back to the much slower gloo"
        return warn("nccl", detail, m.install(facts.cuda))
    set_to = {name: m.snap.env[name] for name in NCCL_SLOW_SWITCHES if m.snap.env.get(name, "").strip()}
    switches = [name for name, value in set_to.items() if nccl_switch_on(name, value)]
    # "true" or "2": meant to turn a transport off, which NCCL leaves on; "0", "false" or "off" mean what NCCL does
    ignored = [name for name, value in set_to.items() if name not in switches and not _says_off(value)]
    details, fixes, notes = [], [], []
    version, gpus = facts.nccl_version, len(m.gpus) or len(facts.devices)
    # P2P and shared memory carry traffic between the GPUs of one machine, InfiniBand (and RoCE) between machines
    # (NCCL's user guide, "Environment Variables"): with one GPU the first two have nothing to carry.
    between_gpus = [name for name in switches if name in _NCCL_OFF_AT_ONE]
    if between_gpus and gpus <= 1:
        verb = "changes" if len(between_gpus) == 1 else "change"
        notes.append(f"{' and '.join(between_gpus)} set, which {verb} nothing with one GPU")
    elif between_gpus:
        details.append(
            f"NCCL {version} with {', '.join(between_gpus)} set, which slows collectives between this machine's GPUs"
        )
        fixes.append(
            f"unset {' '.join(between_gpus)}; if a multi-GPU run hangs without NCCL_P2P_DISABLE, fix the cause "
            "instead: disable PCI ACS or boot with iommu=pt (NCCL troubleshooting guide, 'GPU Direct')"
        )
    rdma = m.snap.infiniband
    if "NCCL_IB_DISABLE" in switches and rdma:  # the doctor sees one machine, not whether a run spans several
        details.append(
            f"NCCL {version} with NCCL_IB_DISABLE set, which sends collectives between nodes over TCP sockets instead "
            f"of this machine's InfiniBand/RoCE devices ({', '.join(rdma)}): a run across nodes slows, one on this "
            "machine alone does not"
        )
        fixes.append("unset NCCL_IB_DISABLE before a run across nodes")
    elif "NCCL_IB_DISABLE" in switches and rdma == []:
        notes.append("NCCL_IB_DISABLE set, which changes nothing: this machine has no InfiniBand or RoCE device")
    elif "NCCL_IB_DISABLE" in switches:  # a snapshot that did not look for the devices
        notes.append("NCCL_IB_DISABLE set, which slows only collectives between nodes, sent over TCP, not InfiniBand")
    if ignored:
        shown = ", ".join(f"{name}={set_to[name]!r}" for name in ignored)
        details.append(
            f"NCCL {facts.nccl_version} ignores {shown}: it reads these switches as numbers and turns P2P and "
            "shared memory off only at 1, InfiniBand at any number but 0"
        )
        fixes.append(
            f"unset {' '.join(ignored)}; to turn a transport off NCCL needs the number, as in `export {ignored[0]}=1`"
        )
    if details:
        return warn("nccl", "; ".join(details + notes), "; and ".join(fixes))
    return ok("nccl", "; ".join([f"NCCL {version}", *notes]))


def nccl_switch_on(name: str, value: str) -> bool:
    """Whether NCCL turns its transport off for the switch ``name`` set to ``value``, reading it as NCCL does."""
    number = _c_integer(value)
    return number == 1 if name in _NCCL_OFF_AT_ONE else number != 0


def _says_off(value: str) -> bool:
    """Whether a switch's value reads as "not disabled" to a person as well as to NCCL: a zero, false, no or off."""
    text = value.strip().lower()
    return text in ("false", "no", "off", "n", "f") or re.fullmatch(r"[+-]?(0x)?0+", text) is not None


def _c_integer(text: str) -> int:
    """``text`` read as C's strtol(text, NULL, 0) reads it: leading digits in base 16 (0x), 8 (0) or 10, else 0."""
    match = re.match(r"\s*([+-]?)(0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*)", text)
    if match is None:
        return 0
    sign, digits = match.groups()
    base = 16 if digits[:2].lower() == "0x" else 8 if digits.startswith("0") else 10
    return int(sign + digits, base)


@dataclass(frozen=True)
class Shadow:
    """A CUDA library on LD_LIBRARY_PATH that the dynamic loader finds before the wheel's copy."""

    directory: str
    soname: str
    found: Version | None
    wheel: Version | None


def soname_of(filename: str) -> tuple[str, Version] | None:
    """Split "libnvJitLink.so.12.1.105" into ("libnvJitLink.so.12", (12, 1, 105))."""
    match = re.fullmatch(r"(lib\w+\.so\.(\d+))((?:\.\d+)*)", filename)
    if match is None:
        return None
    return match.group(1), tuple(int(p) for p in (match.group(2) + match.group(3)).split("."))


# CUDA 13 wheels put the toolkit's libraries in one folder, site-packages/nvidia/cu13/lib, each from
# its own package (nvidia-cuda-runtime 13.0.96 brings libcudart.so.13): library stem -> package.
_SHARED_FOLDER_PACKAGES = {
    "cudart": "cuda-runtime",
    "cublas": "cublas",
    "cublasLt": "cublas",
    "nvJitLink": "nvjitlink",
    "nvrtc": "cuda-nvrtc",
    "cupti": "cuda-cupti",
    "cufft": "cufft",
    "curand": "curand",
    "cusolver": "cusolver",
    "cusparse": "cusparse",
}


def _shared_folder_package(lib: str) -> str:
    stem = lib.removeprefix("lib").partition(".so")[0]
    return _SHARED_FOLDER_PACKAGES.get(stem, stem)


def _pip_version(m: Machine, package: str) -> str | None:
    return next((v for n, v in m.snap.packages.items() if n == package or n.startswith(package + "-cu")), None)


def shadows(m: Machine) -> list[Shadow]:
    """Find LD_LIBRARY_PATH libraries with the same soname as one in the nvidia-* wheels beside torch."""
    wheel: dict[str, Version | None] = {}
    for directory in m.snap.wheel_libs:
        folder = PurePosixPath(directory.path).parent.name
        for lib in directory.libs:
            if (parsed := soname_of(lib)) is not None:
                package = "nvidia-" + (_shared_folder_package(lib) if re.fullmatch(r"cu\d+", folder) else folder)
                wheel[parsed[0]] = parse_version(_pip_version(m, package.replace("_", "-")))
    found: list[Shadow] = []
    for entry in m.snap.library_path:
        versions: dict[str, Version] = {}
        for lib in entry.libs:
            if (parsed := soname_of(lib)) is not None and parsed[0] in wheel:
                versions[parsed[0]] = max(versions.get(parsed[0], ()), parsed[1])
        toolkit = re.search(r"cuda-(\d+)\.(\d+)", entry.path)  # /usr/local/cuda-12.1/lib64
        for soname, version in versions.items():
            if len(version) < 2 and toolkit and not soname.startswith(("libcudnn", "libnccl")):
                version = (int(toolkit.group(1)), int(toolkit.group(2)))
            found.append(Shadow(entry.path, soname, version if len(version) >= 2 else None, wheel[soname]))
    return found


def library_shadowing(m: Machine) -> Check:
    if not m.linux:
        return skip("library-shadowing", "LD_LIBRARY_PATH is a Linux matter")
    import_error = m.snap.torch.import_error if m.snap.torch else None
    if import_error and mentions(import_error, "undefined symbol") and (dirs := m.shadowing_dirs(import_error)):
        detail = f"import torch failed with {first_line(import_error)!r} while LD_LIBRARY_PATH holds libraries it loads"
        return fail("library-shadowing", detail, m.ld_path_without(dirs))
    if not m.snap.library_path:
        return ok("library-shadowing", "LD_LIBRARY_PATH is unset")
    if m.build is not None and m.build != "cuda":
        return skip("library-shadowing", "torch is not a CUDA build, so it loads no CUDA library")
    if not m.snap.wheel_libs:
        return ok(
            "library-shadowing", "torch uses the CUDA libraries on the system path (no nvidia-* wheels beside it)"
        )
    found = shadows(m)
    # Compared over the parts both give: a system libcudnn.so.9.7.1 is the wheel's 9.7.1.26, not older.
    older = [s for s in found if s.found and s.wheel and _common(s.found, s.wheel) < _common(s.wheel, s.found)]
    unknown = [s for s in found if s.found is None or s.wheel is None]
    if older:
        names = ", ".join(
            f"{s.directory}/{s.soname} {dotted(s.found or ())} (wheel: {dotted(s.wheel or ())})" for s in older
        )
        detail = (
            f"LD_LIBRARY_PATH puts older CUDA libraries before the wheel's: {names}; expect 'undefined symbol' errors"
        )
        return fail("library-shadowing", detail, m.ld_path_without(sorted({s.directory for s in older})))
    if unknown:
        names = ", ".join(f"{s.directory}/{s.soname}" for s in unknown)
        return warn(
            "library-shadowing",
            f"LD_LIBRARY_PATH puts CUDA libraries of unknown version before the wheel's: {names}",
            m.ld_path_without(sorted({s.directory for s in unknown})),
        )
    if found:
        return ok(
            "library-shadowing", f"LD_LIBRARY_PATH holds {len(found)} CUDA libraries, none older than the wheel's"
        )
    return ok("library-shadowing", "no CUDA library on LD_LIBRARY_PATH shadows the wheel's")


def _common(version: Version, other: Version) -> Version:
    return version[: min(len(version), len(other))]


def torch_companions(m: Machine) -> Check:
    installed = {name: m.snap.packages[name] for name in m.companions}
    if not installed:
        return skip("torch-companions", "torchvision and torchaudio are not installed")
    torch_version = m.torch_version
    if torch_version is None:
        return skip("torch-companions", "torch's version is unknown")
    torch_tag = local_tag(torch_version)
    torch_cuda = tag_cuda(torch_tag) or parse_version(m.torch.cuda if m.torch else None)
    problems, pins = [], []
    for name, version in installed.items():
        want, have, tag = companion_version(name, torch_version), parse_version(version), local_tag(version)
        if want is not None and have is not None and have[:2] != want:
            problems.append(f"{name} {version} is not the {dotted(want, 2)} built for torch {torch_version}")
        elif tag and torch_tag and (tag == "cpu") != (torch_tag == "cpu"):
            problems.append(f"{name} {version} and torch {torch_version} differ in CPU vs CUDA build")
        elif (cuda := tag_cuda(tag)) and torch_cuda and cuda[0] != torch_cuda[0]:
            problems.append(f"{name} {version} is built for CUDA {dotted(cuda)}, torch for CUDA {dotted(torch_cuda)}")
        else:
            continue
        pins.append(f"{name}=={dotted(want, 2)}.*" if want else name)
    if problems:
        index = f" --index-url {INDEX_URL}/{torch_tag}" if torch_tag and is_index_tag(torch_tag) else ""
        fix = f"pip install --force-reinstall --no-deps {' '.join(pins)}{index}"
        detail = (
            "; ".join(problems) + "; a mismatched build fails at import ('operator torchvision::nms does not exist')"
        )
        return fail("torch-companions", detail, fix)
    listed = ", ".join(f"{name} {version}" for name, version in installed.items())
    agree = "matches" if len(installed) == 1 else "match"
    return ok("torch-companions", f"{listed} {agree} torch {torch_version}")
