#!/usr/bin/env python3
"""Strata's CPU forward against PyTorch on the same checkpoint and tokens.

Writes the random `small` Llama (hidden 1024, 8 layers, 16/4 heads, MLP 2816,
vocab 32000, f32) and 4 x 512 tokens with the synth_checkpoint example, times
HF transformers' base model on it (no LM head, f32, eager attention,
torch.set_num_threads(2)), runs the criterion bench on the same directory,
and prints tokens/s of both and the ratio. Medians throughout.

    python scripts/bench_vs_torch.py [--dir /tmp/strata-bench-small] [--runs 7]
Requires: torch, transformers, safetensors (not needed by CI).
"""
import argparse
import json
import os
import statistics
import subprocess
import time

import torch
from transformers import LlamaModel

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/strata-bench-small")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    if not os.path.exists(os.path.join(args.dir, "tokens.jsonl")):
        subprocess.run(["cargo", "run", "--release", "--example", "synth_checkpoint", "--", args.dir],
                       cwd=ROOT, check=True)
    samples = [json.loads(l)["input_ids"] for l in open(os.path.join(args.dir, "tokens.jsonl"))]
    assert len({len(s) for s in samples}) == 1, "equal lengths: torch runs them as one unpadded batch"
    ntok = sum(len(s) for s in samples)

    torch.set_num_threads(args.threads)
    model = LlamaModel.from_pretrained(args.dir, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.tensor(samples)
    times = []
    with torch.inference_mode():
        model(input_ids=ids[:, :64])  # warm-up
        for _ in range(args.runs):
            t = time.perf_counter()
            model(input_ids=ids, output_hidden_states=True)
            times.append(time.perf_counter() - t)
    torch_tps = ntok / statistics.median(times)

    env = dict(os.environ, STRATA_BENCH_MODEL=args.dir)
    subprocess.run(["cargo", "bench", "--bench", "forward", "--", "--noplot"], cwd=ROOT, env=env, check=True)
    est = json.load(open(os.path.join(ROOT, "target/criterion/forward/small_4x512_f32/new/estimates.json")))
    strata_tps = ntok / (est["median"]["point_estimate"] / 1e9)

    print(f"tokens per forward: {ntok} ({len(samples)} x {len(samples[0])}), threads: {args.threads}")
    print(f"pytorch {torch.__version__}: {torch_tps:8.1f} tokens/s (median of {args.runs})")
    print(f"strata:          {strata_tps:8.1f} tokens/s (criterion median)")
    print(f"ratio strata/pytorch: {strata_tps / torch_tps:.2f}")


if __name__ == "__main__":
    main()
