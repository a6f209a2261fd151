"""A long prompt (4096 tokens by default) on a model against llama.cpp, every checkpoint at sampled rows, each
command timed and its peak memory read from wait4 (what /usr/bin/time prints); a plot of the error by position and a report.

--mode diff (default): `llorch-ref diff --prompt-file F --rows R` (llorch-ref, exact float32, against
llama.cpp with its default n_ubatch 512: micro-batches), end-to-end figures under the weight class's bands.
--mode subject: llama.cpp's dump with --rows, then `diff --subject` on it (the reference in llama.cpp's declared
arithmetic: local and end-to-end errors by position; the ggml emulation of attention is slow on long prompts).

    python tools/long_context.py [--model M] [--tokens 4096] [--rows every:64] [--text FILE] [--mode diff|subject]
        [--settings f32|production] [--backend numpy|numba] --out-dir results/long [--memory-points FILE.json] [--batch N]

--memory-points FILE.json: the run's peak resident memory and wall time are added to FILE.json (one point per
prompt length, rows and backend; a later run of the same key replaces its point), and FILE.png/FILE.md are
drawn again from every point held: memory by prompt length, grown one run at a time.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import llorch_ref
from llorch_ref.harness.bundle import cpu_model
from llorch_ref.harness.metrics import fmt
from llorch_ref.loaders.default_model import resolve_model

TEXT = Path("/usr/share/common-licenses/GPL-3")       # natural English text present on Debian machines
SETTINGS = {"f32": [], "production": ["--flash-attn", "--kv-dtype", "float16"]}


def prompt_of(tokenizer, text: str, n: int) -> str:
    """The longest prefix of text (repeated as needed) that tokenizes to at most n tokens."""
    while len(tokenizer.encode(text)) < n:
        text = text + "\n\n" + text
    lo, hi = 1, len(text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if len(tokenizer.encode(text[:mid])) <= n else (lo, mid - 1)
    return text[:lo]


def timed(cmd: list, out=None, env=None, every: float = 1.0) -> dict:
    """Run a command -> {"wall_s", "peak_rss_mb", "rc", "rss_trace"}; stdout to `out` if given. peak_rss_mb: the
    command's own maximum resident set (wait4's ru_maxrss, the figure /usr/bin/time prints, so no such program is
    needed); rss_trace: [seconds since the start, MB] every `every` s, the largest resident set among the
    command and its children; peak_tmp_mb: the most the run's temporary stores (tmp_mb) held on disk at a look."""
    import os
    import threading
    import time

    print("+ " + " ".join(map(str, cmd)), flush=True)
    with open(out, "w") if out else open(os.devnull, "w") as so:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=so, stderr=sys.stderr, env=env)
        trace, done = [], threading.Event()
        sampler = threading.Thread(target=_sample_rss, args=(proc.pid, trace, t0, every, done), daemon=True)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        done.set()
        sampler.join()
        proc.returncode = os.waitstatus_to_exitcode(status)      # reaped here: Popen must not wait again
    return {"wall_s": round(wall, 2), "peak_rss_mb": usage.ru_maxrss / 1024, "rc": proc.returncode,
            "peak_tmp_mb": max((d for _, _, d in trace), default=0.0), "rss_trace": [x[:2] for x in trace]}


def tmp_mb() -> float:
    """MB in the temporary folders llorch-ref's stores make (llorch-spill-*, llorch-capture-*) now."""
    import os

    total = 0
    for d in Path(tempfile.gettempdir()).glob("llorch-*"):
        for root, _, files in os.walk(d):
            for f in files:
                try:
                    total += os.stat(os.path.join(root, f)).st_size
                except OSError:
                    pass                       # deleted between the listing and the look
    return round(total / 2**20, 1)


