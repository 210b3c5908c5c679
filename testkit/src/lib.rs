//! Test support for Strata's tests, benches and examples, kept out of the
//! library's public surface: random-weight checkpoints (no downloads), a
//! HF-layout `config.json` + `model.safetensors` that any HF loader reads as-is,
//! and token files to run them on.

use std::path::Path;
use strata::shape::DType;

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

/// `dir/model.safetensors` holding `tensors` (name, dtype, shape, bytes).
pub fn write_safetensors(
    dir: &Path,
    tensors: &[(String, safetensors::Dtype, Vec<usize>, Vec<u8>)],
) -> std::io::Result<()> {
    let views = tensors
        .iter()
        .map(|(n, dt, shape, b)| safetensors::tensor::TensorView::new(*dt, shape.clone(), b).map(|v| (n.clone(), v)))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors"))
        .map_err(|e| std::io::Error::other(e.to_string()))
}

/// Random tensors of one dtype, named as a checkpoint's, from a seeded generator.
pub struct RandomTensors {
    dtype: DType,
    rng: Rng,
    tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>,
}

impl RandomTensors {
    /// No tensors yet; values from `Rng::new(seed)`, stored as `dtype`.
    pub fn new(dtype: DType, seed: u64) -> Self {
        RandomTensors { dtype, rng: Rng::new(seed), tensors: Vec::new() }
    }
    /// Adds `name` of `shape`, each value `offset + scale · uniform(-1, 1)`.
    pub fn add(&mut self, name: String, shape: Vec<usize>, scale: f32, offset: f32) {
        let v: Vec<f32> = (0..shape.iter().product()).map(|_| offset + scale * self.rng.uniform()).collect();
        let mut bytes = Vec::new();
        self.dtype.encode_into(&v, &mut bytes);
        self.tensors.push((name, self.dtype.to_safetensors(), shape, bytes));
    }
    /// Writes them to `dir/model.safetensors`.
    pub fn write(&self, dir: &Path) -> std::io::Result<()> {
        write_safetensors(dir, &self.tensors)
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
        "torch_dtype": match dtype {
            DType::F32 => "float32",
            DType::BF16 => "bfloat16",
            DType::F16 => "float16",
            // Plain FP8 weights would need block scales to load.
            DType::F8E4M3 => return Err(std::io::Error::other("write_llama writes f32, bf16 or f16 weights")),
        },
    });
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config).unwrap())?;

    let mut t = RandomTensors::new(dtype, seed);
    let (h, i) = (s.hidden_size, s.intermediate_size);
    let (q, kv) = (s.num_heads * hd, s.num_kv_heads * hd);
    let w = |fan_in: usize| (3.0 / fan_in as f32).sqrt(); // unit-variance outputs
    t.add("model.embed_tokens.weight".into(), vec![s.vocab_size, h], 1.0, 0.0);
    for l in 0..s.num_layers {
        let p = format!("model.layers.{l}");
        t.add(format!("{p}.input_layernorm.weight"), vec![h], 0.2, 1.0);
        t.add(format!("{p}.self_attn.q_proj.weight"), vec![q, h], w(h), 0.0);
        t.add(format!("{p}.self_attn.k_proj.weight"), vec![kv, h], w(h), 0.0);
        t.add(format!("{p}.self_attn.v_proj.weight"), vec![kv, h], w(h), 0.0);
        t.add(format!("{p}.self_attn.o_proj.weight"), vec![h, q], w(q), 0.0);
        t.add(format!("{p}.post_attention_layernorm.weight"), vec![h], 0.2, 1.0);
        t.add(format!("{p}.mlp.gate_proj.weight"), vec![i, h], w(h), 0.0);
        t.add(format!("{p}.mlp.up_proj.weight"), vec![i, h], w(h), 0.0);
        t.add(format!("{p}.mlp.down_proj.weight"), vec![h, i], w(i), 0.0);
    }
    t.add("model.norm.weight".into(), vec![h], 0.2, 1.0);
    t.add("lm_head.weight".into(), vec![s.vocab_size, h], w(h), 0.0);
    t.write(dir)
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

/// How a synthetic DeepSeek checkpoint stores its weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Storage {
    /// Every tensor in f32.
    F32,
    /// Every tensor in bf16.
    Bf16,
    /// DeepSeek-V3 / Kimi-K2: every linear layer but the router in FP8 E4M3
    /// with 128×128 block scales; the rest in bf16.
    Fp8,
    /// Kimi-K2.5 / Kimi-K2-Thinking: routed experts in compressed-tensors
    /// packed INT4 (groups of 32, bf16 scales); the rest in bf16.
    Int4Experts,
}

