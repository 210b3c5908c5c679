//! Random-weight checkpoints for benches and tests (no downloads): a HF-layout
//! `config.json` + `model.safetensors` that any HF loader reads as-is.

use crate::shape::DType;
use std::path::Path;

/// Sizes of a synthetic Llama.
#[derive(Clone, Debug)]
pub struct LlamaSpec {
    /// Residual width.
    pub hidden_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// KV heads.
    pub num_kv_heads: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Vocabulary.
    pub vocab_size: usize,
}

impl LlamaSpec {
    /// The `small` bench shape: hidden 1024, 8 layers, 16/4 heads, MLP 2816, vocab 32000.
    pub fn small() -> Self {
        LlamaSpec {
            hidden_size: 1024,
            num_layers: 8,
            num_heads: 16,
            num_kv_heads: 4,
            intermediate_size: 2816,
            vocab_size: 32000,
        }
    }
}

/// A deterministic generator (SplitMix64), so every run writes the same weights.
pub struct Rng(u64);

impl Rng {
    /// Seeded generator.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `[-1, 1)`.
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    /// Uniform integer in `[0, n)`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// Writes a random-weight Llama checkpoint (weights in `dtype`) into `dir`.
pub fn write_llama(dir: &Path, spec: &LlamaSpec, dtype: DType, seed: u64) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let s = spec;
    let hd = s.hidden_size / s.num_heads;
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": s.hidden_size,
        "num_hidden_layers": s.num_layers,
        "num_attention_heads": s.num_heads,
        "num_key_value_heads": s.num_kv_heads,
        "head_dim": hd,
        "intermediate_size": s.intermediate_size,
        "vocab_size": s.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": false,
        "attention_bias": false,
        "mlp_bias": false,
        "torch_dtype": match dtype { DType::F32 => "float32", DType::BF16 => "bfloat16", DType::F16 => "float16" },
    });
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config).unwrap())?;

    let mut rng = Rng::new(seed);
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut add = |name: String, shape: Vec<usize>, scale: f32, offset: f32, rng: &mut Rng| {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| offset + scale * rng.uniform()).collect();
        let mut bytes = Vec::new();
        dtype.encode_into(&v, &mut bytes);
        tensors.push((name, shape, bytes));
    };
    let (h, i) = (s.hidden_size, s.intermediate_size);
    let (q, kv) = (s.num_heads * hd, s.num_kv_heads * hd);
    let w = |fan_in: usize| (3.0 / fan_in as f32).sqrt(); // unit-variance outputs
    add("model.embed_tokens.weight".into(), vec![s.vocab_size, h], 1.0, 0.0, &mut rng);
    for l in 0..s.num_layers {
        let p = format!("model.layers.{l}");
        add(format!("{p}.input_layernorm.weight"), vec![h], 0.2, 1.0, &mut rng);
        add(format!("{p}.self_attn.q_proj.weight"), vec![q, h], w(h), 0.0, &mut rng);
        add(format!("{p}.self_attn.k_proj.weight"), vec![kv, h], w(h), 0.0, &mut rng);
        add(format!("{p}.self_attn.v_proj.weight"), vec![kv, h], w(h), 0.0, &mut rng);
        add(format!("{p}.self_attn.o_proj.weight"), vec![h, q], w(q), 0.0, &mut rng);
        add(format!("{p}.post_attention_layernorm.weight"), vec![h], 0.2, 1.0, &mut rng);
        add(format!("{p}.mlp.gate_proj.weight"), vec![i, h], w(h), 0.0, &mut rng);
        add(format!("{p}.mlp.up_proj.weight"), vec![i, h], w(h), 0.0, &mut rng);
        add(format!("{p}.mlp.down_proj.weight"), vec![h, i], w(i), 0.0, &mut rng);
    }
    add("model.norm.weight".into(), vec![h], 0.2, 1.0, &mut rng);
    add("lm_head.weight".into(), vec![s.vocab_size, h], w(h), 0.0, &mut rng);
    let views = tensors
        .iter()
        .map(|(n, shape, b)| {
            safetensors::tensor::TensorView::new(dtype.to_safetensors(), shape.clone(), b).map(|v| (n.clone(), v))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors"))
        .map_err(|e| std::io::Error::other(e.to_string()))
}

/// Random token samples, written as JSON Lines.
pub fn write_tokens(path: &Path, vocab: usize, lengths: &[usize], seed: u64) -> std::io::Result<Vec<Vec<u32>>> {
    let mut rng = Rng::new(seed);
    let samples: Vec<Vec<u32>> =
        lengths.iter().map(|&n| (0..n).map(|_| rng.below(vocab as u64) as u32).collect()).collect();
    let text: String = samples.iter().map(|s| serde_json::json!({ "input_ids": s }).to_string() + "\n").collect();
    std::fs::write(path, text)?;
    Ok(samples)
}

/// The `small` bench checkpoint (random f32 weights) with 4 × 512 random
/// tokens in `tokens.jsonl`: `$STRATA_BENCH_MODEL` if set, else written once
/// under the temp directory.
pub fn bench_small_dir() -> std::io::Result<std::path::PathBuf> {
    if let Ok(d) = std::env::var("STRATA_BENCH_MODEL") {
        return Ok(d.into());
    }
    let dir = std::env::temp_dir().join("strata-bench-small");
    if !dir.join("tokens.jsonl").exists() {
        let spec = LlamaSpec::small();
        write_llama(&dir, &spec, DType::F32, 7)?;
        write_tokens(&dir.join("tokens.jsonl"), spec.vocab_size, &[512; 4], 11)?;
    }
    Ok(dir)
}

/// Sizes of a synthetic DeepSeek-V3-layout (MLA + MoE) model.
#[derive(Clone, Debug)]
pub struct DeepseekSpec {
    /// `model_type`: `deepseek_v3` or `kimi_k2`.
    pub model_type: &'static str,
    /// Residual width.
    pub hidden_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Attention heads.
    pub num_heads: usize,
    /// q LoRA rank.
    pub q_lora_rank: usize,
    /// Latent KV width.
    pub kv_lora_rank: usize,
    /// q/k width without RoPE.
    pub qk_nope_head_dim: usize,
    /// q/k width with RoPE.
    pub qk_rope_head_dim: usize,
    /// Value width.
    pub v_head_dim: usize,
    /// Dense MLP width.
    pub intermediate_size: usize,
    /// Routed experts.
    pub n_routed_experts: usize,
    /// Shared experts.
    pub n_shared_experts: usize,
    /// Experts per token.
    pub num_experts_per_tok: usize,
    /// Expert MLP width.
    pub moe_intermediate_size: usize,
    /// Leading dense layers.
    pub first_k_dense_replace: usize,
    /// Vocabulary.
    pub vocab_size: usize,
}

/// Writes a random-weight DeepSeek-V3-layout checkpoint (f32) into `dir`.
pub fn write_deepseek(dir: &Path, s: &DeepseekSpec, seed: u64) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let config = serde_json::json!({
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": s.model_type,
        "hidden_size": s.hidden_size, "num_hidden_layers": s.num_layers,
        "num_attention_heads": s.num_heads, "num_key_value_heads": s.num_heads,
        "q_lora_rank": s.q_lora_rank, "kv_lora_rank": s.kv_lora_rank,
        "qk_nope_head_dim": s.qk_nope_head_dim, "qk_rope_head_dim": s.qk_rope_head_dim, "v_head_dim": s.v_head_dim,
        "intermediate_size": s.intermediate_size, "moe_intermediate_size": s.moe_intermediate_size,
        "n_routed_experts": s.n_routed_experts, "n_shared_experts": s.n_shared_experts,
        "num_experts_per_tok": s.num_experts_per_tok, "first_k_dense_replace": s.first_k_dense_replace,
        "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "norm_topk_prob": true, "routed_scaling_factor": 2.5, "vocab_size": s.vocab_size,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "hidden_act": "silu", "rope_interleave": true,
        "rope_theta": 50000.0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        "torch_dtype": "float32",
    });
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config).unwrap())?;
    let mut rng = Rng::new(seed);
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut add = |name: String, shape: Vec<usize>, scale: f32, offset: f32, rng: &mut Rng| {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| offset + scale * rng.uniform()).collect();
        tensors.push((name, shape, bytemuck::cast_slice(&v).to_vec()));
    };
    let w = |fan_in: usize| (3.0 / fan_in as f32).sqrt();
    let (h, nh) = (s.hidden_size, s.num_heads);
    let qk = s.qk_nope_head_dim + s.qk_rope_head_dim;
    add("model.embed_tokens.weight".into(), vec![s.vocab_size, h], 1.0, 0.0, &mut rng);
    for l in 0..s.num_layers {
        let p = format!("model.layers.{l}");
        add(format!("{p}.input_layernorm.weight"), vec![h], 0.2, 1.0, &mut rng);
        add(format!("{p}.post_attention_layernorm.weight"), vec![h], 0.2, 1.0, &mut rng);
        add(format!("{p}.self_attn.q_a_proj.weight"), vec![s.q_lora_rank, h], w(h), 0.0, &mut rng);
        add(format!("{p}.self_attn.q_a_layernorm.weight"), vec![s.q_lora_rank], 0.2, 1.0, &mut rng);
        add(format!("{p}.self_attn.q_b_proj.weight"), vec![nh * qk, s.q_lora_rank], w(s.q_lora_rank), 0.0, &mut rng);
        let kva = s.kv_lora_rank + s.qk_rope_head_dim;
        add(format!("{p}.self_attn.kv_a_proj_with_mqa.weight"), vec![kva, h], w(h), 0.0, &mut rng);
        add(format!("{p}.self_attn.kv_a_layernorm.weight"), vec![s.kv_lora_rank], 0.2, 1.0, &mut rng);
        let kvb = nh * (s.qk_nope_head_dim + s.v_head_dim);
        add(format!("{p}.self_attn.kv_b_proj.weight"), vec![kvb, s.kv_lora_rank], w(s.kv_lora_rank), 0.0, &mut rng);
        add(format!("{p}.self_attn.o_proj.weight"), vec![h, nh * s.v_head_dim], w(nh * s.v_head_dim), 0.0, &mut rng);
        let mut mlp = |prefix: String, inter: usize, rng: &mut Rng| {
            add(format!("{prefix}.gate_proj.weight"), vec![inter, h], w(h), 0.0, rng);
            add(format!("{prefix}.up_proj.weight"), vec![inter, h], w(h), 0.0, rng);
            add(format!("{prefix}.down_proj.weight"), vec![h, inter], w(inter), 0.0, rng);
        };
        if l < s.first_k_dense_replace {
            mlp(format!("{p}.mlp"), s.intermediate_size, &mut rng);
        } else {
            for e in 0..s.n_routed_experts {
                mlp(format!("{p}.mlp.experts.{e}"), s.moe_intermediate_size, &mut rng);
            }
            if s.n_shared_experts > 0 {
                mlp(format!("{p}.mlp.shared_experts"), s.moe_intermediate_size * s.n_shared_experts, &mut rng);
            }
            add(format!("{p}.mlp.gate.weight"), vec![s.n_routed_experts, h], w(h), 0.0, &mut rng);
            add(format!("{p}.mlp.gate.e_score_correction_bias"), vec![s.n_routed_experts], 0.05, 0.0, &mut rng);
        }
    }
    add("model.norm.weight".into(), vec![h], 0.2, 1.0, &mut rng);
    let views = tensors
        .iter()
        .map(|(n, shape, b)| {
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), b).map(|v| (n.clone(), v))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors"))
        .map_err(|e| std::io::Error::other(e.to_string()))
}
