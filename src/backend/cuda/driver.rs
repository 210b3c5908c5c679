//! [`Device`] on a real GPU, through cudarc's dynamically loaded driver,
//! cuBLAS and NCCL. One context and one stream per GPU; every kernel of
//! `kernels/` is compiled (or read from the cache) when the device opens.
//!
//! Never run in CI (no GPU there), nor yet on any GPU.

use super::device::{grouped_takes, Arg, DevPtr, Device, Gemm, GemmPath, GemmType, Launch, StagedCopies};
use super::{nvrtc, probe, CudaError};
use cudarc::cublas::sys as blas;
use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaFunction, CudaModule, CudaStream};
use cudarc::nccl::sys as nccl;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

fn driver_err(call: &str, e: impl std::fmt::Debug) -> CudaError {
    CudaError::Driver { call: call.into(), error: format!("{e:?}") }
}

/// A raw handle used from one rank's thread at a time (the backend's ops
/// are issued in order by that thread).
struct Handle<T>(T);
// SAFETY: cuBLAS handles and NCCL communicators may be used from any thread
// as long as calls on one handle do not overlap, which the mutex around each
// guarantees.
unsafe impl<T> Send for Handle<T> {}
unsafe impl<T> Sync for Handle<T> {}

/// One GPU, as one tensor-parallel rank.
pub struct Driver {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    modules: Vec<Arc<CudaModule>>,
    functions: Mutex<HashMap<String, (CudaFunction, u32)>>,
    blas: Mutex<Handle<blas::cublasHandle_t>>,
    /// The NCCL group this rank belongs to (none for one rank).
    group: Option<Arc<NcclGroup>>,
    /// Pinned host buffers that captures are copied into; reused step to step.
    staging: Arc<Mutex<Staging<Pinned, CudaEvent>>>,
    /// Pinned host memory small uploads go through; reset at each stream sync.
    uploads: Mutex<Arena>,
    /// The experts' GEMM path, probed at open, and the device array of the
    /// grouped call's pointers.
    path: GemmPath,
    grouped_ptrs: Mutex<Option<(Mem, usize)>>,
    rank: usize,
    world: usize,
    /// The GPU's index, name and architecture.
    pub info: probe::DeviceInfo,
    /// How the kernels were loaded: cubins, unless one fell back to PTX.
    pub image: nvrtc::ImageKind,
}

/// The communicators of one NCCL group, one per rank, shared by its ranks
/// so that any rank can abort them all.
struct NcclGroup {
    /// Each rank's communicator; `None` once aborted (or destroyed).
    comms: Vec<Mutex<Option<Handle<nccl::ncclComm_t>>>>,
    /// Why the group was aborted, if it was.
    aborted: Mutex<Option<String>>,
}

impl NcclGroup {
    fn aborted(&self) -> Option<String> {
        self.aborted.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// How long a teardown waits for the stream before it gives up and leaks
/// the memory queued work may still touch (a hung peer must not hang the exit).
const TEARDOWN_DEADLINE: std::time::Duration = std::time::Duration::from_secs(30);
/// How long a sync in an aborted group waits for the stream to drain (the
/// aborted NCCL kernels exit) before it returns anyway.
const ABORT_DRAIN: std::time::Duration = std::time::Duration::from_secs(10);

/// NCCL's algorithm and protocol, fixed so that sums are the same bits run
/// to run. NCCL reads them from the environment at communicator creation;
/// setting the environment while other threads run is a data race, so the
/// `strata` binary calls this first thing in `main`, before any thread
/// starts. A variable the user set is kept.
pub fn set_nccl_env() {
    for (k, v) in NCCL_ENV {
        if std::env::var_os(k).is_none() {
            // SAFETY (edition 2021: a safe fn): called from `main` before any other thread exists.
            std::env::set_var(k, v);
        }
    }
}

const NCCL_ENV: [(&str, &str); 2] = [("NCCL_ALGO", "Ring"), ("NCCL_PROTO", "Simple")];

/// Device memory, allocated and freed in stream order, so a buffer dropped
/// while queued kernels still read it is freed after them.
pub struct Mem {
    ptr: sys::CUdeviceptr,
    stream: Arc<CudaStream>,
}

impl Drop for Mem {
    fn drop(&mut self) {
        // A failed free at drop has no caller to tell; the context is torn down with the process.
        if self.stream.context().bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from cuMemAllocAsync on this stream and is freed once, in stream order.
            let _ = unsafe { result::free_async(self.ptr, self.stream.cu_stream()) };
        }
    }
}

/// Page-locked host memory (`cuMemHostAlloc`): the copy engine writes it
/// directly, without the driver's bounce buffer, and without holding the
/// host thread.
struct Pinned {
    ptr: *mut u8,
    cap: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: plain host memory; the pool's mutex serialises its users.
unsafe impl Send for Pinned {}

impl Drop for Pinned {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by cuMemHostAlloc in this context, freed once, after the copies into it (collect waits).
            let _ = unsafe { result::free_host(self.ptr as *mut c_void) };
        }
    }
}

impl Pinned {
    fn new(bytes: usize, ctx: &Arc<CudaContext>) -> Result<Pinned, CudaError> {
        // SAFETY: a plain page-locked allocation in this context.
        let ptr = unsafe { result::malloc_host(bytes.max(1), 0) }
            .map_err(|e| driver_err(&format!("cuMemHostAlloc({bytes} bytes)"), e))?;
        Ok(Pinned { ptr: ptr as *mut u8, cap: bytes.max(1), ctx: ctx.clone() })
    }
}

