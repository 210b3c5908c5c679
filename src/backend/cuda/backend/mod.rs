//! [`Cuda`]: the [`Backend`] over a [`Device`], one value per GPU (rank).
//!
//! - Activations are f32 device buffers ([`Buf`]), typed by the same
//!   [`Tensor`] as on the host; weights stay as stored where the GEMM can take
//!   them (f32, bf16), FP8 and INT4 stay quantised and are expanded to the
//!   GEMM's input dtype just before it, one layer (or expert) at a time.
//! - bf16 compute rounds the GEMM and attention inputs to bf16 and
//!   accumulates in f32 (cuBLAS `COMPUTE_32F`, tensor-core attention); f32
//!   compute uses f32 GEMMs without TF32 and the f32 attention kernel.
//! - A failure of the device (out of memory, a launch error) is recorded by
//!   the op that meets it, later ops are skipped, and [`DeviceOps::end_step`]
//!   returns it: the step fails with the device's message, nothing panics.
//! - Sizes are asserted at the boundary: host copies and captures return a
//!   `ShapeError` naming the axis; every launch first checks that each buffer
//!   holds what the kernel will touch.

use super::device::{DevPtr, Device, Gemm, GemmType, Launch};
use super::driver::Driver;
use super::kernels as launch;
use super::CudaError;
use crate::backend::{
    AttentionOps, AttnBlock, AttnBufs, AttnShape, BackendError, Buffers, Cols, ComputeDtype, DeltaGates, DeviceOps,
    EmbeddingInfo, FusedOps, GatedLinear, Gating, Glu, HeadSpan, HeadSums, KvStore, LayerState, LinearInfo, MlpBufs,
    MoeOps, Parallel, PendingCopies, Qkv, RecurrentOps, Resident, RopeInfo, Router, RoutesInfo, RowOps, Temperature,
    Tensor, VectorInfo, Weights, F32,
};
use crate::hf::checkpoint::TensorBytes;
use crate::hf::moe::{Scoring, TopkMethod};
use crate::hf::quant::{LinearWeight, QuantKind, QuantRows};
use crate::hf::RopeFreqs;
use crate::pipeline::batch::PackedBatch;
use crate::shape::{CapturedStates, DType, Dim, ShapeError};
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

mod attention;
mod buffers;
mod delta;
mod fused;
mod gemm;
mod moe;
mod rows;

use attention::Src;
pub use attention::{
    attention_bf16_kernel, attention_bf16_smem, pad16, split_chunk, AttentionLaunch, SplitPlan, SPLIT_MAX,
    SPLIT_MIN_CHUNK, SPLIT_MIN_KEYS,
};

/// Device memory of `len` values of 4 bytes (f32, or u32 indices), with
/// room for `cap`.
pub struct Buf<D: Device> {
    mem: Option<D::Mem>,
    ptr: DevPtr,
    cap: usize,
    len: usize,
}

