//! Python interop: the native and speculators outputs read with the
//! `safetensors` and `numpy` packages match the HF reference (tests/interop/check.py).
//!
//! Uses `$STRATA_PYTHON` (else `python3`). Without numpy and safetensors the
//! test says so and skips, unless `STRATA_REQUIRE_INTEROP=1` (set by .ci/run,
//! which installs them) turns that into a failure.

mod common;

use common::*;
use std::process::Command;

fn python() -> Option<String> {
    let py = std::env::var("STRATA_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&py).args(["-c", "import numpy, safetensors"]).output().map(|o| o.status.success());
    match ok {
        Ok(true) => Some(py),
        _ => {
            let why = format!("{py} with numpy and safetensors is not available");
            if std::env::var("STRATA_REQUIRE_INTEROP").as_deref() == Ok("1") {
                panic!("{why} (STRATA_REQUIRE_INTEROP=1)");
            }
            eprintln!("SKIPPED interop test: {why}; `pip install numpy safetensors` or set STRATA_PYTHON");
            None
        }
    }
}

#[test]
fn python_reads_native_and_speculators_outputs() {
    let Some(py) = python() else { return };
    for (name, dtype) in [("qwen3", "f32"), ("llama-default", "bf16"), ("mistral-swa", "f16")] {
        let tmp = tempfile::tempdir().unwrap();
        let fx = fixture(name);
        let capture = "embeddings,input:1,output:1,final,final-norm";
        for format in ["strata", "speculators"] {
            let o = Command::new(env!("CARGO_BIN_EXE_strata"))
                .args(["extract", "--capture", capture, "--dtype", dtype, "--format", format, "--model"])
                .arg(&fx)
                .arg("--data")
                .arg(fx.join("data.jsonl"))
                .arg("--out")
                .arg(tmp.path().join(format))
                .output()
                .unwrap();
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        }
        let o = Command::new(&py)
            .arg(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/interop/check.py"))
            .arg(tmp.path().join("strata"))
            .arg(tmp.path().join("speculators"))
            .arg(&fx)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{name}: {text}");
        println!("{name}: {}", text.trim());
    }
}
