//! What `GET /metrics` shows, in Prometheus' text format: counters and
//! gauges kept as atomics, written by the HTTP tasks, the scheduler and the
//! writer without a lock.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

/// HTTP statuses counted per value; others go to `other`.
const STATUSES: [u16; 10] = [200, 400, 401, 404, 405, 408, 413, 500, 503, 499];

/// The server's counters.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Replies by status, in [`STATUSES`] order (499: the client went away first).
    by_status: [AtomicU64; STATUSES.len()],
    other_status: AtomicU64,
    /// Prompt tokens of the requests served (200).
    pub prompt_tokens: AtomicU64,
    /// Tokens drawn by generation requests.
    pub generated_tokens: AtomicU64,
    /// Forward steps run.
    pub steps: AtomicU64,
    /// Tokens run in forward steps.
    pub step_tokens: AtomicU64,
    /// Requests dropped before their forward because their client hung up.
    pub dropped_queued: AtomicU64,
    /// Files removed because their client hung up before the reply was taken.
    pub removed_unclaimed: AtomicU64,
    /// Files removed by `--pending-ttl`.
    pub expired: AtomicU64,
    /// Requests waiting for the model (admitted, not yet in a step).
    pub queue_depth: AtomicU64,
    /// Their tokens.
    pub queue_tokens: AtomicU64,
    /// Bytes reserved for files written and not yet deleted, or being made.
    pub pending_bytes: AtomicU64,
    /// Files served and not yet deleted by their reader.
    pub pending_files: AtomicU64,
    /// Microseconds in forward steps.
    pub forward_us: AtomicU64,
    /// Microseconds gathering, encoding and writing files.
    pub write_us: AtomicU64,
    /// The token budget of a step (for the fill ratio).
    pub budget: AtomicU64,
    /// Bytes of request bodies held now (bounded by `--max-body-bytes`).
    pub body_bytes: AtomicU64,
    /// Connections open now.
    pub connections: AtomicU64,
    /// Idle connections closed to make room for new ones (every slot was taken).
    pub evicted: AtomicU64,
    /// Histogram of step fill (tokens / budget) in tenths: bucket `i` counts steps with fill ≤ (i+1)/10.
    fill: [AtomicU64; 10],
    /// Request latency histogram (seconds), admitted to replied.
    latency: Mutex<Histogram>,
}

/// A cumulative histogram as Prometheus keeps one.
#[derive(Debug, Default)]
struct Histogram {
    counts: Vec<u64>,
    sum: f64,
    n: u64,
}

/// Upper bounds of the latency buckets, seconds.
const LATENCY_BOUNDS: [f64; 12] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];

impl Metrics {
    /// Counts a reply with `status`.
    pub fn reply(&self, status: u16) {
        match STATUSES.iter().position(|&s| s == status) {
            Some(i) => self.by_status[i].fetch_add(1, Relaxed),
            None => self.other_status.fetch_add(1, Relaxed),
        };
    }

    /// Replies with `status` so far.
    pub fn replies(&self, status: u16) -> u64 {
        STATUSES.iter().position(|&s| s == status).map_or(0, |i| self.by_status[i].load(Relaxed))
    }

    /// Records a forward step of `tokens`.
    pub fn step(&self, tokens: usize, forward_us: u64) {
        self.steps.fetch_add(1, Relaxed);
        self.step_tokens.fetch_add(tokens as u64, Relaxed);
        self.forward_us.fetch_add(forward_us, Relaxed);
        let budget = self.budget.load(Relaxed).max(1);
        let tenth = ((tokens as u64 * 10).div_ceil(budget)).clamp(1, 10) as usize - 1;
        self.fill[tenth].fetch_add(1, Relaxed);
    }

    /// Records one request's latency.
    pub fn latency(&self, secs: f64) {
        let mut h = self.latency.lock().unwrap_or_else(|e| e.into_inner());
        if h.counts.is_empty() {
            h.counts = vec![0; LATENCY_BOUNDS.len()];
        }
        for (c, b) in h.counts.iter_mut().zip(LATENCY_BOUNDS) {
            if secs <= b {
                *c += 1;
            }
        }
        h.sum += secs;
        h.n += 1;
    }

