//! (d) A million samples (issue 14, point 5): the writer's cost per sample must
//! stay flat from 10^4 to 10^6 samples, and the duplicate-id check's memory bounded.
//!
//! Tiny samples (1–4 tokens, L = 2 capture layers, H = 8, bf16 storage, ids
//! `s{i}`) are generated as JSON Lines on the fly, parsed by `JsonlSource`,
//! checked by `Checked` (vocabulary, lengths, duplicate ids through a hash set
//! of id digests) and written by `StrataSink` with small shards (256 KiB by
//! default) into a temporary directory under `target/`. Each shard is
//! fsynced, journaled and renamed as in a real run; `finish` compacts the
//! journal into `manifest.json`.
//!
//! Per size it prints the median over its repetitions of: ns per sample of the
//! write loop (source + checks + sink), of which the sink's `write_sample`
//! alone (shard closes included); ns per sample including `finish`; the
//! `finish` time; shards; `manifest.json` bytes; and the peak RSS of the run
//! (VmHWM, reset before each run where the kernel allows) above the RSS it
//! started from. A second table splits the loop into the calls that close a
//! shard and the rest, and a third gives the curve within each run (ns per
//! sample over each tenth of its samples, as the id set, manifest, journal and
//! directory grow). The ratio of the per-sample cost at the largest size to
//! the smallest is checked against 1.5×.
//!
//!     cargo bench --bench million [-- --max 100000 --shard-size 262144 --reps 3 --dir /dev/shm]
//!
//! `MILLION_MAX`, `MILLION_SHARD_SIZE`, `MILLION_REPS` and `MILLION_DIR` do the same as the flags.
//! `--dir` on a tmpfs (where fsync costs nothing) shows the writer's own CPU cost apart from the disk's.

/// Large buffers on cache lines, as the `strata` binary has them.
#[global_allocator]
static ALLOC: strata::backend::cpu::CacheAligned = strata::backend::cpu::CacheAligned;

use std::io::{BufReader, Read};
use std::path::Path;
use std::time::Instant;
use strata::format::manifest::{Manifest, ModelInfo, MANIFEST};
use strata::pipeline::capture::CapturePoint;
use strata::pipeline::source::{Checked, Expected, JsonlSource, Limits, Source};
use strata::shape::{CapturedStates, DType};
use strata::sink::{OpenMode, Sink, StrataSink};
use strata_testkit::bench::{median, status_kib};

const LAYERS: usize = 2;
const HIDDEN: usize = 8;
const VOCAB: u32 = 32_000;
const MAX_TOKENS: usize = 4;

/// An endless-looking JSON Lines input of `n` tiny samples, produced as it is read.
struct Lines {
    next: usize,
    n: usize,
    line: Vec<u8>,
    pos: usize,
}

impl Lines {
    fn new(n: usize) -> Self {
        Lines { next: 0, n, line: Vec::new(), pos: 0 }
    }

    /// Token count of sample `i`: 1 to 4, spread by a multiplicative hash.
    fn tokens(i: usize) -> usize {
        1 + ((i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 62) as usize
    }

    fn fill(&mut self) {
        use std::fmt::Write;
        let i = self.next;
        self.next += 1;
        let t = Self::tokens(i);
        let mut s = String::with_capacity(96);
        let _ = write!(s, "{{\"id\":\"s{i}\",\"input_ids\":[");
        for k in 0..t {
            let tok = (i as u64 * 31 + k as u64 * 7) % VOCAB as u64;
            let _ = write!(s, "{}{tok}", if k == 0 { "" } else { "," });
        }
        s.push_str("],\"loss_mask\":[");
        for k in 0..t {
            s.push_str(if k == 0 { "0" } else { ",1" });
        }
        s.push_str("]}\n");
        self.line = s.into_bytes();
        self.pos = 0;
    }
}

impl Read for Lines {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        let mut done = 0;
        while done < out.len() {
            if self.pos == self.line.len() {
                if self.next == self.n {
                    break;
                }
                self.fill();
            }
            let k = (self.line.len() - self.pos).min(out.len() - done);
            out[done..done + k].copy_from_slice(&self.line[self.pos..self.pos + k]);
            self.pos += k;
            done += k;
        }
        Ok(done)
    }
}

/// Resets VmHWM to the current RSS (Linux 4.0+); false where refused.
fn reset_peak() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

struct Run {
    loop_s: f64,
    sink_s: f64,
    // Time in the `write_sample` calls that closed a shard.
    close_s: f64,
    // Mean µs of such a call over the run's first and last tenth of shards.
    close_us: (f64, f64),
    finish_s: f64,
    shards: usize,
    manifest_bytes: u64,
    peak_mib: f64,
    // The same before `finish`.
    loop_peak_mib: f64,
    // Loop ns per sample over each tenth of the samples.
    tenth_ns: Vec<f64>,
}

