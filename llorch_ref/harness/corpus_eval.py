"""A subject and a reference over a corpus, in chunks, as llama-perplexity --kl-divergence runs them: the text
tokenized as one (BOS first), cut into chunks of ctx tokens, each chunk's first token replaced by BOS, the second
half of each chunk scored (positions ctx/2 .. ctx-2 predict the next token). In-process, or on Ray
(harness/ray_eval.py): the same chunks, the same scores, every chunk counted once.

Bounded by the request: the text file is at most TEXT_LIMIT bytes, read and tokenized in windows (the ids
those of the whole text) only as far as the chunks need; the memory a run needs (eval_memory) is checked
against MEMORY_SHARE of what this process may still take before anything runs.
"""
from __future__ import annotations

import codecs
import math
import resource
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import ParameterError
from ..loaders.lazy_weights import mem_available
from ..loaders.text_file import TEXT_LIMIT, checked_path
from .kld import SCORE_BLOCK_BYTES, ChunkScores, array_module, kld_by_position, score_chunk, summary

WINDOW = 1 << 18           # characters of the text tokenized at a time
OVERLAP = 1 << 13          # characters two windows share: where their tokens agree, the second takes over
MEMORY_SHARE = 0.5         # of the memory this process may still take, the most a run may need


def text_file(path) -> Path:
    """--text PATH, checked before a byte is read (loaders.text_file.checked_path): it exists, is a regular file
    (or a link to one) and holds at most TEXT_LIMIT bytes."""
    return checked_path(path, "--text", TEXT_LIMIT)


def _text_blocks(path: Path):
    """The file's characters, decoded as UTF-8 a MiB at a time; at most TEXT_LIMIT bytes (a file that grows
    while it is read is cut off by the same limit)."""
    dec = codecs.getincrementaldecoder("utf-8")()
    done = 0
    with open(path, "rb") as f:
        while True:
            b = f.read(1 << 20)
            if done + len(b) > TEXT_LIMIT:
                raise ParameterError(f"--text {path}: more than {TEXT_LIMIT >> 20} MiB: give a shorter text")
            try:
                yield dec.decode(b, final=not b)
            except UnicodeDecodeError as e:
                raise ParameterError(f"--text {path}: cannot read it as UTF-8 text (byte {done + e.start}: "
                                     f"{e.reason})") from None
            if not b:
                return
            done += len(b)


