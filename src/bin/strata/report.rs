//! What the CLI prints: progress while a job runs, and its summary after.

use std::io::IsTerminal;
use std::time::{Duration, Instant};
use strata::job::extract::{InputProgress, Summary};
use strata::job::Progress;
use strata::serve::Event;
use strata::shape::DType;

/// Progress on stderr: a bar on a terminal, a log line every 10 s otherwise.
/// The input is read once, as it streams, so progress is in bytes of input
/// (a pipe's length is unknown: then samples and tokens only).
pub(crate) struct Reporter {
    pub(crate) bar: Option<indicatif::ProgressBar>,
    last_line: Instant,
}

impl Reporter {
    pub(crate) fn new() -> Self {
        Reporter { bar: None, last_line: Instant::now() }
    }

    pub(crate) fn update(&mut self, p: &Progress, input: &InputProgress) {
        let secs = p.elapsed.as_secs_f64().max(1e-9);
        let tps = p.tokens as f64 / secs;
        let done = p.resumed + p.samples;
        if std::io::stderr().is_terminal() {
            let bar = self.bar.get_or_insert_with(|| {
                let (b, template) = match input.total {
                    Some(n) => (
                        indicatif::ProgressBar::new(n),
                        "{bar:40.cyan/blue} {percent}% of input  {msg}  elapsed {elapsed_precise}  eta {eta}",
                    ),
                    None => (indicatif::ProgressBar::new_spinner(), "{spinner} {msg}  elapsed {elapsed_precise}"),
                };
                b.set_style(indicatif::ProgressStyle::with_template(template).expect("valid template"));
                b
            });
            bar.set_position(input.read);
            bar.set_message(format!("{done} samples, {tps:.0} tokens/s"));
        } else if self.last_line.elapsed() >= Duration::from_secs(10) {
            self.last_line = Instant::now();
            let of = match input.total {
                Some(n) if n > 0 => format!(" ({:.1}% of the input)", 100.0 * input.read as f64 / n as f64),
                _ => String::new(),
            };
            eprintln!("progress: {done} samples{of}, {} tokens, {tps:.0} tokens/s", p.tokens);
        }
    }
}

pub(crate) fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: f64 = status.lines().find(|l| l.starts_with("VmHWM:"))?.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

pub(crate) fn print_summary(s: &Summary, out: &std::path::Path) {
    let r = &s.report;
    let p = &r.progress;
    let secs = p.elapsed.as_secs_f64().max(1e-9);
    let points: Vec<String> = s.points.iter().map(|p| p.to_string()).collect();
    say!("wrote {} samples ({} tokens) to {}", p.samples, p.tokens, out.display());
    if p.resumed > 0 {
        say!("  resumed     {} samples were already written", p.resumed);
    }
    if s.skipped > 0 {
        say!("  skipped     {} samples with NaN or Inf states (listed in the manifest's `skipped`)", s.skipped);
    }
    if let Some(part) = &s.part {
        say!(
            "  part        {} of {} (from {}): input lines {}.., bytes {}..{} of {}; `strata merge` joins the parts",
            part.index,
            part.count,
            part.source,
            part.first_line,
            part.start,
            part.end,
            part.input_bytes
        );
    }
    print_prepare(s);
    say!("  capture     {} ({})", points.join(","), s.dtype.map_or("?".into(), |d| d.to_string()));
    say!("  bytes       {}", r.bytes);
    if s.dtype == Some(DType::F8E4M3) {
        say!(
            "  fp8         e4m3 codes with hidden_states_scales (one per token and capture point); the speculators \
             trainer must read them with its FP8 hidden-states backend (--hidden-states-backend fp8): its default \
             reader does not dequantise and fails on them"
        );
    }
    say!("  weights     {:.1} MiB in memory ({})", s.weight_bytes as f64 / (1 << 20) as f64, s.weight_storage);
    if s.state_bytes > 0 {
        say!(
            "  state       {:.2} MiB per sample split across steps (Gated DeltaNet conv and recurrent state)",
            s.state_bytes as f64 / (1 << 20) as f64
        );
    }
    say!("  throughput  {:.0} tokens/s over {:.2}s ({} steps)", p.tokens as f64 / secs, secs, r.steps);
    say!(
        "  stages      load {:.2}s, read {:.2}s, forward {:.2}s, gather {:.2}s, write {:.2}s",
        s.load_time.as_secs_f64(),
        r.schedule_time.as_secs_f64(),
        r.forward_time.as_secs_f64(),
        r.gather_time.as_secs_f64(),
        r.write_time.as_secs_f64()
    );
    if let Some(m) = peak_rss_mib() {
        say!("  peak memory {m:.0} MiB");
    }
    print_trainer_flags(s);
}