/// Where one staged capture lies until it is collected.
enum Staged<P> {
    /// The first `bytes` of a pinned buffer.
    Pinned(P, usize),
    /// Pageable memory, copied synchronously: the fallback when no pinned
    /// memory could be allocated.
    Owned(Vec<u8>),
}

impl Staged<Pinned> {
    /// The staged bytes. The caller has waited for the copy into them.
    fn bytes(&self) -> &[u8] {
        match self {
            // SAFETY: the buffer holds at least `n` bytes, which the copy has written.
            Staged::Pinned(p, n) => unsafe { std::slice::from_raw_parts(p.ptr as *const u8, *n) },
            Staged::Owned(v) => v,
        }
    }
}

/// A staging buffer's capacity, for the pool's choice.
trait Capacity {
    fn capacity(&self) -> usize;
}

impl Capacity for Pinned {
    fn capacity(&self) -> usize {
        self.cap
    }
}

/// The capacity of a new staging buffer for `bytes`: the next rung of a
/// ladder of quarter steps between powers of two (2ⁿ × 1, 1.25, 1.5, 1.75),
/// so a run whose steps grow re-pins a few times (once per rung crossed,
/// each at most 25% over the need), not at every growth: pinning costs
/// milliseconds per hundred MiB.
fn staging_capacity(bytes: usize) -> usize {
    if bytes <= 4096 {
        return 4096;
    }
    let rung = bytes.next_power_of_two() / 8;
    bytes.div_ceil(rung) * rung
}

/// The staging pool: free buffers, this step's captures (in order), and
/// the buffers of dropped steps whose copies may still be landing. A step's
/// captures leave the pool when taken and come back when read, so it
/// settles at one buffer per capture point for each step in flight: two in
/// `extract` (one step's being read on the host while the next step's are
/// copied), three in `serve` (whose writer queue holds one more step).
/// `M` marks when a dropped step's copies are done (a CUDA event).
struct Staging<P, M> {
    free: Vec<P>,
    used: Vec<Staged<P>>,
    deferred: Vec<(M, Vec<Staged<P>>)>,
}

impl<P, M> Default for Staging<P, M> {
    fn default() -> Self {
        Staging { free: Vec::new(), used: Vec::new(), deferred: Vec::new() }
    }
}

impl<P: Capacity, M> Staging<P, M> {
    /// The smallest free buffer of at least `bytes`; if none, the free ones
    /// too small are dropped (a step's captures are all [T, H], the same
    /// sizes step after step) and `None` says to allocate one.
    fn take_free(&mut self, bytes: usize) -> Option<P> {
        let fit =
            (0..self.free.len()).filter(|&i| self.free[i].capacity() >= bytes).min_by_key(|&i| self.free[i].capacity());
        match fit {
            Some(i) => Some(self.free.swap_remove(i)),
            None => {
                self.free.retain(|p| p.capacity() >= bytes);
                None
            }
        }
    }

    /// Buffers back into the free list.
    fn give_back(&mut self, parts: Vec<Staged<P>>) {
        self.free.extend(parts.into_iter().filter_map(|part| match part {
            Staged::Pinned(p, _) => Some(p),
            Staged::Owned(_) => None,
        }));
    }

    /// Frees the deferred steps whose copies `done` says have landed.
    fn reclaim(&mut self, done: impl Fn(&M) -> bool) {
        let (ready, waiting): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.deferred).into_iter().partition(|(m, _)| done(m));
        self.deferred = waiting;
        for (_, parts) in ready {
            self.give_back(parts);
        }
    }
}

/// A step's staged captures, taken off the pool ([`Device::take_staged`]).
struct Taken {
    parts: Vec<Staged<Pinned>>,
    /// Recorded after the last copy into `parts`.
    done: Option<CudaEvent>,
    pool: Arc<Mutex<Staging<Pinned, CudaEvent>>>,
    /// Whether `done` was waited for: the buffers may be reused.
    landed: bool,
}

impl StagedCopies for Taken {
    fn collect(mut self: Box<Self>, f: &mut dyn FnMut(&[&[u8]])) -> Result<(), CudaError> {
        let done = self.done.as_ref().expect("set until drop");
        done.synchronize().map_err(|e| driver_err("cuEventSynchronize (captures)", e))?;
        self.landed = true;
        let parts: Vec<&[u8]> = self.parts.iter().map(Staged::bytes).collect();
        f(&parts);
        Ok(())
    }
}

impl Drop for Taken {
    fn drop(&mut self) {
        let done = self.done.take().expect("set until drop");
        let parts = std::mem::take(&mut self.parts);
        let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        if self.landed || (done.context().bind_to_thread().is_ok() && done.is_complete()) {
            pool.give_back(parts);
        } else {
            // A copy may still write them (a step dropped before its sync):
            // reused only once the event says the copies have landed.
            pool.deferred.push((done, parts));
        }
    }
}

/// Pinned chunks that small uploads are copied through, so that
/// `cuMemcpyHtoDAsync` is asynchronous by definition (from pageable memory
/// CUDA only says it "might be synchronous"). A chunk's bytes may be
/// rewritten only once the stream has passed the copies out of it, so the
/// arena is reset only after a stream sync.
#[derive(Default)]
struct Arena {
    chunks: Vec<Pinned>,
    /// The chunk being filled, and how far.
    at: (usize, usize),
}

