#!/usr/bin/env python3
"""Greedy-generation references for the family fixtures (run by hand, not in CI).

For each fixture under tests/fixtures/ that holds a checkpoint, transformers'
own `generate(do_sample=False)` with EOS ignored writes NEW_TOKENS tokens for
token-id prompts of mixed lengths (1 to 100, fewer where the model's positions
end sooner), in f32 on the checkpoint's weights (quantised ones exactly
dequantised, checked against the fixture's expected states first):

  tests/fixtures/NAME/greedy.json
      {"new_tokens": N, "prompts": [{"input_ids": [...], "output": [...],
        "min_gap": g, "max_diff": d}, ...], "transformers": ..., "torch": ...}

Each prompt is gated: at every generated position, the gap between the
largest and second-largest f32 logit must be at least GATE times the largest
difference between HF's f32 logits and its f64 logits of that position. A
prompt that fails is drawn again (the next seed), never cut, so a greedy
token the reference itself could flip by rounding is never asked of Strata.
`min_gap` is the smallest top-1/top-2 gap over the prompt's positions.

Requires: torch, transformers>=5, safetensors, compressed-tensors.

    python scripts/make_greedy_fixtures.py [--only NAME ...]
"""
import argparse
import json
import os
import re
import tempfile

import torch
import transformers
from safetensors.torch import load_file, save_file

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures")
NEW_TOKENS = 32
LENGTHS = [1, 5, 17, 42, 100]
GATE = 10.0
TRIES = 20


def tensors_of(d):
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors") and not f.startswith("expected"):
            out.update(load_file(os.path.join(d, f)))
    return out


def fp8_dequant(codes, scale_inv):
    out, inp = codes.shape
    s = scale_inv.float().repeat_interleave(128, 0)[:out].repeat_interleave(128, 1)[:, :inp]
    return codes.float() * s


def int4_dequant(packed, scale, shape, group):
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    out, inp = (int(x) for x in shape.tolist())
    vals = unpack_from_int32(packed, 4, torch.Size([out, inp])).float()
    return vals * scale.float().repeat_interleave(group, 1)[:, :inp]


