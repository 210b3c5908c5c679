//! Hostile input and failing machines against `strata extract`: the input is
//! read once, resume trusts nothing it cannot check, nothing is written
//! outside `--out` or deleted that Strata did not write, one run per
//! directory, overwrite and non-finite states are safe, and every write
//! stage survives a kill. Every run has a timeout and must not panic.

use crate::common;

use common::*;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use strata::dataset::manifest::Manifest;

/// The outcome of one `strata` run.
struct Out {
    ok: bool,
    stdout: String,
    stderr: String,
}

/// Waits for `child` at most `secs` (killing it and failing the test after that).
fn wait(mut child: Child, secs: u64) -> Out {
    let start = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if start.elapsed() > Duration::from_secs(secs) {
            child.kill().unwrap();
            panic!("strata hung: no exit after {secs} s");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let o = child.wait_with_output().unwrap();
    let out = Out {
        ok: o.status.success(),
        stdout: String::from_utf8_lossy(&o.stdout).into(),
        stderr: String::from_utf8_lossy(&o.stderr).into(),
    };
    assert!(!out.stderr.contains("panicked"), "strata panicked: {}", out.stderr);
    out
}

fn cmd(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_strata"));
    c.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    c
}

/// `strata extract ARGS` on the embedded model, with a 120 s timeout.
fn extract(args: &[&str]) -> Out {
    wait(cmd(&[&["extract"][..], args].concat()).spawn().unwrap(), 120)
}

/// The same with `STRATA_FAILPOINT` set: the run must abort at that stage.
fn extract_killed_at(stage: &str, args: &[&str]) {
    let mut c = cmd(&[&["extract"][..], args].concat());
    let o = wait(c.env("STRATA_FAILPOINT", stage).spawn().unwrap(), 120);
    assert!(!o.ok && o.stderr.contains("aborting at"), "{stage}: the run was not stopped: {}", o.stderr);
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn mkfifo(p: &Path) {
    let c = std::ffi::CString::new(s(p)).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0, "mkfifo {}", p.display());
}

/// Every file of `dir` but the manifest, whose `input.path` differs between inputs.
fn data_files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    dir_contents(dir).into_iter().filter(|(n, _)| n != "manifest.json").collect()
}

struct Setup {
    tmp: tempfile::TempDir,
    data: PathBuf,
}

/// `n` samples for the embedded model.
fn setup(n: usize) -> Setup {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data.jsonl");
    write_data(&data, n, 5..60, 11);
    Setup { tmp, data }
}

impl Setup {
    fn out(&self, name: &str) -> PathBuf {
        self.tmp.path().join(name)
    }
}

const SMALL: [&str; 4] = ["--shard-size", "8KiB", "--max-batch-tokens", "64"];

#[test]
fn the_input_is_read_once_so_pipes_fifos_and_stdin_work() {
    let st = setup(30);
    let whole = st.out("file");
    assert!(extract(&[&["--data", s(&st.data), "--out", s(&whole)][..], &SMALL].concat()).ok);
    let want = data_files(&whole);
    let bytes = std::fs::read(&st.data).unwrap();

    // stdin as a pipe, both as `-` and `/dev/stdin`.
    for name in ["-", "/dev/stdin"] {
        let out = st.out(&format!("stdin{}", name.len()));
        let mut c = cmd(&[&["extract", "--data", name, "--out", s(&out)][..], &SMALL].concat());
        let mut child = c.stdin(Stdio::piped()).spawn().unwrap();
        let mut w = child.stdin.take().unwrap();
        let b = bytes.clone();
        let t = std::thread::spawn(move || w.write_all(&b));
        let o = wait(child, 120);
        t.join().unwrap().unwrap();
        assert!(o.ok, "{name}: {}", o.stderr);
        assert!(o.stdout.contains("wrote 30 samples"), "{name}: {}", o.stdout);
        assert!(data_files(&out) == want, "{name}: output differs from the file's");
    }

    // A FIFO: a second read would find it empty.
    let fifo = st.out("fifo");
    mkfifo(&fifo);
    let out = st.out("from-fifo");
    let child = cmd(&[&["extract", "--data", s(&fifo), "--out", s(&out)][..], &SMALL].concat()).spawn().unwrap();
    let f = fifo.clone();
    let t = std::thread::spawn(move || std::fs::write(f, bytes));
    let o = wait(child, 120);
    t.join().unwrap().unwrap();
    assert!(o.ok && o.stdout.contains("wrote 30 samples"), "{}{}", o.stdout, o.stderr);
    assert!(data_files(&out) == want);
    let m = Manifest::read(&out).unwrap();
    let input = m.input.unwrap();
    assert_eq!((input.path.as_str(), input.whole.samples), (s(&fifo), 30));

    // A device never ends: refused by kind, before anything is written.
    let o = extract(&["--data", "/dev/zero", "--out", s(&st.out("zero"))]);
    assert!(!o.ok && o.stderr.contains("/dev/zero is a device"), "{}", o.stderr);
    assert!(!st.out("zero").exists());
}

/// An interrupted run: `shards` shards durable, then killed.
fn interrupted(st: &Setup, out: &Path, extra: &[&str], shards: usize) {
    extract_killed_at(
        &format!("renamed:{shards}"),
        &[&["--data", s(&st.data), "--out", s(out)][..], &SMALL, extra].concat(),
    );
    assert_eq!(Manifest::read(out).unwrap().shards.len(), shards);
}