/// Uploads up to this size go through the pinned arena; larger ones (weights
/// at load) are copied from pageable memory and waited for.
const SMALL_UPLOAD: usize = 1 << 20;
/// Each arena chunk.
const ARENA_CHUNK: usize = 4 << 20;

impl Driver {
    /// Opens GPU `ordinal`: its context, a stream, cuBLAS, and every kernel
    /// (compiled for its architecture, or read from the kernel cache).
    pub fn open(ordinal: usize) -> Result<Driver, CudaError> {
        let info = probe::probe(&[ordinal])?.remove(0);
        if info.capability.0 < 8 {
            return Err(CudaError::Driver {
                call: format!("GPU {ordinal} ({})", info.name),
                error: format!(
                    "compute capability {}.{}: the CUDA backend needs 8.0 or newer (bf16 tensor cores: A100, H100, H200, ...)",
                    info.capability.0, info.capability.1
                ),
            });
        }
        // SAFETY: only dlopen attempts.
        if !unsafe { blas::is_culib_present() } {
            return Err(CudaError::Driver {
                call: "cuBLAS".into(),
                error: "libcublas.so could not be loaded: install the CUDA runtime libraries (or the PyPI package nvidia-cublas) and put them on LD_LIBRARY_PATH".into(),
            });
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| driver_err("cuCtxCreate", e))?;
        let stream = ctx.new_stream().map_err(|e| driver_err("cuStreamCreate", e))?;
        keep_freed_memory(&ctx, ordinal)?;
        let dir = nvrtc::cache_dir();
        let mut modules = Vec::new();
        let mut image_kind = nvrtc::ImageKind::Cubin;
        for (name, _) in nvrtc::SOURCES {
            let load = |image: nvrtc::Image| {
                let ptx = match image {
                    nvrtc::Image::Cubin(b) => cudarc::nvrtc::Ptx::from_binary(b),
                    nvrtc::Image::Ptx(p) => cudarc::nvrtc::Ptx::from_src(p),
                };
                ctx.load_module(ptx)
            };
            let image = nvrtc::image_for(name, &info.arch(), dir.as_deref())?;
            let kind = image.kind();
            let module = match (load(image), kind) {
                (Ok(m), _) => m,
                (Err(e), nvrtc::ImageKind::Cubin) => {
                    // A cubin the driver refuses (from an NVRTC of a newer
                    // major version, say): the PTX, for its JIT, is the last try.
                    tracing::warn!("kernel {name}: the driver refused the cubin ({e:?}); trying PTX");
                    let ptx = nvrtc::compile_cached(name, &info.arch(), dir.as_deref(), nvrtc::ImageKind::Ptx)?;
                    image_kind = nvrtc::ImageKind::Ptx;
                    load(ptx).map_err(|e2| CudaError::Kernel {
                        name: (*name).into(),
                        log: format!("cuModuleLoadData: cubin {e:?}, PTX {e2:?}"),
                    })?
                }
                (Err(e), nvrtc::ImageKind::Ptx) => {
                    return Err(CudaError::Kernel {
                        name: (*name).into(),
                        log: format!("cuModuleLoadData (PTX): {e:?}"),
                    })
                }
            };
            if kind == nvrtc::ImageKind::Ptx {
                image_kind = nvrtc::ImageKind::Ptx;
            }
            modules.push(module);
        }
        let handle = cudarc::cublas::result::create_handle().map_err(|e| driver_err("cublasCreate", e))?;
        // Grouped GEMMs arrived in cuBLAS 12.5 (cudarc panics on a missing symbol, so ask first).
        let mut version = 0;
        // SAFETY: a live handle; `version` is a live local.
        let grouped = unsafe { blas::cublasGetVersion_v2(handle, &mut version) }.result().is_ok() && version >= 120500;
        let path = if grouped { GemmPath::Grouped } else { GemmPath::PerExpert };
        // SAFETY: a live handle and stream of this context.
        unsafe {
            cudarc::cublas::result::set_stream(handle, stream.cu_stream() as blas::cudaStream_t)
                .map_err(|e| driver_err("cublasSetStream", e))?;
        }
        let mut d = Driver {
            ctx,
            stream,
            modules,
            functions: Mutex::new(HashMap::new()),
            blas: Mutex::new(Handle(handle)),
            group: None,
            staging: Arc::default(),
            uploads: Mutex::new(Arena::default()),
            path,
            grouped_ptrs: Mutex::new(None),
            rank: 0,
            world: 1,
            info,
            image: image_kind,
        };
        if d.path == GemmPath::Grouped {
            d.path = d.probe_grouped();
        }
        Ok(d)
    }