fn run(n: usize, base: &Path, shard_size: u64, states: &[CapturedStates<usize, usize>]) -> Run {
    let dir = tempfile::tempdir_in(base).unwrap();
    let points = [CapturePoint::LayerInput(1), CapturePoint::FinalPreNorm];
    let model = ModelInfo {
        path: "<bench>".into(),
        architecture: "llama".into(),
        config_hash: "xxh3:0000000000000000".into(),
        weights_digest: String::new(),
        num_layers: 2,
        hidden_size: HIDDEN,
        vocab_size: VOCAB as usize,
    };
    let manifest = Manifest::new(model, &points, DType::BF16, shard_size);
    let limits = Limits { vocab_size: VOCAB as usize, max_tokens: MAX_TOKENS, max_tokens_from: "the bench".into() };

    let before = status_kib("VmRSS:");
    let exact = reset_peak();
    let t0 = Instant::now();
    let mut sink = StrataSink::open(dir.path(), manifest, LAYERS, HIDDEN, OpenMode::Create).unwrap();
    let jsonl = JsonlSource::new("<generated>".into(), BufReader::with_capacity(64 << 10, Lines::new(n)));
    let mut source = Checked::new(jsonl, "<generated>".into(), limits, Expected::default());
    let mut sink_s = 0.0;
    let mut count = 0usize;
    // Calls that closed a shard (fsync, journal line, rename), timed apart, in order.
    let mut closes = Vec::with_capacity(n / 8);
    // Loop time at each tenth of the samples: the curve within the run, as the
    // id set, the manifest, the journal and the directory grow.
    let mut tenths = Vec::with_capacity(10);
    for s in source.by_ref() {
        let s = s.unwrap();
        let shards = sink.manifest().shards.len();
        let t = Instant::now();
        sink.write_sample(&s, states[s.len() - 1].view()).unwrap();
        let dt = t.elapsed().as_secs_f64();
        sink_s += dt;
        if sink.manifest().shards.len() != shards {
            closes.push(dt);
        }
        count += 1;
        if count.is_multiple_of(n / 10) {
            tenths.push(t0.elapsed().as_secs_f64());
        }
    }
    let loop_s = t0.elapsed().as_secs_f64();
    let peak_loop = status_kib("VmHWM:");
    let t = Instant::now();
    sink.finish(source.consumed()).unwrap();
    let finish_s = t.elapsed().as_secs_f64();
    assert_eq!(count, n);
    let peak = status_kib("VmHWM:");
    let shards = sink.manifest().shards.len();
    assert_eq!(sink.manifest().shards.iter().map(|s| s.samples).sum::<usize>(), n);
    drop(sink);
    drop(source);
    let manifest_bytes = std::fs::metadata(dir.path().join(MANIFEST)).unwrap().len();
    // Removing the shards is outside the timed region, and made durable before the
    // next run (its journal commit, and the discards of a `discard` mount, would
    // otherwise land on that run's first fsyncs).
    drop(dir);
    let _ = std::fs::File::open(base).and_then(|d| d.sync_all());
    let _ = std::process::Command::new("sync").status();
    let above = |p: u64| if exact { p.saturating_sub(before) as f64 / 1024.0 } else { p as f64 / 1024.0 };
    let (peak_mib, loop_peak_mib) = (above(peak), above(peak_loop));
    let close_s: f64 = closes.iter().sum();
    let tenth = (closes.len() / 10).max(1);
    let mean_us = |c: &[f64]| c.iter().sum::<f64>() * 1e6 / c.len().max(1) as f64;
    let close_us =
        (mean_us(&closes[..tenth.min(closes.len())]), mean_us(&closes[closes.len().saturating_sub(tenth)..]));
    let tenth_ns = tenths.iter().scan(0.0, |prev, &t| Some((t - std::mem::replace(prev, t)) * 1e9 * 10.0 / n as f64));
    let tenth_ns = tenth_ns.collect();
    Run { loop_s, sink_s, close_s, close_us, finish_s, shards, manifest_bytes, peak_mib, loop_peak_mib, tenth_ns }
}

