"""Mixture-of-Experts decoders: Qwen2-MoE (with its gated shared expert), Qwen3-MoE, Mixtral and OLMoE.

Attention is the Llama family's; the MLP is a router over E SwiGLU experts whose weights are stacked into
one tensor each (`FusedExperts`), run by the backend's `fused_moe` op: a grouped GEMM on CPU, vLLM's
fused-MoE kernel shape on GPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from inflight.config import ConfigError
from inflight.models.config import ModelConfig
from inflight.models.llama import MLP, LlamaForCausalLM, StepMetadata


class Router(nn.Module):
    """The router's linear over the experts (HF's `gate`, no bias), its weight kept as it is: `pack_linears` leaves
    it, so that the backend's routing op (`select_experts`) can read it alongside the softmax and top-k."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class FusedExperts(nn.Module):
    """E experts' SwiGLU MLPs stacked: `w13` [E, 2I, H] (each expert's gate rows, then its up rows) and `w2`
    [E, H, I] (its down projection). `cpu_packed` is a backend's own layout of both, made once (ops/cpu.py)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        e, h, i = num_experts, hidden_size, intermediate_size
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, h, i), requires_grad=False)
        self.cpu_packed: Any = None


@dataclass(frozen=True)
class MoEConfig:
    """What an MoE family's config.json adds to the Llama fields."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool  # the top-k weights rescaled to sum 1 (Mixtral always; Qwen and OLMoE by `norm_topk_prob`)
    shared_expert_intermediate_size: int  # Qwen2-MoE's shared expert (0: none)
    sparse_layers: tuple[bool, ...]  # per layer: experts (True) or a dense MLP of the model's intermediate size

    @classmethod
    def from_model_config(cls, cfg: ModelConfig) -> MoEConfig:
        hf, arch = cfg.hf_config, cfg.architecture
        experts = hf.get("num_experts") or hf.get("num_local_experts")
        top_k = hf.get("num_experts_per_tok")
        if not experts or not top_k or top_k > experts:
            raise ConfigError(
                f"{arch}: num_experts={experts} and num_experts_per_tok={top_k} must be set, with top-k <= experts"
            )
        if hf.get("clip_qkv") is not None:
            raise ConfigError(f"{arch}: clip_qkv={hf['clip_qkv']} is not supported")
        step, dense = hf.get("decoder_sparse_step", 1) or 1, set(hf.get("mlp_only_layers") or ())
        layers = cfg.num_hidden_layers
        return cls(
            num_experts=int(experts),
            top_k=int(top_k),
            intermediate_size=int(hf.get("moe_intermediate_size") or cfg.intermediate_size),
            renormalize=arch == "MixtralForCausalLM" or bool(hf.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
            sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(layers)),
        )


class SparseMoeBlock(nn.Module):
    """The router (`gate`, HF's name) over the experts; Qwen2-MoE adds a shared expert scaled by a sigmoid gate."""

    def __init__(self, cfg: ModelConfig, moe: MoEConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.gate = Router(h, moe.num_experts)
        self.experts = FusedExperts(moe.num_experts, h, moe.intermediate_size)
        self.shared_expert: MLP | None = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg, moe.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)

    def fuse(self) -> None:
        if self.shared_expert is not None:
            self.shared_expert.fuse()

    def forward(self, x: torch.Tensor, meta: StepMetadata, ops: Any) -> torch.Tensor:
        topk_weights, topk_ids = ops.select_experts(x, self.gate, self.top_k, self.renormalize)
        out = ops.fused_moe(x, self.experts, topk_weights, topk_ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, meta, ops)
        return out


class MoEForCausalLM(LlamaForCausalLM):
    """Qwen2-MoE, Qwen3-MoE, Mixtral and OLMoE: the Llama decoder with `SparseMoeBlock`s for MLPs (a Qwen
    config may keep some layers dense)."""

    supports_tensor_parallel = False  # the experts are not split across ranks yet

    @staticmethod
    def make_mlp(cfg: ModelConfig, layer: int) -> nn.Module:
        moe = MoEConfig.from_model_config(cfg)
        return SparseMoeBlock(cfg, moe) if moe.sparse_layers[layer] else MLP(cfg)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """Mixtral's checkpoint names as the other families': block_sparse_moe -> mlp, w1/w3/w2 -> gate/up/down."""
        if ".block_sparse_moe." not in name:
            return name
        name = name.replace(".block_sparse_moe.", ".mlp.")
        return _MIXTRAL_EXPERT.sub(lambda m: f".{_MIXTRAL_PROJ[m.group(1)]}.", name)


_MIXTRAL_EXPERT = re.compile(r"\.(w1|w2|w3)\.(?=weight$)")
_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# One expert's projection in a checkpoint: layer prefix, expert, projection
EXPERT_TENSOR = re.compile(r"^(model\.layers\.\d+\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class ExpertStacker:
    """Gathers a checkpoint's per-expert tensors into each layer's stacked `w13` and `w2` as they are read."""

    def __init__(self, model: MoEForCausalLM, dtype: torch.dtype, device: torch.device) -> None:
        self.shapes = {
            name.removesuffix(".experts.w13"): (p.shape, model.get_parameter(name.replace("w13", "w2")).shape)
            for name, p in model.named_parameters()
            if name.endswith(".experts.w13")
        }
        self.dtype, self.device = dtype, device
        self.stacked: dict[str, torch.Tensor] = {}
        self.seen: dict[str, set[tuple[int, str]]] = {}

    def take(self, name: str, tensor: torch.Tensor) -> bool:
        """Copy `tensor` into its stack if it is one expert's projection; False for any other tensor."""
        m = EXPERT_TENSOR.match(name)
        if m is None or m.group(1) not in self.shapes:
            return False
        prefix, expert, proj = m.group(1), int(m.group(2)), m.group(3)
        (e, two_i, h), w2_shape = self.shapes[prefix]
        if expert >= e:
            raise ConfigError(f"{name}: expert {expert} but the config has {e} experts")
        key = f"{prefix}.experts.{'w2' if proj == 'down_proj' else 'w13'}"
        if key not in self.stacked:
            shape = w2_shape if proj == "down_proj" else (e, two_i, h)
            self.stacked[key] = torch.empty(shape, dtype=self.dtype, device=self.device)
        dest = self.stacked[key][expert]
        if proj != "down_proj":
            half = two_i // 2
            dest = dest[:half] if proj == "gate_proj" else dest[half:]
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ConfigError(f"{name}: shape {tuple(tensor.shape)}, the config implies {tuple(dest.shape)}")
        dest.copy_(tensor)
        self.seen.setdefault(prefix, set()).add((expert, proj))
        return True

    def finish(self) -> dict[str, torch.Tensor]:
        """The stacked tensors by parameter name, once every expert's three projections were read."""
        for prefix, ((e, _, _), _) in self.shapes.items():
            got = self.seen.get(prefix, set())
            missing = [(x, p) for x in range(e) for p in ("gate_proj", "up_proj", "down_proj") if (x, p) not in got]
            if missing:
                x, p = missing[0]
                raise ConfigError(f"checkpoint lacks {prefix}.experts.{x}.{p}.weight (+{len(missing) - 1} more)")
        return self.stacked