#[test]
fn resume_refuses_other_data_weights_or_settings_and_says_what_differs() {
    let st = setup(60);
    let whole = st.out("whole");
    assert!(extract(&[&["--data", s(&st.data), "--out", s(&whole)][..], &SMALL].concat()).ok);
    let cut = st.out("cut");
    interrupted(&st, &cut, &[], 3);
    let consumed = Manifest::read(&cut).unwrap().consumed();
    let text = std::fs::read_to_string(&st.data).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let resume = |data: &Path, extra: &[&str]| {
        extract(&[&["--data", s(data), "--out", s(&cut), "--resume"][..], &SMALL, extra].concat())
    };

    // Other data: different ids.
    let other = st.out("other.jsonl");
    write_data(&other, 60, 5..60, 12);
    let o = resume(&other, &[]);
    assert!(!o.ok && o.stderr.contains("not the input the output was made from"), "{}", o.stderr);
    // A shorter file.
    let short = st.out("short.jsonl");
    std::fs::write(&short, lines[..consumed - 2].join("\n")).unwrap();
    let o = resume(&short, &[]);
    assert!(!o.ok && o.stderr.contains(&format!("input ends after {} samples", consumed - 2)), "{}", o.stderr);
    // Same ids and lengths, one token changed: only the digest can tell.
    let edited = st.out("edited.jsonl");
    let mut v: serde_json::Value = serde_json::from_str(lines[1]).unwrap();
    let t = v["input_ids"][0].as_u64().unwrap();
    v["input_ids"][0] = ((t + 1) % 256).into();
    let mut e: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
    e[1] = v.to_string();
    std::fs::write(&edited, e.join("\n") + "\n").unwrap();
    let o = resume(&edited, &[]);
    assert!(!o.ok && o.stderr.contains("digest"), "{}", o.stderr);
    // Settings whose outputs differ in the last bits.
    let o = resume(&st.data, &["--tp", "2"]);
    assert!(!o.ok && o.stderr.contains("run differs") && o.stderr.contains("--tp 1"), "{}", o.stderr);
    let o = resume(&st.data, &["--backend", "reference"]);
    assert!(!o.ok && o.stderr.contains("run differs") && o.stderr.contains("backend cpu"), "{}", o.stderr);
    let o = resume(&st.data, &["--on-nonfinite", "skip"]);
    assert!(!o.ok && o.stderr.contains("on_nonfinite differs"), "{}", o.stderr);
    // None of that touched the output: the right input completes it.
    assert!(Manifest::read(&cut).unwrap().shards.len() == 3);
    let o = resume(&st.data, &[]);
    assert!(o.ok, "{}", o.stderr);
    assert!(dir_contents(&whole) == dir_contents(&cut), "resumed output differs from the uninterrupted run");

    // A finished output: a refused resume leaves it finished and unchanged.
    let before = dir_contents(&whole);
    let resume_whole =
        |data: &Path| extract(&[&["--data", s(data), "--out", s(&whole), "--resume"][..], &SMALL].concat());
    let o = resume_whole(&other);
    assert!(!o.ok && o.stderr.contains("not the input"), "{}", o.stderr);
    let longer = st.out("longer.jsonl");
    std::fs::write(&longer, format!("{text}{{\"id\": \"extra\", \"input_ids\": [1, 2]}}\n")).unwrap();
    let o = resume_whole(&longer);
    assert!(!o.ok && o.stderr.contains("complete with 60 samples, and this input has more"), "{}", o.stderr);
    let trailing = st.out("trailing.jsonl");
    std::fs::write(&trailing, format!("{text}\n")).unwrap();
    let o = resume_whole(&trailing);
    assert!(!o.ok && o.stderr.contains("bytes with digest"), "{}", o.stderr);
    assert!(dir_contents(&whole) == before, "a refused resume changed the output");
    let (ok, text) = verify(&whole, &[]);
    assert!(ok, "{text}");
    // The same input: nothing to do, nothing changes.
    assert!(resume_whole(&st.data).ok);
    assert!(dir_contents(&whole) == before);
}

#[test]
fn resume_refuses_other_weights_under_the_same_config() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    std::fs::create_dir(&model).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture("qwen3").join(f), model.join(f)).unwrap();
    }
    let data = fixture("qwen3").join("data.jsonl");
    let out = tmp.path().join("out");
    let args = ["--model", s(&model), "--data", s(&data), "--out", s(&out), "--shard-size", "4KiB"];
    extract_killed_at("renamed:1", &args);
    // One weight changes: the last byte of the last tensor's data.
    let w = model.join("model.safetensors");
    let mut bytes = std::fs::read(&w).unwrap();
    let n = bytes.len();
    bytes[n - 2] ^= 0x01;
    std::fs::write(&w, &bytes).unwrap();
    let o = extract(&[&args[..], &["--resume"]].concat());
    assert!(!o.ok && o.stderr.contains("model.weights_digest differs"), "{}", o.stderr);
    // The digest ignores where the checkpoint lives: a copy elsewhere matches.
    bytes[n - 2] ^= 0x01;
    let copy = tmp.path().join("elsewhere");
    std::fs::create_dir(&copy).unwrap();
    std::fs::copy(model.join("config.json"), copy.join("config.json")).unwrap();
    std::fs::write(copy.join("model.safetensors"), &bytes).unwrap();
    let moved = ["--model", s(&copy), "--data", s(&data), "--out", s(&out), "--shard-size", "4KiB", "--resume"];
    let o = extract(&moved);
    assert!(o.ok, "{}", o.stderr);
}

