#!/usr/bin/env python3
"""Generate the quantised-checkpoint parity fixtures under tests/fixtures/ (by hand, not in CI).

Each fixture is a tiny random DeepSeek-V3-style checkpoint stored the way the
real ones are, plus the hidden states HF transformers computes in f32 on the
exactly dequantised weights (same files as scripts/make_fixtures.py writes):

  deepseek-v3-fp8        FP8 E4M3 blocks of 128x128 with f32 `weight_scale_inv` on every
                         linear layer (not embeddings, norms, router, lm_head), as DeepSeek-V3
                         and Kimi-K2 ship; no dimension a multiple of 128 (partial edge blocks).
  kimi-k2-fp8-sharded    model_type kimi_k2, FP8 as above, split over several safetensors files.
  kimi-k2-int4           compressed-tensors pack-quantized INT4 routed experts (group 32,
                         symmetric, bf16 scales; written by the `compressed-tensors` package),
                         everything else bf16, as Kimi-K2-Thinking ships. (compressed-tensors
                         needs inputs in whole groups; at --tp 2 a rank's down_proj slice of
                         48 inputs starts inside a group.)
  minimax-m2-fp8         MiniMax-M2 (a Llama-family mixture) as it ships: FP8 E4M3 blocks of
                         128x128 on attention and experts, bf16 router, norms and correction
                         bias (`modules_to_not_convert`), the hub's top-level keys.
  kimi-k25-wrapper       Kimi-K2.5's multimodal wrapper: model_type kimi_k25, the text config
                         under text_config with its own quantization_config, the language model
                         under language_model.*, and vision_tower.* / mm_projector.* tensors
                         (one shard holds only vision tensors).

Requires: torch, transformers>=5, safetensors, compressed-tensors.

    python scripts/make_quant_fixtures.py [--out tests/fixtures] [--only NAME ...]
"""
import json
import os
import re
import shutil
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, MiniMaxM2Config, MiniMaxM2ForCausalLM
import compressed_tensors
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

sys.path.insert(0, os.path.dirname(__file__))
from make_fixtures import build, cli, hub_rotary_dim, randomize, to_legacy, write_expected  # noqa: E402

FP8_MAX = 448.0
BLOCK = 128
GROUP = 32

BASE = dict(num_attention_heads=4, num_key_value_heads=4, n_group=2, topk_group=1, norm_topk_prob=True,
            routed_scaling_factor=2.5, max_position_embeddings=512, rope_interleave=True,
            rope_parameters=dict(rope_type="yarn", rope_theta=50000.0, factor=4.0, original_max_position_embeddings=16,
                                 beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0))

FIXTURES = {
    "deepseek-v3-fp8": dict(
        quant="fp8", model_type="deepseek_v3", shard=None, wrapper=False,
        cfg=dict(hidden_size=200, num_hidden_layers=3, intermediate_size=272, moe_intermediate_size=136,
                 n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                 q_lora_rank=160, kv_lora_rank=132, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
                 vocab_size=140)),
    "kimi-k2-fp8-sharded": dict(
        quant="fp8", model_type="kimi_k2", shard=200_000, wrapper=False,
        cfg=dict(hidden_size=144, num_hidden_layers=2, intermediate_size=160, moe_intermediate_size=40,
                 n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                 q_lora_rank=136, kv_lora_rank=48, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=12,
                 vocab_size=120)),
    "kimi-k2-int4": dict(
        quant="int4", model_type="kimi_k2", shard=None, wrapper=False,
        cfg=dict(hidden_size=96, num_hidden_layers=3, intermediate_size=160, moe_intermediate_size=96,
                 n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                 q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=12,
                 vocab_size=130)),
    "kimi-k25-wrapper": dict(
        quant="int4", model_type="kimi_k2", shard=150_000, wrapper=True,
        cfg=dict(hidden_size=128, num_hidden_layers=2, intermediate_size=192, moe_intermediate_size=64,
                 n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                 q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                 vocab_size=110)),
    # Sizes not multiples of 128: partial edge blocks in every direction, two blocks along hidden.
    "minimax-m2-fp8": dict(
        quant="fp8", family="llama", cls=(MiniMaxM2Config, MiniMaxM2ForCausalLM), router_scale=4.0, rotary_dim_key=True,
        linear=re.compile(r"\.(self_attn\.[qkvo]_proj|block_sparse_moe\.experts\.\d+\.w[123])\.weight$"),
        not_converted=["gate", "e_score_correction_bias", "lm_head"],
        cfg=dict(hidden_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=48,
                 intermediate_size=72, num_local_experts=4, num_experts_per_tok=2, vocab_size=120,
                 max_position_embeddings=512, rotary_dim=24, bos_token_id=None, eos_token_id=None,
                 rope_parameters=dict(rope_type="default", rope_theta=5000000.0))),
}

FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}

