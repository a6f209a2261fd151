"""`llorch-ref verify` against forged and hostile bundles: pages that contradict result.json's rows (their
hashes recomputed), a deleted repro/, a manifest that turns the re-run off, symbolic links out of the bundle,
code files llorch-ref did not write, weight names that leave the repro folder; and a clean bundle's report."""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

import llorch_ref
from llorch_ref.errors import HarnessError

_OPENED: list | None = None           # paths opened while a test watches (an audit hook cannot be removed)


def _audit(event, args):
    if _OPENED is not None and event in ("open", "os.scandir", "os.listdir") and args and args[0] is not None:
        _OPENED.append(os.fsdecode(args[0]) if isinstance(args[0], (str, bytes, os.PathLike)) else str(args[0]))


sys.addaudithook(_audit)


@pytest.fixture(scope="module")
def bundles(tiny, tmp_path_factory):
    """{"clean": a PASS bundle (llorch-ref's own dump against llorch-ref), "planted": a FAIL bundle (a 5% scale
    error in blk.1.ffn_up, named by local error, with repro/)}; both keep their tensors, no plots."""
    from llorch_ref.checkpoints import engine_band_class
    from llorch_ref.harness.bundle import write_bundle
    from llorch_ref.harness.run import run_subject
    from llorch_ref.references.llorch import record_engine
    from llorch_ref.testing.plant import plant_scale

    q8 = tiny(weight_type="Q8_0", n_layers=2, d_model=128, d_ff=192, vocab="bpe")
    d = tmp_path_factory.mktemp("integrity")
    bad = plant_scale(q8, d / "up1x1.05.gguf", "blk.1.ffn_up.weight", 1.05)
    ref = llorch_ref.load(q8)
    prompt = "Once upon a time, there was"
    ids = ref.tokenizer.encode(prompt)
    out = {}
    for name, subject in (("clean", q8), ("planted", bad)):
        sub = record_engine(llorch_ref.load(subject), ids, prompt=prompt, n_greedy=3).to_dump()
        res = run_subject(ref, sub, engine_band_class(ref), subject_label=f"{name} engine")
        out[name] = write_bundle(res, ref, out_dir=d / "pb", run_id=name, plot=False,
                                 argv=["llorch-ref", "prove", "--subject", "x", "--no-plots"])["dir"]
    return out


def _copy(bundles, which, tmp_path) -> Path:
    dst = tmp_path / which
    shutil.copytree(bundles[which], dst)
    return dst


def _rehash(run: Path):
    """What a forger does after editing: every regular file's sha256 recomputed into the manifest."""
    from llorch_ref.harness.bundle import sha256_of

    man = json.loads((run / "manifest.json").read_text())
    man["files"] = {p.relative_to(run).as_posix(): sha256_of(p) for p in sorted(run.rglob("*"))
                    if p.is_file() and not p.is_symlink() and p.name != "manifest.json"}
    (run / "manifest.json").write_text(json.dumps(man, indent=2))


def _verify(run, *more, capsys) -> tuple[int, str, str]:
    from llorch_ref.cli import main

    rc = main(["verify", str(run), *more])
    got = capsys.readouterr()
    return rc, got.out, got.err


def _forge_summary(run: Path):
    p = run / "summary.md"
    text = re.sub(r"^(# Proof run \S+: ).*$", r"\1every checkpoint inside its band", p.read_text(), count=1, flags=re.M)
    p.write_text(text.replace("**Verdict: FAIL**", "**Verdict: PASS**"))


def _forge_junit(run: Path):
    p = run / "junit.xml"
    text = re.sub(r"<failure[^>]*>.*?</failure>", "<system-out>inside</system-out>", p.read_text(), flags=re.S)
    text = re.sub(r'failures="\d+"', 'failures="0"', text)
    p.write_text(text.replace('value="FAIL"', 'value="PASS"'))


def _forge_html(run: Path):
    p = run / "report.html"
    text = re.sub(r'<div([^>]*)class="verdict fail"([^>]*)>.*?</div>',
                  r'<div\1class="verdict pass"\2>PASS: every checkpoint inside its band</div>', p.read_text(),
                  count=1, flags=re.S)
    p.write_text(text.replace('data-verdict="FAIL"', 'data-verdict="PASS"'))