#[test]
fn resume_redoes_missing_or_truncated_shards_and_never_calls_a_hole_complete() {
    let st = setup(60);
    let whole = st.out("whole");
    assert!(extract(&[&["--data", s(&st.data), "--out", s(&whole)][..], &SMALL].concat()).ok);
    let m = Manifest::read(&whole).unwrap();
    assert!(m.shards.len() >= 5, "want several shards, got {}", m.shards.len());
    for (case, damage) in [("missing", 1usize), ("truncated", 2)] {
        let d = st.out(case);
        std::fs::create_dir(&d).unwrap();
        for (f, b) in dir_contents(&whole) {
            std::fs::write(d.join(f), b).unwrap();
        }
        let shard = d.join(&m.shards[damage].file);
        if case == "missing" {
            std::fs::remove_file(&shard).unwrap();
        } else {
            let len = std::fs::metadata(&shard).unwrap().len();
            std::fs::OpenOptions::new().write(true).open(&shard).unwrap().set_len(len - 100).unwrap();
        }
        let (ok, text) = verify(&d, &[]);
        assert!(!ok, "{case}: verify passed a hole: {text}");
        // A resume killed right after it deleted the shards to redo, before its manifest is down.
        extract_killed_at(
            "manifest-temp:1",
            &[&["--data", s(&st.data), "--out", s(&d), "--resume"][..], &SMALL].concat(),
        );
        let o = extract(&[&["--data", s(&st.data), "--out", s(&d), "--resume"][..], &SMALL].concat());
        assert!(o.ok, "{case}: {}", o.stderr);
        assert!(o.stderr.contains("written again"), "{case}: no word about the redone shards: {}", o.stderr);
        assert!(dir_contents(&whole) == dir_contents(&d), "{case}: resumed output differs");
    }
}

#[test]
fn a_kill_at_every_write_stage_resumes_to_the_uninterrupted_output() {
    let st = setup(24);
    for format in ["strata", "speculators"] {
        let mut opts = [&["--data", s(&st.data), "--format", format][..], &SMALL].concat();
        if format == "speculators" {
            // The resumed run's trainer files count every row, the first run's too.
            opts.extend(["--draft-vocab-size", "7,40"]);
        }
        let whole = st.out(&format!("whole-{format}"));
        assert!(extract(&[&opts[..], &["--out", s(&whole)]].concat()).ok);
        // The manifest is written at the start (hit 1) and when compacted at the end (hit 2).
        for stage in ["shard-synced:2", "journaled:2", "renamed:2", "manifest-temp:1", "manifest-temp:2", "compacted"] {
            let cut = st.out(&format!("{format}-{}", stage.replace(':', "-")));
            extract_killed_at(stage, &[&opts[..], &["--out", s(&cut)]].concat());
            if cut.join("manifest.json").exists() {
                let (ok, text) = verify(&cut, &[]);
                let finished = stage == "compacted";
                assert_eq!(ok, finished, "{format} {stage}: verify says {text}");
            }
            let o = extract(&[&opts[..], &["--out", s(&cut), "--resume"]].concat());
            assert!(o.ok, "{format} {stage}: {}", o.stderr);
            assert!(dir_contents(&whole) == dir_contents(&cut), "{format} {stage}: resumed output differs");
            let leftovers: Vec<_> = dir_contents(&cut).into_iter().filter(|(n, _)| n.ends_with(".tmp")).collect();
            assert!(leftovers.is_empty(), "{format} {stage}: temporary files left");
        }
    }
}

#[test]
fn the_journal_grows_by_a_line_per_shard_instead_of_rewriting_the_manifest() {
    let st = setup(60);
    let out = st.out("out");
    extract_killed_at("journaled:6", &[&["--data", s(&st.data), "--out", s(&out)][..], &SMALL].concat());
    let raw: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(raw["shards"].as_array().unwrap().len(), 0, "the manifest was rewritten per shard");
    let journal = std::fs::read_to_string(out.join("journal.jsonl")).unwrap();
    assert_eq!(journal.lines().count(), 6);
    // Readers see the journal replayed; the sixth shard was journaled, never renamed.
    let m = Manifest::read(&out).unwrap();
    assert_eq!(m.shards.len(), 6);
    assert!(!out.join(&m.shards[5].file).exists());
    let o = extract(&[&["--data", s(&st.data), "--out", s(&out), "--resume"][..], &SMALL].concat());
    assert!(o.ok, "{}", o.stderr);
    let (ok, text) = verify(&out, &[]);
    assert!(ok, "{text}");
    assert!(!out.join("journal.jsonl").exists(), "the journal was not compacted");
}

