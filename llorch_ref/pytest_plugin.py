"""pytest plugin (entry point pytest11 'llorch'): run the checkpoint suite against any engine.

    pytest --llorch-subject=my_package.module:make_dump [--llorch-model PATH] [--llorch-bundle-dir DIR]
    pytest --llorch-dump=dump.safetensors [--llorch-model PATH]
    pytest --llorch-subject=openai:URL|mistralrs [--llorch-decode-steps N] [--llorch-top-logprobs K] [--llorch-chat]

The subject MODULE is imported by its import path (importlib.import_module): from the current folder under
`python -m pytest` (which puts it on sys.path), else from PYTHONPATH or an installed package; the `pytest`
script alone does not add the current folder (`PYTHONPATH=. pytest ...`).

The subject protocol: a callable `f(model_path: str, token_ids: list[int]) -> Recorder | Dump | path`,
which runs the engine on the model and returns its checkpoint tensors (llorch_ref.dump.Recorder); with
--llorch-decode-steps N it is called with decode_steps=N and records N decode steps after the prompt
(Recorder.add(..., step=k), the fed tokens in decode_token_ids); with --llorch-rows SPEC, with rows=[indices]
(the prompt rows to keep: Recorder(..., rows=rows) cuts what is added); with --llorch-ubatch N, with ubatch=N
(feed the prompt in micro-batches of N tokens). The reference runs the same tokens. The
reference is llorch-ref (numpy, exact) on --llorch-model (default: the default model). One test per
checkpoint and layer ('llorch::cp2_qkv[layer3]'); a test fails when a tensor leaves its band, and is
skipped, with the reason, where the subject does not cover it. Without either option the plugin adds
nothing.

A black-box subject, spelled as for `llorch-ref diff --subject`: `openai:URL` (an OpenAI-compatible server's
greedy tokens and top-K log-probabilities) or `mistralrs` (mistral.rs on --llorch-model, the whole vocabulary),
compared step by step with the reference teacher-forced on the engine's tokens (harness/blackbox.py): one test per
checkpoint it gives (cp0 the tokenization, cp10 the argmax, cp11 the log-probabilities; a failure names the
first step outside its band with both distributions' top entries) and the verdict, the same as diff's.
"""
from __future__ import annotations

import pytest


def pytest_addoption(parser):
    from .harness.blackbox_options import add_blackbox_options

    g = parser.getgroup("llorch", "llorch-ref checkpoint suite against an engine under test")
    g.addoption("--llorch-subject", default=None, metavar="MODULE:CALLABLE",
                help="callable(model_path, token_ids) -> llorch_ref.dump.Recorder (the engine under test)")
    g.addoption("--llorch-dump", default=None, metavar="FILE", help="a llorch-dump file to check instead")
    g.addoption("--llorch-model", default=None, metavar="PATH",
                help="model the reference (llorch-ref) runs (default: the default model)")
    g.addoption("--llorch-prompt", default=None, help="prompt the subject is run on (default: the harness prompt)")
    g.addoption("--llorch-prompt-file", default=None, metavar="FILE", help="read the prompt from this UTF-8 file")
    g.addoption("--llorch-rows", default=None, metavar="SPEC",
                help="prompt rows the subject keeps (passed as rows=[...]): last, every:K or 0,5,100-199")
    g.addoption("--llorch-ubatch", type=int, default=None, metavar="N",
                help="micro-batch size the subject feeds the prompt in (passed as ubatch=N)")
    g.addoption("--llorch-bundle-dir", default=None, metavar="DIR", help="write proof bundles here")
    g.addoption("--llorch-band-class", default=None, help="band class (default: from the model's weight types)")
    g.addoption("--llorch-decode-steps", type=int, default=0,
                help="decode steps the subject records after the prompt (passed to it as decode_steps=N; the "
                     "reference runs the same tokens)")
    g.addoption("--llorch-require", default="auto", metavar="WHAT",
                help="what must be compared for a PASS, as diff --require: auto (every tensor the subject's engine "
                     "kind can provide), all, or checkpoint ids, names and cp<id>.<tensor> keys")
    add_blackbox_options(g.addoption, "--llorch-")
    g.addoption("--llorch-greedy", type=int, default=0,
                help="greedy tokens the reference generates to compare with the subject's cp12 (default: as many "
                     "as the subject recorded)")


class _State:
    result = None
    error = None
    bundle = None


def is_blackbox(subject) -> bool:
    """openai:URL or mistralrs (cli's rule: anything else is MODULE:CALLABLE)."""
    return bool(subject) and (subject.startswith("openai:") or subject == "mistralrs")


