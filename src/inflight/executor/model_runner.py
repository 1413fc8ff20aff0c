"""Turns a scheduled batch into flat tensors (no padding), runs the model, returns logits.

Write-then-read: each layer first scatters the step's new K/V into the paged cache at
`slot_mapping`, then attention reads every context token through `block_tables`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from inflight.executor.attention import AttentionMetadata, get_backend
from inflight.models.llama import LlamaForCausalLM

if TYPE_CHECKING:  # the engine hands its batch down; the executor never imports the engine
    from inflight.engine.scheduler import SchedulerOutput


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [S, V] float32, one row per sequence that samples this step
    sample_rows: np.ndarray  # indices into the scheduled seqs of those S sequences
    forward_time_s: float


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device,
        attention_backend: str,
    ) -> None:
        cfg = model.cfg
        self.model = model
        self.block_size = block_size
        self.device = device
        self.ops = get_backend(attention_backend, device)
        model.init_rope(max_model_len, device)
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_hidden_layers)
        ]

    @staticmethod
    def kv_bytes_per_block(model_cfg, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * model_cfg.num_hidden_layers * block_size * model_cfg.num_key_value_heads * model_cfg.head_dim * elem

    def prepare(self, sched: SchedulerOutput) -> tuple[torch.Tensor, np.ndarray, AttentionMetadata, np.ndarray]:
        seqs, counts = sched.seqs, sched.num_scheduled_tokens
        num_computed = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=len(seqs))
        n = np.asarray(counts, dtype=np.int64)
        qsl = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(n, out=qsl[1:])
        total = int(qsl[-1])
        seq_lens = num_computed + n
        # Position of every token: its sequence's computed count plus its offset inside the chunk.
        positions = np.arange(total, dtype=np.int64) + np.repeat(num_computed - qsl[:-1], n)

        input_ids: list[int] = []
        for s, c, k in zip(seqs, num_computed.tolist(), counts):
            if k == 1:
                input_ids.append(s.token_at(c))
            elif c + k <= s.num_prompt_tokens:
                input_ids.extend(s.prompt_token_ids[c : c + k])
            else:
                input_ids.extend(s.all_token_ids()[c : c + k])

        table_lens = np.fromiter((len(s.block_table) for s in seqs), dtype=np.int64, count=len(seqs))
        # A short table would map tokens into the padding's block 0, which may be another request's cached
        # prefix: check coverage once per step on the host (no per-layer skip test, which would sync a GPU).
        assert (-(-seq_lens // self.block_size) <= table_lens).all(), "a block table does not cover its tokens"
        max_blocks = int(table_lens.max())
        tables = np.zeros((len(seqs), max_blocks), dtype=np.int32)
        for row, s in zip(tables, seqs):
            row[: len(s.block_table)] = s.block_table
        token_rows = np.repeat(np.arange(len(seqs)), n)
        slots = tables[token_rows, positions // self.block_size].astype(np.int64) * self.block_size
        slots += positions % self.block_size

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(tables).to(dev),
            query_start_loc_np=qsl,
            seq_lens_np=seq_lens,
        )
        num_tokens = np.fromiter((s.num_tokens for s in seqs), dtype=np.int64, count=len(seqs))
        sample_rows = np.nonzero(seq_lens == num_tokens)[0]  # chunks that reach the end sample a token
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        return ids, positions, meta, sample_rows

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        ids, positions, meta, sample_rows = self.prepare(sched)
        t0 = time.perf_counter()
        hidden = self.model(ids, torch.from_numpy(positions).to(self.device), meta, self.kv_caches, self.ops)
        last = torch.from_numpy(meta.query_start_loc_np[1:][sample_rows] - 1).to(self.device)
        logits = self.model.compute_logits(hidden[last])
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return ModelOutput(
            logits=logits,
            sample_rows=sample_rows,
            forward_time_s=time.perf_counter() - t0,
        )
