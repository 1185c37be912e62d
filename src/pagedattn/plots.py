"""Shared plotting (matplotlib + seaborn): paper-vs-ours figures labelled with hardware, model and date."""
from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

if "ipykernel" not in sys.modules:
    matplotlib.use("Agg")  # headless outside a notebook kernel
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

KIND_COLORS = {"token_states": "#4c9a2a", "reserved": "#f2b134", "internal": "#e4572e", "external": "#8a8a8a"}
KIND_LABELS = {"token_states": "token states", "reserved": "reserved", "internal": "internal frag.",
               "external": "external frag. & free"}


def footnote(fig, text: str) -> None:
    """Label a figure with where its numbers come from (hardware, model, date)."""
    fig.text(0.01, 0.005, text, fontsize=7, color="#555555", ha="left", va="bottom")


def savefig(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130, bbox_inches="tight")
    return path


def stacked_shares(df: pd.DataFrame, title: str, label: str = ""):
    """Horizontal stacked bars of KV slot shares. ``df``: index = bar names, columns = the four kinds (percent)."""
    sns.set_theme(style="whitegrid", context="notebook")
    fig, ax = plt.subplots(figsize=(8, 0.55 * len(df) + 1.6))
    left = pd.Series(0.0, index=df.index)
    for kind, color in KIND_COLORS.items():
        vals = df[kind].fillna(0.0)
        ax.barh(df.index, vals, left=left, color=color, label=KIND_LABELS[kind], edgecolor="white")
        for y, (v, l0) in enumerate(zip(vals, left)):
            if v >= 4:
                ax.text(l0 + v / 2, y, f"{v:.1f}", ha="center", va="center", fontsize=8, color="white")
        left += vals
    ax.set_xlim(0, 100)
    ax.invert_yaxis()
    ax.set_xlabel("share of KV memory (%)")
    ax.set_title(title)
    ax.legend(ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.18), fontsize=8, frameon=False)
    if label:
        footnote(fig, label)
    fig.tight_layout()
    return fig