impl<D: Device> Buf<D> {
    fn empty() -> Self {
        Buf { mem: None, ptr: 0, cap: 0, len: 0 }
    }
    /// The device address of value `i`.
    pub fn at(&self, i: usize) -> DevPtr {
        self.ptr + 4 * i as u64
    }
    /// Values held.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether it holds no values.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Raw device bytes (weights as stored).
pub struct Bytes<D: Device> {
    mem: Option<D::Mem>,
    ptr: DevPtr,
    len: usize,
}

/// A weight on the device.
enum Weight<D: Device> {
    /// f32 `[rows, cols]`.
    F32(Bytes<D>),
    /// bf16 bits `[rows, cols]`.
    Bf16(Bytes<D>),
    /// FP8 codes `[rows, cols]` or INT4 codes two to a byte `[rows, ⌈cols/2⌉]`,
    /// scales `[rows, segments]`, and each column's segment.
    Quant { kind: QuantKind, codes: Bytes<D>, scales: Bytes<D>, colseg: Bytes<D>, segments: usize },
}

/// A linear layer on the device.
pub struct Linear<D: Device> {
    w: Weight<D>,
    rows: usize,
    cols: usize,
    /// Added inside the layer (column-parallel, replicated, or one rank).
    bias: Option<Bytes<D>>,
    /// A row-parallel layer's bias, added once after the all-reduce.
    post_bias: Option<Bytes<D>>,
    kind: Parallel,
    /// GEMM inputs in f32 whatever the compute dtype (the MoE router).
    f32_inputs: bool,
    held: Option<QuantKind>,
    /// A quantised weight (or a bf16 one under f32 compute) expanded once and kept, when device memory allowed
    /// it (see `weight_operand`): its GEMMs then read it as bf16 or f32.
    kept: std::sync::OnceLock<Bytes<D>>,
}

impl<D: Device> Resident for Linear<D> {
    fn resident_bytes(&self) -> usize {
        let w = match &self.w {
            Weight::F32(b) | Weight::Bf16(b) => b.len,
            Weight::Quant { codes, scales, colseg, .. } => codes.len + scales.len + colseg.len,
        };
        let kept = self.kept.get().map_or(0, |k| k.len);
        w + kept + self.bias.as_ref().map_or(0, |b| b.len) + self.post_bias.as_ref().map_or(0, |b| b.len)
    }
}

impl<D: Device> Linear<D> {
    /// Whether a GEMM with (or without) bf16 inputs reads this weight through
    /// an expansion: quantised codes, or bf16 under an f32 GEMM.
    fn expands(&self, bf16_inputs: bool) -> bool {
        match self.w {
            Weight::F32(_) => false,
            Weight::Bf16(_) => !bf16_inputs,
            Weight::Quant { .. } => true,
        }
    }
}

impl<D: Device> LinearInfo for Linear<D> {
    fn out_features(&self) -> usize {
        self.rows
    }
    fn in_features(&self) -> usize {
        self.cols
    }
    fn held_as(&self) -> Option<QuantKind> {
        self.held
    }
}

/// A weight vector on the device (f32).
pub struct Vector<D: Device>(Bytes<D>);

impl<D: Device> Resident for Vector<D> {
    fn resident_bytes(&self) -> usize {
        self.0.len
    }
}

impl<D: Device> VectorInfo for Vector<D> {
    fn len(&self) -> usize {
        self.0.len / 4
    }
}

/// The embedding table as stored (f32, bf16 or f16 bytes).
pub struct Embedding<D: Device> {
    table: Bytes<D>,
    dtype: DType,
    hidden: usize,
    vocab: usize,
}

impl<D: Device> Resident for Embedding<D> {
    fn resident_bytes(&self) -> usize {
        self.table.len
    }
}

impl<D: Device> EmbeddingInfo for Embedding<D> {
    fn hidden(&self) -> usize {
        self.hidden
    }
}

/// cos/sin `[positions, half]` (times the scale), shared with the backend's
/// cache of tables (built once per frequency set, not every step).
pub struct RopeTable<D: Device> {
    tables: Arc<(Bytes<D>, Bytes<D>)>,
    half: usize,
    len: usize,
}

impl<D: Device> RopeInfo for RopeTable<D> {
    fn half(&self) -> usize {
        self.half
    }
}

impl<D: Device> RopeTable<D> {
    /// Where its cos values lie on the device: the same step after step
    /// while the cached table is long enough.
    pub fn cos_ptr(&self) -> DevPtr {
        self.tables.0.ptr
    }
    /// Positions it holds.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether it holds no position.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// One cached RoPE table: its frequencies' bits and scale's, positions, and the tables.
type CachedRope<D> = (Vec<u32>, u32, usize, Arc<(Bytes<D>, Bytes<D>)>);

/// Each token's experts (on the host, to group rows by expert) and weights (on the device).
pub struct Routes<D: Device> {
    /// `[T, top_k]` u32, on the device.
    ids: Bytes<D>,
    /// T.
    tokens: usize,
    weights: Bytes<D>,
    top_k: usize,
}

impl<D: Device> RoutesInfo for Routes<D> {
    fn tokens(&self) -> usize {
        self.tokens
    }
}

/// Keys and values of one layer of one sample: `[capacity positions, width]`, f32 (f32 compute) or
/// bf16 heads padded to 16 columns (bf16 compute: what `attention_bf16_vN` reads, half the bytes).
struct LayerKv<D: Device> {
    k: Bytes<D>,
    v: Bytes<D>,
    cap: usize,
}

/// One sample's cached positions, the most it reserved, and each layer's keys and values.
type KvEntry<D> = (usize, usize, Vec<Option<LayerKv<D>>>);

/// The KV cache: per sample, its positions and each layer's keys and values.
pub struct KvCache<D: Device> {
    entries: HashMap<u64, KvEntry<D>>,
}

impl<D: Device> Default for KvCache<D> {
    fn default() -> Self {
        KvCache { entries: HashMap::new() }
    }
}

impl<D: Device> KvStore for KvCache<D> {
    fn begin(&mut self, batch: &PackedBatch) -> Result<(), BackendError> {
        for &(key, to) in batch.rewinds() {
            let Some(e) = self.entries.get_mut(&key) else { continue };
            if to == 0 {
                self.entries.remove(&key);
            } else if to > e.0 {
                return Err(crate::backend::kv_cache::rewind_refused(key, e.0, to));
            } else {
                // The rows past `to` stay allocated and are written over as the sample goes on.
                e.0 = to;
            }
        }
        crate::backend::kv_cache::check_continuations(batch, |key| self.entries.get(&key).map_or(0, |e| e.0))?;
        for (s, seg) in batch.segments().iter().enumerate().filter(|(_, g)| g.uses_cache()) {
            self.entries.entry(seg.key).or_insert_with(|| (0, 0, Vec::new())).0 = seg.pos0 + batch.range(s).len();
        }
        for &(key, positions) in batch.reservations() {
            if let Some(e) = self.entries.get_mut(&key) {
                e.1 = positions;
            }
        }
        Ok(())
    }
    fn retire(&mut self, batch: &PackedBatch) {
        for seg in batch.segments().iter().filter(|g| !g.keep) {
            self.entries.remove(&seg.key);
        }
    }
    fn len(&self) -> usize {
        self.entries.len()
    }
    fn held_bytes(&self) -> usize {
        let layers = self.entries.values().flat_map(|e| e.2.iter().flatten());
        layers.map(|l| l.k.len + l.v.len).sum()
    }
}

impl<D: Device> crate::backend::kv_cache::Held for DeltaLayer<D> {
    fn held_bytes(&self) -> usize {
        self.conv.len + self.s.len + self.pend.iter().map(|p| p.len).sum::<usize>()
    }
}

/// What a Gated DeltaNet layer keeps of a chunked sample on the device: the
/// conv's last `K - 1` inputs `[K - 1, C]`, the recurrent state `[v_heads,
/// dk, dv]` at the start of its unfinished chunk, and that chunk's prepared
/// rows `[64, pw]`, in two buffers a step reads one of and writes the other
/// (value heads sharing a key head read its rows while another writes).
pub struct DeltaLayer<D: Device> {
    conv: Bytes<D>,
    s: Bytes<D>,
    pend: [Bytes<D>; 2],
    /// Which of `pend` holds the rows to read.
    flip: usize,
}

impl<D: Device> Default for DeltaLayer<D> {
    fn default() -> Self {
        let e = || Bytes { mem: None, ptr: 0, len: 0 };
        DeltaLayer { conv: e(), s: e(), pend: [e(), e()], flip: 0 }
    }
}

/// Working buffers of one rank, reused step to step (grown, never shrunk).
struct Scratch<D: Device> {
    /// bf16 GEMM inputs.
    xb: Bytes<D>,
    /// A weight expanded from FP8/INT4 (or bf16 widened).
    wexp: Bytes<D>,
    /// A row-parallel layer's partial output.
    partial: Bytes<D>,
    /// Small tables uploaded per op (ids, positions, segments, tiles).
    table: Bytes<D>,
    table2: Bytes<D>,
    table3: Bytes<D>,
    /// Split-K decode's partials (`SplitPlan`): `[splits, heads, 2]` (max,
    /// sum) then `[splits, heads, vd]` unnormalised outputs, f32.
    split: Bytes<D>,
    /// bf16 attention: this step's keys, values and queries, `[tokens, kv
    /// heads, dp]`, `[tokens, kv heads, vp]` and `[tokens, heads, dp]`.
    kv: [Bytes<D>; 3],
    /// A bf16 qkv projection's output, `[tokens, (heads + 2·kv heads) · hd]` bf16.
    qkv: Bytes<D>,
    /// A bf16 gated MLP's gate/up activations, `[tokens, 2 · inter]` bf16.
    mlp: Bytes<D>,
    /// MoE grouping: `starts [experts + 1]`, `src [T·top_k]`, `slot [T·top_k]` u32.
    group: Bytes<D>,
    /// MoE: router scratch, grouped rows in and out, gate/up, activation, shared output.
    moe: [Bytes<D>; 6],
    /// Gated DeltaNet: each block's work area (`delta_work_floats` in kernels/delta.cu).
    delta: Bytes<D>,
}

/// The CUDA backend for compute dtype `C` on device `D` (a GPU: [`Driver`]).
pub struct Cuda<C: ComputeDtype = F32, D: Device = Driver> {
    dev: Arc<D>,
    /// The GPUs a group is opened on (rank order).
    ordinals: Vec<usize>,
    scratch: Mutex<Option<Scratch<D>>>,
    failed: Mutex<Option<BackendError>>,
    /// The capture slots staged this step, in order (see [`Device::stage`]).
    staged: Mutex<Vec<usize>>,
    /// Scratch bytes a chunk of experts may take (see `experts_grouped`).
    moe_scratch: usize,
    /// RoPE tables built so far, one per frequency set (see `rope_table`).
    ropes: Mutex<Vec<CachedRope<D>>>,
    /// Set once device memory had no room to keep an expanded weight: none
    /// is tried again (each try asks the driver for its free memory).
    keep_refused: std::sync::atomic::AtomicBool,
    _compute: PhantomData<C>,
}

/// Copies each `(src, dst)` pair, split over up to 8 threads when large:
/// host copy bandwidth, and the first touches of a fresh buffer's pages,
/// scale with threads.
fn copy_parallel(pairs: Vec<(&[u8], &mut [u8])>) {
    const PIECE: usize = 8 << 20;
    let total: usize = pairs.iter().map(|p| p.0.len()).sum();
    let mut pieces: Vec<(&[u8], &mut [u8])> =
        pairs.into_iter().flat_map(|(s, d)| s.chunks(PIECE).zip(d.chunks_mut(PIECE))).collect();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(8).min(total.div_ceil(PIECE));
    if threads <= 1 {
        pieces.into_iter().for_each(|(s, d)| d.copy_from_slice(s));
        return;
    }
    let per = pieces.len().div_ceil(threads);
    std::thread::scope(|scope| {
        for chunk in pieces.chunks_mut(per) {
            scope.spawn(move || chunk.iter_mut().for_each(|(s, d)| d.copy_from_slice(s)));
        }
    });
}

/// A kernel's `int` parameter from a size the caller knows fits (kernel
/// sizes are checked against `i32::MAX` where buffers are made).
fn int(v: usize) -> i32 {
    i32::try_from(v).expect("kernel size parameter fits an int")
}

const ELEMENTWISE_BLOCK: u32 = 256;

/// The launch of an element-wise kernel over `n` values. Its loop indexes
/// in 32 bits (`GRID_STRIDE` in common.cuh), so more than 2^31 values in
/// one op are refused here rather than wrapped there.
fn elementwise(n: usize) -> Result<Launch, CudaError> {
    if n > i32::MAX as usize {
        return Err(CudaError::Kernel {
            name: "element-wise".into(),
            log: format!("{n} values in one op exceed the kernels' 2^31 (lower --max-batch-tokens)"),
        });
    }
    Ok(Launch {
        grid: (n.div_ceil(ELEMENTWISE_BLOCK as usize).clamp(1, 65535) as u32, 1),
        block: ELEMENTWISE_BLOCK,
        smem: 0,
    })
}

impl<C: ComputeDtype, D: Device> Cuda<C, D> {
    /// The backend on `dev` (rank 0 of a group that `group` opens on `ordinals`).
    pub fn new(dev: D, ordinals: Vec<usize>) -> Self {
        Cuda {
            dev: Arc::new(dev),
            ordinals,
            scratch: Mutex::new(None),
            failed: Mutex::new(None),
            staged: Mutex::new(Vec::new()),
            moe_scratch: 1 << 30,
            ropes: Mutex::new(Vec::new()),
            keep_refused: std::sync::atomic::AtomicBool::new(false),
            _compute: PhantomData,
        }
    }