/// Writes a random-weight DeepSeek-V3-layout checkpoint (f32) into `dir`.
pub fn write_deepseek(dir: &Path, s: &DeepseekSpec, seed: u64) -> std::io::Result<()> {
    write_deepseek_stored(dir, s, Storage::F32, false, seed)
}

/// The nearest FP8 E4M3 code to `x` (ties to the even code), saturating at ±448.
pub fn fp8_e4m3_from_f32(x: f32) -> u8 {
    use std::sync::OnceLock;
    static POS: OnceLock<Vec<f32>> = OnceLock::new();
    // Codes 0..=0x7e are the finite non-negative values, in increasing order.
    let pos = POS.get_or_init(|| (0u8..=0x7e).map(strata::hf::quant::fp8_e4m3_to_f32).collect());
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    let i = pos.partition_point(|&v| v < a);
    let code = if i == 0 {
        0
    } else if i >= pos.len() {
        pos.len() - 1
    } else {
        let (lo, hi) = (pos[i - 1], pos[i]);
        if a - lo < hi - a || (a - lo == hi - a && (i - 1) % 2 == 0) {
            i - 1
        } else {
            i
        }
    };
    sign | code as u8
}

/// What a synthetic tensor is, which decides how it is stored.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    Plain,
    Linear,
    Expert,
}

