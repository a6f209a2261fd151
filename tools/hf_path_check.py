"""Default model through the Hugging Face path: GGUF -> HF folder -> llorch-ref and transformers.

    python tools/hf_path_check.py [--model GGUF] [--out DIR]

Prints max abs / NMSE / cosine of the logits: GGUF path vs HF path (llorch-ref, Q/K rows permuted at load
as by default, and kept half-split with qk_layout="neox"), and llorch-ref vs
transformers (float32, eager attention) on the converted folder, plus greedy agreement over 32 tokens."""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import llorch_ref
from llorch_ref.convert import convert_gguf_to_hf
from llorch_ref.engine import Engine
from llorch_ref.harness.metrics import compare
from llorch_ref.loaders.hf_folder import load_hf_folder


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--prompt", default="The capital of France is")
    a = ap.parse_args()
    from llorch_ref.loaders.default_model import default_model_path
    gguf_path = Path(a.model or default_model_path())
    out = Path(a.out or tempfile.mkdtemp()) / (gguf_path.stem + "-hf")
    convert_gguf_to_hf(gguf_path, out, overwrite=True)
    eg, eh = llorch_ref.load(gguf_path), llorch_ref.load(out)
    ids = eg.encode_prompt(a.prompt, chat=True)
    lg, lh = eg.logits(ids), eh.logits(ids)
    print(f"model {gguf_path.name}, {len(ids)} prompt tokens (chat template)")
    print(f"GGUF path vs HF path (llorch-ref):      {compare(lh, lg)}")
    native = load_hf_folder(out, qk_layout="neox")      # rows as stored, half-split RoPE
    ln = Engine(native.config, native.weights, native.tokenizer).logits(ids)
    print(f"GGUF path vs HF path, qk_layout=neox:   {compare(ln, lg)}")
    ga = list(eg.generate_ids(ids, max_tokens=32, ignore_eos=True))
    gb = list(eh.generate_ids(ids, max_tokens=32, ignore_eos=True))
    print(f"greedy 32 tokens GGUF vs HF path: {sum(x == y for x, y in zip(ga, gb))}/32 identical")
    import torch
    import transformers
    m = transformers.AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    with torch.no_grad():
        lt = m(torch.tensor([ids])).logits[0].numpy()
        gt = m.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, min_new_tokens=32)[0, len(ids):]
    print(f"transformers {transformers.__version__} vs llorch-ref (HF folder): {compare(lh, lt)}")
    gt = gt.tolist()
    print(f"greedy 32 tokens transformers vs llorch-ref: {sum(x == y for x, y in zip(ga, gt))}/32 identical")
    print("transformers text:", repr(eh.tokenizer.decode(gt)))


if __name__ == "__main__":
    main()