    /// Runs one small grouped bf16 GEMM (two 16×16×16 products of ones) and
    /// checks its result: the grouped path if cuBLAS takes it and gets it
    /// right, else one GEMM per expert, with a warning saying why.
    fn probe_grouped(&self) -> GemmPath {
        let run = || -> Result<bool, CudaError> {
            const N: usize = 16;
            let one = vec![0x3f80u16; N * N]; // bf16 1.0
            let a = self.alloc(N * N * 2)?;
            let b = self.alloc(N * N * 2)?;
            let c = self.alloc(2 * N * N * 2)?;
            self.upload(a.ptr, bytemuck::cast_slice(&one))?;
            self.upload(b.ptr, bytemuck::cast_slice(&one))?;
            let g = |i: usize| Gemm {
                c_type: GemmType::Bf16,
                ..Gemm::linear(
                    (a.ptr, GemmType::Bf16),
                    (b.ptr, GemmType::Bf16),
                    c.ptr + (i * N * N * 2) as u64,
                    N,
                    N,
                    N,
                    false,
                )
            };
            self.grouped_call(&[&g(0), &g(1)])?;
            let mut out = vec![0u16; 2 * N * N];
            self.download(c.ptr, bytemuck::cast_slice_mut(&mut out))?;
            Ok(out.iter().all(|&v| v == 0x4180)) // bf16 16.0
        };
        match run() {
            Ok(true) => GemmPath::Grouped,
            Ok(false) => {
                tracing::warn!(
                    "cuda: cublasGemmGroupedBatchedEx gave wrong sums in its probe: experts run one GEMM each"
                );
                GemmPath::PerExpert
            }
            Err(e) => {
                tracing::warn!("cuda: cublasGemmGroupedBatchedEx refused its probe ({e}): experts run one GEMM each");
                GemmPath::PerExpert
            }
        }
    }

    /// One `cublasGemmGroupedBatchedEx` over `gs` (one group per GEMM), all
    /// of one type combination that [`grouped_takes`] allows.
    fn grouped_call(&self, gs: &[&Gemm]) -> Result<(), CudaError> {
        self.bind()?;
        let n = gs.len();
        let dim = |v: usize| {
            i32::try_from(v).map_err(|_| driver_err("cublasGemmGroupedBatchedEx", format!("dimension {v} exceeds int")))
        };
        // The A, B and C pointers, in device memory as cuBLAS reads them.
        let ptrs: Vec<u64> =
            gs.iter().map(|g| g.a.0).chain(gs.iter().map(|g| g.b.0)).chain(gs.iter().map(|g| g.c.0)).collect();
        let table = {
            let mut t = self.grouped_ptrs.lock().unwrap_or_else(|e| e.into_inner());
            if t.as_ref().is_none_or(|(_, cap)| *cap < ptrs.len()) {
                *t = None; // freed in stream order, after the calls that read it
                let bytes = ptrs.len().next_power_of_two() * 8;
                *t = Some((self.alloc(bytes)?, bytes / 8));
            }
            t.as_ref().expect("made above").0.ptr
        };
        self.upload(table, bytemuck::cast_slice(&ptrs))?;
        let op = |t| if t { blas::cublasOperation_t::CUBLAS_OP_T } else { blas::cublasOperation_t::CUBLAS_OP_N };
        let ta: Vec<_> = gs.iter().map(|g| op(g.trans_a)).collect();
        let tb: Vec<_> = gs.iter().map(|g| op(g.trans_b)).collect();
        let col = |f: &dyn Fn(&Gemm) -> usize| gs.iter().map(|g| dim(f(g))).collect::<Result<Vec<i32>, _>>();
        let (m, nn, k) = (col(&|g| g.m)?, col(&|g| g.n)?, col(&|g| g.k)?);
        let (lda, ldb, ldc) = (col(&|g| g.a.2)?, col(&|g| g.b.2)?, col(&|g| g.c.1)?);
        let alpha: Vec<f32> = gs.iter().map(|g| g.alpha).collect();
        let beta: Vec<f32> = gs.iter().map(|g| g.beta).collect();
        let sizes = vec![1i32; n];
        let h = self.blas.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: one group per GEMM (`sizes`), every host array of length
        // `n`; the device table holds the n A, then B, then C pointers, each
        // to the extents its sizes and leading dimension name (checked by the
        // backend), and is read in stream order after its upload.
        let status = unsafe {
            blas::cublasGemmGroupedBatchedEx(
                h.0,
                ta.as_ptr(),
                tb.as_ptr(),
                m.as_ptr(),
                nn.as_ptr(),
                k.as_ptr(),
                alpha.as_ptr() as *const c_void,
                table as *const *const c_void,
                data_type(gs[0].a.1),
                lda.as_ptr(),
                (table + 8 * n as u64) as *const *const c_void,
                data_type(gs[0].b.1),
                ldb.as_ptr(),
                beta.as_ptr() as *const c_void,
                (table + 16 * n as u64) as *const *mut c_void,
                data_type(gs[0].c_type),
                ldc.as_ptr(),
                n as i32,
                sizes.as_ptr(),
                blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            )
        };
        status.result().map_err(|e| driver_err("cublasGemmGroupedBatchedEx", e))
    }

    fn function(&self, name: &str, smem: u32) -> Result<CudaFunction, CudaError> {
        let mut fns = self.functions.lock().unwrap_or_else(|e| e.into_inner());
        if !fns.contains_key(name) {
            let f = self
                .modules
                .iter()
                .find_map(|m| m.load_function(name).ok())
                .ok_or_else(|| CudaError::Kernel { name: name.into(), log: "no such kernel in kernels/".into() })?;
            fns.insert(name.into(), (f, 48 << 10));
        }
        let (f, limit) = fns.get_mut(name).expect("inserted above");
        if smem > *limit {
            // Above 48 KiB of dynamic shared memory a kernel must opt in.
            f.set_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
                .map_err(|e| driver_err(&format!("cuFuncSetAttribute({name})"), e))?;
            *limit = smem;
        }
        Ok(f.clone())
    }

