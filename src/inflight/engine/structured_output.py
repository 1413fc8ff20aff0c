"""Structured outputs: compile a request's constraint off the engine thread, own its grammar matcher,
and build the step's token bitmask.

The grammar engine is xgrammar (vLLM's and SGLang's default). A constraint compiles once per
(kind, spec, options) in a small thread pool; a sequence waits in the scheduler's waiting queue until
its grammar is ready (`is_ready`) and fails with the compiler's message if it cannot compile. The
sampler gets one int32 bitmask for the rows that carry a matcher; each matcher then accepts the
sampled token. Preemption recomputes KV but keeps the output tokens, so a matcher stays valid across
it; abort and finish drop it with the sequence.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from inflight.sampling_params import InvalidRequestError, StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar
    from tokenizers import Tokenizer

    from inflight.config import EngineConfig
    from inflight.engine.sequence import Sequence

log = logging.getLogger("inflight.engine.structured_output")

# A grammar that takes longer than this to compile fails its request rather than wait forever (the
# compile itself cannot be interrupted; its result still lands in the cache). Only the compile counts:
# time queued behind other requests' compiles has its own, longer bound.
COMPILE_TIMEOUT_S = 60.0
COMPILE_QUEUE_TIMEOUT_S = 300.0
_CACHE_ENTRIES = 256
# A constraint whose text is at most this many bytes compiles in a lane of its own (one worker), so that
# a few big schemas filling the main pool never hold up the small ones most requests bring.
SMALL_SPEC_BYTES = 4 << 10


class GrammarCompileError(Exception):
    """The constraint could not be compiled; the message says which field and why."""


@dataclass(eq=False)
class StructuredRequest:
    """One sequence's constraint: the compile in flight, then its matcher."""

    params: StructuredOutputsParams
    future: cf.Future
    submitted: float = field(default_factory=time.monotonic)
    matcher: xgrammar.GrammarMatcher | None = None
    _why_cancelled: str | None = None
    # Time the engine thread spent in this request's matcher (bitmask fill + accept): in total, and for the
    # token of the current step (the fill starts a step's account). Bounded by max_grammar_*time_s.
    matcher_time_s: float = 0.0
    step_time_s: float = 0.0

    @property
    def is_ready(self) -> bool:
        f = self.future
        return self.matcher is not None or (f.done() and not f.cancelled() and f.exception() is None)

    @property
    def allowed_words(self) -> torch.Tensor | None:
        """A bitmask row ANDed into the grammar's at every step (see `_json_allowed_words`), or None."""
        return self.future.result().allowed_words

    def error(self) -> str | None:
        """Why this request cannot run, once that is known; None while compiling or when ready."""
        kind = self.params.kind
        timeout = f"structured_outputs.{kind}: grammar compilation took over {COMPILE_TIMEOUT_S:.0f}s"
        if self.future.cancelled():
            return self._why_cancelled or timeout
        if self.future.done():
            exc = self.future.exception()
            return None if exc is None else str(exc)
        now = time.monotonic()
        started = getattr(self.future, "started", None)  # [start time] once a pool thread runs the compile
        if started:
            # A request that joins a compile already running (an earlier request's, cached) waits its own
            # COMPILE_TIMEOUT_S for it rather than starting a second compile of the same grammar.
            if now - max(started[0], self.submitted) > COMPILE_TIMEOUT_S:
                self.future.cancel()  # no effect on a running compile: it finishes unused
                return timeout
        elif now - self.submitted > COMPILE_QUEUE_TIMEOUT_S:
            self.future.cancel()  # still queued: dropped
            self._why_cancelled = (
                f"structured_outputs.{kind}: waited over {COMPILE_QUEUE_TIMEOUT_S:.0f}s for a grammar compiler "
                "(busy with other requests' grammars); retry later"
            )
            return self._why_cancelled
        return None

    def get_matcher(self) -> xgrammar.GrammarMatcher:
        if self.matcher is None:
            import xgrammar as xgr

            self.matcher = xgr.GrammarMatcher(self.future.result().grammar)
        return self.matcher


@dataclass(frozen=True)
class _Compiled:
    grammar: xgrammar.CompiledGrammar
    allowed_words: torch.Tensor | None