# Kimi-K2.5's: every Linear in groups of 32, except attention, shared experts and dense MLPs.
INT4_CONFIG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP,
                    "dynamic": False, "observer": "minmax", "actorder": None, "block_structure": None}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:vision_tower.*", "re:mm_projector.*"],
}

LINEAR = re.compile(r"\.(self_attn\.(q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)|"
                    r"mlp\.(experts\.\d+\.|shared_experts\.)?(gate|up|down)_proj)\.weight$")
ROUTED = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def fp8_quantize(w):
    """Block scales s = amax/448 (f32); codes = e4m3(w / s). Returns (codes, s, exact f32 dequantisation)."""
    out, inp = w.shape
    br, bc = -(-out // BLOCK), -(-inp // BLOCK)
    padded = torch.zeros(br * BLOCK, bc * BLOCK)
    padded[:out, :inp] = w
    blocks = padded.view(br, BLOCK, bc, BLOCK)
    s = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12).float()
    full = s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:out, :inp]
    codes = (w / full).to(torch.float8_e4m3fn)
    return codes, s, codes.float() * full


def int4_quantize(w):
    """Group scales amax/7 (bf16), packed by compressed-tensors; the reference is its own
    decompression with the scales widened to f32 (exact: q * s fits an f32)."""
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP))
    out, inp = w.shape
    groups = -(-inp // GROUP)
    padded = torch.zeros(out, groups * GROUP)
    padded[:, :inp] = w
    scale = (padded.view(out, groups, GROUP).abs().amax(dim=2) / 7.0).clamp(min=1e-8).to(torch.bfloat16)
    comp = PackedQuantizationCompressor.compress({"weight": w.to(torch.bfloat16), "weight_scale": scale}, scheme)
    back = PackedQuantizationCompressor.decompress(
        {"weight_packed": comp["weight_packed"], "weight_scale": scale.float(), "weight_shape": comp["weight_shape"]},
        scheme)["weight"].float()
    return comp, back


def save_sharded(tensors, out, shard):
    """model.safetensors, or shards of about `shard` bytes plus an index."""
    if not shard:
        save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        return
    files, cur, size = [], {}, 0
    for name in sorted(tensors):
        t = tensors[name]
        if cur and size + t.numel() * t.element_size() > shard:
            files.append(cur)
            cur, size = {}, 0
        cur[name] = t
        size += t.numel() * t.element_size()
    files.append(cur)
    weight_map = {}
    for i, part in enumerate(files):
        fname = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        save_file(part, os.path.join(out, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)


def make_llama_family(name, spec, out_root, seed):
    """A Llama-family checkpoint with FP8 blocks on `spec["linear"]`'s weights, everything else
    bf16; the reference is HF in f32 on the exactly dequantised weights."""
    out, cfg, model_cls, model, gen = build(name, spec, out_root, seed)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)  # hub names
        sd = load_file(os.path.join(tmp, "model.safetensors"))
        with open(os.path.join(tmp, "config.json")) as f:
            config = json.load(f)
    stored, exact = {}, {}
    for k, w in sd.items():
        w = w.float()
        if spec["linear"].search(k):
            codes, s, back = fp8_quantize(w)
            stored[k], stored[k.replace(".weight", ".weight_scale_inv")] = codes, s
            exact[k] = back
        else:
            stored[k] = w.to(torch.bfloat16)
            exact[k] = stored[k].float()
    save_sharded(stored, out, None)
    # As MiniMax-M2's hub file: torch's name for the format, and the modules left in bf16.
    config["quantization_config"] = {**FP8_CONFIG, "fmt": "float8_e4m3fn", "modules_to_not_convert": spec["not_converted"]}
    config.pop("dtype", None)
    config["torch_dtype"] = "bfloat16"
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    to_legacy(os.path.join(out, "config.json"))
    if spec.get("rotary_dim_key"):
        hub_rotary_dim(os.path.join(out, "config.json"))

    with tempfile.TemporaryDirectory() as tmp:
        save_file(exact, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        cfg.save_pretrained(tmp)
        ref = model_cls.from_pretrained(tmp, dtype=torch.float32).eval()
        ref.config._attn_implementation = "eager"
        # Every weight loaded exactly: saved again under hub names, it is `exact`.
        again = os.path.join(tmp, "again")
        ref.save_pretrained(again)
        back = load_file(os.path.join(again, "model.safetensors"))
    for k, v in exact.items():
        assert torch.equal(back[k].float(), v), f"{k} did not load exactly"
    write_expected(ref, cfg, out, gen)
    size = sum(os.path.getsize(os.path.join(out, x)) for x in os.listdir(out))
    print(f"{name}: {size / 1024:.0f} KiB, {len([k for k in stored if 'weight_scale' in k])} quantised weights")


def make(name, spec, out_root, seed):
    if spec.get("family") == "llama":
        return make_llama_family(name, spec, out_root, seed)
    out = os.path.join(out_root, name)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    cfg = DeepseekV3Config(**BASE, **spec["cfg"])
    cfg._attn_implementation = "eager"
    gen = torch.Generator().manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg).eval()
    randomize(model, gen)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)  # the checkpoint's own tensor names (one tensor per expert)
        sd = load_file(os.path.join(tmp, "model.safetensors"))

    stored, exact = {}, {}
    for k, w in sd.items():
        w = w.float()
        if spec["quant"] == "fp8" and LINEAR.search(k):
            codes, s, back = fp8_quantize(w)
            stored[k], stored[k.replace(".weight", ".weight_scale_inv")] = codes, s
            exact[k] = back
        elif spec["quant"] == "int4" and ROUTED.search(k):
            comp, back = int4_quantize(w)
            base = k[: -len(".weight")]
            for part in ("weight_packed", "weight_scale", "weight_shape"):
                stored[f"{base}.{part}"] = comp[part]
            exact[k] = back
        else:
            stored[k] = w.to(torch.bfloat16)  # unquantised tensors ship in bf16
            exact[k] = stored[k].float()

    text_cfg = json.loads(cfg.to_json_string(use_diff=False))
    for drop in ("_attn_implementation_autoset", "transformers_version", "dtype", "torch_dtype"):
        text_cfg.pop(drop, None)
    text_cfg["model_type"] = spec["model_type"]
    text_cfg["quantization_config"] = FP8_CONFIG if spec["quant"] == "fp8" else INT4_CONFIG
    text_cfg["torch_dtype"] = "bfloat16"
    if spec["wrapper"]:
        stored = {("language_model." + k): v for k, v in stored.items()}
        vis = torch.Generator().manual_seed(seed + 1)
        for i in range(2):
            stored[f"vision_tower.blocks.{i}.attn.qkv.weight"] = torch.randn(96, 32, generator=vis).to(torch.bfloat16)
            stored[f"vision_tower.blocks.{i}.norm0.weight"] = torch.ones(32, dtype=torch.bfloat16)
        stored["mm_projector.proj.0.weight"] = torch.randn(cfg.hidden_size, 32, generator=vis).to(torch.bfloat16)
        config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
                  "text_config": text_cfg,
                  "vision_config": {"model_type": "moonvit", "hidden_size": 32, "num_hidden_layers": 2},
                  "media_placeholder_token_id": cfg.vocab_size - 1}
    else:
        text_cfg["architectures"] = ["DeepseekV3ForCausalLM"]
        config = text_cfg
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    if spec["wrapper"]:
        # Vision tensors in a shard of their own, which extraction never opens, plus one beside text weights.
        vision = {k: v for k, v in stored.items() if k.startswith("vision_tower.blocks.0")}
        rest = {k: v for k, v in stored.items() if k not in vision}
        save_sharded(rest, out, spec["shard"])
        index_path = os.path.join(out, "model.safetensors.index.json")
        with open(index_path) as f:
            index = json.load(f)
        save_file(vision, os.path.join(out, "vision-00001.safetensors"), metadata={"format": "pt"})
        index["weight_map"].update({k: "vision-00001.safetensors" for k in vision})
        with open(index_path, "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    else:
        save_sharded(stored, out, spec["shard"])

    # Reference: HF in f32 on the exactly dequantised weights.
    ref = DeepseekV3ForCausalLM(cfg).eval()
    with tempfile.TemporaryDirectory() as tmp:
        save_file(exact, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        cfg.save_pretrained(tmp)
        ref = DeepseekV3ForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    ref.config._attn_implementation = "eager"
    # Every weight must load exactly; transformers fuses the routed experts into 3-D tensors.
    loaded = ref.state_dict()
    for k, v in exact.items():
        m = re.match(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", k)
        if m:
            base, e, which = m.group(1), int(m.group(2)), m.group(3)
            if which == "down":
                got = loaded[f"{base}.down_proj"][e]
            else:
                half = loaded[f"{base}.gate_up_proj"][e].shape[0] // 2
                got = loaded[f"{base}.gate_up_proj"][e][:half] if which == "gate" else \
                    loaded[f"{base}.gate_up_proj"][e][half:]
        elif k in loaded:
            got = loaded[k]
        else:
            continue  # lm_head is not part of the hidden states
        assert torch.equal(got, v), f"{k} did not load exactly"
    write_expected(ref, cfg, out, gen, compressed_tensors=compressed_tensors.__version__)
    size = sum(os.path.getsize(os.path.join(out, x)) for x in os.listdir(out))
    print(f"{name}: {size / 1024:.0f} KiB, {len([k for k in stored if 'weight_scale' in k])} quantised weights")


def main():
    cli(__doc__, FIXTURES, make, 2000)


if __name__ == "__main__":
    main()
