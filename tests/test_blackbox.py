"""Black-box subjects (harness/blackbox.py, references/blackbox.py): a trace of tokens and log-probabilities against
the teacher-forced reference. The reference as its own black box passes with KLD 0; a planted error in the
log-probabilities, or in one weight matrix of the file a real engine runs, fails at a named step; bad input is one
`error:` line and exit 2."""
from __future__ import annotations

import http.server
import json
import threading
import time

import numpy as np
import pytest
from blackbox_helpers import PROMPT, SELF_STEPS, Memo, needs_mistralrs, needs_server

import llorch_ref
from llorch_ref.cli import main
from llorch_ref.errors import BlackBoxError
from llorch_ref.harness.blackbox import compare_trace, kld_step, log_softmax64
from llorch_ref.references.blackbox import Step, Trace, openai_trace


@pytest.fixture(scope="module")
def ref(blackbox_self_run):
    return blackbox_self_run[0]


@pytest.fixture(scope="module")
def self_run(blackbox_self_run):
    """The reference's greedy run of SELF_STEPS tokens from PROMPT: (prompt ids, tokens, its log-probabilities)."""
    from llorch_ref.harness.blackbox import load_bands

    assert SELF_STEPS >= max(r["min_steps"] for b in load_bands()["bands"].values() for r in b.get("run", {}).values())
    return blackbox_self_run[1:]


def self_trace(run, n=12, top_k=None) -> Trace:
    """The reference as a black box: the first n steps of its greedy run with its own log-probabilities (top_k,
    default all); a new Trace each call, for the tests to edit."""
    ids, gen, logp = run
    gen, logp = gen[:n], logp[:n]
    steps = []
    for j, t in enumerate(gen):
        keep = np.argsort(-logp[j])[: top_k or logp.shape[1]]
        steps.append(Step(token=int(t), logprob=float(logp[j, t]), top={int(i): float(logp[j, i]) for i in keep}))
    return Trace(engine="self", version="", prompt=PROMPT, steps=steps, top_k=top_k or logp.shape[1],
                 whole=top_k is None, prompt_ids=list(ids), tokenized_by="the reference")


def test_the_reference_as_its_own_black_box_passes_with_kld_zero(ref, self_run):
    res = compare_trace(ref, self_trace(self_run))
    v = res.verdict()
    assert v.status == "PASS", v.line()
    klds = [r.metrics["kld"] for r in res.rows if r.checkpoint == "11"]
    assert len(klds) == 12 and max(klds) < 1e-9
    assert all(r.metrics["kld_kind"] == "exact" and r.metrics["rank"] == 1 for r in res.rows if r.checkpoint == "11")
    assert v.required == ["cp0", "cp10", "cp11"]            # the black-box kind lacks every layer tensor


def test_top_k_gives_a_lower_bound_of_the_exact_kld(ref, self_run):
    tr, cut = self_trace(self_run), self_trace(self_run, top_k=20)
    rng = np.random.default_rng(0)
    for full, top in zip(tr.steps, cut.steps):      # the same noise on both: the bound stays under the exact figure
        noise = {i: v + 0.3 * rng.standard_normal() for i, v in full.top.items()}
        z = np.log(np.sum(np.exp(np.fromiter(noise.values(), float))))
        full.top = {i: v - z for i, v in noise.items()}
        top.top = {i: full.top[i] for i in top.top}
    logp = log_softmax64(ref.logits(tr.prompt_ids + [s.token for s in tr.steps[:-1]])[len(tr.prompt_ids) - 1:])
    for j in range(len(tr.steps)):
        exact, how, _ = kld_step(logp[j], tr.steps[j].top)
        bound, how_b, buckets = kld_step(logp[j], cut.steps[j].top)
        assert (how, how_b, buckets) == ("exact", "bound", 21)
        assert 0 <= bound <= exact + 1e-12 and exact > 1e-3


