"""ONNX Runtime GenAI as an engine under test: a model built by onnxruntime-genai's model builder (float32, or int4
MatMulNBits blocks at its default block size), its tensors written as a llorch-dump.

- Logits, argmax, greedy tokens (checkpoints 8-12) and the tokenization (0) come from ONNX Runtime GenAI itself
  (`onnxruntime_genai.Generator`, its Tokenizer).
- The layer tensors come from the same decoder graph run by onnxruntime with the builder's intermediate values
  added as graph outputs (nothing else in the graph changes; the logits of that run are compared with GenAI's,
  the capture-invariance check). GroupQueryAttention fuses RoPE and attention: q, kq and kq_soft_max are never
  materialized (not covered); k is read from the present key it writes (the rotated keys), k_cache and v_cache
  are the present key and value. Decode steps feed one token at a time on the present keys and values.
- A GGUF file or a Hugging Face folder is converted once (GGUF -> Hugging Face folder -> the builder) into
  $LLORCH_HOME/onnx/<name>-<sha>-<precision>/.

    dump_onnxruntime("model.gguf", prompt="...", precision="int4", decode_steps=4) -> Recorder
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from ..dump import Recorder, capture_invariance, check_rows, model_sha256, parse_rows
from ..errors import ParameterError, ReferenceError_
from ..loaders.default_model import home
from ..loaders.onnx_folder import OnnxGraph, is_onnx_folder
from .engines import check_token_ids, hf_folder_for

PRECISIONS = ("fp32", "int4")


def _import_ort():
    try:
        import onnxruntime
        import onnxruntime_genai
    except ImportError:
        raise ReferenceError_("the onnxruntime engine needs onnxruntime and onnxruntime-genai: pip install "
                              "'llorch-ref[onnx]'") from None
    return onnxruntime, onnxruntime_genai


def onnx_folder_for(model, precision: str = "fp32") -> Path:
    """An ONNX Runtime GenAI folder: MODEL itself, or built once from a GGUF file or Hugging Face folder."""
    if precision not in PRECISIONS:
        raise ParameterError(f"--precision {precision!r} must be one of {', '.join(PRECISIONS)}")
    p = Path(model)
    if is_onnx_folder(p):
        return p
    if not p.exists():
        raise ParameterError(f"{p}: no such model (an ONNX Runtime GenAI folder, a Hugging Face folder or a GGUF file)")
    out = home() / "onnx" / f"{p.stem if p.is_file() else p.name}-{model_sha256(p)[:12]}-{precision}"
    if not is_onnx_folder(out):
        build_onnx(hf_folder_for(p), out, precision)
    return out


def build_onnx(hf_folder, out: Path, precision: str):
    """onnxruntime-genai's model builder (CPU execution provider), into a staging folder renamed into place."""
    _import_ort()
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"llorch-ref: building an ONNX model ({precision}) with onnxruntime-genai's builder: {out}", file=sys.stderr)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        r = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_folder), "-o",
                            str(stage / "model"), "-p", precision, "-e", "cpu", "-c", str(stage / "cache")],
                           capture_output=True, text=True)
        if r.returncode != 0 or not is_onnx_folder(stage / "model"):
            last = (r.stderr.strip().splitlines() or ["no output"])[-1][:300]
            raise ReferenceError_(f"onnxruntime-genai's model builder failed on {hf_folder} ({last})")
        os.rename(stage / "model", out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def layer_values(g: OnnxGraph, layer: int) -> dict:
    """{dump tensor: the graph value holding it} for one layer of the builder's Llama graph."""
    pre, n = f"/model/layers.{layer}", int(g.decoder["num_hidden_layers"])
    nxt = f"/model/layers.{layer + 1}/input_layernorm/output_3" if layer + 1 < n else \
        f"/model/layers.{n}/final_norm_layernorm/output_3"
    return {"attn_norm": f"{pre}/input_layernorm/output_0", "qkv": f"{pre}/attn/qkv_proj/MatMul/output_0",
            "kqv_out": f"{pre}/attn/GroupQueryAttention/output_0", "attn_out": f"{pre}/attn/o_proj/MatMul/output_0",
            "ffn_inp": f"{pre}/post_attention_layernorm/output_3", "ffn_norm": f"{pre}/post_attention_layernorm/output_0",
            "ffn_swiglu": f"{pre}/mlp/Mul/output_0", "ffn_out": f"{pre}/mlp/down_proj/MatMul/output_0", "l_out": nxt}


class CapturedSession:
    """The decoder graph with every layer value added as a graph output (the builder leaves the final norm's
    residual sum unnamed: it is given a name), on onnxruntime with the folder's weights memory-mapped."""

    def __init__(self, g: OnnxGraph, capture: bool = True):
        ort, _ = _import_ort()
        import onnx
        self.g, self.n_layers = g, int(g.decoder["num_hidden_layers"])
        model = onnx.ModelProto()
        model.CopyFrom(g.model)
        names, values = [], []
        for t in model.graph.initializer:           # the external data, memory-mapped, handed to the session
            if t.data_location == 1:
                names.append(t.name)
                values.append(ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(g.array(t.name))))
        self.values = {}
        if capture:
            final = next(nd for nd in model.graph.node if nd.name.endswith("final_norm_layernorm/SkipLayerNorm"))
            while len(final.output) < 4:
                final.output.append("")
            final.output[3] = f"/model/layers.{self.n_layers}/final_norm_layernorm/output_3"
            model.graph.output.append(onnx.ValueInfoProto(name=final.output[0]))           # result_norm
            produced = {o for nd in model.graph.node for o in nd.output if o}
            for layer in range(self.n_layers):
                for key, v in layer_values(g, layer).items():
                    if v not in produced:
                        raise ReferenceError_(f"{g.path}: no value {v} (not a graph of onnxruntime-genai's builder "
                                              f"for a Llama-family model)")
                    self.values[(key, layer)] = v
                    model.graph.output.append(onnx.ValueInfoProto(name=v))
        so = ort.SessionOptions()
        so.add_external_initializers(names, values)
        so.log_severity_level = 3
        self.session = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        self._keep = values                          # the OrtValues must outlive the session
        self.kv, self.hd = int(g.decoder["num_key_value_heads"]), int(g.decoder["head_size"])

    def run(self, ids, past: dict | None):
        """ids: the new tokens; past: {layer: (key, value)} [1, KV, P, Hd] or None -> (outputs by name, present)."""
        p = 0 if past is None else past[0][0].shape[2]
        feeds = {"input_ids": np.asarray([ids], dtype=np.int64),
                 "attention_mask": np.ones((1, p + len(ids)), dtype=np.int64)}
        for i in range(self.n_layers):
            k, v = past[i] if past else (np.zeros((1, self.kv, 0, self.hd), np.float32),) * 2
            feeds[f"past_key_values.{i}.key"], feeds[f"past_key_values.{i}.value"] = k, v
        names = [o.name for o in self.session.get_outputs()]
        out = dict(zip(names, self.session.run(None, feeds)))
        present = {i: (out[f"present.{i}.key"], out[f"present.{i}.value"]) for i in range(self.n_layers)}
        return out, present


