//! (c) Peak memory of `strata extract` for 100 and 1,000 samples of the same
//! length distribution (100–400 tokens) on a random `medium` Llama (hidden
//! 512, 4 layers, MLP 1408, vocab 8000): streaming keeps it flat.
//!
//!     cargo bench --bench memory

/// Large buffers on cache lines, as the `strata` binary has them.
#[global_allocator]
static ALLOC: strata::backend::cpu::CacheAligned = strata::backend::cpu::CacheAligned;

use std::process::Command;
use strata::shape::DType;
use strata_testkit::{write_llama, write_tokens, LlamaSpec, Rng};

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let dir = std::env::temp_dir().join("strata-bench-medium");
    let spec = LlamaSpec {
        hidden_size: 512,
        num_layers: 4,
        num_heads: 8,
        num_kv_heads: 2,
        intermediate_size: 1408,
        vocab_size: 8000,
    };
    if !dir.join("config.json").exists() {
        write_llama(&dir, &spec, DType::F32, 3).unwrap();
    }
    let mut peaks = Vec::new();
    for n in [100usize, 1000] {
        let mut rng = Rng::new(17);
        let lens: Vec<usize> = (0..n).map(|_| 100 + rng.below(301) as usize).collect();
        let data = dir.join(format!("tokens-{n}.jsonl"));
        write_tokens(&data, spec.vocab_size, &lens, 23).unwrap();
        let out = tempfile::tempdir_in(std::env::current_dir().unwrap().join("target")).unwrap();
        let o = Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(["extract", "--capture", "eagle3", "--dtype", "bf16", "--overwrite", "--model"])
            .arg(&dir)
            .arg("--data")
            .arg(&data)
            .arg("--out")
            .arg(out.path())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&o.stdout).to_string();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let peak: f64 = text
            .lines()
            .find(|l| l.contains("peak memory"))
            .and_then(|l| l.split_whitespace().nth(2))
            .and_then(|v| v.parse().ok())
            .expect("summary reports peak memory");
        let tokens: usize = lens.iter().sum();
        println!("(c) {n:>5} samples, {tokens:>7} tokens: peak RSS {peak:.0} MiB");
        peaks.push(peak);
    }
    println!("    ratio 1000/100: {:.2}", peaks[1] / peaks[0]);
}