    /// Bounds the scratch one chunk of MoE experts takes (default 1 GiB):
    /// its rows' activations and its experts' expanded FP8/INT4 weights.
    /// Smaller chunks mean more, smaller grouped GEMM launches.
    pub fn moe_scratch(mut self, bytes: usize) -> Self {
        self.moe_scratch = bytes;
        self
    }

    /// The device.
    pub fn device(&self) -> &D {
        &self.dev
    }

    fn ok(&self) -> bool {
        self.failed.lock().unwrap_or_else(|e| e.into_inner()).is_none()
    }

    /// Runs `f` unless an earlier op failed; records its error.
    fn run(&self, f: impl FnOnce() -> Result<(), CudaError>) {
        if !self.ok() {
            return;
        }
        if let Err(e) = f() {
            self.fail(e.into());
        }
    }

    /// Records the rank's first failure, and aborts its group: a failed rank
    /// cannot be trusted to join the next all-reduce (its buffers may never
    /// have been made), and its peers must not wait for it.
    fn fail(&self, e: BackendError) {
        let mut failed = self.failed.lock().unwrap_or_else(|e| e.into_inner());
        if failed.is_none() {
            // The message without `device: `, as the model's error shows it.
            let msg = match &e {
                BackendError::Device(d) => d.to_string(),
                other => other.to_string(),
            };
            tracing::error!("cuda: {msg}");
            let (rank, world) = self.dev.rank();
            if world > 1 {
                self.dev.abort(&format!("rank {rank} failed: {msg}"));
            }
            *failed = Some(e);
        }
    }