/// Writes a random-weight DeepSeek-V3-layout checkpoint into `dir`, stored as
/// `storage` says; with `kimi_k25_wrapper`, inside Kimi-K2.5's multimodal
/// wrapper (`text_config`, `language_model.*` names, a few vision tensors).
pub fn write_deepseek_stored(
    dir: &Path,
    s: &DeepseekSpec,
    storage: Storage,
    kimi_k25_wrapper: bool,
    seed: u64,
) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut config = serde_json::json!({
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
        "torch_dtype": if storage == Storage::F32 { "float32" } else { "bfloat16" },
    });
    match storage {
        Storage::Fp8 => {
            config["quantization_config"] = serde_json::json!({"quant_method": "fp8", "fmt": "e4m3",
                "activation_scheme": "dynamic", "weight_block_size": [128, 128]})
        }
        Storage::Int4Experts => {
            config["quantization_config"] = serde_json::json!({
                "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": null,
                    "weights": {"num_bits": 4, "type": "int", "symmetric": true, "strategy": "group",
                                "group_size": 32, "dynamic": false}}},
                "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                           "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:vision_tower.*", "re:mm_projector.*"]})
        }
        Storage::F32 | Storage::Bf16 => {}
    }
    let prefix = if kimi_k25_wrapper { "language_model." } else { "" };
    if kimi_k25_wrapper {
        config = serde_json::json!({
            "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
            "text_config": config, "vision_config": {"model_type": "moonvit", "hidden_size": 64},
        });
    }
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config).unwrap())?;

    let mut rng = Rng::new(seed);
    let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut add = |name: String, shape: Vec<usize>, scale: f32, offset: f32, role: Role, rng: &mut Rng| {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| offset + scale * rng.uniform()).collect();
        let name = format!("{prefix}{name}");
        match (storage, role) {
            (Storage::Fp8, Role::Linear | Role::Expert) => {
                let (codes, scales, sshape) = fp8_blocks(&v, shape[0], shape[1]);
                let base = name.strip_suffix(".weight").expect("a weight");
                tensors.push((format!("{base}.weight_scale_inv"), safetensors::Dtype::F32, sshape, scales));
                tensors.push((name, safetensors::Dtype::F8_E4M3, shape, codes));
            }
            (Storage::Int4Experts, Role::Expert) => {
                let base = name.strip_suffix(".weight").expect("a weight").to_string();
                let (packed, scales) = int4_groups(&v, shape[0], shape[1]);
                let words = shape[1].div_ceil(8);
                tensors.push((format!("{base}.weight_packed"), safetensors::Dtype::I32, vec![shape[0], words], packed));
                let groups = shape[1].div_ceil(32);
                tensors.push((
                    format!("{base}.weight_scale"),
                    safetensors::Dtype::BF16,
                    vec![shape[0], groups],
                    scales,
                ));
                let dims: Vec<u8> = [shape[0] as i64, shape[1] as i64].iter().flat_map(|d| d.to_le_bytes()).collect();
                tensors.push((format!("{base}.weight_shape"), safetensors::Dtype::I64, vec![2], dims));
            }
            (Storage::F32, _) => {
                tensors.push((name, safetensors::Dtype::F32, shape, bytemuck::cast_slice(&v).to_vec()))
            }
            _ => {
                let mut bytes = Vec::new();
                DType::BF16.encode_into(&v, &mut bytes);
                tensors.push((name, safetensors::Dtype::BF16, shape, bytes));
            }
        }
    };
    let w = |fan_in: usize| (3.0 / fan_in as f32).sqrt();
    let (h, nh) = (s.hidden_size, s.num_heads);
    let qk = s.qk_nope_head_dim + s.qk_rope_head_dim;
    let (plain, linear) = (Role::Plain, Role::Linear);
    add("model.embed_tokens.weight".into(), vec![s.vocab_size, h], 1.0, 0.0, plain, &mut rng);
    for l in 0..s.num_layers {
        let p = format!("model.layers.{l}");
        add(format!("{p}.input_layernorm.weight"), vec![h], 0.2, 1.0, plain, &mut rng);
        add(format!("{p}.post_attention_layernorm.weight"), vec![h], 0.2, 1.0, plain, &mut rng);
        add(format!("{p}.self_attn.q_a_proj.weight"), vec![s.q_lora_rank, h], w(h), 0.0, linear, &mut rng);
        add(format!("{p}.self_attn.q_a_layernorm.weight"), vec![s.q_lora_rank], 0.2, 1.0, plain, &mut rng);
        let (qr, kvr) = (s.q_lora_rank, s.kv_lora_rank);
        add(format!("{p}.self_attn.q_b_proj.weight"), vec![nh * qk, qr], w(qr), 0.0, linear, &mut rng);
        let kva = kvr + s.qk_rope_head_dim;
        add(format!("{p}.self_attn.kv_a_proj_with_mqa.weight"), vec![kva, h], w(h), 0.0, linear, &mut rng);
        add(format!("{p}.self_attn.kv_a_layernorm.weight"), vec![kvr], 0.2, 1.0, plain, &mut rng);
        let kvb = nh * (s.qk_nope_head_dim + s.v_head_dim);
        add(format!("{p}.self_attn.kv_b_proj.weight"), vec![kvb, kvr], w(kvr), 0.0, linear, &mut rng);
        let vw = nh * s.v_head_dim;
        add(format!("{p}.self_attn.o_proj.weight"), vec![h, vw], w(vw), 0.0, linear, &mut rng);
        let mut mlp = |prefix: String, inter: usize, role: Role, rng: &mut Rng| {
            add(format!("{prefix}.gate_proj.weight"), vec![inter, h], w(h), 0.0, role, rng);
            add(format!("{prefix}.up_proj.weight"), vec![inter, h], w(h), 0.0, role, rng);
            add(format!("{prefix}.down_proj.weight"), vec![h, inter], w(inter), 0.0, role, rng);
        };
        if l < s.first_k_dense_replace {
            mlp(format!("{p}.mlp"), s.intermediate_size, linear, &mut rng);
        } else {
            for e in 0..s.n_routed_experts {
                mlp(format!("{p}.mlp.experts.{e}"), s.moe_intermediate_size, Role::Expert, &mut rng);
            }
            if s.n_shared_experts > 0 {
                mlp(format!("{p}.mlp.shared_experts"), s.moe_intermediate_size * s.n_shared_experts, linear, &mut rng);
            }
            add(format!("{p}.mlp.gate.weight"), vec![s.n_routed_experts, h], w(h), 0.0, plain, &mut rng);
            add(format!("{p}.mlp.gate.e_score_correction_bias"), vec![s.n_routed_experts], 0.05, 0.0, plain, &mut rng);
        }
    }
    add("model.norm.weight".into(), vec![h], 0.2, 1.0, plain, &mut rng);
    if kimi_k25_wrapper {
        // A vision tower the extraction never reads.
        let v: Vec<u8> = (0..64 * 64 * 2).map(|i| (i % 251) as u8).collect();
        tensors.push(("vision_tower.encoder.blocks.0.wqkv.weight".into(), safetensors::Dtype::BF16, vec![64, 64], v));
        let v: Vec<u8> = (0..h * 64 * 2).map(|i| (i % 241) as u8).collect();
        tensors.push(("mm_projector.proj.0.weight".into(), safetensors::Dtype::BF16, vec![h, 64], v));
    }
    write_safetensors(dir, &tensors)
}