/// Speculators format: the trainer's flags for this output, or why it cannot read it.
pub(crate) fn print_trainer_flags(s: &Summary) {
    let Some(ids) = &s.target_layer_ids else { return };
    match ids {
        Ok(ids) => {
            let list: Vec<String> = ids.iter().map(usize::to_string).collect();
            let vocab = match s.draft_vocab_sizes.as_slice() {
                [] => String::new(),
                [n] => format!(" --draft-vocab-size {n}"),
                _ => " --draft-vocab-size N".into(),
            };
            let fp8 = if s.dtype == Some(DType::F8E4M3) { " --hidden-states-backend fp8" } else { "" };
            say!("  trainer     speculators train --target-layer-ids {}{vocab}{fp8} ...", list.join(" "));
            if !s.draft_vocab_sizes.is_empty() {
                say!(
                    "  vocab       token_freq.pt, and d2t-N.npy and t2d-N.npy for N = {}: the trainer loads them",
                    s.draft_vocab_sizes.iter().map(usize::to_string).collect::<Vec<_>>().join(", ")
                );
            }
            if ids.len() != 3 {
                say!(
                    "  note        EAGLE-3 drafts read three layers besides the final one; this capture gives {}, \
                     so a draft trained on it takes these {} ids",
                    ids.len(),
                    ids.len()
                );
            }
        }
        Err(why) => say!("  trainer     the speculators trainer cannot read this capture: {why}"),
    }
}

/// What preparing the input did: rows of each kind, skips, errors, cuts.
pub(crate) fn print_prepare(s: &Summary) {
    let p = &s.prepare;
    if p.conversations > 0 {
        say!(
            "  input       {} conversations ({}): {} rows of a whole conversation, {} of one turn; {} tokens \
             saved against one row per turn",
            p.conversations,
            s.input_format.name(),
            p.rows_per_conversation,
            p.rows_per_turn,
            p.saved_tokens
        );
        if let Some(t) = &s.chat_template {
            let date = s.chat_date.map_or(String::new(), |d| format!(", dates render as {d}"));
            say!("  template    {t}{date}");
        }
    } else if p.records > 0 {
        say!("  input       {} records ({})", p.records, s.input_format.name());
    }
    if p.skipped_empty + p.skipped_no_assistant > 0 {
        say!(
            "  skipped     {} empty conversations, {} without an assistant turn",
            p.skipped_empty,
            p.skipped_no_assistant
        );
    }
    if p.errors > 0 {
        say!("  errors      {} records could not be rendered or tokenized and were left out:", p.errors);
        for e in &p.first_errors {
            say!("                {e}");
        }
    }
    if p.long_prompts + p.truncated + p.skipped_long > 0 {
        say!(
            "  limit       {} rows cut, {} rows left out as too long, {} turns left out (prompt alone fills the limit)",
            p.truncated,
            p.skipped_long,
            p.long_prompts
        );
    }
    if !p.unknown_roles.is_empty() {
        let more = p.unknown_role_count - p.unknown_roles.len();
        let more = if more > 0 { format!(" and {more} more") } else { String::new() };
        say!("  roles       counted as assistant: {}{more}", p.unknown_roles.join(", "));
    }
}

