"""Tensor parallelism in Megatron-LM's layout (as vLLM and nano-vllm have it): every rank holds a slice of each
large weight, runs the same forward over the whole batch, and the ranks meet in two all-reduces a layer.

- column-parallel (q/k/v, gate/up): each rank its output rows (its heads, its share of the MLP), no communication:
  the next op reads only its own columns;
- row-parallel (o_proj, down_proj): each rank its input columns; the output is the rank's partial sum, which the
  model all-reduces (after any adapter delta); rank 0 alone holds the bias, so it is added once;
- vocab-parallel embedding: each rank its vocabulary rows, a masked lookup, an all-reduce;
- vocab-parallel lm_head: each rank the logits of its vocabulary rows, gathered to rank 0 (which samples).

KV heads as vLLM splits them: with at least as many KV heads as ranks each rank holds Hkv / tp of them, with fewer
each KV head is replicated on tp / Hkv ranks. A parallel module names the part of each checkpoint tensor its rank
holds (`tp_shards`); the loader reads just that part. At size 1 every layer is the plain one, with no extra op.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from inflight.config import ConfigError
from inflight.models.config import ModelConfig


@dataclass(frozen=True)
class Shard:
    """`size` rows (dim 0) or columns (dim 1) from `start` of a checkpoint tensor `total` long along `dim`. The
    parameter may be longer along `dim`: the rest is zeros (a vocabulary's last shard; a row-parallel bias on
    ranks but 0)."""

    dim: int
    start: int
    size: int
    total: int

    def checkpoint_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The whole tensor's shape, given this rank's parameter's."""
        return tuple(self.total if i == self.dim else n for i, n in enumerate(shape))

    def part_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """This part's shape, given the whole tensor's."""
        return tuple(self.size if i == self.dim else n for i, n in enumerate(shape))

    def take(self, tensor: Any) -> torch.Tensor:
        """This part of `tensor`: a torch tensor or a safetensors slice (read without the rest of the tensor)."""
        part = slice(self.start, self.start + self.size)
        return tensor[part] if self.dim == 0 else tensor[:, part]


@dataclass
class TensorParallel:
    """This process's place in the group: its rank, the group's size, the torch.distributed group the
    collectives run in (set once the ranks have joined; None at size 1), and, for CPU ranks on one host, the
    shared-memory group (executor/shm_group.py) that runs the all-reduce and the gather in its place."""

    rank: int = 0
    size: int = 1
    group: Any = None
    shm: Any = None

    def split(self, total: int, dim: int = 0) -> Shard:
        """This rank's even share of `total` rows (columns with dim=1); `check_sizes` checked it divides."""
        size = total // self.size
        return Shard(dim, self.rank * size, size, total)

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(KV heads this rank holds, the first of them)."""
        if num_kv_heads >= self.size:
            n = num_kv_heads // self.size
            return n, self.rank * n
        return 1, self.rank // (self.size // num_kv_heads)  # each head on size / Hkv ranks

    def vocab_rows(self, vocab_size: int) -> tuple[Shard, int]:
        """This rank's vocabulary rows, and the rows every rank's shard is padded to (equal shards gather)."""
        per_rank = -(-vocab_size // self.size)
        start = min(self.rank * per_rank, vocab_size)
        return Shard(0, start, min(per_rank, vocab_size - start), vocab_size), per_rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` summed, in place; `x` itself at size 1."""
        if self.size == 1:
            return x
        if self.shm is not None and self.shm.supports(x):
            return self.shm.all_reduce(x)
        dist.all_reduce(x, group=self.group)
        return x

    def gather_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """[T, V] on rank 0 from each rank's [T, V / size] columns (None on the other ranks); as is at size 1."""
        if self.size == 1:
            return logits
        if len(logits) == 0:  # every rank has the same rows: none of them communicates
            return logits.new_empty(0, vocab_size) if self.rank == 0 else None
        logits = logits.contiguous()
        if self.shm is not None:
            parts = self.shm.gather(logits)  # [size, T, V / size] on rank 0
            if parts is None:
                return None
            full = parts.permute(1, 0, 2).reshape(len(logits), -1)
        else:
            parts = [torch.empty_like(logits) for _ in range(self.size)] if self.rank == 0 else None
            dist.gather(logits, parts, group=self.group, group_dst=0)
            if self.rank != 0:
                return None
            full = torch.cat(parts, dim=-1)
        return full if full.shape[-1] == vocab_size else full[:, :vocab_size].contiguous()


SINGLE = TensorParallel()  # one rank holds everything


