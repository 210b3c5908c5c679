//! The kernel sources of `kernels/`, compiled at run time with NVRTC to a
//! cubin for the device's real architecture (PTX only as a fallback), and
//! cached on disk.
//!
//! - The sources are built into the binary (`include_str!`), so a stripped
//!   binary carries them; `common.cuh` is pasted in place of each source's
//!   `#include "common.cuh"` line, because NVRTC is given no include path (and
//!   users' machines have no CUDA headers).
//! - The cache key is the source after that paste, the architecture, NVRTC's
//!   version, the options and the image kind (cubin or PTX): a change to any
//!   of them compiles afresh. Entries
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

/// What NVRTC hands the module loader.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ImageKind {
    /// Machine code for one real architecture (an ELF cubin): loaded as is,
    /// no JIT. Under CUDA's minor-version compatibility, a cubin from a newer
    /// 13.x NVRTC loads on a 13.0 driver.
    Cubin,
    /// PTX, compiled by the driver's JIT at load. A driver older than the
    /// NVRTC refuses newer PTX ISA versions (`CUDA_ERROR_UNSUPPORTED_PTX_VERSION`):
    /// only a fallback.
    Ptx,
}

impl ImageKind {
    /// `cubin` or `ptx` (the cache file's extension, and what the probe prints).
    pub fn name(self) -> &'static str {
        match self {
            ImageKind::Cubin => "cubin",
            ImageKind::Ptx => "ptx",
        }
    }
}

/// A kernel file compiled for one architecture.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Image {
    /// An ELF cubin.
    Cubin(Vec<u8>),
    /// PTX text.
    Ptx(String),
}

impl Image {
    /// Which kind it is.
    pub fn kind(&self) -> ImageKind {
        match self {
            Image::Cubin(_) => ImageKind::Cubin,
            Image::Ptx(_) => ImageKind::Ptx,
        }
    }

    /// The bytes as stored in the cache.
    pub fn bytes(&self) -> &[u8] {
        match self {
            Image::Cubin(b) => b,
            Image::Ptx(p) => p.as_bytes(),
        }
    }

    /// Whether it looks whole: a cubin for some architecture, or PTX with entry points.
    fn plausible(&self) -> bool {
        match self {
            Image::Cubin(b) => cubin_arch(b).is_some(),
            Image::Ptx(p) => !entry_points(p).is_empty(),
        }
    }
}

/// The SM version an ELF cubin is for (`90` for sm_90), read from its
/// header; `None` if `image` is not a CUDA ELF. The ELF machine is EM_CUDA
/// (190); the SM sits in `e_flags`' low byte up to ELF ABI version 7 and in
/// its second byte from version 8 (CUDA 12.8 on).
pub fn cubin_arch(image: &[u8]) -> Option<u32> {
    if image.len() < 52 || &image[..4] != b"\x7fELF" || image[4] != 2 {
        return None;
    }
    let machine = u16::from_le_bytes([image[18], image[19]]);
    if machine != 190 {
        return None;
    }
    let flags = u32::from_le_bytes([image[48], image[49], image[50], image[51]]);
    Some(if image[8] >= 8 { (flags >> 8) & 0xff } else { flags & 0xff })
}

/// Compiles kernel file `name` for `arch` (`sm_90`) and returns what `kind`
/// asks for, without the cache.
pub fn compile_to(name: &str, arch: &str, kind: ImageKind) -> Result<Image, CudaError> {
    if !available() {
        return Err(CudaError::NoNvrtc);
    }
    use cudarc::nvrtc::{result, sys};
    let src = CString::new(source(name)?)
        .map_err(|_| CudaError::Kernel { name: name.into(), log: "NUL in source".into() })?;
    let file = CString::new(format!("{name}.cu")).expect("no NUL in a kernel name");
    let fail = |log: String| CudaError::Kernel { name: name.into(), log };
    let prog = result::create_program(&src, Some(&file)).map_err(|e| fail(format!("{e:?}")))?;
    let mut opts: Vec<String> = OPTIONS.iter().map(|s| s.to_string()).collect();
    opts.push(format!("--gpu-architecture={arch}"));
    // SAFETY: `prog` was just created from `src`, which outlives it, and is
    // destroyed once below; the cubin buffer has the size NVRTC reported.
    let out = unsafe {
        let compiled = result::compile_program(prog, &opts);
        let log = result::get_program_log(prog)
            .map(|l| CStr::from_ptr(l.as_ptr()).to_string_lossy().into_owned())
            .unwrap_or_default();
        let image = match (compiled, kind) {
            (Err(e), _) => Err(fail(format!("{e:?} for {arch}:\n{log}"))),
            (Ok(()), ImageKind::Ptx) => result::get_ptx(prog)
                .map(|p| Image::Ptx(CStr::from_ptr(p.as_ptr()).to_string_lossy().into_owned()))
                .map_err(|e| fail(format!("{e:?}"))),
            (Ok(()), ImageKind::Cubin) => {
                let mut size = 0usize;
                sys::nvrtcGetCUBINSize(prog, &mut size)
                    .result()
                    .and_then(|()| {
                        let mut buf = vec![0u8; size];
                        sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut std::ffi::c_char).result().map(|()| buf)
                    })
                    .map_err(|e| fail(format!("nvrtcGetCUBIN for {arch}: {e:?}")))
                    .and_then(|b| match size {
                        0 => Err(fail(format!("NVRTC made no cubin for {arch} (a virtual architecture?)"))),
                        _ => Ok(Image::Cubin(b)),
                    })
            }
        };
        let _ = result::destroy_program(prog);
        image
    };
    out
}

