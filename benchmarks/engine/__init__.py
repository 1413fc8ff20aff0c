"""Offline engine benchmarks: batching policies A/B, prefix caching, structured outputs, input prepare,
the decode step against its floors, torch.compile."""