def test_a_planted_logprob_error_fails_at_its_step(ref, self_run):
    tr = self_trace(self_run)
    s = tr.steps[5]
    tilted = {i: v + (3.0 if i % 2 else 0.0) for i, v in s.top.items()}       # half the vocabulary 20x likelier
    z = np.log(np.sum(np.exp(np.fromiter(tilted.values(), float))))
    s.top = {i: v - z for i, v in tilted.items()}
    v = compare_trace(ref, tr).verdict()
    assert v.status == "FAIL"
    assert (v.first_divergence["checkpoint"], v.first_divergence["step"]) == ("11", 5)


def test_a_flip_is_a_bug_unless_the_reference_has_a_near_tie(ref, self_run):
    tr = self_trace(self_run)
    logp = log_softmax64(ref.logits(tr.prompt_ids + [s.token for s in tr.steps[:-1]])[len(tr.prompt_ids) - 1:])
    second = int(np.argsort(-logp[3])[1])
    tr.steps = tr.steps[:4]
    tr.steps[3].token = second                       # the engine chose the reference's second token at step 3
    margin = float(np.sort(logp[3])[-1] - np.sort(logp[3])[-2])
    wide = {"bands": {"exact:Q4_x": {"kld": 1.0, "near_tie": margin * 1.01}}}
    narrow = {"bands": {"exact:Q4_x": {"kld": 1.0, "near_tie": margin * 0.99}}}
    assert compare_trace(ref, tr, bands=wide).verdict().status == "PASS"
    fd = compare_trace(ref, tr, bands=narrow).verdict().first_divergence
    assert (fd["checkpoint"], fd["step"]) == ("10", 3)


def test_another_tokenization_fails_cp0_naming_the_token(ref, self_run):
    tr = self_trace(self_run, n=3)
    tr.prompt_ids = tr.prompt_ids[:4] + [17] + tr.prompt_ids[5:]
    res = compare_trace(ref, tr)
    fd = res.verdict().first_divergence
    assert fd["checkpoint"] == "0"
    assert next(r for r in res.rows if r.checkpoint == "0").metrics["first_difference"] == 4


# -- the run-level bands: a planted error under every per-step band that the run's means catch --------------
def run_bands():
    """(arithmetic key, subject kind) of every run-level band shipped."""
    from llorch_ref.harness.blackbox import load_bands

    return [(k, kind) for k, b in load_bands()["bands"].items() for kind in b.get("run", {})]


@pytest.fixture(scope="module")
def long_trace(self_run):
    return self_trace(self_run, n=SELF_STEPS)


@pytest.fixture(scope="module")
def references(ref, self_run):
    ggml = Memo(llorch_ref.load(threads=1, numerics="ggml", kv_dtype="float16"))
    ids, gen, _ = self_run
    ggml.logits(ids + gen[:-1])                     # the whole run once: every trace below feeds a prefix of it
    return {"exact:Q4_x": ref, "ggml": ggml}


def noisy(logp: dict, target: float, seed: int) -> dict:
    """The distribution `logp` (id -> logprob) with noise on its logits scaled so that KL(logp || noisy) = target."""
    ids = np.fromiter(logp.keys(), np.int64, len(logp))
    x = np.fromiter(logp.values(), np.float64, len(logp))
    e = np.random.default_rng(seed).standard_normal(x.size)
    p = np.exp(x)

    def at(sigma):
        y = x + sigma * e
        y -= y.max() + np.log(np.exp(y - y.max()).sum())
        return y, float(np.sum(p * (x - y)))
    lo, hi = 0.0, 4.0
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if at(mid)[1] < target else (lo, mid)
    return dict(zip(ids.tolist(), at(hi)[0].tolist()))


def retrace(tr, kind, tops) -> Trace:
    """The trace as a subject of `kind` with each step's log-probabilities replaced by `tops`."""
    steps = [Step(token=s.token, logprob=t[s.token], top=t) for s, t in zip(tr.steps, tops)]
    return Trace(engine=kind, version="", prompt=tr.prompt, steps=steps, top_k=tr.top_k, whole=True,
                 prompt_ids=tr.prompt_ids, tokenized_by=tr.tokenized_by)