fn arg(args: &[String], flag: &str, env: &str) -> Option<u64> {
    let v = args.iter().position(|a| a == flag).map(|i| args[i + 1].clone()).or_else(|| std::env::var(env).ok())?;
    Some(v.replace('_', "").parse().unwrap_or_else(|_| panic!("{flag} / {env}: not a number: {v}")))
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--list") {
        return; // `cargo test --benches` lists benches; nothing to list here
    }
    let max = arg(&args, "--max", "MILLION_MAX").unwrap_or(1_000_000) as usize;
    let shard_size = arg(&args, "--shard-size", "MILLION_SHARD_SIZE").unwrap_or(256 << 10);
    let reps = arg(&args, "--reps", "MILLION_REPS").map(|r| r.max(1) as usize);
    let sizes: Vec<usize> = [10_000, 100_000, 1_000_000].into_iter().filter(|&n| n <= max).collect();
    assert!(!sizes.is_empty(), "--max {max} is below the smallest size, 10000");

    // The states of a sample of t tokens: [2, t, 8], finite, different per entry.
    let states: Vec<CapturedStates<usize, usize>> = (1..=MAX_TOKENS)
        .map(|t| {
            let v = (0..LAYERS * t * HIDDEN).map(|k| (k as f32 * 0.37).sin()).collect();
            CapturedStates::try_from_vec(v, LAYERS, t, HIDDEN).unwrap()
        })
        .collect();
    let base = args
        .iter()
        .position(|a| a == "--dir")
        .map(|i| args[i + 1].clone())
        .or_else(|| std::env::var("MILLION_DIR").ok())
        .map_or_else(|| std::env::current_dir().unwrap().join("target"), std::path::PathBuf::from);
    std::fs::create_dir_all(&base).unwrap();

    println!("(d) {} samples of 1-4 tokens, L={LAYERS}, H={HIDDEN}, bf16, ids s{{i}}", sizes.last().unwrap());
    println!("    source: generated JSON Lines -> JsonlSource -> Checked (unique-id digests)");
    println!("    sink:   StrataSink, shard_size {} KiB, into {}", shard_size >> 10, base.display());
    println!("    loop = source + checks + write_sample (shard close: fsync, journal, rename);");
    println!("    sink = write_sample alone; +finish = loop + finish (journal compacted into manifest.json);");
    println!("    peak = VmHWM during the run above the RSS it started from; medians over the runs");
    println!();
    println!(
        "{:>9} {:>4} {:>8} {:>9} {:>9} {:>10} {:>8} {:>7} {:>10} {:>9} {:>8}",
        "samples",
        "runs",
        "total s",
        "loop ns",
        "sink ns",
        "+finish ns",
        "finish s",
        "shards",
        "manifest",
        "peak MiB",
        "B/sample"
    );
    let mut per_sample = Vec::new();
    let mut breakdown = Vec::new();
    let mut curve = Vec::new();
    for &n in &sizes {
        let runs = reps.unwrap_or(if n >= 1_000_000 { 1 } else { 3 });
        let results: Vec<Run> = (0..runs).map(|_| run(n, &base, shard_size, &states)).collect();
        let m = |f: &dyn Fn(&Run) -> f64| median(results.iter().map(f).collect());
        let (loop_s, sink_s, finish_s) = (m(&|r| r.loop_s), m(&|r| r.sink_s), m(&|r| r.finish_s));
        let total = m(&|r| r.loop_s + r.finish_s);
        let peak = m(&|r| r.peak_mib);
        let ns = |s: f64| s * 1e9 / n as f64;
        println!(
            "{n:>9} {runs:>4} {total:>8.2} {:>9.0} {:>9.0} {:>10.0} {finish_s:>8.3} {:>7} {:>10} {peak:>9.1} {:>8.0}",
            ns(loop_s),
            ns(sink_s),
            ns(total),
            results[0].shards,
            results[0].manifest_bytes,
            peak * (1 << 20) as f64 / n as f64,
        );
        per_sample.push((n, ns(loop_s), ns(total)));
        let shards = results[0].shards as f64;
        let close = m(&|r| r.close_s);
        breakdown.push(format!(
            "{n:>9} {:>8.1} {:>12.0} {:>13.0} {:>13.0} {:>13.0} {:>13.1}",
            n as f64 / shards,
            ns(loop_s - close),
            close * 1e6 / shards,
            m(&|r| r.close_us.0),
            m(&|r| r.close_us.1),
            m(&|r| r.loop_peak_mib),
        ));
        let tenths: Vec<String> = (0..10).map(|k| format!("{:>7.0}", m(&|r| r.tenth_ns[k]))).collect();
        curve.push(format!("{n:>9} {}", tenths.join("")));
    }
    println!();
    println!("    where the time goes: samples per shard; loop ns per sample outside the calls that close a shard;");
    println!("    µs per shard-closing `write_sample` call, overall and over the first and last tenth of the shards;");
    println!("    peak RSS before `finish` (the rest of the peak is `finish` serialising the whole manifest)");
    println!(
        "{:>9} {:>8} {:>12} {:>13} {:>13} {:>13} {:>13}",
        "samples", "per shard", "rest ns", "close µs", "first 10% µs", "last 10% µs", "loop peak MiB"
    );
    breakdown.iter().for_each(|l| println!("{l}"));
    println!();
    println!("    the curve within each run: loop ns per sample over each tenth of its samples");
    println!("{:>9} {}", "samples", (1..=10).map(|k| format!("{:>7}", format!("{k}0%"))).collect::<String>());
    curve.iter().for_each(|l| println!("{l}"));
    if let (Some(first), Some(last)) = (per_sample.first(), per_sample.last()) {
        if per_sample.len() > 1 {
            let (r_loop, r_total) = (last.1 / first.1, last.2 / first.2);
            let verdict = if r_loop.max(r_total) <= 1.5 { "PASS" } else { "FAIL" };
            println!();
            println!(
                "    per-sample cost {} / {}: loop {r_loop:.2}x, with finish {r_total:.2}x (limit 1.5x): {verdict}",
                last.0, first.0
            );
        }
    }
}
