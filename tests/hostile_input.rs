//! The second round of hostile input: chat templates, tokenizers, long
//! conversations, unknown roles, merge and planted links. Each class of bad
//! case has a test here; bounds are asserted under `ulimit -v` and with a
//! timeout (absolute times with a 5x margin for this shared 2-core machine,
//! or as scaling: twice the input at most 2.5x the time), never by reading logs.

use crate::common;

use common::chat_model;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// One finished `strata` run.
struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    secs: f64,
}

impl Run {
    fn ok(&self) -> bool {
        self.code == Some(0)
    }

    /// Asserts success.
    fn assert_ok(&self) -> &Self {
        assert!(self.ok(), "expected success, exit {:?}:\n{}\n{}", self.code, self.stdout, self.stderr);
        self
    }

    /// Asserts exit 1 with every needle in the output.
    fn assert_fails(&self, needles: &[&str]) -> &Self {
        assert_eq!(self.code, Some(1), "expected exit 1:\n{}\n{}", self.stdout, self.stderr);
        self.assert_says(needles)
    }

    /// Asserts every needle is in stdout or stderr.
    fn assert_says(&self, needles: &[&str]) -> &Self {
        let all = format!("{}{}", self.stdout, self.stderr);
        for n in needles {
            assert!(all.contains(n), "output lacks {n:?}:\n{all}");
        }
        self
    }
}

/// Runs `strata ARGS` killing it after `secs` (a test failure), under
/// `ulimit -v KB` when given; stdout and stderr go to files, so a chatty run
/// cannot block on a full pipe. A panic, an abort or any signal fails the test.
fn strata_in(args: &[&str], limit_kb: Option<u64>, secs: u64, env: &[(&str, &str)], cwd: Option<&Path>) -> Run {
    let tmp = tempfile::tempdir().unwrap();
    // STRATA_BIN runs these tests against another build (an earlier commit's, to show what they catch).
    let built = std::env::var("STRATA_BIN").ok();
    let bin = built.as_deref().unwrap_or(env!("CARGO_BIN_EXE_strata"));
    let mut cmd = match limit_kb {
        Some(kb) => {
            let mut c = Command::new("sh");
            c.args(["-c", &format!("ulimit -v {kb}; exec \"$0\" \"$@\""), bin]);
            // Few threads and malloc arenas: the limit then bounds the work, not the runtime's reservations.
            c.env("RAYON_NUM_THREADS", "2").env("MALLOC_ARENA_MAX", "2");
            c
        }
        None => Command::new(bin),
    };
    // The test's own environment may hold a launcher's variables: only the given ones count.
    for v in LAUNCHER_VARS {
        cmd.env_remove(v);
    }
    cmd.args(args).envs(env.iter().copied());
    if let Some(d) = cwd {
        cmd.current_dir(d);
    }
    let (out_path, err_path) = (tmp.path().join("stdout"), tmp.path().join("stderr"));
    cmd.stdin(Stdio::null())
        .stdout(Stdio::from(std::fs::File::create(&out_path).unwrap()))
        .stderr(Stdio::from(std::fs::File::create(&err_path).unwrap()));
    let start = Instant::now();
    let mut child = cmd.spawn().unwrap();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > Duration::from_secs(secs) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("strata did not finish within {secs} s: {args:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let secs = start.elapsed().as_secs_f64();
    let stdout = std::fs::read_to_string(&out_path).unwrap();
    let stderr = String::from_utf8_lossy(&std::fs::read(&err_path).unwrap()).into_owned();
    // Exit 0 or 1: not a panic (101), an abort on an allocation or a stack overflow (a signal).
    // (A render process's death is quoted in messages; strata itself must not die so.)
    assert!(matches!(status.code(), Some(0 | 1)), "strata died ({status}):\n{stderr}");
    Run { code: status.code(), stdout, stderr, secs }
}

const LAUNCHER_VARS: [&str; 12] = [
    "SLURM_ARRAY_TASK_ID",
    "SLURM_ARRAY_TASK_COUNT",
    "SLURM_ARRAY_TASK_MIN",
    "SLURM_ARRAY_TASK_STEP",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "JOB_COMPLETION_INDEX",
    "STRATA_NUM_PARTS",
];

fn strata(args: &[&str]) -> Run {
    strata_in(args, None, 120, &[], None)
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Writes JSON Lines.
fn write_jsonl(path: &Path, lines: impl IntoIterator<Item = Value>) {
    let mut text = String::new();
    for l in lines {
        text.push_str(&l.to_string());
        text.push('\n');
    }
    std::fs::write(path, text).unwrap();
}

/// A short conversation that renders on every fixture template.
fn hello(id: &str) -> Value {
    json!({"id": id, "messages": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]})
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat")
}

/// `strata extract` of `data` on `model` into `out` (`--chat-date` fixed), `extra` appended.
fn extract_args<'a>(model: &'a Path, data: &'a Path, out: &'a Path, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec!["extract", "--capture", "final", "--chat-date", "2026-01-15", "--model", s(model)];
    a.extend(["--data", s(data), "--out", s(out)]);
    a.extend_from_slice(extra);
    a
}

// ---- 9. Empty special tokens ----------------------------------------------------------------

#[test]
fn class9_an_empty_special_token_is_refused_in_tiktoken_and_tokenizer_json() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("text.jsonl");
    write_jsonl(&data, [json!({"text": "Hello, world"})]);

    // tiktoken: an added_tokens_decoder entry with empty content.
    let kimi = tmp.path().join("kimi");
    common::tiny_llama(&kimi, 700);
    std::fs::copy(fixtures().join("tiktoken/tiktoken.model"), kimi.join("tiktoken.model")).unwrap();
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("tiktoken/tokenizer_config.json")).unwrap())
            .unwrap();
    config["added_tokens_decoder"]["410"] = json!({"content": "", "special": true});
    std::fs::write(kimi.join("tokenizer_config.json"), config.to_string()).unwrap();
    let r = strata(&extract_args(&kimi, &data, &tmp.path().join("o1"), &[]));
    r.assert_fails(&["added_tokens_decoder[410]", "empty `content`"]);
    assert!(!tmp.path().join("o1/manifest.json").exists());

    // tokenizer.json: an added token with empty content.
    let model = chat_model(tmp.path(), "chatml");
    let path = model.join("tokenizer.json");
    let mut tok: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    tok["added_tokens"].as_array_mut().unwrap().push(json!({"id": 450, "content": "", "single_word": false,
        "lstrip": false, "rstrip": false, "normalized": false, "special": true}));
    std::fs::write(&path, tok.to_string()).unwrap();
    let r = strata(&extract_args(&model, &data, &tmp.path().join("o2"), &[]));
    r.assert_fails(&["tokenizer.json: added_tokens[", "(id 450)", "empty `content`"]);
}