    fn bytes(&self, data: &[u8]) -> Bytes<D> {
        let mut b = Bytes { mem: None, ptr: 0, len: data.len() };
        self.run(|| {
            let m = self.dev.alloc(data.len())?;
            b.ptr = self.dev.ptr(&m);
            b.mem = Some(m);
            if !data.is_empty() {
                self.dev.upload(b.ptr, data)?;
            }
            Ok(())
        });
        b
    }

    fn f32s(&self, v: &[f32]) -> Bytes<D> {
        self.bytes(bytemuck::cast_slice(v))
    }

    /// Grows `b` to at least `bytes` (contents not kept).
    fn ensure(&self, b: &mut Bytes<D>, bytes: usize) -> Result<(), CudaError> {
        if b.mem.is_none() || b.len < bytes {
            b.mem = None; // free before allocating the larger block
            let m = self.dev.alloc(bytes.max(256))?;
            b.ptr = self.dev.ptr(&m);
            b.len = bytes.max(256);
            b.mem = Some(m);
        }
        Ok(())
    }

    /// Makes `b` a zero-filled block of `bytes` if it holds none yet (a
    /// sample's sequence state, zeros before its first step).
    fn zeroed(&self, b: &mut Bytes<D>, bytes: usize) -> Result<(), CudaError> {
        if b.mem.is_none() {
            let m = self.dev.alloc_zeroed(bytes.max(256))?;
            (b.ptr, b.len) = (self.dev.ptr(&m), bytes.max(256));
            b.mem = Some(m);
        }
        Ok(())
    }

