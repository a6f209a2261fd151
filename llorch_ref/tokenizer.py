"""Tokenizers built from GGUF metadata with the `tokenizers` library, matching llama.cpp's tokenize.

Byte-level BPE (`tokenizer.ggml.model = gpt2`): the pre-tokenizer regexes are llama.cpp's for the
`tokenizer.ggml.pre` name, applied one after the other like llama.cpp's unicode_regex_split.
SentencePiece-style (`llama`): BPE over score-ranked merges with byte fallback, the same algorithm as
llama.cpp's SPM tokenizer. Special/control tokens are split out first (parse_special=True).
"""
from __future__ import annotations

import codecs

import numpy as np

from .errors import TokenizerError

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEFAULT = ([r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"], False)
# tokenizer.ggml.pre -> (regexes applied in order, ignore_merges), as llama.cpp's llama-vocab.cpp maps them
PRE_TOKENIZERS = {
    "default": _DEFAULT,
    **{n: ([_GPT2], False) for n in ("gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4")},
    **{n: ([r"\p{N}", _GPT2], False) for n in ("smollm", "starcoder", "refact", "command-r", "codeshell",
                                                "exaone", "minerva-7b")},
    **{n: ([_LLAMA3], True) for n in ("llama-bpe", "llama3", "llama-v3", "falcon3")},
    **{n: ([_LLAMA3], False) for n in ("dbrx", "smaug-bpe")},
    **{n: ([_QWEN2], False) for n in ("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2")},
}
# Names llama.cpp knows with pre-tokenizers llorch-ref does not implement: refused, never approximated.
UNSUPPORTED_PRE = {"deepseek-llm", "deepseek-coder", "deepseek-v3", "falcon", "poro-chat", "glm4", "chatglm-bpe",
                   "viking", "tekken", "bloom", "gpt3-finnish", "chameleon", "gpt-4o", "llama4", "superbpe",
                   "trillion", "bailingmoe", "seed-coder", "hunyuan", "kimi-k2", "grok-2", "afmoe", "minimax-m2",
                   "falcon-h1", "pixtral", "lfm2", "midm-2.0", "kormo", "granite-docling"}

TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6
# Token texts llama.cpp treats as end-of-generation besides the declared EOS/EOT ids.
EOG_TEXTS = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>", "_<EOT>",
             "<｜end▁of▁sentence｜>", "<|end_of_text|>", "<|eom_id|>", "</s>"}


def _bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_BYTE_ENC = _bytes_to_unicode()
_BYTE_DEC = {c: b for b, c in _BYTE_ENC.items()}


class Tokenizer:
    """encode(text) -> ids (what llama_tokenize(add_special=True, parse_special=True) returns);
    decode(ids) -> text; token_bytes(id) -> the raw bytes a token stands for (for streaming)."""

    def __init__(self, hf, kind, tokens, token_types, bos_id, eos_id, add_bos, add_eos, eog_ids,
                 chat_template, add_space_prefix=False, pre=None):
        self.hf, self.kind, self.tokens = hf, kind, tokens
        self.token_types = token_types
        self.bos_id, self.eos_id = bos_id, eos_id
        self.add_bos, self.add_eos = add_bos, add_eos
        self.eog_ids = frozenset(eog_ids)
        self.chat_template = chat_template
        self.add_space_prefix = add_space_prefix
        self.pre = pre
        self._bytes_cache = None

    @property
    def _bytes(self) -> list:
        """Every token's bytes, built on first use (streaming, decode) rather than at load."""
        if self._bytes_cache is None:
            self._bytes_cache = [self._piece_bytes(i) for i in range(len(self.tokens))]
        return self._bytes_cache

    @property
    def n_vocab(self):
        return len(self.tokens)

    def _piece_bytes(self, i: int) -> bytes:
        s, tt = self.tokens[i], self.token_types[i]
        if tt in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN):
            return s.encode("utf-8")
        if self.kind == "gpt2":
            try:
                return bytes(_BYTE_DEC[c] for c in s)
            except KeyError:
                return s.encode("utf-8")
        if tt == TOKEN_BYTE and len(s) == 6 and s.startswith("<0x"):
            return bytes([int(s[3:5], 16)])
        return s.replace("\u2581", " ").encode("utf-8")

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TokenizerError(f"text must be str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise TokenizerError(f"text is not valid UTF-8: character {e.start} is {text[e.start]!r} "
                                 f"(a lone surrogate, e.g. from undecodable bytes)") from None
        # encode_batch releases the GIL while it works (encode does not): a 1 MB prompt tokenized in a server
        # thread no longer stalls the event loop for half a second; the ids are the same
        ids = self.hf.encode_batch([text], add_special_tokens=False)[0].ids if text else []
        if add_special and self.add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        if add_special and self.add_eos and self.eos_id is not None:
            ids = ids + [self.eos_id]
        return ids

    def token_bytes(self, i: int) -> bytes:
        return self._bytes[i]

    def decode(self, ids, remove_special: bool = True) -> str:
        """ids -> text. remove_special drops the BOS/EOS that encode() adds, so decode(encode(s)) == s."""
        ids = [int(i) for i in ids]
        if remove_special and self.add_bos and ids and ids[0] == self.bos_id:
            ids = ids[1:]
        if remove_special and self.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        data = b"".join(self._bytes[i] for i in ids)
        text = data.decode("utf-8", errors="replace")
        if self.kind == "llama" and self.add_space_prefix and text.startswith(" "):
            text = text[1:]
        return text

    def stream_decoder(self):
        return StreamDecoder(self)

    def apply_chat_template(self, messages, add_generation_prompt=True) -> str:
        if not self.chat_template:
            raise TokenizerError("the model has no chat template (tokenizer.chat_template is missing)")
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(msg):
            raise TemplateError(msg)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.tokens[self.bos_id] if self.bos_id is not None else "",
                eos_token=self.tokens[self.eos_id] if self.eos_id is not None else "")
        except TemplateError as e:
            raise TokenizerError(f"chat template failed: {e}") from None