// ---- 4. Unknown roles ----------------------------------------------------------------------

/// `n` conversations, each with its own unknown role (and so no assistant
/// turn after a first message), after one that renders.
fn unknown_roles(path: &Path, n: usize) {
    let lines = std::iter::once(hello("ok"))
        .chain((0..n).map(|i| json!({"messages": [{"role": format!("model-{i}"), "content": "x"}]})));
    write_jsonl(path, lines);
}

#[test]
fn class4_unknown_roles_are_linear_and_warned_once_each_up_to_a_cap() {
    let tmp = tempfile::tempdir().unwrap();
    let model = chat_model(tmp.path(), "chatml");
    let (small, big) = (tmp.path().join("small.jsonl"), tmp.path().join("big.jsonl"));
    unknown_roles(&small, 75_000);
    unknown_roles(&big, 150_000);
    let a = strata(&extract_args(&model, &small, &tmp.path().join("a"), &[]));
    let b = strata(&extract_args(&model, &big, &tmp.path().join("b"), &[]));
    b.assert_ok().assert_says(&["wrote 1 samples", "150000 without an assistant turn", "and 149980 more"]);
    a.assert_ok();
    // 150k role names within 5 s (25 s with the margin), and twice the input at most 2.5x the time.
    assert!(b.secs < 25.0, "150k unknown roles took {:.1} s", b.secs);
    assert!(b.secs < 2.5 * a.secs.max(0.5), "75k took {:.2} s, 150k {:.2} s", a.secs, b.secs);
    // One warning per name up to the cap, then one line.
    let warnings = b.stderr.lines().filter(|l| l.contains("unknown role")).count();
    assert!(warnings <= 21, "{warnings} warning lines:\n{}", &b.stderr[..b.stderr.len().min(4000)]);
}

// ---- 8. Planted directory links under --out ------------------------------------------------

/// Token rows for the embedded model.
fn tokens(path: &Path, n: usize) {
    common::write_data(path, n, 3..20, 5);
}

/// `strata extract` of token rows on the embedded model.
fn extract_tokens<'a>(data: &'a Path, out: &'a Path, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec!["extract", "--capture", "input:1,final", "--data", s(data), "--out", s(out)];
    a.extend_from_slice(extra);
    a
}

/// Every file under `dir` (links not followed), as relative names.
fn names_under(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> =
        walk(dir).into_iter().map(|p| p.strip_prefix(dir).unwrap().display().to_string()).collect();
    v.sort();
    v
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = vec![];
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let t = e.file_type().unwrap();
        if t.is_dir() {
            out.extend(walk(&e.path()));
        } else {
            out.push(e.path());
        }
    }
    out
}

#[test]
fn class8_links_planted_at_directories_under_out_are_refused_and_nothing_lands_outside() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("in.jsonl");
    tokens(&data, 6);
    let elsewhere = tmp.path().join("elsewhere");
    std::fs::create_dir_all(&elsewhere).unwrap();

    // OUT/hidden_states as a link: the speculators writer refuses to enter it.
    let out = tmp.path().join("spec");
    std::fs::create_dir_all(&out).unwrap();
    std::os::unix::fs::symlink(&elsewhere, out.join("hidden_states")).unwrap();
    let r = strata(&extract_tokens(&data, &out, &["--format", "speculators", "--overwrite"]));
    r.assert_fails(&["hidden_states", "symbolic link"]);
    assert!(names_under(&elsewhere).is_empty(), "{:?}", names_under(&elsewhere));
    assert!(!out.join("manifest.json").exists() || !strata::dataset::manifest::Manifest::read(&out).unwrap().complete);

    // OUT/part-0000-of-0002 as a link: refused before any work, nothing written there.
    let out = tmp.path().join("parts");
    std::fs::create_dir_all(&out).unwrap();
    std::os::unix::fs::symlink(&elsewhere, out.join("part-0000-of-0002")).unwrap();
    for mode in [&[][..], &["--resume"], &["--overwrite"]] {
        let r = strata(&extract_tokens(&data, &out, &[&["--part-index", "0", "--num-parts", "2"][..], mode].concat()));
        r.assert_fails(&["part-0000-of-0002", "symbolic link"]);
        assert!(names_under(&elsewhere).is_empty(), "{mode:?}: {:?}", names_under(&elsewhere));
    }
    // A link inside a part, at hidden_states.
    let out = tmp.path().join("parts2");
    std::fs::create_dir_all(out.join("part-0001-of-0002")).unwrap();
    std::os::unix::fs::symlink(&elsewhere, out.join("part-0001-of-0002/hidden_states")).unwrap();
    let args = ["--part-index", "1", "--num-parts", "2", "--format", "speculators", "--overwrite"];
    let r = strata(&extract_tokens(&data, &out, &args));
    r.assert_fails(&["hidden_states", "symbolic link"]);
    assert!(names_under(&elsewhere).is_empty(), "{:?}", names_under(&elsewhere));

    // OUT itself may be a link: the run writes into its target.
    let real = tmp.path().join("real");
    std::fs::create_dir_all(&real).unwrap();
    let link = tmp.path().join("link");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    strata(&extract_tokens(&data, &link, &["--format", "speculators"])).assert_ok();
    assert!(real.join("hidden_states/hs_5.safetensors").is_file());
}

// ---- 6 and 7. Merge takes only each part's own files, as listed -----------------------------

/// Runs both parts of a 2-part split of `data` into `out` (`extra` flags), then returns nothing; panics on failure.
fn two_parts(data: &Path, out: &Path, extra: &[&str]) {
    for i in ["0", "1"] {
        let a = extract_tokens(data, out, &[&["--part-index", i, "--num-parts", "2"][..], extra].concat());
        strata(&a).assert_ok();
    }
}

fn merge_run(out: &Path, extra: &[&str]) -> Run {
    strata(&[&["merge", s(out)][..], extra].concat())
}

/// Edits a part's manifest.
fn edit_manifest(dir: &Path, f: impl FnOnce(&mut Value)) {
    let p = dir.join("manifest.json");
    let mut m: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut m);
    std::fs::write(&p, serde_json::to_string_pretty(&m).unwrap()).unwrap();
}

