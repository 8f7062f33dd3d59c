"""PNG plots of calibration curves and margin distributions (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: files only
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from mgbench.analysis.calibration import COUNT, UNITS, counts_of  # noqa: E402


def calibration_curves(curves: pd.DataFrame, taus: dict[str, float | None], path: Path) -> None:
    """Recall of flips and trigger rate against TAU, one panel per margin unit."""
    units = [u for u in UNITS if (curves["unit"] == u).any()] or ["logit"]
    fig, axes = plt.subplots(1, len(units), figsize=(5.5 * len(units), 4), squeeze=False)
    for ax, unit in zip(axes[0], units):
        data = curves[curves["unit"] == unit]
        # The interesting part is near TAU; far above it the trigger rate only creeps towards 1.
        tau = taus.get(unit)
        limit = 4 * tau if tau else (np.quantile(data["tau"], 0.99) if len(data) else 1.0)
        view = data[data["tau"] <= limit]
        ax.step(view["tau"], view["recall"], where="post", label="recall of flips")
        ax.step(view["tau"], view["trigger_rate"], where="post", label="trigger rate")
        if taus.get(unit) is not None:
            ax.axvline(taus[unit], color="red", linestyle="--", label=f"TAU = {taus[unit]:.4g}")
        ax.set_xlabel(f"TAU ({unit} margin)")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.suptitle("MarginGate calibration: verify steps with margin < TAU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """The smallest value with at least a share q of the weight at or below it."""
    order = np.argsort(values, kind="stable")
    cumulative = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cumulative, q * cumulative[-1])])


def margin_histograms(steps: pd.DataFrame, path: Path) -> None:
    """Margins at flip vs non-flip steps (density), one panel per unit; from a steps table or its
    counts per distinct margin (what calibrate streams)."""
    counts = counts_of(steps)
    units = {u: c for u, c in UNITS.items() if counts[c].notna().any()} or {"logit": "margin"}  # endpoint: no ulps
    fig, axes = plt.subplots(1, len(units), figsize=(5.5 * len(units), 4), squeeze=False)
    weight = counts[COUNT].to_numpy(dtype=np.int64)
    for ax, (unit, column) in zip(axes[0], units.items()):
        values = counts[column].to_numpy(dtype=float)
        top = weighted_quantile(values, weight, 0.99) if len(values) else 1.0
        bins = np.linspace(0, max(top, 1e-6), 60)
        flipped = counts["flipped"].to_numpy(dtype=bool)
        ax.hist(
            np.clip(values[~flipped], 0, top),
            bins=bins,
            weights=weight[~flipped],
            density=True,
            alpha=0.6,
            label=f"non-flip ({weight[~flipped].sum()})",
        )
        if flipped.any():
            ax.hist(
                np.clip(values[flipped], 0, top),
                bins=bins,
                weights=weight[flipped],
                density=True,
                alpha=0.8,
                label=f"flip ({weight[flipped].sum()})",
            )
        ax.set_xlabel(f"batched top-1/top-2 margin ({unit})")
        ax.set_ylabel("density")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def compare_plots(table: pd.DataFrame, out_dir: Path) -> None:
    """latency_increment.png (bars with the spread over repeats) and determinism_vs_triggers.png."""
    shown = table[table["config"] != "none"]
    fig, ax = plt.subplots(figsize=(10, 4))
    colors = ["tab:green" if d == 1 else "tab:red" for d in shown["determinism"]]
    ax.bar(
        shown["config"],
        100 * shown["increment"],
        color=colors,
        yerr=[100 * (shown["increment"] - shown["increment_min"]), 100 * (shown["increment_max"] - shown["increment"])],
    )
    ax.set_ylabel("latency increment over plain batched (%)")
    ax.set_title("cost of determinism (green: 100% identical to solo, red: not)")
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(out_dir / "latency_increment.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4.5))
    policies = table[table["trigger_rate"].notna()]
    ax.scatter(100 * policies["trigger_rate"], 100 * policies["determinism"])
    for row in policies.itertuples():
        ax.annotate(
            row.config,
            (100 * row.trigger_rate, 100 * row.determinism),
            fontsize=8,
            xytext=(4, 4),
            textcoords="offset points",
        )
    ax.set_xlabel("trigger rate (% of decode steps verified)")
    ax.set_ylabel("sequence-level determinism (%)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / "determinism_vs_triggers.png", dpi=110)
    plt.close(fig)


STACKED_PAIRS = 8  # pairs of runs a margins histogram tells apart by colour


def divergence_margins(pairs: list[dict], path: Path) -> None:
    """`mgbench diff`: the solo margins at each first divergence (both sides), stacked by pair of
    runs. Near 0: a near-tie that numeric noise broke the other way; wide: the logits really moved."""
    fig, ax = plt.subplots(figsize=(7, 4))
    stacks, labels = [], []
    for pair in pairs:
        values = [d[side] for d in pair["divergences"] for side in ("margin_a", "margin_b") if d[side] is not None]
        if values:
            stacks.append(np.asarray(values, dtype=float))
            labels.append(f"{pair['run_a']} vs {pair['run_b']} ({len(values)})")
    if len(stacks) > STACKED_PAIRS:  # more pairs than a legend tells apart: one bar per bin
        stacks, labels = (
            [np.concatenate(stacks)],
            [f"{len(stacks)} diverging pairs of runs ({sum(len(s) for s in stacks)})"],
        )
    if stacks:
        top = max(float(np.max(s)) for s in stacks)
        ax.hist(stacks, bins=np.linspace(0, max(top, 1e-3), 40), stacked=True, label=labels)
        ax.legend(fontsize=8)
    else:
        diverged = sum(len(pair["divergences"]) for pair in pairs)
        ax.text(
            0.5,
            0.5,
            "no divergence" if not diverged else f"{diverged} divergences, no solo margins recorded there",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
    ax.set_xlabel("solo top-1/top-2 margin at the first divergence (logit; each side)")
    ax.set_ylabel("count")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
