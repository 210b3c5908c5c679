//! The GEMMs of the CUDA backend: linear layers as the device holds them
//! ([`Weights`]), and the cuBLAS calls every linear op goes through.

use super::*;

impl<C: ComputeDtype, D: Device> Weights for Cuda<C, D> {
    type Linear = Linear<D>;

    fn linear(&self, w: LinearWeight, bias: Option<Vec<f32>>, kind: Parallel) -> Linear<D> {
        self.linear_in(w, bias, kind, false)
    }

    fn linear_f32(&self, w: LinearWeight, bias: Option<Vec<f32>>, kind: Parallel) -> Linear<D> {
        self.linear_in(w, bias, kind, true)
    }
}

impl<C: ComputeDtype, D: Device> Cuda<C, D> {
    pub(super) fn linear_in(
        &self,
        w: LinearWeight,
        bias: Option<Vec<f32>>,
        kind: Parallel,
        f32_inputs: bool,
    ) -> Linear<D> {
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

    pub(super) fn quant(&self, q: &QuantRows) -> Weight<D> {
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
    pub(super) fn bf16_inputs(&self, l: &Linear<D>) -> bool {
        C::COMPUTE == crate::backend::Compute::Bf16 && !l.f32_inputs
    }

    /// The bf16 GEMM input scratch, holding at least `bytes`.
    pub(super) fn xb(&self, bytes: usize) -> Result<DevPtr, CudaError> {
        let mut s = self.scratch()?;
        let s = s.as_mut().expect("scratch made");
        self.ensure(&mut s.xb, bytes)?;
        Ok(s.xb.ptr)
    }

    /// What `l`'s GEMM reads for `rows` rows of f32 `x [rows, in]`: `x`
    /// itself, or (bf16 inputs) its rounding to bf16 in scratch.
    pub(super) fn gemm_input(&self, l: &Linear<D>, x: DevPtr, rows: usize) -> Result<(DevPtr, GemmType), CudaError> {
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
    pub(super) fn gemm_from(
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
    pub(super) fn gemm_into(
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
    pub(super) fn gemm_rows(
        &self,
        l: &Linear<D>,
        x: DevPtr,
        rows: usize,
        y: DevPtr,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        let xin = self.gemm_input(l, x, rows)?;
        self.gemm_from(l, xin, rows, y, accumulate)
    }

    /// A row-parallel layer's tail: the all-reduce of its `rows` output
    /// rows at `y`, then its bias, once.
    pub(super) fn row_parallel_tail(&self, l: &Linear<D>, y: DevPtr, rows: usize) {
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
    pub(super) fn add_linear(
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
    pub(super) fn weight_operand(
        &self,
        l: &Linear<D>,
        bf16_inputs: bool,
        dst: DevPtr,
    ) -> Result<(DevPtr, GemmType), CudaError> {
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

    pub(super) fn add_bias(&self, y: DevPtr, b: &Bytes<D>, rows: usize, width: usize) -> Result<(), CudaError> {
        launch::add_bias(&*self.dev, elementwise(rows * width)?, y, b.ptr, int(rows), int(width))
    }
}