/// No file under `dir` is a hard link to `secret` (the same inode), and no name there holds its bytes.
fn no_trace_of(dir: &Path, secret: &Path) {
    use std::os::unix::fs::MetadataExt;
    let ino = std::fs::metadata(secret).unwrap().ino();
    let bytes = std::fs::read(secret).unwrap();
    for p in walk(dir) {
        let m = std::fs::symlink_metadata(&p).unwrap();
        assert!(m.ino() != ino, "{} is a link to the secret", p.display());
        if m.is_file() && !p.starts_with(dir.join("part-0000-of-0002")) && !p.starts_with(dir.join("part-0001-of-0002"))
        {
            assert!(std::fs::read(&p).unwrap() != bytes, "{} holds the secret", p.display());
        }
    }
}

#[test]
fn class6_merge_follows_no_path_out_of_a_part() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("in.jsonl");
    tokens(&data, 8);
    let secret = tmp.path().join("secret.txt");
    std::fs::write(&secret, "top secret").unwrap();

    for format in ["strata", "speculators"] {
        let out = tmp.path().join(format!("out-{format}"));
        two_parts(&data, &out, &["--format", format]);
        let part = out.join("part-0001-of-0002");
        let file0 = |m: &Value| m["shards"][0]["file"].as_str().unwrap().to_string();
        let m: Value = serde_json::from_str(&std::fs::read_to_string(part.join("manifest.json")).unwrap()).unwrap();
        let listed = file0(&m);
        let good = m.clone();
        // A `..` path, and an absolute one, in a part's manifest.
        for bad in ["../../../secret.txt", "../../secret.txt", secret.to_str().unwrap()] {
            edit_manifest(&part, |m| {
                m["shards"][0]["file"] = json!(bad);
                m["shards"][0]["bytes"] = json!(10);
            });
            let r = merge_run(&out, &[]);
            r.assert_fails(&["part-0001-of-0002/", "cannot merge"]);
            assert!(!out.join("manifest.json").exists(), "{format} {bad}: a merged manifest was written");
            no_trace_of(&out, &secret);
        }
        // A part's range of the input that is not one (start past end): refused, not a wrapped subtraction.
        edit_manifest(&part, |m| {
            let end = m["part"]["end"].as_u64().unwrap();
            m["part"]["start"] = json!(end + 5);
        });
        merge_run(&out, &[]).assert_fails(&["part-0001-of-0002", "does not fit the split"]);
        std::fs::write(part.join("manifest.json"), serde_json::to_string_pretty(&good).unwrap()).unwrap();
        // A listed file replaced by a link to an outside file of the same size.
        let real = part.join(&listed);
        let size = std::fs::metadata(&real).unwrap().len() as usize;
        let big_secret = tmp.path().join(format!("secret-{format}.bin"));
        std::fs::write(&big_secret, vec![b's'; size]).unwrap();
        std::fs::rename(&real, tmp.path().join("moved")).unwrap();
        std::os::unix::fs::symlink(&big_secret, &real).unwrap();
        let r = merge_run(&out, &[]);
        r.assert_fails(&["symbolic link", &listed]);
        assert!(!out.join("manifest.json").exists());
        no_trace_of(&out, &big_secret);
        // A link at a directory on the way (speculators: hidden_states/ of the part).
        std::fs::remove_file(&real).unwrap();
        std::fs::rename(tmp.path().join("moved"), &real).unwrap();
        if format == "speculators" {
            let hs = part.join("hidden_states");
            std::fs::rename(&hs, tmp.path().join("hs-moved")).unwrap();
            std::os::unix::fs::symlink(tmp.path().join("hs-moved"), &hs).unwrap();
            merge_run(&out, &[]).assert_fails(&["hidden_states", "symbolic link"]);
            assert!(!out.join("manifest.json").exists());
            std::fs::remove_file(&hs).unwrap();
            std::fs::rename(tmp.path().join("hs-moved"), &hs).unwrap();
        }
        // Put right, it merges, and verify agrees.
        merge_run(&out, &[]).assert_ok().assert_says(&["checked", "strata verify"]);
        assert!(common::verify(&out, &[]).0);
    }
}

#[test]
fn class7_merge_checks_each_listed_files_presence_and_size() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("in.jsonl");
    tokens(&data, 8);
    for format in ["strata", "speculators"] {
        let out = tmp.path().join(format!("out-{format}"));
        two_parts(&data, &out, &["--format", format, "--shard-size", "2KiB"]);
        let part = out.join("part-0000-of-0002");
        let m: Value = serde_json::from_str(&std::fs::read_to_string(part.join("manifest.json")).unwrap()).unwrap();
        let listed = m["shards"][0]["file"].as_str().unwrap().to_string();
        let path = part.join(&listed);
        let bytes = std::fs::read(&path).unwrap();
        // Deleted.
        std::fs::remove_file(&path).unwrap();
        merge_run(&out, &[]).assert_fails(&[&format!("{listed} is missing"), "--resume"]);
        assert!(!out.join("manifest.json").exists());
        // Truncated.
        std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
        merge_run(&out, &[]).assert_fails(&[&listed, &format!("has {} bytes", bytes.len() / 2)]);
        assert!(!out.join("manifest.json").exists());
        // Symlinked out (to a copy of the very bytes).
        let copy = tmp.path().join(format!("copy-{format}"));
        std::fs::write(&copy, &bytes).unwrap();
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink(&copy, &path).unwrap();
        merge_run(&out, &[]).assert_fails(&[&listed, "symbolic link"]);
        assert!(!out.join("manifest.json").exists());
        // Whole again: merged, and a resume of the part redoes a missing file.
        std::fs::remove_file(&path).unwrap();
        let r = strata(&extract_tokens(
            &data,
            &out,
            &["--part-index", "0", "--num-parts", "2", "--format", format, "--shard-size", "2KiB", "--resume"],
        ));
        r.assert_ok();
        assert_eq!(std::fs::read(&path).unwrap(), bytes);
        merge_run(&out, &[]).assert_ok();
        assert!(common::verify(&out, &[]).0);
    }
}

