"""CUDA graphs: decode-only steps whole, every other step in pieces split at attention.

Decode-only steps: the layer stack captured once per (padded batch size, split-K count) and replayed,
instead of launching every kernel from Python each step.

Why: on a GPU a decode step of a small model is launch-bound (Python launches each of its kernels); a replay
launches them all in one call.

What is captured whole: steps where every sequence queries one token (decode), whose shapes depend on the
batch size alone. A batch of B sequences is padded up to the next captured
size; pad rows write no K/V (slot -1), attend to one token of a valid block (their block-table row keeps
whatever valid block ids it held) and their outputs are dropped. The graphs read their own static input
buffers: a replay first copies the step's inputs (already on the device, from the persistent input batch)
into them. The attention plan (query tiles, split-K count) is host-side and frozen into a graph, so the
split-K count the step would pick is part of the key.

Numerics: a padded GEMM may pick another cuBLAS kernel than the unpadded one, so a replay matches the eager
step to rounding, not bit for bit (tested on a GPU; greedy tokens equal on the demo model).

Steps with prompt chunks or drafts to verify (vLLM's piecewise graphs, `PiecewiseGraphRunner`): everything
but attention depends on the token count alone, so it is captured per padded token count as L + 1 graphs
that end and begin at each layer's attention; attention runs eagerly between the replays on the step's real
rows, with the step's own plan. Under load nearly every step admits a request, so without these most steps
of a served GPU ran eagerly.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from inflight.executor.attention import AttentionMetadata

logger = logging.getLogger("inflight")


def is_decode_only(input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Every sequence queries exactly one token (query_start_loc is 0, 1, ..., B): what the graphs assume.
    One token per sequence on average is not enough: a sequence with none would shift the others' rows."""
    qsl = meta.query_start_loc_np
    return input_ids.shape[0] == len(qsl) - 1 and bool((np.diff(qsl) == 1).all())


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, then multiples of 8 (vLLM's choice), up to max_num_seqs."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sorted(set(sizes) | {max_num_seqs})


class CudaGraphRunner:
    """Replays a graph per (padded batch size, split-K count). `capture_all` captures every size with one KV
    pass up front (the key of every batch that fills the GPU, and of small ones over short contexts); a
    split-K key is captured on its first step (a warm-up run, then the capture)."""

    def __init__(
        self,
        model: Any,  # LlamaForCausalLM: its forward(input_ids, positions, meta, kv_caches, ops)
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        ops: Any,  # the Triton backend (it exposes `plan` and `num_splits`)
        max_num_seqs: int,
        max_blocks_per_seq: int,
        device: torch.device,
    ) -> None:
        self.model, self.kv_caches, self.ops, self.device = model, kv_caches, ops, device
        self.sizes = capture_sizes(max_num_seqs)
        cfg = model.cfg
        self.num_q_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        n = self.sizes[-1]
        # Pad values where a row is not a real sequence; query_start_loc is arange for every decode batch.
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, AttentionMetadata]] = {}
        self.pool = None  # one memory pool for all graphs: only one runs at a time
        self.replays: dict[tuple[int, int], int] = {}  # per key: how many steps replayed it

    @torch.inference_mode()
    def capture_all(self) -> None:
        t0 = time.perf_counter()
        for size in reversed(self.sizes):  # largest first: the shared pool is sized once
            if (size, 1) not in self.graphs:
                self._capture(size, 1)
        logger.info(
            "captured CUDA graphs for decode batches of %s sequences in %.1f s",
            ", ".join(map(str, self.sizes)),
            time.perf_counter() - t0,
        )

    def can_run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
        return 0 < len(meta.seq_lens_np) <= self.sizes[-1] and is_decode_only(input_ids, meta)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """[B] decode tokens -> [B, hidden], the K/V of the step written, through a replay."""
        b = len(meta.seq_lens_np)
        size = next(s for s in self.sizes if s >= b)
        splits = self.ops.num_splits(size, self.num_kv_heads, int(meta.seq_lens_np.max()), 1, self.device)
        graph, hidden, _ = self.graphs.get((size, splits)) or self._capture(size, splits)
        width = meta.block_tables.shape[1]
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slot_mapping[:b].copy_(meta.slot_mapping)
        self.seq_lens[:b].copy_(meta.seq_lens)
        self.block_tables[:b, :width].copy_(meta.block_tables)
        if size > b:  # rows a larger step left real values in are pads again
            self.slot_mapping[b:size].fill_(-1)
            self.seq_lens[b:size].fill_(1)
        graph.replay()
        self.replays[(size, splits)] = self.replays.get((size, splits), 0) + 1
        return hidden[:b]

    def _capture(self, size: int, splits: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, AttentionMetadata]:
        # Every row a pad while capturing: the warm-up run really executes, and must write no K/V.
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(1)
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            query_start_loc_np=np.arange(size + 1),
            seq_lens_np=np.ones(size, dtype=np.int64),
        )
        self.ops.plan(meta, self.num_q_heads, self.num_kv_heads, self.device, num_splits=splits)
        args = (self.input_ids[:size], self.positions[:size], meta, self.kv_caches, self.ops)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # the warm-up compiles the kernels; a capture may not
            self.model(*args)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self.model(*args)
        self.pool = graph.pool()
        self.graphs[(size, splits)] = (graph, hidden, meta)  # meta keeps the plan's tile tensors alive
        logger.debug("captured a CUDA graph for decode batch %d, %d KV split(s)", size, splits)
        return self.graphs[(size, splits)]


