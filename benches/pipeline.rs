//! (a) End-to-end overhead: the pipeline (parse, schedule, forward, capture,
//!     gather, convert, checksum, write, fsync) against the bare forward on the
//!     same tokens, `small` Llama shape, 4 × 512 tokens, EAGLE-3 points, bf16.
//! (b) Writer throughput: the native and the speculators sink writing captured
//!     f32 states (as bf16 and as f32) against a plain sequential write + fsync
//!     of the same bytes to the same disk.
//!
//! Runs are interleaved (A, B, A, B, ...) so machine noise hits both sides;
//! medians and their ratio are printed. Each writer case also prints the
//! time its `finish` took (the sink's time includes it) and the time its
//! encoding takes alone on the caller's thread (no disk). The ratio is the
//! median of the runs' paired ratios (each sink run against the plain write
//! next to it); the medians of each side are printed as well.
//!
//!     cargo bench --bench pipeline [-- --runs N] [--reps R] [--only pipeline,native,speculators:fp8,...]
//!
//! `--reps R` writes the 4 samples R times per run (16: 256 MiB of bf16).
//! A burst of a few hundred MiB measures the writer against the disk's
//! write cache; some virtual disks sustain a fraction of that over GiBs.
//!
//! `--only` keeps the listed parts: `pipeline` is (a); a writer case is
//! named by its format (`native`, `speculators`) or `format:dtype`.

/// Large buffers on cache lines, as the `strata` binary has them.
#[global_allocator]
static ALLOC: strata::backend::cpu::CacheAligned = strata::backend::cpu::CacheAligned;

use std::io::Write;
use std::path::Path;
use std::time::Instant;
use strata::format::manifest::{Manifest, ModelInfo};
use strata::hf::llama::LlamaConfig;
use strata::job::Pipeline;
use strata::model::Llama;
use strata::pipeline::batch::PackedBatch;
use strata::pipeline::capture::{CapturePoint, CaptureSet};
use strata::pipeline::source::{JsonlSource, Sample};
use strata::shape::DType;
use strata::sink::{OpenMode, Sink, SpeculatorsSink, StrataSink, DEFAULT_SHARD_SIZE};
use strata_testkit::bench::{flag_or, median};

