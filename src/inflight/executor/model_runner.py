"""Turns a scheduled batch into flat tensors (no padding), runs the model, returns logits.

The step's tensors come from the persistent input batch (`input_batch.py`), updated by diff each step.
Write-then-read: each layer first scatters the step's new K/V into the paged cache at
`slot_mapping`, then attention reads every context token through `block_tables`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from inflight.executor.attention import get_backend
from inflight.executor.input_batch import BatchInputs, InputBatch
from inflight.executor.sampler import SamplingMetadata
from inflight.models.llama import LlamaForCausalLM

if TYPE_CHECKING:  # the engine hands its batch down; the executor never imports the engine
    from inflight.engine.scheduler import SchedulerOutput


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [S, V] float32, one row per sequence that samples this step
    sample_rows: np.ndarray  # indices into the scheduled seqs of those S sequences
    forward_time_s: float
    sampling_metadata: SamplingMetadata  # those S sequences' sampling parameters and token ids


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
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
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
        self.input_batch = InputBatch(max_num_seqs, max_model_len, max_num_batched_tokens, block_size, device)

    @staticmethod
    def kv_bytes_per_block(model_cfg, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * model_cfg.num_hidden_layers * block_size * model_cfg.num_key_value_heads * model_cfg.head_dim * elem

    def prepare(self, sched: SchedulerOutput) -> BatchInputs:
        return self.input_batch.prepare(sched.seqs, sched.num_scheduled_tokens)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        inputs = self.prepare(sched)
        meta, sample_rows = inputs.attn_metadata, inputs.sample_rows
        t0 = time.perf_counter()
        hidden = self.model(inputs.input_ids, inputs.positions, meta, self.kv_caches, self.ops)
        last = torch.from_numpy(meta.query_start_loc_np[1:][sample_rows] - 1).to(self.device)
        logits = self.model.compute_logits(hidden[last])
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return ModelOutput(
            logits=logits,
            sample_rows=sample_rows,
            forward_time_s=time.perf_counter() - t0,
            sampling_metadata=self.input_batch.sampling_metadata(sample_rows),
        )
