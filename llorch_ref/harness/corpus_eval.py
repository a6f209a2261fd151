"""A subject and a reference over a corpus, in chunks, as llama-perplexity --kl-divergence runs them: the text
tokenized once (BOS first), cut into chunks of ctx tokens, each chunk's first token replaced by BOS, the second
half of each chunk scored (positions ctx/2 .. ctx-2 predict the next token). In-process, or on Ray
(harness/ray_eval.py): the same chunks, the same scores, every chunk counted once.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from ..errors import ParameterError
from .kld import ChunkScores, kld_by_position, score_chunk, summary


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


def eval_chunk(index: int, tokens, subject, reference) -> ChunkScores:
    first = len(tokens) // 2
    return score_chunk(index, subject.logits(tokens, first), reference.logits(tokens, first), tokens[first + 1:])


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
    """Every chunk through both sources in this process (each built once). progress(n_tokens) per chunk."""
    ctx = len(chunks[0])
    t0 = time.perf_counter()
    subject, reference = subject_spec.build(ctx), reference_spec.build(ctx)
    t_load = time.perf_counter() - t0
    scores = []
    for i, c in enumerate(chunks):
        scores.append(eval_chunk(i, c, subject, reference))
        if progress:
            progress(len(c))
    dt = time.perf_counter() - t0 - t_load
    return EvalResult(subject_spec.label, reference_spec.label, text_name, ctx, scores,
                      {"load_s": t_load, "eval_s": dt, "tokens_per_s": len(chunks) * ctx / dt if dt > 0 else None})
