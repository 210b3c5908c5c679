//! `strata verify` and `strata inspect` on datasets and files built to break
//! them: manifests naming files outside the dataset, inconsistent counts,
//! FIFOs and devices in place of files, zero-sized dims, huge strings. Each
//! gives a clear error (or a clean report) in bounded time, never a panic,
//! and nothing outside the dataset is opened.

use serde_json::Value;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How long one command may take: a FIFO read would block forever.
const TIMEOUT: Duration = Duration::from_secs(20);

fn os(s: &str) -> &OsStr {
    OsStr::new(s)
}

/// Runs `strata ARGS`, killed and failed after [`TIMEOUT`]; (success, stdout, stderr).
fn strata(args: &[&OsStr]) -> (bool, String, String) {
    let logs = tempfile::tempdir().unwrap();
    let (out_path, err_path) = (logs.path().join("out"), logs.path().join("err"));
    // Files, not pipes: a full pipe would stall the child and look like a hang.
    let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            panic!("strata {args:?} did not finish within {TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let read = |p: &Path| String::from_utf8_lossy(&std::fs::read(p).unwrap()).to_string();
    let (out, err) = (read(&out_path), read(&err_path));
    assert!(!err.contains("panicked"), "strata {args:?} panicked: {err}");
    (status.success(), out, err)
}

/// `strata verify DIR`: (success, stdout + stderr).
fn verify(dir: &Path) -> (bool, String) {
    let (ok, out, err) = strata(&[os("verify"), dir.as_os_str()]);
    (ok, out + &err)
}

/// `strata inspect PATH`: (success, stdout + stderr).
fn inspect(path: &Path) -> (bool, String) {
    let (ok, out, err) = strata(&[os("inspect"), path.as_os_str()]);
    (ok, out + &err)
}

/// Asserts that `strata verify` fails naming every needle.
fn verify_fails(dir: &Path, needles: &[&str]) -> String {
    let (ok, text) = verify(dir);
    assert!(!ok, "verify passed:\n{text}");
    for n in needles {
        assert!(text.contains(n), "lacks {n:?}:\n{text}");
    }
    text
}

/// The embedded demo model and data, two shards, at `tmp/name`.
fn dataset(tmp: &Path, name: &str) -> PathBuf {
    let ds = tmp.join(name);
    let (ok, _, err) = strata(&[os("extract"), os("--out"), ds.as_os_str(), os("--shard-size"), os("16KiB")]);
    assert!(ok, "{err}");
    let (ok, text) = verify(&ds);
    assert!(ok, "{text}");
    ds
}

fn manifest(ds: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(ds.join("manifest.json")).unwrap()).unwrap()
}

/// Rewrites `ds/manifest.json` through `f`.
fn edit(ds: &Path, f: impl FnOnce(&mut Value)) {
    let mut m = manifest(ds);
    f(&mut m);
    std::fs::write(ds.join("manifest.json"), serde_json::to_string(&m).unwrap()).unwrap();
}

fn mkfifo(path: &Path) {
    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0, "mkfifo {}", path.display());
}

