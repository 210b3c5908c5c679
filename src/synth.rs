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