    fn bind(&self) -> Result<(), CudaError> {
        self.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))
    }
}

fn data_type(t: GemmType) -> blas::cudaDataType {
    match t {
        GemmType::F32 => blas::cudaDataType::CUDA_R_32F,
        GemmType::Bf16 => blas::cudaDataType::CUDA_R_16BF,
    }
}

impl Device for Driver {
    type Mem = Mem;

    fn alloc(&self, bytes: usize) -> Result<Mem, CudaError> {
        self.bind()?;
        // SAFETY: allocation in stream order on this context's stream.
        unsafe {
            let ptr = result::malloc_async(self.stream.cu_stream(), bytes.max(1))
                .map_err(|e| driver_err(&format!("cuMemAllocAsync({bytes} bytes)"), e))?;
            Ok(Mem { ptr, stream: self.stream.clone() })
        }
    }

    fn memory(&self) -> Result<(usize, usize), CudaError> {
        self.bind()?;
        result::mem_get_info().map_err(|e| driver_err("cuMemGetInfo", e))
    }

    fn alloc_zeroed(&self, bytes: usize) -> Result<Mem, CudaError> {
        let mem = self.alloc(bytes)?;
        // SAFETY: `mem` holds `bytes.max(1)` bytes; the memset is in stream order before any use.
        unsafe { result::memset_d8_async(mem.ptr, 0, bytes.max(1), self.stream.cu_stream()) }
            .map_err(|e| driver_err("cuMemsetD8Async", e))?;
        Ok(mem)
    }

    fn ptr(&self, m: &Mem) -> DevPtr {
        m.ptr
    }

