"""Compiling constraints off the engine thread: xgrammar's compiler, a cache keyed by the constraint, two lanes
of workers, and the timeouts a request waits under.

A constraint compiles once per (kind, spec, options); a later request with the same key joins the compile (or
its result). A failed compile stays cached too: it would fail the same way again. A compile that runs past
its timeout cannot be interrupted: it stays cached until it ends, so a retry joins it.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from inflight.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from collections.abc import Callable

    import xgrammar
    from tokenizers import Tokenizer

    from inflight.config import EngineConfig

# A grammar that takes longer than this to compile fails its request rather than wait forever. Only the compile
# counts: time queued behind other requests' compiles has its own, longer bound.
COMPILE_TIMEOUT_S = 60.0
COMPILE_QUEUE_TIMEOUT_S = 300.0
CACHE_ENTRIES = 256
# A constraint whose text is at most this many bytes compiles in a lane of its own (one worker), so that
# a few big schemas filling the main pool never hold up the small ones most requests bring.
SMALL_SPEC_BYTES = 4 << 10


class GrammarCompileError(Exception):
    """The constraint could not be compiled; the message says which field and why."""


@dataclass(frozen=True)
class CompiledGrammar:
    grammar: xgrammar.CompiledGrammar
    allowed_words: torch.Tensor | None  # a bitmask row ANDed into the grammar's at every step, or None


@dataclass(eq=False)
class CompileJob:
    """One compile in the pool, shared by every request of its constraint."""

    started: float | None = None  # when a pool thread began it; None while queued
    future: cf.Future = field(init=False)


@dataclass(eq=False)
class GrammarCompile:
    """One request's wait for its constraint's compile."""

    params: StructuredOutputsParams
    job: CompileJob
    submitted: float = field(default_factory=time.monotonic)
    _why_cancelled: str | None = None

    @property
    def future(self) -> cf.Future:
        return self.job.future

    @property
    def is_ready(self) -> bool:
        f = self.job.future
        return f.done() and not f.cancelled() and f.exception() is None

    def result(self) -> CompiledGrammar:
        return self.job.future.result()

    def error(self) -> str | None:
        """Why this request cannot run, once that is known; None while compiling or when ready."""
        future, kind = self.job.future, self.params.kind
        timeout = f"structured_outputs.{kind}: grammar compilation took over {COMPILE_TIMEOUT_S:.0f}s"
        if future.cancelled():
            return self._why_cancelled or timeout
        if future.done():
            exc = future.exception()
            return None if exc is None else str(exc)
        now = time.monotonic()
        started = self.job.started
        if started is not None:
            # A request that joins a compile already running (an earlier request's) waits its own
            # COMPILE_TIMEOUT_S for it rather than starting a second compile of the same grammar.
            if now - max(started, self.submitted) > COMPILE_TIMEOUT_S:
                future.cancel()  # no effect on a running compile: it finishes unused
                return timeout
        elif now - self.submitted > COMPILE_QUEUE_TIMEOUT_S:
            future.cancel()  # still queued: dropped
            self._why_cancelled = (
                f"structured_outputs.{kind}: waited over {COMPILE_QUEUE_TIMEOUT_S:.0f}s for a grammar compiler "
                "(busy with other requests' grammars); retry later"
            )
            return self._why_cancelled
        return None


class CompilePool:
    """The compiler (built lazily, on the first constraint), the compile cache and the lanes of workers."""

    def __init__(
        self,
        tokenizer: Callable[[], Tokenizer] | None,
        vocab_size: int,
        stop_token_ids: list[int],
        config: EngineConfig,
        max_workers: int,
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._max_workers = max_workers
        self.config = config
        self._pool: cf.ThreadPoolExecutor | None = None
        self._small_pool: cf.ThreadPoolExecutor | None = None  # the lane of small constraints
        self._cache_bytes: dict[tuple, int] = {}  # compiled grammars' sizes, once known
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._json_allowed: dict[bool, torch.Tensor] = {}
        self._compiler_lock = threading.Lock()
        self._cache: OrderedDict[tuple, CompileJob] = OrderedDict()

    def request(self, params: StructuredOutputsParams) -> GrammarCompile:
        """Start (or join) the compile of `params`; called on the engine thread, returns at once."""
        key = params.key
        job = self._cache.get(key)
        if job is not None:
            self._cache.move_to_end(key)
        else:
            job = CompileJob()
            job.future = self._lane(key).submit(self._compile, params, job)
            self._cache[key] = job
            self._evict()
        return GrammarCompile(params, job)

    def forget(self, compile_: GrammarCompile) -> None:
        """Drop a compile cancelled before it began from the cache: no verdict on the grammar, a later request
        compiles it afresh."""
        key = compile_.params.key
        if self._cache.get(key) is compile_.job:
            del self._cache[key]

    def _lane(self, key: tuple) -> cf.ThreadPoolExecutor:
        """The pool a constraint compiles in: small ones (most requests) have a worker of their own."""
        if len(key[1]) <= SMALL_SPEC_BYTES:
            if self._small_pool is None:
                self._small_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="inflight-grammar-small")
            return self._small_pool
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(self._max_workers, thread_name_prefix="inflight-grammar")
        return self._pool

    @property
    def cache_bytes(self) -> int:
        """Bytes held by the compiled grammars in the cache (xgrammar's estimate), as of the last eviction."""
        return sum(self._cache_bytes.values())

    def _evict(self) -> None:
        """Drop least recently used compiled grammars past max_grammar_cache_bytes (or CACHE_ENTRIES). A
        compile still queued or running stays: its requests wait for it, and a retry must join it."""
        for key, job in self._cache.items():
            if key not in self._cache_bytes and job.future.done():
                self._cache_bytes[key] = _compiled_bytes(job.future)
        limit = self.config.max_grammar_cache_bytes
        total = sum(self._cache_bytes.values())
        for key in list(self._cache):
            if total <= limit and len(self._cache) <= CACHE_ENTRIES:
                break
            if not self._cache[key].future.done():
                continue
            del self._cache[key]
            total -= self._cache_bytes.pop(key, 0)

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                compiler, info = _make_compiler(
                    self._tokenizer(), self.vocab_size, self._stop_token_ids, self.config.max_grammar_cache_bytes
                )
                self._json_allowed = _json_allowed_words(info.decoded_vocab, self.vocab_size)
                self._compiler = compiler
            return self._compiler

    def _compile(self, params: StructuredOutputsParams, job: CompileJob) -> CompiledGrammar:
        job.started = time.monotonic()
        compiler = self._get_compiler()
        grammar = self.compile_grammar(compiler, params)
        if params.kind in ("json", "json_object"):
            return CompiledGrammar(grammar, self._json_allowed[params.disable_any_whitespace])
        return CompiledGrammar(grammar, None)

    @staticmethod
    def compile_grammar(
        compiler: xgrammar.GrammarCompiler, params: StructuredOutputsParams
    ) -> xgrammar.CompiledGrammar:
        kind = params.kind
        try:
            if kind in ("json", "json_object"):
                # json_object: any JSON object (OpenAI's JSON mode), not any JSON value.
                schema = params.json if kind == "json" else {"type": "object"}
                whitespace = not params.disable_any_whitespace
                return compiler.compile_json_schema(json.dumps(schema), any_whitespace=whitespace)
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "structural_tag":
                return compiler.compile_structural_tag(params.key[1])
            if kind == "choice":
                # EBNF string literals take JSON's escapes.
                return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in params.choice))
            return compiler.compile_grammar(params.grammar)
        except Exception as e:  # xgrammar raises RuntimeError with the parser's position and reason
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise GrammarCompileError(f"structured_outputs.{kind} cannot be compiled: {_strip_location(reason)}") from e

    def close(self) -> None:
        """Drop queued compiles and let the pool's threads end (a running compile finishes first: it
        cannot be interrupted). Nothing compiles after this."""
        for pool in (self._pool, self._small_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)


