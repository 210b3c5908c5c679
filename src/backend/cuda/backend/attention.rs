//! The CUDA backend's attention ([`AttentionOps`]): the f32 and the
//! tensor-core bf16 kernels, split-K decode for long one-query segments
//! ([`SplitPlan`]), and where their inputs lie.

use super::*;
use crate::backend::Mask;

impl<C: ComputeDtype, D: Device> AttentionOps for Cuda<C, D> {
    type KvCache = KvCache<D>;

    fn attention_unchecked(
        &self,
        qkv: Qkv<'_, Self>,
        shape: AttnShape,
        sinks: Option<&Vector<D>>,
        batch: &PackedBatch,
        kv: LayerState<'_, KvCache<D>>,
        out: &mut Tensor<Self>,
    ) {
        let (Qkv { q, k, v }, LayerState { state: cache, layer }) = (qkv, kv);
        let src = [Src::f32(&q), Src::f32(&k), Src::f32(&v)];
        self.run(|| self.attention_launch(src, shape, sinks, batch, cache, layer, out));
    }
}

impl<C: ComputeDtype, D: Device> Cuda<C, D> {
    /// Causal attention of `[q, k, v]` (see [`AttentionOps::attention`]), each
    /// read where `src` says: f32 columns, or (bf16 compute) bf16 ones.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_launch(
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
                if entry.2.len() <= layer {
                    entry.2.resize_with(layer + 1, || None);
                }
                let need = seg.pos0 + rows.len();
                let reserved = entry.1;
                let slot = &mut entry.2[layer];
                if slot.is_none() && seg.pos0 > 0 {
                    // begin() checked the sample's positions; a layer without them is a broken cache.
                    return Err(CudaError::Kernel {
                        name: "attention".into(),
                        log: format!("layer {layer} has no cached keys for positions 0..{} of its sample", seg.pos0),
                    });
                }
                if slot.as_ref().is_none_or(|l| l.cap < need) {
                    // The positions the sample reserved (more when a continued sample
                    // reserves more), at once; else grow to twice the need, keeping the
                    // earlier positions.
                    let cap = if reserved >= need { reserved } else { (2 * need).max(64) };
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

        // Long one-query segments go to the split kernels; the rest to the
        // one-block-per-query kernels, which leave the split rows alone.
        let plan = SplitPlan::new(batch, s.mask);
        // The split tables, uploaded before any launch: slot 2, `split` then `rows`.
        let split_tables = if plan.is_empty() {
            None
        } else {
            let tables: Vec<i32> = plan.split.iter().chain(&plan.rows).flatten().copied().collect();
            Some(self.upload_table(2, bytemuck::cast_slice(&tables))?)
        };
        let block4 = s.heads.div_ceil(4) as u32;
        if let Some((_, _, qb)) = packed {
            let tiles: Vec<i32> = (0..batch.num_samples())
                .filter(|&i| plan.splits(i) == 0)
                .flat_map(|i| (0..batch.range(i).len()).step_by(64).flat_map(move |q0| [i as i32, q0 as i32]))
                .collect();
            if !tiles.is_empty() {
                let table = self.upload_table(1, bytemuck::cast_slice(&tiles))?;
                let smem = attention_bf16_smem(s.head_dim, s.v_dim);
                let cfg = Launch { grid: ((tiles.len() / 2) as u32, s.heads as u32), block: 128, smem };
                let qs = int(s.heads * pad16(s.head_dim));
                attention_bf16_kernel(s.v_dim)(
                    &*self.dev, cfg, qb, qs, segs, table, heads, kvh, hd, vd, window, chunk, s.scale, sinkp, op,
                )?;
            }
        } else {
            let (qp, qs) = (q.at(q.offset), int(q.stride));
            if plan.rows.len() < t {
                // SEG_SPLIT (attention.cu) for a split row: attention_f32 skips it.
                let seg_of: Vec<u32> = (0..batch.num_samples())
                    .flat_map(|i| {
                        let id = if plan.splits(i) == 0 { i as u32 } else { u32::MAX };
                        batch.range(i).map(move |_| id)
                    })
                    .collect();
                let table = self.upload_table(1, bytemuck::cast_slice(&seg_of))?;
                let cfg = Launch { grid: (t as u32, block4), block: 128, smem: 0 };
                let sc = s.scale;
                launch::attention_f32(
                    &*self.dev, cfg, qp, qs, segs, table, heads, kvh, hd, vd, window, chunk, sc, sinkp, op,
                )?;
            }
        }
        let Some(split) = split_tables else { return Ok(()) };
        let (ml, po) = {
            let n = plan.split.len() * s.heads;
            let mut sc = self.scratch()?;
            let sc = sc.as_mut().expect("scratch made");
            self.ensure(&mut sc.split, n * (2 + s.v_dim) * 4)?;
            (sc.split.ptr, sc.split.ptr + (n * 2 * 4) as u64)
        };
        let cfg = Launch { grid: (plan.split.len() as u32, block4), block: 128, smem: 0 };
        match packed {
            Some((_, _, qb)) => {
                let qs = int(s.heads * pad16(s.head_dim));
                launch::attention_split_bf16(&*self.dev, cfg, qb, qs, segs, split, heads, kvh, hd, vd, s.scale, ml, po)?
            }
            None => {
                let (qp, qs) = (q.at(q.offset), int(q.stride));
                launch::attention_split_f32(&*self.dev, cfg, qp, qs, segs, split, heads, kvh, hd, vd, s.scale, ml, po)?
            }
        }
        let rows = split + (plan.split.len() * 3 * 4) as u64;
        let cfg = Launch { grid: (plan.rows.len() as u32, block4), block: 128, smem: 0 };
        launch::attention_split_combine(&*self.dev, cfg, rows, heads, vd, sinkp, ml, po, op)
    }
}