    fn upload(&self, dst: DevPtr, src: &[u8]) -> Result<(), CudaError> {
        self.bind()?;
        if src.len() > SMALL_UPLOAD {
            // SAFETY: `dst` holds `src.len()` bytes (the backend checks sizes
            // before copying); the stream is synchronised before return, so
            // `src` may be reused.
            unsafe {
                result::memcpy_htod_async(dst, src, self.stream.cu_stream())
                    .map_err(|e| driver_err("cuMemcpyHtoDAsync", e))?;
            }
            return self.sync();
        }
        let mut arena = self.uploads.lock().unwrap_or_else(|e| e.into_inner());
        let (mut chunk, mut at) = arena.at;
        if chunk < arena.chunks.len() && at + src.len() > ARENA_CHUNK {
            (chunk, at) = (chunk + 1, 0);
        }
        if chunk == arena.chunks.len() {
            arena.chunks.push(Pinned::new(ARENA_CHUNK, &self.ctx)?);
        }
        arena.at = (chunk, at + src.len().next_multiple_of(256));
        let host = arena.chunks[chunk].ptr.wrapping_add(at);
        // SAFETY: `host` has `src.len()` bytes left in a pinned chunk that no
        // queued copy reads (the arena moves forward until a sync); `dst`
        // holds `src.len()` bytes. The copy is queued in stream order, and
        // `src` is no longer needed once copied into the chunk.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), host, src.len());
            let staged = std::slice::from_raw_parts(host as *const u8, src.len());
            result::memcpy_htod_async(dst, staged, self.stream.cu_stream())
                .map_err(|e| driver_err("cuMemcpyHtoDAsync", e))
        }
    }

    fn download(&self, src: DevPtr, dst: &mut [u8]) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: `src` holds `dst.len()` bytes; the stream is synchronised before return.
        unsafe {
            result::memcpy_dtoh_async(dst, src, self.stream.cu_stream())
                .map_err(|e| driver_err("cuMemcpyDtoHAsync", e))?;
        }
        self.sync()
    }

    fn stage(&self, src: DevPtr, bytes: usize) -> Result<(), CudaError> {
        self.bind()?;
        let mut st = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        st.reclaim(|done| done.is_complete());
        let buf = match st.take_free(bytes) {
            Some(p) => p,
            None => match Pinned::new(staging_capacity(bytes), &self.ctx) {
                Ok(p) => p,
                Err(e) => {
                    // No page-locked memory left: copy this one the slow way.
                    tracing::warn!("cuda: capture staged through pageable memory: {e}");
                    let mut v = vec![0u8; bytes];
                    drop(st);
                    self.download(src, &mut v)?;
                    self.staging.lock().unwrap_or_else(|e| e.into_inner()).used.push(Staged::Owned(v));
                    return Ok(());
                }
            },
        };
        // SAFETY: `buf` is pinned host memory of at least `bytes`, untouched by
        // the host until its collection has waited for the copy; `src` holds
        // `bytes` (the backend checks sizes before staging).
        let copied = unsafe {
            let dst = std::slice::from_raw_parts_mut(buf.ptr, bytes);
            result::memcpy_dtoh_async(dst, src, self.stream.cu_stream())
        };
        // Queued or not, the buffer goes into `used`: a failed copy's buffer
        // is never reused before the stream passed it.
        st.used.push(Staged::Pinned(buf, bytes));
        copied.map_err(|e| driver_err("cuMemcpyDtoHAsync (capture)", e))
    }

    fn take_staged(&self) -> Result<Box<dyn StagedCopies>, CudaError> {
        // Taken first: whatever happens, this step's copies are not the next step's.
        let parts = std::mem::take(&mut self.staging.lock().unwrap_or_else(|e| e.into_inner()).used);
        let done = self
            .bind()
            .and_then(|()| self.stream.record_event(None).map_err(|e| driver_err("cuEventRecord (captures)", e)));
        match done {
            Ok(done) => Ok(Box::new(Taken { parts, done: Some(done), pool: self.staging.clone(), landed: false })),
            Err(e) => {
                // Nothing says when their copies land: never reuse them.
                std::mem::forget(parts);
                Err(e)
            }
        }
    }

    fn copy(&self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<(), CudaError> {
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: both ranges are device memory of at least `bytes`.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }
            .map_err(|e| driver_err("cuMemcpyDtoDAsync", e))
    }

    fn launch(&self, name: &str, cfg: Launch, args: &[Arg]) -> Result<(), CudaError> {
        if cfg.grid.0 == 0 || cfg.grid.1 == 0 {
            return Ok(()); // nothing to do (an empty batch)
        }
        self.bind()?;
        let f = self.function(name, cfg.smem)?;
        // Each parameter's value in an 8-byte slot; cuLaunchKernel reads the
        // parameter's own size from the start of its slot (little-endian).
        let mut slots: Vec<u64> = args.iter().map(|a| a.slot()).collect();
        let mut params: Vec<*mut c_void> = slots.iter_mut().map(|s| s as *mut u64 as *mut c_void).collect();
        // SAFETY: the function takes exactly these parameters in this order
        // (each op's wrapper in the backend is written against its kernel).
        unsafe {
            result::launch_kernel(
                f.cu_function(),
                (cfg.grid.0, cfg.grid.1, 1),
                (cfg.block, 1, 1),
                cfg.smem,
                self.stream.cu_stream(),
                &mut params,
            )
        }
        .map_err(|e| driver_err(&format!("launch {name}"), e))
    }

    fn gemm(&self, g: &Gemm) -> Result<(), CudaError> {
        if g.m == 0 || g.n == 0 {
            return Ok(());
        }
        self.bind()?;
        let h = self.blas.lock().unwrap_or_else(|e| e.into_inner());
        let op = |t| if t { blas::cublasOperation_t::CUBLAS_OP_T } else { blas::cublasOperation_t::CUBLAS_OP_N };
        // f32 inputs: pedantic f32 compute (no TF32 behind the exact path's back).
        let compute = if g.pedantic() {
            blas::cublasComputeType_t::CUBLAS_COMPUTE_32F_PEDANTIC
        } else {
            blas::cublasComputeType_t::CUBLAS_COMPUTE_32F
        };
        let dim =
            |v: usize| i32::try_from(v).map_err(|_| driver_err("cublasGemmEx", format!("dimension {v} exceeds int")));
        // SAFETY: A, B and C hold the extents the sizes and leading dimensions
        // name (checked by the backend before it issues the GEMM).
        unsafe {
            cudarc::cublas::result::gemm_ex(
                h.0,
                op(g.trans_a),
                op(g.trans_b),
                dim(g.m)?,
                dim(g.n)?,
                dim(g.k)?,
                &g.alpha as *const f32 as *const c_void,
                g.a.0 as *const c_void,
                data_type(g.a.1),
                dim(g.a.2)?,
                g.b.0 as *const c_void,
                data_type(g.b.1),
                dim(g.b.2)?,
                &g.beta as *const f32 as *const c_void,
                g.c.0 as *mut c_void,
                data_type(g.c_type),
                dim(g.c.1)?,
                compute,
                blas::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
            )
        }
        .map_err(|e| driver_err("cublasGemmEx", e))
    }

    fn gemm_grouped(&self, gs: &[Gemm]) -> Result<(), CudaError> {
        let gs: Vec<&Gemm> = gs.iter().filter(|g| g.m > 0 && g.n > 0).collect();
        let one_type = gs.windows(2).all(|w| (w[0].a.1, w[0].b.1, w[0].c_type) == (w[1].a.1, w[1].b.1, w[1].c_type));
        if gs.len() < 2 || !one_type || self.path != GemmPath::Grouped || !grouped_takes(gs[0]) {
            return gs.iter().try_for_each(|g| self.gemm(g));
        }
        self.grouped_call(&gs)
    }

    fn gemm_path(&self) -> GemmPath {
        self.path
    }

    fn all_reduce(&self, ptr: DevPtr, count: usize) -> Result<(), CudaError> {
        let Some(group) = &self.group else { return Ok(()) };
        self.bind()?;
        let c = group.comms[self.rank].lock().unwrap_or_else(|e| e.into_inner());
        let Some(comm) = c.as_ref() else {
            let why = group.aborted().unwrap_or_else(|| "the communicator is gone".into());
            return Err(driver_err("ncclAllReduce", format!("the group was aborted: {why}")));
        };
        // SAFETY: `ptr` holds `count` f32 on this rank's device; in place is
        // allowed; the communicator is live (an abort takes it under this lock).
        unsafe {
            cudarc::nccl::result::all_reduce(
                ptr as *const c_void,
                ptr as *mut c_void,
                count,
                nccl::ncclDataType_t::ncclFloat32,
                nccl::ncclRedOp_t::ncclSum,
                comm.0,
                self.stream.cu_stream() as nccl::cudaStream_t,
            )
        }
        .map(|_| ())
        .map_err(|e| driver_err("ncclAllReduce", e))
    }

    fn sync(&self) -> Result<(), CudaError> {
        match &self.group {
            // One rank: nothing can wait for a peer.
            None => self.stream.synchronize().map_err(|e| driver_err("cuStreamSynchronize", e))?,
            Some(group) => self.sync_watched(group, None)?,
        }
        // Every copy out of the upload arena has run: it can be refilled.
        self.uploads.lock().unwrap_or_else(|e| e.into_inner()).at = (0, 0);
        Ok(())
    }

    fn abort(&self, why: &str) {
        let Some(group) = &self.group else { return };
        {
            let mut a = group.aborted.lock().unwrap_or_else(|e| e.into_inner());
            if a.is_some() {
                return;
            }
            *a = Some(why.to_string());
        }
        tracing::error!("cuda: aborting the NCCL group: {why}");
        for c in &group.comms {
            if let Some(comm) = c.lock().unwrap_or_else(|e| e.into_inner()).take() {
                // SAFETY: taken under its lock, so no rank uses it again; ncclCommAbort
                // stops its queued operations and frees it (unverified on GPUs: it
                // needs two, see scripts/gpu-check.sh).
                let _ = unsafe { nccl::ncclCommAbort(comm.0) };
            }
        }
    }

    fn rank(&self) -> (usize, usize) {
        (self.rank, self.world)
    }

    fn group(&self, ordinals: &[usize]) -> Result<Vec<Driver>, CudaError> {
        if let [one] = ordinals {
            // One rank needs no communicator, so no NCCL either.
            return Ok(vec![Driver::open(*one)?]);
        }
        Driver::nccl_group(ordinals)
    }
}

