//! `strata serve` under 1, 16 and 64 concurrent clients against offline
//! `strata extract --format speculators` on the same prompts, the same
//! model (the bench `small` Llama), capture points, storage dtype and step
//! budget. Each client does what the trainer does: one request at a time on
//! a keep-alive connection, then it reads the file whole and deletes it.
//!
//! Served tokens/s is steady state: the server is loaded and warmed before
//! the clock starts (model load excluded), and the clock stops at the last
//! reply. Offline tokens/s is the pipeline's own figure (load excluded), the
//! faster of two runs, one before and one after the served ones.
//!
//!     cargo bench --bench serve [-- --prompts N --max-batch-tokens B --dtype D]
//!     cargo bench --bench serve -- --cold-burst [--requests 900 --tokens 4000 --backend cpu --wait 240]
//!
//! `--cold-burst`: a fresh server (the bench `small` Llama on `--backend`,
//! cpu by default: a few hundred tokens/s on 2 cores, slow enough for a
//! queue to fill) gets `--requests`
//! prompts of `--tokens` tokens at once, each on its own connection, the
//! moment it is ready. It prints how many were admitted and refused, the
//! queue 5 s in, when the last admitted one was answered, and how many were
//! still waiting after `--wait` seconds. `STRATA_BIN` runs another build (an
//! older commit's) the same way; `--max-queue-time` is passed on when given.
//!
//! `--dtype` is the stored dtype on both sides (bf16 by default; fp8 puts
//! the FP8 encoding on the server's writer thread and in the offline sink).
//! Each row also gives the share of its wall time the server spent in
//! forward steps and on its writer thread (from `/metrics`): a writer busy
//! far below 100% does not hold the steps back.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

fn bin() -> PathBuf {
    std::env::var_os("STRATA_BIN").map_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_strata")), PathBuf::from)
}

fn arg(args: &[String], name: &str, default: usize) -> usize {
    args.iter().position(|a| a == name).map_or(default, |i| args[i + 1].parse().unwrap())
}

/// A keep-alive HTTP/1.1 connection, as the openai client keeps one per worker.
struct Conn {
    r: BufReader<TcpStream>,
    addr: String,
}

impl Conn {
    fn new(addr: &str) -> Conn {
        let s = TcpStream::connect(addr).unwrap();
        s.set_nodelay(true).unwrap();
        Conn { r: BufReader::new(s), addr: addr.into() }
    }

    fn post(&mut self, path: &str, body: &str) -> (u16, String) {
        let req = format!(
            "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            self.addr,
            body.len()
        );
        self.send(&req)
    }

    fn get(&mut self, path: &str) -> (u16, String) {
        let req = format!("GET {path} HTTP/1.1\r\nHost: {}\r\n\r\n", self.addr);
        self.send(&req)
    }

    fn send(&mut self, req: &str) -> (u16, String) {
        self.r.get_mut().write_all(req.as_bytes()).unwrap();
        let mut line = String::new();
        self.r.read_line(&mut line).unwrap();
        let status: u16 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
        let mut len = 0;
        loop {
            line.clear();
            self.r.read_line(&mut line).unwrap();
            if line == "\r\n" {
                break;
            }
            if let Some((k, v)) = line.split_once(':') {
                if k.eq_ignore_ascii_case("content-length") {
                    len = v.trim().parse().unwrap();
                }
            }
        }
        let mut body = vec![0; len];
        self.r.read_exact(&mut body).unwrap();
        (status, String::from_utf8(body).unwrap())
    }
}