    /// Each token's position within its sample, `[T]` u32, into scratch slot 0.
    fn upload_positions(&self, batch: &PackedBatch) -> Result<DevPtr, CudaError> {
        let positions: Vec<u32> = batch
            .segments()
            .iter()
            .enumerate()
            .flat_map(|(i, g)| (0..batch.range(i).len()).map(move |j| (g.pos0 + j) as u32))
            .collect();
        self.upload_table(0, bytemuck::cast_slice(&positions))
    }

    /// Uploads a small host table into scratch slot `which` (0, 1 or 2), returning its address.
    fn upload_table(&self, which: usize, data: &[u8]) -> Result<DevPtr, CudaError> {
        let mut s = self.scratch()?;
        let s = s.as_mut().expect("scratch made");
        let b = match which {
            0 => &mut s.table,
            1 => &mut s.table2,
            _ => &mut s.table3,
        };
        self.ensure(b, data.len())?;
        self.dev.upload(b.ptr, data)?;
        Ok(b.ptr)
    }

    fn scratch(&self) -> Result<std::sync::MutexGuard<'_, Option<Scratch<D>>>, CudaError> {
        let mut g = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        if g.is_none() {
            let e = || Bytes { mem: None, ptr: 0, len: 0 };
            *g = Some(Scratch {
                xb: e(),
                wexp: e(),
                partial: e(),
                table: e(),
                table2: e(),
                table3: e(),
                split: e(),
                kv: [e(), e(), e()],
                qkv: e(),
                group: e(),
                mlp: e(),
                moe: [e(), e(), e(), e(), e(), e()],
                delta: e(),
            });
        }
        Ok(g)
    }