#[test]
fn resume_deletes_only_what_the_manifest_lists_and_never_replaces_a_stranger() {
    let st = setup(60);
    let cut = st.out("cut");
    interrupted(&st, &cut, &[], 3);
    let strangers = ["shard-99999.safetensors", ".notes.tmp", ".shard-00004.safetensors.tmp", "hs_5.safetensors"];
    for n in strangers {
        std::fs::write(cut.join(n), format!("user file {n}")).unwrap();
    }
    // A file under the name the next shard will take: never replaced.
    let next = cut.join("shard-00003.safetensors");
    std::fs::write(&next, "mine").unwrap();
    let resume = || extract(&[&["--data", s(&st.data), "--out", s(&cut), "--resume"][..], &SMALL].concat());
    let o = resume();
    assert!(!o.ok && o.stderr.contains("no manifest lists it"), "{}", o.stderr);
    assert_eq!(std::fs::read_to_string(&next).unwrap(), "mine");
    std::fs::remove_file(&next).unwrap();
    let o = resume();
    assert!(o.ok, "{}", o.stderr);
    for n in strangers {
        assert_eq!(std::fs::read_to_string(cut.join(n)).unwrap(), format!("user file {n}"), "{n} was touched");
    }
}

#[test]
fn links_planted_in_the_output_are_never_followed() {
    let st = setup(60);
    let victim = st.out("victim");
    std::fs::write(&victim, "precious").unwrap();
    let cut = st.out("cut");
    interrupted(&st, &cut, &[], 2);
    let old_nonce = Manifest::read(&cut).unwrap().nonce;
    assert_eq!(old_nonce.len(), 16);
    // Links at every temporary name a predictable run would use, and at the old run's.
    let mut planted = vec![];
    for i in 0..12 {
        planted.push(format!(".shard-{i:05}.safetensors.tmp"));
        planted.push(format!(".shard-{i:05}.safetensors.{old_nonce}.tmp"));
    }
    planted.push(".manifest.json.tmp".into());
    for n in &planted {
        std::os::unix::fs::symlink(&victim, cut.join(n)).unwrap();
    }
    // The lock file as a link: refused, not followed.
    let lock = cut.join(".strata.lock");
    std::fs::remove_file(&lock).unwrap();
    std::os::unix::fs::symlink(&victim, &lock).unwrap();
    let resume = || extract(&[&["--data", s(&st.data), "--out", s(&cut), "--resume"][..], &SMALL].concat());
    let o = resume();
    assert!(!o.ok && o.stderr.contains(".strata.lock"), "{}", o.stderr);
    std::fs::remove_file(&lock).unwrap();
    let o = resume();
    assert!(o.ok, "{}", o.stderr);
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    let (ok, text) = verify(&cut, &[]);
    assert!(ok, "{text}");
}

#[test]
fn a_second_run_on_the_same_output_is_refused_while_the_first_holds_it() {
    let st = setup(40);
    let fifo = st.out("fifo");
    mkfifo(&fifo);
    let out = st.out("out");
    let first = cmd(&["extract", "--data", s(&fifo), "--out", s(&out), "--max-batch-tokens", "16"]).spawn().unwrap();
    let mut w = std::fs::OpenOptions::new().write(true).open(&fifo).unwrap();
    let text = std::fs::read_to_string(&st.data).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    // Half the input; the first run writes it and waits for more, holding the directory.
    for l in &lines[..20] {
        writeln!(w, "{l}").unwrap();
    }
    w.flush().unwrap();
    let start = Instant::now();
    while !out.join("manifest.json").exists() {
        assert!(start.elapsed() < Duration::from_secs(60), "the first run wrote nothing");
        std::thread::sleep(Duration::from_millis(10));
    }
    for mode in ["--resume", "--overwrite"] {
        let o = extract(&["--data", s(&st.data), "--out", s(&out), mode]);
        assert!(!o.ok && o.stderr.contains("another strata run is writing"), "{mode}: {}", o.stderr);
    }
    for l in &lines[20..] {
        writeln!(w, "{l}").unwrap();
    }
    drop(w);
    let o = wait(first, 120);
    assert!(o.ok && o.stdout.contains("wrote 40 samples"), "{}{}", o.stdout, o.stderr);
    let (ok, text) = verify(&out, &[]);
    assert!(ok, "{text}");
}

#[test]
fn an_interrupted_overwrite_never_leaves_old_data_that_looks_complete() {
    let st = setup(30);
    let out = st.out("out");
    let native = [&["--data", s(&st.data), "--out", s(&out)][..], &SMALL].concat();
    assert!(extract(&native).ok);
    extract_killed_at("overwrite-cleared", &[&native[..], &["--overwrite", "--dtype", "f32"]].concat());
    // The old manifest went first: nothing calls the leftovers a dataset.
    let (ok, text) = verify(&out, &[]);
    assert!(!ok && text.contains("has no manifest.json"), "{text}");
    let o = extract(&[&native[..], &["--resume"]].concat());
    assert!(!o.ok && o.stderr.contains("cannot resume"), "{}", o.stderr);
    let o = extract(&[&native[..], &["--overwrite", "--dtype", "f32"]].concat());
    assert!(o.ok, "{}", o.stderr);
    let (ok, text) = verify(&out, &[]);
    assert!(ok && Manifest::read(&out).unwrap().dtype == "f32", "{text}");

    // Native over speculators: no hs_ file or dataset table survives.
    let spec = st.out("spec");
    assert!(extract(&["--data", s(&st.data), "--out", s(&spec), "--format", "speculators"]).ok);
    assert!(extract(&[&["--data", s(&st.data), "--out", s(&spec), "--overwrite"][..], &SMALL].concat()).ok);
    let names: Vec<String> = dir_contents(&spec).into_iter().map(|(n, _)| n).collect();
    let old = |n: &String| n.contains("hs_") || n.ends_with(".arrow") || n == "state.json" || n == "dataset_info.json";
    assert!(!names.iter().any(old), "{names:?}");
    let (ok, text) = verify(&spec, &[]);
    assert!(ok, "{text}");
}