def _record_forward(rec: Recorder, s: CapturedSession, out: dict, present: dict, past: int, t: int, step: int):
    """One forward's layer tensors, canonical layout but for the Q/K pair order (NeoX, declared)."""
    h = int(s.g.decoder["num_attention_heads"])
    kv, hd = s.kv, s.hd
    for layer in range(s.n_layers):
        val = lambda key, layer=layer: out[s.values[(key, layer)]][0]
        qkv = val("qkv")
        rec.add("cp2.q_proj", qkv[:, :h * hd].reshape(t, h, hd), layer, step)
        rec.add("cp2.k_proj", qkv[:, h * hd:(h + kv) * hd].reshape(t, kv, hd), layer, step)
        rec.add("cp2.v", qkv[:, (h + kv) * hd:].reshape(t, kv, hd), layer, step)
        k_all, v_all = (a[0].transpose(1, 0, 2) for a in present[layer])          # [S, KV, Hd]
        rec.add("cp1B.k", k_all[past:past + t], layer, step)                         # the rotated keys GQA wrote
        rec.add("cp3.k_cache", k_all, layer, step)
        rec.add("cp3.v_cache", v_all, layer, step)
        for cp, key in (("1", "attn_norm"), ("5", "kqv_out"), ("5", "attn_out"), ("5", "ffn_inp"), ("1", "ffn_norm"),
                        ("6", "ffn_swiglu"), ("6", "ffn_out"), ("7", "l_out")):
            rec.add(f"cp{cp}.{key}", val(key), layer, step)
    final = f"/model/layers.{s.n_layers}/final_norm_layernorm/output_0"
    rec.add("cp8.result_norm", out[final][0], step=step)


