#!/usr/bin/env python3
"""PyTorch's own bf16 run of each parity fixture, for tests/accuracy.rs (run by hand, not in CI).

For every fixture of tests/common FIXTURES, GEMMA, GPT_OSS, LLAMA4, DEEPSEEK and HYBRID, loads the checkpoint with HF
transformers in bf16 with sdpa attention (as a user runs a bf16 model on the CPU), runs
the fixture's data.jsonl and writes

  tests/fixtures/NAME/expected_bf16.safetensors
      sample{i}.hidden_states   [N+1, T, H]   HF output_hidden_states, bf16 values as f32
      sample{i}.final_pre_norm  [T, H]        input of model.norm

the same layout as expected.safetensors (HF in f32). The test checks that Strata's
bf16 compute is at least as close to the f32 reference as this run is.

It also writes tests/fixtures/bench-small/ (the benches' `small` Llama shape, stored in
bf16, whose weights the test regenerates with strata-testkit): one 32-token sample, the
HF f32 reference and the HF bf16 run.

    python scripts/make_bf16_reference.py [--only NAME ...]
Requires: torch, transformers>=5, safetensors; cargo (for the bench-small weights).
"""
import argparse
import json
import os
import shutil
import subprocess
import tempfile

import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoModel

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
FIXTURES = ["llama-default", "llama-gqa-sharded", "mistral-swa", "qwen2-swa", "qwen3", "qwen3-moe", "mixtral", "glm4-moe", "minimax-m2",
            "gemma3-text", "gemma3", "gpt-oss", "gpt-oss-mxfp4", "llama4-text", "llama4", "deepseek-v3", "deepseek-v3-nolora", "deepseek-v2-lite", "deepseek-v2-group",
            "qwen3-next", "qwen3_5-moe"]


def run(model, samples):
    """HF's hidden states and final-norm inputs of each sample, as f32."""
    # A multimodal wrapper (gemma3's Gemma3Model) runs its text model alone;
    # Llama 4's wrapper holds a whole causal LM there.
    model = getattr(model, "language_model", model)
    model = model.model if hasattr(model, "lm_head") else model
    captured = {}
    hook = model.norm.register_forward_pre_hook(lambda mod, args: captured.__setitem__("pre", args[0].detach().clone()))
    out = {}
    for i, ids in enumerate(samples):
        with torch.inference_mode():
            res = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        out[f"sample{i}.hidden_states"] = torch.stack([h[0] for h in res.hidden_states]).float().contiguous()
        out[f"sample{i}.final_pre_norm"] = captured["pre"][0].float().contiguous()
    hook.remove()
    return out


def bf16_run(d, samples, out_path):
    attn = "sdpa"
    try:
        model = AutoModel.from_pretrained(d, dtype=torch.bfloat16, attn_implementation=attn).eval()
    except ValueError as e:
        # gpt-oss has no sdpa path (its sinks): eager is what transformers runs it with on the CPU.
        print(f"  {os.path.basename(d)}: {e}; attn_implementation='eager'")
        attn = "eager"
        model = AutoModel.from_pretrained(d, dtype=torch.bfloat16, attn_implementation=attn).eval()
    experts = getattr(model.config, "_experts_implementation", None)
    try:
        states = run(model, samples)
    except RuntimeError as e:
        # grouped_mm wants 16-byte strides, which the tiny fixtures' expert widths are not.
        print(f"  {os.path.basename(d)}: {e}; experts_implementation='eager'")
        model = AutoModel.from_pretrained(d, dtype=torch.bfloat16, attn_implementation=attn,
                                          experts_implementation="eager").eval()
        experts = "eager"
        states = run(model, samples)
    save_file(states, out_path, metadata={"transformers": transformers.__version__, "torch": torch.__version__,
                                          "dtype": "bfloat16", "attn_implementation": attn,
                                          "experts_implementation": str(experts)})


def read_samples(d):
    return [json.loads(l)["input_ids"] for l in open(os.path.join(d, "data.jsonl"))]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", help="fixtures to rerun (the bench model only without --only)")
    args = ap.parse_args()
    torch.manual_seed(0)
    fixtures = os.path.join(ROOT, "tests", "fixtures")
    for name in FIXTURES:
        if args.only and name not in args.only:
            continue
        d = os.path.join(fixtures, name)
        bf16_run(d, read_samples(d), os.path.join(d, "expected_bf16.safetensors"))
        print(f"{name}: expected_bf16.safetensors")
    if args.only:
        return

    # The bench model: weights from the synth_checkpoint example (what the test regenerates).
    out = os.path.join(fixtures, "bench-small")
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["cargo", "run", "--release", "--example", "synth_checkpoint", "--", tmp,
                        "--dtype", "bf16", "--samples", "1"], cwd=ROOT, check=True)
        shutil.copy(os.path.join(tmp, "config.json"), os.path.join(out, "config.json"))
        ids = [json.loads(l)["input_ids"][:32] for l in open(os.path.join(tmp, "tokens.jsonl"))]
        with open(os.path.join(out, "data.jsonl"), "w") as f:
            f.write(json.dumps({"input_ids": ids[0]}) + "\n")
        f32 = AutoModel.from_pretrained(tmp, dtype=torch.float32, attn_implementation="sdpa").eval()
        save_file(run(f32, ids), os.path.join(out, "expected.safetensors"),
                  metadata={"transformers": transformers.__version__, "torch": torch.__version__})
        del f32
        bf16_run(tmp, ids, os.path.join(out, "expected_bf16.safetensors"))
    print("bench-small: config.json, data.jsonl, expected.safetensors, expected_bf16.safetensors")


if __name__ == "__main__":
    main()