def _sample_rss(pid: int, trace: list, t0: float, every: float, done):
    import time

    import psutil

    while not done.is_set():
        try:
            me = psutil.Process(pid)
            mb = max(p.memory_info().rss for p in [me] + me.children(recursive=True)) / 2**20
            trace.append([round(time.perf_counter() - t0, 1), round(mb, 1), tmp_mb()])
        except psutil.Error:
            pass
        done.wait(every)


def phase_peaks(trace: list, wall_s: float, timings: dict) -> dict:
    """The trace's peak in llama.cpp's capture and in llorch-ref's recording and comparison: the diff's own
    timings (llamacpp_s, then ours_s and compare_s, total_s in all) placed at the end of the wall time less
    a second for writing the result (the load runs before them)."""
    if not trace or "llamacpp_s" not in timings:
        return {}
    start = wall_s - timings["total_s"] - 1.0
    cut = start + timings["llamacpp_s"]
    peak = lambda a, b: max((mb for t, mb in trace if a <= t < b), default=None)     # noqa: E731
    return {"load_mb": peak(0, start), "llamacpp_mb": peak(start, cut), "ours_and_compare_mb": peak(cut, wall_s + 1)}


def blas_env(n):
    """The environment of the measured command where n is given: LLORCH_THREADS=n (the threads llorch-ref's backend
    sets BLAS and numba to: OPENBLAS_NUM_THREADS alone is overridden by the numpy backend's own limit), and
    OPENBLAS_NUM_THREADS and OMP_NUM_THREADS."""
    import os

    return None if n is None else {**os.environ, "LLORCH_THREADS": str(n), "OPENBLAS_NUM_THREADS": str(n),
                                   "OMP_NUM_THREADS": str(n)}