def dense_dir(name, d, tmp):
    """A plain f32 checkpoint of fixture `d` in `tmp`: quantised weights dequantised exactly,
    a wrapper's text model only, model types transformers knows."""
    cfg = json.load(open(os.path.join(d, "config.json")))
    prefix = ""
    if cfg["model_type"] == "kimi_k25":
        cfg, prefix = cfg["text_config"], "language_model."
    quant = cfg.pop("quantization_config", None)
    if cfg["model_type"] == "kimi_k2":
        cfg["model_type"] = "deepseek_v3"
    cfg["architectures"] = [{"deepseek_v3": "DeepseekV3ForCausalLM", "minimax_m2": "MiniMaxM2ForCausalLM"}[cfg["model_type"]]]
    src = tensors_of(d)
    out = {}
    for k, v in src.items():
        if not k.startswith(prefix):
            continue
        k = k[len(prefix):]
        if k.endswith(("weight_scale_inv", "weight_scale", "weight_shape")):
            continue
        if k.endswith(".weight_packed"):
            base = k[: -len(".weight_packed")]
            group = quant["config_groups"]["group_0"]["weights"]["group_size"]
            out[base + ".weight"] = int4_dequant(v, src[prefix + base + ".weight_scale"],
                                                 src[prefix + base + ".weight_shape"], group)
        elif v.dtype == torch.float8_e4m3fn:
            out[k] = fp8_dequant(v, src[prefix + k + "_scale_inv"])
        else:
            out[k] = v.float()
    save_file(out, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    json.dump(cfg, open(os.path.join(tmp, "config.json"), "w"))
    return tmp


def load(src, dtype):
    cfg = json.load(open(os.path.join(src, "config.json")))
    cls = getattr(transformers, cfg["architectures"][0])
    kw = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    model = cls.from_pretrained(src, dtype=dtype, attn_implementation="eager", **kw).eval()
    return model


def text_config(model):
    return model.config.get_text_config()


def check_expected(model, d):
    """HF's f32 states of the fixture's first samples, as loaded here, against the fixture's own."""
    exp = load_file(os.path.join(d, "expected.safetensors"))
    with open(os.path.join(d, "data.jsonl")) as f:
        for i, line in enumerate(f):
            ids = torch.tensor(json.loads(line)["input_ids"])[None]
            with torch.no_grad():
                hs = model(input_ids=ids, output_hidden_states=True).hidden_states
            want = exp[f"sample{i}.hidden_states"][-1]
            err = (hs[-1][0] - want).abs().max().item()
            assert err < 1e-4 * max(1.0, want.abs().max().item()), f"{d} sample {i}: loaded model is {err} off"
            if i >= 1:
                break


def greedy(m32, m64, ids):
    """HF's greedy tokens and, per generated position, the top-1/top-2 gap of its f32 logits
    and its largest f32/f64 logit difference."""
    # EOS ignored: no eos_token_id anywhere generate looks (min_new_tokens would mask the
    # config's EOS id instead of ignoring it), and each token checked to be its logits' argmax.
    m32.generation_config.eos_token_id = None
    gc = transformers.GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS,
                                       eos_token_id=None, pad_token_id=0, bos_token_id=None,
                                       output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        res = m32.generate(input_ids=ids[None], generation_config=gc)
        seq = res.sequences[0]
        out = seq[len(ids):].tolist()
        assert len(out) == NEW_TOKENS, (len(out), NEW_TOKENS)
        l32 = torch.stack([l[0] for l in res.logits]).double()  # [N, V]
        l64 = m64(input_ids=seq[None, :-1]).logits[0, len(ids) - 1:].double()  # [N, V]
    assert out == l32.argmax(dim=-1).tolist(), "generate chose other tokens than its logits' argmax"
    top = l32.topk(2, dim=-1).values
    gaps = (top[:, 0] - top[:, 1])
    diffs = (l32 - l64).abs().max(dim=-1).values
    return out, gaps, diffs


def make(name):
    d = os.path.join(ROOT, name)
    cfg = json.load(open(os.path.join(d, "config.json")))
    quantised = "quantization_config" in cfg or "quantization_config" in cfg.get("text_config", {})
    with tempfile.TemporaryDirectory() as tmp:
        if name == "gpt-oss-mxfp4":
            src = os.path.join(ROOT, "gpt-oss")  # its dense twin, made by transformers' dequantiser
        elif quantised:
            src = dense_dir(name, d, tmp)
        else:
            src = d
        m32, m64 = load(src, torch.float32), load(src, torch.float64)
    check_expected(m32, d)
    tc = text_config(m32)
    vocab, max_pos = tc.vocab_size, tc.max_position_embeddings
    lengths = sorted({min(n, max_pos - NEW_TOKENS) for n in LENGTHS})
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    prompts = []
    for n in lengths:
        for attempt in range(TRIES):
            ids = torch.randint(0, vocab, (n,), generator=gen)
            out, gaps, diffs = greedy(m32, m64, ids)
            ratio = (gaps / diffs.clamp(min=1e-300)).min().item()
            if ratio >= GATE:
                break
            print(f"  {name} prompt of {n}: gap/diff {ratio:.2f} < {GATE}; drawing it again")
        else:
            raise SystemExit(f"{name}: no prompt of {n} tokens passed the gate in {TRIES} tries")
        prompts.append(dict(input_ids=ids.tolist(), output=out, min_gap=gaps.min().item(),
                            max_diff=diffs.max().item()))
    doc = dict(new_tokens=NEW_TOKENS, gate=GATE, prompts=prompts, transformers=transformers.__version__,
               torch=torch.__version__)
    with open(os.path.join(d, "greedy.json"), "w") as f:
        json.dump(doc, f)
        f.write("\n")
    print(f"{name}: {len(prompts)} prompts ({lengths}), min gap {min(p['min_gap'] for p in prompts):.4g}, "
          f"max f32/f64 diff {max(p['max_diff'] for p in prompts):.3g}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*")
    args = ap.parse_args()
    names = sorted(n for n in os.listdir(ROOT)
                   if os.path.exists(os.path.join(ROOT, n, "config.json"))
                   and any(re.match(r"model.*\.safetensors", f) for f in os.listdir(os.path.join(ROOT, n))))
    for name in names:
        if args.only and name not in args.only:
            continue
        make(name)


if __name__ == "__main__":
    main()
