"""llorch-ref sweep: a matrix of checks over prompt lengths, decode steps and a subject's settings (harness/sweep.py),
in-process or on Ray; a table, the smallest failing case as one command, --json, --junit and --report (report.html
with a heat map, each failing cell's bundle)."""
from __future__ import annotations

import json

from rich.table import Table

from ..errors import ParameterError
from ..harness.ray_eval import check_cluster_address
from ..harness.sweep import LocalExecutor, Plan, RayExecutor, load_toml, make_spec, run_sweep
from ..harness.sweep_report import junit_xml, render_html, table_rows
from ..harness.text_safety import for_terminal
from ..loaders.default_model import resolve_model
from ..output_paths import check_output
from .common import log
from .report import console_for

OPTIONS = ("subject", "model", "lengths", "steps", "settings", "text", "backend", "threads", "require", "json",
           "junit", "report", "ray")


def sweep_options(args) -> dict:
    """The sweep's options: a TOML file's keys, each overridden by the same option given on the command line."""
    opts = load_toml(args.spec) if args.spec else {}
    for k in OPTIONS:
        v = getattr(args, k)
        if v is not None and v != []:
            opts[k] = v
    if args.no_shrink:
        opts["shrink"] = False
    return opts


def check_fits(spec, cfg):
    """Every cell's prompt and decode steps inside the model's context."""
    need = max(spec.lengths) + max(spec.steps)
    if need > cfg.context_length:
        raise ParameterError(f"--lengths/--steps: {max(spec.lengths)} prompt and {max(spec.steps)} decode tokens "
                             f"exceed the model's context of {cfg.context_length}")


def cmd_sweep(args):
    """Every check that can refuse the run comes before any cell: the spec, the outputs, the Ray address."""
    import llorch_ref
    opts = sweep_options(args)
    base = resolve_model(opts.get("model"))
    spec = make_spec(**{**opts, "model": opts.get("model")})
    check_fits(spec, llorch_ref.load(base, weights="lazy").config)
    outs = {k: check_output(opts[k], inputs=[base], overwrite=args.overwrite, what=f"--{k}")
            for k in ("json", "junit") if opts.get(k)}
    if opts.get("report"):
        outs["report"] = check_output(opts["report"], kind="folder", inputs=[base], overwrite=args.overwrite,
                                      what="--report", owned=("report.html", "junit.xml", "sweep.json", "bundles"))
    ray = opts.get("ray")
    if ray is not None:
        check_cluster_address(ray or None)
    if "report" in outs:
        with outs["report"].staged_folder() as d:
            res = _run(spec, base, ray, str(d / "bundles"))
            (d / "report.html").write_text(render_html(res), encoding="utf-8")
            (d / "junit.xml").write_text(junit_xml(res), encoding="utf-8")
            (d / "sweep.json").write_text(json.dumps(res.to_json(), indent=1) + "\n", encoding="utf-8")
        log(f"llorch-ref: wrote {opts['report']}/report.html")
    else:
        res = _run(spec, base, ray, None)
    print_table(res)
    for k, body in (("json", lambda: json.dumps(res.to_json(), indent=1) + "\n"), ("junit", lambda: junit_xml(res))):
        if k in outs:
            with outs[k].staged_file() as tmp:
                tmp.write_text(body(), encoding="utf-8")
            log(f"llorch-ref: wrote {opts[k]}")
    return res.exit_code


def _run(spec, base, ray, bundle_dir):
    """The sweep on a local executor, or on Ray (ray "" a local Ray, else the cluster's address)."""
    plan = Plan(subject=spec.subject, model=str(base), text=spec.text, backend=spec.backend, threads=spec.threads,
                require=spec.require, bundle_dir=bundle_dir, argv=("llorch-ref", "sweep"))
    ex = LocalExecutor(plan) if ray is None else RayExecutor(plan, address=ray or None)
    n = [0]

    def progress(rec):
        n[0] += 1
        log(f"llorch-ref: cell {n[0]}: L{rec['length']} s{rec['steps']} {rec['settings']} {rec['status']} "
            f"({rec['seconds']:.1f} s)")
    try:
        return run_sweep(spec, ex, progress=progress)
    finally:
        ex.close()


def print_table(res, file=None):
    """The cells (length, steps, settings, verdict, first divergence, seconds), then the counts and the
    smallest failing case's command."""
    con = console_for(file)
    out = res.to_json()
    c = out["counts"]
    t = Table(title=for_terminal(f"sweep of {res.spec.subject}: {len(res.cells)} cells, {c['PASS']} pass, "
                                 f"{c['FAIL']} fail, {c['INCOMPLETE']} incomplete ({res.where}, {res.wall_s:.1f} s)"))
    for col in ("length", "steps", "settings", "verdict", "first divergence", "s"):
        t.add_column(col)
    for row in table_rows(res.cells):
        t.add_row(*map(for_terminal, row))
    con.print(t)
    if res.smallest:
        con.print(for_terminal(f"smallest failing case: {res.smallest['label']}"))
        con.print(for_terminal(f"reproduce: {res.smallest['command']}"), soft_wrap=True)
    con.print(f"verdict: {res.status}")
