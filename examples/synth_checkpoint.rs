//! Writes a random-weight checkpoint and random tokens for the benches and
//! `scripts/bench_vs_torch.py`:
//!
//! - default: the `small` Llama (hidden 1024, 8 layers, 16/4 heads, MLP 2816,
//!   vocab 32000) and 4 × 512 tokens;
//! - `--moe`: a Kimi-K2-shaped DeepSeek-V3 model (hidden 1024, 4 layers with a
//!   dense first one, MLA with K2's head sizes, 64 experts × 512, top-8, one
//!   shared expert, vocab 32000).
//!
//!     cargo run --release --example synth_checkpoint -- DIR [--dtype f32|bf16] [--moe] [--samples N]

use strata::shape::DType;
use strata_testkit::{write_deepseek_stored, write_llama, write_tokens, DeepseekSpec, LlamaSpec, Storage};

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: synth_checkpoint DIR [--dtype f32|bf16] [--moe] [--samples N]";
    let dir = std::path::Path::new(args.first().expect(usage));
    let value = |flag: &str| args.iter().position(|a| a == flag).map(|i| args.get(i + 1).expect(usage).as_str());
    let bf16 = match value("--dtype").unwrap_or("f32") {
        "f32" => false,
        "bf16" => true,
        other => panic!("--dtype {other}: {usage}"),
    };
    let samples: usize = value("--samples").map_or(4, |v| v.parse().expect(usage));
    let vocab = if args.iter().any(|a| a == "--moe") {
        let spec = DeepseekSpec {
            model_type: "deepseek_v3",
            hidden_size: 1024,
            num_layers: 4,
            num_heads: 16,
            q_lora_rank: 512,
            kv_lora_rank: 512,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128,
            intermediate_size: 2816,
            n_routed_experts: 64,
            n_shared_experts: 1,
            num_experts_per_tok: 8,
            moe_intermediate_size: 512,
            first_k_dense_replace: 1,
            vocab_size: 32000,
        };
        let storage = if bf16 { Storage::Bf16 } else { Storage::F32 };
        write_deepseek_stored(dir, &spec, storage, false, 7)?;
        spec.vocab_size
    } else {
        let spec = LlamaSpec::small();
        write_llama(dir, &spec, if bf16 { DType::BF16 } else { DType::F32 }, 7)?;
        spec.vocab_size
    };
    write_tokens(&dir.join("tokens.jsonl"), vocab, &vec![512; samples], 11)?;
    eprintln!("wrote {}", dir.display());
    Ok(())
}
