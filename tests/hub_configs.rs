//! The real hub `config.json` files of the target models
//! (`tests/fixtures/configs/`, sources in its README) parse, select the
//! family and variant their model_type names, and give the sizes the hub
//! model has: a config key read wrong would show here before any forward.

use crate::common;

use common::fixture;
use strata::hf::llama::{Arch, QkNorm};
use strata::hf::moe::{Scoring, TopkMethod};
use strata::model::AnyConfig;

fn config(name: &str) -> AnyConfig {
    let path = fixture("configs").join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    AnyConfig::parse(&text).unwrap_or_else(|e| panic!("{name}: {e}"))
}

#[test]
fn qwen3_30b_a3b_is_a_qwen3_attention_with_128_experts() {
    let AnyConfig::Llama(c) = config("qwen3-30b-a3b") else { panic!("qwen3_moe is a Llama-family config") };
    assert_eq!(c.arch, Arch::Qwen3Moe);
    assert_eq!(c.qk_norm, QkNorm::PerHead, "Qwen3-MoE keeps Qwen3's q/k norm");
    assert_eq!((c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim), (48, 2048, 32, 4, 128));
    let moe = c.moe.expect("a mixture of experts");
    assert_eq!((moe.experts, moe.top_k, moe.intermediate_size, moe.norm_topk_prob), (128, 8, 768, true));
    assert_eq!(moe.sparse, vec![true; 48], "decoder_sparse_step 1 and no mlp_only_layers: every layer routes");
    assert_eq!(c.sliding_windows, vec![None; 48], "use_sliding_window is false");
    assert_eq!(c.rope_theta, 1e6);
}

#[test]
fn mixtral_8x7b_is_a_mistral_attention_with_8_experts_of_top_2() {
    let AnyConfig::Llama(c) = config("mixtral-8x7b") else { panic!("mixtral is a Llama-family config") };
    assert_eq!(c.arch, Arch::Mixtral);
    assert!(c.qk_norm == QkNorm::None && !c.qkv_bias);
    assert_eq!((c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim), (32, 4096, 32, 8, 128));
    let moe = c.moe.expect("a mixture of experts");
    // Mixtral's experts are `intermediate_size` wide, and it always renormalises its top 2.
    assert_eq!((moe.experts, moe.top_k, moe.intermediate_size, moe.norm_topk_prob), (8, 2, 14336, true));
    assert_eq!(moe.sparse, vec![true; 32]);
    assert_eq!(c.sliding_windows, vec![None; 32], "no sliding_window key");
    assert_eq!(c.max_position_embeddings, 32768);
}

#[test]
fn glm_4_5_air_rotates_half_of_each_head_and_routes_as_deepseek_v3() {
    let AnyConfig::Llama(c) = config("glm-4.5-air") else { panic!("glm4_moe is a Llama-family config") };
    assert_eq!(c.arch, Arch::Glm4Moe);
    assert_eq!((c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim), (46, 4096, 96, 8, 128));
    // partial_rotary_factor 0.5: RoPE on the first 64 columns of each head, 32 frequencies.
    assert_eq!(c.rotary_dim, 64);
    assert_eq!(c.rope().inv_freq.len(), 32);
    assert!(c.qkv_bias && !c.o_bias, "attention_bias is on q, k and v only");
    assert_eq!(c.qk_norm, QkNorm::None, "use_qk_norm is false");
    assert_eq!(c.extra_layers, 1, "one multi-token-prediction layer is stored past layer 45");
    let moe = c.moe.expect("a mixture of experts");
    assert_eq!((moe.experts, moe.top_k, moe.intermediate_size, moe.norm_topk_prob), (128, 8, 1408, true));
    assert_eq!((moe.scoring, moe.topk_method), (Scoring::Sigmoid, TopkMethod::NoauxTc));
    assert_eq!((moe.n_group, moe.topk_group, moe.routed_scaling_factor), (1, 1, 1.0));
    assert_eq!(moe.shared_intermediate_size, Some(1408), "one shared expert as wide as a routed one");
    let mut sparse = vec![true; 46];
    sparse[0] = false;
    assert_eq!(moe.sparse, sparse, "first_k_dense_replace 1: layer 0 is dense");
    assert_eq!(c.rope_theta, 1e6);
}

