"""Hostile dumps: every float type a GPU engine writes is read; malformed headers, empty tensors, manifests
nested too deep or not UTF-8, token counts past the context and comparisons too big for memory are refused up
front with one line `error: ...` and exit 2; a few hundred mutated dumps never trace back and never PASS with a
mutated tensor."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest

import llorch_ref
from llorch_ref.cli import main
from llorch_ref.dump import MANIFEST_KEY, load_dump
from llorch_ref.references.llorch import record_engine

PROMPT = "Once upon a time, there was"


@pytest.fixture(scope="module")
def rec(bpe_model):
    eng = llorch_ref.load(bpe_model, weights="eager")
    return record_engine(eng, eng.tokenizer.encode(PROMPT), prompt=PROMPT, n_greedy=4)


def write(path, tensors, manifest, dtypes=None, header_edit=None, meta=True):
    """A safetensors file written by hand (the format, not the library): dtypes {name: BF16 | F16 | F8_E4M3}."""
    header, blobs, off = {}, [], 0
    for k, a in tensors.items():
        dt = (dtypes or {}).get(k) or {"float32": "F32", "int64": "I64"}[str(a.dtype)]
        if dt == "BF16":
            b = (np.ascontiguousarray(a, np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
        elif dt == "F16":
            b = np.asarray(a, np.float16).tobytes()
        elif dt == "F8_E4M3":
            b = np.full(a.size, 0x38, np.uint8).tobytes()            # 1.0 in E4M3
        else:
            b = np.ascontiguousarray(a).tobytes()
        header[k] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        off += len(b)
        blobs.append(b)
    if meta:
        header["__metadata__"] = {MANIFEST_KEY: json.dumps(manifest)}
    if header_edit:
        header_edit(header)
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    return path


def diff(path, model, capsys):
    rc = main(["diff", "--subject", str(path), "--model", str(model)])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


@pytest.mark.parametrize("dtype", ["BF16", "F16"])
def test_bfloat16_and_float16_dumps_are_read_as_float32(rec, tmp_path, dtype):
    t = dict(rec.tensors)
    p = write(tmp_path / "d.safetensors", t, rec.manifest(), dtypes={k: dtype for k in t if t[k].dtype == np.float32})
    d = load_dump(p)
    a = d.raw("7", "l_out", 1)
    assert a.dtype == np.float32
    rel = np.abs(a - t["cp7.l_out.layer1"]).max() / np.abs(t["cp7.l_out.layer1"]).max()
    assert 0 < rel < (2 ** -7 if dtype == "BF16" else 2 ** -10)


def test_an_f8_tensor_is_read(rec, tmp_path):
    p = write(tmp_path / "d.safetensors", dict(rec.tensors), rec.manifest(), dtypes={"cp7.l_out.layer0": "F8_E4M3"})
    assert np.all(load_dump(p).raw("7", "l_out", 0) == 1.0)


def test_a_bfloat16_dump_gets_a_verdict_not_a_traceback(rec, bpe_model, tmp_path, capsys):
    t = dict(rec.tensors)
    p = write(tmp_path / "d.safetensors", t, rec.manifest(), dtypes={k: "BF16" for k in t if t[k].dtype == np.float32})
    rc, out, err = diff(p, bpe_model, capsys)
    assert rc in (0, 1) and "verdict: " in out and "Traceback" not in err


def _hostile(rec, tmp_path):
    man, t = rec.manifest(), dict(rec.tensors)
    n_vocab = t["cp9.logits"].shape[-1]
    nested = '{"a": ' * 100000 + "null" + "}" * 100000
    return {
        "empty logits": (lambda p: write(p, {**t, "cp8.logits": np.zeros((0, n_vocab), np.float32)}, man), "is empty"),
        "integer logits": (lambda p: write(p, {**t, "cp9.logits": t["cp9.logits"].astype(np.int64)}, man),
                           "floating-point"),
        "offsets outside the file": (lambda p: write(p, t, man, header_edit=lambda h: h["cp9.logits"].update(
            data_offsets=[0, 10**12])), "outside"),
        "bytes that do not fit the shape": (lambda p: write(p, t, man, header_edit=lambda h: h["cp9.logits"].update(
            shape=[7, 7])), "data bytes for shape"),
        "unknown dtype": (lambda p: write(p, t, man, header_edit=lambda h: h["cp9.logits"].update(dtype="C64")),
                          "dtype"),
        "prompt past the context": (lambda p: write(p, {"cp9.logits": t["cp9.logits"]},
                                                    {**man, "token_ids": [1] * 5000}), "exceed the reference's context"),
        "decode tokens past the context": (lambda p: write(p, t, {**man, "decode_token_ids": [1] * 100000}),
                                           "exceed the reference's context"),
        "sidecar nested too deep": (lambda p: (write(p, t, man, meta=False),
                                               p.with_name(p.name + ".manifest.json").write_text(nested))[0], "JSON"),
        "sidecar not UTF-8": (lambda p: (write(p, t, man, meta=False),
                                         p.with_name(p.name + ".manifest.json").write_bytes(b"{\"x\": \"\xff\xfe\"}"))[0],
                              "UTF-8"),
        "header not JSON": (lambda p: p.write_bytes(struct.pack("<Q", 4) + b"\xff\xfe{{" + b"\0" * 16), "not JSON"),
    }


@pytest.mark.parametrize("case", ["empty logits", "integer logits", "offsets outside the file",
                                  "bytes that do not fit the shape", "unknown dtype", "prompt past the context",
                                  "decode tokens past the context", "sidecar nested too deep", "sidecar not UTF-8",
                                  "header not JSON"])
def test_a_hostile_dump_is_refused_in_one_line(rec, bpe_model, tmp_path, capsys, case):
    make, says = _hostile(rec, tmp_path)[case]
    p = tmp_path / "d.safetensors"
    make(p)
    rc, out, err = diff(p, bpe_model, capsys)
    assert rc == 2, (out[-500:], err[-1500:])
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and says in last and err.count("error: ") == 1 and "Traceback" not in err, err


def test_a_comparison_too_big_for_memory_is_refused_before_it_runs(rec, bpe_model, tmp_path, capsys, monkeypatch):
    import llorch_ref.harness.run as run
    monkeypatch.setattr(run, "mem_available", lambda: 2**10)
    p = write(tmp_path / "d.safetensors", dict(rec.tensors), rec.manifest())
    rc, out, err = diff(p, bpe_model, capsys)
    assert rc == 2 and "comparing this dump needs about" in err and "--rows" in err, err


def test_mutated_dumps_never_trace_back_and_never_pass(rec, bpe_model, tmp_path, capsys):
    """A few hundred dumps, each with one tensor's values or one header or manifest field mutated: every run
    ends in a verdict or a one-line refusal, and a dump with a changed tensor never gets PASS."""
    rng = np.random.default_rng(7)
    man, t = rec.manifest(), dict(rec.tensors)
    floats = sorted(k for k in t if t[k].dtype == np.float32 and not k.startswith("cp11"))
    eng = llorch_ref.load(bpe_model, weights="eager")
    from llorch_ref.errors import LlorchError
    from llorch_ref.harness.run import run_subject
    outcomes = {}
    for i in range(240):
        name = floats[i % len(floats)]
        a = t[name].copy()
        how = ["scale", "row", "nan", "sign"][i % 4] if ".kq." not in name else "scale"   # no masked score
        flat = a.reshape(-1)
        j = int(rng.integers(flat.size))
        if how == "scale":
            a *= np.float32(1 + 0.05 * (1 + rng.random()))
        elif how == "row":
            a.reshape(a.shape[0], -1)[int(rng.integers(a.shape[0]))] *= 3
        elif how == "nan":
            flat[j] = np.nan
        else:
            flat[j] = -flat[j] * 4 - 1
        sub = {**t, name: a}
        from llorch_ref.dump import Dump
        try:
            v = run_subject(eng, Dump(manifest=man, tensors=sub, source=f"mutant {i}")).verdict()
            outcomes.setdefault(v.status, []).append((name, how))
            assert v.status != "PASS", (name, how)
        except LlorchError:
            outcomes.setdefault("refused", []).append((name, how))
    assert sum(len(v) for v in outcomes.values()) == 240 and "PASS" not in outcomes
    for i in range(60):                       # header and manifest fields mutated, through the CLI
        field = ["token_ids", "rows", "layouts", "engine", "format", "decode_token_ids"][i % 6]
        value = [[-1], [10**9], "x", {"rope_pairs": "spiral"}, None, [[1]]][int(rng.integers(6))]
        p = write(tmp_path / f"m{i}.safetensors", t, {**man, field: value})
        rc, out, err = diff(p, bpe_model, capsys)
        assert rc in (1, 2, 3) and "Traceback" not in err, (field, value, err[-800:])
        assert rc != 2 or (err.strip().splitlines()[-1].startswith("error: ") and err.count("error: ") == 1), err
