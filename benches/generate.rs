//! `strata generate` against transformers' `generate` on the bench `small`
//! Llama (f32 checkpoint: hidden 1024, 8 layers, 16/4 heads, vocab 32000),
//! greedy, EOS ignored, 128 new tokens per prompt of 64 tokens, with 1 and
//! 32 sequences in flight (transformers: batches of 1 and of 32). Generated
//! tokens/s on both sides exclude the model load: Strata's is its run's own
//! figure (first step to last row written, states captured and written),
//! PyTorch's times `generate` alone (`scripts/bench_generate_torch.py`,
//! sdpa, the checkpoint's dtype, the faster of the dynamic and static
//! caches). Also the one-pass cost: Strata with states (eagle3, bf16
//! storage) against `--no-states`. Medians of `--runs` runs.
//!
//!     cargo bench --bench generate [-- --runs 3 --threads 2 --python venv/bin/python]
//!
//! Needs Python with torch and transformers for the PyTorch side (skipped,
//! saying so, without them).

use std::path::Path;
use std::process::Command;

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).map(|i| args[i + 1].clone())
}

/// Strata's generated tokens/s: `generated N tokens in S s (R tokens/s` from its summary.
fn strata(model: &Path, prompts: &Path, seqs: usize, threads: &str, extra: &[&str]) -> f64 {
    let out = tempfile::tempdir().unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_strata"))
        .env("RAYON_NUM_THREADS", threads)
        .arg("generate")
        .arg("--model")
        .arg(model)
        .arg("--data")
        .arg(prompts)
        .arg("--out")
        .arg(out.path().join("o"))
        .args(["--temperature", "0", "--ignore-eos", "--max-tokens", "128", "--seed", "1"])
        .args(["--max-num-seqs", &seqs.to_string(), "--dtype", "bf16", "--capture", "eagle3"])
        .args(extra)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let at = stdout.find("tokens/s;").expect("the summary's rate");
    let head = &stdout[..at];
    head[head.rfind('(').unwrap() + 1..].trim().parse().unwrap()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let runs: usize = arg(&args, "--runs").map_or(3, |r| r.parse().unwrap());
    let threads = arg(&args, "--threads").unwrap_or_else(|| "2".into());
    let python = arg(&args, "--python").unwrap_or_else(|| "python3".into());
    let model = strata_testkit::bench_small_dir().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let mut rng = strata_testkit::Rng::new(5);
    let mut rows = Vec::new();
    for (seqs, prompts) in [(1usize, 2usize), (32, 32)] {
        let path = tmp.path().join(format!("prompts-{seqs}.jsonl"));
        let text: String = (0..prompts)
            .map(|_| {
                let ids: Vec<u32> = (0..64).map(|_| 1 + (rng.next_u64() % 31999) as u32).collect();
                format!("{}\n", serde_json::json!({ "input_ids": ids }))
            })
            .collect();
        std::fs::write(&path, text).unwrap();
        let (mut with, mut without) = (vec![], vec![]);
        for _ in 0..runs {
            with.push(strata(&model, &path, seqs, &threads, &[]));
            without.push(strata(&model, &path, seqs, &threads, &["--no-states"]));
        }
        let torch = Command::new(&python)
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/bench_generate_torch.py"))
            .arg(&model)
            .arg(&path)
            .args(["--batch", &seqs.to_string(), "--new", "128", "--runs", &runs.to_string()])
            .args(["--threads", &threads])
            .output();
        let torch = match torch {
            Ok(o) if o.status.success() => {
                let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
                let best = v["dynamic"].as_f64().unwrap().max(v["static"].as_f64().unwrap());
                Some((best, v))
            }
            Ok(o) => {
                println!("PyTorch side skipped: {}", String::from_utf8_lossy(&o.stderr).lines().last().unwrap_or(""));
                None
            }
            Err(e) => {
                println!("PyTorch side skipped: {python}: {e}");
                None
            }
        };
        let (w, n) = (median(with), median(without));
        let t = torch.as_ref().map_or("skipped".to_string(), |(best, _)| format!("{best:.1} tokens/s"));
        println!("{seqs} in flight: strata {w:.1} tokens/s with states, {n:.1} without; transformers {t}");
        rows.push((seqs, w, n, torch));
    }
    println!();
    println!(
        "bench small Llama (f32), 64-token prompts, 128 new tokens, greedy, {threads} threads, medians of {runs} runs"
    );
    println!("| in flight | transformers generate (sdpa, f32) tokens/s | Strata tokens/s (states) | ratio | Strata --no-states | states / no-states time |");
    println!("|---|---|---|---|---|---|");
    for (seqs, w, n, torch) in rows {
        let (t, ratio) = match &torch {
            Some((best, v)) => (
                format!(
                    "{best:.1} (dynamic {:.1}, static {:.1}; torch {})",
                    v["dynamic"].as_f64().unwrap_or(0.0),
                    v["static"].as_f64().unwrap_or(0.0),
                    v["torch"].as_str().unwrap_or("?")
                ),
                format!("{:.2}x", w / best),
            ),
            None => ("skipped".into(), "-".into()),
        };
        println!("| {seqs} | {t} | {w:.1} | {ratio} | {n:.1} | {:.3}x |", n / w);
    }
}