/// A safetensors file of `(name, dtype, shape)` tensors filled with a byte pattern.
fn write_safetensors(path: &Path, tensors: &[(&str, safetensors::Dtype, &[usize])]) {
    let data: Vec<(String, Vec<u8>, safetensors::Dtype, Vec<usize>)> = tensors
        .iter()
        .map(|(name, dt, shape)| {
            let n: usize = shape.iter().product::<usize>() * dt.bitsize() / 8;
            let bytes = (0..n).map(|i| (i % 7) as u8 + 0x3c).collect();
            (name.to_string(), bytes, *dt, shape.to_vec())
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = data
        .iter()
        .map(|(name, bytes, dt, shape)| {
            (name.clone(), safetensors::tensor::TensorView::new(*dt, shape.clone(), bytes).unwrap())
        })
        .collect();
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

#[test]
fn verify_checks_shard_indices_ids_and_counts() {
    let tmp = tempfile::tempdir().unwrap();

    // A sample listing a shard past the end: reported, and the shard totals no longer add up.
    let ds = dataset(tmp.path(), "index");
    edit(&ds, |m| m["samples"][1]["shard"] = 99.into());
    verify_fails(&ds, &["sample \"1\": shard 99 is past the end of the shard list (2 shards)", "but says"]);

    // An id listed twice (with the counts kept consistent, so only the duplicate is wrong).
    let ds = dataset(tmp.path(), "dup");
    edit(&ds, |m| {
        let first = m["samples"][0].clone();
        let shard = first["shard"].as_u64().unwrap() as usize;
        m["samples"].as_array_mut().unwrap().push(first);
        let n = m["shards"][shard]["samples"].as_u64().unwrap();
        m["shards"][shard]["samples"] = (n + 1).into();
    });
    verify_fails(&ds, &["sample id \"0\" appears 2 times"]);

    // Per-shard counts that disagree with the samples listed, and a total that does not add up.
    let ds = dataset(tmp.path(), "counts");
    edit(&ds, |m| m["shards"][0]["samples"] = 7.into());
    let total = 7 + manifest(&ds)["shards"][1]["samples"].as_u64().unwrap();
    let sum = format!("hold {total} samples in all, but it lists 4");
    verify_fails(&ds, &["shard-00000.safetensors: manifest lists", "but says 7", &sum]);

    // Counts near usize::MAX do not overflow the sum.
    let ds = dataset(tmp.path(), "huge");
    edit(&ds, |m| {
        m["shards"][0]["samples"] = u64::MAX.into();
        m["shards"][1]["samples"] = u64::MAX.into();
        m["samples"][0]["tokens"] = u64::MAX.into();
    });
    verify_fails(&ds, &["in all, but it lists 4", "has shape"]);

    // Two shards naming one file.
    let ds = dataset(tmp.path(), "twice");
    edit(&ds, |m| m["shards"][1]["file"] = m["shards"][0]["file"].clone());
    verify_fails(&ds, &["shard 1 (shard-00000.safetensors): shard 0 names the same file"]);
}

#[test]
fn shards_outside_the_dataset_are_never_opened() {
    let tmp = tempfile::tempdir().unwrap();
    // A sound shard outside the dataset: were it opened, verify would pass.
    let ds = dataset(tmp.path(), "ds");
    let outside = tmp.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    let moved = outside.join("shard-00000.safetensors");
    std::fs::rename(ds.join("shard-00000.safetensors"), &moved).unwrap();
    std::os::unix::fs::symlink(&moved, ds.join("link.safetensors")).unwrap();

    let cases: [(&str, &str); 6] = [
        ("../outside/shard-00000.safetensors", "has a `..` component"),
        ("part-1/../../outside/shard-00000.safetensors", "has a `..` component"),
        (moved.to_str().unwrap(), "is absolute"),
        ("/etc/passwd", "is absolute"),
        ("/dev/zero", "is absolute"),
        ("link.safetensors", "leads outside"),
    ];
    for (file, why) in cases {
        edit(&ds, |m| m["shards"][0]["file"] = file.into());
        let text = verify_fails(&ds, &[why, "not opened"]);
        assert!(!text.contains("not a valid safetensors file"), "{file}: it was opened:\n{text}");
        // inspect (and recompute, through Dataset::shard) refuse it too.
        let (ok, text) = inspect(&ds);
        assert!(!ok && text.contains(why), "inspect {file}:\n{text}");
    }

    // Subdirectories inside the dataset are fine (merged datasets keep parts there).
    std::fs::create_dir(ds.join("part-1")).unwrap();
    std::fs::rename(&moved, ds.join("part-1/shard-00000.safetensors")).unwrap();
    edit(&ds, |m| m["shards"][0]["file"] = "part-1/shard-00000.safetensors".into());
    let (ok, text) = verify(&ds);
    assert!(ok && text.contains("ok: 4 samples in 2 shards"), "{text}");
    let (ok, text) = inspect(&ds);
    assert!(ok, "{text}");
}

#[test]
fn fifos_and_devices_are_refused_not_read() {
    let tmp = tempfile::tempdir().unwrap();

    // A FIFO in place of manifest.json.
    let ds = dataset(tmp.path(), "manifest");
    std::fs::remove_file(ds.join("manifest.json")).unwrap();
    mkfifo(&ds.join("manifest.json"));
    verify_fails(&ds, &["manifest.json is a FIFO, not a regular file"]);
    let (ok, text) = inspect(&ds);
    assert!(!ok && text.contains("is a FIFO"), "{text}");

    // A FIFO in place of a shard.
    let ds = dataset(tmp.path(), "shard");
    std::fs::remove_file(ds.join("shard-00001.safetensors")).unwrap();
    mkfifo(&ds.join("shard-00001.safetensors"));
    verify_fails(&ds, &["shard-00001.safetensors is a FIFO, not a regular file"]);
    let (ok, text) = inspect(&ds);
    assert!(!ok && text.contains("is a FIFO"), "{text}");

    // A FIFO as the expected layout.
    let layout = tmp.path().join("layout.json");
    mkfifo(&layout);
    let (ok, out, err) =
        strata(&[os("verify"), tmp.path().join("manifest").as_os_str(), os("--layout"), layout.as_os_str()]);
    assert!(!ok && (out + &err).contains("is a FIFO"), "layout FIFO accepted");

    // A speculators directory with a FIFO among its files, a FIFO given as a file, and a device.
    let spec = tmp.path().join("spec");
    std::fs::create_dir(&spec).unwrap();
    mkfifo(&spec.join("hs_0.safetensors"));
    let (ok, text) = inspect(&spec);
    assert!(!ok && text.contains("hs_0.safetensors is a FIFO"), "{text}");
    let (ok, text) = inspect(&spec.join("hs_0.safetensors"));
    assert!(!ok && text.contains("is a FIFO"), "{text}");
    let (ok, text) = inspect(Path::new("/dev/zero"));
    assert!(!ok && text.contains("/dev/zero is a device"), "{text}");
}

#[test]
fn zero_sized_dims_do_not_panic() {
    use safetensors::Dtype::{BF16, F32, I64, U8};
    let tmp = tempfile::tempdir().unwrap();
    // Single files, speculators ([T, L, H]) and native ([L, T, H]) names.
    for shape in [[2, 3, 0], [0, 3, 4], [3, 0, 4], [0, 0, 0], [0, usize::MAX / 2, 4]] {
        for name in ["hidden_states", "s0.hidden_states"] {
            let file = tmp.path().join("f.safetensors");
            write_safetensors(&file, &[(name, BF16, &shape), ("other", F32, &[0, 5])]);
            let (ok, text) = inspect(&file);
            assert!(ok && text.contains(name), "{name} {shape:?}:\n{text}");
        }
    }
    // Layer counts past what is summarised are said, not allocated.
    let file = tmp.path().join("f.safetensors");
    write_safetensors(&file, &[("hidden_states", BF16, &[1, 70_000, 1])]);
    let (ok, text) = inspect(&file);
    assert!(ok && text.contains("70000 layers, more than"), "{text}");

    // A speculators directory with a 0 dim in one file.
    let spec = tmp.path().join("spec");
    std::fs::create_dir(&spec).unwrap();
    write_safetensors(&spec.join("hs_0.safetensors"), &[("hidden_states", BF16, &[2, 3, 0]), ("input_ids", I64, &[2])]);
    write_safetensors(&spec.join("hs_1.safetensors"), &[("hidden_states", BF16, &[4, 3, 8]), ("input_ids", I64, &[4])]);
    let (ok, text) = inspect(&spec);
    assert!(ok && text.contains("samples:     2") && text.contains("layer 2"), "{text}");

    // A native dataset of hidden size 0 with a sample of 0 tokens: sound, and read without a panic.
    let ds = dataset(tmp.path(), "ds");
    let m = manifest(&ds);
    let layers = m["capture"].as_array().unwrap().len();
    let file = ds.join("shard-00000.safetensors");
    write_safetensors(
        &file,
        &[
            ("z.input_ids", I64, &[0]),
            ("z.loss_mask", U8, &[0]),
            ("z.hidden_states", BF16, &[layers, 0, 0]),
            ("w.input_ids", I64, &[3]),
            ("w.loss_mask", U8, &[3]),
            ("w.hidden_states", BF16, &[layers, 3, 0]),
        ],
    );
    let mapped = strata::dataset::MappedFile::open(&file).unwrap();
    let sample = |id: &str, tokens: usize| {
        let names: Vec<String> =
            ["input_ids", "loss_mask", "hidden_states"].iter().map(|e| format!("{id}.{e}")).collect();
        serde_json::json!({"id": id, "shard": 0, "tokens": tokens, "checksum": mapped.sample_checksum(&names).unwrap()})
    };
    let bytes = std::fs::metadata(&file).unwrap().len();
    edit(&ds, |m| {
        m["model"]["hidden_size"] = 0.into();
        m["shards"] = serde_json::json!([{"file": "shard-00000.safetensors", "samples": 2, "bytes": bytes}]);
        m["samples"] = serde_json::json!([sample("z", 0), sample("w", 3)]);
    });
    let (ok, text) = verify(&ds);
    // The loss mask bytes of the pattern are not 0 or 1: the only problem.
    assert!(!ok && text.contains("sample \"w\": loss_mask holds values other than 0 and 1"), "{text}");
    assert_eq!(text.matches("problem:").count(), 1, "{text}");
    let (ok, text) = inspect(&ds);
    assert!(ok && text.contains("samples:     2 in 1 shards"), "{text}");
    let (ok, text) = inspect(&file);
    assert!(ok && text.contains("z.hidden_states"), "{text}");
}

#[test]
fn messages_quote_huge_strings_cut_short() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = dataset(tmp.path(), "ds");
    let long_id = "i".repeat(1 << 20);
    let long_file = format!("../{}", "f".repeat(1 << 20));
    let long_name = "n".repeat(1 << 20);
    edit(&ds, |m| {
        let mut s = m["samples"][0].clone();
        s["id"] = long_id.clone().into();
        let shard = s["shard"].as_u64().unwrap() as usize;
        m["samples"].as_array_mut().unwrap().push(s.clone());
        m["samples"].as_array_mut().unwrap().push(s);
        let n = m["shards"][shard]["samples"].as_u64().unwrap();
        m["shards"][shard]["samples"] = (n + 2).into();
        let shards = m["shards"].as_array_mut().unwrap();
        shards.push(serde_json::json!({"file": long_file, "samples": 0, "bytes": 0}));
        shards.push(serde_json::json!({"file": long_name, "samples": 0, "bytes": 0}));
        m["capture"][0]["point"] = long_name.clone().into();
    });
    let layout = tmp.path().join("layout.json");
    std::fs::write(&layout, serde_json::json!({"capture": [long_name], "dtype": long_id}).to_string()).unwrap();
    let (ok, out, err) = strata(&[os("verify"), ds.as_os_str(), os("--layout"), layout.as_os_str()]);
    let text = out + &err;
    assert!(!ok, "{text}");
    for want in [
        "appears 2 times",
        "has a `..` component",
        &format!("({} bytes)", long_id.len()),
        &format!("({} bytes)", long_file.len()),
        "…",
        "layout: capture is [",
    ] {
        assert!(text.contains(want), "lacks {want:?}:\n{}", &text[..text.len().min(4000)]);
    }
    assert!(text.len() < 20_000, "{} bytes of messages:\n{}", text.len(), &text[..4000]);

    // inspect stops at the first sample it cannot read, quoting its id cut short too.
    let (ok, text) = inspect(&ds);
    assert!(!ok && text.contains("…") && text.len() < 20_000, "{}", &text[..text.len().min(4000)]);

    // A file with a huge tensor name and a shape of 100000 dims.
    let file = tmp.path().join("f.safetensors");
    let ones = vec![1; 100_000];
    write_safetensors(&file, &[(&long_name, safetensors::Dtype::F32, &[2]), ("t", safetensors::Dtype::F32, &ones)]);
    let (ok, text) = inspect(&file);
    assert!(ok && text.contains("(100000 dims)") && text.len() < 20_000, "{}", &text[..text.len().min(4000)]);

    // A malformed layout file's values are cut short as well.
    std::fs::write(&layout, serde_json::json!({"capture": [[long_id]]}).to_string()).unwrap();
    let (ok, out, err) = strata(&[os("verify"), ds.as_os_str(), os("--layout"), layout.as_os_str()]);
    assert!(
        !ok && err.contains("is not a string") && out.len() + err.len() < 20_000,
        "{}",
        &err[..err.len().min(4000)]
    );
}

#[test]
fn inspect_survives_bad_shard_indices_duplicates_and_huge_counts() {
    let tmp = tempfile::tempdir().unwrap();

    // A shard index past the end: a clean error naming it.
    let ds = dataset(tmp.path(), "index");
    edit(&ds, |m| m["samples"][2]["shard"] = 99.into());
    let (ok, text) = inspect(&ds);
    assert!(!ok && text.contains("sample \"2\"") && text.contains("no shard 99 (the manifest lists 2)"), "{text}");

    // Duplicate ids: described, each read.
    let ds = dataset(tmp.path(), "dup");
    edit(&ds, |m| {
        let first = m["samples"][0].clone();
        m["samples"].as_array_mut().unwrap().push(first);
    });
    let (ok, text) = inspect(&ds);
    assert!(ok && text.contains("samples:     5 in 2 shards"), "{text}");

    // Token and byte counts whose sums overflow usize.
    let ds = dataset(tmp.path(), "huge");
    edit(&ds, |m| {
        m["samples"][0]["tokens"] = u64::MAX.into();
        m["samples"][1]["tokens"] = u64::MAX.into();
        m["shards"][0]["bytes"] = u64::MAX.into();
        m["shards"][1]["bytes"] = u64::MAX.into();
    });
    let (ok, text) = inspect(&ds);
    assert!(!ok && text.contains("has shape"), "{text}");
}

#[test]
fn every_input_row_is_written_or_skipped_exactly_once() {
    let tmp = tempfile::tempdir().unwrap();
    // A row listed twice.
    let ds = dataset(tmp.path(), "twice");
    edit(&ds, |m| m["samples"][1]["index"] = 0.into());
    verify_fails(&ds, &["input row 0 is listed twice"]);
    // A row in neither list: the input had one more sample than the output accounts for.
    let ds = dataset(tmp.path(), "gap");
    edit(&ds, |m| {
        let n = m["input"]["samples"].as_u64().unwrap();
        m["input"]["samples"] = (n + 1).into();
    });
    verify_fails(&ds, &["the input had 5 samples but 4 are written or skipped (row 4 is in neither)"]);
    // Out of input order.
    let ds = dataset(tmp.path(), "order");
    edit(&ds, |m| {
        m["samples"][1]["index"] = 2.into();
        m["samples"][2]["index"] = 1.into();
    });
    verify_fails(&ds, &["samples are not in input order"]);
}
