"""The default model's vocabulary alone (every tokenizer.* key, 1.7 MB), to carry where its 98 MB file cannot go:
python results/cpu/2026-11-28-s23-device-calls/make_vocab.py .dev/smol-vocab.gguf"""
import sys

import gguf

sys.path.insert(0, "tools")
from make_big_model import copy_vocab  # noqa: E402

from llorch_ref.loaders.default_model import default_model_path  # noqa: E402

w = gguf.GGUFWriter(sys.argv[1], "llama")
copy_vocab(w, default_model_path(), 49152)
w.write_header_to_file(), w.write_kv_data_to_file(), w.write_ti_data_to_file(), w.close()