#[test]
fn merge_names_a_linked_part_leaves_no_temporary_links_and_checks_the_input_ranges() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("in.jsonl");
    tokens(&data, 10);
    let out = tmp.path().join("out");
    two_parts(&data, &out, &["--format", "speculators"]);
    // Merged twice: no hidden temporary link is left.
    merge_run(&out, &[]).assert_ok().assert_says(&["has the digest the part recorded"]);
    merge_run(&out, &[]).assert_ok();
    let temps: Vec<String> = names_under(&out).into_iter().filter(|n| n.contains(".merge-")).collect();
    assert!(temps.is_empty(), "{temps:?}");
    assert!(common::verify(&out, &[]).0);

    // The input edited after the parts ran (same length): the part whose bytes changed is named.
    let text = std::fs::read_to_string(&data).unwrap();
    let edited = text.replacen("\"s00001\"", "\"s0000X\"", 1);
    assert_eq!(edited.len(), text.len());
    std::fs::write(&data, &edited).unwrap();
    merge_run(&out, &[]).assert_fails(&["part-0000-of-0002", "other bytes than the input holds now"]);
    // The original given with --data: checked against it.
    let orig = tmp.path().join("orig.jsonl");
    std::fs::write(&orig, &text).unwrap();
    merge_run(&out, &["--data", s(&orig)]).assert_ok();
    // The input gone: merged, saying it could not be checked.
    std::fs::remove_file(&data).unwrap();
    merge_run(&out, &[]).assert_ok().assert_says(&["NOT CHECKED", "--data"]);

    // A part directory that is a link: named as a link, not as missing.
    let moved = tmp.path().join("p1");
    std::fs::rename(out.join("part-0001-of-0002"), &moved).unwrap();
    std::os::unix::fs::symlink(&moved, out.join("part-0001-of-0002")).unwrap();
    let r = merge_run(&out, &[]);
    r.assert_fails(&["part-0001-of-0002 is a symbolic link"]);
    assert!(!r.stderr.contains("is missing"), "{}", r.stderr);
}

// ---- Launchers: torchrun's variables describe the process ----------------------------------

#[test]
fn torchrun_inside_a_one_task_sbatch_splits_by_rank_and_inconsistent_launches_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("in.jsonl");
    tokens(&data, 12);
    let out = tmp.path().join("out");
    for rank in ["0", "1", "2", "3"] {
        let env = [
            ("SLURM_NTASKS", "1"),
            ("SLURM_PROCID", "0"),
            ("RANK", rank),
            ("WORLD_SIZE", "4"),
            ("LOCAL_WORLD_SIZE", "4"),
        ];
        let r = strata_in(&extract_tokens(&data, &out, &[]), None, 120, &env, None);
        r.assert_ok().assert_says(&[&format!("part        {rank} of 4 (from RANK/WORLD_SIZE)")]);
    }
    merge_run(&out, &[]).assert_ok().assert_says(&["merged 4 parts", "12 samples"]);
    // Inconsistent or half-set: refused before anything is written, naming the variables.
    type Env<'a> = &'a [(&'a str, &'a str)];
    let cases: [(Env, &[&str]); 4] = [
        (&[("RANK", "1")], &["RANK=1 is set without WORLD_SIZE"]),
        (&[("RANK", ""), ("WORLD_SIZE", "4")], &["RANK is set but empty"]),
        (
            &[("SLURM_ARRAY_TASK_ID", "2"), ("SLURM_ARRAY_TASK_COUNT", "4"), ("RANK", "1"), ("WORLD_SIZE", "4")],
            &["SLURM_ARRAY_TASK_ID=2", "RANK=1/WORLD_SIZE=4"],
        ),
        (&[("JOB_COMPLETION_INDEX", "1"), ("STRATA_NUM_PARTS", "4")], &["--num-parts 3", "STRATA_NUM_PARTS=4"]),
    ];
    for (i, (env, needles)) in cases.iter().enumerate() {
        let o = tmp.path().join(format!("bad{i}"));
        let extra: &[&str] = if i == 3 { &["--num-parts", "3"] } else { &[] };
        strata_in(&extract_tokens(&data, &o, extra), None, 120, env, None).assert_fails(needles);
        assert!(!o.exists(), "case {i} wrote {}", o.display());
    }
}

// ---- The weak cases ------------------------------------------------------------------------

/// A template that refuses every conversation.
const REFUSING: &str = "{{ raise_exception('no: ' ~ messages[0].content) }}";

#[test]
fn a_run_whose_every_record_is_refused_fails_but_an_empty_part_or_a_finished_resume_does_not() {
    let tmp = tempfile::tempdir().unwrap();
    let model = chat_model(tmp.path(), "chatml");
    let refusing = tmp.path().join("refusing.jinja");
    std::fs::write(&refusing, REFUSING).unwrap();
    let data = tmp.path().join("c.jsonl");
    write_jsonl(&data, (0..3).map(|i| hello(&format!("c{i}"))));
    let out = tmp.path().join("o");
    let r = strata(&extract_args(&model, &data, &out, &["--chat-template", s(&refusing)]));
    r.assert_fails(&["none of the 3 input records gave a sample", "3 could not be rendered or tokenized"]);
    // Every conversation without an assistant turn: the same.
    write_jsonl(&data, (0..2).map(|i| json!({"id": i.to_string(), "messages": [{"role": "user", "content": "x"}]})));
    let r = strata(&extract_args(&model, &data, &tmp.path().join("o2"), &[]));
    r.assert_fails(&["none of the 2 input records", "2 had no assistant turn"]);
    // A part with no records, and a resume that finds the work done: exit 0.
    write_jsonl(&data, [hello("only")]);
    let out = tmp.path().join("parts");
    for i in ["0", "1"] {
        let r = strata(&extract_args(&model, &data, &out, &["--part-index", i, "--num-parts", "2"]));
        r.assert_ok();
    }
    let out = tmp.path().join("done");
    strata(&extract_args(&model, &data, &out, &[])).assert_ok();
    strata(&extract_args(&model, &data, &out, &["--resume"])).assert_ok();
}

#[test]
fn tiktoken_text_the_pattern_does_not_cover_or_cannot_match_fails_that_record_only() {
    let tmp = tempfile::tempdir().unwrap();
    let kimi = tmp.path().join("kimi");
    common::tiny_llama(&kimi, 700);
    std::fs::copy(fixtures().join("tiktoken/tiktoken.model"), kimi.join("tiktoken.model")).unwrap();
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("tiktoken/tokenizer_config.json")).unwrap())
            .unwrap();
    // A pattern of letters only: spaces and punctuation are not covered.
    config["pat_str"] = json!("[a-zA-Z]+");
    std::fs::write(kimi.join("tokenizer_config.json"), config.to_string()).unwrap();
    let data = tmp.path().join("t.jsonl");
    write_jsonl(&data, [json!({"id": "a", "text": "hello"}), json!({"id": "b", "text": "hello world"})]);
    let r = strata(&extract_args(&kimi, &data, &tmp.path().join("o"), &[]));
    r.assert_ok().assert_says(&["wrote 1 samples", "(id \"b\")", "does not match byte 5 of the text"]);
    // Kimi's own pattern on a megabyte of spaces fails (tiktoken's regex gives up on it, as tiktoken
    // itself does): that record, not the run. A megabyte of Han characters is one piece, tokenized whole.
    config["pat_str"] = json!(strata::chat::tiktoken::KIMI_PATTERN);
    std::fs::write(kimi.join("tokenizer_config.json"), config.to_string()).unwrap();
    let spaces = format!("x{}y", " ".repeat(1 << 20));
    let han = "漢字".repeat(1 << 18);
    write_jsonl(
        &data,
        [json!({"id": "a", "text": "hello"}), json!({"id": "s", "text": spaces}), json!({"id": "h", "text": han})],
    );
    let r = strata(&extract_args(&kimi, &data, &tmp.path().join("o2"), &["--max-seq-len", "600"]));
    r.assert_ok().assert_says(&["wrote 2 samples", "1 records could not be rendered", "(id \"s\")", "pattern fails"]);
}