@pytest.mark.parametrize("key", ["exact:Q4_x", "ggml"])
def test_one_step_past_the_step_band_fails_there_in_each_arithmetic(references, long_trace, key):
    from llorch_ref.harness.blackbox import band_for

    eng = references[key]
    _, band = band_for(eng)
    tops = [s.top for s in long_trace.steps[:12]]
    tops[7] = noisy(tops[7], 2 * band["kld"], 7)
    fd = compare_trace(eng, retrace(long_trace, "openai", tops)).verdict().first_divergence
    assert (fd["checkpoint"], fd["step"]) == ("11", 7), fd


@pytest.mark.parametrize("key", ["exact:Q4_x", "ggml"])
def test_a_flip_past_the_near_tie_band_fails_in_each_arithmetic(references, long_trace, key):
    from llorch_ref.harness.blackbox import band_for

    eng = references[key]
    _, band = band_for(eng)
    fed = long_trace.prompt_ids + [s.token for s in long_trace.steps[:-1]]
    logp = log_softmax64(eng.logits(fed)[len(long_trace.prompt_ids) - 1:])
    top2 = np.sort(logp, axis=1)[:, -2:]
    j = int(np.argmax(top2[:, 1] - top2[:, 0]))           # the step with the widest reference margin
    assert top2[j, 1] - top2[j, 0] > band["near_tie"]
    tr = retrace(long_trace, "openai", [s.top for s in long_trace.steps[:j + 1]])
    tr.steps[j].token = int(np.argsort(-logp[j])[1])        # the engine chose the reference's second token
    fd = compare_trace(eng, tr).verdict().first_divergence
    assert (fd["checkpoint"], fd["step"]) == ("10", j), fd


@pytest.mark.parametrize("key, kind", run_bands())
def test_a_spread_error_under_the_step_band_fails_the_run_mean_kld(references, long_trace, key, kind):
    from llorch_ref.harness.blackbox import RUN, band_for, judge_table, run_band_for, steps_table

    eng = references[key]
    _, band = band_for(eng)
    rb = run_band_for(band, kind)
    target = 2 * rb["mean_kld"]
    assert target < band["kld"] / 3                         # every step stays well inside its own band
    tr = retrace(long_trace, kind, [noisy(s.top, target, j) for j, s in enumerate(long_trace.steps)])
    res = compare_trace(eng, tr)
    v = res.verdict()
    assert v.status == "FAIL" and v.first_divergence["tensor"] == RUN, v.line()
    assert max(r.metrics["kld"] for r in res.rows if r.checkpoint == "11" and r.tensor != RUN) < band["kld"]
    assert judge_table(steps_table(res), band, rb)["by"] == "run"      # the tools' rule is the verdict's


@pytest.mark.parametrize("key, kind", run_bands())
def test_a_systematic_lift_of_the_chosen_token_fails_the_run_logprob_shift(references, long_trace, key, kind):
    from llorch_ref.harness.blackbox import RUN, band_for, run_band_for, run_row

    eng = references[key]
    _, band = band_for(eng)
    rb = run_band_for(band, kind)
    tops = []
    for s in long_trace.steps:                   # the engine's own token's logit raised by 3 x the band, renormalized
        t = {i: v + (3 * rb["logprob_shift"] if i == s.token else 0.0) for i, v in s.top.items()}
        z = np.log(np.sum(np.exp(np.fromiter(t.values(), float))))
        tops.append({i: v - z for i, v in t.items()})
    res = compare_trace(eng, retrace(long_trace, kind, tops))
    v = res.verdict()
    assert v.status == "FAIL" and v.first_divergence["tensor"] == RUN, v.line()
    assert run_row(res).metrics["mean_shift"] > rb["logprob_shift"]


