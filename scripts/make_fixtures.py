#!/usr/bin/env python3
"""Generate the HF-parity fixtures under tests/fixtures/ (run by hand, not in CI).

Each fixture is a tiny random-weight checkpoint written by transformers'
save_pretrained, plus the hidden states HF computes for a few samples:

  tests/fixtures/NAME/config.json, model.safetensors (or shards + index)
  tests/fixtures/NAME/data.jsonl        one {"input_ids": [...]} per line
  tests/fixtures/NAME/expected.safetensors
      sample{i}.hidden_states   [N+1, T, H]  HF output_hidden_states, f32
      sample{i}.final_pre_norm  [T, H]       input of model.norm (hook)

Weights are random with non-trivial norms and biases (HF's ones and zeros
hide norm and bias bugs). Checkpoints saved in bf16/f16 are run by HF in f32
on exactly the rounded weights. Requires: torch, transformers>=5, safetensors.

    python scripts/make_fixtures.py [--out tests/fixtures]
"""
import argparse
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file
import transformers
from transformers import (Gemma3Config, Gemma3ForCausalLM, Gemma3ForConditionalGeneration, Gemma3TextConfig,
                          GptOssConfig, GptOssForCausalLM, Llama4Config, Llama4ForCausalLM, Llama4ForConditionalGeneration,
                          Llama4TextConfig, Mxfp4Config, SiglipVisionConfig)
from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM, Glm4MoeConfig,
                          Glm4MoeForCausalLM, LlamaConfig, LlamaForCausalLM, MiniMaxM2Config, MiniMaxM2ForCausalLM, MistralConfig,
                          MistralForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM, Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

LENGTHS = [1, 6, 19, 40]

