"""The adapter registry: the adapters the engine knows by name, the ones read into host memory (LRU,
`max_cpu_loras`) and the ones in the model's device slots (LRU, `max_loras`).

The scheduler keeps a step's distinct adapters within `max_loras`, so `slots_for` can always seat them all:
a slot whose adapter this step does not use is given to one it does, read from host memory or, if it left
that too, from its directory again.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from inflight.config import ConfigError, EngineConfig
from inflight.errors import InvalidRequestError
from inflight.lora_request import stable_lora_id
from inflight.models import lora as lora_layers
from inflight.models.config import ModelConfig
from inflight.models.llama import LlamaForCausalLM
from inflight.models.lora import AdapterError, LoRAAdapter

logger = logging.getLogger(__name__)


@dataclass
class RegisteredAdapter:
    name: str
    path: str
    lora_id: int  # the id KV events carry (stable across replicas)
    cache_key: bytes  # keys prefix-cache blocks: a re-registered adapter never meets the old one's KV
    rank: int


class LoRAManager:
    def __init__(self, model: LlamaForCausalLM, model_config: ModelConfig, config: EngineConfig) -> None:
        if not all(hasattr(layer.mlp, "gate_up_proj") for layer in model.model.layers):  # experts take none
            raise ConfigError(
                f"enable_lora: LoRA adapters are not supported on {model_config.architecture} (a Mixture-of-Experts "
                "model); supported: models whose every MLP is dense"
            )
        self.model, self.model_config = model, model_config
        self.max_loras, self.max_rank = config.max_loras, config.max_lora_rank
        self.max_cpu_loras = config.max_cpu_loras or config.max_loras
        device = model.model.norm.weight.device
        lora_layers.attach_slots(model, self.max_loras, self.max_rank, device)
        self.adapters: dict[str, RegisteredAdapter] = {}
        self._host: OrderedDict[str, LoRAAdapter] = OrderedDict()  # LRU: the last used at the end
        self._slots: OrderedDict[str, int] = OrderedDict()  # resident adapter -> slot, LRU
        self._free = list(range(self.max_loras - 1, -1, -1))
        self._serial = 0
        self.num_slot_loads = 0  # adapters copied into a slot (a cold adapter's first step pays one)

    # ---- the registry ------------------------------------------------------------------------------

    def add(self, name: str, path: str, lora_id: int | None = None) -> RegisteredAdapter:
        """Read and check an adapter (AdapterError names it and why) and register it under `name`."""
        if not name or "\0" in name:
            raise AdapterError(f"LoRA adapter name {name!r} is invalid")
        if name in self.adapters:
            if self.adapters[name].path == str(path):
                return self.adapters[name]
            raise AdapterError(f"LoRA adapter {name!r} is already registered (from {self.adapters[name].path})")
        adapter = lora_layers.read_peft_adapter(name, path, self.model_config, self.max_rank)
        self._serial += 1
        key = f"{name}\0{path}\0{self._serial}".encode()
        lora_id = stable_lora_id(name) if lora_id is None else lora_id
        registered = RegisteredAdapter(name, str(path), lora_id, key, adapter.rank)
        self.adapters[name] = registered
        self._keep_in_host(adapter)
        logger.info("LoRA adapter %r: rank %d on %s (%s)", name, adapter.rank, ", ".join(adapter.target_modules), path)
        return registered

    def remove(self, name: str) -> None:
        """Forget an adapter (the caller checks no unfinished request uses it)."""
        self.adapters.pop(name)
        self._host.pop(name, None)
        slot = self._slots.pop(name, None)
        if slot is not None:
            lora_layers.install(self.model, slot, None)
            self._free.append(slot)

    def check_name(self, name: str) -> RegisteredAdapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            known = ", ".join(repr(n) for n in sorted(self.adapters)) or "none"
            raise InvalidRequestError(f"lora_name={name!r} is not a known LoRA adapter (known: {known})", "lora_name")
        return adapter

    # ---- a step's slots ------------------------------------------------------------------------------

    def slots_for(self, names: list[str | None]) -> list[int] | None:
        """Each scheduled sequence's slot (-1: the base model), seating the step's adapters; None when no
        sequence of the step uses one."""
        needed = {n for n in names if n is not None}
        if not needed:
            return None
        if len(needed) > self.max_loras:
            raise RuntimeError(f"{len(needed)} adapters in one step: the scheduler keeps it within {self.max_loras}")
        for name in needed:
            if name in self._slots:
                self._slots.move_to_end(name)
            else:
                self._seat(name, needed)
        return [self._slots[n] if n is not None else -1 for n in names]

    def _seat(self, name: str, needed: set[str]) -> None:
        if not self._free:
            victim = next(n for n in self._slots if n not in needed)  # LRU first
            self._free.append(self._slots.pop(victim))
        slot = self._free.pop()
        adapter = self._host.get(name)
        if adapter is None:
            t0 = time.perf_counter()
            info = self.adapters[name]
            adapter = lora_layers.read_peft_adapter(name, info.path, self.model_config, self.max_rank)
            logger.info("LoRA adapter %r read again in %.3f s", name, time.perf_counter() - t0)
        self._keep_in_host(adapter)
        with torch.inference_mode():
            lora_layers.install(self.model, slot, adapter)
        self._slots[name] = slot
        self.num_slot_loads += 1

    def _keep_in_host(self, adapter: LoRAAdapter) -> None:
        self._host[adapter.name] = adapter
        self._host.move_to_end(adapter.name)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

    @property
    def resident(self) -> list[str]:
        return list(self._slots)