fn sink(
    dir: &Path,
    config: &LlamaConfig,
    config_text: &str,
    points: &[CapturePoint],
    dtype: DType,
) -> StrataSink<usize, usize> {
    let manifest =
        Manifest::new(ModelInfo::new("bench", &config.info(), config_text), points, dtype, DEFAULT_SHARD_SIZE);
    StrataSink::open(dir, manifest, points.len(), config.hidden_size, OpenMode::Overwrite).unwrap()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let runs: usize = flag_or("--runs", 5);
    if args.iter().any(|a| a == "--list") {
        return; // `cargo test --benches` lists benches; nothing to list here
    }
    let only: Option<Vec<String>> =
        args.iter().position(|a| a == "--only").map(|i| args[i + 1].split(',').map(str::to_string).collect());
    let wanted = |names: &[String]| only.as_ref().is_none_or(|o| o.iter().any(|w| names.contains(w)));
    let dir = strata_testkit::bench_small_dir().unwrap();
    let config_text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let config = LlamaConfig::from_json(&config_text).unwrap();
    let model: Llama = Llama::load(&dir).unwrap();
    let tokens_text = std::fs::read_to_string(dir.join("tokens.jsonl")).unwrap();
    let samples: Vec<Sample> = JsonlSource::new("t".into(), tokens_text.as_bytes()).map(|s| s.unwrap()).collect();
    let ntok: usize = samples.iter().map(|s| s.len()).sum();
    let points = CapturePoint::eagle3(config.num_layers);
    let set = CaptureSet::<usize>::try_new(points.clone()).unwrap();
    let out = tempfile::tempdir_in(std::env::current_dir().unwrap().join("target")).unwrap();

    // (a) pipeline vs bare forward.
    let batch = PackedBatch::from_samples(samples.iter().map(|s| s.input_ids.as_slice()));
    let (mut fwd, mut e2e) = (Vec::new(), Vec::new());
    let part_a = wanted(&["pipeline".to_string()]);
    for _ in 0..if part_a { runs } else { 0 } {
        let t = Instant::now();
        std::hint::black_box(model.forward(&batch, &set).unwrap());
        fwd.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        let source = JsonlSource::new("t".into(), tokens_text.as_bytes());
        let s = sink(out.path(), &config, &config_text, &points, DType::BF16);
        Pipeline::new(source).max_batch_tokens(ntok).model(&model).capture(set.clone()).sink(s).run().unwrap();
        e2e.push(t.elapsed().as_secs_f64());
    }
    if part_a {
        let (f, e) = (median(fwd), median(e2e));
        println!("(a) {ntok} tokens, {} capture points, bf16, {runs} interleaved runs", points.len());
        println!("    bare forward     {f:.3} s  ({:.0} tokens/s)", ntok as f64 / f);
        println!("    pipeline         {e:.3} s  ({:.0} tokens/s)", ntok as f64 / e);
        println!("    overhead         {:+.2}%", (e / f - 1.0) * 100.0);
    }

    // (b) writer vs plain sequential write of the same bytes.
    let states = model.forward(&batch, &set).unwrap();
    // R × 4 samples of [4, 512, 1024]
    let reps: usize = args.iter().position(|a| a == "--reps").map_or(16, |i| args[i + 1].parse().unwrap());
    let cases = [
        ("native", DType::BF16),
        ("native", DType::F32),
        ("native", DType::F8E4M3),
        ("speculators", DType::BF16),
        ("speculators", DType::F32),
        ("speculators", DType::F8E4M3),
    ];
    for (format, dtype) in cases {
        if !wanted(&[format.to_string(), format!("{format}:{dtype}")]) {
            continue;
        }
        let (mut sink_t, mut plain_t, mut finish_t) = (Vec::new(), Vec::new(), Vec::new());
        let mut bytes = 0u64;
        let per_sample = 4 * 512 * 1024 * dtype.size();
        // The exact hidden-state bytes the sink stores for each sample, [L, T, H].
        let blocks: Vec<Vec<u8>> = (0..samples.len())
            .map(|i| {
                let v = states.view_tokens(batch.range(i)).unwrap();
                let mut b = Vec::new();
                (0..4).for_each(|l| dtype.encode_into(v.layer(l), &mut b));
                assert_eq!(b.len(), per_sample);
                b
            })
            .collect();
        for run in 0..runs {
            // Alternate which side goes first; each writes into a fresh place and
            // its files are removed outside the timed region.
            for side in [run % 2, 1 - run % 2] {
                let target = out.path().join(format!("run{run}-{side}"));
                if side == 0 {
                    let t = Instant::now();
                    let mut s: Box<dyn Sink<usize, usize>> = if format == "native" {
                        Box::new(sink(&target, &config, &config_text, &points, dtype))
                    } else {
                        let manifest = Manifest::new(
                            ModelInfo::new("bench", &config.info(), &config_text),
                            &points,
                            dtype,
                            DEFAULT_SHARD_SIZE,
                        );
                        Box::new(SpeculatorsSink::open(&target, manifest, OpenMode::Overwrite).unwrap())
                    };
                    for r in 0..reps {
                        for (i, sm) in samples.iter().enumerate() {
                            let index = r * samples.len() + i;
                            let sample = Sample { id: format!("{r}-{i}"), index, ..sm.clone() };
                            s.write_sample(&sample, states.view_tokens(batch.range(i)).unwrap()).unwrap();
                        }
                    }
                    let f = Instant::now();
                    s.finish(Default::default()).unwrap();
                    finish_t.push(f.elapsed().as_secs_f64());
                    sink_t.push(t.elapsed().as_secs_f64());
                    bytes = s.bytes_written();
                } else {
                    std::fs::create_dir_all(&target).unwrap();
                    let t = Instant::now();
                    let path = target.join("plain.bin");
                    let mut f = std::io::BufWriter::with_capacity(4 << 20, std::fs::File::create(&path).unwrap());
                    for _ in 0..reps {
                        blocks.iter().for_each(|b| f.write_all(b).unwrap());
                    }
                    f.into_inner().unwrap().sync_all().unwrap();
                    plain_t.push(t.elapsed().as_secs_f64());
                }
                std::fs::remove_dir_all(&target).unwrap();
            }
        }
        // The encoding alone, as the sink does it on the caller's thread (the
        // native one a layer at a time, `[L, T, H]`; speculators `[T, L, H]`).
        let mut enc_t = Vec::new();
        let (mut buf, mut scales) = (Vec::new(), Vec::new());
        for _ in 0..runs {
            let t = Instant::now();
            for _ in 0..reps {
                for i in 0..samples.len() {
                    let v = states.view_tokens(batch.range(i)).unwrap();
                    buf.clear();
                    scales.clear();
                    if format == "native" {
                        for l in 0..v.layers() {
                            let src = v.layer(l);
                            match dtype {
                                DType::F8E4M3 => scales.extend(
                                    src.chunks_exact(v.hidden())
                                        .map(|row| strata::shape::fp8::quantize_row(row, &mut buf)),
                                ),
                                _ => dtype.encode_into(src, &mut buf),
                            }
                        }
                    } else {
                        v.encode_tlh(dtype, &mut buf, &mut scales);
                    }
                    std::hint::black_box((&buf, &scales));
                }
            }
            enc_t.push(t.elapsed().as_secs_f64());
        }
        let enc = median(enc_t);
        let plain_bytes = (reps * samples.len() * per_sample) as f64;
        let paired = median(sink_t.iter().zip(&plain_t).map(|(s, p)| (bytes as f64 / s) / (plain_bytes / p)).collect());
        let (s, p, fin) = (median(sink_t), median(plain_t), median(finish_t));
        println!(
            "(b) {format} writer, {dtype}: {} samples, {:.0} MiB, {runs} interleaved runs",
            reps * samples.len(),
            bytes as f64 / (1 << 20) as f64
        );
        println!("    strata sink      {:.0} MiB/s", bytes as f64 / s / (1 << 20) as f64);
        println!("    plain write      {:.0} MiB/s", plain_bytes / p / (1 << 20) as f64);
        println!("    ratio            {paired:.2}  (of medians {:.2})", (bytes as f64 / s) / (plain_bytes / p));
        println!("    finish           {:.1} ms  ({:.0}% of the sink's time)", fin * 1e3, fin / s * 100.0);
        println!(
            "    encoding alone   {:.0} MiB/s  ({:.0}% of the sink's time)",
            bytes as f64 / enc / (1 << 20) as f64,
            enc / s * 100.0
        );
    }
}