def corpus_ids(path, tok, need: int | None = None) -> array:
    """The text's token ids (4 bytes each), as tok.encode() gives them for the whole text, tokenized WINDOW
    characters at a time: consecutive windows share OVERLAP characters, and the second takes over at the first
    token boundary from which both give the same tokens to the end of the first's reliable part. With `need`,
    reading stops once that many ids are settled (the rest of the file is never read)."""
    ids = array("i", [tok.bos_id] if tok.add_bos and tok.bos_id is not None else [])
    blocks = _text_blocks(Path(path))
    buf, base, eof, pending, any_text = "", 0, False, None, False      # buf: the characters from `base` on
    while True:
        while len(buf) <= WINDOW and not eof:
            block = next(blocks, None)
            eof = block is None
            buf += block or ""
        text, last = buf[:WINDOW], eof and len(buf) <= WINDOW
        any_text = any_text or bool(text.strip())
        wids, spans = tok.encode_spans(text)
        toks = [(i, base + a, base + b) for i, (a, b) in zip(wids, spans)]
        if pending is not None:
            k, j = _takeover(pending, toks, base + OVERLAP // 4, base + OVERLAP - OVERLAP // 4, path)
            ids.extend(t[0] for t in pending[:k])
            toks = toks[j:]
        if last or (need is not None and len(ids) >= need):
            break
        pending = toks
        base += WINDOW - OVERLAP
        buf = buf[WINDOW - OVERLAP:]
    if last:
        if not any_text:
            raise ParameterError(f"--text {path}: the file holds no text")
        ids.extend(t[0] for t in toks)
        if tok.add_eos and tok.eos_id is not None:
            ids.append(tok.eos_id)
    return ids


def _takeover(prev, new, lo: int, hi: int, path) -> tuple[int, int]:
    """(k, j): prev[:k] + new[j:] is the text's tokenization, where prev and new are (id, start, end) tokens of
    two windows that share the characters from new's first start: k, j index the first token boundary q in
    [lo, hi) that starts a token in both, with both giving the same tokens from q up to hi."""
    at_prev = {t[1]: i for i, t in enumerate(prev) if lo <= t[1] < hi and (i == 0 or prev[i - 1][2] <= t[1])}
    for j, t in enumerate(new):
        if t[1] >= hi:
            break
        k = at_prev.get(t[1])
        if k is None or (j and new[j - 1][2] > t[1]):
            continue
        n = 0
        while k + n < len(prev) and prev[k + n][1] < hi and j + n < len(new) and prev[k + n] == new[j + n]:
            n += 1
        if n and (k + n == len(prev) or prev[k + n][1] >= hi) and (j + n == len(new) or new[j + n][1] >= hi):
            return k, j
    raise ParameterError(f"--text {path}: characters {lo}..{hi} hold no place where the text can be cut for "
                         f"tokenizing in pieces (a run of over {hi - lo} characters that is one token sequence)")


def memory_available() -> int:
    """Bytes this process may still take: the least of the kernel's MemAvailable, the room under its cgroup's
    memory.max (cgroup v2) and the room under its address-space limit (RLIMIT_AS)."""
    room = [mem_available()]
    try:
        rel = next(ln.split("::", 1)[1].strip() for ln in open("/proc/self/cgroup") if ln.startswith("0::"))
        d = Path("/sys/fs/cgroup") / rel.lstrip("/")
        top = (d / "memory.max").read_text().strip()
        if top != "max":
            room.append(int(top) - int((d / "memory.current").read_text()))
    except (OSError, StopIteration, ValueError):
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        room.append(soft - _vm_size())
    return max(0, min(room))


def _vm_size() -> int:
    try:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        return 0


def eval_memory(cfg, weights_bytes: int, ctx: int, n_chunks: int, sides: int = 2, text_tokens: int = 0) -> dict:
    """The bytes an evaluation needs at its peak, by part, for a model of config cfg whose dequantized weights
    are weights_bytes, at ctx tokens a chunk: every engine side counted as llorch-ref's float32 forward pass
    (llama.cpp's and the others' need less or about as much); sides: the sides that load weights (a dump: none);
    text_tokens: the ids read from the text. One chunk runs at a time, on one side at a time; the subject's
    logits wait while the reference runs."""
    f32, rows = 4, ctx - 1 - ctx // 2
    return {"weights": sides * weights_bytes,
            "attention": 4 * cfg.n_heads * ctx * ctx * f32,       # scores, scaled + masked, exp, probabilities
            "mask": 2 * ctx * ctx * f32,
            "kv_cache": 2 * cfg.n_layers * ctx * cfg.n_kv_heads * cfg.head_dim * f32,
            "activations": ctx * (8 * cfg.d_model + 4 * cfg.d_ff + 4 * cfg.n_heads * cfg.head_dim) * f32,
            "logits": 2 * rows * cfg.n_vocab * f32,
            "scoring": 8 * SCORE_BLOCK_BYTES,
            "text": WINDOW * 200 + 4 * text_tokens + n_chunks * ctx * 40,   # tokenizer window, ids, chunks
            "scores": n_chunks * rows * 128}                       # each scored token's figures, kept to the end


def check_memory(cfg, weights_bytes: int, ctx: int, n_chunks: int, sides: int = 2, processes: int = 1,
                 text_tokens: int = 0) -> int:
    """Refuses, before anything runs, a run whose eval_memory (times `processes` running at once here) passes
    MEMORY_SHARE of memory_available(); -> the bytes it needs."""
    parts = eval_memory(cfg, weights_bytes, ctx, n_chunks, sides, text_tokens)
    need = processes * sum(parts.values())
    limit = int(MEMORY_SHARE * memory_available())
    if need > limit:
        top = max(parts, key=parts.get)
        raise ParameterError(
            f"--ctx {ctx}: the run needs about {need / 1e9:.1f} GB ({top.replace('_', ' ')} "
            f"{processes * parts[top] / 1e9:.1f} GB{f', {processes} processes' if processes > 1 else ''}), over the "
            f"limit {limit / 1e9:.1f} GB (half the memory this process may still take): lower --ctx"
            f"{' or --chunks' if parts['text'] + parts['scores'] > need / 4 else ''}")
    return need


def make_chunks(ids: list[int], ctx: int, n_chunks: int | None, bos_id: int | None) -> list[list[int]]:
    """The corpus ids -> chunks of ctx tokens (as many as fit, or the first n_chunks), each starting with BOS
    when the model adds one."""
    if ctx < 16:
        raise ParameterError(f"--ctx {ctx}: at least 16 tokens (half of each chunk is context, half is scored)")
    have = len(ids) // ctx
    if have < 1:
        raise ParameterError(f"the text has {len(ids)} tokens: fewer than one chunk of --ctx {ctx}")
    n = have if n_chunks is None else n_chunks
    if n < 1 or n > have:
        raise ParameterError(f"--chunks {n_chunks}: the text holds {have} chunks of {ctx} tokens")
    out = []
    for i in range(n):
        c = list(ids[i * ctx:(i + 1) * ctx])
        if bos_id is not None:
            c[0] = bos_id
        out.append(c)
    return out


def eval_chunk(index: int, tokens, subject, reference, clock: dict | None = None) -> ChunkScores:
    """One chunk's scores: each side's logits of the scored rows as it holds them (a source with device_logits,
    llorch-ref on cupy, keeps them on the GPU), scored where they are (harness/kld.score_chunk). Where one side
    is on the GPU and the other on the host, the host's [n, V] float32 go to the device: one copy of 4 bytes
    a logit, where scoring on the host would read and write several float64 [n, V] arrays. clock: a dict that
    gets the seconds of each part added to "subject_s", "reference_s" and "scoring_s" (a GPU side's work
    waited for before its time is read)."""
    first = len(tokens) // 2
    t0 = time.perf_counter()
    q = _settled(chunk_logits(subject, tokens, first), clock)
    t1 = time.perf_counter()
    p = _settled(chunk_logits(reference, tokens, first), clock)
    t2 = time.perf_counter()
    xq, xp = array_module(q), array_module(p)
    if xq is not xp:
        dev = xq if xq is not np else xp
        q, p = dev.asarray(q), dev.asarray(p)
    s = score_chunk(index, q, p, tokens[first + 1:])
    if clock is not None:
        for k, dt in (("subject_s", t1 - t0), ("reference_s", t2 - t1), ("scoring_s", time.perf_counter() - t2)):
            clock[k] = clock.get(k, 0.0) + dt
    return s


def _settled(a, clock):
    """a, its device's queued work finished first where a clock reads the time (CuPy arrays only)."""
    if clock is not None and array_module(a) is not np:
        array_module(a).cuda.get_current_stream().synchronize()
    return a


def chunk_logits(source, tokens, first: int):
    """source's logits of rows first..len(tokens)-2: on the device where it offers them there."""
    return (getattr(source, "device_logits", None) or source.logits)(tokens, first)


def build_sources(subject_spec, reference_spec, ctx: int):
    """(subject, reference) sources for chunks of ctx tokens; equal specs share one built source (a forward
    starts from a cache of its own, so both sides still run every chunk)."""
    subject = subject_spec.build(ctx)
    return subject, (subject if reference_spec == subject_spec else reference_spec.build(ctx))


@dataclass
class EvalResult:
    subject: str
    reference: str
    text: str
    ctx: int
    scores: list                                  # ChunkScores, by chunk index
    timings: dict = field(default_factory=dict)
    where: str = "in-process"

    def to_json(self) -> dict:
        s = summary(self.scores)
        return {"subject": self.subject, "reference": self.reference, "text": self.text, "ctx": self.ctx,
                "chunks": len(self.scores), "where": self.where, "timings": self.timings,
                "statistics": {k: (list(v) if isinstance(v, tuple) else v) for k, v in s.items()},
                "kld_by_position": kld_by_position(self.scores),
                "kld_values": [float(x) for c in self.scores for x in c.kld],
                "per_chunk": [{"index": c.index, "mean_kld": float(c.kld.mean()),
                               "ppl": float(math.exp(c.nll.mean())),
                               "ppl_base": float(math.exp(c.nll_base.mean())),
                               "same_top": float(c.same_top.mean())} for c in self.scores]}


def run_eval(subject_spec, reference_spec, chunks, text_name: str, progress=None) -> EvalResult:
    """Every chunk through both sources in this process (each built once; one source for both where the two
    specs are equal: the same engine on the same file and settings, loaded once). progress(n_tokens) per chunk."""
    ctx = len(chunks[0])
    t0 = time.perf_counter()
    subject, reference = build_sources(subject_spec, reference_spec, ctx)
    t_load = time.perf_counter() - t0
    scores, clock = [], {}
    for i, c in enumerate(chunks):
        scores.append(eval_chunk(i, c, subject, reference, clock))
        if progress:
            progress(len(c))
    dt = time.perf_counter() - t0 - t_load
    return EvalResult(subject_spec.label, reference_spec.label, text_name, ctx, scores,
                      {"load_s": t_load, "eval_s": dt, "tokens_per_s": len(chunks) * ctx / dt if dt > 0 else None,
                       **clock})