#[test]
fn verify_recompute_with_other_weights_says_the_digest_differs() {
    let tmp = tempfile::tempdir().unwrap();
    let model = chat_model(tmp.path(), "chatml");
    let data = tmp.path().join("t.jsonl");
    write_jsonl(&data, [json!({"input_ids": [1, 2, 3, 4, 5]}), json!({"input_ids": [7, 8, 9]})]);
    let out = tmp.path().join("o");
    strata(&extract_args(&model, &data, &out, &[])).assert_ok();
    let other = tmp.path().join("other");
    common::tiny_llama_seeded(&other, 512, 99);
    let r = strata(&["verify", s(&out), "--recompute", "2", "--model", s(&other)]);
    r.assert_fails(&["(digest xxh3:", "are not the ones the dataset was written with", "differ from a fresh forward"]);
    strata(&["verify", s(&out), "--recompute", "2", "--model", s(&model)]).assert_ok();
}

#[test]
fn template_messages_say_what_is_wrong_and_noncharacters_are_text() {
    let tmp = tempfile::tempdir().unwrap();
    let model = chat_model(tmp.path(), "chatml");
    std::fs::remove_file(model.join("chat_template.jinja")).unwrap();
    let data = tmp.path().join("c.jsonl");
    write_jsonl(&data, [hello("a")]);
    let cfg_path = model.join("tokenizer_config.json");
    let cfg: Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    let with = |t: Value| {
        let mut c = cfg.clone();
        c["chat_template"] = t;
        std::fs::write(&cfg_path, c.to_string()).unwrap();
    };
    with(json!([{"name": "tool_use", "template": "x"}, {"name": "rag", "template": "y"}]));
    let r = strata(&extract_args(&model, &data, &tmp.path().join("o1"), &[]));
    r.assert_fails(&["without \"default\"", "\"tool_use\", \"rag\"", "--chat-template"]);
    assert!(!r.stderr.contains("no chat template"), "{}", r.stderr);
    with(json!(42));
    let r = strata(&extract_args(&model, &data, &tmp.path().join("o2"), &[]));
    r.assert_fails(&["must be a string or a list", "not a number"]);
    // U+FDD0 in a conversation is text, also under a template with generation blocks.
    let gen = fixtures().join("templates/generation.jinja");
    write_jsonl(
        &data,
        [
            json!({"messages": [{"role": "user", "content": "a\u{FDD0}b"}, {"role": "assistant", "content": "c\u{FDD1}d\u{FDD0}"}]}),
        ],
    );
    for mask in ["boundary", "generation"] {
        let out = tmp.path().join(format!("nc-{mask}"));
        let r = strata(&extract_args(&model, &data, &out, &["--chat-template", s(&gen), "--loss-mask", mask]));
        r.assert_ok().assert_says(&["wrote 1 samples"]);
    }
    // A 1 MB raise_exception message is clipped, in the log and the summary.
    let big = tmp.path().join("big.jinja");
    std::fs::write(&big, "{{ raise_exception('x' * 1000000) }}").unwrap();
    write_jsonl(&data, [hello("a"), hello("b"), hello("c")]);
    let r = strata(&extract_args(&model, &data, &tmp.path().join("o3"), &["--chat-template", s(&big)]));
    r.assert_fails(&["refused the conversation"]);
    assert!(r.stderr.len() + r.stdout.len() < 20_000, "{} bytes of output", r.stderr.len() + r.stdout.len());
}

#[test]
fn duplicate_ids_are_refused_in_every_row_mode() {
    let tmp = tempfile::tempdir().unwrap();
    let model = chat_model(tmp.path(), "chatml");
    let data = tmp.path().join("c.jsonl");
    let two_turns = |id: &str| {
        json!({"id": id, "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                      {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]})
    };
    write_jsonl(&data, [two_turns("x"), hello("x")]);
    for rows in ["auto", "per-turn", "per-conversation"] {
        let out = tmp.path().join(rows);
        strata(&extract_args(&model, &data, &out, &["--rows", rows])).assert_fails(&["duplicate id \"x\""]);
    }
    // A record named like another's per-turn row (the prepare step checks every row's id).
    write_jsonl(&data, [hello("x#1"), two_turns("x")]);
    let out = tmp.path().join("named-like-a-turn");
    strata(&extract_args(&model, &data, &out, &["--rows", "per-turn"])).assert_fails(&["duplicate id \"x#1\""]);
}

#[test]
fn a_refused_resume_names_the_field_both_values_and_the_remedy() {
    let tmp = tempfile::tempdir().unwrap();
    let model = chat_model(tmp.path(), "chatml");
    let data = tmp.path().join("c.jsonl");
    write_jsonl(&data, [hello("a"), hello("b")]);
    let out = tmp.path().join("o");
    strata(&extract_args(&model, &data, &out, &["--max-seq-len", "100", "--rows", "per-turn"])).assert_ok();
    let r = strata(&extract_args(&model, &data, &out, &["--max-seq-len", "200", "--rows", "per-turn", "--resume"]));
    r.assert_fails(&[
        "prepare.max_seq_len differs",
        "has 100, this run has 200",
        "run with --max-seq-len 100",
        "--overwrite",
    ]);
    let r = strata(&extract_args(&model, &data, &out, &["--max-seq-len", "100", "--resume"]));
    r.assert_fails(&["prepare.rows differs", "has per-turn, this run has auto", "--rows per-turn"]);
    // Two parts made with other options: merge names the field, both parts' values and the remedy.
    let out = tmp.path().join("parts");
    for (i, n) in [("0", "100"), ("1", "200")] {
        strata(&extract_args(&model, &data, &out, &["--part-index", i, "--num-parts", "2", "--max-seq-len", n]))
            .assert_ok();
    }
    merge_run(&out, &[]).assert_fails(&[
        "prepare.max_seq_len differs: part-0000-of-0002 has 100, part-0001-of-0002 has 200",
        "Rerun part-0001-of-0002 with --max-seq-len 100",
    ]);
}

#[test]
fn datasets_directories_take_no_other_input_format_and_a_dataset_dict_names_its_splits() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("in.jsonl");
    tokens(&data, 4);
    let ds = tmp.path().join("ds");
    strata(&extract_tokens(&data, &ds, &["--format", "speculators"])).assert_ok();
    strata(&extract_tokens(&ds, &tmp.path().join("o1"), &[])).assert_ok().assert_says(&["wrote 4 samples"]);
    let r = strata(&extract_tokens(&ds, &tmp.path().join("o2"), &["--input-format", "text"]));
    r.assert_fails(&["--input-format text does not apply", "datasets directory"]);
    // A DatasetDict: its splits are named.
    let dict = tmp.path().join("dict");
    std::fs::create_dir_all(&dict).unwrap();
    std::fs::write(dict.join("dataset_dict.json"), "{\"splits\": [\"train\"]}").unwrap();
    std::fs::rename(&ds, dict.join("train")).unwrap();
    let r = strata(&extract_tokens(&dict, &tmp.path().join("o3"), &[]));
    r.assert_fails(&["is a DatasetDict", "train", "dict/train"]);
    assert!(!r.stderr.contains("Is a directory"), "{}", r.stderr);
}

#[test]
fn bpe_dropout_is_ignored_with_one_warning_so_runs_are_reproducible() {
    let tmp = tempfile::tempdir().unwrap();
    let model = chat_model(tmp.path(), "chatml");
    let path = model.join("tokenizer.json");
    let mut tok: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    tok["model"]["dropout"] = json!(0.5);
    std::fs::write(&path, tok.to_string()).unwrap();
    let data = tmp.path().join("t.jsonl");
    write_jsonl(&data, (0..4).map(|i| json!({"text": format!("the quick brown fox jumps over the lazy dog {i}")})));
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    let r = strata(&extract_args(&model, &data, &a, &[]));
    r.assert_ok();
    assert_eq!(r.stderr.matches("dropout 0.5").count(), 1, "{}", r.stderr);
    strata(&extract_args(&model, &data, &b, &[])).assert_ok();
    let files =
        |d: &Path| common::dir_contents(d).into_iter().filter(|(n, _)| n.ends_with(".safetensors")).collect::<Vec<_>>();
    assert_eq!(files(&a), files(&b));
}

// ---- 3. Long conversations ------------------------------------------------------------------

/// One conversation of `turns` messages of about 650 bytes (1500 turns: about 1 MB).
fn long_conversation(path: &Path, turns: usize) {
    let msgs: Vec<Value> = (0..turns)
        .map(|i| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            json!({"role": role, "content": format!("turn {i} {}", "lorem ipsum dolor sit amet, ".repeat(22))})
        })
        .collect();
    write_jsonl(path, [json!({"id": "long", "messages": msgs})]);
}

