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
//!   the op that meets it, later ops are skipped, and [`Backend::end_step`]
//!   returns it: the step fails with the device's message, nothing panics.
//! - Sizes are asserted at the boundary: host copies and captures return a
//!   `ShapeError` naming the axis; every launch first checks that each buffer
//!   holds what the kernel will touch.

use super::device::{DevPtr, Device, Gemm, GemmType, Launch};
use super::driver::Driver;
use super::kernels as launch;
use super::CudaError;
use crate::backend::{
    check, AttnBlock, AttnShape, Backend, BackendError, Cols, ComputeDtype, GatedLinear, Gating, Glu, HeadSpan,
    KvStore, LinearInfo, Parallel, PendingCopies, Resident, Router, Temperature, Tensor, F32,
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

/// cos/sin `[positions, half]` (times the scale), shared with the backend's
/// cache of tables (built once per frequency set, not every step).
pub struct RopeTable<D: Device> {
    tables: Arc<(Bytes<D>, Bytes<D>)>,
    half: usize,
    len: usize,
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

/// Keys and values of one layer of one sample: `[capacity positions, width]`, f32 (f32 compute) or
/// bf16 heads padded to 16 columns (bf16 compute: what `attention_bf16_vN` reads, half the bytes).
struct LayerKv<D: Device> {
    k: Bytes<D>,
    v: Bytes<D>,
    cap: usize,
}

/// One sample's cached positions and each layer's keys and values.
type KvEntry<D> = (usize, Vec<Option<LayerKv<D>>>);

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
        crate::backend::kv_cache::check_continuations(batch, |key| self.entries.get(&key).map_or(0, |e| e.0))?;
        for (s, seg) in batch.segments().iter().enumerate().filter(|(_, g)| g.uses_cache()) {
            self.entries.entry(seg.key).or_insert_with(|| (0, Vec::new())).0 = seg.pos0 + batch.range(s).len();
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

    /// Uploads a small host table into scratch slot `which` (0 or 1), returning its address.
    fn upload_table(&self, which: usize, data: &[u8]) -> Result<DevPtr, CudaError> {
        let mut s = self.scratch()?;
        let s = s.as_mut().expect("scratch made");
        let b = if which == 0 { &mut s.table } else { &mut s.table2 };
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

    fn linear_in(&self, w: LinearWeight, bias: Option<Vec<f32>>, kind: Parallel, f32_inputs: bool) -> Linear<D> {
        let (rows, cols) = (w.rows(), w.cols());
        let bf16_inputs = C::COMPUTE == crate::backend::Compute::Bf16 && !f32_inputs;
        let held = match &w {
            LinearWeight::Dense { .. } | LinearWeight::Mapped(_) => None,
            LinearWeight::MappedBf16(_) => Some(QuantKind::Bf16),
            LinearWeight::Quant(q) => Some(q.kind),
        };
        let to_bf16 = |v: &[f32]| -> Vec<u16> { v.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect() };
        // bf16 weights stay bf16 under either compute dtype: an f32 GEMM
        // reads them widened (`weight_operand`), as FP8/INT4 are expanded.
        let w = match w {
            LinearWeight::Dense { w, .. } if bf16_inputs => {
                Weight::Bf16(self.bytes(bytemuck::cast_slice(&to_bf16(&w))))
            }
            LinearWeight::Dense { w, .. } => Weight::F32(self.f32s(&w)),
            LinearWeight::Mapped(m) if bf16_inputs => {
                Weight::Bf16(self.bytes(bytemuck::cast_slice(&to_bf16(&m.to_vec()))))
            }
            LinearWeight::Mapped(m) => Weight::F32(self.f32s(&m.to_vec())),
            LinearWeight::MappedBf16(m) => Weight::Bf16(self.bytes(bytemuck::cast_slice(&m.to_vec()))),
            LinearWeight::Quant(q) if q.kind == QuantKind::Bf16 => {
                // bf16 codes with scale 1 (every scale is 1 by construction).
                let bits: Vec<u16> = q.codes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
                Weight::Bf16(self.bytes(bytemuck::cast_slice(&bits)))
            }
            LinearWeight::Quant(q) => self.quant(&q),
        };
        // One rank keeps its bias in the layer; with several, a row-parallel
        // bias is added once, after the all-reduce.
        let split = kind == Parallel::Row && self.world_size() > 1;
        let (inner, post) = if split { (None, bias) } else { (bias, None) };
        Linear {
            w,
            rows,
            cols,
            bias: inner.map(|b| self.f32s(&b)),
            post_bias: post.map(|b| self.f32s(&b)),
            kind,
            f32_inputs,
            held,
            kept: std::sync::OnceLock::new(),
        }
    }

    fn quant(&self, q: &QuantRows) -> Weight<D> {
        let ns = q.num_segments();
        let colseg: Vec<u32> = (0..q.cols).map(|c| (q.seg.partition_point(|&s| s <= c) - 1) as u32).collect();
        let codes = match q.kind {
            // Two codes per byte, as the checkpoint holds them (a padding nibble codes 0).
            QuantKind::Int4 | QuantKind::Mxfp4 => {
                let pad = if q.kind == QuantKind::Int4 { 8 } else { 0 };
                let half = q.cols.div_ceil(2);
                let mut packed = vec![0u8; q.rows * half];
                for r in 0..q.rows {
                    let row = &q.codes[r * q.cols..(r + 1) * q.cols];
                    for (i, pair) in row.chunks(2).enumerate() {
                        packed[r * half + i] = pair[0] | (pair.get(1).copied().unwrap_or(pad) << 4);
                    }
                }
                packed
            }
            QuantKind::Fp8 | QuantKind::Bf16 => q.codes.clone(),
        };
        Weight::Quant {
            kind: q.kind,
            codes: self.bytes(&codes),
            scales: self.f32s(&q.scales),
            colseg: self.bytes(bytemuck::cast_slice(&colseg)),
            segments: ns,
        }
    }

    /// Whether `l`'s GEMM reads bf16 inputs (bf16 compute, not an f32-input layer).
    fn bf16_inputs(&self, l: &Linear<D>) -> bool {
        C::COMPUTE == crate::backend::Compute::Bf16 && !l.f32_inputs
    }

    /// The bf16 GEMM input scratch, holding at least `bytes`.
    fn xb(&self, bytes: usize) -> Result<DevPtr, CudaError> {
        let mut s = self.scratch()?;
        let s = s.as_mut().expect("scratch made");
        self.ensure(&mut s.xb, bytes)?;
        Ok(s.xb.ptr)
    }

    /// What `l`'s GEMM reads for `rows` rows of f32 `x [rows, in]`: `x`
    /// itself, or (bf16 inputs) its rounding to bf16 in scratch.
    fn gemm_input(&self, l: &Linear<D>, x: DevPtr, rows: usize) -> Result<(DevPtr, GemmType), CudaError> {
        if !self.bf16_inputs(l) {
            return Ok((x, GemmType::F32));
        }
        let (inp, xb) = (l.cols, self.xb(rows * l.cols * 2)?);
        if rows > 0 {
            launch::to_bf16(&*self.dev, elementwise(rows * inp)?, x, int(rows), int(inp), 0, int(inp), xb)?;
        }
        Ok((xb, GemmType::Bf16))
    }

    /// `y[rows, out] (+)= x[rows, in] · Wᵀ` (no bias, no all-reduce) from
    /// an input already in the GEMM's type (see [`Self::gemm_input`]), FP8/INT4
    /// weights expanded first; `y` f32.
    fn gemm_from(
        &self,
        l: &Linear<D>,
        xin: (DevPtr, GemmType),
        rows: usize,
        y: DevPtr,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        self.gemm_into(l, xin, rows, (y, GemmType::F32), accumulate)
    }

    /// [`Self::gemm_from`] into `y` of type `y.1` (bf16: f32 accumulation,
    /// rounded once on the way out).
    fn gemm_into(
        &self,
        l: &Linear<D>,
        xin: (DevPtr, GemmType),
        rows: usize,
        y: (DevPtr, GemmType),
        accumulate: bool,
    ) -> Result<(), CudaError> {
        if rows == 0 {
            return Ok(());
        }
        let (out, inp) = (l.rows, l.cols);
        let bf16_inputs = self.bf16_inputs(l);
        let w = match &l.w {
            _ if l.expands(bf16_inputs) && l.kept.get().is_none() => {
                let es = if bf16_inputs { 2 } else { 4 };
                let wexp = {
                    let mut s = self.scratch()?;
                    let s = s.as_mut().expect("scratch made");
                    self.ensure(&mut s.wexp, out * inp * es)?;
                    s.wexp.ptr
                };
                self.weight_operand(l, bf16_inputs, wexp)?
            }
            _ => self.weight_operand(l, bf16_inputs, 0)?,
        };
        let g = Gemm::linear(w, xin, y.0, rows, out, inp, accumulate);
        self.dev.gemm(&Gemm { c_type: y.1, ..g })
    }

    /// `y[rows, out] (+)= x[rows, in] · Wᵀ` (no bias, no all-reduce): the
    /// input rounded to bf16 and FP8/INT4 weights expanded first, as the
    /// layer's compute dtype asks.
    fn gemm_rows(&self, l: &Linear<D>, x: DevPtr, rows: usize, y: DevPtr, accumulate: bool) -> Result<(), CudaError> {
        let xin = self.gemm_input(l, x, rows)?;
        self.gemm_from(l, xin, rows, y, accumulate)
    }

    /// A row-parallel layer's tail: the all-reduce of its `rows` output
    /// rows at `y`, then its bias, once.
    fn row_parallel_tail(&self, l: &Linear<D>, y: DevPtr, rows: usize) {
        if l.kind == Parallel::Row {
            self.join_all_reduce(y, rows * l.rows);
            if let Some(b) = &l.post_bias {
                self.run(|| self.add_bias(y, b, rows, l.rows));
            }
        }
    }

    /// `residual[rows] += input · Wᵀ + b`, `input` giving the GEMM's input
    /// when it runs (an op that fails before it skips it): one rank adds in
    /// the GEMM (beta = 1); split rows go through a partial buffer and the
    /// all-reduce first.
    fn add_linear(
        &self,
        l: &Linear<D>,
        rows: usize,
        residual: DevPtr,
        input: impl FnOnce() -> Result<(DevPtr, GemmType), CudaError>,
    ) {
        if l.kind == Parallel::Row && self.world_size() > 1 {
            let mut partial = 0;
            self.run(|| {
                partial = {
                    let mut s = self.scratch()?;
                    let s = s.as_mut().expect("scratch made");
                    self.ensure(&mut s.partial, rows * l.rows * 4)?;
                    s.partial.ptr
                };
                self.gemm_from(l, input()?, rows, partial, false)
            });
            self.join_all_reduce(partial, rows * l.rows);
            let bias = l.post_bias.as_ref().map_or(0, |b| b.ptr);
            self.run(|| {
                let cfg = elementwise(rows * l.rows)?;
                launch::add_bias_residual(&*self.dev, cfg, residual, partial, bias, int(rows), int(l.rows))
            });
            return;
        }
        self.run(|| {
            self.gemm_from(l, input()?, rows, residual, true)?;
            if let Some(b) = &l.bias {
                self.add_bias(residual, b, rows, l.rows)?;
            }
            Ok(())
        });
    }

    /// Where a GEMM reads `l`'s weight: resident as stored, or (FP8/INT4/MXFP4,
    /// or bf16 under an f32 GEMM) expanded by a kernel. The expansion is kept,
    /// on the first use, while device memory stays above [`keep_reserve`]
    /// after it (the same kernel, so the same bits, once instead of every
    /// forward: three times less weight traffic); otherwise it goes into
    /// `dst`, which holds `rows · cols` values of the GEMM's input type, every time.
    fn weight_operand(&self, l: &Linear<D>, bf16_inputs: bool, dst: DevPtr) -> Result<(DevPtr, GemmType), CudaError> {
        use std::sync::atomic::Ordering;
        let ty = if bf16_inputs { GemmType::Bf16 } else { GemmType::F32 };
        match &l.w {
            Weight::F32(b) => return Ok((b.ptr, GemmType::F32)),
            Weight::Bf16(b) if bf16_inputs => return Ok((b.ptr, GemmType::Bf16)),
            _ => {}
        }
        if let Some(k) = l.kept.get() {
            return Ok((k.ptr, ty));
        }
        let (out, inp) = (l.rows, l.cols);
        let bytes = out * inp * if bf16_inputs { 2 } else { 4 };
        let mut into = dst;
        let mut keep = None;
        if !self.keep_refused.load(Ordering::Relaxed) {
            // A device that cannot say what is free keeps nothing (the step goes on).
            let (free, total) = self.dev.memory().unwrap_or((0, 0));
            if free >= bytes.saturating_add(keep_reserve(total)) {
                let m = self.dev.alloc(bytes)?;
                into = self.dev.ptr(&m);
                keep = Some(Bytes { mem: Some(m), ptr: into, len: bytes });
            } else {
                self.keep_refused.store(true, Ordering::Relaxed);
                tracing::debug!("cuda: {free} bytes free of {total}: quantised and bf16 weights expanded per forward");
            }
        }
        let cfg = elementwise(out * inp)?;
        match &l.w {
            Weight::Quant { kind, codes, scales, colseg, segments } => {
                let dequant = match (kind, ty) {
                    (QuantKind::Fp8, GemmType::Bf16) => launch::dequant_fp8_bf16,
                    (QuantKind::Fp8, GemmType::F32) => launch::dequant_fp8_f32,
                    (QuantKind::Mxfp4, GemmType::Bf16) => launch::dequant_mxfp4_bf16,
                    (QuantKind::Mxfp4, GemmType::F32) => launch::dequant_mxfp4_f32,
                    // bf16 codes never reach here: `linear_in` holds them as `Weight::Bf16`.
                    (QuantKind::Int4 | QuantKind::Bf16, GemmType::Bf16) => launch::dequant_int4_bf16,
                    (QuantKind::Int4 | QuantKind::Bf16, GemmType::F32) => launch::dequant_int4_f32,
                };
                dequant(&*self.dev, cfg, codes.ptr, scales.ptr, colseg.ptr, int(out), int(inp), int(*segments), into)?;
            }
            // Widened for an f32 GEMM (bf16 GEMMs returned above).
            Weight::Bf16(b) => launch::bf16_to_f32_n(&*self.dev, cfg, b.ptr, int(out * inp), into)?,
            Weight::F32(_) => unreachable!("f32 weights returned above"),
        }
        if let Some(k) = keep {
            let _ = l.kept.set(k); // one thread per rank: unset until now
        }
        Ok((into, ty))
    }

    /// The routed experts' gated MLPs over the rows each received (expert
    /// `e`'s rows `starts[e]..starts[e + 1]` of `xe`, results into the same
    /// rows of `ye`): per chunk of experts, their gate/up GEMMs in one grouped
    /// launch, one SwiGLU over all the chunk's rows, their down GEMMs in
    /// another. A chunk is bounded by the scratch it needs (its rows'
    /// activations, and its experts' FP8/INT4 weights expanded), so memory
    /// does not grow with the number of experts.
    ///
    /// `xe` and `ye` are in the experts' activation type: bf16 under bf16
    /// compute (the grouped GEMM takes bf16 inputs only with bf16 output,
    /// see [`grouped_takes`](super::device::grouped_takes)), else f32.
    fn experts_grouped(
        &self,
        experts: &[GatedLinear<Self>],
        starts: &[usize],
        xe: DevPtr,
        ye: DevPtr,
    ) -> Result<(), CudaError> {
        let budget = self.moe_scratch;
        let Some(first) = experts.first() else { return Ok(()) };
        let (h, inter, h_out) = (first.gate_up_proj.cols, first.down_proj.cols, first.down_proj.rows);
        let bf16 = self.experts_bf16(first);
        let (ty, es) = if bf16 { (GemmType::Bf16, 2) } else { (GemmType::F32, 4) };
        let quant = experts.iter().any(|m| m.gate_up_proj.expands(bf16) || m.down_proj.expands(bf16));
        let per_expert = 2 * inter * h * es; // the larger of gate/up and down, expanded
        let max_experts = if quant { (budget / per_expert).max(1) } else { usize::MAX };
        let max_rows = (budget / (3 * inter * 4)).max(1);
        let active: Vec<usize> = (0..experts.len()).filter(|&e| starts[e + 1] > starts[e]).collect();
        let mut at = 0;
        while at < active.len() {
            // The chunk: at least one expert, then while the budgets hold.
            let mut end = at + 1;
            while end < active.len()
                && end - at < max_experts
                && starts[active[end] + 1] - starts[active[at]] <= max_rows
            {
                end += 1;
            }
            let chunk = &active[at..end];
            at = end;
            let r0 = starts[chunk[0]];
            let rows = starts[chunk[chunk.len() - 1] + 1] - r0;
            let mut s = self.scratch()?;
            let s = s.as_mut().expect("scratch made");
            self.ensure(&mut s.moe[3], rows * 2 * inter * es)?;
            self.ensure(&mut s.moe[4], rows * inter * es)?;
            let (gu, act) = (s.moe[3].ptr, s.moe[4].ptr);
            if quant {
                self.ensure(&mut s.wexp, chunk.len() * per_expert)?;
            }
            // One projection of every expert in the chunk: `x` holds the
            // chunk's rows of width `inp`, `y` receives them at width `out`,
            // both of type `ty`. `down`: the row-parallel down projection,
            // whose bias rank 0 alone adds.
            let project = |down: bool, x: DevPtr, inp: usize, y: DevPtr, out: usize| -> Result<(), CudaError> {
                fn pick<B: Backend>(m: &GatedLinear<B>, down: bool) -> &B::Linear {
                    if down {
                        &m.down_proj
                    } else {
                        &m.gate_up_proj
                    }
                }
                let mut gemms = Vec::with_capacity(chunk.len());
                for (j, &e) in chunk.iter().enumerate() {
                    let l = pick(&experts[e], down);
                    let w = self.weight_operand(l, bf16, s.wexp.ptr + (j * per_expert) as u64)?;
                    let (off, n) = (starts[e] - r0, starts[e + 1] - starts[e]);
                    let xe = (x + (off * inp * es) as u64, ty);
                    let y = y + (off * out * es) as u64;
                    gemms.push(Gemm { c_type: ty, ..Gemm::linear(w, xe, y, n, out, inp, false) });
                }
                self.dev.gemm_grouped(&gemms)?;
                for &e in chunk {
                    let l = pick(&experts[e], down);
                    // A row-parallel bias counts once over the group: rank 0 adds it.
                    let bias = if down {
                        l.bias.as_ref().or(l.post_bias.as_ref()).filter(|_| self.rank() == 0)
                    } else {
                        l.bias.as_ref()
                    };
                    if let Some(b) = bias {
                        let (off, n) = (starts[e] - r0, starts[e + 1] - starts[e]);
                        let add = if bf16 { launch::add_bias_bf16 } else { launch::add_bias };
                        add(&*self.dev, elementwise(n * out)?, y + (off * out * es) as u64, b.ptr, int(n), int(out))?;
                    }
                }
                Ok(())
            };
            project(false, xe + (r0 * h * es) as u64, h, gu, 2 * inter)?;
            let cfg = elementwise(rows * inter)?;
            match (first.act, bf16) {
                (Glu::Silu, true) => launch::swiglu_bf16(&*self.dev, cfg, gu, int(rows), int(inter), act)?,
                (Glu::Silu, false) => launch::swiglu(&*self.dev, cfg, gu, int(rows), int(inter), act)?,
                (Glu::GeluTanh, false) => launch::gelu_tanh_glu(&*self.dev, cfg, gu, int(rows), int(inter), act)?,
                (Glu::Clamped { alpha, limit }, false) => {
                    launch::clamped_glu(&*self.dev, cfg, gu, int(rows), int(inter), alpha, limit, act)?
                }
                (Glu::Clamped { alpha, limit }, true) => {
                    launch::clamped_glu_bf16(&*self.dev, cfg, gu, int(rows), int(inter), alpha, limit, act)?
                }
                (other, true) => {
                    return Err(CudaError::Kernel {
                        name: "moe_experts".into(),
                        log: format!("no bf16 kernel for the experts' activation {other:?}"),
                    })
                }
            }
            project(true, act, inter, ye + (r0 * h_out * es) as u64, h_out)?;
        }
        Ok(())
    }

    /// Whether an expert MLP's activations and GEMMs are bf16 (bf16 compute), not f32.
    fn experts_bf16(&self, m: &GatedLinear<Self>) -> bool {
        C::COMPUTE == crate::backend::Compute::Bf16 && !m.gate_up_proj.f32_inputs
    }

    fn add_bias(&self, y: DevPtr, b: &Bytes<D>, rows: usize, width: usize) -> Result<(), CudaError> {
        launch::add_bias(&*self.dev, elementwise(rows * width)?, y, b.ptr, int(rows), int(width))
    }

    /// In place: RoPE of `heads` of the rows of `x` (`width` values each, f32
    /// or bf16), at each token's position (see [`Backend::rope`]).
    fn rope_launch(
        &self,
        x: (DevPtr, GemmType),
        width: usize,
        heads: HeadSpan,
        interleave: bool,
        table: &RopeTable<D>,
        batch: &PackedBatch,
    ) -> Result<(), CudaError> {
        Self::holds("rope table positions", batch.max_position(), table.len)?;
        let pos = self.upload_positions(batch)?;
        // Heads per block: their rotated columns fit 32 KiB of shared memory.
        let chunk = (8192 / (2 * table.half).max(1)).clamp(1, heads.count.max(1));
        let cfg = Launch {
            grid: (batch.num_tokens() as u32, heads.count.div_ceil(chunk) as u32),
            block: 128,
            smem: (chunk * 2 * table.half * 4) as u32,
        };
        let (offset, count, stride) = (int(heads.offset), int(heads.count), int(heads.stride));
        let (cos, sin, half) = (table.tables.0.ptr, table.tables.1.ptr, int(table.half));
        let rope = if x.1 == GemmType::Bf16 { launch::rope_bf16 } else { launch::rope };
        rope(
            &*self.dev,
            cfg,
            x.0,
            int(width),
            offset,
            count,
            stride,
            half,
            interleave as i32,
            cos,
            sin,
            pos,
            int(chunk),
        )
    }

    /// Causal attention of `[q, k, v]` (see [`Backend::attention`]), each
    /// read where `src` says: f32 columns, or (bf16 compute) bf16 ones.
    #[allow(clippy::too_many_arguments)]
    fn attention_launch(
        &self,
        [q, k, v]: [Src; 3],
        s: AttnShape,
        sinks: Option<&Vector<D>>,
        batch: &PackedBatch,
        cache: &mut KvCache<D>,
        layer: usize,
        out: &mut Tensor<Self>,
    ) -> Result<(), CudaError> {
        if s.head_dim > 256 || s.v_dim > 256 {
            return Err(CudaError::Kernel {
                name: "attention".into(),
                log: format!("head dims {}/{} exceed the kernels' 256", s.head_dim, s.v_dim),
            });
        }
        let bf16 = C::COMPUTE == crate::backend::Compute::Bf16;
        // Keys and values as the kernel reads them, per position: f32 heads
        // as the projection wrote them, or (bf16) each head rounded and
        // padded to 16 columns; widths in values, and their bytes.
        let (kw, vw, es) = if bf16 {
            (s.kv_heads * pad16(s.head_dim), s.kv_heads * pad16(s.v_dim), 2)
        } else {
            (s.kv_heads * s.head_dim, s.kv_heads * s.v_dim, 4)
        };
        let t = batch.num_tokens();
        // bf16: this step's keys, values and queries, every row, packed once.
        let packed = if bf16 {
            let (kb, vb, qb) = {
                let mut sc = self.scratch()?;
                let sc = sc.as_mut().expect("scratch made");
                self.ensure(&mut sc.kv[0], t * kw * 2)?;
                self.ensure(&mut sc.kv[1], t * vw * 2)?;
                self.ensure(&mut sc.kv[2], t * s.heads * pad16(s.head_dim) * 2)?;
                (sc.kv[0].ptr, sc.kv[1].ptr, sc.kv[2].ptr)
            };
            for (src, dst, heads, width) in
                [(&k, kb, s.kv_heads, s.head_dim), (&v, vb, s.kv_heads, s.v_dim), (&q, qb, s.heads, s.head_dim)]
            {
                let cfg = Launch { grid: (t as u32, 1), block: 128, smem: 0 };
                let (x, stride, offset) = (src.ptr, int(src.stride), int(src.offset));
                let (heads, wpad) = (int(heads), int(pad16(width)));
                let pack = if src.bf16 { launch::pack_heads_bf16_from_bf16 } else { launch::pack_heads_bf16 };
                pack(&*self.dev, cfg, x, stride, offset, heads, int(width), wpad, dst)?;
            }
            Some((kb, vb, qb))
        } else {
            if [q, k, v].iter().any(|x| x.bf16) {
                return Err(CudaError::Kernel {
                    name: "attention".into(),
                    log: "bf16 inputs under f32 compute".into(),
                });
            }
            None
        };
        // One 40-byte `Seg` per segment (common.cuh), little-endian.
        let mut segs = Vec::with_capacity(batch.num_samples() * 40);
        for (i, seg) in batch.segments().iter().enumerate() {
            let rows = batch.range(i);
            let (kp, vp, ks, vs) = if seg.uses_cache() {
                let entry = cache.entries.get_mut(&seg.key).expect("begin() made the entry");
                if entry.1.len() <= layer {
                    entry.1.resize_with(layer + 1, || None);
                }
                let need = seg.pos0 + rows.len();
                let slot = &mut entry.1[layer];
                if slot.is_none() && seg.pos0 > 0 {
                    // begin() checked the sample's positions; a layer without them is a broken cache.
                    return Err(CudaError::Kernel {
                        name: "attention".into(),
                        log: format!("layer {layer} has no cached keys for positions 0..{} of its sample", seg.pos0),
                    });
                }
                if slot.as_ref().is_none_or(|l| l.cap < need) {
                    // Grow to twice the need, keeping the earlier positions.
                    let cap = (2 * need).max(64);
                    let mut fresh =
                        LayerKv { k: Bytes { mem: None, ptr: 0, len: 0 }, v: Bytes { mem: None, ptr: 0, len: 0 }, cap };
                    self.ensure(&mut fresh.k, cap * kw * es)?;
                    self.ensure(&mut fresh.v, cap * vw * es)?;
                    if let Some(old) = slot.as_ref() {
                        self.dev.copy(fresh.k.ptr, old.k.ptr, seg.pos0 * kw * es)?;
                        self.dev.copy(fresh.v.ptr, old.v.ptr, seg.pos0 * vw * es)?;
                    }
                    *slot = Some(fresh);
                }
                let l = slot.as_ref().expect("made above");
                if let Some((kb, vb, _)) = packed {
                    // The step's packed rows are already in the cache's layout.
                    for (src, dst, w) in [(kb, &l.k, kw), (vb, &l.v, vw)] {
                        let at = |pos: usize| (pos * w * es) as u64;
                        self.dev.copy(dst.ptr + at(seg.pos0), src + at(rows.start), rows.len() * w * es)?;
                    }
                } else {
                    for (src, dst, w) in [(&k, &l.k, kw), (&v, &l.v, vw)] {
                        launch::pack_cols(
                            &*self.dev,
                            elementwise(rows.len() * w)?,
                            src.at(rows.start * src.stride),
                            int(rows.len()),
                            int(src.stride),
                            int(src.offset),
                            int(w),
                            dst.ptr + (seg.pos0 * w * es) as u64,
                        )?;
                    }
                }
                (l.k.ptr, l.v.ptr, kw, vw)
            } else if let Some((kb, vb, _)) = packed {
                (kb + (rows.start * kw * es) as u64, vb + (rows.start * vw * es) as u64, kw, vw)
            } else {
                (k.at(rows.start * k.stride + k.offset), v.at(rows.start * v.stride + v.offset), k.stride, v.stride)
            };
            segs.extend_from_slice(&kp.to_le_bytes());
            segs.extend_from_slice(&vp.to_le_bytes());
            for x in [ks, vs, rows.start, rows.len(), seg.pos0, seg.pos0 + rows.len()] {
                segs.extend_from_slice(&(x as i32).to_le_bytes());
            }
        }
        let segs = self.upload_table(0, &segs)?;
        let (window, chunk) = s.mask.window_and_chunk();
        let (window, chunk) = (window.min(i32::MAX as usize) as i32, chunk.min(i32::MAX as usize) as i32);
        let op = out.storage().ptr;
        let (heads, kvh, hd, vd) = (int(s.heads), int(s.kv_heads), int(s.head_dim), int(s.v_dim));
        if let Some(v) = sinks {
            Self::holds("attention sinks", s.heads, v.0.len / 4)?;
        }
        let sinkp = sinks.map_or(0, |v| v.0.ptr); // null: no sinks
        if let Some((_, _, qb)) = packed {
            let tiles: Vec<i32> = (0..batch.num_samples())
                .flat_map(|i| (0..batch.range(i).len()).step_by(64).flat_map(move |q0| [i as i32, q0 as i32]))
                .collect();
            let table = self.upload_table(1, bytemuck::cast_slice(&tiles))?;
            let smem = attention_bf16_smem(s.head_dim, s.v_dim);
            let cfg = Launch { grid: ((tiles.len() / 2) as u32, s.heads as u32), block: 128, smem };
            let qs = int(s.heads * pad16(s.head_dim));
            attention_bf16_kernel(s.v_dim)(
                &*self.dev, cfg, qb, qs, segs, table, heads, kvh, hd, vd, window, chunk, s.scale, sinkp, op,
            )
        } else {
            let (qp, qs) = (q.at(q.offset), int(q.stride));
            let seg_of: Vec<u32> =
                (0..batch.num_samples()).flat_map(|i| batch.range(i).map(move |_| i as u32)).collect();
            let table = self.upload_table(1, bytemuck::cast_slice(&seg_of))?;
            let cfg = Launch { grid: (t as u32, s.heads.div_ceil(4) as u32), block: 128, smem: 0 };
            let sc = s.scale;
            launch::attention_f32(
                &*self.dev, cfg, qp, qs, segs, table, heads, kvh, hd, vd, window, chunk, sc, sinkp, op,
            )
        }
    }
}

/// Where attention reads its queries, keys or values: columns `offset ..`
/// of rows `stride` values apart from `ptr`, f32 or (a bf16 projection's) bf16.
#[derive(Clone, Copy, Debug)]
struct Src {
    ptr: DevPtr,
    stride: usize,
    offset: usize,
    bf16: bool,
}

impl Src {
    /// f32 columns of a backend tensor.
    fn f32<D: Device, C: ComputeDtype>(c: &Cols<'_, Cuda<C, D>>) -> Src {
        Src { ptr: c.storage.ptr, stride: c.stride, offset: c.offset, bf16: false }
    }

    /// The address of value `i`.
    fn at(&self, i: usize) -> DevPtr {
        self.ptr + (i * if self.bf16 { 2 } else { 4 }) as u64
    }
}

/// Device memory left free when an expanded FP8/INT4 weight is kept: room
/// for the activations, caches and scratch of steps larger than those so far
/// (an eighth of the device, at least 8 GiB).
pub fn keep_reserve(total: usize) -> usize {
    (8usize << 30).max(total / 8)
}

/// A head dim rounded up to 16: the width of each head of the bf16 keys and
/// values `attention_bf16_vN` reads (zero-padded).
pub fn pad16(dim: usize) -> usize {
    dim.div_ceil(16) * 16
}

/// The `attention_bf16_vN` for value head dim `v_dim` (at most 256): the
/// narrowest N that holds it.
pub fn attention_bf16_kernel<D: Device>(v_dim: usize) -> AttentionLaunch<D> {
    match v_dim {
        0..=16 => launch::attention_bf16_v16,
        17..=32 => launch::attention_bf16_v32,
        33..=64 => launch::attention_bf16_v64,
        65..=128 => launch::attention_bf16_v128,
        _ => launch::attention_bf16_v256,
    }
}

/// Dynamic shared memory of `attention_bf16_vN` at head dims `(hd, vd)`:
/// Q [64][dp+8], K 2×[32][dp+8] and V 2×[32][vp+8] bf16 (attention.cu).
pub fn attention_bf16_smem(hd: usize, vd: usize) -> u32 {
    let (ldk, ldv) = (pad16(hd) + 8, pad16(vd) + 8);
    ((64 * ldk + 2 * 32 * ldk + 2 * 32 * ldv) * 2) as u32
}

/// The launcher of one `attention_bf16_vN` (they share a signature).
pub type AttentionLaunch<D> = fn(
    &D,
    Launch,
    DevPtr,
    i32,
    DevPtr,
    DevPtr,
    i32,
    i32,
    i32,
    i32,
    i32,
    i32,
    f32,
    DevPtr,
    DevPtr,
) -> Result<(), CudaError>;

impl<C: ComputeDtype, D: Device> Backend for Cuda<C, D> {
    type Compute = C;
    type Storage = Buf<D>;
    type Vector = Vector<D>;
    type Embedding = Embedding<D>;
    type Linear = Linear<D>;
    type RopeTable = RopeTable<D>;
    type Routes = Routes<D>;
    type KvCache = KvCache<D>;
    type DeltaState = crate::backend::DeltaCache<DeltaLayer<D>>;

    const NAME: &'static str = "cuda";

    fn native_bf16() -> bool {
        true // every GPU the kernels target (sm_80+) has bf16 tensor cores
    }

    fn kernel(&self) -> &'static str {
        self.dev.gemm_path().kernel(C::COMPUTE)
    }

    fn rank(&self) -> usize {
        self.dev.rank().0
    }

    fn world_size(&self) -> usize {
        self.dev.rank().1
    }

    fn abort_group(&self, why: &str) {
        self.dev.abort(why);
    }

    fn group(&self, n: usize) -> Result<Vec<Self>, BackendError> {
        if n == 0 {
            return Err(BackendError::Unsupported("--tp must be at least 1".into()));
        }
        let ordinals: Vec<usize> =
            if self.ordinals.len() >= n { self.ordinals[..n].to_vec() } else { (0..n).collect() };
        let devs = self.dev.group(&ordinals).map_err(BackendError::Device)?;
        Ok(devs.into_iter().map(|d| Cuda::new(d, ordinals.clone()).moe_scratch(self.moe_scratch)).collect())
    }

    fn alloc(&self, len: usize) -> Buf<D> {
        let mut b = Buf::empty();
        self.run(|| {
            let m = self.dev.alloc_zeroed(len * 4)?;
            (b.ptr, b.cap, b.len) = (self.dev.ptr(&m), len, len);
            b.mem = Some(m);
            Ok(())
        });
        b
    }

    fn realloc(&self, s: &mut Buf<D>, len: usize) {
        if len <= s.cap && s.mem.is_some() {
            s.len = len;
            return;
        }
        self.run(|| {
            s.mem = None;
            let m = self.dev.alloc(len * 4)?;
            s.ptr = self.dev.ptr(&m);
            s.mem = Some(m);
            s.cap = len;
            s.len = len;
            Ok(())
        });
    }

    fn upload(&self, host: &[f32]) -> Buf<D> {
        let mut b = Buf::empty();
        self.realloc(&mut b, host.len());
        self.run(|| self.dev.upload(b.ptr, bytemuck::cast_slice(host)));
        b.len = host.len();
        b
    }

    fn download(&self, s: &Buf<D>, out: &mut [f32]) {
        self.run(|| {
            Self::holds("download", out.len(), s.len)?;
            self.dev.download(s.ptr, bytemuck::cast_slice_mut(out))
        });
    }

    fn vector(&self, v: Vec<f32>) -> Vector<D> {
        Vector(self.f32s(&v))
    }

    fn embedding(&self, bytes: TensorBytes, dtype: DType, hidden: usize) -> Embedding<D> {
        if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
            self.fail(BackendError::Unsupported(format!(
                "the CUDA backend reads embedding tables in f32, bf16 or f16, not {dtype}"
            )));
        }
        let vocab = bytes.len() / (hidden * dtype.size()).max(1);
        Embedding { table: self.bytes(&bytes), dtype, hidden, vocab }
    }

    fn linear(&self, w: LinearWeight, bias: Option<Vec<f32>>, kind: Parallel) -> Linear<D> {
        self.linear_in(w, bias, kind, false)
    }

    fn linear_f32(&self, w: LinearWeight, bias: Option<Vec<f32>>, kind: Parallel) -> Linear<D> {
        self.linear_in(w, bias, kind, true)
    }

    fn embed<H: Dim>(&self, table: &Embedding<D>, batch: &PackedBatch, out: &mut Tensor<Self, H>) {
        check::embed(batch, table.hidden, out);
        self.run(|| {
            if let Some(&bad) = batch.token_ids().iter().find(|&&id| id as usize >= table.vocab) {
                return Err(CudaError::Shape(ShapeError::new("embed", "token id", table.vocab, bad as usize + 1)));
            }
            let ids = self.upload_table(0, bytemuck::cast_slice(batch.token_ids()))?;
            let embed = match table.dtype {
                DType::BF16 => launch::embed_bf16,
                DType::F16 => launch::embed_f16,
                _ => launch::embed_f32,
            };
            let t = batch.num_tokens();
            let cfg = elementwise(t * table.hidden)?;
            embed(&*self.dev, cfg, table.table.ptr, ids, int(t), int(table.hidden), out.storage().ptr)
        });
    }

    fn rms_norm<W: Dim>(&self, x: Cols<'_, Self>, w: &Vector<D>, eps: f32, out: &mut Tensor<Self, W>) {
        check::rms_norm(&x, w.0.len / 4, (out.rows(), out.width().size()));
        self.run(|| {
            Self::holds("rms_norm input", x.rows * x.stride, x.storage.len)?;
            let cfg = Launch { grid: (x.rows as u32, 1), block: 256, smem: 0 };
            let (stride, offset, width) = (int(x.stride), int(x.offset), int(x.width));
            launch::rms_norm(&*self.dev, cfg, x.storage.ptr, stride, offset, width, w.0.ptr, eps, out.storage().ptr)
        });
    }

    fn rms_norm_heads(&self, x: &mut Tensor<Self>, heads: HeadSpan, w: &Vector<D>, eps: f32) {
        check::rms_norm_heads(x, heads, w.0.len / 4);
        let cfg = Launch { grid: (x.rows() as u32, heads.count as u32), block: 64, smem: 0 };
        let (ptr, width) = (x.storage().ptr, int(x.width()));
        let (offset, stride, hw) = (int(heads.offset), int(heads.stride), int(heads.width));
        self.run(|| launch::rms_norm_heads(&*self.dev, cfg, ptr, width, offset, stride, hw, w.0.ptr, eps));
    }

    fn sum_squares_heads(&self, x: &Tensor<Self>, heads: HeadSpan, out: &mut Tensor<Self>, col: usize) {
        check::sum_squares_heads(x, heads, out, col);
        let cfg = Launch { grid: (x.rows() as u32, heads.count as u32), block: 128, smem: 0 };
        let (ptr, width, o, ow) = (x.storage().ptr, int(x.width()), out.storage().ptr, int(out.width()));
        let (offset, stride, hw) = (int(heads.offset), int(heads.stride), int(heads.width));
        self.run(|| launch::sum_squares_heads(&*self.dev, cfg, ptr, width, offset, stride, hw, o, ow, int(col)));
    }

    fn scale_heads_rms(
        &self,
        x: &mut Tensor<Self>,
        heads: HeadSpan,
        sums: &Tensor<Self>,
        col: usize,
        n: usize,
        w: &Vector<D>,
        eps: f32,
    ) {
        check::scale_heads_rms(x, heads, sums, col, n, w.0.len / 4);
        let cfg = Launch { grid: (x.rows() as u32, heads.count as u32), block: 128, smem: 0 };
        let (ptr, width, s, sw) = (x.storage().ptr, int(x.width()), sums.storage().ptr, int(sums.width()));
        let (offset, stride, hw) = (int(heads.offset), int(heads.stride), int(heads.width));
        self.run(|| {
            launch::scale_heads_rms(
                &*self.dev,
                cfg,
                ptr,
                width,
                offset,
                stride,
                hw,
                s,
                sw,
                int(col),
                int(n),
                w.0.ptr,
                eps,
            )
        });
    }

    fn rope_table(&self, freqs: &RopeFreqs, len: usize) -> RopeTable<D> {
        let half = freqs.inv_freq.len();
        let key: Vec<u32> = freqs.inv_freq.iter().map(|f| f.to_bits()).collect();
        let scale = freqs.scale.to_bits();
        let mut ropes = self.ropes.lock().unwrap_or_else(|e| e.into_inner());
        let at = ropes.iter().position(|r| r.0 == key && r.1 == scale);
        if let Some(r) = at.map(|i| &ropes[i]).filter(|r| r.2 >= len) {
            return RopeTable { tables: r.3.clone(), half, len: r.2 };
        }
        // Built on the host once, and again only when a step reaches past
        // it, then twice as long: a position's values do not depend on the
        // table's length. The angle as HF forms it (an f32 product), as the
        // CPU backend does.
        let len = at.map_or(len, |i| len.max(2 * ropes[i].2));
        let (mut cos, mut sin) = (vec![0f32; len * half], vec![0f32; len * half]);
        for p in 0..len {
            for (i, f) in freqs.inv_freq.iter().enumerate() {
                let a = p as f32 * f;
                cos[p * half + i] = a.cos() * freqs.scale;
                sin[p * half + i] = a.sin() * freqs.scale;
            }
        }
        let tables = Arc::new((self.f32s(&cos), self.f32s(&sin)));
        if self.ok() {
            // (A failed upload is not cached: the step fails with its error.)
            if let Some(i) = at {
                ropes.remove(i);
            }
            ropes.push((key, scale, len, tables.clone()));
        }
        RopeTable { tables, half, len }
    }

    fn rope(&self, x: &mut Tensor<Self>, heads: HeadSpan, interleave: bool, table: &RopeTable<D>, batch: &PackedBatch) {
        check::rope(x, heads, table.half, batch);
        let (ptr, width) = (x.storage().ptr, x.width());
        self.run(|| self.rope_launch((ptr, GemmType::F32), width, heads, interleave, table, batch));
    }

    fn glu(&self, act: Glu, gate_up: &Tensor<Self>, out: &mut Tensor<Self>) {
        check::glu("glu", gate_up, out);
        let (rows, inter) = (out.rows(), out.width());
        let (gu, o) = (gate_up.storage().ptr, out.storage().ptr);
        let cfg = elementwise(rows * inter);
        self.run(|| match act {
            Glu::Silu => launch::swiglu(&*self.dev, cfg?, gu, int(rows), int(inter), o),
            Glu::GeluTanh => launch::gelu_tanh_glu(&*self.dev, cfg?, gu, int(rows), int(inter), o),
            Glu::Clamped { alpha, limit } => {
                launch::clamped_glu(&*self.dev, cfg?, gu, int(rows), int(inter), alpha, limit, o)
            }
        });
    }

    fn attn_temperature(&self, x: &mut Tensor<Self>, heads: HeadSpan, t: Temperature, batch: &PackedBatch) {
        check::temperature(x, heads, batch);
        let (xp, rows, stride) = (x.storage().ptr, x.rows(), x.width());
        self.run(|| {
            let pos = self.upload_positions(batch)?;
            let (offset, count, hstride, width) =
                (int(heads.offset), int(heads.count), int(heads.stride), int(heads.width));
            let cfg = elementwise(rows * heads.count * heads.width)?;
            let (fs, s) = (t.floor_scale, t.attn_scale);
            launch::attn_temperature(
                &*self.dev,
                cfg,
                xp,
                int(rows),
                int(stride),
                offset,
                count,
                hstride,
                width,
                pos,
                fs,
                s,
            )
        });
    }

    fn scale<W: Dim>(&self, x: &mut Tensor<Self, W>, s: f32) {
        let (xp, n) = (x.storage().ptr, x.len());
        self.run(|| launch::scale(&*self.dev, elementwise(n)?, xp, s, int(n)));
    }

    fn add<W: Dim>(&self, x: &mut Tensor<Self, W>, y: &Tensor<Self, W>) {
        check::add(x, y);
        let (xp, yp, n) = (x.storage().ptr, y.storage().ptr, x.len());
        self.run(|| launch::add(&*self.dev, elementwise(n)?, xp, yp, int(n)));
    }

    fn copy_heads(&self, src: &Tensor<Self>, from: HeadSpan, dst: &mut Tensor<Self>, to: HeadSpan) {
        check::copy_heads(src, from, dst, to);
        let n = src.rows() * to.count * to.width;
        let (s, sw, d, dw) = (src.storage().ptr, int(src.width()), dst.storage().ptr, int(dst.width()));
        let (fo, fs, to_o, ts) = (int(from.offset), int(from.stride), int(to.offset), int(to.stride));
        let (rows, count, width) = (int(src.rows()), int(to.count), int(to.width));
        self.run(|| {
            launch::copy_heads(&*self.dev, elementwise(n)?, s, sw, fo, fs, d, dw, to_o, ts, rows, count, width)
        });
    }

    fn linear_forward<W: Dim, V: Dim>(&self, l: &Linear<D>, x: &Tensor<Self, W>, out: &mut Tensor<Self, V>) {
        check::linear(l, x, out);
        let (rows, y) = (x.rows(), out.storage().ptr);
        self.run(|| {
            self.gemm_rows(l, x.storage().ptr, rows, y, false)?;
            if let Some(b) = &l.bias {
                self.add_bias(y, b, rows, l.rows)?;
            }
            Ok(())
        });
        self.row_parallel_tail(l, y, rows);
    }

    fn norm_linear_forward<W: Dim, V: Dim>(
        &self,
        l: &Linear<D>,
        x: &Tensor<Self, W>,
        w: &Vector<D>,
        eps: f32,
        normed: &mut Tensor<Self, W>,
        out: &mut Tensor<Self, V>,
    ) {
        if !self.bf16_inputs(l) {
            self.rms_norm(x.all(), w, eps, normed);
            return self.linear_forward(l, normed, out);
        }
        check::rms_norm(&x.all(), w.0.len / 4, (normed.rows(), normed.width().size()));
        check::linear(l, normed, out);
        // The norm writes its rows rounded to bf16 straight into the GEMM's
        // input (the bits rms_norm then to_bf16 give): `normed` is never
        // written, and the f32 copy's write and read are saved.
        let (rows, y) = (x.rows(), out.storage().ptr);
        self.run(|| {
            if rows == 0 {
                return Ok(());
            }
            let (xb, width) = (self.xb(rows * l.cols * 2)?, x.width().size());
            let cfg = Launch { grid: (rows as u32, 1), block: 256, smem: 0 };
            launch::rms_norm_bf16(&*self.dev, cfg, x.storage().ptr, int(width), 0, int(width), w.0.ptr, eps, xb)?;
            self.gemm_from(l, (xb, GemmType::Bf16), rows, y, false)?;
            if let Some(b) = &l.bias {
                self.add_bias(y, b, rows, l.rows)?;
            }
            Ok(())
        });
        self.row_parallel_tail(l, y, rows);
    }

    fn linear_add<W: Dim, V: Dim>(&self, l: &Linear<D>, x: &Tensor<Self, W>, residual: &mut Tensor<Self, V>) {
        check::linear(l, x, residual);
        let (rows, xp) = (x.rows(), x.storage().ptr);
        self.add_linear(l, rows, residual.storage().ptr, || self.gemm_input(l, xp, rows));
    }

    fn swiglu_linear_add<V: Dim>(
        &self,
        l: &Linear<D>,
        gate_up: &Tensor<Self>,
        act: &mut Tensor<Self>,
        residual: &mut Tensor<Self, V>,
    ) {
        if !self.bf16_inputs(l) {
            self.glu(Glu::Silu, gate_up, act);
            return self.linear_add(l, act, residual);
        }
        check::swiglu(gate_up, act);
        check::linear(l, act, residual);
        // SwiGLU writes its output rounded to bf16 straight into the down
        // GEMM's input (the bits swiglu then to_bf16 give): `act` is never
        // written, and the f32 copy's write and read are saved.
        let (rows, inter, gu) = (act.rows(), act.width(), gate_up.storage().ptr);
        self.add_linear(l, rows, residual.storage().ptr, || {
            let xb = self.xb(rows * inter * 2)?;
            if rows > 0 {
                launch::swiglu_to_bf16(&*self.dev, elementwise(rows * inter)?, gu, int(rows), int(inter), xb)?;
            }
            Ok((xb, GemmType::Bf16))
        });
    }

    fn norm_gated_mlp_add<H: Dim>(
        &self,
        gate_up: &Linear<D>,
        down: &Linear<D>,
        w: &Vector<D>,
        eps: f32,
        x: &mut Tensor<Self, H>,
        normed: &mut Tensor<Self, H>,
        gate_up_out: &mut Tensor<Self>,
        act: &mut Tensor<Self>,
    ) {
        if !self.bf16_inputs(gate_up) || !self.bf16_inputs(down) || gate_up.kind == Parallel::Row {
            self.norm_linear_forward(gate_up, x, w, eps, normed, gate_up_out);
            return self.swiglu_linear_add(down, gate_up_out, act, x);
        }
        check::rms_norm(&x.all(), w.0.len / 4, (normed.rows(), normed.width().size()));
        check::linear(gate_up, normed, gate_up_out);
        check::swiglu(gate_up_out, act);
        check::linear(down, act, x);
        // bf16 from the norm to the down GEMM, as PyTorch's bf16 run keeps
        // them: the norm writes the gate/up GEMM's input, that GEMM writes
        // bf16 (f32 accumulation), SwiGLU reads and writes bf16, the down
        // GEMM adds into the f32 residual. No f32 [T, 2·inter] is written or
        // read (8 bytes per element less than the f32 gate/up output).
        let (rows, h, inter) = (x.rows(), x.width().size(), act.width());
        let mut gu = 0;
        self.run(|| {
            if rows == 0 {
                return Ok(());
            }
            let xb = self.xb(rows * h.max(inter) * 2)?;
            gu = {
                let mut s = self.scratch()?;
                let s = s.as_mut().expect("scratch made");
                self.ensure(&mut s.mlp, rows * 2 * inter * 2)?;
                s.mlp.ptr
            };
            let cfg = Launch { grid: (rows as u32, 1), block: 256, smem: 0 };
            launch::rms_norm_bf16(&*self.dev, cfg, x.storage().ptr, int(h), 0, int(h), w.0.ptr, eps, xb)?;
            self.gemm_into(gate_up, (xb, GemmType::Bf16), rows, (gu, GemmType::Bf16), false)?;
            if let Some(b) = &gate_up.bias {
                let cfg = elementwise(rows * 2 * inter)?;
                launch::add_bias_bf16(&*self.dev, cfg, gu, b.ptr, int(rows), int(2 * inter))?;
            }
            Ok(())
        });
        self.add_linear(down, rows, x.storage().ptr, || {
            let xb = self.xb(rows * inter * 2)?;
            if rows > 0 {
                launch::swiglu_bf16(&*self.dev, elementwise(rows * inter)?, gu, int(rows), int(inter), xb)?;
            }
            Ok((xb, GemmType::Bf16))
        });
    }

    fn norm_attention_add<H: Dim>(
        &self,
        a: &AttnBlock<'_, Self>,
        x: &mut Tensor<Self, H>,
        normed: &mut Tensor<Self, H>,
        qkv: &mut Tensor<Self>,
        out: &mut Tensor<Self>,
        rope: &RopeTable<D>,
        batch: &PackedBatch,
        cache: &mut KvCache<D>,
        layer: usize,
    ) {
        let (l, (w, eps)) = (a.qkv_proj, a.norm);
        // (A norm over all heads sums its squares across ranks between two
        // f32 ops: that block runs op by op.)
        let all_heads = a.qk_norm.as_ref().is_some_and(|n| n.all_heads);
        if !self.bf16_inputs(l) || l.kind == Parallel::Row || all_heads {
            return crate::backend::attention_block_ops(self, a, x, normed, qkv, out, rope, batch, cache, layer);
        }
        let s = a.shape;
        let (nh, nkv, hd) = (s.heads, s.kv_heads, s.head_dim);
        check::rms_norm(&x.all(), w.0.len / 4, (normed.rows(), normed.width().size()));
        check::linear(l, normed, qkv);
        let spans = [HeadSpan::heads(0, nh, hd), HeadSpan::heads(nh * hd, nkv, hd)];
        if let Some(n) = &a.qk_norm {
            check::rms_norm_heads(qkv, spans[0], n.q.0.len / 4);
            check::rms_norm_heads(qkv, spans[1], n.k.0.len / 4);
        }
        check::rope(qkv, a.rope_span(), rope.half, batch);
        let (q, k, v) = (qkv.cols(0, nh * hd), qkv.cols(nh * hd, nkv * hd), qkv.cols((nh + nkv) * hd, nkv * hd));
        check::attention(&q, &k, &v, s, batch, (out.rows(), out.width()));
        // bf16 from the norm to the attention kernel, as PyTorch's bf16 run
        // keeps q, k and v: the norm writes the GEMM's input, the GEMM writes
        // bf16 (f32 accumulation), the q/k norms and RoPE work in f32 on
        // bf16 rows and round once, the attention packs them. No f32
        // [T, (heads + 2·kv_heads)·hd] is written or read.
        let (rows, h, width) = (x.rows(), x.width().size(), qkv.width());
        self.run(|| {
            if rows == 0 {
                return Ok(());
            }
            let xb = self.xb(rows * h * 2)?;
            let qkvb = {
                let mut sc = self.scratch()?;
                let sc = sc.as_mut().expect("scratch made");
                self.ensure(&mut sc.qkv, rows * width * 2)?;
                sc.qkv.ptr
            };
            let cfg = Launch { grid: (rows as u32, 1), block: 256, smem: 0 };
            launch::rms_norm_bf16(&*self.dev, cfg, x.storage().ptr, int(h), 0, int(h), w.0.ptr, eps, xb)?;
            self.gemm_into(l, (xb, GemmType::Bf16), rows, (qkvb, GemmType::Bf16), false)?;
            if let Some(b) = &l.bias {
                launch::add_bias_bf16(&*self.dev, elementwise(rows * width)?, qkvb, b.ptr, int(rows), int(width))?;
            }
            if let Some(qk) = &a.qk_norm {
                let eps = qk.eps;
                for (span, n) in spans.into_iter().zip([qk.q, qk.k]) {
                    let cfg = Launch { grid: (rows as u32, span.count as u32), block: 64, smem: 0 };
                    let (offset, stride, hw) = (int(span.offset), int(span.stride), int(span.width));
                    launch::rms_norm_heads_bf16(&*self.dev, cfg, qkvb, int(width), offset, stride, hw, n.0.ptr, eps)?;
                }
            }
            self.rope_launch((qkvb, GemmType::Bf16), width, a.rope_span(), false, rope, batch)?;
            let col = |offset: usize| Src { ptr: qkvb, stride: width, offset, bf16: true };
            self.attention_launch([col(0), col(nh * hd), col((nh + nkv) * hd)], s, a.sinks, batch, cache, layer, out)
        });
        self.linear_add(a.o_proj, out, x);
    }

    fn attention(
        &self,
        q: Cols<'_, Self>,
        k: Cols<'_, Self>,
        v: Cols<'_, Self>,
        shape: AttnShape,
        sinks: Option<&Vector<D>>,
        batch: &PackedBatch,
        cache: &mut KvCache<D>,
        layer: usize,
        out: &mut Tensor<Self>,
    ) {
        check::attention(&q, &k, &v, shape, batch, (out.rows(), out.width()));
        let src = [Src::f32(&q), Src::f32(&k), Src::f32(&v)];
        self.run(|| self.attention_launch(src, shape, sinks, batch, cache, layer, out));
    }

    fn causal_conv1d(
        &self,
        x: Cols<'_, Self>,
        w: &Vector<D>,
        shape: crate::backend::DeltaShape,
        batch: &PackedBatch,
        state: &mut Self::DeltaState,
        layer: usize,
        out: &mut Tensor<Self>,
    ) {
        check::conv1d(&x, w.0.len / 4, shape, batch, out);
        let (c, k, t) = (shape.channels(), shape.conv_kernel, batch.num_tokens());
        self.run(|| {
            if k > 9 {
                return Err(CudaError::Kernel {
                    name: "causal_conv1d".into(),
                    log: format!("a conv of {k} taps: the kernel keeps at most 8 earlier inputs"),
                });
            }
            // One 16-byte `ConvSeg` per segment (kernels/delta.cu), and each token's segment.
            let mut segs = Vec::with_capacity(batch.num_samples() * 16);
            let mut seg_of = Vec::with_capacity(t);
            for (si, seg) in batch.segments().iter().enumerate() {
                let rows = batch.range(si);
                let ptr = if seg.uses_cache() {
                    let l = state.0.layer_mut(seg.key, layer);
                    self.zeroed(&mut l.conv, (k - 1) * c * 4)?;
                    l.conv.ptr
                } else {
                    0
                };
                segs.extend_from_slice(&ptr.to_le_bytes());
                for v in [rows.start, rows.len()] {
                    segs.extend_from_slice(&int(v).to_le_bytes());
                }
                seg_of.extend(std::iter::repeat_n(si as u32, rows.len()));
            }
            let segs = self.upload_table(0, &segs)?;
            let seg_of = self.upload_table(1, bytemuck::cast_slice(&seg_of))?;
            let (xp, xs, xo) = (x.storage.ptr, int(x.stride), int(x.offset));
            let cfg = elementwise(t * c)?;
            launch::causal_conv1d(
                &*self.dev,
                cfg,
                xp,
                xs,
                xo,
                int(t),
                int(c),
                int(k),
                w.0.ptr,
                segs,
                seg_of,
                out.storage().ptr,
            )?;
            let n = batch.num_samples();
            launch::conv_state_update(&*self.dev, elementwise(n * c)?, xp, xs, xo, int(n), int(c), int(k), segs)
        });
    }

    fn gated_delta_rule(
        &self,
        qkv: &Tensor<Self>,
        z: Cols<'_, Self>,
        ba: Cols<'_, Self>,
        rule: &crate::backend::DeltaRule<'_, Self>,
        batch: &PackedBatch,
        state: &mut Self::DeltaState,
        layer: usize,
        out: &mut Tensor<Self>,
    ) {
        use crate::backend::DELTA_CHUNK;
        let sh = rule.shape;
        let vectors = [rule.a_log.0.len / 4, rule.dt_bias.0.len / 4, rule.norm.0.len / 4];
        check::delta_rule(qkv, &z, &ba, sh, vectors, batch, out);
        let (nk, nv, dk, dv) = (sh.k_heads, sh.v_heads, sh.k_dim, sh.v_dim);
        let pw = sh.channels() + 2 * nv;
        self.run(|| {
            // One 40-byte `DeltaSeg` per segment (kernels/delta.cu).
            let mut segs = Vec::with_capacity(batch.num_samples() * 40);
            for (si, seg) in batch.segments().iter().enumerate() {
                let rows = batch.range(si);
                let (sp, pin, pout, done) = if seg.uses_cache() {
                    let l = state.0.layer_mut(seg.key, layer);
                    self.zeroed(&mut l.s, nv * dk * dv * 4)?;
                    for p in &mut l.pend {
                        self.zeroed(p, DELTA_CHUNK * pw * 4)?;
                    }
                    let (pin, pout) = (l.pend[l.flip].ptr, l.pend[1 - l.flip].ptr);
                    if seg.keep {
                        l.flip = 1 - l.flip;
                    }
                    (l.s.ptr, pin, pout, seg.pos0 % DELTA_CHUNK)
                } else {
                    (0, 0, 0, 0)
                };
                for p in [sp, pin, pout] {
                    segs.extend_from_slice(&p.to_le_bytes());
                }
                for v in [rows.start, rows.len(), done, usize::from(seg.keep)] {
                    segs.extend_from_slice(&int(v).to_le_bytes());
                }
            }
            let segs = self.upload_table(0, &segs)?;
            let n = batch.num_samples();
            // Blocks over (segments, value heads); a block takes segments blocks apart.
            let blocks = n.min(16);
            let per_block = dk * dv + DELTA_CHUNK * (5 * dk + 3 * dv) + 2 * DELTA_CHUNK * DELTA_CHUNK + 3 * DELTA_CHUNK;
            let work = {
                let mut sc = self.scratch()?;
                let sc = sc.as_mut().expect("scratch made");
                self.ensure(&mut sc.delta, blocks * nv * per_block * 4)?;
                sc.delta.ptr
            };
            let cfg = Launch { grid: (blocks as u32, nv as u32), block: 256, smem: 0 };
            let (zp, zs, zo) = (z.storage.ptr, int(z.stride), int(z.offset));
            let (bp, bs, bo) = (ba.storage.ptr, int(ba.stride), int(ba.offset));
            let (a_log, dt, norm) = (rule.a_log.0.ptr, rule.dt_bias.0.ptr, rule.norm.0.ptr);
            let (nk, nv, dk, dv) = (int(nk), int(nv), int(dk), int(dv));
            launch::gated_delta_rule(
                &*self.dev,
                cfg,
                qkv.storage().ptr,
                zp,
                zs,
                zo,
                bp,
                bs,
                bo,
                a_log,
                dt,
                norm,
                rule.eps,
                nk,
                nv,
                dk,
                dv,
                segs,
                int(n),
                work,
                out.storage().ptr,
            )
        });
    }

    fn sigmoid_mul<W: Dim>(&self, x: &mut Tensor<Self, W>, gate: Cols<'_, Self>) {
        check::sigmoid_mul(x, &gate);
        let (rows, width) = (x.rows(), x.width().size());
        let (xp, gp) = (x.storage().ptr, gate.storage.ptr);
        self.run(|| {
            let (gs, go, gw) = (int(gate.stride), int(gate.offset), int(gate.width));
            launch::sigmoid_mul(&*self.dev, elementwise(rows * width)?, xp, int(rows), int(width), gp, gs, go, gw)
        });
    }

    fn moe_route(&self, logits: &Tensor<Self>, r: &Router, correction: Option<&Vector<D>>) -> Routes<D> {
        let (t, e) = (logits.rows(), logits.width());
        if let Some(c) = correction {
            check::shape("moe_route", "experts", e, c.0.len / 4);
        }
        let none = || Bytes { mem: None, ptr: 0, len: 0 };
        let mut routes = Routes { ids: none(), tokens: t, weights: none(), top_k: r.top_k };
        self.run(|| {
            if r.n_group == 0 || r.topk_group > r.n_group || e % r.n_group != 0 {
                return Err(CudaError::Kernel {
                    name: "moe_route".into(),
                    log: format!("{e} experts in {} groups, {} kept: not a valid grouping", r.n_group, r.topk_group),
                });
            }
            if e > 1024 || r.n_group > 64 || r.top_k > e {
                return Err(CudaError::Kernel {
                    name: "moe_route".into(),
                    log: format!(
                        "{e} experts, {} groups, top {}: the router kernel takes up to 1024 experts and 64 groups",
                        r.n_group, r.top_k
                    ),
                });
            }
            self.ensure(&mut routes.weights, t * r.top_k * 4)?;
            self.ensure(&mut routes.ids, t * r.top_k * 4)?;
            let ids = routes.ids.ptr;
            let (scores, choice) = {
                let mut s = self.scratch()?;
                let s = s.as_mut().expect("scratch made");
                self.ensure(&mut s.moe[0], 2 * t * e * 4)?;
                (s.moe[0].ptr, s.moe[0].ptr + (t * e * 4) as u64)
            };
            let scoring = match r.scoring {
                Scoring::Softmax => 0,
                Scoring::Sigmoid => 1,
            };
            let method = match r.topk_method {
                TopkMethod::Greedy => 0,
                TopkMethod::GroupLimitedGreedy => 1,
                TopkMethod::NoauxTc => 2,
            };
            launch::moe_route(
                &*self.dev,
                Launch { grid: (t.div_ceil(64) as u32, 1), block: 64, smem: 0 },
                logits.storage().ptr,
                correction.map_or(0, |c| c.0.ptr),
                int(t),
                int(e),
                scoring,
                method,
                int(r.top_k),
                int(r.n_group),
                int(r.topk_group),
                r.norm_topk_prob as i32,
                r.routed_scaling_factor,
                scores,
                choice,
                ids,
                routes.weights.ptr,
            )
        });
        routes
    }

    fn moe_experts<H: Dim>(
        &self,
        experts: &[GatedLinear<Self>],
        shared: Option<&GatedLinear<Self>>,
        x: &Tensor<Self, H>,
        routes: &Routes<D>,
        gating: Gating,
        out: &mut Tensor<Self, H>,
    ) {
        let (t, h, top_k) = (x.rows(), x.width().size(), routes.top_k);
        check::shape("moe_experts", "tokens", t, routes.tokens);
        check::shape("moe_experts", "tokens", t, out.rows());
        self.run(|| {
            // Rows grouped by expert on the device, tokens in order within
            // each: src[r] is the token of grouped row r, slot[t·k + j] the
            // row of token t's j-th expert. Only the experts' first rows come
            // back (cuBLAS's grouped call takes its sizes from the host).
            let (n, ne) = (t * top_k, experts.len());
            let table = {
                let mut s = self.scratch()?;
                let s = s.as_mut().expect("scratch made");
                self.ensure(&mut s.group, (ne + 1 + 2 * n) * 4)?;
                s.group.ptr
            };
            let (startp, srcp, slotp) = (table, table + ((ne + 1) * 4) as u64, table + ((ne + 1 + n) * 4) as u64);
            let mut starts = vec![0u32; ne + 1];
            if n > 0 && ne > 0 {
                let cfg = Launch { grid: (ne as u32, 1), block: 256, smem: 0 };
                launch::moe_group(&*self.dev, cfg, routes.ids.ptr, int(n), int(top_k), int(ne), startp, srcp, slotp)?;
                self.dev.download(startp, bytemuck::cast_slice_mut(&mut starts))?;
            }
            Self::holds("moe expert indices in range", n, starts[ne] as usize)?;
            let starts: Vec<usize> = starts.iter().map(|&s| s as usize).collect();
            let bf16 = experts.first().or(shared).is_some_and(|m| self.experts_bf16(m));
            let (xe, ye, sh, xs) = {
                let mut s = self.scratch()?;
                let s = s.as_mut().expect("scratch made");
                self.ensure(&mut s.moe[1], t * top_k * h * 4)?;
                self.ensure(&mut s.moe[2], t * top_k * h * 4)?;
                self.ensure(&mut s.moe[5], t * h * 4)?;
                if bf16 && shared.is_some() {
                    self.ensure(&mut s.xb, t * h * 2)?;
                }
                (s.moe[1].ptr, s.moe[2].ptr, s.moe[5].ptr, s.xb.ptr)
            };
            let cfg = elementwise(t * top_k * h)?;
            let (xp, wp) = (x.storage().ptr, routes.weights.ptr);
            match (gating, bf16) {
                (Gating::Output, false) => launch::gather_rows(&*self.dev, cfg, xp, srcp, int(n), int(h), xe)?,
                (Gating::Output, true) => launch::gather_rows_bf16(&*self.dev, cfg, xp, srcp, int(n), int(h), xe)?,
                // Each row times its weight on the way in; the combine then weighs them 1.
                (Gating::Input, false) => {
                    launch::scatter_rows_scaled(&*self.dev, cfg, xp, slotp, wp, int(n), int(top_k), int(h), xe)?
                }
                (Gating::Input, true) => {
                    launch::scatter_rows_scaled_bf16(&*self.dev, cfg, xp, slotp, wp, int(n), int(top_k), int(h), xe)?
                }
            }
            self.experts_grouped(experts, &starts, xe, ye)?;
            if let Some(m) = shared {
                // The shared expert: one more expert, over every token.
                let xin = if bf16 {
                    launch::to_bf16(&*self.dev, elementwise(t * h)?, x.storage().ptr, int(t), int(h), 0, int(h), xs)?;
                    xs
                } else {
                    x.storage().ptr
                };
                self.experts_grouped(std::slice::from_ref(m), &[0, t], xin, sh)?;
            }
            let combine = if bf16 { launch::moe_combine_bf16 } else { launch::moe_combine };
            let (sh, o) = (if shared.is_some() { sh } else { 0 }, out.storage().ptr);
            let weights = if gating == Gating::Input { 0 } else { wp }; // null: every row weighs 1
            combine(&*self.dev, elementwise(t * h)?, ye, slotp, weights, int(t), int(top_k), int(h), sh, o)
        });
        self.join_all_reduce(out.storage().ptr, t * h);
    }

    fn all_reduce<W: Dim>(&self, x: &mut Tensor<Self, W>) {
        self.join_all_reduce(x.storage().ptr, x.len());
    }

    fn capture<L: Dim, H: Dim>(
        &self,
        x: &Tensor<Self, H>,
        out: &mut CapturedStates<L, H>,
        slot: usize,
    ) -> Result<(), ShapeError> {
        check::capture(x.rows(), x.width().size(), out, slot)?;
        // Into pinned staging, in stream order (later ops may overwrite `x`
        // only after the copy): the host thread goes on issuing the forward.
        let bytes = out.layer(slot).len() * 4;
        if bytes == 0 {
            return Ok(());
        }
        self.run(|| {
            self.dev.stage(x.storage().ptr, bytes)?;
            self.staged.lock().unwrap_or_else(|e| e.into_inner()).push(slot);
            Ok(())
        });
        Ok(())
    }

    fn capture_take<L: Dim, H: Dim>(&self, out: &CapturedStates<L, H>) -> Option<PendingCopies> {
        let slots = std::mem::take(&mut *self.staged.lock().unwrap_or_else(|e| e.into_inner()));
        // Always take the device's staged copies, so that none is carried
        // into the next step's (an error path too).
        let taken = match self.dev.take_staged() {
            Ok(t) => t,
            Err(e) => {
                self.fail(e.into());
                return None;
            }
        };
        if slots.is_empty() || !self.ok() {
            return None; // nothing staged, or a failed step (end_step reports it)
        }
        let per = out.tokens() * out.hidden().size();
        Some(Box::new(move |values: &mut [f32]| {
            let mut lost = None;
            taken
                .collect(&mut |parts| {
                    // Each slot's [T, H] rows of `values`, taken once.
                    let mut layers: Vec<Option<&mut [f32]>> = values.chunks_mut(per.max(1)).map(Some).collect();
                    let mut pairs = Vec::with_capacity(parts.len());
                    for (&slot, part) in slots.iter().zip(parts) {
                        match layers.get_mut(slot).and_then(Option::take) {
                            Some(dst) if part.len() == dst.len() * 4 => {
                                pairs.push((*part, bytemuck::cast_slice_mut(dst)))
                            }
                            _ => lost = Some(format!("capture slot {slot}: staged {} bytes", part.len())),
                        }
                    }
                    if parts.len() != slots.len() {
                        lost = Some(format!("{} captures staged, {} collected", slots.len(), parts.len()));
                    }
                    copy_parallel(pairs);
                })
                .map_err(BackendError::Device)?;
            match lost {
                Some(what) => Err(BackendError::Device(CudaError::Capture { what })),
                None => Ok(()),
            }
        }))
    }

    fn end_step(&self) -> Result<(), BackendError> {
        if self.ok() {
            self.run(|| self.dev.sync());
        } else {
            // Still wait for what a failed rank queued (staged copies), so
            // nothing it frees later is in use.
            let _ = self.dev.sync();
        }
        // A failure stays: later steps would meet buffers the failed op never made.
        match self.failed.lock().unwrap_or_else(|e| e.into_inner()).clone() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
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
