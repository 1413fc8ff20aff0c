"""`inflight-client "prompt"`: stream text from the server to the terminal as it is generated.

The text goes to stdout as it arrives; a one-line summary (TTFT, tokens, tokens/s) goes to stderr.
Ctrl-C cancels the request on the server.
"""

from __future__ import annotations

import argparse
import sys

from inflight_client.stream import Completion, InferenceError, LLMClient


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="inflight-client", description=__doc__.splitlines()[0])
    p.add_argument("prompt")
    p.add_argument("--url", default="localhost:8001", help="the server's gRPC address (default: %(default)s)")
    p.add_argument("--model", default="llm", help="model name in the repository (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (server default: 1.0)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens tokens")
    p.add_argument("--no-stream", action="store_true", help="one response with the whole text")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for each response")
    return p.parse_args(argv)


def sampling_parameters(args: argparse.Namespace) -> dict:
    params = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": args.stop,
        "ignore_eos": True if args.ignore_eos else None,
    }
    return {k: v for k, v in params.items() if v is not None}


def summary(c: Completion) -> str:
    ttft = f"{c.ttft_s * 1000:.0f} ms" if c.ttft_s is not None else "-"
    return (
        f"[TTFT {ttft} | {c.num_output_tokens} tokens in {c.e2e_s:.2f} s | {c.tokens_per_s:.1f} tokens/s"
        f" | finish: {c.finish_reason}]"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    client = LLMClient(args.url, args.model, timeout_s=args.timeout)
    try:
        stream = client.stream(args.prompt, sampling_parameters(args), stream=not args.no_stream)
    except InferenceError as e:
        print(f"inflight-client: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # connection refused and the like
        print(f"inflight-client: cannot reach {args.url}: {e}", file=sys.stderr)
        return 1
    wrote = False
    try:
        for delta in stream:
            sys.stdout.write(delta.text)
            sys.stdout.flush()
            wrote = True
    except KeyboardInterrupt:
        stream.cancel()
        stream.collect()
        print(file=sys.stdout)
        print(summary(stream.completion), file=sys.stderr)
        return 130
    except InferenceError as e:
        if wrote:
            print(file=sys.stdout)
        print(f"inflight-client: {e}", file=sys.stderr)
        return 1
    print(file=sys.stdout)
    print(summary(stream.completion), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