def _compute_blackbox(config, eng):
    """A black box's greedy run, compared step by step with the reference teacher-forced on its tokens."""
    from .errors import ParameterError
    from .harness.blackbox import compare_trace
    from .harness.run import DEFAULT_PROMPT
    from .references.blackbox import mistralrs_trace, openai_trace

    opt = config.getoption
    subject, steps = opt("llorch_subject"), opt("llorch_decode_steps") or 32
    unused = [f for f, on in (("--llorch-rows", opt("llorch_rows")), ("--llorch-ubatch", opt("llorch_ubatch")),
                              ("--llorch-band-class", opt("llorch_band_class")),
                              ("--llorch-chat", opt("llorch_chat") and subject == "mistralrs")) if on]
    if unused:
        raise ParameterError(f"{', '.join(unused)}: not a setting of --llorch-subject {subject}")
    if eng.tokenizer is None:
        raise ParameterError("this model has no vocabulary: a black box's tokens are named by it")
    prompt = _prompt(opt) or DEFAULT_PROMPT
    if subject == "mistralrs":
        trace = mistralrs_trace(eng.path, prompt, eng.tokenizer, n_steps=steps, top_k=opt("llorch_top_logprobs"))
    else:
        trace = openai_trace(subject[len("openai:"):], prompt, eng.tokenizer, n_steps=steps,
                             top_k=opt("llorch_top_logprobs") or 20, chat=opt("llorch_chat"),
                             timeout=opt("llorch_timeout"))
    res = compare_trace(eng, trace, require=opt("llorch_require"))
    res.verdict()
    if opt("llorch_bundle_dir"):
        from .harness.bundle import write_bundle
        _State.bundle = write_bundle(res, eng, out_dir=opt("llorch_bundle_dir"),
                                     argv=["pytest"] + list(config.invocation_params.args), plot=False, trace=trace)
    return res, eng.config


def _compute(config, eng):
    """Run the subject (or read the dump), run the reference, compare; once per session."""
    from .dump import check_rows, load_dump, parse_rows
    from .harness.run import DEFAULT_PROMPT, run_subject
    from .harness.subject import as_dump, load_callable

    opt = config.getoption
    if is_blackbox(opt("llorch_subject")):
        return _compute_blackbox(config, eng)
    if opt("llorch_dump"):
        sub = load_dump(opt("llorch_dump"))
        label = f"{sub.engine} (dump {opt('llorch_dump')})"
    else:
        fn = load_callable(opt("llorch_subject"), "--llorch-subject")
        prompt = _prompt(opt) or DEFAULT_PROMPT
        ids = eng.tokenizer.encode(prompt)
        kw = {"decode_steps": opt("llorch_decode_steps") or None, "ubatch": opt("llorch_ubatch"),
              "rows": check_rows(parse_rows(opt("llorch_rows"), len(ids)), len(ids))}
        out = fn(str(eng.path), list(ids), **{k: v for k, v in kw.items() if v is not None})
        sub = as_dump(out, opt("llorch_subject"), "--llorch-subject", prompt=prompt)
        label = f"{sub.engine} (subject {opt('llorch_subject')})"
    res = run_subject(eng, sub, opt("llorch_band_class"), subject_label=label, n_greedy=opt("llorch_greedy"),
                      require=opt("llorch_require"))          # in the dump's declared arithmetic, as diff --subject
    res.verdict()                                              # a --llorch-require naming nothing is refused here
    if opt("llorch_bundle_dir"):
        from .harness.bundle import write_bundle
        _State.bundle = write_bundle(res, eng, out_dir=opt("llorch_bundle_dir"),
                                      argv=["pytest"] + list(config.invocation_params.args), plot=False)
    return res, eng.config


def _prompt(opt):
    from .errors import ParameterError
    from .loaders.text_file import read_text_file

    f = opt("llorch_prompt_file")
    if f is None:
        return opt("llorch_prompt")
    if opt("llorch_prompt"):
        raise ParameterError("give --llorch-prompt or --llorch-prompt-file, not both")
    return read_text_file(f, "--llorch-prompt-file")


class CheckpointItem(pytest.Item):
    def __init__(self, *, spec, layer, **kw):
        super().__init__(**kw)
        self.spec, self.layer = spec, layer

    def runtest(self):
        if _State.error is not None:
            raise RuntimeError(f"the subject failed before any checkpoint could be compared: "
                               f"{type(_State.error).__name__}: {_State.error}") from _State.error
        res = _State.result
        rows = [r for r in res.rows if r.checkpoint == self.spec.id and r.layer == self.layer]
        missing = [u for u in res.not_covered if u["checkpoint"] == self.spec.id and u["layer"] == self.layer]
        bad = [r for r in rows if r.diverges]        # by local error where there is one, else end to end
        if bad:
            raise CheckpointFailure(self.spec, bad, res)
        if not rows:
            pytest.skip(f"not covered: {missing[0]['why']}" if missing else "not covered by this run")
        if missing:      # partly covered: what was compared passed; say what was not
            self.user_properties.append(("not_covered", [u["tensor"] for u in missing]))

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, CheckpointFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.spec.path, None, f"checkpoint {self.spec.id} {self.spec.name}" + (
            "" if self.layer is None else f" layer {self.layer}")