def check_sizes(cfg: ModelConfig, size: int) -> None:
    """ConfigError naming tensor_parallel_size unless `size` ranks can split this model's heads and MLP."""

    def refuse(field: str, value: int, rule: str) -> ConfigError:
        return ConfigError(f"tensor_parallel_size={size} does not fit {cfg.architecture}'s {field}={value}: {rule}")

    if cfg.num_attention_heads % size:
        raise refuse("num_attention_heads", cfg.num_attention_heads, "it must divide the attention heads")
    kv = cfg.num_key_value_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        raise refuse("num_key_value_heads", kv, "it must divide the KV heads, or be a multiple of them")
    if cfg.intermediate_size % size:
        raise refuse("intermediate_size", cfg.intermediate_size, "it must divide the MLP's width")
    if cfg.qk_norm == "projection":
        raise ConfigError(
            f"tensor_parallel_size={size}: {cfg.architecture}'s q/k norm spans every head (OLMoE); it is not split "
            "across ranks, use tensor_parallel_size=1"
        )


class ColumnParallelLinear(nn.Linear):
    """The output rows `rows` of a [out, in] linear (all of them at size 1): its own heads or MLP columns."""

    def __init__(self, in_features: int, rows: Shard, bias: bool) -> None:
        super().__init__(in_features, rows.size, bias=bias)
        self.tp_shards = {"weight": rows, "bias": rows}


class RowParallelLinear(nn.Linear):
    """The input columns `columns` of a [out, in] linear: its output is this rank's partial sum, which the model
    all-reduces. Ranks but 0 hold a zero bias (the loader reads none), so the sum adds it once."""

    def __init__(self, columns: Shard, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__(columns.size, out_features, bias=bias)
        self.tp_shards = {"weight": Shard(1, columns.start, columns.size, columns.total)}
        if bias and tp.rank:
            self.tp_shards["bias"] = Shard(0, 0, 0, out_features)


class VocabParallelEmbedding(nn.Embedding):
    """This rank's vocabulary rows: each rank looks up the ids it holds (zeros for the others) and the all-reduce
    puts every row together. At size 1 the plain lookup."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        rows, per_rank = tp.vocab_rows(vocab_size)
        # Uninitialised: the loader assigns the checkpoint's (init's normal_ would import torch's compiler stack)
        super().__init__(per_rank, hidden_size, _weight=torch.empty(per_rank, hidden_size))
        self.tp = tp
        self.vocab_start, self.vocab_end = rows.start, rows.start + rows.size
        self.tp_shards = {"weight": rows}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(input_ids)
        lookup = partial(F.embedding, weight=self.weight)
        return vocab_parallel_lookup(self.tp, input_ids, self.vocab_start, self.vocab_end, lookup)


def vocab_parallel_lookup(
    tp: TensorParallel, input_ids: torch.Tensor, start: int, end: int, lookup: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """Embedding rows of ids on ranks that each hold the vocabulary rows [start, end): each looks up its own
    (`lookup` of local row ids), zeros for the others, and the all-reduce puts every row together."""
    mine = (input_ids >= start) & (input_ids < end)
    rows = lookup((input_ids - start) * mine)
    return tp.all_reduce(rows.masked_fill_(~mine.unsqueeze(-1), 0))


class ParallelLMHead(nn.Linear):
    """The output layer's rows of this rank's vocabulary (zero rows pad the last shard); the model gathers the
    ranks' logits with `TensorParallel.gather_logits`."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallel) -> None:
        rows, per_rank = tp.vocab_rows(vocab_size)
        super().__init__(hidden_size, per_rank, bias=False)
        self.tp_shards = {"weight": rows}


def shard_of(model: nn.Module, name: str) -> Shard | None:
    """The part of checkpoint tensor `name` (a parameter's name) this rank holds; None: all of it."""
    module_name, _, param = name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return None
    return getattr(module, "tp_shards", {}).get(param)


def local_part(tensor: Any, shard: Shard | None, shape: tuple[int, ...]) -> torch.Tensor:
    """This rank's part of a checkpoint tensor (a torch tensor or a safetensors slice), zero-padded to the
    parameter's `shape` along the shard's dim: a tensor of its own (a view would keep the whole one alive)."""
    if shard is None:
        return tensor if isinstance(tensor, torch.Tensor) else tensor[:]
    part = shard.take(tensor)
    if isinstance(tensor, torch.Tensor):
        part = part.clone(memory_format=torch.contiguous_format)
    return pad_part(part, shard, shape)


def pad_part(part: torch.Tensor, shard: Shard, shape: tuple[int, ...]) -> torch.Tensor:
    """`part` with zeros after it along the shard's dim, up to the parameter's `shape`."""
    missing = shape[shard.dim] - part.shape[shard.dim]
    if missing <= 0:
        return part
    pad = list(part.shape)
    pad[shard.dim] = missing
    return torch.cat([part, part.new_zeros(pad)], dim=shard.dim)