#[test]
fn minimax_m2_5_norms_all_heads_and_rotates_64_columns() {
    let AnyConfig::Llama(c) = config("minimax-m2.5") else { panic!("minimax_m2 is a Llama-family config") };
    assert_eq!(c.arch, Arch::MiniMaxM2);
    assert_eq!((c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim), (62, 3072, 48, 8, 128));
    assert_eq!(c.qk_norm, QkNorm::AllHeads, "qk_norm_type per_layer: one norm over all heads");
    assert_eq!((c.rotary_dim, c.rope_theta), (64, 5e6));
    assert!(!c.qkv_bias && !c.o_bias);
    assert_eq!(c.extra_layers, 3, "use_mtp with 3 MTP modules");
    assert_eq!(c.sliding_windows, vec![None; 62]);
    let moe = c.moe.expect("a mixture of experts");
    assert_eq!((moe.experts, moe.top_k, moe.intermediate_size, moe.norm_topk_prob), (256, 8, 1536, true));
    assert_eq!((moe.scoring, moe.topk_method, moe.n_group), (Scoring::Sigmoid, TopkMethod::NoauxTc, 1));
    assert_eq!((moe.shared_intermediate_size, moe.sparse), (None, vec![true; 62]));
}

#[test]
fn gemma_3_1b_alternates_five_local_layers_with_one_global() {
    let AnyConfig::Gemma3(c) = config("gemma-3-1b-it") else { panic!("gemma3_text is a Gemma 3 config") };
    assert_eq!((c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim), (26, 1152, 4, 1, 256));
    assert_eq!((c.intermediate_size, c.vocab_size, c.query_pre_attn_scalar), (6912, 262_144, 256.0));
    let global: Vec<usize> = (0..26).filter(|&i| c.sliding_windows[i].is_none()).collect();
    assert_eq!(global, vec![5, 11, 17, 23], "sliding_window_pattern 6: every sixth layer is global");
    assert!(c.sliding_windows.iter().flatten().all(|&w| w == 512));
    assert_eq!((c.rope_theta, c.rope_local_theta), (1e6, 1e4));
    assert_eq!(c.tensor_prefix, "", "a text model alone: model.* names");
    assert!(!c.attention_bias);
}

#[test]
fn gemma_3_4b_takes_the_defaults_its_text_config_leaves_out() {
    let AnyConfig::Gemma3(c) = config("gemma-3-4b-it") else { panic!("gemma3 is a Gemma 3 config") };
    // Named: hidden, MLP width, layers, window, scaling. The rest: Gemma3TextConfig's defaults.
    assert_eq!((c.num_layers, c.hidden_size, c.intermediate_size), (34, 2560, 10240));
    assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size), (8, 4, 256, 262_208));
    assert_eq!((c.query_pre_attn_scalar, c.rms_norm_eps, c.max_position_embeddings), (256.0, 1e-6, 131_072));
    assert_eq!(c.tensor_prefix, "language_model.", "the wrapper's text model: language_model.model.*");
    let global: Vec<usize> = (0..34).filter(|&i| c.sliding_windows[i].is_none()).collect();
    assert_eq!(global, vec![5, 11, 17, 23, 29]);
    // Linear scaling by 8 on the global layers' base 1e6; the local layers' base 1e4, unscaled.
    let (g, l) = (c.rope(), c.rope_local());
    assert_eq!((g.inv_freq[0], l.inv_freq[0]), (0.125, 1.0));
    assert!((g.inv_freq[64] - 1e6f32.powf(-0.5) / 8.0).abs() < 1e-9);
    assert!((l.inv_freq[64] - 1e4f32.powf(-0.5)).abs() < 1e-9);
}