impl Driver {
    /// One rank per GPU of `ordinals`, joined by an NCCL communicator, even
    /// for one GPU (so a one-GPU machine can test the collective at world
    /// size 1; NCCL runs no two ranks on one GPU).
    pub fn nccl_group(ordinals: &[usize]) -> Result<Vec<Driver>, CudaError> {
        // SAFETY: only dlopen attempts.
        if !unsafe { nccl::is_culib_present() } {
            return Err(CudaError::Driver {
                call: "NCCL".into(),
                error: "libnccl.so could not be loaded: --tp over GPUs needs NCCL (the PyPI package nvidia-nccl-cu13) \
                        on LD_LIBRARY_PATH, under the name libnccl.so (the package's file is libnccl.so.2: link it)"
                    .into(),
            });
        }
        let mut ranks: Vec<Driver> = ordinals.iter().map(|&o| Driver::open(o)).collect::<Result<_, _>>()?;
        // One algorithm and protocol, so sums are the same bits run to run:
        // `set_nccl_env` sets them before any thread starts. Setting them
        // here, with rank threads running, would be a data race.
        for (k, v) in NCCL_ENV {
            if std::env::var_os(k).is_none() {
                tracing::warn!(
                    "{k} is not set: NCCL picks its algorithm, and sums may differ run to run in the last bits \
                     (the strata binary sets {k}={v} at start; a program using the library calls set_nccl_env first)"
                );
            }
        }
        let mut comms = vec![std::ptr::null_mut(); ranks.len()];
        let devs: Vec<i32> = ordinals.iter().map(|&o| o as i32).collect();
        // SAFETY: `comms` has one slot per device.
        unsafe { cudarc::nccl::result::comm_init_all(comms.as_mut_ptr(), devs.len() as i32, devs.as_ptr()) }
            .map_err(|e| driver_err("ncclCommInitAll", e))?;
        let world = ranks.len();
        let group = Arc::new(NcclGroup {
            comms: comms.into_iter().map(|c| Mutex::new(Some(Handle(c)))).collect(),
            aborted: Mutex::new(None),
        });
        for (rank, d) in ranks.iter_mut().enumerate() {
            d.group = Some(group.clone());
            d.rank = rank;
            d.world = world;
        }
        Ok(ranks)
    }