def _compiled_bytes(fut: cf.Future) -> int:
    """A finished compile's memory (xgrammar's estimate of the compiled grammar; a failure holds ~nothing)."""
    if fut.cancelled() or fut.exception() is not None:
        return 0
    return int(fut.result().grammar.memory_size_bytes)


def _strip_location(reason: str) -> str:
    # "[03:25:07] /project/cpp/regex_converter.cc:83: Regex parsing error ..." -> the reason alone
    if reason.startswith("[") and ".cc:" in reason:
        return reason.split(": ", 1)[-1]
    return reason


def _make_compiler(
    tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int], cache_bytes: int
) -> tuple[xgrammar.GrammarCompiler, xgrammar.TokenizerInfo]:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    # xgrammar reads the vocabulary type (byte-level, byte-fallback, raw) off a HF fast tokenizer.
    detected = xgr.TokenizerInfo.from_huggingface(
        PreTrainedTokenizerFast(tokenizer_object=tokenizer), vocab_size=vocab_size, stop_token_ids=stop_token_ids
    )
    # Special tokens (<s>, <unk>, ...) are skipped by the detokenizer, so the grammar must never see them
    # as text: an empty string marks a token as special for xgrammar. Ids past the tokenizer (padding
    # rows of the model's lm_head) are empty too, hence never allowed.
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    encoded = [""] * vocab_size
    for text, i in tokenizer.get_vocab(with_added_tokens=True).items():
        if i < vocab_size and i not in special:
            encoded[i] = text
    info = xgr.TokenizerInfo(
        encoded,
        detected.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=stop_token_ids,
        add_prefix_space=detected.add_prefix_space,
    )
    # Bounded: by default xgrammar caches every grammar it ever compiled, so distinct user schemas would grow
    # memory without limit. Our constraint-keyed cache above it holds the same objects, bounded by the same bytes.
    compiler = xgr.GrammarCompiler(info, max_threads=max(1, min(8, os.cpu_count() or 1)), cache_limit_bytes=cache_bytes)
    return compiler, info


def _json_allowed_words(decoded_vocab: list[bytes], vocab_size: int) -> dict[bool, torch.Tensor]:
    """Bitmask rows of the tokens JSON output may use, keyed by disable_any_whitespace.

    xgrammar 0.2.8 lowers a string with minLength/maxLength to a class that excludes only quote,
    backslash, CR and LF, so it admits raw control characters that RFC 8259 forbids in strings
    (mlc-ai/xgrammar#800): a random-weight model emits them and `json.loads` rejects the output. JSON never
    needs a raw byte below 0x20 other than whitespace between tokens, so tokens holding one are masked for JSON
    constraints; with disable_any_whitespace there is no free whitespace, so newline/CR go too. Tab is
    masked in both modes: the string class admits it (a raw tab inside a string is invalid JSON), and
    spaces and newlines remain for whitespace between tokens.
    """
    ws = {10, 13}
    forbid = {False: [], True: []}
    for i, text in enumerate(decoded_vocab[:vocab_size]):
        controls = {b for b in text if b < 0x20}
        if controls:
            forbid[True].append(i)
            if controls - ws:
                forbid[False].append(i)
    words = -(-vocab_size // 32)
    out = {}
    for compact, ids in forbid.items():
        bits = torch.ones(words * 32, dtype=torch.bool)
        bits[ids] = False
        # Pack 32 bits per int32 word, bit j of word w = token 32 * w + j (xgrammar's layout).
        packed = (bits.view(words, 32).to(torch.int64) << torch.arange(32)).sum(1)
        out[compact] = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return out