/// FP8 E4M3 codes of `w` (`[out, inp]`) with f32 scales `amax / 448` per 128×128 block.
fn fp8_blocks(w: &[f32], out: usize, inp: usize) -> (Vec<u8>, Vec<u8>, Vec<usize>) {
    let (br, bc) = (out.div_ceil(128), inp.div_ceil(128));
    let mut scale = vec![0f32; br * bc];
    for (i, row) in w.chunks_exact(inp).enumerate() {
        for (j, v) in row.iter().enumerate() {
            let s = &mut scale[(i / 128) * bc + j / 128];
            *s = s.max(v.abs() / 448.0);
        }
    }
    scale.iter_mut().for_each(|s| *s = s.max(1e-12));
    let codes = w
        .chunks_exact(inp)
        .enumerate()
        .flat_map(|(i, row)| {
            let scale = &scale;
            row.iter().enumerate().map(move |(j, v)| fp8_e4m3_from_f32(v / scale[(i / 128) * bc + j / 128]))
        })
        .collect();
    (codes, bytemuck::cast_slice(&scale).to_vec(), vec![br, bc])
}

/// compressed-tensors packed INT4 of `w` (`[out, inp]`): symmetric groups of 32
/// with bf16 scales `amax / 7`; returns the I32 words' and the scales' bytes.
fn int4_groups(w: &[f32], out: usize, inp: usize) -> (Vec<u8>, Vec<u8>) {
    let (words, groups) = (inp.div_ceil(8), inp.div_ceil(32));
    let mut packed = vec![0u32; out * words];
    let mut scales = Vec::with_capacity(out * groups);
    for (i, row) in w.chunks_exact(inp).enumerate() {
        for g in 0..groups {
            let cols = g * 32..((g + 1) * 32).min(inp);
            let amax = row[cols.clone()].iter().fold(0f32, |m, v| m.max(v.abs()));
            let s = half::bf16::from_f32((amax / 7.0).max(1e-8));
            scales.push(s);
            for j in cols {
                let q = (row[j] / s.to_f32()).round().clamp(-8.0, 7.0) as i32 + 8;
                packed[i * words + j / 8] |= (q as u32) << (4 * (j % 8));
            }
        }
    }
    let packed = packed.iter().flat_map(|w| w.to_le_bytes()).collect();
    (packed, scales.iter().flat_map(|s| s.to_le_bytes()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_encoding_rounds_to_the_nearest_code() {
        use strata::hf::quant::fp8_e4m3_to_f32 as dec;
        for code in (0u8..=0x7e).chain(0x80..=0xfe) {
            assert_eq!(fp8_e4m3_from_f32(dec(code)), if code == 0x80 { 0x80 } else { code }, "{code:#x}");
        }
        assert_eq!(fp8_e4m3_from_f32(1000.0), 0x7e);
        assert_eq!(fp8_e4m3_from_f32(-1e-9), 0x80);
        // Halfway between 1.0 (0x38) and 1.125 (0x39): to the even code.
        assert_eq!(fp8_e4m3_from_f32(1.0625), 0x38);
        assert_eq!(fp8_e4m3_from_f32(1.07), 0x39);
    }
}

/// What the bench binaries share: their flags, medians and memory readings.
pub mod bench {
    /// The median of a sample (the upper middle of an even count): what the
    /// benches quote, since these machines are shared and noisy.
    pub fn median<T: PartialOrd + Copy>(mut v: Vec<T>) -> T {
        v.sort_by(|a, b| a.partial_cmp(b).expect("a timing is never NaN"));
        v[v.len() / 2]
    }

    /// The value after `--name` on this process's command line.
    pub fn flag(name: &str) -> Option<String> {
        let args: Vec<String> = std::env::args().collect();
        args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned()
    }

    /// [`flag`] parsed, or `default` when absent; a value that does not parse stops the bench, naming it.
    pub fn flag_or<T: std::str::FromStr>(name: &str, default: T) -> T {
        flag(name).map_or(default, |v| v.parse().unwrap_or_else(|_| panic!("{name} {v}: not a valid value")))
    }

    /// A field of `/proc/self/status` in KiB (`VmRSS:`, `VmHWM:`), 0 where unavailable.
    pub fn status_kib(field: &str) -> u64 {
        let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        s.lines()
            .find(|l| l.starts_with(field))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }
}

/// The bounded-memory case of `strata generate`: a Llama of `spec` with the
/// chat fixtures' tokenizer and ChatML template, 256 one-turn conversations,
/// and the cache flag that holds a quarter of what they need at once with
/// 512 new tokens each (f32 cache: `layers · 2 · kv_heads · head_dim · 4`
/// bytes per position, the prompts measured by rendering them).
pub struct GenerationMemoryCase {
    /// The model directory.
    pub model: std::path::PathBuf,
    /// The conversations (JSON Lines).
    pub data: std::path::PathBuf,
    /// `--kv-cache-memory`, in bytes.
    pub flag: usize,
    /// Bytes of the checkpoint's safetensors files.
    pub weights: u64,
}

/// Writes [`GenerationMemoryCase`] under `dir`; `chat` is `tests/fixtures/chat`.
pub fn generation_memory_case(dir: &Path, chat: &Path, spec: &LlamaSpec) -> std::io::Result<GenerationMemoryCase> {
    let model = dir.join("model");
    write_llama(&model, spec, DType::F32, 7)?;
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(chat.join(f), model.join(f))?;
    }
    std::fs::copy(chat.join("templates/chatml.jinja"), model.join("chat_template.jinja"))?;
    let loaded = strata::chat::Chat::load(&model, &Default::default()).map_err(std::io::Error::other)?;
    let template = loaded.template.as_ref().ok_or_else(|| std::io::Error::other("no template"))?;
    let (mut text, mut positions) = (String::new(), 0usize);
    for i in 0..256 {
        let messages = serde_json::json!([{"role": "user", "content": format!("Tell me story number {i}, please.")}]);
        let rendered = template
            .render(&strata::chat::template::json_value(&messages), None, true)
            .map_err(std::io::Error::other)?;
        let mut enc = strata::chat::Encoded::default();
        loaded.tokenizer.encode(&rendered.text, false, &mut enc).map_err(std::io::Error::other)?;
        positions += enc.ids.len() + 512;
        text += &format!("{}\n", serde_json::json!({"id": i, "messages": messages}));
    }
    let data = dir.join("conversations.jsonl");
    std::fs::write(&data, text)?;
    let per_position = spec.num_layers * 2 * spec.num_kv_heads * (spec.hidden_size / spec.num_heads) * 4;
    let mut weights = 0;
    for e in std::fs::read_dir(&model)? {
        let p = e?.path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            weights += std::fs::metadata(p)?.len();
        }
    }
    Ok(GenerationMemoryCase { model, data, flag: positions * per_position / 4, weights })
}