/// Compiles kernel file `name` to PTX for `arch` (`sm_90`), without the
/// cache: what the tests read entry points and instruction counts from.
pub fn compile(name: &str, arch: &str) -> Result<String, CudaError> {
    match compile_to(name, arch, ImageKind::Ptx)? {
        Image::Ptx(p) => Ok(p),
        Image::Cubin(_) => unreachable!("PTX was asked for"),
    }
}

/// The directory compiled kernels are cached in: `$STRATA_KERNEL_CACHE`, or
/// `$XDG_CACHE_HOME/strata/kernels`, or `~/.cache/strata/kernels`.
pub fn cache_dir() -> Option<PathBuf> {
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    env("STRATA_KERNEL_CACHE")
        .or_else(|| env("XDG_CACHE_HOME").map(|d| d.join("strata/kernels")))
        .or_else(|| env("HOME").map(|d| d.join(".cache/strata/kernels")))
}

/// The cache key of kernel file `name` for `arch` under NVRTC `version`, as `kind`.
pub fn cache_key(name: &str, arch: &str, version: (i32, i32), kind: ImageKind) -> Result<String, CudaError> {
    let text =
        format!("{}\0{arch}\0{}.{}\0{}\0{}", source(name)?, version.0, version.1, OPTIONS.join(" "), kind.name());
    Ok(format!("{name}-{arch}-{:016x}.{}", xxhash_rust::xxh3::xxh3_64(text.as_bytes()), kind.name()))
}

/// Kernel file `name` for `arch` as `kind`: from the cache in `dir` when a
/// whole entry with its key is there, else compiled and stored. A cache that
/// cannot be written is not an error (the kernel is compiled each run instead).
pub fn compile_cached(name: &str, arch: &str, dir: Option<&Path>, kind: ImageKind) -> Result<Image, CudaError> {
    let Some(dir) = dir else { return compile_to(name, arch, kind) };
    let path = dir.join(cache_key(name, arch, version()?, kind)?);
    if let Ok(bytes) = std::fs::read(&path) {
        let cached = match kind {
            ImageKind::Cubin => Some(Image::Cubin(bytes)),
            ImageKind::Ptx => String::from_utf8(bytes).ok().map(Image::Ptx),
        };
        if let Some(image) = cached.filter(Image::plausible) {
            return Ok(image);
        }
    }
    let image = compile_to(name, arch, kind)?;
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let stored = std::fs::create_dir_all(dir)
        .and_then(|_| std::fs::write(&tmp, image.bytes()))
        .and_then(|_| std::fs::rename(&tmp, &path));
    if let Err(e) = stored {
        let _ = std::fs::remove_file(&tmp);
        tracing::warn!("kernel cache {}: {e}; compiling each run", dir.display());
    }
    Ok(image)
}

/// Kernel file `name` for the device's `arch`, as the driver should load it:
/// a cubin, or (only when NVRTC cannot make one, say an architecture newer
/// than it knows) PTX for the driver's JIT, with a warning.
pub fn image_for(name: &str, arch: &str, dir: Option<&Path>) -> Result<Image, CudaError> {
    match compile_cached(name, arch, dir, ImageKind::Cubin) {
        Ok(image) => Ok(image),
        Err(cubin) => {
            let image = compile_cached(name, arch, dir, ImageKind::Ptx).map_err(|_| cubin.clone())?;
            tracing::warn!("{cubin}; loading PTX for the driver's JIT instead (slower to open, and a driver older than NVRTC refuses it)");
            Ok(image)
        }
    }
}
