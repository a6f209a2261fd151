"""The report of a corpus evaluation: report.md with the statistics and per-chunk figures, and two plots
(mean KLD by position in the chunk; the histogram of per-token KLD on a log axis). matplotlib, Agg."""
from __future__ import annotations


def write_report(out: dict, target):
    """out: EvalResult.to_json(); target: an output_paths.Output for the folder."""
    with target.staged_folder() as d:
        _plots(out, d)
        lines = [f"# {out['subject']} vs {out['reference']}", "",
                 f"Text: {out['text']}; {out['chunks']} chunks of {out['ctx']} tokens, the second half of each scored "
                 f"({out['statistics']['scored tokens']} tokens); run {out['where']}.", "",
                 "| statistic | value |", "|---|---|"]
        for k, v in out["statistics"].items():
            lines.append(f"| {k} | {v[0]:.6g} ± {v[1]:.3g} |" if isinstance(v, list) else f"| {k} | {v:.6g} |"
                         if isinstance(v, float) else f"| {k} | {v} |")
        lines += ["", "![mean KLD by position](kld_by_position.png)", "", "![KLD histogram](kld_histogram.png)", "",
                  "| chunk | mean KLD | PPL | PPL(base) | same top |", "|---|---|---|---|---|"]
        lines += [f"| {c['index']} | {c['mean_kld']:.6g} | {c['ppl']:.4f} | {c['ppl_base']:.4f} | {c['same_top']:.4f} |"
                  for c in out["per_chunk"]]
        (d / "report.md").write_text("\n".join(lines) + "\n")


def _plots(out: dict, d):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = out["ctx"] // 2
    k = out["kld_by_position"]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(range(first, first + len(k)), k)
    ax.set_xlabel("position in the chunk")
    ax.set_ylabel("mean KLD over chunks")
    ax.set_title(f"{out['subject']}: KLD by position")
    fig.tight_layout()
    fig.savefig(d / "kld_by_position.png", dpi=100)
    plt.close(fig)
    stats = out["statistics"]
    fig, ax = plt.subplots(figsize=(9, 4))
    lo = max(stats["Minimum KLD"], 1e-12)
    hi = max(stats["Maximum KLD"], lo * 10)
    ax.hist([max(c, lo) for c in out["kld_values"]], bins=[lo * (hi / lo) ** (i / 60) for i in range(61)])
    ax.set_xscale("log")
    ax.set_xlabel("KLD per scored token (clipped below at the smallest positive)")
    ax.set_ylabel("tokens")
    fig.tight_layout()
    fig.savefig(d / "kld_histogram.png", dpi=100)
    plt.close(fig)