def _forge_result(run: Path):
    p = run / "result.json"
    res = json.loads(p.read_text())
    res["passed"], res["first_divergence"] = True, None
    if "verdict" in res:
        res["verdict"].update(status="PASS", first_divergence=None, diverging=0, reasons=[])
    p.write_text(json.dumps(res, indent=2))


@pytest.mark.parametrize("page, forge", [("summary.md", _forge_summary), ("junit.xml", _forge_junit),
                                         ("report.html", _forge_html), ("result.json", _forge_result)])
def test_a_page_saying_pass_over_diverging_rows_is_named(bundles, tmp_path, capsys, page, forge):
    run = _copy(bundles, "planted", tmp_path)
    forge(run)
    _rehash(run)
    rc, out, _ = _verify(run, "--no-rerun", capsys=capsys)
    assert rc == 1, out
    assert re.search(rf"^CONTRADICTS .*{re.escape(page)}", out, flags=re.M), out
    assert "verify: FAILED" in out


def test_every_page_forged_with_repro_deleted_fails_the_rerun_too(bundles, tmp_path, capsys):
    run = _copy(bundles, "planted", tmp_path)
    for forge in (_forge_summary, _forge_junit, _forge_html):
        forge(run)
    shutil.rmtree(run / "repro")
    _rehash(run)
    rc, out, _ = _verify(run, capsys=capsys)
    assert rc == 1, out
    for page in ("summary.md", "junit.xml", "report.html"):
        assert re.search(rf"^CONTRADICTS .*{re.escape(page)}", out, flags=re.M), (page, out)
    assert "the figures hold" not in out


def test_a_deleted_repro_is_an_error(bundles, tmp_path, capsys):
    run = _copy(bundles, "planted", tmp_path)
    shutil.rmtree(run / "repro")
    _rehash(run)
    rc, out, _ = _verify(run, "--no-rerun", capsys=capsys)
    assert rc == 1, out
    assert re.search(r"^CONTRADICTS .*repro/", out, flags=re.M), out


def test_tensors_false_with_tensors_present_is_refused(bundles, tmp_path, capsys):
    run = _copy(bundles, "planted", tmp_path)
    man = json.loads((run / "manifest.json").read_text())
    man["tensors"] = False
    (run / "manifest.json").write_text(json.dumps(man, indent=2))
    rc, out, err = _verify(run, capsys=capsys)
    assert rc in (1, 2), out + err
    assert "tensors" in (out + err) and "false" in (out + err), out + err
    assert "verify: OK" not in out


def _watch(run_fn):
    """-> (run_fn's answer, every path opened or listed meanwhile)."""
    global _OPENED
    _OPENED = []
    try:
        return run_fn(), list(_OPENED)
    finally:
        _OPENED = None