def _genai(folder, ids, n_greedy):
    """ONNX Runtime GenAI on the prompt: its logits of every prompt row, and n_greedy greedy tokens (EOS ignored:
    min_length holds the generator to the full count)."""
    _, og = _import_ort()
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    total = len(ids) + max(n_greedy, 1)
    params.set_search_options(max_length=total, min_length=total, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(np.asarray(ids, dtype=np.int32))
    logits = np.array(gen.get_output("logits"), dtype=np.float32)[0]
    toks = []
    while len(toks) < n_greedy and not gen.is_done():
        gen.generate_next_token()
        toks.append(int(gen.get_next_tokens()[0]))
    return model, logits, toks


def dump_onnxruntime(model, prompt=None, token_ids=None, n_greedy=32, decode_steps=0, decode_ids=None, rows=None,
                     precision="fp32") -> Recorder:
    """ONNX Runtime GenAI on an ONNX folder (or a GGUF file / Hugging Face folder built into one) -> Recorder.
    rows: the prompt rows to keep (indices, or a --rows spec such as "every:64")."""
    ort, og = _import_ort()
    folder = onnx_folder_for(model, precision)
    g = OnnxGraph(folder)
    n_vocab, ctx = int(g.genai["model"]["vocab_size"]), int(g.genai["model"].get("context_length", 2048))
    tok = None
    if token_ids is None:
        if prompt is None:
            raise ParameterError("give a prompt or token ids")
        tok = og.Tokenizer(og.Model(str(folder)))
        token_ids = [int(t) for t in tok.encode(prompt)]
    steps = len(decode_ids) if decode_ids is not None else int(decode_steps)
    ids = check_token_ids(token_ids, n_vocab, ctx - steps)
    rows = parse_rows(rows, len(ids)) if isinstance(rows, str) else check_rows(rows, len(ids))
    _, logits, greedy = _genai(folder, ids, n_greedy)
    s = CapturedSession(g)
    mm = next((n for n in g.model.graph.node if n.op_type == "MatMulNBits"), None)
    settings = {"onnxruntime": ort.__version__, "onnxruntime_genai": og.__version__, "execution_provider": "cpu",
                "precision": "int4" if mm is not None else "fp32"}
    if mm is not None:
        a = g.attrs(mm)
        settings.update(bits=a["bits"], block_size=a["block_size"], accuracy_level=a.get("accuracy_level", 0))
    # accuracy_level 4: MatMulNBits quantizes its input to int8 blocks, which numerics "ort" reproduces
    numerics = "ort" if mm is not None and g.attrs(mm).get("accuracy_level", 0) == 4 else "exact"
    rec = Recorder("onnxruntime-genai", og.__version__, model_path=folder, token_ids=ids, prompt=prompt, rows=rows,
                   layouts={"rope_pairs": "neox"},
                   notes="GroupQueryAttention fuses RoPE and attention: q, kq and kq_soft_max are not materialized; "
                         "k is the present key at the new positions",
                   extra={"arithmetic": {"numerics": numerics, "kv_dtype": "float32", "settings": settings}})
    if tok is not None:
        rec.add("cp0.token_ids", np.asarray(token_ids, dtype=np.int64))
    out, present = s.run(ids, None)
    _record_forward(rec, s, out, present, 0, len(ids), 0)
    rec.add("cp8.logits", logits)
    rec.extra["capture_invariance"] = capture_invariance(out["logits"][0], logits)
    rec.extra["capture_invariance"]["what"] = ("logits of the captured onnxruntime session minus ONNX Runtime GenAI's "
                                               "own logits of the prompt")
    rec.add("cp9.logits", logits[-1])
    rec.add("cp10.argmax", logits.argmax(-1).astype(np.int64))
    if n_greedy > 0:
        rec.add("cp12.greedy_tokens", np.asarray(greedy, dtype=np.int64))
    fed, last, past = [], logits[-1], len(ids)
    for k in range(1, steps + 1):
        t = int(decode_ids[k - 1]) if decode_ids is not None else int(np.argmax(last))
        out, present = s.run([t], present)
        _record_forward(rec, s, out, present, past, 1, k)
        last = out["logits"][0, -1]
        rec.add("cp8.logits", out["logits"][0], step=k)
        fed.append(t)
        past += 1
    if steps:
        rec.extra["decode_token_ids"] = fed
    return rec
