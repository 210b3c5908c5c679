//! Writes the random-weight `small` Llama checkpoint and 4 × 512 random tokens
//! used by `benches/forward.rs` and `scripts/bench_vs_torch.py`.
//!
//!     cargo run --release --example synth_checkpoint -- DIR

use strata::shape::DType;
use strata_testkit::{write_llama, write_tokens, LlamaSpec};

fn main() -> std::io::Result<()> {
    let dir = std::env::args().nth(1).expect("usage: synth_checkpoint DIR");
    let dir = std::path::Path::new(&dir);
    let spec = LlamaSpec::small();
    write_llama(dir, &spec, DType::F32, 7)?;
    write_tokens(&dir.join("tokens.jsonl"), spec.vocab_size, &[512; 4], 11)?;
    eprintln!("wrote {}", dir.display());
    Ok(())
}