/// A copy of the qwen3 fixture whose embedding row of token `t` is NaN:
/// exactly the samples holding `t` get NaN states.
fn nan_model(dir: &Path, t: usize) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::copy(fixture("qwen3").join("config.json"), dir.join("config.json")).unwrap();
    let mut bytes = std::fs::read(fixture("qwen3").join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let e = &header["model.embed_tokens.weight"];
    assert_eq!(e["dtype"], "F32");
    let hidden = e["shape"][1].as_u64().unwrap() as usize;
    let start = 8 + n + e["data_offsets"][0].as_u64().unwrap() as usize + t * hidden * 4;
    for c in bytes[start..start + hidden * 4].chunks_exact_mut(4) {
        c.copy_from_slice(&f32::NAN.to_le_bytes());
    }
    std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
}

#[test]
fn non_finite_states_fail_by_default_or_are_skipped_and_recorded() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("nan-model");
    nan_model(&model, 7);
    let data = tmp.path().join("data.jsonl");
    let rows = ["[1, 2, 3]", "[4, 7, 5]", "[8, 9]", "[7]", "[10, 11, 12, 13]", "[7, 7]"];
    let text: String =
        rows.iter().enumerate().map(|(i, r)| format!("{{\"id\": \"r{i}\", \"input_ids\": {r}}}\n")).collect();
    std::fs::write(&data, text).unwrap();
    let run = |out: &Path, extra: &[&str]| {
        extract(
            &[&["--model", s(&model), "--data", s(&data), "--out", s(out), "--capture", "embeddings,final"][..], extra]
                .concat(),
        )
    };
    let o = run(&tmp.path().join("fail"), &[]);
    assert!(!o.ok, "NaN states were written");
    assert!(o.stderr.contains("sample r1 (line 2): capture point embeddings holds"), "{}", o.stderr);
    assert!(o.stderr.contains("--on-nonfinite skip"), "{}", o.stderr);

    let native = tmp.path().join("native");
    let o = run(&native, &["--on-nonfinite", "skip"]);
    assert!(o.ok && o.stdout.contains("skipped     3 samples"), "{}{}", o.stdout, o.stderr);
    let m = Manifest::read(&native).unwrap();
    let skipped: Vec<(&str, usize)> = m.skipped.iter().map(|s| (s.id.as_str(), s.index)).collect();
    assert_eq!(skipped, [("r1", 1), ("r3", 3), ("r5", 5)]);
    assert_eq!(m.samples.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(), ["r0", "r2", "r4"]);
    let (ok, text) = verify(&native, &[]);
    assert!(ok, "{text}");

    // Speculators: file i holds table row i; a skipped sample has neither.
    let spec = tmp.path().join("spec");
    let o = run(&spec, &["--on-nonfinite", "skip", "--format", "speculators"]);
    assert!(o.ok, "{}", o.stderr);
    for (i, present) in [true, true, true, false].into_iter().enumerate() {
        assert_eq!(spec.join(format!("hidden_states/hs_{i}.safetensors")).exists(), present, "hs_{i}");
    }
    let f = strata::dataset::MappedFile::open(&spec.join("hidden_states/hs_1.safetensors")).unwrap();
    let ids: Vec<i64> =
        f.bytes(&f.tensors["token_ids"]).chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!(ids, [8, 9]);
    let (ok, text) = verify(&spec, &[]);
    assert!(ok, "{text}");
    // A finished output whose last rows were skipped resumes to itself.
    for (dir, format) in [(&native, "strata"), (&spec, "speculators")] {
        let before = dir_contents(dir);
        let o = run(dir, &["--on-nonfinite", "skip", "--format", format, "--resume"]);
        assert!(o.ok, "{format}: {}", o.stderr);
        assert!(dir_contents(dir) == before, "{format}: resume changed a finished output");
    }
}

