//! What the CUDA backend asks of a GPU, as a trait: device memory, copies,
//! kernel launches (`cuLaunchKernel`'s arguments: a kernel name and its
//! parameters in order), cuBLAS-style GEMMs and the group's all-reduce.
//!
//! [`Driver`](super::driver::Driver) is the real GPU (cudarc). The tests add
//! a second implementation that runs the same kernel sources on the CPU
//! (`tests/cuda_emu/`), so the backend's launches — grids, argument order,
//! segment tables, GEMM transposes — are checked against the reference
//! backend on machines without a GPU.

use super::CudaError;

/// A device address (`CUdeviceptr`).
pub type DevPtr = u64;

/// One kernel parameter, as `cuLaunchKernel` passes it (by value).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arg {
    /// A device pointer (null: 0).
    Ptr(DevPtr),
    /// `int`.
    I32(i32),
    /// `unsigned` / `u32`.
    U32(u32),
    /// `u64`.
    U64(u64),
    /// `float`.
    F32(f32),
}

impl Arg {
    /// An `int` parameter from a size the caller knows fits (kernel sizes are
    /// checked against `i32::MAX` where buffers are made).
    pub fn int(v: usize) -> Arg {
        Arg::I32(i32::try_from(v).expect("kernel size parameter fits an int"))
    }

    /// The 8-byte slot `cuLaunchKernel` reads the parameter from: its value
    /// at the start (little-endian), as wide as the kernel's parameter type.
    pub fn slot(self) -> u64 {
        match self {
            Arg::Ptr(p) | Arg::U64(p) => p,
            Arg::I32(v) => v as u32 as u64,
            Arg::U32(v) => v as u64,
            Arg::F32(v) => v.to_bits() as u64,
        }
    }
}

/// A launch: grid `(x, y)` of blocks of `block` threads, `smem` bytes of
/// dynamic shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    /// Blocks along x and y.
    pub grid: (u32, u32),
    /// Threads per block (a multiple of 32).
    pub block: u32,
    /// Dynamic shared memory, bytes.
    pub smem: u32,
}

/// Element types a GEMM reads or writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmType {
    /// f32.
    F32,
    /// bf16 (bits).
    Bf16,
}

/// `C = alpha · op(A) · op(B) + beta · C`, column-major, as cublasGemmEx
/// takes it (f32 accumulation; for f32 inputs no TF32). Row-major `Y[T, out]
/// = X[T, in] · W[out, in]ᵀ` is `m = out, n = T, k = in, A = W (transposed,
/// lda = in), B = X (ldb = in), C = Y (ldc = out)`: see [`Gemm::linear`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gemm {
    /// Transpose A.
    pub trans_a: bool,
    /// Transpose B.
    pub trans_b: bool,
    /// Rows of op(A) and C.
    pub m: usize,
    /// Columns of op(B) and C.
    pub n: usize,
    /// Columns of op(A), rows of op(B).
    pub k: usize,
    /// A's address, type and leading dimension.
    pub a: (DevPtr, GemmType, usize),
    /// B's.
    pub b: (DevPtr, GemmType, usize),
    /// C's address and leading dimension.
    pub c: (DevPtr, usize),
    /// C's type: f32, or bf16 for the MoE experts' GEMMs (see [`grouped_takes`]).
    pub c_type: GemmType,
    /// Factor on the product.
    pub alpha: f32,
    /// Factor on C's old values (0: C is overwritten, even if it held NaN).
    pub beta: f32,
}

impl Gemm {
    /// `Y[rows, out] (+)= X[rows, in] · W[out, in]ᵀ` for row-major buffers.
    pub fn linear(
        w: (DevPtr, GemmType),
        x: (DevPtr, GemmType),
        y: DevPtr,
        rows: usize,
        out: usize,
        inp: usize,
        accumulate: bool,
    ) -> Gemm {
        Gemm {
            trans_a: true,
            trans_b: false,
            m: out,
            n: rows,
            k: inp,
            a: (w.0, w.1, inp),
            b: (x.0, x.1, inp),
            c: (y, out),
            c_type: GemmType::F32,
            alpha: 1.0,
            beta: if accumulate { 1.0 } else { 0.0 },
        }
    }
}

impl Gemm {
    /// Whether this GEMM runs with pedantic f32 compute: f32 inputs, the
    /// exact path (no TF32, no reduced-precision reductions).
    pub fn pedantic(&self) -> bool {
        self.a.1 == GemmType::F32 && self.b.1 == GemmType::F32
    }
}

/// Whether `cublasGemmGroupedBatchedEx` takes these types. Its table
/// (cuBLAS 12.5+, "cublasGemmGroupedBatchedEx") is far shorter than
/// `cublasGemmEx`'s: with `CUBLAS_COMPUTE_32F` (f32 scale) it takes A/B/C of
/// f16/f16/f16, bf16/bf16/bf16 or f32/f32/f32 (and TF32 and f64 variants).
/// bf16 inputs with f32 output are not there, nor is pedantic compute: so
/// the experts' bf16 GEMMs write bf16, and f32 GEMMs (the exact path, which
/// is pedantic) run one call each.
pub fn grouped_takes(g: &Gemm) -> bool {
    matches!((g.a.1, g.b.1, g.c_type), (GemmType::Bf16, GemmType::Bf16, GemmType::Bf16))
}

