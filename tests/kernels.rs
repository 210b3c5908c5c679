//! Every CUDA kernel source in `kernels/` compiles with NVRTC alone (no CUDA
//! headers) for sm_80 (A100) and sm_90 (H100/H200), and defines the entry
//! points the backend launches. Needs no GPU: only libnvrtc, which `.ci/run`
//! takes from the PyPI package `nvidia-cuda-nvrtc` (and then sets
//! STRATA_REQUIRE_NVRTC=1, so a missing library fails instead of skipping).
#![cfg(feature = "cuda")]

use strata::backend::cuda::nvrtc;

const ARCHES: [&str; 2] = ["sm_80", "sm_90"];

fn nvrtc_or_skip(test: &str) -> bool {
    if nvrtc::available() {
        return true;
    }
    assert!(
        std::env::var_os("STRATA_REQUIRE_NVRTC").is_none(),
        "STRATA_REQUIRE_NVRTC is set but libnvrtc.so could not be loaded (is its directory on LD_LIBRARY_PATH?)"
    );
    eprintln!("{test}: skipped: libnvrtc.so not found (pip install nvidia-cuda-nvrtc, put nvidia/cu13/lib on LD_LIBRARY_PATH)");
    false
}

/// The kernel files on disk: every `.cu` of `kernels/`.
fn files_on_disk() -> Vec<String> {
    // The checkout the test was built from, or the current directory where
    // the binary was carried elsewhere (scripts/gpu-check.sh).
    let built = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let dir = if built.is_dir() { built } else { std::path::PathBuf::from("kernels") };
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|n| n.strip_suffix(".cu").map(str::to_string))
        .collect();
    names.sort();
    names
}

#[test]
fn every_kernel_file_is_built_in() {
    let built: Vec<&str> = nvrtc::SOURCES.iter().map(|(n, _)| *n).collect();
    assert_eq!(files_on_disk(), built, "kernels/*.cu and nvrtc::SOURCES must list the same files");
}

#[test]
fn kernels_include_no_headers_but_common() {
    for (name, text) in nvrtc::SOURCES {
        for line in text.lines().filter(|l| l.trim_start().starts_with("#include")) {
            assert_eq!(line.trim(), "#include \"common.cuh\"", "{name}.cu: NVRTC has no headers to include: {line}");
        }
        assert!(!nvrtc::source(name).unwrap().contains("#include"), "{name}: header not pasted");
    }
    assert!(!nvrtc::COMMON.contains("#include"));
}

#[test]
fn every_kernel_compiles_for_sm80_and_sm90() {
    if !nvrtc_or_skip("every_kernel_compiles_for_sm80_and_sm90") {
        return;
    }
    let version = nvrtc::version().unwrap();
    eprintln!("NVRTC {}.{}", version.0, version.1);
    for (name, text) in nvrtc::SOURCES {
        // The entry points the file declares, by name (each written out, no macros).
        let declared: Vec<&str> =
            text.split("extern \"C\" __global__ void ").skip(1).map(|s| s.split('(').next().unwrap().trim()).collect();
        for arch in ARCHES {
            let ptx = nvrtc::compile(name, arch).unwrap_or_else(|e| panic!("{e}"));
            let entries = nvrtc::entry_points(&ptx);
            assert!(!entries.is_empty(), "{name}.cu for {arch}: no entry points");
            for d in &declared {
                assert!(entries.iter().any(|e| e == d), "{name}.cu for {arch}: {d} not in PTX (entries: {entries:?})");
            }
            assert!(ptx.contains(&format!(".target {arch}")), "{name}.cu: PTX not for {arch}");
        }
    }
}

#[test]
fn the_attention_kernels_use_tensor_cores() {
    if !nvrtc_or_skip("the_attention_kernels_use_tensor_cores") {
        return;
    }
    let ptx = nvrtc::compile("attention", "sm_90").unwrap();
    for n in [16, 32, 64, 128, 256] {
        assert!(nvrtc::entry_points(&ptx).contains(&format!("attention_bf16_v{n}")));
    }
    assert!(ptx.contains("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"));
}

