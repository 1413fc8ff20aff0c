"""Turns a scheduled batch into flat tensors (no padding), runs the model, returns logits.

The step's tensors come from the persistent input batch (`input_batch.py`), updated by diff each step.
Write-then-read: each layer first scatters the step's new K/V into the paged cache at
`slot_mapping`, then attention reads every context token through `block_tables`. With tensor parallelism this
is rank 0's runner: it sends each step to the worker ranks (executor/tensor_parallel.py), whose runners run the
same `run_model`.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from inflight import omp
from inflight.executor.attention import AttentionMetadata, get_backend
from inflight.executor.cpu_forward import CpuForward
from inflight.executor.cuda_graphs import CudaGraphRunner, PiecewiseGraphRunner
from inflight.executor.input_batch import BatchInputs, InputBatch
from inflight.executor.sampler import SamplingMetadata
from inflight.models.llama import LlamaForCausalLM
from inflight.models.packed_linear import PackedLinear, warm_up_onednn
from inflight.models.parallel import TensorParallel

if TYPE_CHECKING:
    from inflight.executor.scheduled import ScheduledStep
    from inflight.executor.tensor_parallel import TensorParallelWorkers


@dataclass
class ModelOutput:
    # [R, V] float32: one row per sequence that samples this step, or d+1 consecutive rows for one that
    # verifies d draft tokens (the logits after its last token and after each draft)
    logits: torch.Tensor
    sample_rows: np.ndarray  # indices into the scheduled seqs of those S sequences
    forward_time_s: float
    sampling_metadata: SamplingMetadata  # the R logits rows' sampling parameters and token ids
    num_spec_tokens: np.ndarray | None = None  # [S] drafts each of those sequences verifies; None: none does


# With OMP_WAIT_POLICY=PASSIVE, OpenMP threads sleep between ops and each op wakes them again; a step whose
# GEMMs are this small (tokens x one layer's weights, multiply-adds) runs faster on the calling thread alone.
# The same bound applies to the output layer when it is
# bigger than a layer. It is only where ThreadChooser starts: the crossover depends on the host.
SINGLE_THREAD_LAYER_MACS = 32e6


class ThreadChooser:
    """The forward's thread count per step size, chosen from measured step times.

    Whether a second core pays for a step depends on the step's size, the dtype and the host (how long a
    sleeping OpenMP thread takes to wake). Steps are bucketed by token
    count (powers of two); a bucket starts from the static rule (`single_below` tokens), runs the other
    count every `explore_every`-th step, and keeps whichever has the lower median over its last `window`
    steps: one slow step (a VM hiccup) does not move it, a slowdown that lasts (another process on a core)
    does. Outputs do not depend on the thread count (every CPU op sums each row in a fixed order; tested),
    so the choice moves time only.
    """

    def __init__(self, max_threads: int, single_below: int, explore_every: int = 16, window: int = 5) -> None:
        self.max_threads, self.single_below = max_threads, single_below
        self.explore_every, self.window = explore_every, window
        self._steps: dict[int, int] = {}
        self._times: dict[tuple[int, int], deque[float]] = {}

    def _median(self, bucket: int, threads: int) -> float | None:
        times = self._times.get((bucket, threads))
        return statistics.median(times) if times else None

    def best(self, tokens: int) -> int:
        bucket = tokens.bit_length()
        one, many = self._median(bucket, 1), self._median(bucket, self.max_threads)
        if one is None or many is None:
            return 1 if tokens < self.single_below else self.max_threads
        return 1 if one <= many else self.max_threads

    def choose(self, tokens: int) -> int:
        bucket = tokens.bit_length()
        self._steps[bucket] = self._steps.get(bucket, 0) + 1
        best = self.best(tokens)
        if self._steps[bucket] % self.explore_every == 0:
            return self.max_threads if best == 1 else 1
        return best

    def record(self, tokens: int, threads: int, seconds: float) -> None:
        key = (tokens.bit_length(), threads)
        if key not in self._times:
            self._times[key] = deque(maxlen=self.window)
        self._times[key].append(seconds)


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
        enforce_eager: bool = False,
        workers: TensorParallelWorkers | None = None,
        num_threads: int | None = None,
    ) -> None:
        """`workers`: the tensor-parallel ranks this runner (rank 0's) sends each step to; `num_threads`: the
        forward's torch threads (default: the process's)."""
        cfg = model.cfg
        self.model = model
        self.block_size = block_size
        self.device = device
        self.workers = workers
        self.ops = get_backend(attention_backend, device)
        model.init_rope(max_model_len, device)
        tensor_parallel = model.tp.size > 1
        # This rank's KV heads (all of them on one rank)
        shape = (num_blocks, block_size, model.model.layers[0].self_attn.num_kv_heads, cfg.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_hidden_layers)
        ]
        # The layer stack as one C++ call a step where it covers the model (CPU, our GEMM, the C++ ops).
        self.cpu_forward = CpuForward(model, self.kv_caches) if CpuForward.supported(model, self.ops) else None
        self.input_batch = InputBatch(max_num_seqs, max_model_len, max_num_batched_tokens, block_size, device)
        # Steps replayed from CUDA graphs where the kernels are compiled (not under the interpreter): decode
        # steps whole, the others in pieces around attention; not with several ranks (none around collectives yet).
        self.cuda_graphs = self.piecewise_graphs = None
        if device.type == "cuda" and attention_backend == "triton" and not enforce_eager and not tensor_parallel:
            max_blocks = self.input_batch.block_table.cpu.shape[1]
            max_decode = min(max_num_seqs, max_num_batched_tokens)
            self.cuda_graphs = CudaGraphRunner(model, self.kv_caches, self.ops, max_decode, max_blocks, device)
            self.cuda_graphs.capture_all()
            self.piecewise_graphs = PiecewiseGraphRunner(
                model, self.kv_caches, self.ops, max_num_batched_tokens, device, pool=self.cuda_graphs.pool
            )
            self.piecewise_graphs.capture_all()
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_threads = num_threads or torch.get_num_threads()
        passive = omp.threads_sleep()
        layer = model.model.layers[0]  # packed linears hold their weight outside parameters()
        packed = sum(m.in_features * m.out_features for m in layer.modules() if isinstance(m, PackedLinear))
        layer_weights = packed + sum(p.numel() for p in layer.parameters())
        # A large vocabulary's output layer can be one GEMM bigger than a whole layer: then it alone decides.
        head = model.cfg.hidden_size * model.cfg.vocab_size
        # CPU with sleeping OpenMP threads only: below this many tokens a step starts on one thread (0: none
        # does), and the chooser measures from there (a big model's small steps may still be faster alone).
        adaptive = device.type == "cpu" and passive and self.max_threads > 1
        self.single_thread_tokens = int(SINGLE_THREAD_LAYER_MACS // max(1, layer_weights, head)) if adaptive else 0
        explore_every = 16
        if self.cpu_forward is not None:
            # It wakes the threads once a step, not once an op: every size starts on all threads, and one thread
            # is tried every 64th step (it wins small steps when other processes keep every core busy).
            self.single_thread_tokens, explore_every = 0, 64
        self.threads = ThreadChooser(self.max_threads, self.single_thread_tokens, explore_every) if adaptive else None

    def warm_up(self, head_rows: int) -> int:
        """Build oneDNN's kernels for every step size and thread count now (CPU; see `warm_up_onednn`): a
        server's memory is then what it holds from its start. Returns the number of calls."""
        if self.device.type != "cpu":
            return 0
        threads = [self.max_threads] + ([1] if self.threads is not None and self.max_threads > 1 else [])
        return warm_up_onednn(self.model, self.max_num_batched_tokens, head_rows, threads)

    @staticmethod
    def kv_bytes_per_block(model_cfg, block_size: int, dtype: torch.dtype, tensor_parallel_size: int = 1) -> int:
        """One block's K and V over every layer, of the heads one rank holds."""
        elem = torch.empty((), dtype=dtype).element_size()
        kv_heads, _ = TensorParallel(0, tensor_parallel_size).kv_heads(model_cfg.num_key_value_heads)
        return 2 * model_cfg.num_hidden_layers * block_size * kv_heads * model_cfg.head_dim * elem

    def prepare(self, sched: ScheduledStep) -> BatchInputs:
        return self.input_batch.prepare(sched.seqs, sched.num_scheduled_tokens, sched.spec_token_ids, sched.lora_slots)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The layer stack: [T] tokens -> [T, hidden] final-norm outputs (the step's K/V written)."""
        if self.cpu_forward is not None:
            return self.cpu_forward(input_ids, positions, meta)
        # The graphs were captured without adapters: a step with LoRA rows launches its kernels from Python.
        graphs = meta.token_lora_slots is None
        if graphs and self.cuda_graphs is not None and self.cuda_graphs.can_run(input_ids, meta):
            return self.cuda_graphs.run(input_ids, positions, meta)
        if graphs and self.piecewise_graphs is not None and self.piecewise_graphs.can_run(len(input_ids)):
            return self.piecewise_graphs.run(input_ids, positions, meta)
        return self.model(input_ids, positions, meta, self.kv_caches, self.ops)

    def run_model(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, logit_rows: np.ndarray
    ) -> torch.Tensor | None:
        """The forward, then the logits of its output rows `logit_rows` (None on a tensor-parallel worker rank)."""
        hidden = self.forward(input_ids, positions, meta)
        # A decode step samples every row in order: no gather.
        if len(logit_rows) != len(hidden) or not np.array_equal(logit_rows, np.arange(len(hidden))):
            hidden = hidden[torch.from_numpy(logit_rows).to(self.device)]
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def execute(self, sched: ScheduledStep) -> ModelOutput:
        inputs = self.prepare(sched)
        meta, sample_rows = inputs.attn_metadata, inputs.sample_rows
        last = meta.query_start_loc_np[1:][sample_rows] - 1
        spec = inputs.num_spec_tokens
        offsets = None
        if spec is not None:  # a verifying row's logits at its last d+1 positions
            counts = spec + 1
            starts = np.cumsum(counts) - counts
            offsets = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(starts, counts)
            last = np.repeat(last - spec, counts) + offsets
        # The thread count is process-wide: put it back after the forward, so that nothing else (the
        # sampler, another engine in this process, the caller's own torch work) inherits another count.
        tokens = len(inputs.input_ids)
        threads = self.threads.choose(tokens) if self.threads and tokens else self.max_threads
        previous = torch.get_num_threads()
        if threads != previous:
            torch.set_num_threads(threads)
        try:
            t0 = time.perf_counter()
            if self.workers is None:
                logits = self.run_model(inputs.input_ids, inputs.positions, meta, last)
            else:
                logits = self.workers.run(self.run_model, inputs.input_ids, inputs.positions, meta, last)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            forward_time = time.perf_counter() - t0
        finally:
            if threads != previous:
                torch.set_num_threads(previous)
        if self.threads and tokens:
            self.threads.record(tokens, threads, forward_time)
        rows = sample_rows if spec is None else np.repeat(sample_rows, spec + 1)
        return ModelOutput(
            logits=logits,
            sample_rows=sample_rows,
            forward_time_s=forward_time,
            sampling_metadata=self.input_batch.sampling_metadata(rows, offsets),
            num_spec_tokens=spec,
        )
