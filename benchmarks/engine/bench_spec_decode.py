"""Speculative decoding (n-gram prompt lookup) on and off, on the real default model, greedy, side by side.

    python -m benchmarks.engine.bench_spec_decode                    # SmolLM2-135M-Instruct, k = 4
    python -m benchmarks.engine.bench_spec_decode --model demo --max-tokens 32 --repeats 1   # a smoke run

Two traces of chat requests: input-grounded (repeat, correct or edit a passage given in the prompt: text
the drafts can copy) and free (stories: nothing to copy). Each runs at 1 request in flight (time per output
token, the ITL a user sees) and at 8 (output tok/s), with speculation off and on in turns; the outputs must
be identical token for token. Targets (issue 25): grounded TPOT >= 2x lower at 1 in flight and >= 1.4x the
throughput at 8; free <= 3% slower. One JSON line per cell and a summary in benchmarks/results/spec_decode.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from inflight import LLM, SamplingParams
from inflight.serving.openai.checkpoint import Checkpoint

PASSAGE = (
    "The river runs through the old town, past the mill and the market square, where traders sell bread, "
    "cheese and apples every Saturday morning. In winter the water freezes near the bridge, and children "
    "skate there until the bells of the church call them home for supper."
)
CODE = (
    "def total_price(items, tax):\n    total = 0\n    for item in items:\n        total += item.price * item.count\n"
    "    total = total * (1 + tax)\n    return round(total, 2)\n"
)
GROUNDED = [
    f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    f"Correct the spelling in this text and return it in full:\n\n{PASSAGE.replace('the', 'teh', 3)}",
    f"Rename the variable `total` to `amount` in this code and return the whole function:\n\n{CODE}",
    f"Copy this paragraph, then add one sentence at the end:\n\n{PASSAGE}",
]
FREE = [
    "Write a short story about a dragon who learns to bake.",
    "Tell me about your favourite season and why.",
    "Invent a new board game and explain its rules.",
    "Describe a day in the life of a lighthouse keeper.",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="rounds of off / on per cell (best of)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/spec_decode.json"))
    return p.parse_args(argv)


def run(llm: LLM, prompts: list[str], in_flight: int, max_tokens: int) -> tuple[float, int, list]:
    """Seconds, output tokens and outputs of the prompts, `in_flight` at a time (closed loop)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    t0 = time.perf_counter()
    outputs = []
    for i in range(0, len(prompts), in_flight):
        outputs += llm.generate(prompts[i : i + in_flight], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return seconds, sum(len(o.token_ids) for o in outputs), [o.token_ids for o in outputs]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_max": args.prompt_lookup_max,
        "prompt_lookup_min": args.prompt_lookup_min,
    }
    engines = {
        "off": LLM(args.model, dtype=args.dtype, max_num_seqs=8),
        "on": LLM(args.model, dtype=args.dtype, max_num_seqs=8, speculative_config=spec),
    }
    checkpoint = Checkpoint.resolve(args.model)
    rows, summary = [], {}
    for trace, texts in (("grounded", GROUNDED), ("free", FREE)):
        prompts = [chat_prompt(checkpoint, engines["off"], t) for t in texts] * 2  # 8 requests
        for in_flight in (1, 8):
            best: dict[str, tuple] = {}
            for _ in range(args.repeats):
                for mode, llm in engines.items():  # in turns
                    before = dict(llm.engine.spec_decode_counters)
                    seconds, tokens, outs = run(llm, prompts, in_flight, args.max_tokens)
                    after = dict(llm.engine.spec_decode_counters)
                    if mode not in best or seconds < best[mode][0]:
                        best[mode] = (seconds, tokens, outs, before, after)
            identical = best["off"][2] == best["on"][2]
            cell = {"trace": trace, "in_flight": in_flight, "identical": identical}
            for mode, (seconds, tokens, _, before, after) in best.items():
                cell[mode] = {"seconds": round(seconds, 3), "tokens": tokens, "tok_per_s": round(tokens / seconds, 1),
                              "tpot_ms": round(1000 * seconds * in_flight / tokens, 2)}  # fmt: skip
                if mode == "on":
                    drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
                    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
                    cell[mode]["acceptance"] = round(accepted / drafted, 3) if drafted else None
            cell["speedup"] = round(cell["on"]["tok_per_s"] / cell["off"]["tok_per_s"], 3)
            rows.append(cell)
            print(json.dumps(cell), flush=True)
            summary[f"{trace}@{in_flight}"] = cell["speedup"]
    result = {"settings": vars(args) | {"out": str(args.out)}, "rows": rows, "speedup": summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(summary))
    return result


def chat_prompt(checkpoint: Checkpoint, llm: LLM, text: str) -> str:
    """The request as the chat API sends it: the model's chat template applied, when it has one."""
    if checkpoint.template is None:
        return text
    return checkpoint.chat_prompt([{"role": "user", "content": text}], add_generation_prompt=True)


if __name__ == "__main__":
    main()