#[test]
fn gpt_oss_20b_alternates_sliding_and_full_layers_with_mxfp4_experts() {
    let AnyConfig::GptOss(c) = config("gpt-oss-20b") else { panic!("gpt_oss is a gpt-oss config") };
    assert_eq!((c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim), (24, 2880, 64, 8, 64));
    assert_eq!((c.num_experts, c.top_k, c.intermediate_size, c.vocab_size), (32, 4, 2880, 201_088));
    assert!(c.mxfp4, "quant_method mxfp4: the experts are read from *_blocks and *_scales");
    assert!(c.attention_bias);
    let sliding: Vec<usize> = (0..24).filter(|&i| c.sliding_windows[i].is_some()).collect();
    assert_eq!(sliding, (0..24).step_by(2).collect::<Vec<_>>(), "layer_types: sliding first, then full");
    assert!(c.sliding_windows.iter().flatten().all(|&w| w == 128));
    assert_eq!((c.swiglu_limit, c.swiglu_alpha), (7.0, 1.702), "alpha is GptOssConfig's, the file names none");
    let yarn = c.yarn.expect("rope_scaling is YaRN");
    assert_eq!((yarn.factor, yarn.beta_fast, yarn.beta_slow), (32.0, 32.0, 1.0));
    assert_eq!(yarn.original_max_position_embeddings, 4096.0);
    assert!(!yarn.truncate, "truncate: false (the correction range is not rounded to whole dims)");
    assert_eq!(c.rope_theta, 150_000.0);
    // --tp 8 cuts each expert's 2880 columns into 360 (90 MXFP4 blocks do not split 8 ways):
    // accepted, each rank keeping the codes of its columns and the scale of the block it shares.
    let opts = |tp| strata::model::LoadOptions { tp, ..Default::default() };
    for tp in [2, 4, 8] {
        AnyConfig::GptOss(c.clone()).check(&opts(tp)).unwrap_or_else(|e| panic!("--tp {tp}: {e}"));
    }
    let err = AnyConfig::GptOss(c.clone()).check(&opts(3)).unwrap_err().to_string();
    assert!(err.contains("num_attention_heads"), "{err}");
}

#[test]
fn llama_4_scout_routes_every_layer_and_chunks_its_rope_layers() {
    let AnyConfig::Llama4(c) = config("llama-4-scout-17b-16e") else { panic!("llama4 is a Llama 4 config") };
    assert_eq!((c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim), (48, 5120, 40, 8, 128));
    assert_eq!((c.num_experts, c.top_k, c.intermediate_size, c.vocab_size), (16, 1, 8192, 202_048));
    assert_eq!(c.tensor_prefix, "language_model.", "the wrapper's text model: language_model.model.*");
    assert!(c.layers.iter().all(|l| l.moe), "moe_layers 0..47");
    // no_rope_layers [1, 1, 1, 0] × 12: a 1 means the layer USES RoPE.
    let nope: Vec<usize> = (0..48).filter(|&i| !c.layers[i].rope).collect();
    assert_eq!(nope, (3..48).step_by(4).collect::<Vec<_>>());
    assert!(c.layers.iter().all(|l| l.chunk == l.rope.then_some(8192)), "the RoPE layers attend in chunks of 8192");
    assert!(c.qk_norm, "use_qk_norm: q and k normed after RoPE on the RoPE layers");
    let t = c.temperature.expect("attn_temperature_tuning: 4 (the hub's integer) is on");
    assert_eq!((t.floor_scale, t.attn_scale), (8192.0, 0.1));
    // llama3 scaling by 16 over 8192 original positions on base 5e5 (every frequency checked
    // against transformers' in the next test): the highest is kept, the lowest divided by 16.
    assert_eq!((c.rope_theta, c.rope().inv_freq[0]), (500_000.0, 1.0));
    let low = 500_000f32.powf(-126.0 / 128.0);
    assert!((c.rope().inv_freq[63] - low / 16.0).abs() < 1e-6 * low, "the lowest frequency divided by 16");
    let opts = |tp| strata::model::LoadOptions { tp, ..Default::default() };
    AnyConfig::Llama4(c.clone()).check(&opts(8)).expect("40 heads, 8 kv heads, 8192 expert columns over 8 ranks");
    let err = AnyConfig::Llama4(c.clone()).check(&opts(3)).unwrap_err().to_string();
    assert!(err.contains("num_attention_heads"), "{err}");
}

