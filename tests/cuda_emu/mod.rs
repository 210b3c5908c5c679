//! The CUDA kernels on the CPU (see `shim.h` for how this differs from a
//! GPU), and [`Emulated`]: a `Device` over host memory that launches them, so
//! the CUDA backend's own code runs in tests without a GPU. GEMMs are plain
//! loops with cuBLAS's column-major semantics (bf16 inputs read as bits, f32
//! accumulation); the all-reduce sums in rank order.
#![allow(dead_code)] // each test file uses part of it

use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use strata::backend::cuda::device::{
    grouped_takes, Arg, DevPtr, Device, Gemm, GemmPath, GemmType, Launch, StagedCopies,
};
use strata::backend::cuda::{kernels, nvrtc, CudaError};
use strata::parallel::AbortableBarrier;

const SHIM: &str = include_str!("shim.h");

/// A kernel file compiled for the CPU and loaded.
pub struct Lib(*mut c_void);
// SAFETY: the handle is only used to look up symbols; launches are serialised by LAUNCH.
unsafe impl Send for Lib {}
unsafe impl Sync for Lib {}

/// The shim's launch state is global: one launch at a time per process.
static LAUNCH: Mutex<()> = Mutex::new(());

/// Whether g++ is here; skips (with the reason) unless CI requires it.
pub fn gxx_or_skip(test: &str) -> bool {
    let ok = std::process::Command::new("g++").arg("--version").output().is_ok_and(|o| o.status.success());
    if !ok {
        assert!(std::env::var_os("STRATA_REQUIRE_NVRTC").is_none(), "CI runs the kernels on the CPU: g++ is missing");
        eprintln!("{test}: skipped: g++ not found (the CPU emulation of the kernels compiles them with it)");
    }
    ok
}

/// What g++ compiles for kernel file `name` of source `src` (as
/// `nvrtc::source` gives it): the shim, the source with dynamic shared
/// memory as the shim's buffer, and the entries build.rs generated from the
/// kernels' declarations.
pub fn emulation_source(name: &str, src: &str) -> String {
    let dynamic = regex::Regex::new(r"extern __shared__ (?:__align__\(\d+\) )?(\w+) (\w+)\[\];").unwrap();
    let src = dynamic.replace_all(src, "$1* $2 = ($1*)emu_smem;");
    let entries = kernels::EMULATOR_ENTRIES.iter().find(|(f, _)| *f == name).map_or("", |e| e.1);
    format!("{SHIM}\n#line 1 \"{name}.cu\"\n{src}\n{entries}")
}

