"""tools/make_big_model.py's Q4_K_M mix against llama.cpp's own quantizer: the same block type for every matrix."""
import collections
import ctypes
import importlib.util
from pathlib import Path

import gguf

from llorch_ref.testing.tiny import write_tiny_model

TOOL = Path(__file__).resolve().parents[1] / "tools" / "make_big_model.py"


def _tool():
    spec = importlib.util.spec_from_file_location("make_big_model", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_q4_k_m_mix_is_llamacpps(tmp_path, llamacpp):
    """A 32-layer model (rows of 256, so that every matrix can take a K-quant) quantized by llama.cpp to Q4_K_M:
    each matrix's type is make_big_model.tensor_type's (Q6_K output, attn_v and ffn_down in the layers more_bits
    names: 16 of 32), and a plain type's mix is that type throughout."""
    mod = _tool()
    src = write_tiny_model(tmp_path / "f32.gguf", vocab="none", d_model=256, d_ff=512, n_layers=32, n_heads=4,
                           n_kv_heads=2, weight_type="F32")
    p = llamacpp.llama_model_quantize_default_params()
    p.ftype = llamacpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    dst = tmp_path / "q4km.gguf"
    assert llamacpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p)) == 0
    kinds = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o", "ffn_gate": "gate", "ffn_up": "up",
             "ffn_down": "down"}
    seen = collections.Counter()
    for t in gguf.GGUFReader(dst).tensors:
        parts = t.name.split(".")
        if parts[0] == "blk" and parts[2] in kinds:
            want = mod.tensor_type("Q4_K_M", kinds[parts[2]], int(parts[1]), 32)
        elif t.name == "output.weight":
            want = mod.tensor_type("Q4_K_M", "output", 0, 32)
        else:
            continue
        assert t.tensor_type.name == want, t.name
        seen[want] += 1
    assert seen == {"Q4_K": 32 * 7 - 32, "Q6_K": 32 + 1}
    assert {mod.tensor_type("Q4_0", k, i, 32) for k in kinds.values() for i in range(32)} == {"Q4_0"}
