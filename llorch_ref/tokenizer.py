"""Tokenizers built from GGUF metadata with the `tokenizers` library, matching llama.cpp's tokenize.

Byte-level BPE (`tokenizer.ggml.model = gpt2`): the pre-tokenizer regexes are llama.cpp's for the
`tokenizer.ggml.pre` name, applied one after the other like llama.cpp's unicode_regex_split.
SentencePiece-style (`llama`): BPE over score-ranked merges with byte fallback, the same algorithm as
llama.cpp's SPM tokenizer. Special/control tokens are split out first (parse_special=True).
"""
from __future__ import annotations

import atexit
import codecs
import functools
import json
import os
import re
import subprocess
import sys
import threading
import time

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
        """The messages rendered by the model's chat template, within the bounds of render_chat_template."""
        if not self.chat_template:
            raise TokenizerError("the model has no chat template (tokenizer.chat_template is missing)")
        return render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                    bos_token=self.tokens[self.bos_id] if self.bos_id is not None else "",
                                    eos_token=self.tokens[self.eos_id] if self.eos_id is not None else "")

    def encode_spans(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """text -> (ids, (start, end) character span of each id) without BOS/EOS: for tokenizing a long text
        in windows (the ids a window shares with the next are found by their spans)."""
        if not text:
            return [], []
        enc = self.hf.encode_batch([text], add_special_tokens=False)[0]
        return list(enc.ids), list(enc.offsets)


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


# Chat templates are code from the model file. They render in jinja2's immutable sandbox (no attribute of
# Python's internals, no mutation of lists and dicts, range() at most 100000 items) with every size bounded by a
# limit derived from the messages (render_limit), in a helper interpreter whose address space and CPU time are
# capped for each render and which is killed past a wall-time deadline: what the bounds below do not foresee
# (a join, a captured block) still cannot take the machine or stall the caller.
RENDER_BASE = 1 << 20            # characters a template may add to twice its messages' characters
RENDER_SECONDS = 5.0             # wall time (and CPU time) of one render
RENDER_MEMORY_BASE = 256 << 20   # bytes a render may allocate, besides RENDER_BYTES_PER_CHAR per limit character
RENDER_BYTES_PER_CHAR = 16
INT_BITS = 1 << 16               # the largest integer a template may make (bits)


def render_limit(messages) -> int:
    """The most characters a chat template may render, and the largest size (characters or items) any value in
    it may reach: twice the messages' characters plus RENDER_BASE (templates wrap and repeat their messages; they
    do not multiply them)."""
    return 2 * sum(len(str(m.get("content", ""))) for m in messages if isinstance(m, dict)) + RENDER_BASE


def render_memory(limit: int) -> int:
    """The bytes one render may allocate: RENDER_MEMORY_BASE plus RENDER_BYTES_PER_CHAR per limit character."""
    return RENDER_MEMORY_BASE + RENDER_BYTES_PER_CHAR * limit


def render_chat_template(template: str, messages, **variables) -> str:
    """template rendered with messages and variables (strings) -> text, or one TokenizerError ("chat template
    failed: ...") for anything the template does wrong: a jinja2 error, a size over render_limit(messages), a
    Python error, memory over render_memory(limit), or RENDER_SECONDS of time. Rendered by the helper process
    (_RENDERER); where it cannot start, here, with the same size bounds and no memory or time cap."""
    request = {"template": template, "messages": list(messages), "variables": variables}
    try:
        return _RENDERER.render(request)
    except _HelperUnavailable:
        try:
            return _render_bounded(request)
        except Exception as e:      # noqa: BLE001 (anything the template raises is the template's error)
            raise TokenizerError(f"chat template failed: {_reason(e)}") from None


class TemplateBoundError(Exception):
    """A chat template made (or was about to make) a value or an output over its bounds."""


class _HelperUnavailable(Exception):
    """The render helper cannot be started here."""


def _reason(e: BaseException) -> str:
    """A template's exception as one short line: jinja2's own errors by message, others by type and message."""
    from jinja2 import TemplateError

    msg = str(e).splitlines()[0][:300] if str(e) else ""
    if isinstance(e, (TemplateError, TemplateBoundError)):
        return msg or type(e).__name__
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def _render_bounded(request: dict) -> str:
    """One render request in this interpreter, every size bounded by render_limit of its messages."""
    limit = render_limit(request["messages"])
    compiled = _sandbox_class()(limit).from_string(request["template"])
    return _stream_bounded(compiled.generate(messages=request["messages"], **request["variables"]), limit)


class _Renderer:
    """The helper interpreter that renders chat templates for this process: started on first use (about 0.3 s),
    in a session of its own (a terminal's Ctrl-C is the caller's), one request at a time, a JSON line each way on
    its stdin and stdout. A render past RENDER_SECONDS kills it; the next render starts a new one."""

    def __init__(self):
        self.lock = threading.Lock()
        self.proc = None

    def render(self, request: dict) -> str:
        line = (json.dumps(request) + "\n").encode()
        with self.lock:
            proc = self._started()
            try:
                proc.stdin.write(line)
                proc.stdin.flush()
                answer = self._answer(proc, time.monotonic() + RENDER_SECONDS)
            except (OSError, ValueError) as e:
                self._stop()
                raise TokenizerError(f"chat template failed: its render process ended ({e})") from None
        if "text" in answer:
            return answer["text"]
        raise TokenizerError(f"chat template failed: {answer['error']}")

    def _started(self):
        """The running helper, started (and its ready line awaited, up to HELPER_START_SECONDS) if there is none."""
        if self.proc is None or self.proc.poll() is not None:
            try:
                self.proc = subprocess.Popen([sys.executable, "-c", "from llorch_ref.tokenizer import serve_renders; "
                                              "serve_renders()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                             stderr=subprocess.DEVNULL, start_new_session=True)
            except OSError as e:
                raise _HelperUnavailable(str(e)) from None
            if self._answer(self.proc, time.monotonic() + HELPER_START_SECONDS).get("ready") is not True:
                raise _HelperUnavailable("the render helper did not start")
        return self.proc

    def _answer(self, proc, deadline: float) -> dict:
        """The helper's answer line, read before the deadline (else the helper is killed)."""
        import select

        fd, data = proc.stdout.fileno(), b""
        poll = select.poll()
        poll.register(fd, select.POLLIN)
        while not data.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not poll.poll(left * 1000):
                self._stop()
                return {"error": f"it took more than {RENDER_SECONDS:g} s to render"}
            piece = os.read(fd, 1 << 20)
            if not piece:
                self._stop()
                return {"error": "its render process ended without an answer (killed for its memory or CPU time)"}
            data += piece
        return json.loads(data)

    def _stop(self):
        """The helper killed and reaped (a render overran, or its pipe broke)."""
        if self.proc is not None:
            self.proc.kill()
            self.close()

    def close(self):
        """The helper told to end (its stdin closed) and reaped; killed if it does not end within a second."""
        if self.proc is None:
            return
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=1)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self.proc = None


HELPER_START_SECONDS = 60.0      # a loaded machine may take this long to start an interpreter
_RENDERER = _Renderer()
atexit.register(_RENDERER.close)


def serve_renders():
    """The render helper's loop: a JSON request a line on stdin -> {"text"} or {"error"} a line on stdout; each
    render under RLIMIT_AS of this process's size plus render_memory(limit) and RLIMIT_CPU of RENDER_SECONDS more
    than it has used. Ends when stdin closes (its parent is gone)."""
    _no_core_files()
    sys.stdout.write(json.dumps({"ready": True}) + "\n")
    sys.stdout.flush()
    for line in sys.stdin.buffer:
        request = json.loads(line)
        _cap(render_memory(render_limit(request["messages"])))
        try:
            answer = {"text": _render_bounded(request)}
        except MemoryError:
            answer = {"error": f"it needs more than {render_memory(render_limit(request['messages'])) >> 20} MiB "
                               "of memory (the cap of one render)"}
        except Exception as e:      # noqa: BLE001 (anything the template raises is the template's error)
            answer = {"error": _reason(e)}
        _cap(None)
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


def _cap(memory: int | None):
    """The helper's limits for one render (memory: bytes it may grow by; RENDER_SECONDS more CPU time), or, with
    None, lifted back to its hard limits. A platform without them (no resource module, no /proc) keeps the
    parent's wall-time deadline only."""
    try:
        import resource
    except ImportError:
        return
    size = _vm_size()
    for kind, now, extra in ((resource.RLIMIT_AS, size, memory),
                             (resource.RLIMIT_CPU, _cpu_seconds(), int(RENDER_SECONDS) + 1)):
        _, hard = resource.getrlimit(kind)
        if memory is None or now is None:
            soft = hard
        else:
            soft = now + extra if hard == resource.RLIM_INFINITY else min(now + extra, hard)
        resource.setrlimit(kind, (soft, hard))


def _no_core_files():
    """A helper killed for its CPU time (SIGXCPU) leaves no core file behind."""
    try:
        import resource
        resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    except (ImportError, ValueError, OSError):
        pass


def _vm_size() -> int | None:
    try:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        return None


def _cpu_seconds() -> int:
    t = os.times()
    return int(t.user + t.system) + 1


def _stream_bounded(pieces, limit: int) -> str:
    """The template's output pieces joined, refused as soon as they pass `limit` characters."""
    out, n = [], 0
    for p in pieces:
        n += len(p)
        if n > limit:
            raise TemplateBoundError(f"its output passes {limit} characters (the limit: twice the messages' "
                                     f"characters plus {RENDER_BASE})")
        out.append(p)
    return "".join(out)


_SIZED = (str, bytes, list, tuple, dict, set, frozenset)


def _size(v) -> int:
    return len(v) if isinstance(v, _SIZED) else 0


def _format_bound(fmt: str, values) -> int:
    """An upper bound of the length of fmt % values or fmt.format(*values): every field as long as the widest
    number written in fmt plus the longest value."""
    widest = max((int(d) if len(d) <= 18 else 1 << 62 for d in re.findall(r"\d+", fmt)), default=0)
    longest = max((len(str(v)) for v in values), default=0)
    return len(fmt) + (fmt.count("%") + fmt.count("{")) * (widest + longest)


def _binop_bound(op: str, left, right, limit: int):
    """Refuses a * b, a + b, a % b, a ** b whose result would pass the limit (characters or items; INT_BITS for
    integers), before it is made."""
    ints = isinstance(left, int) and isinstance(right, int)
    if op == "*":
        seq, n = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(seq, _SIZED) and isinstance(n, int) and len(seq) * max(n, 0) > limit:
            raise TemplateBoundError(f"'*' would make {len(seq) * n} characters or items ({len(seq)} x {n}); the "
                                     f"limit is {limit}")
        if ints and left.bit_length() + right.bit_length() > INT_BITS:
            raise TemplateBoundError(f"a product of {INT_BITS} bits or more")
    elif op == "+" and _size(left) + _size(right) > limit:
        raise TemplateBoundError(f"'+' would make {_size(left) + _size(right)} characters or items; the limit is "
                                 f"{limit}")
    elif op == "%" and isinstance(left, str):
        values = right.values() if isinstance(right, dict) else right if isinstance(right, tuple) else (right,)
        if _format_bound(left, values) > limit:
            raise TemplateBoundError(f"'%' formats widths or fields that may pass the limit of {limit} characters")
    elif op == "**" and ints and right > 0 and right * max(left.bit_length(), 1) > INT_BITS:
        raise TemplateBoundError(f"{left} ** {right} has more than {INT_BITS} bits")


def _format_values(args, kwargs) -> list:
    """What a format call fills its fields with: its arguments, and the values of a mapping among them."""
    return [*args, *kwargs.values(), *(v for a in args if isinstance(a, dict) for v in a.values())]


def _check_sizes(values, limit: int, what: str):
    """Every string, bytes, list, tuple, dict or set among values holds at most `limit` characters or items."""
    for v in values:
        if _size(v) > limit:
            raise TemplateBoundError(f"{what}: a value of {_size(v)} characters or items; the limit is {limit}")


def _check_counts(values, limit: int, what: str):
    """Integer arguments that set a size (a width, a count) are at most the limit."""
    for v in values:
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > limit:
            raise TemplateBoundError(f"{what}: a width or count of {v}; the limit is {limit}")


def _bounded_result(v, limit: int, what: str):
    """v, refused if it holds more than `limit` characters or items (what a call or filter made)."""
    _check_sizes((v,), limit, what)
    return v


@functools.lru_cache(maxsize=1)
def _sandbox_class():
    """BoundedSandbox, built on first use (jinja2 is imported only by commands that render a template)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import Namespace

    class BoundedNamespace(Namespace):
        """jinja2's namespace() whose attributes are bounded like every other value."""
        limit = RENDER_BASE                       # read as type(self).limit: a Namespace answers its own names

        def __setitem__(self, name, value):
            _check_sizes((value,), type(self).limit, f"namespace attribute {name!r}")
            super().__setitem__(name, value)

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        """The immutable sandbox with every operator that grows a value (* + % **), every call, every filter and
        every buffer join checked against the limit: sizes before the value is made where they can be known
        (repetitions, format widths, integer widths and counts), and every result after."""
        intercepted_binops = frozenset({"*", "+", "%", "**"})

        def __init__(self, limit: int):
            super().__init__(trim_blocks=True, lstrip_blocks=True)
            self.limit = limit
            self.globals["raise_exception"] = _raise_exception
            self.globals["namespace"] = type("namespace", (BoundedNamespace,), {"limit": limit})
            self.filters = {name: self._bounded_filter(name, f) for name, f in self.filters.items()}

        def call_binop(self, context, operator, left, right):
            _binop_bound(operator, left, right, self.limit)
            return _bounded_result(super().call_binop(context, operator, left, right), self.limit, operator)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's signature)
            target = getattr(__obj, "__wrapped__", __obj)
            what = getattr(target, "__name__", None) or f"macro {getattr(target, 'name', '?')}"
            _check_sizes((*args, *kwargs.values()), __self.limit, what)
            if isinstance(getattr(target, "__self__", None), str):
                _check_counts((*args, *kwargs.values()), __self.limit, what)
                fields = _format_values(args, kwargs)
                if what in ("format", "format_map") and _format_bound(target.__self__, fields) > __self.limit:
                    raise TemplateBoundError(f"format: widths or fields that may pass the limit of {__self.limit} "
                                             "characters")
            elif what in _COUNTED:
                _check_counts((*args, *kwargs.values()), __self.limit, what)
            return _bounded_result(super().call(__context, __obj, *args, **kwargs), __self.limit, what)

        def concat(self, parts):
            parts = list(parts)
            if sum(map(len, parts)) > self.limit:
                raise TemplateBoundError(f"a block's output would pass the limit of {self.limit} characters")
            return "".join(parts)

        def _bounded_filter(self, name, f):
            @functools.wraps(f)
            def bounded(*args, **kwargs):
                values = [a for a in args if isinstance(a, (*_SIZED, int))]
                _check_sizes(values, self.limit, f"filter {name}")
                if name == "format" and values and isinstance(values[0], str):
                    if _format_bound(values[0], values[1:] + list(kwargs.values())) > self.limit:
                        raise TemplateBoundError(f"filter format: widths or fields that may pass the limit of "
                                                 f"{self.limit} characters")
                else:
                    _check_counts(values[1:] + list(kwargs.values()), self.limit, f"filter {name}")
                return _bounded_result(f(*args, **kwargs), self.limit, f"filter {name}")
            return bounded
    return BoundedSandbox


_COUNTED = ("safe_range", "generate_lorem_ipsum")     # jinja2's globals whose integer arguments are counts


def _raise_exception(msg):
    from jinja2 import TemplateError

    raise TemplateError(msg)