class StreamDecoder:
    """Turns token ids into text pieces; a character split over several tokens is emitted once, whole."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self.dec.decode(self.tok.token_bytes(int(token_id)))

    def flush(self) -> str:
        return self.dec.decode(b"", final=True)


def _ids_of_types(types, kinds) -> list:
    """The ids whose token type is one of `kinds` (a vocabulary's few special ones among tens of thousands)."""
    return np.flatnonzero(np.isin(np.asarray(types), kinds)).tolist()


def _special_added_tokens(tokens, types):
    from tokenizers import AddedToken

    return [AddedToken(tokens[i], special=True, normalized=False)
            for i in _ids_of_types(types, (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN))]


def _first_ids(tokens) -> dict:
    """token text -> its first id (a vocabulary may repeat a text): built from the end, so the first id is written
    last."""
    return dict(zip(reversed(tokens), range(len(tokens) - 1, -1, -1)))


def build_gpt2(tokens, types, merges, pre):
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    if pre in UNSUPPORTED_PRE or pre not in PRE_TOKENIZERS and pre.startswith("jina"):
        raise TokenizerError(f"pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not implemented; "
                             f"implemented: {', '.join(sorted(PRE_TOKENIZERS))}")
    if pre not in PRE_TOKENIZERS:   # llama.cpp falls back to 'default' for names it does not know; so do we
        import sys
        print(f"llorch-ref: warning: unknown pre-tokenizer {pre!r}, using 'default' as llama.cpp does",
              file=sys.stderr)
    regexes, ignore_merges = PRE_TOKENIZERS.get(pre, PRE_TOKENIZERS["default"])
    vocab = _first_ids(tokens)
    merge_pairs = [tuple(m.split(" ", 1)) for m in merges]
    if min(map(len, merge_pairs), default=2) < 2:
        bad = next(m for m, pair in zip(merges, merge_pairs) if len(pair) < 2)
        raise TokenizerError(f"malformed merge {bad!r} in tokenizer.ggml.merges")
    model = models.BPE(vocab=vocab, merges=merge_pairs, ignore_merges=ignore_merges)
    hf = HFTokenizer(model)
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(_special_added_tokens(tokens, types))
    return hf


def _build_spm(tokens, types, scores, add_space_prefix, unk_id):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers

    vocab = _first_ids(tokens)
    # llama.cpp's SPM tokenizer merges the adjacent pair whose concatenation has the highest score;
    # BPE with merges ranked by that score does the same.
    merges = []
    for i in np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable"):
        piece = tokens[i]
        if types[i] != TOKEN_NORMAL or len(piece) < 2:
            continue
        for j in range(1, len(piece)):
            a, b = piece[:j], piece[j:]
            if a in vocab and b in vocab:
                merges.append((vocab[a], vocab[b], int(i), a, b))
    merges.sort(key=lambda m: (-float(scores[m[2]]), m[0], m[1]))
    model = models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in merges], byte_fallback=True,
                       unk_token=tokens[unk_id] if unk_id is not None else None, fuse_unk=True)
    hf = HFTokenizer(model)
    norms = [normalizers.Prepend("\u2581")] if add_space_prefix else []
    hf.normalizer = normalizers.Sequence(norms + [normalizers.Replace(" ", "\u2581")])
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    hf.add_special_tokens(_special_added_tokens(tokens, types))
    return hf


