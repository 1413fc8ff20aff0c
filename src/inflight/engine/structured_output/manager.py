"""The structured-output manager: per request id, the constraint's compile and then its grammar matcher.

The scheduler asks which requests are ready (their grammar compiled) and admits only those; a request whose
compile fails or times out is reported by `take_failed`. The step's sampling rows get one bitmask
(bitmask.py); each matcher then accepts its sampled token. Preemption recomputes KV but keeps the output
tokens, so a matcher stays valid across it; `remove` drops it with the request.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from inflight.engine.structured_output.bitmask import BitmaskFiller
from inflight.engine.structured_output.compile_pool import CompilePool, GrammarCompile

if TYPE_CHECKING:
    from collections.abc import Callable

    import xgrammar
    from tokenizers import Tokenizer

    from inflight.config import EngineConfig
    from inflight.sampling_params import StructuredOutputsParams


@dataclass(eq=False)
class StructuredRequest:
    """One request's constraint: its compile, then its matcher and the engine time the matcher took."""

    compile: GrammarCompile
    matcher: xgrammar.GrammarMatcher | None = None
    # Matcher time (bitmask fill + accept) in total, and for the current step's token (the fill starts a
    # step's account). Bounded by max_grammar_time_s and max_grammar_step_time_s.
    matcher_time_s: float = 0.0
    step_time_s: float = 0.0

    @property
    def kind(self) -> str:
        return self.compile.params.kind

    def get_matcher(self) -> xgrammar.GrammarMatcher:
        if self.matcher is None:
            import xgrammar as xgr

            self.matcher = xgr.GrammarMatcher(self.compile.result().grammar)
        return self.matcher


class StructuredOutputManager:
    """Owned by the engine thread; only the compile pool's workers run elsewhere. `tokenizer` returns the
    tokenizer when the first constraint compiles (a server that never sees one never loads it)."""

    def __init__(
        self,
        tokenizer: Callable[[], Tokenizer] | None,
        vocab_size: int,
        stop_token_ids: list[int],
        config: EngineConfig,
        max_workers: int = 2,
    ) -> None:
        self.vocab_size = vocab_size
        self.config = config
        self.pool = CompilePool(tokenizer, vocab_size, stop_token_ids, config, max_workers)
        self._requests: dict[str, StructuredRequest] = {}
        self._pending: dict[str, StructuredRequest] = {}  # compiling: not ready, not failed yet
        self._filler = BitmaskFiller(vocab_size)

    def add(self, request_id: str, params: StructuredOutputsParams) -> None:
        """Start the compile of the request's constraint; the scheduler admits it once `is_ready`."""
        request = self._requests[request_id] = StructuredRequest(self.pool.request(params))
        if not request.compile.is_ready:  # compiling, or failed (reported by the next take_failed)
            self._pending[request_id] = request

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def is_ready(self, request_id: str) -> bool:
        """False while the request's grammar compiles (or failed to); True for an unconstrained request."""
        request = self._pending.get(request_id)
        return request is None or request.compile.is_ready

    def remove(self, request_id: str) -> None:
        """The request finished or was aborted: its matcher goes with it."""
        self._requests.pop(request_id, None)
        self._pending.pop(request_id, None)

    def take_failed(self) -> list[tuple[str, str]]:
        """(request id, why) of the pending requests whose compile failed or timed out; the ready ones leave
        the pending set."""
        failed = []
        for request_id, request in list(self._pending.items()):
            err = request.compile.error()
            if err is not None:
                failed.append((request_id, err))
                if request.compile.future.cancelled():
                    self.pool.forget(request.compile)
                del self._pending[request_id]
            elif request.compile.future.done():
                del self._pending[request_id]
        return failed

    def wait_for_compile(self, timeout_s: float) -> None:
        """Nothing else to run: block briefly for a compile instead of spinning the engine loop."""
        futures = [r.compile.future for r in self._pending.values()]
        if futures:
            cf.wait(futures, timeout=timeout_s, return_when=cf.FIRST_COMPLETED)

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def grammar_bitmask(self, request_ids: list[str]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(bitmask [len(request_ids), ceil(V/32)] int32, constrained rows [R]) for the step's sampling rows
        (one per row), or None when no row is constrained. Only the constrained rows are filled."""
        rows = [i for i, rid in enumerate(request_ids) if rid in self._requests]
        if not rows:
            return None
        requests = [self._requests[request_ids[i]] for i in rows]
        bitmask, times = self._filler.fill(
            len(request_ids),
            rows,
            [r.get_matcher() for r in requests],
            [r.compile.result().allowed_words for r in requests],
            self.config.max_grammar_step_time_s,
        )
        for request, dt in zip(requests, times):
            request.step_time_s = dt
            request.matcher_time_s += dt
        return bitmask, torch.tensor(rows, dtype=torch.int64)

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advance the request's matcher; False if the grammar rejects the token."""
        request = self._requests[request_id]
        matcher = request.get_matcher()
        t0 = time.perf_counter()
        ok = matcher.accept_token(token_id)
        dt = time.perf_counter() - t0
        request.step_time_s += dt
        request.matcher_time_s += dt
        return ok

    def over_budget(self, request_id: str, num_output_tokens: int) -> str | None:
        """Why the request's grammar work must stop (after its accept): one token's matcher work over
        max_grammar_step_time_s, or the request's over max_grammar_time_s. An ambiguous grammar (nested
        repetitions: `root ::= (x)*`, `x ::= "a"*`) makes each token cost more than the last; the engine
        thread runs it, so every other request waits as long."""
        request, cfg = self._requests[request_id], self.config
        if request.step_time_s > cfg.max_grammar_step_time_s:
            return (
                f"structured_outputs.{request.kind}: the grammar took {request.step_time_s:.3f}s of matcher work "
                f"for one token: the limit is max_grammar_step_time_s={cfg.max_grammar_step_time_s} (an "
                "ambiguous grammar, e.g. nested repetitions, grows slower with each token; simplify it)"
            )
        if request.matcher_time_s > cfg.max_grammar_time_s:
            return (
                f"structured_outputs.{request.kind}: the grammar took {request.matcher_time_s:.3f}s of matcher "
                f"work over {num_output_tokens} tokens: the limit is max_grammar_time_s={cfg.max_grammar_time_s} "
                "per request"
            )
        return None

    def allows_no_token(self, request_id: str) -> bool:
        """True if the request's grammar allows no token here: it compiled, but no string matches it."""
        bitmask, _ = self.grammar_bitmask([request_id])
        return not bool(bitmask[0].any())

    def is_terminated(self, request_id: str) -> bool:
        request = self._requests.get(request_id)
        return request is not None and request.get_matcher().is_terminated()

    def close(self) -> None:
        """Drop queued compiles; the manager compiles nothing after this."""
        self.pool.close()