def piecewise_sizes(max_tokens: int) -> list[int]:
    """Padded token counts of the piecewise graphs, up to min(max_tokens, 512): larger steps are long prompt
    chunks, whose kernels outlast their launches."""
    limit = min(max_tokens, 512)
    sizes = [s for s in (8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512) if s < limit]
    return [*sizes, limit]


class PiecewiseGraphRunner:
    """Replays a step of T tokens as the pieces captured for the smallest size >= T. The pieces read the
    step's token ids, positions and KV slots from static buffers (pad rows: slot -1, no K/V written) and the
    attention output from one static buffer that each layer's eager attention fills."""

    def __init__(
        self,
        model: Any,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        ops: Any,
        max_tokens: int,
        device: torch.device,
        pool: Any = None,  # the decode graphs' memory pool: one step's graphs run at a time
    ) -> None:
        self.model, self.kv_caches, self.ops, self.device, self.pool = model, kv_caches, ops, device, pool
        self.sizes = piecewise_sizes(max_tokens)
        cfg = model.cfg
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        dtype = kv_caches[0][0].dtype
        self.attn_out = torch.zeros(n, cfg.num_attention_heads, cfg.head_dim, dtype=dtype, device=device)
        # per size: the L + 1 graphs, each layer's query (a tensor of the graphs' pool), scale and sliding window,
        # the output
        self.pieces: dict[int, tuple[list[torch.cuda.CUDAGraph], list[tuple], torch.Tensor]] = {}
        self.replays: dict[int, int] = {}

    @torch.inference_mode()
    def capture_all(self) -> None:
        t0 = time.perf_counter()
        for size in reversed(self.sizes):
            self._capture(size)
        logger.info(
            "captured piecewise CUDA graphs (%d pieces each) for steps of up to %s tokens in %.1f s",
            len(self.kv_caches) + 1,
            ", ".join(map(str, self.sizes)),
            time.perf_counter() - t0,
        )

    def can_run(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """[T] tokens -> [T, hidden], the step's K/V written: the pieces replayed, attention eager between."""
        t = len(input_ids)
        size = next(s for s in self.sizes if s >= t)
        graphs, queries, hidden = self.pieces[size]
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.slot_mapping[:t].copy_(meta.slot_mapping)
        if size > t:  # pad rows keep earlier steps' (valid) ids and positions but write no K/V
            self.slot_mapping[t:size].fill_(-1)
        graphs[0].replay()
        for graph, (query, scale, window), (k_cache, v_cache) in zip(graphs[1:], queries, self.kv_caches, strict=True):
            self.attn_out[:t].copy_(self.ops.attention(query[:t], k_cache, v_cache, meta, scale, sliding_window=window))
            graph.replay()
        self.replays[size] = self.replays.get(size, 0) + 1
        return hidden[:t]

    def _capture(self, size: int) -> None:
        self.slot_mapping.fill_(-1)
        # The warm-up runs every kernel at this size (compiling what it needs; a capture may not): each row a
        # one-token sequence over block 0, writing nothing.
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=self.device),
            seq_lens=torch.ones(size, dtype=torch.int32, device=self.device),
            block_tables=torch.zeros(size, 1, dtype=torch.int32, device=self.device),
            query_start_loc_np=np.arange(size + 1),
            seq_lens_np=np.ones(size, dtype=np.int64),
        )
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.model(self.input_ids[:size], self.positions[:size], meta, self.kv_caches, self.ops)
            stream.synchronize()
            split = _SplitAtAttention(self.ops, self.attn_out[:size], self.pool)
            hidden = self.model(self.input_ids[:size], self.positions[:size], meta, self.kv_caches, split)
            split.finish()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.pool = split.pool
        self.pieces[size] = (split.graphs, split.queries, hidden)


class _SplitAtAttention:
    """The attention backend as the model sees it while its pieces are captured: every op is the backend's,
    but attention ends the piece being captured, keeps its query for the replays, begins the next piece and
    hands back the static buffer that the eager attention will fill."""

    def __init__(self, ops: Any, attn_out: torch.Tensor, pool: Any) -> None:
        self.ops, self.attn_out, self.pool = ops, attn_out, pool
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.queries: list[tuple[torch.Tensor, float, int | None]] = []
        self._begin()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ops, name)

    def _begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool)
        self.graphs.append(graph)

    def finish(self) -> None:
        self.graphs[-1].capture_end()
        if self.pool is None:
            self.pool = self.graphs[0].pool()

    def attention(self, query, k_cache, v_cache, meta, scale, key=None, value=None, sliding_window=None):
        self.finish()
        self.queries.append((query, scale, sliding_window))
        self._begin()
        return self.attn_out