FIXTURES = {
    # The embedded default model of `strata extract`: 8 layers so eagle3 picks distinct layers.
    "llama-default": dict(
        cls=(LlamaConfig, LlamaForCausalLM), dtype=torch.bfloat16, shard=None, legacy=False,
        cfg=dict(hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=256, max_position_embeddings=256, rms_norm_eps=1e-5,
                 rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                                      high_freq_factor=4.0, original_max_position_embeddings=16))),
    # GQA 8:2, q/k/v/o and MLP biases, linear RoPE scaling, sharded weights, legacy config keys.
    "llama-gqa-sharded": dict(
        cls=(LlamaConfig, LlamaForCausalLM), dtype=torch.float32, shard="60KB", legacy=True,
        cfg=dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                 intermediate_size=96, vocab_size=300, max_position_embeddings=64, rms_norm_eps=1e-6,
                 attention_bias=True, mlp_bias=True,
                 rope_parameters=dict(rope_type="linear", rope_theta=500.0, factor=2.0))),
    # Non-power-of-two sizes (hidden 96, head_dim 24) and a window shorter than the longest sample.
    "mistral-swa": dict(
        cls=(MistralConfig, MistralForCausalLM), dtype=torch.float32, shard=None, legacy=False,
        cfg=dict(hidden_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                 intermediate_size=160, vocab_size=200, sliding_window=5, max_position_embeddings=512,
                 rope_parameters=dict(rope_type="default", rope_theta=1000.0))),
    # q/k/v bias, sliding window on layers >= max_window_layers, f16 weights.
    "qwen2-swa": dict(
        cls=(Qwen2Config, Qwen2ForCausalLM), dtype=torch.float16, shard=None, legacy=False,
        cfg=dict(hidden_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=80, vocab_size=180, use_sliding_window=True, sliding_window=6,
                 max_window_layers=1, max_position_embeddings=512,
                 rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0))),
    # q/k RMSNorm, head_dim (32) != hidden/heads (20), tied embeddings.
    "qwen3": dict(
        cls=(Qwen3Config, Qwen3ForCausalLM), dtype=torch.float32, shard=None, legacy=False,
        cfg=dict(hidden_size=80, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 intermediate_size=112, vocab_size=220, tie_word_embeddings=True, max_position_embeddings=512,
                 rope_parameters=dict(rope_type="default", rope_theta=1000000.0))),
    # DeepSeek-V3 (MLA + MoE): q_lora, yarn with mscale, sigmoid routing with group limits and
    # e_score_correction_bias, a shared expert, one dense first layer; no size a multiple of 128.
    "deepseek-v3": dict(
        cls=(DeepseekV3Config, DeepseekV3ForCausalLM), dtype=torch.float32, shard=None, legacy=False,
        cfg=dict(hidden_size=72, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                 intermediate_size=100, moe_intermediate_size=20, n_routed_experts=8, n_shared_experts=1,
                 num_experts_per_tok=3, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
                 norm_topk_prob=True, q_lora_rank=40, kv_lora_rank=24, qk_nope_head_dim=10, qk_rope_head_dim=6,
                 v_head_dim=14, vocab_size=150, max_position_embeddings=512,
                 rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                      original_max_position_embeddings=16, beta_fast=32, beta_slow=1,
                                      mscale=1.0, mscale_all_dim=1.0))),
    # DeepSeek-V3 without q_lora (as V2-Lite), plain RoPE, no top-k normalisation.
    "deepseek-v3-nolora": dict(
        cls=(DeepseekV3Config, DeepseekV3ForCausalLM), dtype=torch.float32, shard=None, legacy=False,
        cfg=dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                 intermediate_size=64, moe_intermediate_size=12, n_routed_experts=6, n_shared_experts=2,
                 num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=0, routed_scaling_factor=1.0,
                 norm_topk_prob=False, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                 v_head_dim=8, vocab_size=120, max_position_embeddings=512,
                 rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    # (HF runs experts with grouped_mm, which wants widths in multiples of 4 floats.)
    # DeepSeek-V2 (as V2-Lite): no q_lora, softmax scoring, greedy top-k, two shared experts.
    "deepseek-v2-lite": dict(
        cls=(DeepseekV2Config, DeepseekV2ForCausalLM), dtype=torch.float32, shard=None, legacy=False,
        cfg=dict(hidden_size=56, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
                 intermediate_size=72, moe_intermediate_size=12, n_routed_experts=6, n_shared_experts=2,
                 num_experts_per_tok=2, topk_method="greedy", first_k_dense_replace=1, routed_scaling_factor=1.0,
                 norm_topk_prob=False, q_lora_rank=None, kv_lora_rank=20, qk_nope_head_dim=10, qk_rope_head_dim=6,
                 v_head_dim=10, vocab_size=130, max_position_embeddings=512,
                 rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    # DeepSeek-V2: q_lora, group-limited greedy routing, YaRN, routed scaling.
    "deepseek-v2-group": dict(
        cls=(DeepseekV2Config, DeepseekV2ForCausalLM), dtype=torch.float32, shard=None, legacy=False,
        cfg=dict(hidden_size=40, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                 intermediate_size=60, moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=1,
                 num_experts_per_tok=2, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                 first_k_dense_replace=0, routed_scaling_factor=16.0, norm_topk_prob=False, q_lora_rank=20,
                 kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=6, vocab_size=110,
                 max_position_embeddings=512,
                 rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                      original_max_position_embeddings=16, beta_fast=32, beta_slow=1,
                                      mscale=0.707, mscale_all_dim=0.707))),
    # Qwen3-MoE: Qwen3's q/k norm, softmax top-2 of 6 experts renormalised (as Qwen3-30B-A3B),
    # a dense middle layer (`mlp_only_layers`), head_dim (16) != hidden/heads.
    "qwen3-moe": dict(
        cls=(Qwen3MoeConfig, Qwen3MoeForCausalLM), dtype=torch.float32, shard=None, legacy=False, router_scale=4.0,
        cfg=dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=96, moe_intermediate_size=24, num_experts=6, num_experts_per_tok=2,
                 norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], vocab_size=160,
                 max_position_embeddings=512, rope_parameters=dict(rope_type="default", rope_theta=1000000.0))),
    # Mixtral: Mistral's attention with a window shorter than the longest sample, top-2 of 4
    # experts (`block_sparse_moe.experts.{j}.w1/w2/w3`), bf16 weights.
    "mixtral": dict(
        cls=(MixtralConfig, MixtralForCausalLM), dtype=torch.bfloat16, shard=None, legacy=True, router_scale=4.0,
        cfg=dict(hidden_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=40, num_local_experts=4, num_experts_per_tok=2, sliding_window=7,
                 vocab_size=140, max_position_embeddings=512,
                 rope_parameters=dict(rope_type="default", rope_theta=1000000.0))),
    # GLM-4.5: RoPE on half of each head (head_dim 24: 12 columns, 6 frequencies), q/k/v bias
    # without an o bias, DeepSeek-V3's sigmoid router (2 groups, 1 kept, correction bias,
    # routed scaling), two shared experts, a dense first layer, hub-style top-level keys, and a
    # multi-token-prediction layer stored past the last one (as GLM-4.5's layer 92) that is never run.
    # use_qk_norm is false, as GLM-4.5/4.6 ship; the per-head q/k norm it turns on is Qwen3's
    # (the qwen3 and qwen3-moe fixtures).
    "glm4-moe": dict(
        cls=(Glm4MoeConfig, Glm4MoeForCausalLM), dtype=torch.bfloat16, shard=None, legacy=True, router_scale=4.0,
        mtp_layer=True,
        cfg=dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                 intermediate_size=96, moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=2,
                 num_experts_per_tok=3, n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                 norm_topk_prob=True, attention_bias=True, use_qk_norm=False, num_nextn_predict_layers=1,
                 vocab_size=150, max_position_embeddings=512,
                 rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))),
    # MiniMax-M2: q/k RMSNorm over all heads at once ([heads·head_dim] weights), RoPE on the
    # first `rotary_dim` (8 of 16) columns from the hub's legacy key, a sigmoid router whose
    # correction bias only chooses (top-2 of 6, renormalised), Mixtral's expert names.
    "minimax-m2": dict(
        cls=(MiniMaxM2Config, MiniMaxM2ForCausalLM), dtype=torch.float32, shard=None, legacy=True, router_scale=4.0,
        rotary_dim_key=True,
        cfg=dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=32, num_local_experts=6, num_experts_per_tok=2, vocab_size=150,
                 max_position_embeddings=512, rotary_dim=8, bos_token_id=None, eos_token_id=None,
                 rope_parameters=dict(rope_type="default", rope_theta=5000000.0))),
    # Gemma 3 text (gemma3_text, as Gemma-3-1B): sandwich (1 + w) norms, per-head q/k norms,
    # GELU-tanh MLP, scores scaled by query_pre_attn_scalar (20, not head_dim 24), embeddings
    # scaled by sqrt(72) (8.485, 8.5 in bf16), local layers with a 5-token window and their own
    # RoPE base (100) alternating with global ones (base 10000, linear factor 2), q/k/v/o biases;
    # the hub's legacy keys (rope_local_base_freq, sliding_window_pattern, rope_scaling).
    "gemma3-text": dict(
        cls=(Gemma3TextConfig, Gemma3ForCausalLM), dtype=torch.float32, shard=None, legacy=False,
        gemma_legacy=True,
        cfg=dict(hidden_size=72, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                 intermediate_size=96, vocab_size=200, max_position_embeddings=512, sliding_window=5,
                 sliding_window_pattern=2, query_pre_attn_scalar=20, attention_bias=True,
                 rope_parameters=dict(full_attention=dict(rope_type="linear", factor=2.0, rope_theta=10000.0),
                                      sliding_attention=dict(rope_type="default", rope_theta=100.0)))),
    # Gemma 3 in its multimodal wrapper (gemma3, as Gemma-3-4B/12B/27B): the text model under
    # `language_model.model.*` beside a vision tower Strata does not read, bf16 weights,
    # transformers 5's layer_types and per-type rope_parameters.
    "gemma3": dict(
        cls=(Gemma3Config, Gemma3ForConditionalGeneration), dtype=torch.bfloat16, shard=None, legacy=False,
        cfg=dict(text_config=dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=16, intermediate_size=80, vocab_size=180, max_position_embeddings=512,
                                  sliding_window=6, query_pre_attn_scalar=16,
                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                  rope_parameters=dict(
                                      full_attention=dict(rope_type="linear", factor=4.0, rope_theta=1000000.0),
                                      sliding_attention=dict(rope_type="default", rope_theta=10000.0))),
                 vision_config=dict(hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=2,
                                    image_size=28, patch_size=14),
                 mm_tokens_per_image=4)),
    # gpt-oss: attention sinks, q/k/v/o biases, sliding (7) and full layers, YaRN with
    # truncate=false (a fractional correction range on head_dim 16), a router with a bias, fused
    # interleaved gate_up experts with biases and a clamped GLU whose limit (1.0) the gates cross.
    # Written twice (make_gpt_oss): `gpt-oss-mxfp4`, the experts in MXFP4 blocks as the hub ships
    # them, and `gpt-oss`, its dense twin made by transformers' own dequantiser; both are checked
    # against HF run on the twin.
    "gpt-oss": dict(
        cls=(GptOssConfig, GptOssForCausalLM), dtype=torch.bfloat16, shard=None, legacy=False, router_scale=4.0,
        maker="gpt_oss",
        cfg=dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, vocab_size=160,
                 max_position_embeddings=256, sliding_window=7, swiglu_limit=1.0,
                 layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                 pad_token_id=None, eos_token_id=None, bos_token_id=None,
                 rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0,
                                      beta_slow=1.0, truncate=False, original_max_position_embeddings=64))),
    # Llama 4 text (llama4_text, as Scout's text model): every layer a mixture of experts, a shared
    # expert plus top-2 of 4 routed ones, each routed expert's INPUT scaled by the sigmoid of its
    # router logit; RoPE on complex pairs with llama3 scaling on layers 0-2, which attend within
    # chunks of 8 positions (every sample but the shortest crosses chunks) and norm q and k without
    # weights after RoPE; layer 3 is NoPE, attends to every position and scales q by its temperature
    # (floor_scale 4, so it changes every 4 positions). The hub's keys: rope_theta/rope_scaling, no
    # layer_types (HF derives it from no_rope_layers and attention_chunk_size).
    "llama4-text": dict(
        cls=(Llama4TextConfig, Llama4ForCausalLM), dtype=torch.float32, shard=None, legacy=True, router_scale=4.0,
        min_router_gap=0.1, drop_keys=["layer_types"],
        cfg=dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=32, intermediate_size_mlp=96, num_local_experts=4, num_experts_per_tok=2,
                 vocab_size=200, max_position_embeddings=256, attention_chunk_size=8, floor_scale=4, attn_scale=0.1,
                 use_qk_norm=True, pad_token_id=None, bos_token_id=None, eos_token_id=None,
                 rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                                      high_freq_factor=4.0, original_max_position_embeddings=16))),
    # Llama 4 in its multimodal wrapper (llama4, as Maverick): the text model under
    # `language_model.model.*` beside a vision model Strata does not read, bf16 weights, dense
    # layers (intermediate_size_mlp) alternating with MoE ones (interleave_moe_layer_step 2, top-1
    # of 4), no q/k norm, NoPE layers 1 and 3 from an explicit no_rope_layers, chunks of 12,
    # temperature with floor_scale 8 and attn_scale 0.2; transformers 5's keys (layer_types,
    # rope_parameters).
    "llama4": dict(
        cls=(Llama4Config, Llama4ForConditionalGeneration), dtype=torch.bfloat16, shard=None, legacy=False,
        router_scale=4.0, min_router_gap=0.1,
        cfg=dict(text_config=dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=16, intermediate_size=32, intermediate_size_mlp=96, num_local_experts=4,
                                  num_experts_per_tok=1, interleave_moe_layer_step=2, no_rope_layers=[1, 0, 1, 0],
                                  use_qk_norm=False, attention_chunk_size=12, floor_scale=8, attn_scale=0.2,
                                  vocab_size=180, max_position_embeddings=256, pad_token_id=None,
                                  rope_parameters=dict(rope_type="default", rope_theta=1000.0)),
                 vision_config=dict(hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=2,
                                    image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
                                    projector_output_dim=32))),
    # Qwen3-Next (Gated DeltaNet hybrid): layers 2 and 5 gated full attention (q with an output
    # gate, zero-centred q/k norms, RoPE on a quarter of head_dim 32), the others Gated DeltaNet
    # with grouped `in_proj_qkvz`/`in_proj_ba`, 2 key heads serving 4 value heads, k_dim 64 !=
    # v_dim 32; top-2 of 6 experts with a sigmoid-gated shared expert, layer 1 dense. Decays slow
    # enough that state carries across 64-position chunks; samples of 64, 65 and 150 tokens cross
    # them. The hub's keys: rope_theta, partial_rotary_factor and full_attention_interval at top
    # level, no layer_types; a multi-token-prediction tensor (`mtp.*`) that must be skipped.
    "qwen3-next": dict(
        cls=(Qwen3NextConfig, Qwen3NextForCausalLM), dtype=torch.float32, shard=None, legacy=True, router_scale=4.0,
        lengths=[1, 7, 64, 65, 150], drop_keys=["layer_types"], set_keys=dict(full_attention_interval=3),
        mtp_tensor=True, expected_f64=True,
        cfg=dict(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 intermediate_size=96, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                 linear_value_head_dim=32, linear_conv_kernel_dim=4, num_experts=6, num_experts_per_tok=2,
                 moe_intermediate_size=24, shared_expert_intermediate_size=32, decoder_sparse_step=1,
                 mlp_only_layers=[1], norm_topk_prob=True, vocab_size=160, max_position_embeddings=512,
                 full_attention_interval=3,
                 rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25))),
    # Qwen3.5-MoE in its multimodal wrapper (qwen3_5_moe, as the hub ships it): the text model under
    # `model.language_model.*` beside a vision tower Strata does not read, bf16 weights, split
    # `in_proj_qkv`/`in_proj_z`/`in_proj_b`/`in_proj_a`, experts fused as the hub stores them
    # (`mlp.experts.gate_up_proj [E, 2·inter, hidden]`, `down_proj [E, hidden, inter]`), MRoPE
    # sections (1-D on text), transformers 5's keys (layer_types, rope_parameters).
    "qwen3_5-moe": dict(
        cls=(Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration), dtype=torch.bfloat16, shard=None, legacy=False,
        router_scale=4.0, lengths=[1, 7, 64, 65, 150], fuse_experts=True, expected_f64=True,
        cfg=dict(text_config=dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                                  linear_key_head_dim=48, linear_value_head_dim=48, linear_conv_kernel_dim=4,
                                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                  shared_expert_intermediate_size=32, vocab_size=180, max_position_embeddings=512,
                                  layer_types=["linear_attention", "linear_attention", "linear_attention",
                                               "full_attention"],
                                  rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                       partial_rotary_factor=0.25, mrope_section=[2, 1, 1],
                                                       mrope_interleaved=True)),
                 vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=40, out_hidden_size=64))),
}

