"""The report of a corpus evaluation: report.md with the statistics and per-chunk figures, two plots (mean
KLD by position in the chunk; the histogram of per-token KLD on a log axis) and report.html, the same in one
self-contained page."""
from __future__ import annotations

from . import plots, report_html
from .text_safety import for_markdown


def write_report(out: dict, target):
    """out: EvalResult.to_json(); target: an output_paths.Output for the folder. The sides' names, the text's name
    and where it ran are escaped (for_markdown): they come from dumps and the command line."""
    with target.staged_folder() as d:
        _plots(out, d)
        lines = [f"# {for_markdown(out['subject'])} vs {for_markdown(out['reference'])}", "",
                 f"Text: {for_markdown(out['text'])}; {out['chunks']} chunks of {out['ctx']} tokens, the second half "
                 f"of each scored ({out['statistics']['scored tokens']} tokens); run {for_markdown(out['where'])}.", "",
                 "| statistic | value |", "|---|---|"]
        for k, v in out["statistics"].items():
            lines.append(f"| {k} | {v[0]:.6g} ± {v[1]:.3g} |" if isinstance(v, list) else f"| {k} | {v:.6g} |"
                         if isinstance(v, float) else f"| {k} | {v} |")
        lines += ["", "Mean KLD by position in the chunk (`kld_by_position.png`):", "",
                  "![mean KLD by position](kld_by_position.png)", "",
                  "Per-token KLD, log axis (`kld_histogram.png`):", "", "![KLD histogram](kld_histogram.png)", "",
                  "| chunk | mean KLD | PPL | PPL(base) | same top |", "|---|---|---|---|---|"]
        lines += [f"| {c['index']} | {c['mean_kld']:.6g} | {c['ppl']:.4f} | {c['ppl_base']:.4f} | {c['same_top']:.4f} |"
                  for c in out["per_chunk"]]
        (d / "report.md").write_text("\n".join(lines) + "\n")
        (d / "report.html").write_text(report_html.render_eval(out))


def _plots(out: dict, d):
    plots.save(plots.kld_by_position(out), d / "kld_by_position.png", dpi=100)
    plots.save(plots.kld_histogram(out), d / "kld_histogram.png", dpi=100)