/// `s` as a shell word.
fn shell_quote(s: &str) -> String {
    if !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_./:@+=".contains(c)) {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// Prints what `strata serve` tells: where it listens, what it serves (with
/// the trainer's flags), progress every 10 s, and its stop.
pub(crate) fn serve_event(addr: &mut Option<std::net::SocketAddr>, event: Event<'_>) {
    match event {
        Event::Warning(w) => eprintln!("warning: {w}"),
        Event::Listening(at) => {
            *addr = Some(at);
            say!("listening on http://{at} (GET /health answers 503 until the model is loaded)");
        }
        Event::Ready(r) => {
            let at = addr.map_or("HOST:PORT".into(), |a| a.to_string());
            let points: Vec<String> = r.points.iter().map(|p| p.to_string()).collect();
            let ids = |v: &[usize]| v.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(" ");
            let fp8 = if r.dtype == DType::F8E4M3 { " --hidden-states-backend fp8" } else { "" };
            say!(
                "serving {:?} on http://{at}/v1 ({} backend, {} compute, loaded in {:.1}s)",
                r.served_model_name,
                r.backend,
                r.compute,
                r.load_time.as_secs_f64()
            );
            say!(
                "  capture     {} ({}), files [T, {}, H] in {}",
                points.join(","),
                r.dtype,
                r.points.len(),
                r.states_dir.display()
            );
            say!(
                "  layer ids   {} (input:K is id K; the last, {}, is final: the trainer's verifier_last_hidden_states)",
                ids(&r.layer_ids),
                r.layer_ids.last().copied().unwrap_or(0)
            );
            say!(
                "  trainer     --target-layer-ids {} : the ids before the final one, in this order. Nothing in the \
             protocol checks them: other ids train silently on the wrong states",
                ids(&r.target_layer_ids)
            );
            say!(
                "  command     speculators train --verifier-name-or-path {} --vllm-endpoint http://{at}/v1 \
             --on-missing generate --target-layer-ids {}{fp8} --data-path DIR",
                shell_quote(&r.served_model_name),
                ids(&r.target_layer_ids)
            );
            say!("  prompts     at most {} tokens", r.max_tokens);
            if r.state_bytes > 0 {
                say!(
                    "  state       {:.2} MiB per request split across steps (Gated DeltaNet conv and recurrent state)",
                    r.state_bytes as f64 / (1 << 20) as f64
                );
            }
            if let Some(why) = &r.no_chat {
                say!("  chat        /v1/chat/completions is off: {why}");
            }
        }
        Event::Progress(p) => {
            if p.served + p.errors + p.steps > 0 || p.queued > 0 {
                eprintln!(
                    "served {} requests ({} tokens) in {:.0}s: {:.0} tokens/s; {} steps, {:.0}% full; queue {}; \
                 pending {} files ({:.1} MiB); {} errors",
                    p.served,
                    p.tokens,
                    p.secs,
                    p.tokens as f64 / p.secs.max(1e-9),
                    p.steps,
                    100.0 * p.fill,
                    p.queued,
                    p.pending.0,
                    p.pending.1 as f64 / (1 << 20) as f64,
                    p.errors
                );
            }
        }
        Event::Stopping => {
            eprintln!("stopping: no new requests; those in a forward step finish within --shutdown-grace")
        }
        Event::Stopped { abandoned } => {
            eprintln!("stopped ({abandoned} requests still in a step were answered 503; their files are removed)")
        }
    }
}

/// A progress line of `strata generate`.
pub(crate) fn generate_progress(p: &strata::job::generate::GenerateProgress) {
    let secs = p.elapsed.as_secs_f64().max(1e-9);
    let cache = match p.cache.1 {
        Some(b) if b > 0 => format!(", cache {:.0}% reserved", 100.0 * p.cache.0 as f64 / b as f64),
        _ => String::new(),
    };
    eprintln!(
        "progress: {} rows, {} tokens generated ({:.0} tokens/s), {} sequences in flight{cache}",
        p.rows,
        p.generated,
        p.generated as f64 / secs,
        p.in_flight
    );
}

/// The summary `strata generate` prints.
pub(crate) fn generate_summary(s: &strata::job::generate::GenerateSummary, out: &std::path::Path) {
    let secs = s.elapsed.as_secs_f64().max(1e-9);
    let drawn = if s.seed_drawn { " (drawn)" } else { "" };
    let resumed =
        if s.resumed > 0 { format!(" (after {} records of an earlier run)", s.resumed) } else { String::new() };
    say!("wrote {}: {} rows, {} records left out{resumed}", out.display(), s.rows, s.skipped);
    say!(
        "  generated {} tokens in {:.2} s ({:.0} tokens/s; model loaded in {:.2} s), {} steps",
        s.generated,
        secs,
        s.generated as f64 / secs,
        s.load_time.as_secs_f64(),
        s.decode.steps
    );
    let generations = s.stopped + s.cut + s.tool_calls;
    let mean = if generations > 0 { s.generated as f64 / generations as f64 } else { 0.0 };
    say!(
        "  responses: {} ended by a stop token, {} cut by max_tokens, {} tool calls; mean {mean:.1} tokens, longest {}",
        s.stopped,
        s.cut,
        s.tool_calls,
        s.max_response
    );
    if s.conversations > 0 {
        say!(
            "  conversations: {} read, {} stopped early (past max_tokens, a parallel call, no cached result); \
             prompt tokens: {} prefilled, {} kept in cache from the turn before",
            s.conversations,
            s.truncated,
            s.decode.prefilled,
            s.decode.reused
        );
    }
    say!("  seed {}{drawn}; stop ids {:?}", s.seed, s.stop_token_ids);
    if let Some(p) = &s.params {
        say!(
            "  sampling: temperature {}, top_k {}, top_p {}, min_p {}, repetition {}, presence {}, frequency {}",
            p.temperature,
            p.top_k.unwrap_or(0),
            p.top_p,
            p.min_p,
            p.repetition_penalty,
            p.presence_penalty,
            p.frequency_penalty
        );
    }
    let cost = s
        .cache_cost
        .map_or(String::new(), |c| format!(" (a sequence: {} bytes per position + {} bytes)", c.per_position, c.fixed));
    say!(
        "  at most {} sequences in flight; cache held at most {} bytes{cost}",
        s.decode.max_in_flight,
        s.decode.cache_high_water
    );
    let points: Vec<String> = s.points.iter().map(|p| p.to_string()).collect();
    let points = if points.is_empty() { "none (--no-states)".to_string() } else { points.join(",") };
    say!("  capture {}; {} bytes written; regenerated.jsonl: {} lines", points, s.bytes_written, s.regenerated);
    if let Some(mib) = peak_rss_mib() {
        say!("  peak memory {mib:.0} MiB");
    }
}