def test_a_symlinked_checkpoint_folder_is_refused_and_not_read(bundles, tmp_path, capsys):
    run = _copy(bundles, "planted", tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.move(run / "cp7_block", outside / "cp7_block")
    (run / "cp7_block").symlink_to(outside / "cp7_block", target_is_directory=True)
    _rehash(run)
    (rc, out, err), opened = _watch(lambda: _verify(run, capsys=capsys))
    assert rc == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "cp7_block" in lines[0] and "link" in lines[0]
    assert not [p for p in opened if str(outside) in p], opened


def test_a_symlinked_file_is_refused_and_not_read(bundles, tmp_path, capsys):
    run = _copy(bundles, "planted", tmp_path)
    outside = tmp_path / "outside.json"
    shutil.move(run / "cp7_block" / "report.json", outside)
    (run / "cp7_block" / "report.json").symlink_to(outside)
    _rehash(run)
    (rc, out, err), opened = _watch(lambda: _verify(run, capsys=capsys))
    assert rc == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "cp7_block/report.json" in lines[0]
    assert not [p for p in opened if str(outside) in p], opened


def test_an_added_conftest_is_refused(bundles, tmp_path, capsys):
    run = _copy(bundles, "planted", tmp_path)
    (run / "repro" / "conftest.py").write_text("import os\nos.system('echo ran')\n")
    _rehash(run)
    rc, out, _ = _verify(run, "--no-rerun", capsys=capsys)
    assert rc == 1, out
    assert re.search(r"^REFUSED code .*repro/conftest\.py", out, flags=re.M), out


@pytest.mark.parametrize("name", ["pytest.ini", "cp6_swiglu/helper.sh", "repro/__pycache__/x.cpython-311.pyc"])
def test_any_other_code_file_is_refused(bundles, tmp_path, capsys, name):
    run = _copy(bundles, "planted", tmp_path)
    (run / name).parent.mkdir(parents=True, exist_ok=True)
    (run / name).write_text("[pytest]\naddopts = -p evil\n")
    _rehash(run)
    rc, out, _ = _verify(run, "--no-rerun", capsys=capsys)
    assert rc == 1 and re.search(rf"^REFUSED code .*{re.escape(name)}", out, flags=re.M), out


def test_an_executable_data_file_is_refused(bundles, tmp_path, capsys):
    run = _copy(bundles, "planted", tmp_path)
    (run / "cp6_swiglu" / "report.md").chmod(0o755)
    rc, out, _ = _verify(run, "--no-rerun", capsys=capsys)
    assert rc == 1 and re.search(r"^REFUSED code .*cp6_swiglu/report\.md", out, flags=re.M), out


def test_a_modified_test_repro_is_refused(bundles, tmp_path, capsys):
    run = _copy(bundles, "planted", tmp_path)
    p = run / "repro" / "test_repro.py"
    p.write_text(p.read_text() + "\nimport os\nos.system('echo ran')\n")
    _rehash(run)
    rc, out, _ = _verify(run, "--no-rerun", capsys=capsys)
    assert rc == 1 and re.search(r"^REFUSED code .*repro/test_repro\.py", out, flags=re.M), out


def test_code_smuggled_through_the_case_description_is_refused(bundles, tmp_path, capsys):
    """case.json's `what` lands in test_repro.py's docstring: a value closing the docstring must not become code,
    however the bundle's test_repro.py is made to match it."""
    from llorch_ref.harness.repro import TEST_FILE

    run = _copy(bundles, "planted", tmp_path)
    case = json.loads((run / "repro" / "case.json").read_text())
    case["what"] = 'x."""\nimport os\nos.system("echo ran")\n"""'
    (run / "repro" / "case.json").write_text(json.dumps(case, indent=2))
    (run / "repro" / "test_repro.py").write_text(TEST_FILE.format(run_id=case["run_id"] or "", what=case["what"],
                                                                  folder="repro"))
    _rehash(run)
    rc, out, _ = _verify(run, "--no-rerun", capsys=capsys)
    assert rc == 1 and re.search(r"^REFUSED code .*repro/test_repro\.py", out, flags=re.M), out


def test_the_written_test_repro_keeps_a_hostile_description_inside_its_docstring(bundles, tmp_path):
    from llorch_ref.harness.repro import repro_test_source

    code = compile(repro_test_source({"run_id": "r", "what": 'x"""\nimport os\n\\'}), "test_repro.py", "exec")
    assert "os" not in code.co_names and code.co_consts[0].startswith("The first divergence of proof run r: x")


@pytest.mark.parametrize("field, value", [("weights", {"../x": {"kind": "array"}}),
                                          ("weights", {"/etc/passwd": {"kind": "array"}}),
                                          ("weights", {"a/b": {"kind": "array"}}),
                                          ("inputs", ["../../x"]), ("masked_by", "../visible.npy"),
                                          ("masked_by", "/tmp/visible.npy")])
def test_repro_load_refuses_names_that_leave_the_folder(bundles, tmp_path, field, value):
    from llorch_ref.harness.repro import load

    run = _copy(bundles, "planted", tmp_path)
    p = run / "repro" / "case.json"
    case = json.loads(p.read_text())
    case[field] = value
    p.write_text(json.dumps(case))
    with pytest.raises(HarnessError, match="leave|outside"):
        load(run / "repro")


def test_a_clean_bundle_verifies_and_says_what_it_checked(bundles, capsys):
    run = bundles["clean"]
    man = json.loads((run / "manifest.json").read_text())
    rc, out, err = _verify(run, capsys=capsys)
    assert rc == 0, out + err
    assert re.search(r"^verdict: PASS", out, flags=re.M), out
    assert re.search(r"^coverage: \d+ of \d+ required tensors", out, flags=re.M), out
    assert f"band class {man['band_class']}" in out
    assert man["recipe"]["model"] in out and man["recipe"]["model_sha256"] in out
    assert "sha256 detects accidental edits, not forgery" in out
    assert "verify: OK" in out and "the figures hold" in out


def test_a_planted_bundle_verifies_with_its_failing_verdict(bundles, capsys):
    rc, out, err = _verify(bundles["planted"], capsys=capsys)
    assert rc == 0, out + err
    assert re.search(r"^verdict: FAIL .*checkpoint 6, layer 1, tensor ffn_swiglu", out, flags=re.M), out
    assert "verify: OK" in out


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """{"private": PEM file, "public": its PEM public key, "other": another key's PEM public key}."""
    pytest.importorskip("cryptography", reason="signing needs the cryptography package")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    d = tmp_path_factory.mktemp("keys")
    out = {}
    for name in ("mine", "other"):
        k = ed25519.Ed25519PrivateKey.generate()
        (d / f"{name}.pem").write_bytes(k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                        serialization.NoEncryption()))
        (d / f"{name}.pub").write_bytes(k.public_key().public_bytes(serialization.Encoding.PEM,
                                                                    serialization.PublicFormat.SubjectPublicKeyInfo))
    out.update(private=d / "mine.pem", public=d / "mine.pub", other=d / "other.pub")
    return out