/// What a run of [`GenerationMemoryCase`] measured.
#[derive(Clone, Debug)]
pub struct GenerationMemoryRun {
    /// The cache's high-water mark (the run's summary), bytes.
    pub high_water: f64,
    /// Peak RSS (the run's `VmHWM`), MiB.
    pub peak_mib: f64,
    /// The flag + the weights + 256 MiB, MiB.
    pub bound_mib: f64,
    /// Lines of `regenerated.jsonl`.
    pub lines: usize,
}

impl GenerationMemoryCase {
    /// Runs `strata generate` (the binary `bin`) on the case: greedy, no stop ids, 512
    /// new tokens each, up to 256 sequences in flight, the cache held to the flag.
    pub fn run(&self, bin: &Path, out: &Path) -> GenerationMemoryRun {
        let o = std::process::Command::new(bin)
            .arg("generate")
            .arg("--model")
            .arg(&self.model)
            .arg("--data")
            .arg(&self.data)
            .arg("--out")
            .arg(out)
            .args(["--compute", "f32", "--dtype", "bf16", "--capture", "input:1,final", "--temperature", "0"])
            .args(["--max-tokens", "512", "--ignore-eos", "--max-num-seqs", "256"])
            .args(["--kv-cache-memory", &self.flag.to_string()])
            .output()
            .expect("strata runs");
        let stdout = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let number = |after: &str| -> f64 {
            let at = stdout.find(after).unwrap_or_else(|| panic!("no {after:?} in {stdout}")) + after.len();
            stdout[at..].split_whitespace().next().unwrap().parse().unwrap()
        };
        let lines = std::fs::read_to_string(out.join("regenerated.jsonl")).map_or(0, |t| t.lines().count());
        GenerationMemoryRun {
            high_water: number("cache held at most "),
            peak_mib: number("peak memory "),
            bound_mib: (self.flag as u64 + self.weights + (256 << 20)) as f64 / (1 << 20) as f64,
            lines,
        }
    }
}

impl std::fmt::Display for GenerationMemoryRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "cache high-water {:.1} MiB, peak RSS {:.0} MiB (bound: flag + weights + 256 MiB = {:.0} MiB), {} lines",
            self.high_water / (1 << 20) as f64,
            self.peak_mib,
            self.bound_mib,
            self.lines
        )
    }
}
