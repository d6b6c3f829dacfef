"""The loss and learning-rate curves of the samples page, as inline SVG: no script, no network, no plotting library.

    svg = curves_svg(records)     # records: metrics.jsonl lines, oldest first (dstune.progress.read_metrics)

Two panels over the optimizer step: the training loss (with the held-out loss of data.eval as dots, when logged)
and the learning rate. Each series is one <polyline> whose points map linearly: x from the first to the last step
logged, y from the panel's lowest to highest value (`Panel.point`), so the drawing is exactly the logged numbers.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass

WIDTH_PX = 860
PANEL_HEIGHT_PX = 230
MARGIN_LEFT_PX, MARGIN_RIGHT_PX, MARGIN_TOP_PX, MARGIN_BOTTOM_PX = 78, 20, 30, 36
TICKS = 5
COLOURS = {"loss": "#1f6fb4", "eval_loss": "#d9480f", "lr": "#2b8a3e"}
LABELS = {"loss": "train loss", "eval_loss": "held-out loss (data.eval)", "lr": "learning rate"}


@dataclass(frozen=True)
class Panel:
    """One plot: the data ranges and where they land on the page (y grows downwards in SVG)."""

    top_px: float
    first_step: float
    last_step: float
    low: float
    high: float
    spacing: float  # between the value grid lines (low and high are multiples of it)

    @property
    def plot_left(self) -> float:
        return MARGIN_LEFT_PX

    @property
    def plot_right(self) -> float:
        return WIDTH_PX - MARGIN_RIGHT_PX

    @property
    def plot_top(self) -> float:
        return self.top_px + MARGIN_TOP_PX

    @property
    def plot_bottom(self) -> float:
        return self.top_px + PANEL_HEIGHT_PX - MARGIN_BOTTOM_PX

    def point(self, step: float, value: float) -> tuple[float, float]:
        """Page coordinates of (step, value): the left edge is the first step, the bottom edge the lowest value."""
        step_span = self.last_step - self.first_step
        value_span = self.high - self.low
        x_fraction = (step - self.first_step) / step_span if step_span else 0.5
        y_fraction = (value - self.low) / value_span if value_span else 0.5
        return (
            self.plot_left + x_fraction * (self.plot_right - self.plot_left),
            self.plot_bottom - y_fraction * (self.plot_bottom - self.plot_top),
        )


def series(records: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of every record holding a finite number under `key`."""
    out = []
    for record in records:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out.append((int(record["step"]), float(value)))
    return out


def nice_step(span: float, ticks: int = TICKS) -> float:
    """A round tick spacing (1, 2 or 5 times a power of ten) giving about `ticks` ticks over `span`."""
    if span <= 0 or not math.isfinite(span):
        return 1.0
    raw = span / max(ticks - 1, 1)
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


def tick_values(low: float, high: float, spacing: float) -> list[float]:
    """The multiples of `spacing` from `low` to `high` (both already multiples of it)."""
    count = round((high - low) / spacing)
    return [round(low + spacing * number, 12) for number in range(count + 1)]


def _number(value: float) -> str:
    return f"{value:.4g}"