#[test]
fn class3_a_long_conversation_is_rendered_once_and_scales_linearly() {
    let tmp = tempfile::tempdir().unwrap();
    let model = chat_model(tmp.path(), "chatml");
    let (a, b) = (tmp.path().join("a.jsonl"), tmp.path().join("b.jsonl"));
    long_conversation(&a, 1500);
    long_conversation(&b, 3000);
    assert!(std::fs::metadata(&a).unwrap().len() > 900_000);
    let ra = strata(&extract_args(&model, &a, &tmp.path().join("oa"), &[]));
    ra.assert_ok().assert_says(&["wrote 1 samples (4096 tokens)", "turns left out"]);
    let rb = strata(&extract_args(&model, &b, &tmp.path().join("ob"), &[]));
    rb.assert_ok().assert_says(&["wrote 1 samples (4096 tokens)"]);
    // 1500 turns within 10 s (50 s with the margin); twice the turns at most 2.5x the time.
    assert!(ra.secs < 50.0, "1500 turns took {:.1} s", ra.secs);
    assert!(rb.secs < 2.5 * ra.secs.max(1.0), "1500 turns took {:.2} s, 3000 {:.2} s", ra.secs, rb.secs);
    // The same rows as the conversation cut to its first turns, which every render path gives alike.
    let short = tmp.path().join("s.jsonl");
    let text = std::fs::read_to_string(&a).unwrap();
    let mut v: Value = serde_json::from_str(&text).unwrap();
    v["messages"].as_array_mut().unwrap().truncate(20);
    write_jsonl(&short, [v]);
    strata(&extract_args(&model, &short, &tmp.path().join("os"), &["--max-seq-len", "4096"])).assert_ok();
    let rows = |d: &Path| {
        let ds = strata::dataset::Dataset::open(d).unwrap();
        let s = &ds.manifest.samples[0];
        let shard = ds.shard(s.shard).unwrap();
        let r = ds.sample(&shard, &s.id, s.tokens).unwrap();
        (r.input_ids.clone(), r.loss_mask.to_vec())
    };
    let (long_ids, long_mask) = rows(&tmp.path().join("oa"));
    let (short_ids, short_mask) = rows(&tmp.path().join("os"));
    assert_eq!(long_ids[..short_ids.len()], short_ids[..]);
    assert_eq!(long_mask[..short_mask.len()], short_mask[..]);
}