class VerdictItem(pytest.Item):
    """The run's verdict (harness/verdict.py), the same the CLI exits by: it fails on FAIL and on INCOMPLETE (a
    run that covered less than --llorch-require asks is not a pass)."""

    def runtest(self):
        if _State.error is not None:
            raise RuntimeError(f"the subject failed before any checkpoint could be compared: "
                               f"{type(_State.error).__name__}: {_State.error}") from _State.error
        v = _State.result.verdict()
        if not v.passed:
            raise VerdictFailure(v.line() + "\n" + v.coverage_line())

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, VerdictFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return "llorch", None, "the run's verdict"


class VerdictFailure(AssertionError):
    pass


class CheckpointFailure(AssertionError):
    def __init__(self, spec, rows, res):
        from .harness.metrics import fmt, fmt_cos
        lines = [f"checkpoint {spec.id} ({spec.title}) outside its band [{res.band_class}]: {res.subject_label} vs "
                 f"{res.reference_label}"]
        for r in rows:
            m = r.metrics
            lines.append(f"  {r.tensor}: shape {m.get('shape')} max abs {fmt(m.get('max_abs'))} max rel "
                         f"{fmt(m.get('max_rel'))} NMSE {fmt(m.get('nmse'))} cosine "
                         f"{fmt_cos(m.get('cosine', m.get('agreement')))} band {r.band}"
                         + ("\n    local (the reference's op on the subject's inputs): "
                            + (f"NMSE {fmt(r.local['nmse'])} max abs {fmt(r.local['max_abs'])}" if "nmse" in r.local
                               else f"agreement {r.local.get('agreement')}")
                            + f" band {r.local_band} [{res.local_declaration}]" if r.local is not None else "")
                         + (f"\n    {m['error']}" if m.get("error") else ""))
        fd = res.first_divergence
        lines.append(f"first divergence of the run: checkpoint {fd['checkpoint']}, layer {fd['layer']}, "
                     f"tensor {fd['tensor']}, step {fd['step']} (by {fd['by']})")
        lines += _divergence_lines(res)
        super().__init__("\n".join(lines))


def _divergence_lines(res) -> list[str]:
    """A black-box result's first step outside its band, with both distributions' top entries (else none)."""
    if not str(res.band_class or "").startswith("blackbox:"):
        return []
    from .harness.blackbox import divergence_lines
    return divergence_lines(res)


class CheckpointSuite(pytest.Collector):
    def collect(self):
        return []


def pytest_collection_modifyitems(session, config, items):
    if not (config.getoption("llorch_subject") or config.getoption("llorch_dump")):
        return
    if config.getoption("llorch_subject") and config.getoption("llorch_dump"):
        raise pytest.UsageError("give --llorch-subject or --llorch-dump, not both")
    import llorch_ref

    from .checkpoints import load_specs
    from .errors import LlorchError
    try:
        eng = llorch_ref.load(config.getoption("llorch_model"))
        cfg = eng.config
        _State.result, _ = _compute(config, eng)
    except LlorchError as e:
        raise pytest.UsageError(f"llorch: {e}") from None
    except Exception as e:            # the subject itself crashed: every checkpoint test reports it
        _State.error = e
    suite = CheckpointSuite.from_parent(session, name="llorch", nodeid="llorch")
    items.append(VerdictItem.from_parent(suite, name="verdict"))
    given = {r.checkpoint for r in _State.result.rows} if _State.result is not None else set()
    black = is_blackbox(config.getoption("llorch_subject"))
    for s in load_specs():
        if black and s.id not in given:        # a black box gives tokens and log-probabilities only
            continue
        for layer in (range(cfg.n_layers) if s.scope == "layer" else [None]):
            name = f"cp{s.id}_{s.name}" + ("" if layer is None else f"[layer{layer}]")
            items.append(CheckpointItem.from_parent(suite, name=name, spec=s, layer=layer))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    res = _State.result
    if res is None:
        return
    tr = terminalreporter
    tr.section("llorch-ref checkpoints")
    tr.write_line(f"{res.subject_label} vs {res.reference_label}, band class {res.band_class}")
    for s in res.summary():
        verdict = "NOT COVERED" if s["passed"] is None else ("pass" if s["passed"] else "FAIL")
        tr.write_line(f"  cp{s['checkpoint']:<3} {s['name']:<18} {verdict:<11} worst NMSE "
                      f"{s['worst_nmse'] if s['worst_nmse'] is not None else '-'}"
                      + (f"; {s['not_covered']} comparisons not covered: {s['why']}" if s.get("not_covered") else ""))
    fd = res.first_divergence
    tr.write_line("first divergence: " + ("none" if fd is None else
                                          f"checkpoint {fd['checkpoint']}, layer {fd['layer']}, {fd['tensor']}"))
    for line in _divergence_lines(res):
        tr.write_line(line)
    for w in res.warnings:
        tr.write_line(f"warning: {w}")
    v = res.verdict()
    tr.write_line(v.coverage_line())
    tr.write_line(v.line())
    if _State.bundle:
        tr.write_line(f"proof bundle: {_State.bundle['dir']}")