# transformers' FP4_VALUES: the E2M1 value of each 4-bit code.
FP4 = [+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def mxfp4_quantize(w):
    """`w` [E, out, in] to the hub's MXFP4 tensors: blocks u8 [E, out, in/32, 16] (two codes per
    byte, low nibble first) and E8M0 scales u8 [E, out, in/32] (2^(s-127), the smallest that
    keeps each block within +-6), codes the nearest E2M1 value."""
    e, o, i = w.shape
    g = w.float().reshape(e, o, i // 32, 32)
    amax = g.abs().amax(-1).clamp(min=1e-30)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = g / torch.exp2(exp)[..., None]
    idx = (scaled[..., None] - torch.tensor(FP4)).abs().argmin(-1).to(torch.uint8)
    blocks = (idx[..., 0::2] | (idx[..., 1::2] << 4)).to(torch.uint8).contiguous()
    return blocks, (exp + 127).to(torch.uint8).contiguous()


def make_gpt_oss(name, spec, out_root, seed):
    """OUT/NAME-mxfp4 (experts as MXFP4 blocks, config quant_method mxfp4) and OUT/NAME, the
    dense twin transformers' Mxfp4Config(dequantize=True) makes of it; HF in f32 on the twin
    gives both their expected states."""
    out, cfg, model_cls, model, gen = build(name, spec, out_root, seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("mlp.router.weight"):
                p.mul_(spec["router_scale"])
            elif pname.endswith("self_attn.sinks"):
                p.copy_(1.5 * torch.randn(p.shape, generator=gen))  # sinks that take a real share
    model = model.to(spec["dtype"])
    qdir = out + "-mxfp4"
    shutil.rmtree(qdir, ignore_errors=True)
    model.save_pretrained(qdir)
    path = os.path.join(qdir, "model.safetensors")
    tensors = load_file(path)
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        # [E, in, out] as the module holds it; the hub stores [E, out, in] blocks.
        blocks, scales = mxfp4_quantize(tensors.pop(key).transpose(1, 2))
        tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
    save_file(tensors, path, metadata={"format": "pt"})
    cpath = os.path.join(qdir, "config.json")
    with open(cpath) as f:
        c = json.load(f)
    # As the hub's files: only the experts are converted.
    c["quantization_config"] = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                           "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}
    with open(cpath, "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)
    to_legacy(cpath)  # the hub's rope_theta and rope_scaling keys
    # The twin: transformers' dequantiser, on the CPU, saved with hub names.
    twin = model_cls.from_pretrained(qdir, quantization_config=Mxfp4Config(dequantize=True), dtype=spec["dtype"],
                                     device_map="cpu")
    twin.save_pretrained(out)
    cpath = os.path.join(out, "config.json")
    with open(cpath) as f:
        c = json.load(f)
    c.pop("quantization_config", None)  # the twin's weights are plain bf16
    with open(cpath, "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)
    for d in (out, qdir):
        p = os.path.join(d, "generation_config.json")
        if os.path.exists(p):
            os.remove(p)
    ref = model_cls.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    write_expected(ref, ref.config, out, gen, twin="transformers Mxfp4Config(dequantize=True) of gpt-oss-mxfp4")
    for f in ("data.jsonl", "expected.safetensors"):
        shutil.copy(os.path.join(out, f), os.path.join(qdir, f))
    for d in (out, qdir):
        size = sum(os.path.getsize(os.path.join(d, x)) for x in os.listdir(d))
        print(f"{os.path.basename(d)}: {size / 1024:.0f} KiB")


def randomize(model, gen):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                # Decays e^(-A·softplus(a + dt_bias)) near 1, so state carries across chunks.
                p.copy_(torch.empty(p.shape).uniform_(0.01, 0.5, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) - 2.0)
            elif "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def to_legacy(cfg_path):
    """Rewrite transformers-5 `rope_parameters` into the hub's older top-level keys."""
    with open(cfg_path) as f:
        cfg = json.load(f)
    rp = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rp.pop("rope_theta")
    if "partial_rotary_factor" in rp:
        cfg["partial_rotary_factor"] = rp.pop("partial_rotary_factor")
    cfg["rope_scaling"] = None if rp.get("rope_type") == "default" else rp
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


def add_mtp_layer(out, cfg, gen):
    """Append the tensors of a multi-token-prediction layer, `model.layers.{N}`, as GLM-4.5 and
    DeepSeek-V3 store it past the decoder's last layer (HF skips it on load; so must Strata)."""
    path = os.path.join(out, "model.safetensors")
    tensors = load_file(path)
    n, h = cfg.num_hidden_layers, cfg.hidden_size
    tensors[f"model.layers.{n}.eh_proj.weight"] = torch.randn((h, 2 * h), generator=gen).to(torch.bfloat16)
    tensors[f"model.layers.{n}.enorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    tensors[f"model.layers.{n}.hnorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    save_file(tensors, path, metadata={"format": "pt"})


def gemma_legacy(cfg_path, pattern):
    """Gemma 3's hub keys before transformers 5: `rope_theta` and `rope_scaling` for the global
    layers, `rope_local_base_freq` for the local ones, `sliding_window_pattern` for layer_types."""
    with open(cfg_path) as f:
        c = json.load(f)
    rp = c.pop("rope_parameters")
    full, local = dict(rp["full_attention"]), rp["sliding_attention"]
    c["rope_theta"] = full.pop("rope_theta")
    c["rope_local_base_freq"] = local["rope_theta"]
    c["rope_scaling"] = None if full.get("rope_type") == "default" else full
    types = c.pop("layer_types")
    assert types == ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(len(types))]
    c.pop("_sliding_window_pattern", None)
    c["sliding_window_pattern"] = pattern
    with open(cfg_path, "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)


def hub_rotary_dim(cfg_path):
    """The hub's MiniMax-M2 files name the rotated width (`rotary_dim`), not a factor."""
    with open(cfg_path) as f:
        c = json.load(f)
    c["rotary_dim"] = int(c.pop("partial_rotary_factor") * c["head_dim"])
    with open(cfg_path, "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)


def drop_keys(cfg_path, drop):
    """Removes keys transformers 5 writes that the hub's older files lack (Llama 4's layer_types)."""
    with open(cfg_path) as f:
        c = json.load(f)
    for k in drop:
        c.pop(k)
    with open(cfg_path, "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)


def set_keys(cfg_path, keys):
    """Adds keys the hub's files have and transformers 5 does not write (Qwen3-Next's full_attention_interval)."""
    with open(cfg_path) as f:
        c = json.load(f)
    c.update(keys)
    with open(cfg_path, "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)


def fuse_experts(path):
    """The hub's fused experts, `mlp.experts.gate_up_proj [E, 2·inter, hidden]` (gate rows first) and
    `mlp.experts.down_proj [E, hidden, inter]`, from per-expert tensors if that is what was saved."""
    tensors = load_file(path)
    layers = {}
    for k in list(tensors):
        parts = k.split(".mlp.experts.")
        if len(parts) == 2 and parts[1].split(".")[0].isdigit():
            e, proj = parts[1].split(".")[:2]
            layers.setdefault(parts[0], {}).setdefault(proj, {})[int(e)] = tensors.pop(k)
    for prefix, projs in layers.items():
        n = len(projs["gate_proj"])
        gate_up = [torch.cat([projs["gate_proj"][e], projs["up_proj"][e]]) for e in range(n)]
        tensors[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(gate_up).contiguous()
        tensors[f"{prefix}.mlp.experts.down_proj"] = torch.stack([projs["down_proj"][e] for e in range(n)]).contiguous()
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in tensors), "no experts found"
    save_file(tensors, path, metadata={"format": "pt"})


def build(name, spec, out_root, seed):
    """A fresh OUT/NAME, and spec's transformers model with random weights (routers scaled by
    `router_scale`): (out, cfg, model class, model, generator)."""
    out = os.path.join(out_root, name)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    cfg_cls, model_cls = spec["cls"]
    cfg = cfg_cls(**spec["cfg"])
    cfg._attn_implementation = "eager"
    gen = torch.Generator().manual_seed(seed)
    model = model_cls(cfg).eval()
    randomize(model, gen)
    if spec.get("router_scale"):
        # Routers with a trained model's spread of logits: with HF's init scale
        # the tiny fixtures' top-k has near-ties, which one bf16 rounding flips
        # (one flipped token outweighs every other token's error in the bf16
        # accuracy test, whichever implementation flips).
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if pname.endswith(("mlp.gate.weight", "feed_forward.router.weight")):
                    p.mul_(spec["router_scale"])
    return out, cfg, model_cls, model, gen


def make(name, spec, out_root, seed):
    out, cfg, model_cls, model, gen = build(name, spec, out_root, seed)
    # Round to the storage dtype, save, then compute the reference in f32 on the rounded weights.
    model = model.to(spec["dtype"])
    kwargs = {"max_shard_size": spec["shard"]} if spec["shard"] else {}
    model.save_pretrained(out, **kwargs)
    if spec["legacy"]:
        to_legacy(os.path.join(out, "config.json"))
    if spec.get("gemma_legacy"):
        gemma_legacy(os.path.join(out, "config.json"), spec["cfg"]["sliding_window_pattern"])
    if spec.get("rotary_dim_key"):
        hub_rotary_dim(os.path.join(out, "config.json"))
    if spec.get("mtp_layer"):
        add_mtp_layer(out, cfg, gen)
    if spec.get("drop_keys"):
        drop_keys(os.path.join(out, "config.json"), spec["drop_keys"])
    if spec.get("set_keys"):
        set_keys(os.path.join(out, "config.json"), spec["set_keys"])
    if spec.get("mtp_tensor"):
        path = os.path.join(out, "model.safetensors")
        tensors = load_file(path)
        tensors["mtp.fc.weight"] = torch.randn((cfg.hidden_size, 2 * cfg.hidden_size), generator=gen)
        save_file(tensors, path, metadata={"format": "pt"})
    if spec.get("fuse_experts"):
        fuse_experts(os.path.join(out, "model.safetensors"))
    for extra in ("generation_config.json",):
        p = os.path.join(out, extra)
        if os.path.exists(p):
            os.remove(p)
    # A fresh f32 model loaded with the rounded weights: casting the model itself
    # would also round RoPE's inv_freq buffer, which a real f32 run never does.
    rounded = {k: v.float() for k, v in model.state_dict().items()}
    model = model_cls(cfg).eval()
    model.load_state_dict(rounded)

    write_expected(model, cfg, out, gen, min_router_gap=spec.get("min_router_gap"), lengths=spec.get("lengths", LENGTHS))
    if spec.get("expected_f64"):
        add_f64_states(model_cls, cfg, rounded, out)
    size = sum(os.path.getsize(os.path.join(out, x)) for x in os.listdir(out))
    print(f"{name}: {size / 1024:.0f} KiB")


def write_expected(model, cfg, out, gen, min_router_gap=None, lengths=LENGTHS, **metadata):
    """Random samples into OUT/data.jsonl and the f32 `model`'s hidden states for them
    into OUT/expected.safetensors (every output_hidden_states entry, plus the final norm's input).

    With `min_router_gap` (Llama 4's `feed_forward.router`s), a sample is drawn again while some
    router's k-th and (k+1)-th logits of some token lie closer than that: a near-tie that any bf16
    run flips at random (one flipped top-1 expert outweighs every other token's error in the bf16
    accuracy test), whichever implementation runs it."""
    captured = {}
    logits = []
    if min_router_gap:
        for name, mod in model.named_modules():
            if name.endswith("feed_forward.router"):
                mod.register_forward_hook(lambda mod, args, res: logits.append((mod.top_k, res[1].detach())))
    # The text model: `model.model`, or a multimodal wrapper's `model.model.language_model`
    # (Llama 4's wrapper holds a whole causal LM as `model.language_model`).
    lm = getattr(model, "language_model", None)
    text_model = lm.model if hasattr(lm, "lm_head") else getattr(model.model, "language_model", model.model)
    cfg = cfg.get_text_config()
    text_model.norm.register_forward_pre_hook(lambda mod, args: captured.__setitem__("pre", args[0].detach().clone()))
    expected = {}
    with open(os.path.join(out, "data.jsonl"), "w") as f:
        for i, n in enumerate(lengths):
            while True:
                ids = torch.randint(0, cfg.vocab_size, (n,), generator=gen)
                logits.clear()
                with torch.no_grad():
                    res = text_model(input_ids=ids[None], output_hidden_states=True)
                gaps = [(l.topk(k + 1, dim=-1).values[:, k - 1] - l.topk(k + 1, dim=-1).values[:, k]).min().item()
                        for k, l in logits]
                if not gaps or min(gaps) >= min_router_gap:
                    break
                print(f"  sample {i}: a router's top-k gap is {min(gaps):.3f}; drawing it again")
            f.write(json.dumps({"input_ids": ids.tolist()}) + "\n")
            hs = torch.stack([h[0] for h in res.hidden_states]).contiguous()
            assert hs.shape == (cfg.num_hidden_layers + 1, n, cfg.hidden_size)
            expected[f"sample{i}.hidden_states"] = hs
            expected[f"sample{i}.final_pre_norm"] = captured["pre"][0].contiguous()
    save_file(expected, os.path.join(out, "expected.safetensors"),
              metadata={"transformers": transformers.__version__, "torch": torch.__version__, **metadata})


def add_f64_states(model_cls, cfg, rounded, out):
    """`sample{i}.hidden_states_f64`: HF run in f64 on the same weights. A hybrid model's f32 states
    are ill-conditioned (each head's gated norm divides out the magnitude of a DeltaNet output that
    may cancel), so HF's own f32 run is some 1e-4 from its f64 one; the f64 states check the
    reference backend's f64 arithmetic at the tight tolerance."""
    cfg = type(cfg).from_dict(cfg.to_dict())
    cfg._experts_implementation = "eager"  # grouped_mm has no f64
    model = model_cls(cfg).eval().to(torch.float64)
    model.load_state_dict({k: v.double() for k, v in rounded.items()})
    lm = getattr(model, "language_model", None)
    text_model = lm.model if hasattr(lm, "lm_head") else getattr(model.model, "language_model", model.model)
    path = os.path.join(out, "expected.safetensors")
    expected = load_file(path)
    with open(os.path.join(out, "data.jsonl")) as f:
        for i, line in enumerate(f):
            ids = torch.tensor(json.loads(line)["input_ids"])[None]
            with torch.no_grad():
                res = text_model(input_ids=ids, output_hidden_states=True)
            expected[f"sample{i}.hidden_states_f64"] = torch.stack([h[0] for h in res.hidden_states]).float().contiguous()
    save_file(expected, path, metadata={"transformers": transformers.__version__, "torch": torch.__version__})


def cli(doc, fixtures, make, seed0):
    """`--out DIR` and `--only NAME ...`, then `make(name, spec, out, seed)` per fixture."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures"))
    ap.add_argument("--only", nargs="*", help="fixture names to regenerate")
    args = ap.parse_args()
    torch.manual_seed(0)
    for seed, (name, spec) in enumerate(fixtures.items()):
        if args.only and name not in args.only:
            continue
        {"gpt_oss": make_gpt_oss}.get(spec.get("maker"), make)(name, spec, args.out, seed0 + seed)


def main():
    cli(__doc__, FIXTURES, make, 1000)


if __name__ == "__main__":
    main()