/// Decode rows that see at least this many keys take the split-K path: below
/// it one block walks the keys in a few 32-key steps, and splitting would
/// only add the partials' round trip.
pub const SPLIT_MIN_KEYS: usize = 256;

/// The fewest keys a split takes (a split's block loads its query and writes
/// a partial as large as its output: a few 32-key steps pay for that).
pub const SPLIT_MIN_CHUNK: usize = 128;

/// The most splits of one row: longer caches take longer splits, so the
/// partials stay bounded by the batch (rows × heads × `SPLIT_MAX` × (vd + 2)
/// f32), whatever the cache length.
pub const SPLIT_MAX: usize = 32;

/// The keys each split of a row that sees `keys` keys takes: at least
/// [`SPLIT_MIN_CHUNK`], at most [`SPLIT_MAX`] splits, a multiple of 32 (the
/// warps' step). A function of the row alone, so a row's result does not
/// depend on what else the batch holds.
pub fn split_chunk(keys: usize) -> usize {
    keys.div_ceil(SPLIT_MAX).next_multiple_of(32).max(SPLIT_MIN_CHUNK)
}

/// The first key position a query at position `p` sees under a window and
/// a chunk (0: none) as the kernels take them: attention.cu's `first_key`,
/// so a split row sees the keys the one-block kernels would give it.
fn first_key(p: usize, window: usize, chunk: usize) -> usize {
    let lo = if window > 0 { (p + 1).saturating_sub(window) } else { 0 };
    if chunk > 0 {
        lo.max(p - p % chunk)
    } else {
        lo
    }
}

/// Which segments of a step take split-K decode (`attention_split_*` in
/// attention.cu) and how their keys are cut: one-query segments whose query
/// sees (under the mask) at least [`SPLIT_MIN_KEYS`] keys.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SplitPlan {
    /// Per split, `(segment, first key, end key)`: its keys `[first, end)`,
    /// a row's splits consecutive and in key order.
    pub split: Vec<[i32; 3]>,
    /// Per split row, `(row in q and out, first split, splits)`.
    pub rows: Vec<[i32; 3]>,
    /// Per segment, its splits (0: the one-block-per-query kernels take it).
    per_segment: Vec<usize>,
}

impl SplitPlan {
    /// The plan of `batch` under `mask`.
    pub fn new(batch: &PackedBatch, mask: Mask) -> Self {
        let (window, chunk) = mask.window_and_chunk();
        let mut plan = SplitPlan { per_segment: vec![0; batch.num_samples()], ..Default::default() };
        for (i, seg) in batch.segments().iter().enumerate() {
            let rows = batch.range(i);
            if rows.len() != 1 {
                continue;
            }
            let (p, lo) = (seg.pos0, first_key(seg.pos0, window, chunk));
            let keys = p + 1 - lo;
            if keys < SPLIT_MIN_KEYS {
                continue;
            }
            let len = split_chunk(keys);
            let n = keys.div_ceil(len);
            plan.rows.push([rows.start as i32, plan.split.len() as i32, n as i32]);
            plan.split.extend((0..n).map(|c| {
                let j0 = lo + c * len;
                [i as i32, j0 as i32, (j0 + len).min(p + 1) as i32]
            }));
            plan.per_segment[i] = n;
        }
        plan
    }

    /// Whether no segment is split.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Segment `i`'s splits; 0 when the one-block-per-query kernels take it.
    pub fn splits(&self, i: usize) -> usize {
        self.per_segment.get(i).copied().unwrap_or(0)
    }
}

/// Where attention reads its queries, keys or values: columns `offset ..`
/// of rows `stride` values apart from `ptr`, f32 or (a bf16 projection's) bf16.
#[derive(Clone, Copy, Debug)]
pub(super) struct Src {
    pub(super) ptr: DevPtr,
    pub(super) stride: usize,
    pub(super) offset: usize,
    pub(super) bf16: bool,
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