def test_the_clean_reference_passes_the_run_bands(ref, long_trace):
    from llorch_ref.harness.blackbox import run_row

    for kind in ("openai", "mistral.rs"):
        res = compare_trace(ref, retrace(long_trace, kind, [s.top for s in long_trace.steps]))
        assert res.verdict().status == "PASS" and run_row(res).metrics["mean_kld"] < 1e-9


# -- bad input, through a stub OpenAI server ------------------------------------------------------------------
class Stub(http.server.BaseHTTPRequestHandler):
    """Answers /v1/completions as `mode` says: ok (a clean top-K answer from the reference), slow (never in time),
    500, few (fewer log-probabilities than asked), vocab (a token id outside the vocabulary), trip (a text its
    tokens do not spell), foreign (a token of another tokenizer); tokenizer: /extras/tokenize answers the prompt's
    ids with one changed (another tokenizer's split)."""
    mode, answer, other_ids = "ok", {}, []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path == "/extras/tokenize" and self.mode == "tokenizer":
            return self._send(200, {"tokens": self.other_ids})
        if self.path != "/v1/completions":
            return self._send(404, {"error": "no such route"})
        if self.mode == "slow":
            time.sleep(3)
            return self._send(200, self.answer)
        if self.mode == "500":
            return self._send(500, {"error": "engine crashed"})
        out = json.loads(json.dumps(self.answer))
        lp = out["choices"][0]["logprobs"]
        if self.mode == "few":
            lp["top_logprobs"] = [dict(list(t.items())[:3]) for t in lp["top_logprobs"]]
        if self.mode == "vocab":
            lp["top_logprobs"][0]["token_id:60000"] = -20.0
        if self.mode == "trip":                         # the text the tokens do not spell
            out["choices"][0]["text"] = out["choices"][0]["text"][:3] + "#" + out["choices"][0]["text"][4:]
        if self.mode == "foreign":                      # a piece of another tokenizer
            lp["tokens"][1] = "\u2603snowman-piece"
        self._send(200, out, body)

    def _send(self, code, body, asked=None):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


@pytest.fixture(scope="module")
def stub(ref, self_run):
    tr = self_trace(self_run, n=4, top_k=20)
    text = lambda i: ref.tokenizer.token_bytes(i).decode("utf-8", "ignore")     # noqa: E731
    Stub.answer = {"model": "stub", "choices": [{"text": "".join(text(s.token) for s in tr.steps), "logprobs": {
        "tokens": [text(s.token) for s in tr.steps], "token_logprobs": [s.logprob for s in tr.steps],
        "top_logprobs": [{text(i): v for i, v in s.top.items()} for s in tr.steps]}, "finish_reason": "length"}]}
    ids = ref.tokenizer.encode(PROMPT)
    Stub.other_ids = ids[:3] + [ref.tokenizer.encode(" snow")[0]] + ids[4:]
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def run_cli(capsys, *argv):
    rc = main(["diff", "--threads", "1", *argv])
    out = capsys.readouterr()
    return rc, out.out, [ln for ln in out.err.splitlines() if ln.startswith("error:")]


def test_a_clean_stub_passes_by_round_trip(stub, capsys):
    Stub.mode = "ok"
    rc, out, errors = run_cli(capsys, "--subject", f"openai:{stub}", "--decode-steps", "4")
    assert (rc, errors) == (0, []), out
    assert "verdict: PASS" in out


@pytest.mark.parametrize("mode, says", [("slow", "no answer in 1 s (timeout)"), ("500", "HTTP 500"),
                                        ("few", "fewer than the 20 asked"), ("vocab", "vocabulary of another size"),
                                        ("trip", "do not give back the text it returned"),
                                        ("foreign", "not in the reference's vocabulary")])
def test_bad_answers_are_one_error_line_and_exit_2(stub, capsys, mode, says):
    Stub.mode = mode
    rc, out, errors = run_cli(capsys, "--subject", f"openai:{stub}", "--decode-steps", "4", "--timeout", "1")
    assert rc == 2 and len(errors) == 1 and says in errors[0], errors


