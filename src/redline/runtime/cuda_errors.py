"""Telling a sticky CUDA error (the device is unusable until the process exits) from an ordinary failure.

After an illegal memory access, a device-side assert or a launch failure, the CUDA context is
corrupt: every later call on it fails the same way, and only a new process recovers
(https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html, the errors documented as
"the process must be terminated and relaunched"). A server must then fail its liveness check so
that it is restarted; a shape error or an out-of-memory error leaves the device usable.
"""

from __future__ import annotations

# The messages of cudaGetErrorString (as torch and triton raise them), with the enum names for
# error texts that quote those instead (CUDA_ERROR_* from the driver API, cudaError* from the runtime).
STICKY_MESSAGES = (
    "an illegal memory access was encountered",  # cudaErrorIllegalAddress
    "device-side assert triggered",  # cudaErrorAssert
    "unspecified launch failure",  # cudaErrorLaunchFailure
    "misaligned address",  # cudaErrorMisalignedAddress
    "an illegal instruction was encountered",  # cudaErrorIllegalInstruction
    "uncorrectable ecc error encountered",  # cudaErrorECCUncorrectable
    "invalid program counter",  # cudaErrorInvalidPc
    "hardware stack error",  # cudaErrorHardwareStackError
    "the launch timed out and was terminated",  # cudaErrorLaunchTimeout
    "an exception occurred on the device while executing a kernel",  # cudaErrorLaunchFailure (driver text)
)
STICKY_NAMES = (
    "illegal_address", "illegaladdress", "cudaerrorassert", "cuda_error_assert", "launch_failed", "launchfailure",
    "misaligned_address", "misalignedaddress", "illegal_instruction", "illegalinstruction", "ecc_uncorrectable",
    "eccuncorrectable", "invalid_pc", "invalidpc", "hardware_stack_error", "hardwarestackerror",
)  # fmt: skip


def is_sticky_cuda_error(exc: BaseException) -> bool:
    """Whether ``exc``, or an exception it wraps, is a CUDA error that leaves the device unusable for this process.

    Out of memory, a shape mismatch or a Python error in the model are not sticky: the device goes on working.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = str(current).lower()
        if any(message in text for message in STICKY_MESSAGES) or any(name in text for name in STICKY_NAMES):
            return True
        current = getattr(current, "inner_exception", None) or current.__cause__ or current.__context__
    return False
