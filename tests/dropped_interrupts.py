"""A signal whose handler's exception Python drops: raised inside ``__del__``, as a Ctrl-C inside torch's compile."""

from __future__ import annotations

import os


class DropsItsInterrupt:
    """An object whose deletion gets a signal: its handler's exception is raised inside ``__del__``, where Python
    prints "Exception ignored in" and drops it, as it did a Ctrl-C inside torch's compile (its weakref callbacks)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum

    def __del__(self) -> None:
        os.kill(os.getpid(), self.signum)
        for _ in range(1000):  # the handler runs here, between two of these bytecodes
            pass