    /// The Prometheus text exposition (version 0.0.4).
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP strata_requests_total Requests answered, by HTTP status (499: the client hung up first).\n\
             # TYPE strata_requests_total counter"
        );
        for (i, status) in STATUSES.iter().enumerate() {
            let _ = writeln!(out, "strata_requests_total{{status=\"{status}\"}} {}", self.by_status[i].load(Relaxed));
        }
        let _ = writeln!(out, "strata_requests_total{{status=\"other\"}} {}", self.other_status.load(Relaxed));
        let mut one = |name: &str, kind: &str, help: &str, value: String| {
            let _ = writeln!(out, "# HELP strata_{name} {help}\n# TYPE strata_{name} {kind}\nstrata_{name} {value}");
        };
        let n = |a: &AtomicU64| a.load(Relaxed).to_string();
        let secs = |a: &AtomicU64| format!("{}", a.load(Relaxed) as f64 / 1e6);
        one("prompt_tokens_total", "counter", "Prompt tokens of the requests served.", n(&self.prompt_tokens));
        one("generated_tokens_total", "counter", "Tokens drawn by generation requests.", n(&self.generated_tokens));
        one("steps_total", "counter", "Forward steps run.", n(&self.steps));
        one("step_tokens_total", "counter", "Tokens run in forward steps.", n(&self.step_tokens));
        one("step_budget_tokens", "gauge", "The token budget of one step (--max-batch-tokens).", n(&self.budget));
        one(
            "dropped_queued_total",
            "counter",
            "Requests dropped before their forward: their client hung up.",
            n(&self.dropped_queued),
        );
        one(
            "removed_unclaimed_total",
            "counter",
            "Files removed at once: their client hung up before taking the reply.",
            n(&self.removed_unclaimed),
        );
        one("expired_total", "counter", "Files removed by --pending-ttl.", n(&self.expired));
        one("queue_depth", "gauge", "Requests admitted and waiting for a step.", n(&self.queue_depth));
        one("queue_tokens", "gauge", "Their prompt tokens.", n(&self.queue_tokens));
        one(
            "pending_bytes",
            "gauge",
            "Bytes of served files not yet deleted, and of files being made.",
            n(&self.pending_bytes),
        );
        one("pending_files", "gauge", "Served files not yet deleted by their reader.", n(&self.pending_files));
        one(
            "body_bytes",
            "gauge",
            "Bytes of request bodies held now (--max-body-bytes bounds them).",
            n(&self.body_bytes),
        );
        one("connections", "gauge", "Connections open now.", n(&self.connections));
        one(
            "evicted_connections_total",
            "counter",
            "Idle connections closed to make room for new ones (every --max-connections slot was taken).",
            n(&self.evicted),
        );
        one("forward_seconds_total", "counter", "Seconds in forward steps.", secs(&self.forward_us));
        one("write_seconds_total", "counter", "Seconds gathering, encoding and writing files.", secs(&self.write_us));
        let _ = writeln!(
            out,
            "# HELP strata_step_fill Forward steps by their tokens over the budget.\n# TYPE strata_step_fill histogram"
        );
        let mut cum = 0;
        for (i, f) in self.fill.iter().enumerate() {
            cum += f.load(Relaxed);
            let _ = writeln!(out, "strata_step_fill_bucket{{le=\"{}\"}} {cum}", (i + 1) as f64 / 10.0);
        }
        let _ = writeln!(out, "strata_step_fill_bucket{{le=\"+Inf\"}} {cum}");
        let _ = writeln!(out, "strata_step_fill_count {cum}");
        // Every step has the same budget: the fills sum to the tokens over it.
        let budget = self.budget.load(Relaxed).max(1) as f64;
        let _ = writeln!(out, "strata_step_fill_sum {}", self.step_tokens.load(Relaxed) as f64 / budget);
        let h = self.latency.lock().unwrap_or_else(|e| e.into_inner());
        let _ = writeln!(
            out,
            "# HELP strata_request_seconds Requests served, from admission to reply.\n# TYPE strata_request_seconds histogram"
        );
        for (i, b) in LATENCY_BOUNDS.iter().enumerate() {
            let _ =
                writeln!(out, "strata_request_seconds_bucket{{le=\"{b}\"}} {}", h.counts.get(i).copied().unwrap_or(0));
        }
        let _ = writeln!(out, "strata_request_seconds_bucket{{le=\"+Inf\"}} {}", h.n);
        let _ = writeln!(out, "strata_request_seconds_sum {}", h.sum);
        let _ = writeln!(out, "strata_request_seconds_count {}", h.n);
        out
    }
}
