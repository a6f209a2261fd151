"""Engine: a loaded model (config, weights, tokenizer) plus a backend, with logits() and generate()."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .backends import Backend, get_backend
from .dtypes import KV_DTYPES, dtype_name
from .errors import ParameterError, PromptError, TokenizerError
from .generate.sampling import Sampler, SamplingParams
from .generate.stopping import StopMatcher
from .model import forward as forward_mod
from .model import layers
from .model.cache import Cache
from .numerics.ggml_cpu import SIMD_LANES, make_ops


@dataclass
class GenerationResult:
    """Filled in by Engine.generate as it runs; read it after the generator is exhausted."""
    prompt_ids: list = field(default_factory=list)
    token_ids: list = field(default_factory=list)
    text: str = ""
    stop_reason: str | None = None      # "eos" | "max_tokens" | "stop_sequence" | "context_full" | "cancelled"
    stop_sequence: str | None = None    # the stop string matched (its text is not emitted)
    seed: int | None = None             # the seed actually used (drawn when none was given)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prompt_logits: object = None        # the prefill's last-row logits [1, V] (the backend's array)


DEFAULT_CTX = 8192


class _Cancelled(Exception):
    """Raised between two layers of a prefill whose cancel Event was set."""


def _cancel_between_layers(cancel):
    """-> a recorder that stops a long prefill at the next layer boundary once `cancel` is set (None: none)."""
    if cancel is None:
        return None

    def record(name, layer, arr):
        if name == "l_out" and cancel.is_set():
            raise _Cancelled
    record.tensors = False                 # it watches the layer boundaries only
    return record


class Engine:
    def __init__(self, config, weights, tokenizer, *, path=None, metadata=None, tensor_types=None,
                 backend=None, n_ctx=None, numerics="exact", kv_dtype="float32", dtype="float32", threads=None,
                 qtensors=None, ggml_simd=None):

        self.config = config
        self.qk_rows = config.rope_style      # the row order of Wq/Wk as loaded: what a dump of Q/K declares
        self.tokenizer = tokenizer
        self.path = Path(path) if path else None
        self.metadata = metadata or {}
        self.tensor_types = tensor_types or {}
        self.backend = get_backend(backend, dtype=dtype, threads=threads)
        if numerics == "ggml" and self.backend.name not in ("numpy", "numba"):
            raise ParameterError("numerics='ggml' runs on the numpy and numba backends only")
        self.xp = self.backend.xp
        self.weights = self.backend.prepare_weights(weights, qtensors, numerics)
        if n_ctx is not None and not (0 < int(n_ctx) <= config.context_length):
            raise ParameterError(f"n_ctx={n_ctx} must be in 1..{config.context_length} (the model's context)")
        # default: the model's context up to DEFAULT_CTX, since the K/V cache is preallocated (a 128k-token
        # Llama 3.1 context would take 34 GB of float32 K/V); --ctx asks for more
        self.n_ctx = int(n_ctx or min(config.context_length, DEFAULT_CTX))
        kv_dtype = dtype_name(kv_dtype, KV_DTYPES, "kv_dtype")
        self.numerics, self.kv_dtype = numerics, kv_dtype
        self.ggml_simd = ggml_simd if numerics == "ggml" else None     # the llama.cpp build reproduced: avx2, avx512
        if numerics == "ggml":
            self.ops = self.backend.make_ggml_ops(make_ops(kv_dtype, SIMD_LANES[ggml_simd or "avx2"]))
        else:
            self.ops = self.backend.make_ops(layers)
        self._spare, self._spare_lock = [], threading.Lock()     # (cache, decoder) a finished request left

    def weights_info(self) -> dict:
        """Lazy or eager, storage dtype, dequantized size and (lazy) the cache's budget, use, hits, misses."""
        return self.weights.info()

    # -- sequences -----------------------------------------------------------------------------------
    def new_cache(self) -> Cache:
        cls = self.backend.cache_class(Cache)
        return cls(self.xp, self.config, self.n_ctx, kv_dtype=self.kv_dtype,
                   ops=self.ops)

    def _request_state(self):
        """(cache, decoder or None) for one generation request: the pair an earlier request finished with, the
        cache reset (its decoder kept: on the GPU, its captured CUDA graph over this cache's buffers), else a
        new cache. One request holds a pair at a time; concurrent requests get their own."""
        with self._spare_lock:
            got = self._spare.pop() if self._spare else None
        if got is None:
            return self.new_cache(), None
        got[0].reset()
        return got

    def _release_state(self, cache, decoder):
        with self._spare_lock:
            if not self._spare:                              # one spare: its cache's pages stay committed
                self._spare.append((cache, decoder))

    def forward(self, token_ids, cache, rows=None, record=None, logits_sink=None):
        """Append token_ids to the sequence in `cache` -> logits [R, V] for `rows` (None: all). A recorder that
        looks at tensors gets the reference's forward (model.forward: every checkpoint tensor formed); without
        one, or with one of the layer boundaries only (`tensors = False`), the backend's own forward, which may
        fuse operations whose tensors nobody sees. logits_sink(first row, logits [n, V]): the logits handed
        over a span of rows at a time (model.forward's; a backend with its own forward hands its [R, V] over in
        spans), the last row's [1, V] returned."""
        self.backend.before_forward(len(token_ids))
        if record is not None and getattr(record, "tensors", True):
            return forward_mod.forward(self.xp, self.config, self.weights, token_ids, cache, rows=rows,
                                       record=record, ops=self.ops, logits_sink=logits_sink)
        if logits_sink is not None and type(self.backend).forward is Backend.forward:    # the reference's own
            return forward_mod.forward(self.xp, self.config, self.weights, token_ids, cache, rows=rows,
                                       ops=self.ops, logits_sink=logits_sink,
                                       **({"record": record} if record is not None else {}))
        out = self.backend.forward(self.xp, self.config, self.weights, token_ids, cache, self.ops, rows=rows,
                                   boundary=record)
        if logits_sink is None:
            return out
        for a in range(0, out.shape[0], forward_mod.LOGIT_SPAN):
            logits_sink(a, out[a:a + forward_mod.LOGIT_SPAN])
        return out[-1:]

    def _check_ids(self, token_ids):
        ids = [int(t) for t in token_ids]
        if not ids:
            raise PromptError("empty prompt: at least one token is needed")
        bad = [t for t in ids if not 0 <= t < self.config.n_vocab]
        if bad:
            raise PromptError(f"token id {bad[0]} is outside the vocabulary (0..{self.config.n_vocab - 1})")
        if len(ids) > self.n_ctx:
            raise PromptError(f"prompt has {len(ids)} tokens but the context holds {self.n_ctx}")
        return ids

    def logits(self, token_ids, record=None) -> np.ndarray:
        """token_ids: [T] -> float32 logits [T, V] for every position of a fresh sequence."""
        ids = self._check_ids(token_ids)
        return self.backend.to_numpy(self.forward(ids, self.new_cache(), record=record))

    def encode_prompt(self, prompt=None, chat: bool = False, system: str | None = None, messages=None) -> list[int]:
        """Text (optionally wrapped in the chat template) or chat messages -> token ids."""
        if self.tokenizer is None:
            raise TokenizerError("this model has no vocabulary (tokenizer.ggml.model = no_vocab); "
                                 "pass token ids instead of text")
        if messages is not None:
            if not messages or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                       and isinstance(m.get("content"), str) for m in messages):
                raise PromptError("messages must be a non-empty list of {role, content} strings")
            return self.tokenizer.encode(self.tokenizer.apply_chat_template(list(messages)))
        if not isinstance(prompt, str) or prompt == "":
            raise PromptError("empty prompt: give some text to continue")
        if not prompt.strip():
            raise PromptError(f"the prompt is only whitespace ({len(prompt)} characters): give some text to continue")
        if chat:
            msgs = ([{"role": "system", "content": system}] if system else []) + \
                   [{"role": "user", "content": prompt}]
            return self.tokenizer.encode(self.tokenizer.apply_chat_template(msgs))
        return self.tokenizer.encode(prompt)

    def generate_ids(self, prompt_ids, max_tokens=128, ignore_eos=False, result=None, cancel=None, **sampling):
        """Yields generated token ids: prefill, then one token at a time through a fresh cache.

        sampling: SamplingParams fields (temperature 0 = greedy, the default); unknown names are an error.
        cancel: a threading.Event; when set, generation stops with stop_reason "cancelled"."""

        params = SamplingParams.from_kwargs(**sampling)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise ParameterError(f"max_tokens={max_tokens!r} must be an integer >= 0")
        ids = self._check_ids(prompt_ids)
        res = result if result is not None else GenerationResult()
        res.prompt_ids = ids
        sampler = Sampler(params, history=ids)          # per-request state: its own RNG and history
        res.seed = sampler.seed
        cache, decode = self._request_state()           # a fresh cache, or a finished request's one reset
        t0 = time.perf_counter()
        try:
            logits = self.forward(ids, cache, rows=[len(ids) - 1], record=_cancel_between_layers(cancel))
        except _Cancelled:
            res.prefill_s, res.stop_reason = time.perf_counter() - t0, "cancelled"
            return
        decode = decode or self.backend.make_decoder(self, cache)
        res.prefill_s, res.prompt_logits = time.perf_counter() - t0, logits
        t0 = time.perf_counter()
        yield from self._decode_tokens(res, logits, cache, decode, sampler, max_tokens, ignore_eos, cancel)
        res.decode_s = time.perf_counter() - t0
        self._release_state(cache, decode)              # only after a whole request (not on an error or a close)

    def _decode_tokens(self, res, logits, cache, decode, sampler, max_tokens, ignore_eos, cancel):
        """generate_ids' loop: yields up to max_tokens tokens after the prompt's logits, setting res.stop_reason.
        Plain greedy on a decoder that chains its steps on the device (cupy's `chained`): the tokens from it, one
        step launched ahead of the one the host reads (the same tokens as one step at a time)."""
        eog = self.tokenizer.eog_ids if self.tokenizer is not None else frozenset()
        chained, chain = getattr(decode, "chained", None) if sampler.plain_greedy else None, None
        res.stop_reason = "max_tokens"
        try:
            for _ in range(max_tokens):
                if cancel is not None and cancel.is_set():
                    res.stop_reason = "cancelled"
                    return
                nxt = sampler.next(logits[-1], self.backend) if chain is None else sampler.took(next(chain))
                if nxt in eog and not ignore_eos:
                    res.stop_reason = "eos"
                    return
                res.token_ids.append(nxt)
                yield nxt
                if res.stop_reason != "max_tokens":        # set by the consumer (a stop string matched)
                    return
                if cache.pos >= self.n_ctx:
                    res.stop_reason = "context_full"
                    return
                if chained is not None:
                    chain = chain or chained(nxt)
                else:
                    logits = decode(nxt)
        finally:
            if chain is not None:
                chain.close()                               # the step launched ahead undone

    def generate(self, prompt=None, max_tokens=128, chat=False, ignore_eos=False, result=None, stop=None,
                 messages=None, system=None, cancel=None, **sampling):
        """Yields text pieces as they are decoded (a UTF-8 character split across tokens comes out whole).

        stop: strings that end generation; they may span tokens, and their text is not emitted."""

        if stop is not None and (isinstance(stop, str) or not all(isinstance(x, str) for x in stop)):
            raise ParameterError("stop must be a list of strings")
        ids = self.encode_prompt(prompt, chat=chat, system=system, messages=messages)
        res = result if result is not None else GenerationResult()
        dec = self.tokenizer.stream_decoder()
        stops = StopMatcher(stop)
        for t in self.generate_ids(ids, max_tokens=max_tokens, ignore_eos=ignore_eos, result=res,
                                   cancel=cancel, **sampling):
            piece = stops.push(dec.push(t))
            if stops.matched is not None:
                res.stop_reason, res.stop_sequence = "stop_sequence", stops.matched
            if piece:
                res.text += piece
                yield piece
        if stops.matched is None:
            tail = stops.push(dec.flush())
            if stops.matched is not None:
                res.stop_reason, res.stop_sequence = "stop_sequence", stops.matched
            tail += stops.flush()
            if tail:
                res.text += tail
                yield tail
