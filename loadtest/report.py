"""Shared by the load-test scripts: their --server-env, percentiles and the look of their
plots."""

from __future__ import annotations


def parse_env(text: str) -> dict[str, str]:
    """A --server-env value, NAME=VALUE,... ("" = none), as a dict."""
    pairs = [item.split("=", 1) for item in text.split(",") if item]
    if any(len(pair) != 2 or not pair[0] for pair in pairs):
        raise ValueError(f"expected NAME=VALUE,... got {text!r}")
    return dict(pairs)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def finish_axes(axes_and_titles, xlabel: str) -> None:
    """Log2 x axis, title, grid and legend on each (axis, title)."""
    for axis, title in axes_and_titles:
        axis.set_xscale("log", base=2)
        axis.set_xlabel(xlabel)
        axis.set_title(title)
        axis.grid(alpha=0.3)
        axis.legend()
