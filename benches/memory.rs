//! (c) Peak memory of `strata extract` for 100 and 1,000 samples of the same
//! length distribution (100–400 tokens) on a random `medium` Llama (hidden
//! 512, 4 layers, MLP 1408, vocab 8000): streaming keeps it flat.
//!
//! (d) Memory per sample of the writers and of `merge`: peak RSS of `strata
//! extract` over 4,000 and 40,000 short samples (4–32 tokens) of the
//! `llama-default` fixture, in each format, and of `strata merge` over the
//! same inputs written as 4 parts; the median of `--reps` runs (default 3)
//! and the bytes per sample between the two sizes. `STRATA_BIN` measures
//! another build of the binary (an older commit's) the same way.
//!
//! (generate) `strata generate`'s cache flag: 256 conversations of 512 new
//! tokens each (no stop ids) on a Llama of hidden 256, 4 layers, 8 KV heads
//! (8 KiB of cache per position), `--kv-cache-memory` a quarter of what they
//! need at once; prints the cache's high-water mark and the peak RSS against
//! the flag + the weights + 256 MiB, and fails past it (`tests/generate.rs`
//! runs the same check at 1 KiB per position).
//!
//!     cargo bench --bench memory [-- --only d|generate --reps 3]

/// Large buffers on cache lines, as the `strata` binary has them.
#[global_allocator]
static ALLOC: strata::backend::cpu::CacheAligned = strata::backend::cpu::CacheAligned;

use std::process::Command;
use strata::shape::DType;
use strata_testkit::bench::{flag, flag_or, median};
use strata_testkit::{write_llama, write_tokens, LlamaSpec, Rng};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--list") {
        return;
    }
    let reps: usize = flag_or("--reps", 3);
    match flag("--only").as_deref() {
        Some("c") => peak_by_length(),
        Some("d") => per_sample(reps),
        Some("generate") => generation_bound(),
        _ => {
            peak_by_length();
            per_sample(reps);
        }
    }
}

/// The binary measured: `STRATA_BIN`, else this build's.
fn strata_bin() -> std::path::PathBuf {
    std::env::var_os("STRATA_BIN").map_or_else(|| env!("CARGO_BIN_EXE_strata").into(), Into::into)
}

/// Runs `cmd` to its end; its peak RSS in KiB (from wait4's rusage, this child's alone).
#[allow(clippy::zombie_processes)] // reaped by wait4 below, which std's Child does not know of
fn peak_kib(mut cmd: Command) -> u64 {
    let child = cmd.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::piped()).spawn().unwrap();
    let pid = child.id() as libc::pid_t;
    let mut err = child.stderr.unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut err, &mut s).unwrap();
        s
    });
    let mut status = 0;
    // SAFETY: wait4 on our own child, with pointers to locals.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let r = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    let err = reader.join().unwrap();
    assert!(r == pid && libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "{err}");
    usage.ru_maxrss as u64
}

/// (d): see the module's doc.
fn per_sample(reps: usize) {
    let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama-default");
    let work = std::env::current_dir().unwrap().join("target/bench-memory-d");
    std::fs::create_dir_all(&work).unwrap();
    let sizes = [4000usize, 40000];
    for &n in &sizes {
        let mut rng = Rng::new(5);
        let lens: Vec<usize> = (0..n).map(|_| 4 + rng.below(29) as usize).collect();
        let data = work.join(format!("tokens-{n}.jsonl"));
        if !data.exists() {
            write_tokens(&data, 256, &lens, 29).unwrap();
        }
    }
    println!("(d) peak RSS (median of {reps}), {}:", strata_bin().display());
    for format in ["strata", "speculators"] {
        let mut peaks = Vec::new();
        let mut merged = Vec::new();
        for &n in &sizes {
            let data = work.join(format!("tokens-{n}.jsonl"));
            let out = work.join(format!("out-{format}-{n}"));
            // A fresh directory each run: what is measured is the writer, not an --overwrite's reading of the last run.
            let extract = |out: &std::path::Path, part: Option<usize>| {
                if part.is_none() {
                    let _ = std::fs::remove_dir_all(out);
                }
                let mut cmd = Command::new(strata_bin());
                cmd.args(["extract", "--format", format, "--model"]).arg(&model);
                cmd.arg("--data").arg(&data).arg("--out").arg(out);
                if let Some(i) = part {
                    cmd.args(["--num-parts", "4", "--part-index", &i.to_string()]);
                }
                cmd
            };
            peaks.push(median((0..reps).map(|_| peak_kib(extract(&out, None))).collect()));
            // The same input in 4 parts, then merged.
            let parts = work.join(format!("parts-{format}-{n}"));
            let _ = std::fs::remove_dir_all(&parts);
            (0..4).for_each(|i| {
                peak_kib(extract(&parts, Some(i)));
            });
            merged.push(median(
                (0..reps)
                    .map(|_| {
                        let mut cmd = Command::new(strata_bin());
                        cmd.arg("merge").arg(&parts);
                        peak_kib(cmd)
                    })
                    .collect(),
            ));
        }
        for (what, v) in [("extract", &peaks), ("merge", &merged)] {
            let per = (v[1] as f64 - v[0] as f64) * 1024.0 / (sizes[1] - sizes[0]) as f64;
            let mib = |k: u64| k as f64 / 1024.0;
            println!(
                "    {format:<11} {what:<7} {:>6.1} MiB at {}, {:>6.1} MiB at {}: {per:>6.0} bytes per sample",
                mib(v[0]),
                sizes[0],
                mib(v[1]),
                sizes[1]
            );
        }
    }
}

/// (c): see the module's doc.
fn peak_by_length() {
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

/// (generate): the bounded-memory run of `strata generate` at 8 KiB of cache per position.
fn generation_bound() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = LlamaSpec {
        hidden_size: 256,
        num_layers: 4,
        num_heads: 8,
        num_kv_heads: 8,
        intermediate_size: 512,
        vocab_size: 512,
    };
    let chat = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat");
    let case = strata_testkit::generation_memory_case(tmp.path(), &chat, &spec).unwrap();
    let t = std::time::Instant::now();
    let run = case.run(&strata_bin(), &tmp.path().join("out"));
    let flag = case.flag as f64;
    println!(
        "generate: 256 conversations x 512 new tokens, --kv-cache-memory {:.1} MiB (a quarter of their need), \
         weights {:.1} MiB: {run} ({:.1}% of the flag), {:.0} s",
        flag / (1 << 20) as f64,
        case.weights as f64 / (1 << 20) as f64,
        100.0 * run.high_water / flag,
        t.elapsed().as_secs_f64()
    );
    assert!(run.lines == 256 && run.high_water <= flag && run.high_water >= 0.9 * flag, "{run}");
    assert!(run.peak_mib <= run.bound_mib, "{run}");
}
