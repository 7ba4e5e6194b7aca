"""Charts for the HTML report: drawn with matplotlib, returned as PNG bytes with their alt text.

matplotlib is the optional extra ``redline[report]``, imported here when a chart is drawn and never
on ``import redline``. Figures are built with ``Figure`` on an Agg canvas directly, never through
pyplot, so the backend and the figures of the process that calls us are left as they were.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from redline.errors import ConfigError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter
    from matplotlib.typing import RcKeyType

WIDTH_IN = 8.0
DPI = 100
STYLE: dict[RcKeyType, Any] = {
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.titleweight": "bold",
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.color": "#e3e3e3",
    "axes.axisbelow": True,
    "text.parse_math": False,  # a "$" in a configuration's name is text, not TeX
}
TEXT = "#333333"


@dataclass(frozen=True)
class Chart:
    """A drawn chart: its PNG file and the words that say what it shows (the image's alt text)."""

    png: bytes
    alt: str
    width_px: int
    height_px: int


@dataclass(frozen=True)
class Series:
    """One curve of a line chart; a NaN or infinite value is left out (a gap), so one diverged step hides no other."""

    label: str
    steps: Sequence[float]
    values: Sequence[float | None]
    points: bool = False  # few values (evaluations): marked, each one visible


def require_matplotlib() -> None:
    """Raise a ConfigError that says how to install matplotlib when it cannot be imported."""
    try:
        import matplotlib.backends.backend_agg
        import matplotlib.figure  # noqa: F401 - imported to learn whether they can be
    except ImportError as exc:
        raise ConfigError(
            f"the HTML report draws its charts with matplotlib, which cannot be imported ({exc})\n"
            "hint: pip install 'redline[report]'"
        ) from exc


def bar_chart(
    labels: Sequence[str],
    values: Sequence[float],
    *,
    title: str,
    xlabel: str,
    value_text: Callable[[float], str],
    colors: Sequence[str],
    reference: float | None = None,
) -> Chart:
    """Draw horizontal bars, the first label on top, each bar's value written at its end.

    ``reference`` draws a dashed vertical line at that value (the naive loop's 1.0x).
    """
    with _figure(height_in=1.3 + 0.42 * len(labels)) as fig:
        ax = fig.add_subplot()
        positions = list(range(len(labels)))
        bars = ax.barh(positions, values, color=list(colors), height=0.65)
        ax.set_yticks(positions, list(labels))
        ax.invert_yaxis()
        ax.bar_label(bars, labels=[value_text(v) for v in values], padding=3, color=TEXT, fontsize=9)
        ax.grid(axis="y", visible=False)
        ax.set_xlim(0, max([*values, reference or 0.0]) * 1.18 or 1.0)  # room for the value labels
        ax.xaxis.set_major_formatter(_plain_numbers())
        if reference is not None:
            ax.axvline(reference, color=TEXT, linestyle="--", linewidth=1)
        ax.set_title(title, loc="left")
        ax.set_xlabel(xlabel)
        alt = f"{title}: " + "; ".join(f"{label} {value_text(v)}" for label, v in zip(labels, values, strict=True))
        return _png(fig, alt)


def line_chart(series: Sequence[Series], *, title: str, ylabel: str, log_y: bool = False) -> Chart:
    """Draw each series against the optimizer step, with a legend when there are several."""
    with _figure(height_in=3.4) as fig:
        ax = fig.add_subplot()
        drawn, plotted, at = [], [], set()
        for one in series:
            steps, values = _finite(one.steps, one.values)
            if not steps:
                continue
            at.update(steps)
            # a line through one point draws nothing: a run of one logged step gets a marker
            dots = one.points or len(steps) == 1
            style: dict[str, Any] = {"marker": "o", "markersize": 5} if dots else {"linewidth": 1.4}
            ax.plot(steps, values, label=one.label, **style)
            drawn.append(f"{one.label} over {len(steps)} point{'' if len(steps) == 1 else 's'}, last "
                         f"{number_text(values[-1])}")  # fmt: skip
            plotted += values
        ax.yaxis.set_major_formatter(_plain_numbers())
        step_axis(ax, at)
        if log_y and plotted and min(plotted) > 0:
            _log_scale(ax)
        if len(drawn) > 1:
            ax.legend(frameon=False)
        ax.set_title(title, loc="left")
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        return _png(fig, f"{title}: " + "; ".join(drawn))


def step_axis(ax: Axes, steps: set[float]) -> None:
    """Tick the step axis at whole steps (no 2.5); around a single step, from the one before to the one after
    (matplotlib's margin would tick 0.96 to 1.04)."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if len(steps) == 1:
        (step,) = steps
        ax.set_xlim(step - 1, step + 1)


def _plain_numbers() -> FuncFormatter:
    """Tick labels as plain text (``2,000``, ``0.5``): never TeX, which the report's style turns off."""
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda value, _: number_text(value))


def number_text(value: float) -> str:
    """A number as a person reads it: ``7,000``, ``0.5203``."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def _log_scale(ax: Axes) -> None:
    """A log y axis ticked at 1, 2 and 5 times each power of ten, so a range under one decade still has labels."""
    from matplotlib.ticker import LogLocator, NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(_plain_numbers())
    ax.yaxis.set_minor_formatter(NullFormatter())


def _finite(steps: Sequence[float], values: Sequence[float | None]) -> tuple[list[float], list[float]]:
    kept = [(s, v) for s, v in zip(steps, values, strict=True) if v is not None and math.isfinite(v)]
    return [s for s, _ in kept], [v for _, v in kept]


@contextmanager
def _figure(height_in: float) -> Iterator[Figure]:
    """A Figure on its own Agg canvas, drawn under the report's style (rc_context restores the caller's)."""
    require_matplotlib()
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(WIDTH_IN, height_in), dpi=DPI, layout="constrained")
        FigureCanvasAgg(fig)
        yield fig


def _png(fig: Figure, alt: str) -> Chart:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", metadata={"Software": None})  # no version string: the same run, the same bytes
    width, height = fig.get_size_inches() * fig.dpi
    return Chart(png=buffer.getvalue(), alt=alt, width_px=round(width), height_px=round(height))