/// What the driver's module loader is handed is machine code for the GPU's
/// own architecture (an ELF cubin), not PTX: a CUDA 13.0 driver refuses the
/// PTX ISA of a newer NVRTC wheel, while it loads that wheel's cubins.
#[test]
fn the_loader_gets_an_elf_cubin_for_the_requested_arch() {
    if !nvrtc_or_skip("the_loader_gets_an_elf_cubin_for_the_requested_arch") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    for (name, _) in nvrtc::SOURCES {
        for (arch, sm) in [("sm_80", 80), ("sm_90", 90)] {
            let image = nvrtc::image_for(name, arch, Some(dir.path())).unwrap_or_else(|e| panic!("{e}"));
            let nvrtc::Image::Cubin(bytes) = &image else { panic!("{name} for {arch}: PTX, not a cubin") };
            assert_eq!(&bytes[..4], b"\x7fELF", "{name} for {arch}: not an ELF image");
            assert_eq!(nvrtc::cubin_arch(bytes), Some(sm), "{name}: the cubin is not for {arch}");
            // From the cache the second time: the same bytes.
            assert_eq!(nvrtc::image_for(name, arch, Some(dir.path())).unwrap(), image);
        }
    }
    assert_eq!(nvrtc::cubin_arch(b"not an elf image at all, fifty-two bytes or more...."), None);
}

#[test]
fn compiled_kernels_are_cached_by_source_arch_version_options_and_kind() {
    if !nvrtc_or_skip("compiled_kernels_are_cached_by_source_arch_version_options_and_kind") {
        return;
    }
    use nvrtc::{Image, ImageKind};
    let dir = tempfile::tempdir().unwrap();
    let version = nvrtc::version().unwrap();
    let first = nvrtc::compile_cached("norm", "sm_90", Some(dir.path()), ImageKind::Ptx).unwrap();
    let key = nvrtc::cache_key("norm", "sm_90", version, ImageKind::Ptx).unwrap();
    let entry = dir.path().join(&key);
    assert_eq!(std::fs::read(&entry).unwrap(), first.bytes());
    // A second call reads the entry: mark it and see the mark come back.
    let Image::Ptx(text) = &first else { panic!("PTX was asked for") };
    let marked = format!("{text}\n// cached");
    std::fs::write(&entry, &marked).unwrap();
    assert_eq!(nvrtc::compile_cached("norm", "sm_90", Some(dir.path()), ImageKind::Ptx).unwrap(), Image::Ptx(marked));
    // Another architecture, NVRTC version or image kind is another key.
    assert_ne!(nvrtc::cache_key("norm", "sm_80", version, ImageKind::Ptx).unwrap(), key);
    assert_ne!(nvrtc::cache_key("norm", "sm_90", (1, 0), ImageKind::Ptx).unwrap(), key);
    assert_ne!(nvrtc::cache_key("norm", "sm_90", version, ImageKind::Cubin).unwrap(), key);
    // A corrupt entry (no entry points; no ELF header) is compiled afresh and replaced.
    std::fs::write(&entry, "garbage").unwrap();
    assert_eq!(nvrtc::compile_cached("norm", "sm_90", Some(dir.path()), ImageKind::Ptx).unwrap(), first);
    let cubin = nvrtc::compile_cached("norm", "sm_90", Some(dir.path()), ImageKind::Cubin).unwrap();
    let cubin_entry = dir.path().join(nvrtc::cache_key("norm", "sm_90", version, ImageKind::Cubin).unwrap());
    std::fs::write(&cubin_entry, b"\x7fELF truncated").unwrap();
    assert_eq!(nvrtc::compile_cached("norm", "sm_90", Some(dir.path()), ImageKind::Cubin).unwrap(), cubin);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2, "no temporary files left");
}

/// Each kernel is declared once (its signature in the `.cu` file); build.rs
/// turns the declarations into the prototypes every source is compiled
/// with. A definition that disagrees with them (here `rms_norm` with a float
/// where the declaration has an int) is refused by NVRTC; the typed
/// launchers make rustc refuse a launch that disagrees (`tests/ui_cuda`),
/// and the emulation's g++ the same definition (`tests/kernels_emulated.rs`).
#[test]
fn a_definition_that_disagrees_with_its_declaration_does_not_compile() {
    if !nvrtc_or_skip("a_definition_that_disagrees_with_its_declaration_does_not_compile") {
        return;
    }
    use strata::backend::cuda::kernels;
    let good = nvrtc::source("norm").unwrap();
    assert!(good.contains(kernels::PROTOTYPES), "the prototypes are not pasted into the source");
    for name in kernels::NAMES {
        assert!(kernels::PROTOTYPES.contains(&format!(" void {name}(")), "{name} has no prototype");
    }
    let decl = "extern \"C\" __global__ void rms_norm(const float* x, int stride,";
    assert!(good.contains(decl), "rms_norm's definition moved: update this test");
    // The definition (the last occurrence; the first is the generated prototype).
    let at = good.rfind(decl).unwrap();
    let bad = format!("{}{}{}", &good[..at], decl.replace("int stride", "float stride"), &good[at + decl.len()..]);
    assert!(nvrtc::compile_text("norm", &good, "sm_90", nvrtc::ImageKind::Ptx).is_ok());
    let err = nvrtc::compile_text("norm", &bad, "sm_90", nvrtc::ImageKind::Ptx).expect_err("a mismatch compiled");
    assert!(err.to_string().contains("rms_norm"), "{err}");
}