def plot(bp: dict, path: Path, title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pos = bp["positions"]
    fig, ax = plt.subplots(figsize=(10, 5))
    floor = 1e-18            # a bit-equal row (NMSE 0) is drawn at the floor
    def draw(ys, **kw):
        ax.plot(pos, [max(y, floor) for y in ys], **kw)
    draw(bp["worst_nmse"], label="worst end-to-end NMSE (any tensor, any layer)", color="C0", lw=2)
    if bp["worst_local_nmse"]:
        draw(bp["worst_local_nmse"], label="worst local NMSE (the op on llama.cpp's own inputs)", color="C3", lw=2)
    for name, c in (("l_out", "C1"), ("kq_soft_max", "C2"), ("logits", "C4")):
        if name in bp["by_tensor"]:
            draw(bp["by_tensor"][name], label=f"{name} end to end (worst layer)", color=c, ls="--")
    ax.set_yscale("log")
    ax.set_xlabel("position in the prompt")
    ax.set_ylabel("NMSE against the reference")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(True, which="major", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rows", default="every:64")
    ap.add_argument("--text", default=str(TEXT))
    ap.add_argument("--settings", choices=list(SETTINGS), default="f32")
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("--mode", choices=["diff", "subject"], default="diff")
    ap.add_argument("--greedy", type=int, default=16)
    ap.add_argument("--batch", type=int, default=None,
                    help="--mode diff: llama.cpp's n_batch (default its 2,048): its logits buffer holds n_batch rows")
    ap.add_argument("--out-dir", default=None, help="where the run's files go (required but with --redraw)")
    ap.add_argument("--memory-points", default=None, help="add this run's peak memory to FILE.json and redraw it")
    ap.add_argument("--blas-threads", type=int, default=None,
                    help="the run's threads, as LLORCH_THREADS: llorch-ref's BLAS and numba, and llama.cpp's in a "
                         "diff (1 on a machine whose cores other work holds)")
    ap.add_argument("--redraw", action="store_true",
                    help="draw --memory-points FILE.json's plot and table again from its points, running nothing")
    a = ap.parse_args()
    if a.redraw:
        if not a.memory_points or not Path(a.memory_points).is_file():
            ap.error("--redraw needs --memory-points FILE.json (an existing file)")
        held = json.loads(Path(a.memory_points).read_text())["points"]
        draw_points(Path(a.memory_points), held, held[0]["model"] if held else "no points")
        return
    if not a.out_dir:
        ap.error("--out-dir is required")
    a.commit = code_commit()
    path = resolve_model(a.model)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{path.stem}-{a.tokens}-{a.settings}"
    eng = llorch_ref.load(path)
    prompt = prompt_of(eng.tokenizer, Path(a.text).read_text(encoding="utf-8"), a.tokens)
    n = len(eng.tokenizer.encode(prompt))
    with tempfile.TemporaryDirectory() as tmp:
        pf, dump, js = Path(tmp) / "prompt.txt", Path(tmp) / "llamacpp.safetensors", out / f"{stem}-{a.mode}.json"
        pf.write_text(prompt, encoding="utf-8")
        cli = [sys.executable, "-m", "llorch_ref.cli"]
        steps = []
        if a.mode == "diff":
            if a.settings != "f32":
                raise SystemExit("--mode diff runs llama.cpp with an F32 cache (the exact-numerics bands' setting)")
            steps.append(("`diff --prompt-file --rows` (llama.cpp's dump and llorch-ref's, compared)", timed(
                cli + ["diff", "--model", path, "--prompt-file", pf, "--rows", a.rows, "--greedy", str(a.greedy),
                       "--backend", a.backend, "--json"] + (["--batch", str(a.batch)] if a.batch else []),
                out=js, env=blas_env(a.blas_threads)), ""))
        else:
            t = timed(cli + ["dump", "--engine", "llamacpp", "--model", path, "--prompt-file", pf, "--rows", a.rows,
                             "--greedy", str(a.greedy), "--out", dump] + SETTINGS[a.settings])
            steps.append(("llama.cpp dump (`dump --engine llamacpp --rows`)", t,
                          f"dump file {dump.stat().st_size / 2**20:.0f} MB"))
            steps.append((f"`diff --subject` (reference on {a.backend})", timed(
                cli + ["diff", "--subject", dump, "--model", path, "--backend", a.backend, "--json"], out=js), ""))
    res = json.loads(js.read_text())
    run = steps[-1][1]
    res["rss"] = {"every_s": 1.0, "phase_peaks_mb": phase_peaks(run["rss_trace"], run["wall_s"], res["timings"]),
                  "trace": run.pop("rss_trace")}
    for _, t, _ in steps:
        t.pop("rss_trace", None)
    js.write_text(json.dumps(res, indent=1) + "\n")
    bp = res["by_position"]
    png = out / f"{stem}-{a.mode}.png"
    plot(bp, png, f"{path.name}: llama.cpp ({a.settings}) vs llorch-ref, {n} tokens, {len(bp['positions'])} rows")
    write_report(out / f"{stem}-{a.mode}.md", a, path, n, res, steps, png, js)
    stamp_json(js, a.commit, command_of(a))
    if a.memory_points:
        add_memory_point(Path(a.memory_points), a, path, n, res, steps)


def code_commit() -> str:
    """The commit of the code as the run starts: git's, else $LLORCH_COMMIT (a copy of the tree without its .git,
    as a remote machine gets it), else "unknown"."""
    import os

    try:
        got = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        got = ""
    return got or os.environ.get("LLORCH_COMMIT") or "unknown"


def command_of(a) -> str:
    return ("python tools/long_context.py" + (f" --model {a.model}" if a.model else "")
            + f" --tokens {a.tokens} --rows {a.rows} --settings {a.settings} "
            f"--backend {a.backend} --mode {a.mode} --greedy {a.greedy} --out-dir {a.out_dir}"
            + (f" --memory-points {a.memory_points}" if a.memory_points else "")
            + (f" --blas-threads {a.blas_threads}" if a.blas_threads else "")
            + (f" --batch {a.batch}" if a.batch else ""))


def stamp_json(js: Path, commit: str, command: str):
    """The raw result with its command and commit as its first key, made_by (what results/ asks of a file)."""
    body = json.loads(js.read_text())
    body.pop("made_by", None)
    js.write_text(json.dumps({"made_by": {"commit": commit, "command": command}, **body}, indent=1) + "\n")


def add_memory_point(pf: Path, a, path, n, res, steps):
    """This run's peak RSS and wall time as a point of pf (JSON), then pf's plot and table drawn again."""
    pts = json.loads(pf.read_text()) if pf.exists() else {"points": []}
    pts.pop("made_by", None)
    commit = a.commit
    t = steps[-1][1]
    key = {"tokens": n, "rows": a.rows, "backend": a.backend, "mode": a.mode, "settings": a.settings}
    pts["points"] = [p for p in pts["points"] if {k: p.get(k) for k in key} != key]
    rows_held = len(res["by_position"]["positions"])
    pts["points"].append({**key, "model": path.name, "peak_rss_mb": round(t["peak_rss_mb"], 1),
                          "peak_tmp_mb": t.get("peak_tmp_mb"),
                          "wall_s": round(t["wall_s"], 1), "rows_held": rows_held, "passed": res["passed"],
                          "first_divergence": res["first_divergence"], "commit": commit, "cpu": cpu_model(),
                          "command": f"python tools/long_context.py --tokens {a.tokens} --rows {a.rows} "
                                     f"--settings {a.settings} --backend {a.backend} --mode {a.mode} "
                                     f"--out-dir {a.out_dir} --memory-points {pf}"
                                     + (f" --blas-threads {a.blas_threads}" if a.blas_threads else "")})
    pts["points"].sort(key=lambda p: (p["mode"], p["backend"], p["rows"], p["tokens"]))
    pts = {"made_by": {"commit": a.commit, "command": "python tools/long_context.py ... --memory-points "
                       f"{pf} (one run per point: each point's own command and commit below)"}, **pts}
    pf.write_text(json.dumps(pts, indent=1) + "\n")
    draw_points(pf, pts["points"], path.name)
    print(f"added a point to {pf}; drew {pf.with_suffix('.png')}")


def draw_points(pf: Path, points, model_name: str):
    """pf's plot (PNG) and table (.md) drawn from its points (each point's command and commit named)."""
    draw_memory(points, pf.with_suffix(".png"))
    pts = {"points": points}
    lines = [f"# Peak resident memory by prompt length ({model_name})", "",
             "Commits: " + ", ".join(sorted({p["commit"] for p in pts["points"]})) + " (each point's below).", "",
             "Each point: one `llorch-ref diff --prompt-file` run (llama.cpp's dump and llorch-ref's, compared), "
             "peak RSS of the diff's process read from wait4 (what `/usr/bin/time` prints), one run at a time, niced, on a machine "
             "shared with other work. Points added by `--memory-points`; the command and commit of each are below.",
             "", f"![memory by prompt length]({pf.with_suffix('.png').name})", "",
             "| tokens | rows | backend | peak RSS (MB) | temporary disk (MB) | wall (s) | rows held | passed | commit | CPU |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for p in pts["points"]:
        disk = "-" if p.get("peak_tmp_mb") is None else f"{p['peak_tmp_mb']:.0f}"
        lines.append(f"| {p['tokens']} | {p['rows']} | {p['backend']} | {p['peak_rss_mb']:.0f} | {disk} | {p['wall_s']:.0f} | "
                     f"{p['rows_held']} | {p['passed']} | {p['commit']} | {p['cpu']} |")
    lines += ["", "Commands:", ""] + [f"- `{p['command']}` (commit {p['commit']})" for p in pts["points"]]
    pf.with_suffix(".md").write_text("\n".join(lines) + "\n")


def draw_memory(points, png: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    series = {}
    for p in points:
        series.setdefault(f"rows {p['rows']}, {p['backend']}, commit {p['commit']}", []).append(p)   # one code a line
    for label, ps in series.items():
        ax.plot([p["tokens"] for p in ps], [p["peak_rss_mb"] / 1024 for p in ps], "o-", label=label)
    ax.axhline(4.0, color="grey", ls="--", lw=1, label="4 GB target")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("peak RSS (GB)")
    ax.set_title("llorch-ref diff --prompt-file against llama.cpp: peak memory")
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def write_report(md: Path, a, path, n, res, steps, png, js):
    bp = res["by_position"]
    fd = res["first_divergence"]
    lines = [f"# {n}-token prompt: llama.cpp ({a.settings}) against llorch-ref on {path.name}", "",
             f"Commit: {a.commit}.", "",
             f"Command: `{command_of(a)}`. CPU: {cpu_model()}. Text: `{a.text}`.",
             "", f"{res['subject']} against {res['reference']}; band class {res['band_class']}"
             + (f"; local errors in {res['local_declaration']} arithmetic" if res["local_declaration"] else "") + ".", "",
             f"Rows kept: {len(bp['positions'])} ({a.rows}); every checkpoint compared at them, caches at every "
             f"position. First divergence: {'none' if fd is None else fd}. Passed: {res['passed']}.", "",
             "| command | wall (s) | peak RSS (MB) | note |", "|---|---|---|---|"]
    lines += [f"| {what} | {t['wall_s']:.0f} | {t['peak_rss_mb']:.0f} | {note} |" for what, t, note in steps]
    lines += ["", f"Temporary disk (llorch-ref's stores under {tempfile.gettempdir()}), most held at a 1 s look: "
              f"{steps[-1][1]['peak_tmp_mb']:.0f} MB."]
    pk = res["rss"]["phase_peaks_mb"]
    if pk:
        lines += ["", "Peak resident set by phase (MB; a 1 s trace of the run's largest process, cut at the diff's "
                  "own timings; trace in the raw result): " + ", ".join(
                      f"{k.removesuffix('_mb').replace('_', ' ')} {v:.0f}" for k, v in pk.items() if v is not None)]
    lines += ["", "Timings inside the run (s): " + ", ".join(f"{k} {v:.1f}" for k, v in res["timings"].items()), "",
             f"![error by position]({png.name})", "", "## Checkpoints", "",
             "| checkpoint | comparisons | failed | worst NMSE | worst max abs | worst at | verdict |", "|---|---|---|---|---|---|---|"]
    for s in res["summary"]:
        at = s["worst_at"]
        lines.append(f"| {s['checkpoint']} {s['name']} | {s['rows']} | {s['failed']} | {fmt(s['worst_nmse'])} | "
                     f"{fmt(s['worst_max_abs'])} | {'' if at['layer'] is None else 'L' + str(at['layer']) + ' '}"
                     f"{at['tensor']} | {'pass' if s['passed'] else 'FAIL' if s['passed'] is False else 'not covered'} |")
    shown = range(0, len(bp["positions"]), max(1, len(bp["positions"]) // 128))   # at most about 128 lines
    lines += ["", "## Error by position", "", f"{len(shown)} of the {len(bp['positions'])} rows held, evenly spaced "
              "(every row's figures are in the raw result).", "",
              "| position | worst NMSE | at | worst local NMSE | at (local) |",
              "|---|---|---|---|---|"]
    for i in shown:
        p = bp["positions"][i]
        loc = (fmt(bp["worst_local_nmse"][i]), bp["local_worst_at"][i]) if bp["worst_local_nmse"] else ("-", "-")
        lines.append(f"| {p} | {fmt(bp['worst_nmse'][i])} | {bp['worst_at'][i]} | {loc[0]} | {loc[1]} |")
    lines += ["", f"Raw result: `{js.name}`."]
    md.write_text("\n".join(lines) + "\n")
    print(f"wrote {md}, {png}")


if __name__ == "__main__":
    main()