#[test]
fn class3_a_line_of_many_tiny_turns_is_bounded_too() {
    // Each turn's render is given every message before it: a render budget charged per
    // message bounds turns times messages, so the conversation is refused in bounded time.
    let tmp = tempfile::tempdir().unwrap();
    let model = chat_model(tmp.path(), "chatml");
    let data = tmp.path().join("tiny.jsonl");
    // 50k messages: the whole conversation renders, its turns then pass the budget; 500k: the
    // whole conversation's one render runs out of its own.
    for (n, says) in [(50_000, "too many turns to render one by one"), (500_000, "ran out of its budget")] {
        let msgs: Vec<Value> =
            (0..n).map(|i| json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": "x"})).collect();
        write_jsonl(&data, [json!({"id": "tiny", "messages": msgs}), hello("fine")]);
        let out = tmp.path().join(format!("o{n}"));
        let r = strata_in(&extract_args(&model, &data, &out, &["--max-seq-len", "512"]), None, 120, &[], None);
        r.assert_ok().assert_says(&["wrote 1 samples", "(id \"tiny\")", says]);
        assert!(r.secs < 60.0, "{n} tiny turns: {:.1} s", r.secs);
    }
}

#[test]
fn class3_every_turn_fitting_tokenizes_each_render_once_only_past_the_shared_start() {
    // No limit: every turn is kept, every prompt and row rendered; the
    // tokenization reuses the whole conversation's tokens up to where a render parts from it.
    let tmp = tempfile::tempdir().unwrap();
    let model = chat_model(tmp.path(), "chatml");
    let chat = strata::chat::Chat::load(&model, &strata::chat::ChatOptions::default()).unwrap();
    let conv = |turns: usize| {
        let msgs: Vec<Value> = (0..turns)
            .map(|i| {
                let role = if i % 2 == 0 { "user" } else { "assistant" };
                json!({"role": role, "content": format!("turn {i} {}", "lorem ipsum dolor sit amet, ".repeat(22))})
            })
            .collect();
        strata::chat::Conversation::parse(strata::chat::Style::OpenAi, &Value::Array(msgs), None).unwrap()
    };
    let opts = strata::chat::RowOptions {
        mask: strata::chat::MaskSource::Boundary,
        rows: strata::chat::RowMode::Auto,
        max_len: usize::MAX,
        long: strata::chat::LongRows::Truncate,
    };
    let mut r = chat.renderer().unwrap();
    let t = Instant::now();
    let rows = r.rows(&conv(1500), &opts).unwrap();
    let secs = t.elapsed().as_secs_f64();
    assert_eq!(rows.rows.len(), 1);
    assert!(rows.rows[0].loss_mask.iter().filter(|&&m| m == 1).count() > 100_000);
    assert!(secs < 50.0, "1500 turns, every one kept, took {secs:.1} s");
}

// ---- 5. Tokenizing whole texts ---------------------------------------------------------------

/// The lowest of a few address-space limits (KiB) under which `args` succeeds: what an ordinary run needs.
fn ordinary_limit(args: &[&str]) -> u64 {
    for mb in [600u64, 800, 1000, 1250, 1500, 2000, 2500, 3000, 4000] {
        if strata_in(args, Some(mb * 1024), 120, &[], None).ok() {
            return mb * 1024;
        }
    }
    panic!("an ordinary run fails even under a 4 GB address-space limit");
}

/// A `{"text": ...}` line of about `mb` MiB of words.
fn huge_text_line(path: &Path, mb: usize) {
    let words = "lorem ipsum dolor sit amet, consectetur adipiscing elit; ";
    let text = words.repeat((mb << 20) / words.len());
    std::fs::write(path, format!("{{\"id\": \"huge\", \"text\": \"{text}\"}}\n")).unwrap();
}

#[test]
fn class5_a_line_near_64_mib_is_tokenized_in_pieces_within_bounds() {
    let tmp = tempfile::tempdir().unwrap();
    let model = chat_model(tmp.path(), "chatml");
    let small = tmp.path().join("small.jsonl");
    write_jsonl(&small, [json!({"id": "s", "text": "lorem ipsum dolor sit amet"})]);
    let ordinary = ordinary_limit(&extract_args(&model, &small, &tmp.path().join("o0"), &["--overwrite"]));
    let huge = tmp.path().join("huge.jsonl");
    huge_text_line(&huge, 60);
    // Cut to --max-seq-len, within 60 s and 1 GiB more address space than an ordinary run.
    let out = tmp.path().join("o1");
    let r = strata_in(
        &extract_args(&model, &huge, &out, &["--max-seq-len", "4096"]),
        Some(ordinary + (1 << 20)),
        60,
        &[],
        None,
    );
    r.assert_ok().assert_says(&["wrote 1 samples (4096 tokens)", "1 rows cut"]);
    // The tokens are the whole text's first 4096 (the text is many copies of one sentence,
    // whose tokens the tokenizer gives for a few of them at once).
    let chat = strata::chat::Chat::load(&model, &strata::chat::ChatOptions::default()).unwrap();
    let line: Value = serde_json::from_str(&std::fs::read_to_string(&huge).unwrap()[..]).unwrap();
    let head = &line["text"].as_str().unwrap()[..64 << 10];
    let mut want = strata::chat::Encoded::default();
    chat.tokenizer.encode(head, true, &mut want).unwrap();
    let ds = strata::dataset::Dataset::open(&out).unwrap();
    let s = &ds.manifest.samples[0];
    let shard = ds.shard(s.shard).unwrap();
    let got = ds.sample(&shard, &s.id, s.tokens).unwrap().input_ids.clone();
    assert_eq!(got, want.ids[..4096].iter().map(|&t| t as i64).collect::<Vec<_>>());
    // Without --max-seq-len a text must fit the model: a clear error, as fast.
    let r =
        strata_in(&extract_args(&model, &huge, &tmp.path().join("o2"), &[]), Some(ordinary + (1 << 20)), 60, &[], None);
    r.assert_fails(&["the text gives more than 4096 tokens", "max_position_embeddings 4096"]);
}

#[test]
fn class5_a_hostile_normalizer_or_a_template_printing_50_mb_stays_within_bounds() {
    let tmp = tempfile::tempdir().unwrap();
    let model = chat_model(tmp.path(), "chatml");
    let small = tmp.path().join("small.jsonl");
    write_jsonl(&small, [hello("s")]);
    let ordinary = ordinary_limit(&extract_args(&model, &small, &tmp.path().join("o0"), &["--overwrite"]));
    // A normalizer that deletes every letter: 20 MB of text give almost no token, so
    // no bytes-per-token bound holds; the text is still tokenized piece by piece.
    let deleting = tmp.path().join("deleting");
    std::fs::create_dir_all(&deleting).unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer_config.json", "chat_template.jinja"] {
        std::fs::copy(model.join(f), deleting.join(f)).unwrap();
    }
    let mut tok: Value = serde_json::from_str(&std::fs::read_to_string(model.join("tokenizer.json")).unwrap()).unwrap();
    tok["normalizer"] = json!({"type": "Replace", "pattern": {"Regex": "[a-z ,;]+"}, "content": ""});
    std::fs::write(deleting.join("tokenizer.json"), tok.to_string()).unwrap();
    let huge = tmp.path().join("huge.jsonl");
    // 20 MB of which the normalizer keeps one letter a megabyte: every piece must be read.
    let mb = "lorem ipsum dolor sit amet, consectetur adipiscing elit; ".repeat((1 << 20) / 58);
    let text: String = (0..20).map(|_| format!("{mb}Z")).collect();
    std::fs::write(&huge, format!("{{\"id\": \"huge\", \"text\": \"{text}\"}}\n")).unwrap();
    let r = strata_in(
        &extract_args(&deleting, &huge, &tmp.path().join("o1"), &["--max-seq-len", "4096"]),
        Some(ordinary + (1 << 20)),
        120,
        &[],
        None,
    );
    r.assert_ok().assert_says(&["wrote 1 samples (20 tokens)"]);
    // A template that prints 50 MB of words: cut to the limit. 50 MB of one letter are
    // one pre-tokenizer piece, which has no place to cut: that conversation is refused.
    for (what, ok) in [("'lorem ipsum ' * 4200000", true), ("'x' * 50000000", false)] {
        let loud = tmp.path().join("loud.jinja");
        std::fs::write(
            &loud,
            format!(
                "{{% for m in messages %}}<|im_start|>{{{{ m.role }}}}\n{{{{ m.content }}}}{{% if m.role == 'assistant' %}}{{{{ {what} }}}}\
                 {{% endif %}}<|im_end|>\n{{% endfor %}}{{% if add_generation_prompt %}}<|im_start|>assistant\n{{% endif %}}"
            ),
        )
        .unwrap();
        let out = tmp.path().join(format!("loud-{ok}"));
        let args = extract_args(&model, &small, &out, &["--chat-template", s(&loud)]);
        let r = strata_in(&args, Some(ordinary + (1 << 20)), 60, &[], None);
        if ok {
            r.assert_ok().assert_says(&["wrote 1 samples (4096 tokens)"]);
        } else {
            r.assert_fails(&["no place between bytes", "none of the 1 input records gave a sample"]);
        }
    }
}

