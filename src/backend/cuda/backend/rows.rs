//! The CUDA backend's row ops ([`RowOps`]).

use super::*;

impl<C: ComputeDtype, D: Device> RowOps for Cuda<C, D> {
    type RopeTable = RopeTable<D>;

    fn embed_unchecked<H: Dim>(&self, table: &Embedding<D>, batch: &PackedBatch, out: &mut Tensor<Self, H>) {
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

    fn rms_norm_unchecked<W: Dim>(&self, x: Cols<'_, Self>, w: &Vector<D>, eps: f32, out: &mut Tensor<Self, W>) {
        self.run(|| {
            Self::holds("rms_norm input", x.rows * x.stride, x.storage.len)?;
            let cfg = Launch { grid: (x.rows as u32, 1), block: 256, smem: 0 };
            let (stride, offset, width) = (int(x.stride), int(x.offset), int(x.width));
            launch::rms_norm(&*self.dev, cfg, x.storage.ptr, stride, offset, width, w.0.ptr, eps, out.storage().ptr)
        });
    }

    fn rms_norm_heads_unchecked(&self, x: &mut Tensor<Self>, heads: HeadSpan, w: &Vector<D>, eps: f32) {
        let cfg = Launch { grid: (x.rows() as u32, heads.count as u32), block: 64, smem: 0 };
        let (ptr, width) = (x.storage().ptr, int(x.width()));
        let (offset, stride, hw) = (int(heads.offset), int(heads.stride), int(heads.width));
        self.run(|| launch::rms_norm_heads(&*self.dev, cfg, ptr, width, offset, stride, hw, w.0.ptr, eps));
    }

    fn sum_squares_heads_unchecked(&self, x: &Tensor<Self>, heads: HeadSpan, out: &mut Tensor<Self>, col: usize) {
        let cfg = Launch { grid: (x.rows() as u32, heads.count as u32), block: 128, smem: 0 };
        let (ptr, width, o, ow) = (x.storage().ptr, int(x.width()), out.storage().ptr, int(out.width()));
        let (offset, stride, hw) = (int(heads.offset), int(heads.stride), int(heads.width));
        self.run(|| launch::sum_squares_heads(&*self.dev, cfg, ptr, width, offset, stride, hw, o, ow, int(col)));
    }

    fn scale_heads_rms_unchecked(
        &self,
        x: &mut Tensor<Self>,
        heads: HeadSpan,
        sums: HeadSums<'_, Self>,
        w: &Vector<D>,
        eps: f32,
    ) {
        let HeadSums { sums, col, n } = sums;
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

    fn rope_unchecked(
        &self,
        x: &mut Tensor<Self>,
        heads: HeadSpan,
        interleave: bool,
        table: &RopeTable<D>,
        batch: &PackedBatch,
    ) {
        let (ptr, width) = (x.storage().ptr, x.width());
        self.run(|| self.rope_launch((ptr, GemmType::F32), width, heads, interleave, table, batch));
    }

    fn glu_unchecked(&self, act: Glu, gate_up: &Tensor<Self>, out: &mut Tensor<Self>) {
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

    fn attn_temperature_unchecked(&self, x: &mut Tensor<Self>, heads: HeadSpan, t: Temperature, batch: &PackedBatch) {
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

    fn add_unchecked<W: Dim>(&self, x: &mut Tensor<Self, W>, y: &Tensor<Self, W>) {
        let (xp, yp, n) = (x.storage().ptr, y.storage().ptr, x.len());
        self.run(|| launch::add(&*self.dev, elementwise(n)?, xp, yp, int(n)));
    }

    fn gather_rows_unchecked<W: Dim>(&self, x: &Tensor<Self, W>, rows: &[usize], out: &mut Tensor<Self, W>) {
        let n = rows.len() * x.width().size();
        if n == 0 {
            return;
        }
        self.run(|| {
            let ids: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
            let ids = self.upload_table(0, bytemuck::cast_slice(&ids))?;
            let (w, nr) = (int(x.width().size()), int(rows.len()));
            launch::gather_rows(&*self.dev, elementwise(n)?, x.storage().ptr, ids, nr, w, out.storage().ptr)
        });
    }

    fn copy_heads_unchecked(&self, src: &Tensor<Self>, from: HeadSpan, dst: &mut Tensor<Self>, to: HeadSpan) {
        let n = src.rows() * to.count * to.width;
        let (s, sw, d, dw) = (src.storage().ptr, int(src.width()), dst.storage().ptr, int(dst.width()));
        let (fo, fs, to_o, ts) = (int(from.offset), int(from.stride), int(to.offset), int(to.stride));
        let (rows, count, width) = (int(src.rows()), int(to.count), int(to.width));
        self.run(|| {
            launch::copy_heads(&*self.dev, elementwise(n)?, s, sw, fo, fs, d, dw, to_o, ts, rows, count, width)
        });
    }

    fn linear_forward_unchecked<W: Dim, V: Dim>(&self, l: &Linear<D>, x: &Tensor<Self, W>, out: &mut Tensor<Self, V>) {
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

    fn linear_add_unchecked<W: Dim, V: Dim>(&self, l: &Linear<D>, x: &Tensor<Self, W>, residual: &mut Tensor<Self, V>) {
        let (rows, xp) = (x.rows(), x.storage().ptr);
        self.add_linear(l, rows, residual.storage().ptr, || self.gemm_input(l, xp, rows));
    }

    fn sigmoid_mul_unchecked<W: Dim>(&self, x: &mut Tensor<Self, W>, gate: Cols<'_, Self>) {
        let (rows, width) = (x.rows(), x.width().size());
        let (xp, gp) = (x.storage().ptr, gate.storage.ptr);
        self.run(|| {
            let (gs, go, gw) = (int(gate.stride), int(gate.offset), int(gate.width));
            launch::sigmoid_mul(&*self.dev, elementwise(rows * width)?, xp, int(rows), int(width), gp, gs, go, gw)
        });
    }
}

impl<C: ComputeDtype, D: Device> Cuda<C, D> {
    /// In place: RoPE of `heads` of the rows of `x` (`width` values each, f32
    /// or bf16), at each token's position (see [`RowOps::rope`]).
    pub(super) fn rope_launch(
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
}
