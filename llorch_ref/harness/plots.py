"""The figures of reports (matplotlib, Agg): error by layer with the layer kinds marked, a heat map of
|difference| over tokens x channels, KLD by position and its histogram. Each function returns a Figure; `svg`,
`png` and `save` turn one into what a report embeds or writes. Without matplotlib (the `plot` extra),
`available()` is False and reports say so instead of drawing."""
from __future__ import annotations

import base64
import io


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def svg(fig) -> str:
    """The figure as inline SVG markup (the XML prolog dropped); the figure is closed."""
    import matplotlib
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none"}):          # text as text, not glyph paths: a small page
        fig.savefig(buf, format="svg", metadata={"Date": None})   # no date: the same figures give the same page
    _plt().close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]


def png(fig, dpi=100) -> str:
    """The figure as a data: URI of a PNG (for an <img>); the figure is closed."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    _plt().close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _plain(*texts):
    """Text objects drawn as the characters they hold: names come from files and command lines, and a `$` in
    one must not start mathtext (which raises on what it cannot parse) nor a `\\` reach LaTeX."""
    for t in texts:
        t.set_usetex(False)
        t.set_parse_math(False)


def _plain_axes(ax):
    """_plain on an axes' title, labels and legend entries."""
    leg = ax.get_legend()
    _plain(ax.title, ax.xaxis.label, ax.yaxis.label, *(leg.get_texts() if leg else ()))


def save(fig, path, dpi=90, close=True):
    fig.savefig(path, dpi=dpi)
    if close:
        _plt().close(fig)


def error_by_layer(title: str, series: dict, band: float | None, local_layers=None, local_series=None,
                   figsize=(7, 3.5)):
    """series: {tensor: ([layer], [NMSE])} end to end; local_series likewise (dashed), where measured;
    band: the NMSE band (a red line); local_layers: [L] bool, local (sliding-window) layers shaded."""
    from matplotlib.ticker import MaxNLocator

    plt = _plt()
    fig, ax = plt.subplots(figsize=figsize)
    for k, is_local in enumerate(local_layers or []):
        if is_local:
            ax.axvspan(k - 0.5, k + 0.5, color="#e8eef8", lw=0, label="local (sliding-window) layer"
                       if k == next(i for i, v in enumerate(local_layers) if v) else None)
    for tensor, (layers, nmse) in series.items():
        line, = ax.semilogy(layers, [max(v, 1e-20) for v in nmse], marker="o", ms=3, label=tensor)
        if local_series and tensor in local_series:
            ll, ln = local_series[tensor]
            ax.semilogy(ll, [max(v, 1e-20) for v in ln], ls=":", marker="x", ms=3, color=line.get_color(),
                        label=f"{tensor} (local)")
    if band is not None:
        ax.axhline(band, color="red", ls="--", label="band (NMSE)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("layer")
    ax.set_ylabel("NMSE vs reference")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=6, ncol=2)
    _plain_axes(ax)
    fig.tight_layout()
    return fig


def heatmap(a, title: str, xlabel="channel", ylabel="token (row held)", figsize=(7, 3.2)):
    """a [rows, channels]: |difference| on a log colour scale (zeros shown at the smallest positive value)."""
    import numpy as np
    from matplotlib.colors import LogNorm

    plt = _plt()
    a = np.abs(np.asarray(a, dtype=np.float64))
    pos = a[a > 0]
    lo = float(pos.min()) if pos.size else 1e-30
    hi = max(float(a.max()), lo * 10)
    fig, ax = plt.subplots(figsize=figsize)
    im = ax.imshow(np.maximum(a, lo), aspect="auto", interpolation="nearest", norm=LogNorm(lo, hi), cmap="magma")
    fig.colorbar(im, ax=ax, label="|difference|")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    _plain_axes(ax)
    fig.tight_layout()
    return fig


def kld_by_position(out: dict, figsize=(9, 4)):
    """out: EvalResult.to_json(): the mean KLD over chunks at each scored position."""
    plt = _plt()
    first = out["ctx"] // 2
    k = out["kld_by_position"]
    fig, ax = plt.subplots(figsize=figsize)
    ax.plot(range(first, first + len(k)), k)
    ax.set_xlabel("position in the chunk")
    ax.set_ylabel("mean KLD over chunks")
    ax.set_title(f"{out['subject']}: KLD by position")
    _plain_axes(ax)
    fig.tight_layout()
    return fig


def kld_histogram(out: dict, figsize=(9, 4)):
    """The histogram of per-token KLD on a log axis (clipped below at the smallest positive value)."""
    plt = _plt()
    stats = out["statistics"]
    fig, ax = plt.subplots(figsize=figsize)
    lo = max(stats["Minimum KLD"], 1e-12)
    hi = max(stats["Maximum KLD"], lo * 10)
    ax.hist([max(c, lo) for c in out["kld_values"]], bins=[lo * (hi / lo) ** (i / 60) for i in range(61)])
    ax.set_xscale("log")
    ax.set_xlabel("KLD per scored token (clipped below at the smallest positive)")
    ax.set_ylabel("tokens")
    fig.tight_layout()
    return fig