/// How a device runs a MoE layer's expert GEMMs. The two paths can differ in
/// the last bits (cuBLAS picks other kernels), so the path is recorded in the
/// manifest's kernel field, and a resume refuses a part begun on the other.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmPath {
    /// One `cublasGemmGroupedBatchedEx` per projection of a chunk of experts.
    Grouped,
    /// One `cublasGemmEx` per expert.
    PerExpert,
}

impl GemmPath {
    /// The manifest's kernel field for a run with `compute`: grouped GEMMs
    /// are taken only by bf16 compute (see [`grouped_takes`]).
    pub fn kernel(self, compute: crate::backend::Compute) -> &'static str {
        match (self, compute) {
            (GemmPath::Grouped, crate::backend::Compute::Bf16) => "cublas-grouped",
            _ => "cublas",
        }
    }
}

/// A step's staged captures, taken off their device.
pub trait StagedCopies: Send {
    /// Hands the bytes of the copies to `f`, in the order they were staged,
    /// once they have landed: a GPU waits for the stream to pass them; the
    /// emulated device refuses copies no sync has completed since they were
    /// staged (so a collection before the step's sync fails a test).
    fn collect(self: Box<Self>, f: &mut dyn FnMut(&[&[u8]])) -> Result<(), CudaError>;
}

/// A GPU as the CUDA backend uses it: one stream, so operations run in the
/// order they are issued, and a copy back to the host waits for them.
pub trait Device: Send + Sync + Sized + 'static {
    /// Device memory that frees itself when dropped.
    type Mem: Send + Sync;

    /// `bytes` of device memory whose contents are undefined: for buffers the
    /// next op overwrites whole (zeroing several GB a step costs bandwidth).
    /// The emulated device fills it with NaN, so a read before a write shows.
    fn alloc(&self, bytes: usize) -> Result<Self::Mem, CudaError>;
    /// `bytes` of zeroed device memory.
    fn alloc_zeroed(&self, bytes: usize) -> Result<Self::Mem, CudaError>;
    /// Device memory `(free, total)` in bytes (`cuMemGetInfo`): what the
    /// backend weighs keeping FP8/INT4 weights expanded against.
    fn memory(&self) -> Result<(usize, usize), CudaError>;
    /// The address of `m`'s first byte.
    fn ptr(&self, m: &Self::Mem) -> DevPtr;
    /// Copies host bytes to `dst`, in stream order, without waiting for the
    /// stream; `src` (pageable host memory, never pinned) may be reused on return.
    fn upload(&self, dst: DevPtr, src: &[u8]) -> Result<(), CudaError>;
    /// Copies device bytes to the host, after everything issued before it.
    fn download(&self, src: DevPtr, dst: &mut [u8]) -> Result<(), CudaError>;
    /// Starts copying `bytes` at `src` into host staging memory the device
    /// keeps (pinned on a GPU), in stream order, without waiting: the
    /// forward goes on while the copy engine works. [`Device::take_staged`]
    /// hands the staged copies over.
    fn stage(&self, src: DevPtr, bytes: usize) -> Result<(), CudaError>;
    /// Takes every copy [`Device::stage`]d since the last take, without
    /// waiting for them: the next step stages into other memory while these
    /// are read (double-buffered staging), and their memory returns to the
    /// device's pool when the taken value is dropped.
    fn take_staged(&self) -> Result<Box<dyn StagedCopies>, CudaError>;
    /// Copies `bytes` between device addresses, in stream order.
    fn copy(&self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<(), CudaError>;
    /// Launches kernel `name` (an `extern "C"` function of `kernels/`) with `args` in order.
    fn launch(&self, name: &str, cfg: Launch, args: &[Arg]) -> Result<(), CudaError>;
    /// A GEMM (cuBLAS semantics).
    fn gemm(&self, g: &Gemm) -> Result<(), CudaError>;
    /// Independent GEMMs of one operand type each (a MoE layer's experts
    /// over the rows each received), in one launch where the device can
    /// ([`Device::gemm_path`]; only types [`grouped_takes`] allows); the same
    /// results as [`Device::gemm`] on each up to the last bits, in any order.
    fn gemm_grouped(&self, gs: &[Gemm]) -> Result<(), CudaError> {
        gs.iter().try_for_each(|g| self.gemm(g))
    }
    /// The path [`Device::gemm_grouped`] takes for the types it allows,
    /// decided once when the device opens (a GPU probes cuBLAS with a small
    /// grouped call).
    fn gemm_path(&self) -> GemmPath {
        GemmPath::PerExpert
    }
    /// Sums `count` f32 at `ptr` over the group's ranks, in place. On GPUs:
    /// NCCL with its algorithm and protocol fixed, the same bits run to run on
    /// one machine, but not summed in rank order (unlike the CPU backend), so
    /// with more than two ranks the bits can differ from the CPU backend's.
    fn all_reduce(&self, ptr: DevPtr, count: usize) -> Result<(), CudaError>;
    /// Waits for everything issued. In a group, it fails (rather than waits
    /// forever) once the group is aborted.
    fn sync(&self) -> Result<(), CudaError>;
    /// Stops the group's collectives: every rank's all-reduce, queued or
    /// later, fails instead of waiting for a rank that will not join (on GPUs
    /// `ncclCommAbort` on every communicator of the group). Idempotent; a
    /// device with no group ignores it.
    fn abort(&self, why: &str);
    /// This rank and the group's size.
    fn rank(&self) -> (usize, usize);
    /// Devices for the `n` ranks of a tensor-parallel group on `ordinals`, joined for [`Device::all_reduce`].
    fn group(&self, ordinals: &[usize]) -> Result<Vec<Self>, CudaError>;
}
