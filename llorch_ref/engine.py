"""Engine: a loaded model (config, weights, tokenizer) plus a backend, with logits() and generate()."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import ParameterError, PromptError, TokenizerError
from .generate import sampling
from .model import forward as forward_mod
from .model import layers
from .model.cache import Cache


@dataclass
class GenerationResult:
    """Filled in by Engine.generate as it runs; read it after the generator is exhausted."""
    prompt_ids: list = field(default_factory=list)
    token_ids: list = field(default_factory=list)
    stop_reason: str | None = None      # "eos" | "max_tokens" | "context_full"
    prefill_s: float = 0.0
    decode_s: float = 0.0


class Engine:
    def __init__(self, config, weights, tokenizer, *, path=None, metadata=None, tensor_types=None,
                 backend="numpy", n_ctx=None, numerics="exact", kv_dtype="f32"):
        from .backends import get_backend

        self.config = config
        self.tokenizer = tokenizer
        self.path = Path(path) if path else None
        self.metadata = metadata or {}
        self.tensor_types = tensor_types or {}
        self.backend = get_backend(backend)
        self.xp = self.backend.xp
        self.weights = weights.map(self.backend.asarray)
        if n_ctx is not None and not (0 < int(n_ctx) <= config.context_length):
            raise ParameterError(f"n_ctx={n_ctx} must be in 1..{config.context_length} (the model's context)")
        self.n_ctx = int(n_ctx or config.context_length)
        if kv_dtype not in ("f32", "f16"):
            raise ParameterError(f"kv_dtype {kv_dtype!r} must be 'f32' or 'f16'")
        self.numerics, self.kv_dtype = numerics, kv_dtype
        if numerics == "ggml":
            from .numerics.ggml_cpu import make_ops
            self.ops = make_ops(kv_dtype)
        else:
            self.ops = layers

    # -- sequences -----------------------------------------------------------------------------------
    def new_cache(self) -> Cache:
        return Cache(self.xp, self.config, self.n_ctx, kv_dtype={"f32": "float32", "f16": "float16"}[self.kv_dtype],
                     ops=self.ops)

    def forward(self, token_ids, cache, rows=None, record=None):
        """Append token_ids to the sequence in `cache` -> logits [R, V] for `rows` (None: all)."""
        kw = {"record": record} if record is not None else {}
        return forward_mod.forward(self.xp, self.config, self.weights, token_ids, cache, rows=rows, ops=self.ops,
                                   **kw)

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

    def encode_prompt(self, prompt: str, chat: bool = False, system: str | None = None) -> list[int]:
        if self.tokenizer is None:
            raise TokenizerError("this model has no vocabulary (tokenizer.ggml.model = no_vocab); "
                                 "pass token ids instead of text")
        if not isinstance(prompt, str) or prompt == "":
            raise PromptError("empty prompt: give some text to continue")
        if chat:
            msgs = ([{"role": "system", "content": system}] if system else []) + \
                   [{"role": "user", "content": prompt}]
            return self.tokenizer.encode(self.tokenizer.apply_chat_template(msgs))
        return self.tokenizer.encode(prompt)

    def generate_ids(self, prompt_ids, max_tokens=128, temperature=0.0, ignore_eos=False, result=None):
        """Yields generated token ids: prefill, then one token at a time through the cache (greedy)."""
        if temperature != 0.0:
            raise ParameterError("temperature must be 0 (greedy): sampling is not implemented yet")
        if not isinstance(max_tokens, int) or max_tokens < 0:
            raise ParameterError(f"max_tokens={max_tokens!r} must be an integer >= 0")
        ids = self._check_ids(prompt_ids)
        res = result if result is not None else GenerationResult()
        res.prompt_ids = ids
        cache = self.new_cache()                     # per-request state: a fresh cache every time
        t0 = time.perf_counter()
        logits = self.forward(ids, cache, rows=[len(ids) - 1])
        res.prefill_s = time.perf_counter() - t0
        eog = self.tokenizer.eog_ids if self.tokenizer is not None else frozenset()
        t0 = time.perf_counter()
        for _ in range(max_tokens):
            nxt = sampling.greedy(self.backend.to_numpy(logits[-1]))
            if nxt in eog and not ignore_eos:
                res.stop_reason = "eos"
                break
            res.token_ids.append(nxt)
            yield nxt
            if cache.pos >= self.n_ctx:
                res.stop_reason = "context_full"
                break
            logits = self.forward([nxt], cache, rows=[0])
        else:
            res.stop_reason = "max_tokens"
        res.decode_s = time.perf_counter() - t0

    def generate(self, prompt: str, max_tokens=128, temperature=0.0, chat=False, ignore_eos=False,
                 result=None):
        """Yields text pieces as they are decoded (a UTF-8 character split across tokens comes out whole)."""
        ids = self.encode_prompt(prompt, chat=chat)
        dec = self.tokenizer.stream_decoder()
        for t in self.generate_ids(ids, max_tokens=max_tokens, temperature=temperature,
                                   ignore_eos=ignore_eos, result=result):
            piece = dec.push(t)
            if piece:
                yield piece
        tail = dec.flush()
        if tail:
            yield tail