    /// Waits for the stream, watching the group: once it is aborted, waits
    /// at most [`ABORT_DRAIN`] more for the stream to drain, then fails.
    /// `deadline` bounds the whole wait (teardown).
    fn sync_watched(&self, group: &NcclGroup, deadline: Option<std::time::Duration>) -> Result<(), CudaError> {
        let t0 = std::time::Instant::now();
        let mut aborted_at = None;
        let mut nap = std::time::Duration::from_micros(5);
        loop {
            // SAFETY: a live stream of this context.
            match unsafe { sys::cuStreamQuery(self.stream.cu_stream()) } {
                sys::CUresult::CUDA_SUCCESS => {
                    return match group.aborted() {
                        Some(why) => Err(driver_err("cuStreamSynchronize", format!("the group was aborted: {why}"))),
                        None => Ok(()),
                    }
                }
                sys::CUresult::CUDA_ERROR_NOT_READY => {}
                e => return Err(driver_err("cuStreamQuery", e)),
            }
            if let Some(why) = group.aborted() {
                let at = *aborted_at.get_or_insert_with(std::time::Instant::now);
                if at.elapsed() > ABORT_DRAIN {
                    return Err(driver_err(
                        "cuStreamSynchronize",
                        format!("the group was aborted ({why}), and the stream did not drain"),
                    ));
                }
            }
            if deadline.is_some_and(|d| t0.elapsed() > d) {
                return Err(driver_err("cuStreamSynchronize", format!("the stream did not finish in {deadline:?}")));
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(std::time::Duration::from_millis(1));
        }
    }
}

/// Sets the device's default memory pool to keep freed memory (a release
/// threshold of "everything"): with the default of 0, every stream sync
/// hands freed memory back to the driver, and the next step maps it again.
fn keep_freed_memory(ctx: &Arc<CudaContext>, ordinal: usize) -> Result<(), CudaError> {
    let dev = ctx.cu_device();
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut threshold = u64::MAX;
    // SAFETY: a valid device of a live context; the value is a u64, as the attribute takes.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, dev)
            .result()
            .map_err(|e| driver_err(&format!("cuDeviceGetDefaultMemPool(GPU {ordinal})"), e))?;
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut threshold as *mut u64 as *mut c_void,
        )
        .result()
        .map_err(|e| driver_err("cuMemPoolSetAttribute(RELEASE_THRESHOLD)", e))
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.bind();
        // Nothing queued may still read or write what is freed below; but a
        // stream that never finishes (a peer that hung) must not hang the exit.
        let drained = match &self.group {
            None => self.stream.synchronize().is_ok(),
            Some(g) => self.sync_watched(g, Some(TEARDOWN_DEADLINE)).is_ok(),
        };
        if !drained {
            tracing::error!(
                "cuda: GPU {}: the stream did not drain at teardown; its host buffers are leaked",
                self.info.ordinal
            );
            // Queued copies may still write them: never free them.
            std::mem::forget(std::mem::take(&mut *self.staging.lock().unwrap_or_else(|e| e.into_inner())));
            std::mem::forget(std::mem::take(&mut *self.uploads.get_mut().unwrap_or_else(|e| e.into_inner())));
        }
        if let Some(g) = self.group.take() {
            if let Some(c) = g.comms[self.rank].lock().unwrap_or_else(|e| e.into_inner()).take() {
                // SAFETY: taken under its lock, used by no one after. A drained
                // stream: finalize flushes, then destroy frees. Otherwise abort.
                unsafe {
                    if drained && nccl::ncclCommFinalize(c.0) == nccl::ncclResult_t::ncclSuccess {
                        let _ = nccl::ncclCommDestroy(c.0);
                    } else {
                        let _ = nccl::ncclCommAbort(c.0);
                    }
                }
            }
        }
        let h = self.blas.get_mut().unwrap_or_else(|e| e.into_inner()).0;
        // SAFETY: the cuBLAS handle is destroyed once, after its last use.
        let _ = unsafe { cudarc::cublas::result::destroy_handle(h) };
    }
}

#[cfg(test)]
mod tests {
    use super::{staging_capacity, Capacity, Staged, Staging};

    impl Capacity for (usize, usize) {
        fn capacity(&self) -> usize {
            self.1
        }
    }

    /// The pool's double buffering: a taken step's buffers are not handed
    /// to the next step until they come back (read, or their copies done).
    #[test]
    fn staging_buffers_are_reused_only_once_given_back() {
        // Buffers are (id, capacity); markers say whether a deferred step's copies are done.
        let mut pool = Staging::<(usize, usize), bool>::default();
        assert!(pool.take_free(100).is_none(), "an empty pool allocates");
        let step1 = vec![Staged::Pinned((1, 128), 100), Staged::Pinned((2, 128), 100)];
        // While step 1's buffers are out, step 2 gets none of them.
        assert!(pool.take_free(100).is_none());
        pool.give_back(step1);
        let a = pool.take_free(100).unwrap();
        let b = pool.take_free(100).unwrap();
        assert_eq!([a.0, b.0].iter().sum::<usize>(), 3, "step 1's buffers, each once");
        assert!(pool.take_free(100).is_none());
        // A step dropped before its copies landed comes back only when they have.
        pool.deferred.push((false, vec![Staged::Pinned(a, 100)]));
        pool.deferred.push((true, vec![Staged::Pinned(b, 100), Staged::Owned(vec![0; 4])]));
        pool.reclaim(|&done| done);
        assert_eq!(pool.free.iter().map(|p| p.0).collect::<Vec<_>>(), [b.0], "only the landed step's buffer");
        assert_eq!(pool.deferred.len(), 1);
        // Too small for a larger step: dropped rather than kept.
        assert!(pool.take_free(200).is_none());
        assert!(pool.free.is_empty());
    }

    #[test]
    fn staging_grows_by_rungs_of_at_most_a_quarter() {
        assert_eq!(staging_capacity(1), 4096);
        assert_eq!(staging_capacity(4097), 5120);
        assert_eq!(staging_capacity(1 << 20), 1 << 20);
        assert_eq!(staging_capacity((1 << 20) + 1), (1 << 20) + (1 << 18));
        let mut rungs = std::collections::BTreeSet::new();
        for bytes in (1usize << 20..=1 << 22).step_by(4093) {
            let cap = staging_capacity(bytes);
            assert!(cap >= bytes && cap as f64 <= bytes as f64 * 1.25 + 1.0, "{bytes}: {cap}");
            rungs.insert(cap);
        }
        // 1 MiB to 4 MiB: 8 rungs, not one buffer per size.
        assert_eq!(rungs.len(), 9, "{rungs:?}");
    }
}