def _panel_svg(panel: Panel, title: str, lines: dict[str, list[tuple[int, float]]]) -> str:
    parts = [f'<text x="{panel.plot_left}" y="{panel.top_px + 18}" class="title">{html.escape(title)}</text>']
    for value in tick_values(panel.low, panel.high, panel.spacing):  # grid lines with their values
        _, y = panel.point(panel.first_step, value)
        parts.append(
            f'<line x1="{panel.plot_left}" y1="{y:.2f}" x2="{panel.plot_right}" y2="{y:.2f}" class="grid"/>'
            f'<text x="{panel.plot_left - 6}" y="{y + 4:.2f}" class="tick" text-anchor="end">'
            f"{_number(value)}</text>"
        )
    spacing = max(1, int(nice_step(panel.last_step - panel.first_step, 8)))
    inner = range(math.ceil(panel.first_step / spacing) * spacing, int(panel.last_step), spacing)
    steps = sorted({int(panel.first_step), int(panel.last_step), *inner})
    for step in [
        s
        for s in steps
        if s in (panel.first_step, panel.last_step)
        or min(abs(s - panel.first_step), abs(s - panel.last_step)) >= spacing / 2
    ]:
        x, _ = panel.point(step, panel.low)
        parts.append(f'<text x="{x:.2f}" y="{panel.plot_bottom + 16}" class="tick" text-anchor="middle">{step}</text>')
    parts.append(
        f'<text x="{(panel.plot_left + panel.plot_right) / 2}" y="{panel.plot_bottom + 30}" class="tick" '
        'text-anchor="middle">optimizer step</text>'
    )
    parts.append(
        f'<rect x="{panel.plot_left}" y="{panel.plot_top}" width="{panel.plot_right - panel.plot_left}" '
        f'height="{panel.plot_bottom - panel.plot_top}" class="frame"/>'
    )
    legend_x = panel.plot_right
    for key, points in lines.items():
        colour = COLOURS[key]
        coordinates = " ".join(f"{x:.2f},{y:.2f}" for x, y in (panel.point(s, v) for s, v in points))
        parts.append(
            f'<polyline data-series="{key}" points="{coordinates}" fill="none" stroke="{colour}" stroke-width="1.6"/>'
        )
        if key == "eval_loss" or len(points) == 1:  # sparse series: dots, so a single evaluation still shows
            parts += [
                f'<circle cx="{x:.2f}" cy="{y:.2f}" r="3" fill="{colour}"/>'
                for x, y in (panel.point(s, v) for s, v in points)
            ]
        parts.append(
            f'<text x="{legend_x}" y="{panel.top_px + 18}" class="legend" text-anchor="end" '
            f'fill="{colour}">{html.escape(LABELS[key])}</text>'
        )
        legend_x -= 8 + 7 * len(LABELS[key])
    return "".join(parts)


def _panel(top_px: float, steps: list[int], values: list[float]) -> Panel:
    """The value range widened to round tick values, so the grid lines are labelled with round numbers."""
    low, high = min(values), max(values)
    if high == low:
        low, high = low - (abs(low) or 1.0) * 0.1, high + (abs(high) or 1.0) * 0.1
    spacing = nice_step(high - low)
    return Panel(
        top_px,
        min(steps),
        max(steps),
        math.floor(low / spacing) * spacing,
        math.ceil(high / spacing) * spacing,
        spacing,
    )


def curves_svg(records: list[dict]) -> str:
    """The loss panel (train loss, held-out loss) and the LR panel as one <svg>; "" when nothing is logged yet."""
    losses = {key: points for key in ("loss", "eval_loss") if (points := series(records, key))}
    rates = series(records, "lr")
    panels = []
    if losses:
        everything = [point for points in losses.values() for point in points]
        panel = _panel(0, [s for s, _ in everything], [v for _, v in everything])
        panels.append(_panel_svg(panel, "loss", losses))
    if rates:
        panel = _panel(len(panels) * PANEL_HEIGHT_PX, [s for s, _ in rates], [v for _, v in rates])
        panels.append(_panel_svg(panel, "learning rate", {"lr": rates}))
    if not panels:
        return ""
    height = len(panels) * PANEL_HEIGHT_PX
    style = (
        "<style>.grid{stroke:#e3e3e3}.frame{fill:none;stroke:#999}.tick{font:11px sans-serif;fill:#444}"
        ".title{font:bold 13px sans-serif}.legend{font:12px sans-serif}</style>"
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH_PX}" height="{height}" '
        f'viewBox="0 0 {WIDTH_PX} {height}" role="img" aria-label="loss and learning rate">{style}'
        + "".join(panels)
        + "</svg>"
    )