/// Whether g++ accepts `text` (an [`emulation_source`]); its errors if not.
pub fn gxx_accepts(text: &str) -> Result<(), String> {
    let dir = tempfile::tempdir().unwrap();
    let cpp = dir.path().join("check.cpp");
    std::fs::write(&cpp, text).unwrap();
    let out = std::process::Command::new("g++")
        .args(["-std=c++20", "-fsyntax-only", "-DSTRATA_EMULATE", "-w"])
        .arg(&cpp)
        .output()
        .unwrap();
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// Kernel file `name` compiled with g++ after the shim, loaded once per process.
pub fn lib(name: &str) -> &'static Lib {
    static LIBS: OnceLock<Mutex<HashMap<String, &'static Lib>>> = OnceLock::new();
    let mut libs = LIBS.get_or_init(Default::default).lock().unwrap();
    if let Some(l) = libs.get(name) {
        return l;
    }
    let dir = std::env::temp_dir().join(format!("strata-emu-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (cpp, so) = (dir.join(format!("{name}.cpp")), dir.join(format!("{name}.so")));
    std::fs::write(&cpp, emulation_source(name, &nvrtc::source(name).unwrap())).unwrap();
    let out = std::process::Command::new("g++")
        .args(["-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-DSTRATA_EMULATE", "-w", "-o"])
        .arg(&so)
        .arg(&cpp)
        .output()
        .unwrap();
    assert!(out.status.success(), "g++ {name}: {}", String::from_utf8_lossy(&out.stderr));
    let path = CString::new(so.to_str().unwrap()).unwrap();
    // SAFETY: loading a library we just built.
    let h = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    assert!(!h.is_null(), "dlopen {name}");
    let l: &'static Lib = Box::leak(Box::new(Lib(h)));
    libs.insert(name.into(), l);
    l
}

impl Lib {
    /// The address of symbol `name`, if the library has it.
    pub fn find(&self, name: &str) -> Option<usize> {
        let c = CString::new(name).unwrap();
        // SAFETY: a symbol lookup in a live handle.
        let p = unsafe { libc::dlsym(self.0, c.as_ptr()) };
        (!p.is_null()).then_some(p as usize)
    }

    /// The address of symbol `name`.
    pub fn sym(&self, name: &str) -> usize {
        self.find(name).unwrap_or_else(|| panic!("no symbol {name}"))
    }

    /// Runs `call` as every thread of a `grid` of `block`-thread blocks.
    pub fn launch<F: Fn() + Sync>(&self, grid: (u32, u32), block: u32, call: F) {
        self.launch_smem(grid, block, 256 << 10, call)
    }

    /// [`Lib::launch`] with `smem` bytes of dynamic shared memory (NaN-filled
    /// before each block, so a read of a byte no thread wrote shows).
    pub fn launch_smem<F: Fn() + Sync>(&self, grid: (u32, u32), block: u32, smem: u32, call: F) {
        extern "C" fn tramp<F: Fn()>(p: *mut *mut c_void) {
            // SAFETY: `p` is the `&F` passed below, alive for the whole run.
            unsafe { (*(p as *const F))() }
        }
        self.run(grid, block, tramp::<F>, &call as *const F as *mut *mut c_void, smem);
    }

    /// Runs `call(params)` as every thread of the grid (the shim's `emu_run`).
    fn run(
        &self,
        grid: (u32, u32),
        block: u32,
        call: extern "C" fn(*mut *mut c_void),
        params: *mut *mut c_void,
        smem: u32,
    ) {
        type Run = unsafe extern "C" fn(u32, u32, u32, extern "C" fn(*mut *mut c_void), *mut *mut c_void, u32);
        let _one = LAUNCH.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the shim's entry point, with its C signature.
        let run: Run = unsafe { std::mem::transmute::<usize, Run>(self.sym("emu_run")) };
        unsafe { run(grid.0, grid.1, block, call, params, smem) };
    }
}

/// Host memory standing in for device memory (8-byte aligned).
pub struct Mem(Box<[u64]>);

/// The group an all-reduce runs over: each rank's buffer address, then the
/// sums. Its barrier can be aborted, as NCCL's communicators can.
struct Group {
    barrier: AbortableBarrier,
    slots: Mutex<Vec<(DevPtr, usize)>>,
}

/// Faults a test plants in an emulated device (and the group it opens).
#[derive(Debug, Default)]
pub struct Faults {
    /// Device memory left: an allocation beyond it fails as out of memory.
    pub memory: Option<AtomicUsize>,
    /// `(rank, kernel)`: that rank's launches of that kernel fail.
    pub kernel: Option<(usize, &'static str)>,
    /// `(rank, kernel)`: that rank panics when it launches that kernel.
    pub panic: Option<(usize, &'static str)>,
}

/// An emulated step's staged copies, taken off the device.
struct EmuTaken {
    parts: Vec<(Vec<u8>, u64)>,
    syncs: Arc<AtomicU64>,
}

impl StagedCopies for EmuTaken {
    fn collect(self: Box<Self>, f: &mut dyn FnMut(&[&[u8]])) -> Result<(), CudaError> {
        let now = self.syncs.load(Ordering::SeqCst);
        let early = self.parts.iter().filter(|(_, at)| *at >= now).count();
        if early > 0 {
            return Err(CudaError::Kernel {
                name: "collect (emulated)".into(),
                log: format!("{early} of {} staged copies read before a sync completed them", self.parts.len()),
            });
        }
        let parts: Vec<&[u8]> = self.parts.iter().map(|(v, _)| v.as_slice()).collect();
        f(&parts);
        Ok(())
    }
}

/// A CPU standing in for a GPU.
pub struct Emulated {
    rank: usize,
    world: usize,
    group: Option<Arc<Group>>,
    faults: Arc<Faults>,
    /// Captures staged since the last take, each with the count of syncs
    /// before it. The bytes are taken when staged (the emulation runs every
    /// op as it is issued, which is stream order), but, as on a GPU, they
    /// count as landed only once a later sync has completed them.
    staged: Mutex<Vec<(Vec<u8>, u64)>>,
    /// Syncs so far.
    syncs: Arc<AtomicU64>,
    /// Launches made, by kernel name (what the tests can assert was used);
    /// grouped GEMM calls count under `cublasGemmGroupedBatchedEx`.
    pub launches: Mutex<HashMap<String, usize>>,
    /// The experts' GEMM path: grouped (as cuBLAS 12.5+), unless a test asks for one GEMM each.
    path: GemmPath,
}

impl Default for Emulated {
    fn default() -> Self {
        Emulated::with_faults(Faults::default())
    }
}

impl Emulated {
    /// A device (and, through `group`, its peers) that fails as `faults` say.
    pub fn with_faults(faults: Faults) -> Self {
        Emulated {
            rank: 0,
            world: 1,
            group: None,
            faults: Arc::new(faults),
            staged: Mutex::new(Vec::new()),
            syncs: Arc::default(),
            launches: Mutex::new(HashMap::new()),
            path: GemmPath::Grouped,
        }
    }

    /// The same device, with its experts' GEMMs run one call each (a cuBLAS
    /// without grouped GEMMs, or one that refused the probe).
    pub fn per_expert(mut self) -> Self {
        self.path = GemmPath::PerExpert;
        self
    }

    /// How many times kernel (or cuBLAS call) `name` was launched.
    pub fn count(&self, name: &str) -> usize {
        self.launches.lock().unwrap().get(name).copied().unwrap_or(0)
    }
}

fn bf16_at(p: DevPtr, i: usize) -> f32 {
    // SAFETY: the backend checked the extents; reading one bf16 value.
    let bits = unsafe { *(p as *const u16).add(i) };
    f32::from_bits((bits as u32) << 16)
}

fn f32_at(p: DevPtr, i: usize) -> f32 {
    // SAFETY: as above, one f32 value.
    unsafe { *(p as *const f32).add(i) }
}

impl Device for Emulated {
    type Mem = Mem;

    fn memory(&self) -> Result<(usize, usize), CudaError> {
        // A planted memory budget is all there is; without one, plenty.
        let free = self.faults.memory.as_ref().map_or(1 << 50, |left| left.load(Ordering::Relaxed));
        Ok((free, free.max(1 << 50)))
    }

    fn alloc(&self, bytes: usize) -> Result<Mem, CudaError> {
        if let Some(left) = &self.faults.memory {
            if left.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |l| l.checked_sub(bytes)).is_err() {
                return Err(CudaError::Driver {
                    call: "cuMemAllocAsync".into(),
                    error: format!("CUDA_ERROR_OUT_OF_MEMORY ({bytes} bytes, emulated)"),
                });
            }
        }
        // NaN in every f32 and bf16 (all bits set): a read before a write shows.
        Ok(Mem(vec![u64::MAX; bytes.div_ceil(8).max(1)].into_boxed_slice()))
    }

    fn alloc_zeroed(&self, bytes: usize) -> Result<Mem, CudaError> {
        let mut m = self.alloc(bytes)?;
        m.0.fill(0);
        Ok(m)
    }

    fn ptr(&self, m: &Mem) -> DevPtr {
        m.0.as_ptr() as DevPtr
    }

    fn upload(&self, dst: DevPtr, src: &[u8]) -> Result<(), CudaError> {
        // SAFETY: `dst` is emulated device memory of at least `src.len()` bytes.
        unsafe { std::ptr::copy(src.as_ptr(), dst as *mut u8, src.len()) };
        Ok(())
    }

    fn download(&self, src: DevPtr, dst: &mut [u8]) -> Result<(), CudaError> {
        // SAFETY: as above.
        unsafe { std::ptr::copy(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    fn stage(&self, src: DevPtr, bytes: usize) -> Result<(), CudaError> {
        let mut v = vec![0u8; bytes];
        self.download(src, &mut v)?;
        let syncs = self.syncs.load(Ordering::SeqCst);
        self.staged.lock().unwrap().push((v, syncs));
        Ok(())
    }

    fn take_staged(&self) -> Result<Box<dyn StagedCopies>, CudaError> {
        let parts = std::mem::take(&mut *self.staged.lock().unwrap());
        Ok(Box::new(EmuTaken { parts, syncs: self.syncs.clone() }))
    }

    fn copy(&self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<(), CudaError> {
        // SAFETY: as above.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
        Ok(())
    }

    fn launch(&self, name: &str, cfg: Launch, args: &[Arg]) -> Result<(), CudaError> {
        *self.launches.lock().unwrap().entry(name.into()).or_default() += 1;
        if self.faults.panic.is_some_and(|(r, k)| r == self.rank && k == name) {
            panic!("planted panic on rank {} in {name}", self.rank);
        }
        if self.faults.kernel.is_some_and(|(r, k)| r == self.rank && k == name) {
            return Err(CudaError::Kernel { name: name.into(), log: format!("planted failure on rank {}", self.rank) });
        }
        if cfg.grid.0 == 0 || cfg.grid.1 == 0 {
            return Ok(());
        }
        let wrapper = format!("emu_call_{name}");
        let (l, f) = nvrtc::SOURCES
            .iter()
            .find_map(|(file, _)| {
                let l = lib(file);
                l.find(&wrapper).map(|f| (l, f))
            })
            .ok_or_else(|| CudaError::Kernel { name: name.into(), log: "no such kernel".into() })?;
        assert!(cfg.smem as usize <= 256 << 10, "{name}: {} bytes of shared memory exceed the emulation's", cfg.smem);
        // Parameters in 8-byte slots, as the driver passes them.
        let slots: Vec<u64> = args.iter().map(|a| a.slot()).collect();
        let mut params: Vec<*mut c_void> = slots.iter().map(|s| s as *const u64 as *mut c_void).collect();
        // SAFETY: the wrapper reads each parameter from its slot.
        let call: extern "C" fn(*mut *mut c_void) = unsafe { std::mem::transmute(f) };
        l.run(cfg.grid, cfg.block, call, params.as_mut_ptr(), cfg.smem);
        Ok(())
    }

    fn gemm(&self, g: &Gemm) -> Result<(), CudaError> {
        // Column-major: element (i, j) of a matrix with leading dim ld is at i + j·ld;
        // op(A)(i, p) = A(p, i) when transposed.
        let read = |m: (DevPtr, GemmType, usize), t: bool, i: usize, j: usize| {
            let idx = if t { j + i * m.2 } else { i + j * m.2 };
            match m.1 {
                GemmType::F32 => f32_at(m.0, idx),
                GemmType::Bf16 => bf16_at(m.0, idx),
            }
        };
        for j in 0..g.n {
            for i in 0..g.m {
                let mut acc = 0f32;
                for p in 0..g.k {
                    acc += read(g.a, g.trans_a, i, p) * read(g.b, g.trans_b, p, j);
                }
                let at = i + j * g.c.1;
                // SAFETY: C holds m × n at leading dim ldc (checked by the backend).
                unsafe {
                    match g.c_type {
                        GemmType::F32 => {
                            let c = (g.c.0 as *mut f32).add(at);
                            *c = if g.beta == 0.0 { g.alpha * acc } else { g.alpha * acc + g.beta * *c };
                        }
                        GemmType::Bf16 => {
                            let c = (g.c.0 as *mut u16).add(at);
                            let old = f32::from_bits((*c as u32) << 16);
                            let v = if g.beta == 0.0 { g.alpha * acc } else { g.alpha * acc + g.beta * old };
                            *c = half::bf16::from_f32(v).to_bits();
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// As cuBLAS: one grouped call where the path and the types allow (the
    /// same loops, so the same results; a GPU's may differ in the last bits),
    /// else one GEMM each. Every GEMM of a call must be of one type combination.
    fn gemm_grouped(&self, gs: &[Gemm]) -> Result<(), CudaError> {
        let gs: Vec<&Gemm> = gs.iter().filter(|g| g.m > 0 && g.n > 0).collect();
        let one_type = gs.windows(2).all(|w| (w[0].a.1, w[0].b.1, w[0].c_type) == (w[1].a.1, w[1].b.1, w[1].c_type));
        assert!(one_type, "a grouped GEMM call mixes type combinations");
        if gs.len() >= 2 && self.path == GemmPath::Grouped && grouped_takes(gs[0]) {
            *self.launches.lock().unwrap().entry("cublasGemmGroupedBatchedEx".into()).or_default() += 1;
        }
        gs.iter().try_for_each(|g| self.gemm(g))
    }

    fn gemm_path(&self) -> GemmPath {
        self.path
    }

    fn all_reduce(&self, ptr: DevPtr, count: usize) -> Result<(), CudaError> {
        let Some(g) = &self.group else { return Ok(()) };
        let aborted = |e: strata::parallel::Aborted| CudaError::Driver {
            call: "ncclAllReduce (emulated)".into(),
            error: e.to_string(),
        };
        g.slots.lock().unwrap()[self.rank] = (ptr, count);
        g.barrier.wait().map_err(aborted)?;
        // Every rank sums every rank's buffer in rank order, then all write.
        let slots = g.slots.lock().unwrap().clone();
        let sum: Vec<f32> = (0..count).map(|i| slots.iter().map(|&(p, _)| f32_at(p, i)).sum()).collect();
        g.barrier.wait().map_err(aborted)?;
        // SAFETY: this rank's own buffer of `count` f32.
        unsafe { std::ptr::copy(sum.as_ptr(), ptr as *mut f32, count) };
        g.barrier.wait().map_err(aborted)?;
        Ok(())
    }

    fn sync(&self) -> Result<(), CudaError> {
        self.syncs.fetch_add(1, Ordering::SeqCst);
        match self.group.as_ref().and_then(|g| g.barrier.aborted()) {
            Some(why) => Err(CudaError::Driver { call: "cuStreamSynchronize (emulated)".into(), error: why }),
            None => Ok(()),
        }
    }

    fn abort(&self, why: &str) {
        if let Some(g) = &self.group {
            g.barrier.abort(why);
        }
    }

    fn rank(&self) -> (usize, usize) {
        (self.rank, self.world)
    }

    fn group(&self, ordinals: &[usize]) -> Result<Vec<Emulated>, CudaError> {
        let n = ordinals.len();
        let g = Arc::new(Group { barrier: AbortableBarrier::new(n), slots: Mutex::new(vec![(0, 0); n]) });
        Ok((0..n)
            .map(|rank| Emulated {
                rank,
                world: n,
                group: (n > 1).then(|| g.clone()),
                faults: self.faults.clone(),
                staged: Mutex::new(Vec::new()),
                syncs: Arc::default(),
                launches: Mutex::new(HashMap::new()),
                path: self.path,
            })
            .collect())
    }
}