#[test]
fn endless_and_huge_lines_are_refused_within_bounded_memory() {
    // 2 GB of address space: the strata process's whole budget.
    let limited = |input: &str, out: &Path| {
        let script = format!("ulimit -v 2000000; {input} | exec \"$0\" extract --data - --out \"$1\"");
        let c = Command::new("sh")
            .args(["-c", &script, env!("CARGO_BIN_EXE_strata"), s(out)])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        wait(c, 120)
    };
    let tmp = tempfile::tempdir().unwrap();
    // A stream with no newline at all.
    let o = limited("cat /dev/zero", &tmp.path().join("a"));
    assert!(!o.ok && o.stderr.contains("line is longer than"), "{}", o.stderr);
    // A 100 MB line of token ids: refused once past the model's length, long before its end.
    let big = tmp.path().join("big.jsonl");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&big).unwrap());
    f.write_all(b"{\"input_ids\": [1").unwrap();
    for _ in 0..50_000_000 {
        f.write_all(b",1").unwrap();
    }
    f.write_all(b"]}\n").unwrap();
    drop(f);
    let o = limited(&format!("cat {}", s(&big)), &tmp.path().join("b"));
    assert!(!o.ok && (o.stderr.contains("more than") || o.stderr.contains("longer than")), "{}", o.stderr);
    assert!(!o.stderr.contains("memory allocation"), "{}", o.stderr);
}

#[test]
fn messages_quote_a_huge_id_cut_short() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data.jsonl");
    // 500 KB: under the line limit, so the id itself is refused.
    std::fs::write(&data, format!("{{\"id\": \"{}\", \"input_ids\": [1, 2]}}\n", "x".repeat(500_000))).unwrap();
    let o = extract(&["--data", s(&data), "--out", s(&tmp.path().join("out"))]);
    assert!(!o.ok && o.stderr.contains("must be 1 to 256 bytes"), "{}", &o.stderr[..o.stderr.len().min(400)]);
    assert!(o.stderr.len() < 1000, "message of {} bytes", o.stderr.len());
}

#[test]
fn ids_that_need_escaping_fit_the_shard_header() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data.jsonl");
    let mut text = String::new();
    for i in 0..40 {
        // 250 quotes and backslashes: each takes two bytes in the header.
        // ... and ids that differ only in a space after a comma.
        let id = if i < 2 { ["a, b", "a,b"][i].to_string() } else { format!("{}{i}", "\"\\".repeat(125)) };
        text += &serde_json::json!({"id": id, "input_ids": [1, 2, 3]}).to_string();
        text.push('\n');
    }
    std::fs::write(&data, text).unwrap();
    let out = tmp.path().join("out");
    let o = extract(&["--data", s(&data), "--out", s(&out), "--shard-size", "1MiB"]);
    assert!(o.ok, "{}", o.stderr);
    let (ok, text) = verify(&out, &[]);
    assert!(ok && text.contains("40 samples"), "{text}");
    let m = Manifest::read(&out).unwrap();
    assert_eq!((m.samples[0].id.as_str(), m.samples[1].id.as_str()), ("a, b", "a,b"));
}

#[test]
fn a_full_disk_leaves_no_partial_file_and_resumes_to_the_uninterrupted_output() {
    let st = setup(60);
    let whole = st.out("whole");
    let opts = ["--shard-size", "64KiB", "--max-batch-tokens", "64"];
    assert!(extract(&[&["--data", s(&st.data), "--out", s(&whole)][..], &opts].concat()).ok);
    let m = Manifest::read(&whole).unwrap();
    assert!(m.shards.len() >= 3 && m.shards.iter().all(|s| s.bytes > 40 << 10), "{:?}", m.shards);
    // No file may grow past 40 KiB: the first shard's write fails as on a full
    // disk (EFBIG rather than ENOSPC; SIGXFSZ ignored so the write returns the error).
    let out = st.out("full");
    let script = "trap '' XFSZ; ulimit -f 40; exec \"$0\" extract --data \"$1\" --out \"$2\" --shard-size 64KiB --max-batch-tokens 64";
    let c = Command::new("bash")
        .args(["-c", script, env!("CARGO_BIN_EXE_strata"), s(&st.data), s(&out)])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let o = wait(c, 120);
    assert!(!o.ok && o.stderr.contains("cannot write") && o.stderr.contains("File too large"), "{}", o.stderr);
    // Every final name holds a whole file: only the manifest, parsed, with nothing listed.
    let names: Vec<String> = dir_contents(&out).into_iter().map(|(n, _)| n).collect();
    assert!(names.iter().all(|n| !n.starts_with("shard-")), "{names:?}");
    assert_eq!(Manifest::read(&out).unwrap().shards.len(), 0);
    let o = extract(&[&["--data", s(&st.data), "--out", s(&out), "--resume"][..], &opts].concat());
    assert!(o.ok, "{}", o.stderr);
    assert!(dir_contents(&whole) == dir_contents(&out), "resumed output differs from the uninterrupted run");
}