def test_another_tokenizer_through_the_tokenize_route_fails_cp0_naming_the_token(ref, stub, capsys):
    Stub.mode = "tokenizer"
    rc, out, errors = run_cli(capsys, "--subject", f"openai:{stub}", "--decode-steps", "4")
    assert (rc, errors) == (1, []), out
    said = " ".join(out.split())                        # the console wraps its lines
    assert "differs first at token 3: the engine's ' snow' against the reference's ' time'" in said, out
    rc, out, errors = run_cli(capsys, "--subject", f"openai:{stub}", "--decode-steps", "4", "--json")
    assert json.loads(out)["verdict"]["first_divergence"]["checkpoint"] == "0"


def test_a_server_that_is_not_there_is_one_error_line(capsys):
    from llorch_ref.testing.openai_server import free_port

    rc, out, errors = run_cli(capsys, "--subject", f"openai:http://127.0.0.1:{free_port()}", "--timeout", "2")
    assert rc == 2 and len(errors) == 1 and "refused" in errors[0], errors


def test_a_token_of_another_tokenizer_is_refused(ref):
    from llorch_ref.references.blackbox import parse_completion

    out = {"choices": [{"text": "x", "logprobs": {"tokens": ["\u2603snowman-piece"], "token_logprobs": [-0.1],
                                                  "top_logprobs": [{"\u2603snowman-piece": -0.1}]}}]}
    with pytest.raises(BlackBoxError, match="not in the reference's vocabulary"):
        parse_completion(out, ref.tokenizer, 1, "stub")


# -- llama-cpp-python's own OpenAI server ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def planted_file(blackbox_planted):
    return blackbox_planted


@needs_server
def test_llama_cpp_server_clean_passes_and_tokenizes_through_its_route(ref, llama_cpp_clean_url, capsys):
    url = llama_cpp_clean_url
    tr = openai_trace(url, PROMPT, ref.tokenizer, n_steps=8, top_k=20)
    rc, out, errors = run_cli(capsys, "--subject", f"openai:{url}", "--decode-steps", "16")
    assert tr.tokenized_by == "tokenize route /extras/tokenize" and tr.prompt_ids == ref.tokenizer.encode(PROMPT)
    assert (rc, errors) == (0, []), out
    assert "verdict: PASS" in out


@needs_server
def test_llama_cpp_server_on_a_planted_file_fails_at_a_named_step(llama_cpp_planted_url, capsys):
    rc, out, errors = run_cli(capsys, "--subject", f"openai:{llama_cpp_planted_url}", "--decode-steps", "6",
                              "--json")                   # its first failing step is 3 of 16 and of 6
    fd = json.loads(out)["verdict"]["first_divergence"]
    assert rc == 1 and fd["checkpoint"] in ("10", "11") and isinstance(fd["step"], int), fd


# -- mistral.rs -----------------------------------------------------------------------------------------------
@needs_mistralrs
def test_mistralrs_clean_passes_with_the_whole_vocabulary(ref, capsys):
    rc, out, errors = run_cli(capsys, "--subject", "mistralrs", "--decode-steps", "4", "--json")
    res = json.loads(out)
    assert (rc, errors) == (0, []), res["verdict"]
    kinds = {r["kld_kind"] for r in res["rows"] if r["checkpoint"] == "11"}
    assert kinds == {"exact"}


@needs_mistralrs
def test_mistralrs_on_a_planted_file_fails_at_a_named_step(ref, planted_file):
    from llorch_ref.references.blackbox import mistralrs_trace

    tr = mistralrs_trace(planted_file, PROMPT, ref.tokenizer, n_steps=5)      # fails first at step 3 of 8 and of 5
    v = compare_trace(ref, tr).verdict()              # the reference on the clean file
    assert v.status == "FAIL" and v.first_divergence["checkpoint"] in ("10", "11"), v.line()