    /// The all-reduce of `count` f32 at `ptr`. A rank that failed has
    /// aborted the group (see `fail`), so its peers' all-reduces fail rather
    /// than wait for it, and it joins none.
    fn join_all_reduce(&self, ptr: DevPtr, count: usize) {
        self.run(|| self.dev.all_reduce(ptr, count));
    }

    /// Checks that a buffer of `have` values holds the `need` a kernel touches.
    fn holds(what: &str, need: usize, have: usize) -> Result<(), CudaError> {
        if need > have {
            return Err(CudaError::Shape(ShapeError::new(what, "elements", need, have)));
        }
        Ok(())
    }
}

/// Device memory left free when an expanded FP8/INT4 weight is kept: room
/// for the activations, caches and scratch of steps larger than those so far
/// (an eighth of the device, at least 8 GiB).
pub fn keep_reserve(total: usize) -> usize {
    (8usize << 30).max(total / 8)
}

#[cfg(test)]
mod tests {
    use super::copy_parallel;

    #[test]
    fn captures_are_copied_whole_over_threads() {
        // Above one 8 MiB piece per thread, with uneven tails: every byte lands where it belongs.
        let sizes = [(20 << 20) + 3, 5, (9 << 20) + 1];
        let src: Vec<Vec<u8>> =
            sizes.iter().enumerate().map(|(k, &n)| (0..n).map(|i| (i * 31 + k * 7) as u8).collect()).collect();
        let mut dst: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0u8; n]).collect();
        let pairs = src.iter().zip(dst.iter_mut()).map(|(s, d)| (s.as_slice(), d.as_mut_slice())).collect();
        copy_parallel(pairs);
        assert!(src == dst, "a piece was lost or misplaced");
    }
}
