"""The guided tour's live view: a recorded trace of real engine steps, drawn as the physical block pool.

Paper §4.2-§4.4 (Figs. 6-8): every sequence has a block table mapping its logical blocks to physical blocks of one
pool; samples of one request share their prompt's blocks (reference counts) and copy a shared, partially filled block
on write (copy-on-write); requests that start with a shared prefix map it to the same physical blocks (§4.4).

The recording (``Frame``, ``record_trace``, ``save_trace`` / ``load_trace``) is in ``pagedattn.repro.experiments.tour_trace`` and
re-exported here. This module draws: ``draw_frame`` draws one frame (the pool as a grid, coloured by owning request,
with reference counts; each sequence's block table beside it), ``BlockPoolView`` wraps the frames in an ipywidgets
slider for JupyterLab (the block tables as text beside the pool), and ``save_gif`` writes the same frames for
headless runs.
"""
from __future__ import annotations

import base64
import html
import io
from functools import lru_cache

from pagedattn.repro.report import plots  # noqa: F401  (selects a headless backend outside a kernel)
from pagedattn.repro.experiments.tour_trace import (Frame, SeqView, copy_on_write_frame, frame_from_manager, load_trace,  # noqa: F401
                                  record_trace, save_trace, snapshot)

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

REQUEST_COLORS = ["#3b75af", "#e4572e", "#4c9a2a", "#9b59b6", "#f2b134", "#17becf", "#8c564b", "#e377c2"]
SHARED_COLOR = "#c9a227"  # a block referenced by more than one request (a shared prefix)
PINNED_COLOR = "#efe3b0"  # a user-marked prefix block held only by the manager
CACHED_COLOR = "#dddddd"  # free, but still holding a cached prefix's K/V (evictable)


# ------------------------------------------------------------------------------------------------ drawing
def request_colors(frames: list[Frame]) -> dict[str, str]:
    """A stable colour per request id, in order of first appearance."""
    ids: dict[str, None] = {}
    for f in frames:
        for r in f.new_requests:
            ids.setdefault(r, None)
        for s in f.seqs:
            ids.setdefault(s.request_id, None)
    return {r: REQUEST_COLORS[i % len(REQUEST_COLORS)] for i, r in enumerate(ids)}


