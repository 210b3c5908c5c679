"""The PyTorch side of `cargo bench --bench generate`: transformers' greedy
`generate` on a checkpoint, timed.

The model is loaded as its users run it: AutoModelForCausalLM, dtype="auto"
(the checkpoint's dtype), attn_implementation="sdpa". Each batch of prompts
(all of one length: no padding) runs `generate(do_sample=False,
max_new_tokens=N, min_new_tokens=N)` with EOS ignored (eos_token_id=None),
once with each cache implementation (the dynamic default and "static"), a
warm-up first; `generate` alone is timed. Prints one JSON object: generated
tokens/s per cache implementation (medians over --runs).

    python scripts/bench_generate_torch.py MODEL PROMPTS.jsonl --batch 32 --new 128
"""

import argparse
import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("prompts")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = [json.loads(l)["input_ids"] for l in open(args.prompts) if l.strip()]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype="auto", attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    batches = [torch.tensor(prompts[i:i + args.batch]) for i in range(0, len(prompts), args.batch)]
    result = {"torch": torch.__version__, "dtype": str(next(model.parameters()).dtype).replace("torch.", "")}
    for cache in ["dynamic", "static"]:
        kw = {} if cache == "dynamic" else {"cache_implementation": "static"}

        def run():
            t = time.perf_counter()
            n = 0
            with torch.inference_mode():
                for ids in batches:
                    out = model.generate(ids, do_sample=False, max_new_tokens=args.new, min_new_tokens=args.new,
                                         attention_mask=torch.ones_like(ids), **kw)
                    n += (out.shape[1] - ids.shape[1]) * ids.shape[0]
            return n / (time.perf_counter() - t)

        with torch.inference_mode():
            model.generate(batches[0][:, :8], do_sample=False, max_new_tokens=4,
                           attention_mask=torch.ones_like(batches[0][:, :8]), **kw)
        result[cache] = statistics.median(run() for _ in range(args.runs))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
