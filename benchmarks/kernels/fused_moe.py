"""The fused-MoE Triton kernel (`inflight.ops.triton.fused_moe`) against a per-expert loop of torch matmuls
(`reference.fused_moe`), on CUDA.

    python -m benchmarks.kernels.fused_moe
    python -m benchmarks.kernels.fused_moe --models qwen3_30b_a3b --tokens 1 64 2048 --dtype float16
    python -m benchmarks.kernels.fused_moe --sweep      # also time candidate block sizes per model
    python -m benchmarks.kernels.fused_moe --smoke      # tiny shapes under TRITON_INTERPRET=1: checks the script

Per model shape (E experts of hidden H and intermediate I, top-k) and token count T: T tokens routed by a
random router, one layer, the median time of each path (triton.testing.do_bench), their ratio, and the
weight bandwidth of the fused kernel (bytes of the experts the step touches over its time). Both outputs are
checked against each other first. With --sweep, every candidate config is timed at every T and the one with
the best geometric mean over T is printed as a `fused_moe.CONFIGS` entry: one config serves every T, which
keeps a row's result independent of its batch.
"""

from __future__ import annotations

import argparse
import math
import os
import time

# (experts, top-k, hidden, intermediate) of real MoE layers (unsharded).
MODELS = {
    "qwen3_30b_a3b": (128, 8, 2048, 768),
    "olmoe_1b_7b": (64, 8, 2048, 1024),
    "mixtral_8x7b": (8, 2, 4096, 14336),
}
SMOKE_MODELS = {"smoke": (8, 2, 64, 32)}


def candidate_configs():
    from inflight.ops.triton.fused_moe import MoEKernelConfig

    for block_m in (16, 32, 64, 128):
        for block_n in (64, 128, 256):
            for block_k in (64, 128):
                for num_warps in (4, 8):
                    for num_stages in (3, 4):
                        yield MoEKernelConfig(block_m, block_n, block_k, 8, num_warps, num_stages)


def make_experts(torch, model: tuple[int, int, int, int], dtype, device):
    experts, _, hidden, inter = model
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen, device=device) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen, device=device) / inter**0.5).to(dtype)
    return w13, w2


def make_tokens(torch, model: tuple[int, int, int, int], tokens: int, dtype, device):
    """x [T, H] and a random router's (topk_weights, topk_ids) for it."""
    from inflight.ops import reference

    experts, top_k, hidden, _ = model
    gen = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen, device=device).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen, device=device)
    return (x, *reference.select_experts(logits, top_k, renormalize=True))


def touched_bytes(topk_ids, w13, w2) -> int:
    """The expert weights a step reads at least once."""
    used = topk_ids.unique().numel()
    return used * (w13[0].numel() + w2[0].numel()) * w13.element_size()


def make_timer(smoke: bool):
    if smoke:

        def once(fn):  # the interpreter's time means nothing; run once to exercise the code path
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3

        return once
    from triton.testing import do_bench

    return lambda fn: do_bench(fn, warmup=10, rep=50)


def bench(torch, models: dict, tokens: list[int], dtype, device, timer) -> None:
    """One table row per (model, T): both paths checked equal, then timed."""
    from inflight.ops import reference
    from inflight.ops.triton.fused_moe import fused_moe, get_config

    head = f"{'model':<16}{'E':>5}{'k':>3}{'H':>6}{'I':>7}{'T':>6}"
    head += f"{'fused ms':>10}{'loop ms':>10}{'speedup':>9}{'GB/s':>8}"
    print(head)
    print("-" * len(head))
    for name, model in models.items():
        experts, top_k, hidden, inter = model
        config = get_config(experts, inter, dtype, device)
        w13, w2 = make_experts(torch, model, dtype, device)
        for t in tokens:
            x, weights, ids = make_tokens(torch, model, t, dtype, device)
            got = fused_moe(x, w13, w2, weights, ids)
            want = reference.fused_moe(x, w13, w2, weights, ids)
            tol = 1e-4 if dtype == torch.float32 else 3e-2
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
            t_fused = timer(lambda x=x, w13=w13, w2=w2, weights=weights, ids=ids: fused_moe(x, w13, w2, weights, ids))
            t_loop = timer(
                lambda x=x, w13=w13, w2=w2, weights=weights, ids=ids: reference.fused_moe(x, w13, w2, weights, ids)
            )
            gbps = touched_bytes(ids, w13, w2) / (t_fused * 1e-3) / 1e9
            print(
                f"{name:<16}{experts:>5}{top_k:>3}{hidden:>6}{inter:>7}{t:>6}{t_fused:>10.3f}{t_loop:>10.3f}"
                f"{t_loop / t_fused:>8.2f}x{gbps:>8.0f}",
                flush=True,
            )
        print(f"{name}: config {config}")


def geomean_ratio(times: list[float], best: list[float]) -> float:
    return math.exp(sum(math.log(t / b) for t, b in zip(times, best)) / len(times))


def time_configs(torch, model, tokens: list[int], dtype, device, timer, candidates: list) -> dict:
    """config -> its time at each T, for the candidates this device can launch."""
    from inflight.ops.triton.fused_moe import fused_moe

    w13, w2 = make_experts(torch, model, dtype, device)
    steps = [make_tokens(torch, model, t, dtype, device) for t in tokens]
    times = {}
    for config in candidates:
        try:
            times[config] = [timer(lambda s=s, c=config: fused_moe(s[0], w13, w2, s[1], s[2], c)) for s in steps]
        except Exception as exc:  # e.g. more shared memory than the device has: not a candidate here
            print(f"{config} skipped ({type(exc).__name__})")
    return times


def sweep(torch, models: dict, tokens: list[int], dtype, device, timer, candidates: list) -> None:
    """Times every candidate config at every T; prints the one with the best geometric mean over T."""
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    for name, model in models.items():
        times = time_configs(torch, model, tokens, dtype, device, timer, candidates)
        best_per_t = [min(ts[i] for ts in times.values()) for i in range(len(tokens))]
        best = min(times, key=lambda c, times=times, b=best_per_t: geomean_ratio(times[c], b))
        for t, ms, b in zip(tokens, times[best], best_per_t):
            print(f"{name} T={t}: {ms:.3f} ms ({ms / b:.2f}x the best config at this T)")
        print(f'    ({model[0]}, {model[3]}, "{device_name}"): {best},')


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 4096])
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--sweep", action="store_true", help="also time candidate block sizes per model")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes under TRITON_INTERPRET=1 on a CPU")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available() and not args.smoke:
        print("benchmarks.kernels.fused_moe times GPU kernels and needs a CUDA device; none is visible here.")
        print("Run it on a GPU machine, or pass --smoke to check the script on a CPU.")
        return
    if args.smoke and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
        models, tokens, dtype, device = SMOKE_MODELS, [1, 5], torch.float16, torch.device("cpu")
        print("cpu (interpreter; timings meaningless)")
    else:
        models, tokens = {m: MODELS[m] for m in args.models}, args.tokens
        dtype, device = getattr(torch, args.dtype), torch.device("cuda")
        print(f"device: {torch.cuda.get_device_name(device)}   dtype: {args.dtype}")
    timer = make_timer(args.smoke)
    bench(torch, models, tokens, dtype, device, timer)
    if args.sweep:
        candidates = list(candidate_configs())
        sweep(torch, models, tokens, dtype, device, timer, candidates[:2] if args.smoke else candidates)


if __name__ == "__main__":
    main()