def draw_frame(frame: Frame, colors: dict[str, str] | None = None, cols: int = 8, title: str | None = None,
               tables: bool = True):
    """Draw one frame: the physical block pool as a grid (colour = owning request; gold = shared by several requests;
    pale gold = pinned prefix held only by the manager; grey = free but cached), reference counts in the cells, and,
    with ``tables``, every live sequence's block table on the right under a title line. ``tables=False`` draws the
    pool alone (the live view shows the tables and the step as text beside it). Returns the matplotlib figure."""
    colors = colors or request_colors([frame])
    rows = -(-frame.num_blocks // cols)
    n_lines = max(len(frame.seqs), 1) + 2
    if not tables:  # the grid alone, at the same cell size as below; the title takes 0.3 inch
        width = 5.6
        fig = plt.figure(figsize=(width, (rows + 0.05) * 0.96 * width / (cols + 0.05) + 0.3), dpi=90)
        _draw_pool(fig.add_axes([0.02, 0.0, 0.96, 1 - 0.3 / fig.get_figheight()]), frame, colors, cols)
        return fig
    fig = plt.figure(figsize=(11.5, max(3.4, 0.62 * rows + 1.4, 0.28 * n_lines + 1.2)), dpi=90)
    _draw_pool(fig.add_axes([0.01, 0.06, 0.44, 0.80]), frame, colors, cols)
    _draw_tables(fig.add_axes([0.47, 0.06, 0.52, 0.80]), frame, colors)
    used = sum(1 for c in frame.ref_counts if c)
    head = title or (f"step {frame.step}: {frame.kind}" if frame.step >= 0 else "before the first step")
    extra = []
    if frame.num_copies:
        extra.append(f"copy-on-write: {frame.num_copies} block(s) copied")
    if frame.new_requests:
        extra.append("added " + ", ".join(frame.new_requests))
    if frame.finished:
        extra.append("finished " + ", ".join(frame.finished))
    fig.suptitle(f"{head}   |   {used}/{frame.num_blocks} blocks used" + ("   |   " + "; ".join(extra) if extra else ""),
                 x=0.01, ha="left", fontsize=10.5, weight="bold")
    return fig


def _draw_pool(ax, frame: Frame, colors: dict[str, str], cols: int) -> None:
    owners = frame.owners()
    pinned, cached = set(frame.pinned), set(frame.cached)
    rows = -(-frame.num_blocks // cols)
    for b in range(frame.num_blocks):
        r, c = divmod(b, cols)
        rc = frame.ref_counts[b]
        who = owners.get(b, set())
        hatch = None
        if len(who) > 1:
            face = SHARED_COLOR
        elif who:
            face = colors.get(next(iter(who)), "#777777")
        elif b in pinned:
            face = PINNED_COLOR
        elif rc == 0 and b in cached:
            face, hatch = CACHED_COLOR, ".."
        else:
            face = "white"
        ax.add_patch(Rectangle((c, -r), 0.92, -0.88, facecolor=face, edgecolor="#444444", lw=0.8, hatch=hatch))
        dark = face not in ("white", CACHED_COLOR, PINNED_COLOR)
        ax.text(c + 0.06, -r - 0.08, str(b), fontsize=7, va="top", ha="left", color="white" if dark else "#555555")
        if rc:
            ax.text(c + 0.46, -r - 0.52, f"×{rc}", fontsize=10, va="center", ha="center", weight="bold",
                    color="white" if dark else "#222222")
    ax.set_xlim(-0.05, cols)
    ax.set_ylim(-rows - 0.05, 0.05)
    ax.set_aspect("equal")
    ax.set_anchor("NW")
    ax.axis("off")
    ax.set_title(f"physical block pool ({frame.num_blocks} blocks × {frame.block_size} tokens; ×n = reference count)",
                 fontsize=9, loc="left")


def _draw_tables(tx, frame: Frame, colors: dict[str, str]) -> None:
    tx.axis("off")
    tx.set_title("block tables (logical → physical)", fontsize=9, loc="left")
    n_lines = max(len(frame.seqs), 1) + 2
    y, dy = 0.97, min(0.09, 0.9 / n_lines)
    for s in frame.seqs:
        fill = s.num_tokens - (len(s.blocks) - 1) * frame.block_size if s.blocks else 0
        table = ", ".join(f"[{b}]" if frame.ref_counts[b] > 1 else str(b) for b in s.blocks)
        tx.text(0.0, y, s.label, color=colors.get(s.request_id, "#333333"), fontsize=9,
                weight="bold", va="top", family="monospace")
        tx.text(0.16, y, f"{table}   ({s.num_tokens} tok, last {fill}/{frame.block_size})", fontsize=8.5, va="top",
                family="monospace")
        y -= dy
    if not frame.seqs:
        tx.text(0.0, y, "(no live sequences)", fontsize=9, va="top", color="#777777")
    tx.text(0.0, 0.0, "[b] = physical block shared with another block table", fontsize=7.5, color="#555555",
            va="bottom")


def frame_png(frame: Frame, colors: dict[str, str] | None = None, **kw) -> bytes:
    """One frame as PNG bytes (the figure is closed afterwards)."""
    fig = draw_frame(frame, colors, **kw)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def save_gif(frames: list[Frame], path, duration_ms: int = 800) -> str:
    """All frames as an animated GIF (for headless runs and the results folder)."""
    from PIL import Image

    colors = request_colors(frames)
    images = [Image.open(io.BytesIO(frame_png(f, colors))).convert("RGB") for f in frames]
    size = (max(i.width for i in images), max(i.height for i in images))
    images = [i if i.size == size else _pad(i, size) for i in images]
    images[0].save(path, save_all=True, append_images=images[1:], duration=duration_ms, loop=0, optimize=True)
    return str(path)


def _pad(img, size):
    from PIL import Image

    out = Image.new("RGB", size, "white")
    out.paste(img, (0, 0))
    return out


class BlockPoolView:
    """An ipywidgets view of a trace: play button + step slider over the frames, a caption, the pool drawn as an image
    and every live sequence's block table as text beside it.

    ``view.widget`` is the ipywidgets box; ``view.show(i)`` moves to frame ``i`` (``start`` is the first one shown).
    Displayed in a notebook, the view also carries a PNG of its current frame (block tables included), which a reader
    without a kernel or widget support (an untrusted notebook, a static renderer) sees instead of the widget."""

    def __init__(self, frames: list[Frame], interval_ms: int = 900, start: int = 0) -> None:
        import ipywidgets as w

        if not frames:
            raise ValueError("a trace needs at least one frame")
        if not 0 <= start < len(frames):
            raise ValueError(f"start must be a frame index in [0, {len(frames) - 1}], got {start}")
        self.frames = frames
        self.colors = request_colors(frames)
        self._png = lru_cache(maxsize=None)(lambda i: frame_png(self.frames[i], self.colors, tables=False))
        n = len(frames) - 1
        self.play = w.Play(value=start, min=0, max=n, step=1, interval=interval_ms, description="play")
        self.slider = w.IntSlider(value=start, min=0, max=n, step=1, description="frame",
                                  layout=w.Layout(width="520px"))
        w.jslink((self.play, "value"), (self.slider, "value"))
        self.image = w.Image(value=self._png(start), format="png", layout=w.Layout(max_width="52%"))
        self.caption = w.HTML(value=self._caption(start))
        self.tables = w.HTML(value=self._tables(start))
        self.slider.observe(lambda change: self.show(change["new"]), names="value")
        legend = w.HTML(value=self._legend())
        self.widget = w.VBox([w.HBox([self.play, self.slider]), self.caption, w.HBox([self.image, self.tables]),
                              legend])

    def show(self, i: int) -> None:
        self.image.value = self._png(i)
        self.caption.value = self._caption(i)
        self.tables.value = self._tables(i)
        if self.slider.value != i:
            self.slider.value = i
        if self.play.value != i:  # the play button is linked to the slider in the browser; keep both in step
            self.play.value = i

    def _caption(self, i: int) -> str:
        f = self.frames[i]
        what = f"step {f.step} ({f.kind})" if f.step >= 0 else "before the first step"
        events = [f"added {', '.join(f.new_requests)}"] * bool(f.new_requests)
        events += [f"finished {', '.join(f.finished)}"] * bool(f.finished)
        return (f"<b>frame {i}/{len(self.frames) - 1}</b>: {what}; {len(f.seqs)} live sequences, "
                f"{sum(1 for c in f.ref_counts if c)} of {f.num_blocks} blocks used"
                + (f"; <b>copy-on-write</b> copied {f.num_copies} block(s)" if f.num_copies else "")
                + "".join(f"; {e}" for e in events))

    def _tables(self, i: int) -> str:
        """Frame ``i``'s block tables as an HTML table (one row per sequence; [b] = a block shared with another
        table), marked with the frame index so that what is shown can be checked against the trace."""
        f = self.frames[i]
        rows = "".join(
            f'<tr data-seq="{html.escape(s.label)}"><td style="color:{self.colors.get(s.request_id, "#333")};'
            f'font-weight:bold;padding-right:8px">{html.escape(s.label)}</td>'
            f'<td class="pa-blocks">{" ".join(f"[{b}]" if f.ref_counts[b] > 1 else str(b) for b in s.blocks)}</td>'
            f'<td style="padding-left:8px;color:#555">{s.num_tokens} tok</td></tr>' for s in f.seqs)
        return (f'<div style="font-family:monospace;font-size:12px;padding-left:8px"><div style="font-size:11px">block '
                f'tables (logical → physical; [b] shared)</div><table class="pa-block-tables" data-frame="{i}">{rows}'
                f'</table>{"" if f.seqs else "(no live sequences)"}</div>')

    def _legend(self) -> str:
        items = [(c, r) for r, c in self.colors.items()] + [(SHARED_COLOR, "shared by several requests"),
                                                            (PINNED_COLOR, "pinned prefix (manager only)"),
                                                            (CACHED_COLOR, "free, cached K/V")]
        return " ".join(f'<span style="background:{c};padding:1px 8px;margin-right:2px;border:1px solid #444">'
                        f'</span>{r}&nbsp;&nbsp;' for c, r in items)

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        """The widget for a live kernel, plus the current frame as PNG (with its block tables) for a reader without
        one: JupyterLab prefers the widget, an untrusted notebook or a static renderer falls back to the image."""
        bundle = self.widget._repr_mimebundle_()
        bundle["image/png"] = base64.b64encode(frame_png(self.frames[self.slider.value], self.colors)).decode()
        return bundle


# ---------------------------------------------------------------------------------------- the tour's run
TOUR_PREFIX = 'import os\nimport sys\n\n\ndef read_config(path):\n    """Read a configuration file."""\n'
TOUR_SUFFIXES = {"A": "    with open(path) as f:\n", "B": "    if not os.path.exists(path):\n",
                 "C": "    result = {}\n"}


def tour_requests(tokenizer, max_tokens: int = 14, seed: int = 0) -> tuple[dict[int, list[tuple]], int]:
    """The tour's workload: three requests that share a marked prefix (the paper's §4.4 mode), A greedy (n=1),
    B with n=2 samples and C with n=4 (§4.4 parallel sampling); C arrives three steps later, after the prefix is
    cached. Returns ``arrivals`` for ``record_trace`` and the prefix length in tokens."""
    from pagedattn.sequence import SamplingParams

    prefix = list(tokenizer(TOUR_PREFIX)["input_ids"])
    ids = {r: prefix + list(tokenizer(s, add_special_tokens=False)["input_ids"]) for r, s in TOUR_SUFFIXES.items()}
    sp = {"A": SamplingParams(temperature=0, max_tokens=max_tokens),
          "B": SamplingParams(n=2, temperature=0.8, top_k=20, seed=seed, max_tokens=max_tokens),
          "C": SamplingParams(n=4, temperature=0.8, top_k=20, seed=seed + 1, max_tokens=max_tokens)}
    p = len(prefix)
    return {0: [("A", ids["A"], sp["A"], None, p), ("B", ids["B"], sp["B"], None, p)],
            3: [("C", ids["C"], sp["C"], None, p)]}, p


def tour_engine(model, tokenizer, block_size: int = 8, num_gpu_blocks: int = 40):
    """A small engine for the live view: block size 8 (more, smaller blocks to look at than the default 16)."""
    from pagedattn.engine import LLMEngine

    return LLMEngine(model, tokenizer, block_size=block_size, num_gpu_blocks=num_gpu_blocks,
                     num_cpu_blocks=num_gpu_blocks, watermark=0.0)  # the scheduler's default preemption (vLLM's)
