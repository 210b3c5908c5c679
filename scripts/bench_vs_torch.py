#!/usr/bin/env python3
"""Strata's CPU extraction against PyTorch at its best on this machine.

Four checkpoints, written by the synth_checkpoint example (random weights):
  dense-f32   the `small` Llama (hidden 1024, 8 layers, 16/4 heads, MLP 2816, vocab 32000), f32
  dense-bf16  the same shape stored in bf16
  moe-f32     a Kimi-K2-shaped DeepSeek-V3 model (hidden 1024, 4 layers, MLA with K2's head
              sizes, 64 experts x 512, top-8, one shared expert), f32
  moe-bf16    the same stored in bf16
and 8 x 512 tokens (4 x 512 for the MoE model).

PyTorch: HF transformers' base model loaded with dtype="auto" (the checkpoint's dtype) and
attn_implementation="sdpa", torch.set_num_threads(THREADS), the whole batch in one forward
with output_hidden_states=True; the forward alone is timed.
Strata: the whole `strata extract` process (load, forward, capture of the EAGLE-3 layers,
write), with --compute f32 on the f32 checkpoint and --compute bf16 (and auto) on the bf16
ones. Medians of --runs runs each, PyTorch and Strata alternating.

    python scripts/bench_vs_torch.py [--runs 5] [--only dense-f32,moe-bf16]
Requires: torch, transformers, safetensors (not needed by CI).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import torch
from transformers import AutoModel

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
MODELS = {
    "dense-f32": (["--dtype", "f32", "--samples", "8"], ["f32"]),
    "dense-bf16": (["--dtype", "bf16", "--samples", "8"], ["bf16", "auto"]),
    "moe-f32": (["--dtype", "f32", "--moe", "--samples", "4"], ["f32"]),
    "moe-bf16": (["--dtype", "bf16", "--moe", "--samples", "4"], ["bf16", "auto"]),
}


def build():
    subprocess.run(["cargo", "build", "--release", "--bin", "strata", "--example", "synth_checkpoint"],
                   cwd=ROOT, check=True)


def checkpoint(name, base):
    d = os.path.join(base, name)
    if not os.path.exists(os.path.join(d, "tokens.jsonl")):
        subprocess.run([os.path.join(ROOT, "target/release/examples/synth_checkpoint"), d] + MODELS[name][0],
                       check=True)
    return d


def torch_forward(model, ids):
    t = time.perf_counter()
    with torch.inference_mode():
        model(input_ids=ids, output_hidden_states=True)
    return time.perf_counter() - t


def strata_run(d, compute, threads):
    out = tempfile.mkdtemp(prefix="strata-bench-")
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    t = time.perf_counter()
    subprocess.run([os.path.join(ROOT, "target/release/strata"), "extract", "--model", d, "--data",
                    os.path.join(d, "tokens.jsonl"), "--out", out, "--overwrite", "--compute", compute],
                   check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    secs = time.perf_counter() - t
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    shutil.rmtree(out)
    return secs, manifest.get("run", {})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/strata-bench-vs-torch")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default=",".join(MODELS))
    args = ap.parse_args()
    build()
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.only.split(","):
        d = checkpoint(name, args.dir)
        samples = [json.loads(l)["input_ids"] for l in open(os.path.join(d, "tokens.jsonl"))]
        ids = torch.tensor(samples)
        ntok = ids.numel()
        model = AutoModel.from_pretrained(d, dtype="auto", attn_implementation="sdpa").eval()
        dtype = str(next(model.parameters()).dtype).replace("torch.", "")
        torch_forward(model, ids[:, :64])  # warm-up
        computes = MODELS[name][1]
        tt, st = [], {c: [] for c in computes}
        run_info = {}
        for _ in range(args.runs):
            tt.append(torch_forward(model, ids))
            for c in computes:
                secs, run_info[c] = strata_run(d, c, args.threads)
                st[c].append(secs)
        del model
        pt = statistics.median(tt)
        for c in computes:
            s = statistics.median(st[c])
            info = run_info[c]
            rows.append((name, f"{ntok}", f"torch {dtype} sdpa", pt, f"strata --compute {c} ({info.get('compute')}, {info.get('kernel')})", s, pt / s))
            print(f"{name}: torch {pt:.2f} s, strata --compute {c} {s:.2f} s, ratio {pt / s:.2f}", flush=True)
    print()
    print(f"torch {torch.__version__}, {args.threads} threads, medians of {args.runs} runs")
    print("| model | tokens | PyTorch (forward only) | s | Strata (whole process) | s | ratio (>1: Strata faster) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.2f} | {r[4]} | {r[5]:.2f} | {r[6]:.2f}x |")


if __name__ == "__main__":
    main()