#[test]
fn llama_4_scouts_rope_is_transformers_table() {
    // Scout's rope_scaling has high_freq_factor == low_freq_factor (1.0): transformers
    // warns, keeps each frequency whose wavelength is at most 8192 / 1 and divides the
    // others by 16, with no smoothed band between.
    let text = std::fs::read_to_string(fixture("configs").join("llama-4-scout-17b-16e.json")).unwrap();
    let AnyConfig::Llama4(c) = AnyConfig::parse(&text).expect("transformers accepts it with a warning") else {
        panic!("llama4 is a Llama 4 config")
    };
    // The warning, as the binary prints it (a child process: what a test process logs is
    // shared by its threads). The directory has no weights: the run stops after the parse.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), &text).unwrap();
    std::fs::write(dir.path().join("data.jsonl"), "{\"input_ids\": [1, 2]}\n").unwrap();
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["extract", "--model"])
        .arg(dir.path())
        .arg("--data")
        .arg(dir.path().join("data.jsonl"))
        .arg("--out")
        .arg(dir.path().join("out"))
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&o.stderr);
    let warning = "`rope_parameters`'s high_freq_factor field must be greater than low_freq_factor, \
                   got high_freq_factor=1.0 and low_freq_factor=1.0";
    assert!(log.contains(warning) && log.contains("WARN"), "transformers' warning, as a warning: {log}");
    assert!(!log.contains("must exceed"), "refused: {log}");
    // scripts/make_scout_inv_freq.py: transformers 5.25.0's Llama4TextRotaryEmbedding for this file.
    let table = std::fs::read_to_string(fixture("configs").join("llama-4-scout-17b-16e.inv_freq.json")).unwrap();
    let table: serde_json::Value = serde_json::from_str(&table).unwrap();
    let floats = |k: &str| -> Vec<f64> { table[k].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect() };
    let (want, unscaled) = (floats("inv_freq"), floats("unscaled_inv_freq"));
    let divided: Vec<usize> =
        table["divided_by_factor"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
    assert_eq!((want.len(), divided.len()), (64, 29), "35 frequencies kept, 29 divided by 16");
    let got = c.rope().inv_freq;
    assert_eq!(got.len(), want.len());
    for i in 0..64 {
        let (g, w) = (got[i] as f64, want[i]);
        assert!((g - w).abs() <= 1e-6 * w, "inv_freq[{i}]: Strata {g:e}, transformers {w:e}");
        // The branch: Strata's value over the unscaled one is 1 or 1/16, as transformers'.
        let strata_divided = (g / unscaled[i] - 1.0 / 16.0).abs() < 1e-6;
        let strata_kept = (g / unscaled[i] - 1.0).abs() < 1e-6;
        assert!(strata_divided != strata_kept, "inv_freq[{i}] is neither kept nor divided by 16: {g:e}");
        assert_eq!(strata_divided, divided.contains(&i), "inv_freq[{i}]: a different branch from transformers'");
    }
}

#[test]
fn llama_4_maverick_alternates_dense_and_moe_layers_without_qk_norm() {
    let AnyConfig::Llama4(c) = config("llama-4-maverick-17b-128e") else { panic!("llama4 is a Llama 4 config") };
    assert_eq!((c.num_layers, c.num_experts, c.top_k, c.intermediate_size_mlp), (48, 128, 1, 16384));
    let moe: Vec<usize> = (0..48).filter(|&i| c.layers[i].moe).collect();
    assert_eq!(moe, (1..48).step_by(2).collect::<Vec<_>>(), "interleave_moe_layer_step 2: the odd layers route");
    assert!(!c.qk_norm, "use_qk_norm: false");
    assert_eq!((c.layers[3].rope, c.layers[3].chunk, c.layers[4].chunk), (false, None, Some(8192)));
    assert!(c.temperature.is_some(), "attn_temperature_tuning defaults to on");
    assert_eq!(c.max_position_embeddings, 1_048_576);
}

use strata::hf::qwen3_next::{InProj, LayerKind};

/// The full-attention layers of `types`.
fn full_layers(types: &[LayerKind]) -> Vec<usize> {
    (0..types.len()).filter(|&i| types[i] == LayerKind::Full).collect()
}