// ---- 1 and 2. A template's memory and nesting, in a render process of its own ----------------

/// ChatML that first does `evil` when the first message says "boom".
fn evil_template(dir: &Path, name: &str, evil: &str) -> PathBuf {
    let p = dir.join(format!("{name}.jinja"));
    let chatml = std::fs::read_to_string(fixtures().join("templates/chatml.jinja")).unwrap();
    std::fs::write(&p, format!("{{% if messages[0].content == 'boom' %}}{evil}{{% endif %}}{chatml}")).unwrap();
    p
}

fn boom_and_fine(path: &Path) {
    let boom =
        json!({"id": "boom", "messages": [{"role": "user", "content": "boom"}, {"role": "assistant", "content": "x"}]});
    write_jsonl(path, [boom, hello("fine")]);
}

#[test]
fn class1_a_renders_memory_is_bounded_and_that_conversation_alone_fails() {
    let tmp = tempfile::tempdir().unwrap();
    let model = chat_model(tmp.path(), "chatml");
    let data = tmp.path().join("c.jsonl");
    boom_and_fine(&data);
    let ordinary = ordinary_limit(&extract_args(&model, &data, &tmp.path().join("o0"), &["--overwrite"]));
    let cases = [
        // A join of one 50 MB string repeated: about 100 GB asked at once.
        ("join", "{% set ns = namespace(s='x' * 50000000) %}{{ ([ns.s] * 2000) | join('') | length }}", "needed more memory"),
        // A string doubled in a loop.
        ("double", "{% set ns = namespace(s='xy') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}", "--template-memory 1024 MiB"),
        // A list of a long string repeated, printed: the 256 MiB output cap.
        ("print", "{{ ['x' * 10000000] * 1000 }}", "the rendered text is over 268435456 bytes"),
    ];
    for (name, evil, says) in cases {
        let t = evil_template(tmp.path(), name, evil);
        let out = tmp.path().join(name);
        // The run's own memory: an ordinary run's and 1 GiB more (the render process has its own).
        let r = strata_in(
            &extract_args(&model, &data, &out, &["--chat-template", s(&t)]),
            Some(ordinary + (2 << 20)),
            60,
            &[],
            None,
        );
        r.assert_ok().assert_says(&["wrote 1 samples", "1 records could not be rendered", "(id \"boom\")", says]);
    }
    // --template-memory sets the bound.
    let t = evil_template(tmp.path(), "hundred", "{{ ('x' * 100000000) | length }}");
    let r = strata(&extract_args(
        &model,
        &data,
        &tmp.path().join("small"),
        &["--chat-template", s(&t), "--template-memory", "64MiB"],
    ));
    r.assert_ok().assert_says(&["wrote 1 samples", "--template-memory 64 MiB"]);
    strata(&extract_args(
        &model,
        &data,
        &tmp.path().join("big"),
        &["--chat-template", s(&t), "--template-memory", "2GiB"],
    ))
    .assert_ok()
    .assert_says(&["wrote 2 samples"]);
}

#[test]
fn class2_values_nested_millions_deep_fail_that_conversation_not_the_run() {
    let tmp = tempfile::tempdir().unwrap();
    let model = chat_model(tmp.path(), "chatml");
    let data = tmp.path().join("c.jsonl");
    boom_and_fine(&data);
    // Two million levels: printed, compared, or only dropped at the end of the render.
    let build = "{% set ns = namespace(x=[], y=[]) %}{% for i in range(200) %}{% for j in range(1000) %}\
                 {% set ns.x = [[[[[[[[[[ns.x]]]]]]]]]] %}{% endfor %}{% endfor %}";
    for (name, use_it) in [("print", "{{ ns.x }}"), ("compare", "{{ ns.x == [ns.x] }}"), ("drop", "")] {
        let t = evil_template(tmp.path(), name, &format!("{build}{use_it}"));
        let out = tmp.path().join(name);
        let r = strata_in(&extract_args(&model, &data, &out, &["--chat-template", s(&t)]), None, 120, &[], None);
        assert_ne!(r.code, Some(134), "{name}: aborted:\n{}", r.stderr);
        r.assert_ok().assert_says(&["wrote 1 samples", "(id \"boom\")"]);
        let all = format!("{}{}", r.stdout, r.stderr);
        assert!(all.contains("nested too deep") || all.contains("--template-memory"), "{name}:\n{all}");
    }
}

#[test]
fn a_template_that_fails_on_every_conversation_stops_the_run_after_max_template_failures() {
    let tmp = tempfile::tempdir().unwrap();
    let model = chat_model(tmp.path(), "chatml");
    let data = tmp.path().join("c.jsonl");
    write_jsonl(&data, (0..12).map(|i| hello(&format!("c{i}"))));
    // Each render runs out of instructions.
    let burn = tmp.path().join("burn.jinja");
    std::fs::write(&burn, "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}").unwrap();
    let r = strata_in(
        &extract_args(&model, &data, &tmp.path().join("a"), &["--chat-template", s(&burn)]),
        None,
        120,
        &[],
        None,
    );
    r.assert_fails(&["none of the 12 input records gave a sample", "ran out of its budget"]);
    assert!(r.secs < 60.0, "12 renders that burn their budget took {:.1} s", r.secs);
    let args = ["--chat-template", s(&burn), "--max-template-failures", "5"];
    let r = strata(&extract_args(&model, &data, &tmp.path().join("b"), &args));
    r.assert_fails(&[
        "failed on 5 conversations in a row",
        "burn.jinja",
        "ran out of its budget",
        "--max-template-failures",
    ]);
    let args = ["--chat-template", s(&burn), "--max-template-failures", "0"];
    strata(&extract_args(&model, &data, &tmp.path().join("c"), &args)).assert_fails(&["none of the 12 input records"]);
}
