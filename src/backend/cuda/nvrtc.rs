//! The kernel sources of `kernels/`, compiled at run time with NVRTC for the
//! device's architecture, and cached on disk.
//!
//! - The sources are built into the binary (`include_str!`), so a stripped
//!   binary carries them; `common.cuh` is pasted in place of each source's
//!   `#include "common.cuh"` line, because NVRTC is given no include path (and
//!   users' machines have no CUDA headers).
//! - The cache key is the source after that paste, the architecture, NVRTC's
//!   version and the options: a change to any of them compiles afresh. Entries
//!   are written to a temporary name and renamed, so a crash never leaves a
//!   partial one.
//! - Nothing here needs a driver or a GPU: CI compiles every kernel for
//!   sm_80 and sm_90 with the PyPI NVRTC wheel alone.

use super::CudaError;
use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};

/// The shared header every kernel source includes.
pub const COMMON: &str = include_str!("../../../kernels/common.cuh");

/// Every kernel source of `kernels/`: (file stem, text).
pub const SOURCES: &[(&str, &str)] = &[
    ("attention", include_str!("../../../kernels/attention.cu")),
    ("elementwise", include_str!("../../../kernels/elementwise.cu")),
    ("moe", include_str!("../../../kernels/moe.cu")),
    ("norm", include_str!("../../../kernels/norm.cu")),
    ("quant", include_str!("../../../kernels/quant.cu")),
    ("rope", include_str!("../../../kernels/rope.cu")),
];

/// The options every kernel is compiled with besides the architecture:
/// IEEE division, square root and denormals, so f32 compute can be checked
/// against the reference at its tight tolerance.
pub const OPTIONS: &[&str] = &["--std=c++17", "--fmad=true", "--prec-div=true", "--prec-sqrt=true", "--ftz=false"];

/// The source of kernel file `name` as NVRTC sees it (the header pasted in).
pub fn source(name: &str) -> Result<String, CudaError> {
    let (_, text) = SOURCES
        .iter()
        .find(|(n, _)| *n == name)
        .ok_or_else(|| CudaError::Kernel { name: name.into(), log: "no such kernel source".into() })?;
    Ok(text.replace("#include \"common.cuh\"", COMMON))
}

/// The names of the `extern "C" __global__` functions a source defines
/// (including those its macros expand to), as PTX `.entry` names.
pub fn entry_points(ptx: &str) -> Vec<String> {
    ptx.lines()
        .filter_map(|l| l.trim_start().strip_prefix(".visible .entry "))
        .map(|l| l.split(['(', ' ']).next().unwrap_or("").to_string())
        .collect()
}

/// Whether the NVRTC library can be loaded (without panicking inside cudarc).
pub fn available() -> bool {
    // SAFETY: only tries to dlopen the library's candidate names.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// NVRTC's version, `(major, minor)`.
pub fn version() -> Result<(i32, i32), CudaError> {
    if !available() {
        return Err(CudaError::NoNvrtc);
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present; the pointers are to live locals.
    let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    r.result().map_err(|e| CudaError::Kernel { name: "nvrtcVersion".into(), log: format!("{e:?}") })?;
    Ok((major, minor))
}

/// Compiles kernel file `name` to PTX for `arch` (`sm_90`), without the cache.
pub fn compile(name: &str, arch: &str) -> Result<String, CudaError> {
    if !available() {
        return Err(CudaError::NoNvrtc);
    }
    use cudarc::nvrtc::result;
    let src = CString::new(source(name)?)
        .map_err(|_| CudaError::Kernel { name: name.into(), log: "NUL in source".into() })?;
    let file = CString::new(format!("{name}.cu")).expect("no NUL in a kernel name");
    let fail = |log: String| CudaError::Kernel { name: name.into(), log };
    let prog = result::create_program(&src, Some(&file)).map_err(|e| fail(format!("{e:?}")))?;
    let mut opts: Vec<String> = OPTIONS.iter().map(|s| s.to_string()).collect();
    opts.push(format!("--gpu-architecture={arch}"));
    // SAFETY: `prog` was just created from `src`, which outlives it, and is destroyed once below.
    let out = unsafe {
        let compiled = result::compile_program(prog, &opts);
        let log = result::get_program_log(prog)
            .map(|l| CStr::from_ptr(l.as_ptr()).to_string_lossy().into_owned())
            .unwrap_or_default();
        let ptx = match compiled {
            Ok(()) => result::get_ptx(prog)
                .map(|p| CStr::from_ptr(p.as_ptr()).to_string_lossy().into_owned())
                .map_err(|e| fail(format!("{e:?}"))),
            Err(e) => Err(fail(format!("{e:?} for {arch}:\n{log}"))),
        };
        let _ = result::destroy_program(prog);
        ptx
    };
    out
}

/// The directory compiled kernels are cached in: `$STRATA_KERNEL_CACHE`, or
/// `$XDG_CACHE_HOME/strata/kernels`, or `~/.cache/strata/kernels`.
pub fn cache_dir() -> Option<PathBuf> {
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    env("STRATA_KERNEL_CACHE")
        .or_else(|| env("XDG_CACHE_HOME").map(|d| d.join("strata/kernels")))
        .or_else(|| env("HOME").map(|d| d.join(".cache/strata/kernels")))
}

/// The cache key of kernel file `name` for `arch` under NVRTC `version`.
pub fn cache_key(name: &str, arch: &str, version: (i32, i32)) -> Result<String, CudaError> {
    let text = format!("{}\0{arch}\0{}.{}\0{}", source(name)?, version.0, version.1, OPTIONS.join(" "));
    Ok(format!("{name}-{arch}-{:016x}.ptx", xxhash_rust::xxh3::xxh3_64(text.as_bytes())))
}

/// PTX of kernel file `name` for `arch`: from the cache in `dir` when an
/// entry with its key is there, else compiled and stored. A cache that cannot
/// be written is not an error (the kernel is compiled each run instead).
pub fn compile_cached(name: &str, arch: &str, dir: Option<&Path>) -> Result<String, CudaError> {
    let Some(dir) = dir else { return compile(name, arch) };
    let path = dir.join(cache_key(name, arch, version()?)?);
    if let Ok(ptx) = std::fs::read_to_string(&path) {
        if !entry_points(&ptx).is_empty() {
            return Ok(ptx);
        }
    }
    let ptx = compile(name, arch)?;
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let stored = std::fs::create_dir_all(dir)
        .and_then(|_| std::fs::write(&tmp, &ptx))
        .and_then(|_| std::fs::rename(&tmp, &path));
    if let Err(e) = stored {
        let _ = std::fs::remove_file(&tmp);
        tracing::warn!("kernel cache {}: {e}; compiling each run", dir.display());
    }
    Ok(ptx)
}