/// The same for the speculators writer, whose files are written on writer
/// threads and committed on another: the first file past the limit fails
/// the run with the write's error, the files before it are committed, none
/// after it is, and a resume completes the same output.
#[test]
fn a_full_disk_under_the_speculators_writer_fails_cleanly_and_resumes() {
    let st = setup(60);
    let whole = st.out("whole");
    let opts = ["--format", "speculators", "--max-batch-tokens", "64"];
    assert!(extract(&[&["--data", s(&st.data), "--out", s(&whole)][..], &opts].concat()).ok);
    let m = Manifest::read(&whole).unwrap();
    // A limit (in KiB) that the first files fit and a later one does not.
    let sizes: Vec<u64> = m.shards.iter().map(|s| s.bytes).collect();
    let limit_kib = (4..60).find(|k| sizes[..4].iter().all(|&b| b <= k << 10) && sizes.iter().any(|&b| b > k << 10));
    let limit_kib = limit_kib.unwrap_or_else(|| panic!("no limit splits the files: {sizes:?}"));
    let first_over = sizes.iter().position(|&b| b > limit_kib << 10).unwrap();
    let out = st.out("full");
    let script = format!(
        "trap '' XFSZ; ulimit -f {limit_kib}; exec \"$0\" extract --data \"$1\" --out \"$2\" {}",
        opts.join(" ")
    );
    let c = Command::new("bash")
        .args(["-c", &script, env!("CARGO_BIN_EXE_strata"), s(&st.data), s(&out)])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let o = wait(c, 120);
    assert!(!o.ok && o.stderr.contains("cannot write") && o.stderr.contains("File too large"), "{}", o.stderr);
    // The files before the failed one are listed, whole; nothing else is in place.
    let listed = Manifest::read(&out).unwrap().shards;
    assert_eq!(listed.len(), first_over, "the file of row {first_over} failed");
    let hs = out.join("hidden_states");
    let mut names: Vec<String> =
        if hs.exists() { dir_contents(&hs).into_iter().map(|(n, _)| n).collect() } else { Vec::new() };
    names.sort();
    let mut expect: Vec<String> =
        listed.iter().map(|s| s.file.trim_start_matches("hidden_states/").to_string()).collect();
    expect.sort();
    assert_eq!(names, expect, "files in place that no manifest lists, or listed files missing");
    let temps: Vec<String> = dir_contents(&out).into_iter().map(|(n, _)| n).filter(|n| n.ends_with(".tmp")).collect();
    assert!(temps.is_empty(), "temporary files left: {temps:?}");
    let o = extract(&[&["--data", s(&st.data), "--out", s(&out), "--resume"][..], &opts].concat());
    assert!(o.ok, "{}", o.stderr);
    assert!(dir_contents(&whole) == dir_contents(&out), "resumed output differs from the uninterrupted run");
}

#[test]
fn schema_1_datasets_are_still_read_by_inspect_and_verify() {
    let st = setup(12);
    let out = st.out("out");
    assert!(extract(&["--data", s(&st.data), "--out", s(&out)]).ok);
    // The manifest as schema 1 wrote it: none of schema 2's fields.
    let path = out.join("manifest.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let o = v.as_object_mut().unwrap();
    o.insert("schema_version".into(), 1.into());
    for k in ["run", "input", "on_nonfinite", "skipped", "nonce"] {
        o.remove(k);
    }
    o["model"].as_object_mut().unwrap().remove("weights_digest");
    for sh in o["shards"].as_array_mut().unwrap() {
        sh.as_object_mut().unwrap().remove("input");
    }
    for sa in o["samples"].as_array_mut().unwrap() {
        sa.as_object_mut().unwrap().remove("index");
    }
    std::fs::write(&path, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
    let (ok, text) = verify(&out, &[]);
    assert!(ok && text.contains("12 samples"), "{text}");
    let (ok, text, err) = strata(&[os("inspect"), out.as_os_str()]);
    assert!(ok && text.contains("samples:     12"), "{text}{err}");
    // Nothing to check a resume against: refused, with the field that is missing.
    let o = extract(&["--data", s(&st.data), "--out", s(&out), "--resume"]);
    assert!(!o.ok && o.stderr.contains("weights_digest differs"), "{}", o.stderr);
}

#[test]
fn a_fifo_or_link_in_place_of_the_lock_file_is_refused_without_hanging() {
    let st = setup(4);
    for mode in [None, Some("--resume"), Some("--overwrite")] {
        let out = st.out(&format!("out{}", mode.map_or(0, str::len)));
        std::fs::create_dir(&out).unwrap();
        mkfifo(&out.join(".strata.lock"));
        let o = extract(&[&["--data", s(&st.data), "--out", s(&out)][..], mode.as_slice()].concat());
        assert!(!o.ok && o.stderr.contains(".strata.lock"), "{mode:?}: {}", o.stderr);
    }
}

/// A copy of the qwen3 fixture whose config says `max_position_embeddings: max`.
fn long_context_model(dir: &Path, max: u64) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::copy(fixture("qwen3").join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    let mut c: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture("qwen3").join("config.json")).unwrap()).unwrap();
    c["max_position_embeddings"] = max.into();
    std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
}

#[test]
fn long_lines_are_bounded_whatever_the_models_context() {
    let tmp = tempfile::tempdir().unwrap();
    let limited = |model: &Path, input: &str, out: &str| {
        let script = format!("ulimit -v 2000000; {input} | exec \"$0\" extract --model \"$1\" --data - --out \"$2\"");
        let out = tmp.path().join(out);
        let c = Command::new("sh")
            .args(["-c", &script, env!("CARGO_BIN_EXE_strata"), s(model), s(&out)])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        wait(c, 120)
    };
    // A context so large that it sets no useful limit: lines still stop at 64 MiB.
    let huge = tmp.path().join("huge");
    long_context_model(&huge, 1_000_000_000_000_000);
    let o = limited(&huge, "cat /dev/zero", "a");
    assert!(!o.ok && o.stderr.contains("line is longer than 67108864 bytes"), "{}", o.stderr);
    // A 60 MB line of 30 million token ids, for a model of 8 million positions:
    // the ids are scanned in place and the sample refused at the 8,000,001st.
    let long = tmp.path().join("long");
    long_context_model(&long, 8_000_000);
    let big = tmp.path().join("big.jsonl");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&big).unwrap());
    f.write_all(b"{\"input_ids\": [1").unwrap();
    for _ in 0..30_000_000 {
        f.write_all(b",1").unwrap();
    }
    f.write_all(b"]}\n").unwrap();
    drop(f);
    let o = limited(&long, &format!("cat {}", s(&big)), "b");
    assert!(!o.ok && o.stderr.contains("sample has more than 8000000 tokens"), "{}", o.stderr);
    assert!(!o.stderr.contains("memory allocation"), "{}", o.stderr);
}