@pytest.fixture(scope="module")
def signed(tiny, keys, tmp_path_factory):
    """A PASS bundle signed with keys["private"]."""
    from llorch_ref.checkpoints import engine_band_class
    from llorch_ref.harness.bundle import write_bundle
    from llorch_ref.harness.run import run_subject
    from llorch_ref.references.llorch import record_engine

    model = tiny(vocab="bpe", n_layers=1)
    eng = llorch_ref.load(model)
    ids = eng.tokenizer.encode("Once upon a time")
    sub = record_engine(llorch_ref.load(model), ids, prompt="Once upon a time", n_greedy=2).to_dump()
    res = run_subject(eng, sub, engine_band_class(eng), subject_label="signed engine")
    return write_bundle(res, eng, out_dir=tmp_path_factory.mktemp("signed"), run_id="signed", plot=False,
                        sign=keys["private"], argv=["llorch-ref", "prove", "--sign", "key.pem"])["dir"]


def test_a_signed_bundle_verifies_under_its_key(signed, keys, capsys):
    rc, out, err = _verify(signed, "--no-rerun", "--key", str(keys["public"]), capsys=capsys)
    assert rc == 0 and re.search(r"^signature: good: manifest\.json", out, flags=re.M), out + err
    rc, out, _ = _verify(signed, "--no-rerun", capsys=capsys)
    assert rc == 0 and "signature: present" in out and "not checked" in out


def test_an_edited_signed_bundle_fails_its_signature(signed, keys, tmp_path, capsys):
    run = tmp_path / "edited"
    shutil.copytree(signed, run)
    p = run / "cp1_rms_norm" / "report.md"
    p.write_text(p.read_text() + "\nAn added line.\n")
    _rehash(run)
    rc, out, _ = _verify(run, "--no-rerun", "--key", str(keys["public"]), capsys=capsys)
    assert rc == 1 and re.search(r"^SIGNATURE BAD: .*edited after signing", out, flags=re.M), out


def test_another_key_or_no_signature_fails(signed, bundles, keys, capsys):
    rc, out, _ = _verify(signed, "--no-rerun", "--key", str(keys["other"]), capsys=capsys)
    assert rc == 1 and re.search(r"^SIGNATURE BAD: ", out, flags=re.M), out
    rc, out, _ = _verify(bundles["clean"], "--no-rerun", "--key", str(keys["public"]), capsys=capsys)
    assert rc == 1 and re.search(r"^SIGNATURE BAD: .*not signed", out, flags=re.M), out


def test_prove_refuses_a_key_that_is_not_one_before_running(tiny, tmp_path, capsys):
    from llorch_ref.cli import main

    pytest.importorskip("cryptography", reason="signing needs the cryptography package")
    bad = tmp_path / "key.pem"
    bad.write_text("not a key\n")
    rc = main(["prove", "--model", str(tiny(vocab="bpe", n_layers=1)), "--out", str(tmp_path / "pb"), "--sign", str(bad)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: --sign ") and not (tmp_path / "pb").exists(), err