/// One entry point's PTX: from its `.entry` line to its closing brace.
fn ptx_of<'a>(ptx: &'a str, entry: &str) -> &'a str {
    let at = ptx.find(&format!(".entry {entry}(")).unwrap_or_else(|| panic!("no entry {entry}"));
    let body = &ptx[at..];
    &body[..body.find("\n}\n").expect("an entry ends with a closing brace")]
}

/// How many instructions of `body` start with `op` (`ld.shared`, `mma.sync`, …).
fn count(body: &str, op: &str) -> usize {
    body.lines().filter(|l| l.trim_start().starts_with(op)).count()
}

/// The tensor-core attention reads shared memory only through `ldmatrix`
/// (no scalar `ld.shared`: the 8-way conflicts of the u32 fragment loads
/// and the 4-way ones of V's u16 loads are gone), fills it with `cp.async`,
/// and keeps Q in registers. The counts are of the compiled PTX; the model
/// below them (docs/ARCHITECTURE.md, "The attention kernel") turns them
/// into shared-memory wavefronts and MMAs per key tile.
#[test]
fn the_bf16_attention_kernel_reads_shared_memory_only_through_ldmatrix() {
    if !nvrtc_or_skip("the_bf16_attention_kernel_reads_shared_memory_only_through_ldmatrix") {
        return;
    }
    let ptx = nvrtc::compile("attention", "sm_90").unwrap();
    for n in [16, 32, 64, 128, 256] {
        let body = ptx_of(&ptx, &format!("attention_bf16_v{n}"));
        let ld_shared = count(body, "ld.shared");
        let ldmatrix = count(body, "ldmatrix.sync.aligned.m8n8.x4.shared.b16");
        let trans = count(body, "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16");
        let cp_async = count(body, "cp.async.cg.shared.global");
        let mma = count(body, "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32");
        let ex2 = count(body, "ex2.approx");
        let local = count(body, "ld.local") + count(body, "st.local");
        eprintln!(
            "attention_bf16_v{n}: ld.shared {ld_shared}, ldmatrix {ldmatrix} (+{trans} .trans), cp.async {cp_async}, \
             mma {mma}, ex2 {ex2}, local {local}"
        );
        assert_eq!(ld_shared, 0, "attention_bf16_v{n}: scalar shared-memory loads");
        assert!(cp_async > 0, "attention_bf16_v{n}: tiles not copied by cp.async");
        // The unrolled loops, at least once each: Q's 8 register chunks
        // (loaded once) and K's 2 loads for each of them; V's n/16 pairs of
        // value tiles for each of the key tile's 2 halves.
        let vt = n / 8;
        assert!(ldmatrix >= 8 + 2 * 8, "attention_bf16_v{n}: Q or K loop not unrolled ({ldmatrix} ldmatrix)");
        assert!(trans >= vt, "attention_bf16_v{n}: V loop not unrolled ({trans} ldmatrix.trans)");
        assert!(mma >= 4 * 8 + 2 * vt, "attention_bf16_v{n}: {mma} mma");
        // Only the scores' 16 and the 2 rows' rescales per key tile, no
        // precise expf's extra steps (an expf is ex2.approx plus range work).
        assert!(ex2 <= 2 * 18, "attention_bf16_v{n}: {ex2} ex2");
        // o, the scores and Q's fragments stay in registers (no stack).
        assert_eq!(local, 0, "attention_bf16_v{n}: an array went to local memory");
    }
}

/// The element-wise kernels index in 32 bits (`GRID_STRIDE`, common.cuh):
/// no 64-bit division or remainder, which the GPU has no instruction for
/// (each is a call of tens of instructions), per element. The backend
/// refuses an op of more than 2^31 values (`elementwise` in backend.rs).
#[test]
fn element_wise_kernels_divide_in_32_bits() {
    if !nvrtc_or_skip("element_wise_kernels_divide_in_32_bits") {
        return;
    }
    for file in ["elementwise", "quant"] {
        let ptx = nvrtc::compile(file, "sm_90").unwrap();
        for entry in nvrtc::entry_points(&ptx) {
            let body = ptx_of(&ptx, &entry);
            let wide = ["div.u64", "rem.u64", "div.s64", "rem.s64"].iter().map(|op| count(body, op)).sum::<usize>();
            assert_eq!(wide, 0, "{file}.cu {entry}: 64-bit division in the element loop");
            assert!(count(body, "div.u32") + count(body, "rem.u32") + count(body, "div.s32") <= 4, "{entry}");
        }
    }
}