def from_gguf_metadata(meta: dict, source="") -> Tokenizer | None:
    """-> Tokenizer, or None for `no_vocab` models (token ids only). Any failure is one TokenizerError."""
    try:
        return _from_gguf_metadata(meta, source)
    except TokenizerError:
        raise
    except Exception as e:  # the tokenizers library rejects inconsistent vocabularies with plain Exceptions
        msg = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise TokenizerError(f"{source}: the vocabulary cannot be turned into a tokenizer: {msg}") from None


def _from_gguf_metadata(meta: dict, source="") -> Tokenizer | None:
    kind = meta.get("tokenizer.ggml.model")
    if kind is None or kind == "no_vocab" or kind == "none":
        return None
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise TokenizerError(f"{source}: tokenizer.ggml.tokens is missing or empty")
    tokens = list(tokens)
    types = np.asarray(meta.get("tokenizer.ggml.token_type", [TOKEN_NORMAL] * len(tokens))).astype(int).tolist()
    if len(types) != len(tokens):
        raise TokenizerError(f"{source}: {len(types)} token types for {len(tokens)} tokens")

    def opt_id(key, default=None):
        v = meta.get(key, default)
        if v is None:
            return None
        v = int(v)
        if not 0 <= v < len(tokens):
            raise TokenizerError(f"{source}: {key}={v} is outside the vocabulary (0..{len(tokens) - 1})")
        return v

    if kind == "gpt2":
        pre = str(meta.get("tokenizer.ggml.pre", "default"))
        merges = list(meta.get("tokenizer.ggml.merges", []))
        hf = build_gpt2(tokens, types, merges, pre)
        bos, eos = opt_id("tokenizer.ggml.bos_token_id", 11), opt_id("tokenizer.ggml.eos_token_id", 11)
        add_space_prefix = False
        add_bos_default = pre in ("llama-bpe", "llama3", "llama-v3", "falcon3")
    elif kind == "llama":
        pre = None
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise TokenizerError(f"{source}: SentencePiece vocabulary needs tokenizer.ggml.scores for every token")
        add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        unk = opt_id("tokenizer.ggml.unknown_token_id", 0)
        hf = _build_spm(tokens, types, scores, add_space_prefix, unk)
        bos, eos = opt_id("tokenizer.ggml.bos_token_id", 1), opt_id("tokenizer.ggml.eos_token_id", 2)
        add_bos_default = True
    else:
        raise TokenizerError(f"{source}: tokenizer model {kind!r} is not supported (supported: gpt2, llama, no_vocab)")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    eog = {i for i in (eos, opt_id("tokenizer.ggml.eot_token_id"), opt_id("tokenizer.ggml.eom_token_id"))
           if i is not None}
    eog |= {i for i in _ids_of_types(types, (TOKEN_CONTROL, TOKEN_USER_DEFINED)) if tokens[i] in EOG_TEXTS}
    return Tokenizer(hf, kind, tokens, types, bos, eos, add_bos, add_eos, eog,
                     meta.get("tokenizer.chat_template"), add_space_prefix=add_space_prefix, pre=pre)
