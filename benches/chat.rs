//! Conversations per second through the prepare stage (chat template render
//! plus tokenizer plus render-boundary masks, on one thread as a run has it),
//! beside the forward's tokens per second on the `small` bench model: the
//! stage runs on its own thread ahead of the forward and must outpace it.
//!
//! The conversations are the parity fixtures' (tests/fixtures/chat, OpenAI
//! style, 14 of them: multi-turn, tools, reasoning, unicode), repeated.
//!
//!     cargo bench --bench chat [-- --runs N]

/// Large buffers on cache lines, as the `strata` binary has them.
#[global_allocator]
static ALLOC: strata::backend::cpu::CacheAligned = strata::backend::cpu::CacheAligned;

use std::path::Path;
use std::time::Instant;
use strata::chat::{Chat, ChatOptions, Conversation, LongRows, MaskSource, RowMode, RowOptions, Style};
use strata::model::Llama;
use strata::pipeline::batch::PackedBatch;
use strata::pipeline::capture::{CapturePoint, CaptureSet};
use strata::pipeline::source::JsonlSource;
use strata_testkit::bench::{flag_or, median};

fn main() {
    let runs: usize = flag_or("--runs", 5);
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat");
    let convs: Vec<Conversation> = std::fs::read_to_string(fixtures.join("conversations.openai.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            Conversation::parse(Style::OpenAi, &v["messages"], v.get("tools")).unwrap()
        })
        .collect();
    let reps = 30;
    println!(
        "prepare stage, one thread, {} conversations a run ({} fixture conversations x {reps}):",
        convs.len() * reps,
        convs.len()
    );
    let mut slowest_tokens = f64::INFINITY;
    for template in ["chatml", "llama3", "qwen3"] {
        let opts = ChatOptions {
            template_file: Some(fixtures.join(format!("templates/{template}.jinja"))),
            date: chrono::NaiveDate::from_ymd_opt(2026, 1, 15).unwrap(),
            ..Default::default()
        };
        let chat = Chat::load(&fixtures, &opts).unwrap();
        let mut r = chat.renderer().unwrap();
        let row_opts = RowOptions {
            mask: MaskSource::Boundary,
            rows: RowMode::Auto,
            max_len: usize::MAX,
            long: LongRows::Truncate,
        };
        let (mut per_s, mut tok_s) = (vec![], vec![]);
        for _ in 0..runs {
            let t = Instant::now();
            let mut tokens = 0usize;
            for _ in 0..reps {
                for c in &convs {
                    if let Ok(rows) = r.rows(c, &row_opts) {
                        tokens += rows.rows.iter().map(|r| r.input_ids.len()).sum::<usize>();
                    }
                }
            }
            let s = t.elapsed().as_secs_f64();
            per_s.push((convs.len() * reps) as f64 / s);
            tok_s.push(tokens as f64 / s);
        }
        let (c, t) = (median(per_s), median(tok_s));
        slowest_tokens = slowest_tokens.min(t);
        println!("  {template:<8} {c:>8.0} conversations/s  {t:>9.0} row tokens/s  (median of {runs})");
    }

    // The forward it feeds: the small bench model (hidden 1024, 8 layers), 4 x 512 tokens.
    let dir = strata_testkit::bench_small_dir().unwrap();
    let model: Llama = Llama::load(&dir).unwrap();
    let samples: Vec<Vec<u32>> =
        JsonlSource::open(&dir.join("tokens.jsonl")).unwrap().map(|s| s.unwrap().input_ids).collect();
    let batch = PackedBatch::from_samples(samples.iter().map(|s| s.as_slice()));
    let set = CaptureSet::<usize>::try_new(CapturePoint::eagle3(model.config().num_layers)).unwrap();
    let mut fwd = vec![];
    for _ in 0..runs.min(3) {
        let t = Instant::now();
        model.forward(&batch, &set).unwrap();
        fwd.push(batch.num_tokens() as f64 / t.elapsed().as_secs_f64());
    }
    let f = median(fwd);
    println!("forward, small bench model (hidden 1024, 8 layers, f32, all threads): {f:.0} tokens/s");
    println!("prepare / forward (slowest template): {:.1}x", slowest_tokens / f);
}