/// The speculators trainer writes into the data directory itself: its
/// draft-vocabulary cache (`d2t-N.npy`, `t2d-N.npy`), `token_freq.pt`, and
/// checkpoints when `--save-path` points inside. verify and inspect leave
/// them alone; --resume, --overwrite and merge remove the vocabulary files
/// (they describe the rows as they were) and say so, and never touch a
/// checkpoint directory.
#[test]
fn the_trainers_own_files_in_the_data_directory_are_known_to_every_command() {
    let st = setup(12);
    let opts = ["--data", s(&st.data), "--format", "speculators", "--draft-vocab-size", "16"];
    let out = st.out("spec");
    let o = extract(&[&opts[..], &["--out", s(&out)]].concat());
    assert!(o.ok, "{}", o.stderr);
    assert!(o.stdout.contains("--target-layer-ids 2 4 5 --draft-vocab-size 16"), "{}", o.stdout);
    let plant = |dir: &Path| {
        for f in ["d2t-32.npy", "t2d-32.npy"] {
            std::fs::write(dir.join(f), b"the trainer's cache").unwrap();
        }
        std::fs::create_dir_all(dir.join("checkpoints/0")).unwrap();
        std::fs::write(dir.join("checkpoints/0/model.safetensors"), b"a draft").unwrap();
    };
    plant(&out);
    let (ok, text) = verify(&out, &[]);
    assert!(ok, "{text}");
    let (ok, text, err) = strata(&[os("inspect"), out.as_os_str()]);
    assert!(ok, "{text}{err}");

    let o = extract(&[&opts[..], &["--out", s(&out), "--resume"]].concat());
    assert!(o.ok, "{}", o.stderr);
    assert!(o.stderr.contains("removed d2t-16.npy, d2t-32.npy, t2d-16.npy, t2d-32.npy, token_freq.pt"), "{}", o.stderr);
    assert!(!out.join("d2t-32.npy").exists() && out.join("d2t-16.npy").exists());
    assert!(out.join("checkpoints/0/model.safetensors").exists());

    plant(&out);
    let o = extract(&["--data", s(&st.data), "--format", "speculators", "--out", s(&out), "--overwrite"]);
    assert!(o.ok, "{}", o.stderr);
    for f in ["d2t-32.npy", "t2d-32.npy", "d2t-16.npy", "t2d-16.npy", "token_freq.pt"] {
        assert!(!out.join(f).exists(), "{f} survived --overwrite");
    }
    assert_eq!(std::fs::read(out.join("checkpoints/0/model.safetensors")).unwrap(), b"a draft");
    let (ok, text) = verify(&out, &[]);
    assert!(ok, "{text}");

    // Parts: the merged directory's cache goes, and the merge writes the parts' sizes.
    let root = st.out("parts");
    for i in ["0", "1"] {
        let o = extract(&[&opts[..], &["--out", s(&root), "--part-index", i, "--num-parts", "2"]].concat());
        assert!(o.ok, "{}", o.stderr);
    }
    plant(&root);
    let (ok, o, e) = strata(&[os("merge"), root.as_os_str()]);
    assert!(ok, "{o}{e}");
    assert!(!root.join("d2t-32.npy").exists() && root.join("d2t-16.npy").exists(), "{o}{e}");
    assert!(root.join("checkpoints/0/model.safetensors").exists());
    let one = st.out("one");
    assert!(extract(&[&opts[..], &["--out", s(&one)]].concat()).ok);
    for f in ["token_freq.pt", "d2t-16.npy", "t2d-16.npy"] {
        assert!(std::fs::read(root.join(f)).unwrap() == std::fs::read(one.join(f)).unwrap(), "{f}");
    }
    let (ok, text) = verify(&root, &[]);
    assert!(ok, "{text}");
}

#[test]
fn draft_vocab_size_needs_the_speculators_format_and_a_size_within_the_vocabulary() {
    let st = setup(3);
    let cases = [
        ("a", "strata", "16", "needs --format speculators"),
        ("b", "speculators", "257", "between 1 and the model's vocabulary size 256"),
        ("c", "speculators", "0", "between 1 and"),
    ];
    for (out, format, size, says) in cases {
        let out = st.out(out);
        let o = extract(&["--data", s(&st.data), "--out", s(&out), "--format", format, "--draft-vocab-size", size]);
        assert!(!o.ok && o.stderr.contains(says), "{format} {size}: {}", o.stderr);
    }
    assert!(!st.out("a").exists() && !st.out("b").exists() && !st.out("c").exists());
}