class StructuredOutputManager:
    """Owns the compiler (built lazily, on the first constraint), the compile cache and the pool."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        stop_token_ids: list[int],
        max_workers: int = 2,
        config: EngineConfig | None = None,
    ):
        from inflight.config import EngineConfig

        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._max_workers = max_workers
        self.config = config if config is not None else EngineConfig(device="cpu")
        self._pool: cf.ThreadPoolExecutor | None = None
        self._small_pool: cf.ThreadPoolExecutor | None = None  # the lane of small constraints
        self._cache_bytes: dict[tuple, int] = {}  # compiled grammars' sizes, once known
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._json_allowed: dict[bool, torch.Tensor] = {}
        self._compiler_lock = threading.Lock()
        self._cache: OrderedDict[tuple, cf.Future] = OrderedDict()
        self._pending: list[Sequence] = []  # sequences whose grammar is not compiled yet
        self._bitmask: torch.Tensor | None = None
        self._batch_matcher = None  # xgrammar.BatchGrammarMatcher, made on the first batch of several rows

    # ---- compiling (the pool's threads) ------------------------------------------------------------

    def request(self, params: StructuredOutputsParams) -> StructuredRequest:
        """Start (or reuse) the compile of `params`; called on the engine thread, returns at once."""
        key = params.key
        fut = self._cache.get(key)  # a failed compile stays cached too: it would fail the same way again
        if fut is not None:
            self._cache.move_to_end(key)
        else:
            started: list[float] = []  # set by the pool thread when the compile begins
            fut = self._cache[key] = self._lane(key).submit(self._compile, params, started)
            fut.started = started  # type: ignore[attr-defined]
            self._evict()
        return StructuredRequest(params, fut)

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
        """Drop least recently used compiled grammars past max_grammar_cache_bytes (or _CACHE_ENTRIES). A
        compile still queued or running stays: its requests wait for it, and a retry must join it."""
        for key, fut in self._cache.items():
            if key not in self._cache_bytes and fut.done():
                self._cache_bytes[key] = _compiled_bytes(fut)
        limit = self.config.max_grammar_cache_bytes
        total = sum(self._cache_bytes.values())
        for key in list(self._cache):
            if total <= limit and len(self._cache) <= _CACHE_ENTRIES:
                break
            if not self._cache[key].done():
                continue
            del self._cache[key]
            total -= self._cache_bytes.pop(key, 0)

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                compiler, info = _make_compiler(
                    self._tokenizer, self.vocab_size, self._stop_token_ids, self.config.max_grammar_cache_bytes
                )
                self._json_allowed = _json_allowed_words(info.decoded_vocab, self.vocab_size)
                self._compiler = compiler
            return self._compiler

    def _compile(self, params: StructuredOutputsParams, started: list[float]) -> Any:
        started.append(time.monotonic())
        compiler = self._get_compiler()
        kind = params.kind
        if kind in ("json", "json_object"):
            return _Compiled(self._compile_grammar(compiler, params), self._json_allowed[params.disable_any_whitespace])
        return _Compiled(self._compile_grammar(compiler, params), None)

    @staticmethod
    def _compile_grammar(compiler: xgrammar.GrammarCompiler, params: StructuredOutputsParams) -> Any:
        kind = params.kind
        try:
            if kind in ("json", "json_object"):
                # json_object: any JSON object (OpenAI's JSON mode), not any JSON value.
                schema = params.json if kind == "json" else {"type": "object"}
                whitespace = not params.disable_any_whitespace
                return compiler.compile_json_schema(json.dumps(schema), any_whitespace=whitespace)
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                # EBNF string literals take JSON's escapes.
                return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in params.choice))
            return compiler.compile_grammar(params.grammar)
        except Exception as e:  # xgrammar raises RuntimeError with the parser's position and reason
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise GrammarCompileError(f"structured_outputs.{kind} cannot be compiled: {_strip_location(reason)}") from e

    # ---- the engine thread -------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Attach the compile of the sequence's constraint; it is admitted once `is_ready`."""
        seq.structured = self.request(seq.sampling_params.structured_outputs)
        if not seq.structured.is_ready:  # compiling, or failed (reported by the next take_failed)
            self._pending.append(seq)

    def take_failed(self) -> list[tuple[Sequence, str]]:
        """Pending sequences whose compile failed or timed out; the ready ones leave the pending list."""
        if not self._pending:
            return []
        failed, still = [], []
        for seq in self._pending:
            if seq.is_finished:
                continue
            err = seq.structured.error()
            if err is not None:
                failed.append((seq, err))
                if seq.structured.future.cancelled():
                    # Dropped before it began (queued too long): no verdict on the grammar, a later request
                    # compiles it afresh. A compile that runs past its timeout stays cached until it ends (it
                    # cannot be stopped): a retry joins it instead of starting a second one.
                    key = seq.structured.params.key
                    if self._cache.get(key) is seq.structured.future:
                        del self._cache[key]
            elif not seq.structured.future.done():
                still.append(seq)
        self._pending = still
        return failed

    def wait_for_compile(self, timeout_s: float) -> None:
        """Nothing else to run: block briefly for a compile instead of spinning the engine loop."""
        futures = [s.structured.future for s in self._pending if not s.is_finished]
        if futures:
            cf.wait(futures, timeout=timeout_s, return_when=cf.FIRST_COMPLETED)

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def grammar_bitmask(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(bitmask [len(seqs), ceil(V/32)] int32, constrained rows [R]) for the step's sampling rows, or
        None when no row is constrained. Only the constrained rows of the bitmask are filled."""
        rows = [i for i, s in enumerate(seqs) if s.structured is not None]
        if not rows:
            return None
        words = -(-self.vocab_size // 32)
        if self._bitmask is None or self._bitmask.shape[0] < len(seqs):
            self._bitmask = torch.empty((2 * len(seqs), words), dtype=torch.int32)
        bitmask = self._bitmask[: len(seqs)]
        matchers = [seqs[i].structured.get_matcher() for i in rows]
        t0 = time.perf_counter()
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, rows[0])
        else:  # xgrammar spreads the rows over its threads
            if self._batch_matcher is None:
                import xgrammar as xgr

                self._batch_matcher = xgr.BatchGrammarMatcher()
            self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        elapsed = time.perf_counter() - t0
        # A request's matcher time is its own (max_grammar_*time_s): the batch's time is shared out, and
        # only a batch over the one-token limit is filled again row by row to find whose it was.
        times = [elapsed / len(rows)] * len(rows)
        if len(rows) > 1 and elapsed > self.config.max_grammar_step_time_s:
            times = []
            for i, matcher in zip(rows, matchers):
                t0 = time.perf_counter()
                matcher.fill_next_token_bitmask(bitmask, i)
                times.append(time.perf_counter() - t0)
        for i, dt in zip(rows, times):
            structured = seqs[i].structured
            structured.step_time_s = dt
            structured.matcher_time_s += dt
        groups: dict[int, tuple[torch.Tensor, list[int]]] = {}  # at most two distinct rows (JSON masks)
        for i in rows:
            allowed = seqs[i].structured.allowed_words
            if allowed is not None:
                groups.setdefault(id(allowed), (allowed, []))[1].append(i)
        for allowed, idx in groups.values():
            bitmask[idx] &= allowed
        return bitmask, torch.tensor(rows, dtype=torch.int64)

    @staticmethod
    def accept(seq: Sequence, token_id: int) -> bool:
        """Advance the sequence's matcher; False if the grammar rejects the token (a masking bug)."""
        structured = seq.structured
        matcher = structured.get_matcher()
        t0 = time.perf_counter()
        ok = matcher.accept_token(token_id)
        dt = time.perf_counter() - t0
        structured.step_time_s += dt
        structured.matcher_time_s += dt
        return ok

    def over_budget(self, seq: Sequence) -> str | None:
        """Why the sequence's grammar work must stop (after its accept): one token's matcher work over
        max_grammar_step_time_s, or the request's over max_grammar_time_s. An ambiguous grammar (nested
        repetitions: `root ::= (x)*`, `x ::= "a"*`) makes each token cost more than the last; the engine
        thread runs it, so every other request waits as long."""
        structured, cfg = seq.structured, self.config
        if structured is None:
            return None
        kind = structured.params.kind
        if structured.step_time_s > cfg.max_grammar_step_time_s:
            return (
                f"structured_outputs.{kind}: the grammar took {structured.step_time_s:.3f}s of matcher work for "
                f"one token: the limit is max_grammar_step_time_s={cfg.max_grammar_step_time_s} (an ambiguous "
                "grammar, e.g. nested repetitions, grows slower with each token; simplify it)"
            )
        if structured.matcher_time_s > cfg.max_grammar_time_s:
            return (
                f"structured_outputs.{kind}: the grammar took {structured.matcher_time_s:.3f}s of matcher work "
                f"over {len(seq.output_token_ids)} tokens: the limit is max_grammar_time_s={cfg.max_grammar_time_s} "
                "per request"
            )
        return None

    def allows_no_token(self, seq: Sequence) -> bool:
        """True if the sequence's grammar allows no token here: it compiled, but no string matches it."""
        bitmask, _ = self.grammar_bitmask([seq])
        return not bool(bitmask[0].any())

    @staticmethod
    def is_terminated(seq: Sequence) -> bool:
        return seq.structured is not None and seq.structured.get_matcher().is_terminated()

    def close(self) -> None:
        """Drop queued compiles and let the pool's threads end (a running compile finishes first: it
        cannot be interrupted). The manager compiles nothing after this."""
        for pool in (self._pool, self._small_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)


def _compiled_bytes(fut: cf.Future) -> int:
    """A finished compile's memory (xgrammar's estimate of the compiled grammar; a failure holds ~nothing)."""
    if fut.cancelled() or fut.exception() is not None:
        return 0
    return int(fut.result().grammar.memory_size_bytes)


def _spec_depth(kind: str, spec: Any) -> int:
    """How deep a constraint nests: objects/arrays of a JSON schema; brackets of a regex or EBNF grammar."""
    if kind == "json":
        depth, stack = 0, [(spec, 1)]
        while stack:
            value, d = stack.pop()
            if isinstance(value, (dict, list)):
                depth = max(depth, d)
                stack += [(v, d + 1) for v in (value.values() if isinstance(value, dict) else value)]
        return depth
    if kind in ("regex", "grammar"):
        depth = deepest = 0
        escaped = False
        for ch in spec:  # a bracket inside a string literal counts too: an over-estimate, never an under
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch in "([{":
                depth += 1
                deepest = max(deepest, depth)
            elif ch in ")]}":
                depth = max(0, depth - 1)
        return deepest
    return 1


def check_structured_outputs(cfg: EngineConfig, params: StructuredOutputsParams | None) -> None:
    """The complexity budget of a constraint, checked before it is compiled (the front checks it too): its
    text's bytes and its nesting depth. A compile's time and memory grow with both."""
    if params is None:
        return
    kind = params.kind
    text = params.key[1]
    size = len(text.encode("utf-8"))
    if size > cfg.max_grammar_spec_bytes:
        raise InvalidRequestError(
            f"structured_outputs.{kind} is {size} bytes: the limit is max_grammar_spec_bytes="
            f"{cfg.max_grammar_spec_bytes}"
        )
    depth = _spec_depth(kind, getattr(params, kind))
    if depth > cfg.max_grammar_depth:
        raise InvalidRequestError(
            f"structured_outputs.{kind} nests {depth} levels deep: the limit is max_grammar_depth="
            f"{cfg.max_grammar_depth}"
        )


def _strip_location(reason: str) -> str:
    # "[03:25:07] /project/cpp/regex_converter.cc:83: Regex parsing error ..." -> the reason alone
    if reason.startswith("[") and ".cc:" in reason:
        return reason.split(": ", 1)[-1]
    return reason


def _make_compiler(
    tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int], cache_bytes: int = 256 << 20
) -> tuple[xgrammar.GrammarCompiler, xgrammar.TokenizerInfo]:
    import os

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
    (mlc-ai/xgrammar#800, fix pending in #880):
    a random-weight model emits them and `json.loads` rejects the output. JSON never needs a raw byte
    below 0x20 other than whitespace between tokens, so tokens holding one are masked for JSON
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