#[test]
fn qwen3_coder_next_is_a_grouped_deltanet_hybrid_with_512_experts() {
    let AnyConfig::Qwen3Next(c) = config("qwen3-coder-next") else { panic!("qwen3_next is a hybrid config") };
    assert_eq!(c.in_proj, InProj::Grouped, "in_proj_qkvz / in_proj_ba");
    assert_eq!((c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim), (48, 2048, 16, 2, 256));
    let l = c.linear;
    assert_eq!((l.k_heads, l.v_heads, l.k_dim, l.v_dim, l.conv_kernel), (16, 32, 128, 128, 4));
    assert_eq!(full_layers(&c.layer_types), (3..48).step_by(4).collect::<Vec<_>>());
    assert_eq!((c.rotary_dim, c.rope_theta), (64, 5e6), "a quarter of head_dim 256 rotated");
    let m = c.moe.as_ref().expect("512 experts");
    assert_eq!((m.experts, m.top_k, m.intermediate_size, m.shared_intermediate_size), (512, 10, 512, Some(512)));
    assert!(m.norm_topk_prob && m.sparse.iter().all(|&s| s), "every layer a mixture");
    assert_eq!((c.tensor_prefix.as_str(), c.vocab_size, c.max_position_embeddings), ("", 151_936, 262_144));
    let opts = |tp| strata::model::LoadOptions { tp, ..Default::default() };
    AnyConfig::Qwen3Next(c.clone()).check(&opts(8)).expect("16 key heads, 32 value heads, 16 heads over 8 ranks");
    let err = AnyConfig::Qwen3Next(c.clone()).check(&opts(32)).unwrap_err().to_string();
    assert!(err.contains("linear_num_key_heads 16"), "{err}");
}

#[test]
fn qwen3_5_moe_text_config_is_a_split_hybrid_whose_mrope_is_1d_on_text() {
    let AnyConfig::Qwen3Next(c) = config("qwen3.6-35b-a3b-text") else { panic!("qwen3_5_moe_text is a hybrid config") };
    assert_eq!(c.in_proj, InProj::Split, "in_proj_qkv / in_proj_z / in_proj_b / in_proj_a");
    assert_eq!((c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim), (40, 2048, 16, 2, 256));
    assert_eq!(full_layers(&c.layer_types).len(), 10);
    let m = c.moe.as_ref().expect("256 experts");
    assert_eq!((m.experts, m.top_k, m.shared_intermediate_size), (256, 8, Some(512)));
    assert!(m.norm_topk_prob, "Qwen3.5-MoE's router always renormalises");
    // mrope_section [11, 11, 10] covers the 32 rotated pairs; on text the three
    // components are the one position, so it is RoPE over the first 64 columns.
    assert_eq!((c.rotary_dim, c.rope_theta), (64, 1e7));
    let f = c.rope_freqs();
    assert_eq!(f.inv_freq.len(), 32);
    assert!((f.inv_freq[1] - 1e7f32.powf(-2.0 / 64.0)).abs() < 1e-9);
}

#[test]
fn qwen3_5_9b_is_the_dense_wrapper_under_model_language_model() {
    let AnyConfig::Qwen3Next(c) = config("qwen3.5-9b") else { panic!("qwen3_5 is a hybrid config") };
    assert_eq!(c.model_type, "qwen3_5");
    assert_eq!(c.tensor_prefix, "model.language_model.", "the text model's tensors");
    assert!(c.moe.is_none(), "dense");
    assert_eq!((c.num_layers, c.hidden_size, c.intermediate_size, c.num_kv_heads), (32, 4096, 12288, 4));
    assert_eq!(full_layers(&c.layer_types), vec![3, 7, 11, 15, 19, 23, 27, 31]);
    assert_eq!(c.rotary_dim, 64);
}

#[test]
fn a_hybrids_sequence_state_is_counted() {
    // Qwen3-Coder-Next: 36 Gated DeltaNet layers, each keeping 32 × 128 × 128 f32 of
    // recurrent state (2 MiB), the conv's last 3 inputs of 2·16·128 + 32·128 channels,
    // and up to 64 prepared rows (those channels, g and β of 32 heads) of an unfinished chunk.
    let c = config("qwen3-coder-next");
    assert_eq!(c.sequence_state_bytes(), 36 * 4 * (32 * 128 * 128 + 3 * 8192 + 64 * (8192 + 64)));
    assert_eq!(config("qwen3-30b-a3b").sequence_state_bytes(), 0, "attention keeps keys and values only");
}
