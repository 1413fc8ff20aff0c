"""Offline engine benchmarks: batching policies A/B, prefix caching, structured outputs, prepare, decode step, torch.compile."""