fn offline(model: &Path, data: &Path, out: &Path, budget: usize, dtype: &str) -> f64 {
    let _ = std::fs::remove_dir_all(out);
    let o = Command::new(bin())
        .args(["extract", "--capture", "eagle3", "--dtype", dtype, "--format", "speculators"])
        .arg("--model")
        .arg(model)
        .arg("--data")
        .arg(data)
        .arg("--out")
        .arg(out)
        .args(["--max-batch-tokens", &budget.to_string()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{text}{}", String::from_utf8_lossy(&o.stderr));
    let _ = std::fs::remove_dir_all(out);
    // "  throughput  1234 tokens/s over 5.00s (20 steps)"
    let line = text.lines().find(|l| l.trim_start().starts_with("throughput")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

struct Served {
    tps: f64,
    p50: f64,
    p99: f64,
    // Of the wall time: the server's writer thread (gather, check, encode,
    // write) and its forward steps, from `/metrics`.
    writer_busy: f64,
    forward_busy: f64,
}

/// A counter of the server's `/metrics`.
fn metric(addr: &str, name: &str) -> f64 {
    let (status, text) = Conn::new(addr).get("/metrics");
    assert_eq!(status, 200, "{text}");
    let line = text.lines().find(|l| l.split_whitespace().next() == Some(name)).unwrap_or_else(|| panic!("no {name}"));
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

fn served(addr: &str, model: &str, prompts: &Arc<Vec<Vec<u32>>>, clients: usize) -> Served {
    let next = Arc::new(AtomicUsize::new(0));
    let (write0, forward0) = (metric(addr, "strata_write_seconds_total"), metric(addr, "strata_forward_seconds_total"));
    let start = Instant::now();
    let threads: Vec<_> = (0..clients)
        .map(|_| {
            let (addr, model, prompts, next) = (addr.to_string(), model.to_string(), prompts.clone(), next.clone());
            std::thread::spawn(move || {
                let mut conn = Conn::new(&addr);
                let mut lat = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(ids) = prompts.get(i) else { return lat };
                    let body = serde_json::json!({"model": model, "prompt": ids, "max_tokens": 1,
                                                  "return_token_ids": true})
                    .to_string();
                    let t = Instant::now();
                    let (status, reply) = conn.post("/v1/completions", &body);
                    assert_eq!(status, 200, "{reply}");
                    let v: serde_json::Value = serde_json::from_str(&reply).unwrap();
                    let path = v["kv_transfer_params"]["hidden_states_path"].as_str().unwrap();
                    // As the trainer: the whole file read, then deleted.
                    std::hint::black_box(std::fs::read(path).unwrap());
                    std::fs::remove_file(path).unwrap();
                    lat.push(t.elapsed().as_secs_f64());
                }
            })
        })
        .collect();
    let mut lat: Vec<f64> = threads.into_iter().flat_map(|t| t.join().unwrap()).collect();
    let secs = start.elapsed().as_secs_f64();
    let writer_busy = (metric(addr, "strata_write_seconds_total") - write0) / secs;
    let forward_busy = (metric(addr, "strata_forward_seconds_total") - forward0) / secs;
    lat.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let q = |f: f64| lat[((lat.len() - 1) as f64 * f).round() as usize];
    let tokens: usize = prompts.iter().map(Vec::len).sum();
    Served { tps: tokens as f64 / secs, p50: q(0.5), p99: q(0.99), writer_busy, forward_busy }
}

/// The server's peak resident memory so far (`VmHWM`).
fn peak_rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kb = status.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| l.split_whitespace().nth(1));
    kb.and_then(|k| k.parse::<f64>().ok()).map_or(f64::NAN, |k| k / 1024.0)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--list") {
        return; // `cargo test --benches` lists benches; nothing to list here
    }
    if args.iter().any(|a| a == "--cold-burst") {
        return cold_burst(&args);
    }
    let n = arg(&args, "--prompts", 256);
    let budget = arg(&args, "--max-batch-tokens", 2048);
    let dtype = args.iter().position(|a| a == "--dtype").map_or("bf16", |i| args[i + 1].as_str());
    let model = strata_testkit::bench_small_dir().unwrap();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    let vocab = config["vocab_size"].as_u64().unwrap();
    let work = std::env::current_dir().unwrap().join("target/bench-serve");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();
    // Prompts of 64 to 512 tokens, as chat turns are.
    let mut rng = strata_testkit::Rng::new(5);
    let prompts: Vec<Vec<u32>> =
        (0..n).map(|_| (0..64 + rng.below(449)).map(|_| rng.below(vocab) as u32).collect()).collect();
    let tokens: usize = prompts.iter().map(Vec::len).sum();
    let data = work.join("prompts.jsonl");
    let text: String = prompts.iter().map(|p| serde_json::json!({"input_ids": p}).to_string() + "\n").collect();
    std::fs::write(&data, text).unwrap();
    let prompts = Arc::new(prompts);

    let off_a = offline(&model, &data, &work.join("offline"), budget, dtype);

    let server_args: Vec<String> = ["--capture", "eagle3", "--dtype", dtype, "--served-model-name", "bench"]
        .iter()
        .map(|s| s.to_string())
        .chain(["--model".into(), model.display().to_string()])
        .chain(["--hidden-states-dir".into(), work.join("hs").display().to_string()])
        .chain(["--max-batch-tokens".into(), budget.to_string()])
        .collect();
    let (mut child, addr) = start(&server_args);
    // Warm-up: the first steps allocate the working buffers.
    let warm = Arc::new(prompts[..8].to_vec());
    served(&addr, "bench", &warm, 8);
    let mut rows = Vec::new();
    for clients in [1, 16, 64] {
        let s = served(&addr, "bench", &prompts, clients);
        rows.push((clients, s, peak_rss_mib(child.id())));
    }
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let _ = child.wait();
    let off_b = offline(&model, &data, &work.join("offline"), budget, dtype);
    let off = off_a.max(off_b);
    let _ = std::fs::remove_dir_all(&work);

    println!(
        "serve vs extract: bench small Llama, {n} prompts ({tokens} tokens, 64 to 512 each), eagle3, {dtype} storage, \
         --max-batch-tokens {budget}"
    );
    println!("  offline extract  {off:.0} tokens/s  (runs: {off_a:.0}, {off_b:.0}; the faster is the baseline)");
    println!(
        "  clients  tokens/s  vs offline  p50 latency  p99 latency  server peak RSS so far  forward busy  writer busy"
    );
    for (clients, s, rss) in rows {
        println!(
            "  {clients:>7}  {:>8.0}  {:>9.2}  {:>9.0} ms  {:>9.0} ms  {:>10.0} MiB  {:>19.0}%  {:>10.0}%",
            s.tps,
            s.tps / off,
            s.p50 * 1e3,
            s.p99 * 1e3,
            rss,
            s.forward_busy * 100.0,
            s.writer_busy * 100.0
        );
    }
    println!(
        "  (busy: the share of the wall time the server spent in forward steps, and on its writer thread \
         gathering, encoding and writing files, which runs beside the steps)"
    );
}

/// Starts `strata serve ARGS --port 0`; returns it and its address once ready.
fn start(args: &[String]) -> (std::process::Child, String) {
    let mut child =
        Command::new(bin()).arg("serve").args(args).args(["--port", "0"]).stdout(Stdio::piped()).spawn().unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut addr = String::new();
    loop {
        let mut line = String::new();
        assert!(out.read_line(&mut line).unwrap() > 0, "strata serve exited");
        if let Some(rest) = line.strip_prefix("listening on http://") {
            addr = rest.split_whitespace().next().unwrap().to_string();
        }
        if line.trim_start().starts_with("prompts") {
            break;
        }
    }
    std::thread::spawn(move || for _ in out.lines() {});
    (child, addr)
}

/// `--cold-burst`: see the module's doc.
fn cold_burst(args: &[String]) {
    let requests = arg(args, "--requests", 900);
    let tokens = arg(args, "--tokens", 4000);
    let wait = arg(args, "--wait", 240) as u64;
    let backend = args.iter().position(|a| a == "--backend").map_or("cpu", |i| args[i + 1].as_str());
    // A request with no answer within --wait ends its client thread by a read timeout: counted, not printed.
    std::panic::set_hook(Box::new(|_| {}));
    let model = strata_testkit::bench_small_dir().unwrap();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    let vocab = config["vocab_size"].as_u64().unwrap();
    let work = std::env::current_dir().unwrap().join("target/bench-serve-burst");
    let _ = std::fs::remove_dir_all(&work);
    let mut server_args: Vec<String> =
        ["--served-model-name", "bench", "--backend", backend, "--max-batch-tokens", "8192"]
            .iter()
            .map(|s| s.to_string())
            .collect();
    server_args.extend(["--model".into(), model.display().to_string()]);
    server_args.extend(["--hidden-states-dir".into(), work.join("hs").display().to_string()]);
    if let Some(i) = args.iter().position(|a| a == "--max-queue-time") {
        server_args.extend(["--max-queue-time".into(), args[i + 1].clone()]);
    }
    let (mut child, addr) = start(&server_args);
    let mut rng = strata_testkit::Rng::new(9);
    let bodies: Vec<String> = (0..requests)
        .map(|_| {
            let ids: Vec<u32> = (0..tokens).map(|_| rng.below(vocab) as u32).collect();
            serde_json::json!({"model": "bench", "prompt": ids, "max_tokens": 1}).to_string()
        })
        .collect();
    let t = Instant::now();
    let clients: Vec<_> = bodies
        .into_iter()
        .map(|body| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let s = TcpStream::connect(&addr).ok()?;
                s.set_read_timeout(Some(std::time::Duration::from_secs(wait))).ok()?;
                let mut c = Conn { r: BufReader::new(s), addr };
                let (status, text) =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| c.post("/v1/completions", &body))).ok()?;
                if status == 200 {
                    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
                    let _ = std::fs::remove_file(v["kv_transfer_params"]["hidden_states_path"].as_str().unwrap());
                }
                Some((status, t.elapsed().as_secs_f64()))
            })
        })
        .collect();
    std::thread::sleep(std::time::Duration::from_secs(5));
    let queued_5s = metric(&addr, "strata_queue_depth");
    let results: Vec<Option<(u16, f64)>> = clients.into_iter().map(|c| c.join().unwrap()).collect();
    let served: Vec<f64> = results.iter().flatten().filter(|r| r.0 == 200).map(|r| r.1).collect();
    let refused = results.iter().flatten().filter(|r| r.0 == 503).count();
    let pending = results.iter().filter(|r| r.is_none()).count();
    let tps = metric(&addr, "strata_step_tokens_total") / metric(&addr, "strata_forward_seconds_total");
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&work);
    println!(
        "cold burst: {requests} requests of {tokens} tokens at once on a fresh server ({backend} backend, bench small \
         Llama, {})",
        bin().display()
    );
    println!("  queue 5 s in: {queued_5s:.0} requests");
    println!(
        "  admitted and answered: {}; refused at once (503): {refused}; no answer within {wait} s: {pending}",
        served.len()
    );
    println!(
        "  the last answer came {:.1} s after the burst; the forward ran at {tps:.0} tokens/s, so the work \
         admitted was {:.1} s of it",
        served.iter().copied().fold(0.0, f64::max),
        served.len() as f64 * tokens as f64 / tps
    );
}
