//! The CUDA backend's fused ops ([`FusedOps`]): bf16 kept from the norm
//! to the next GEMM, as PyTorch's bf16 run keeps it.

use super::*;

impl<C: ComputeDtype, D: Device> FusedOps for Cuda<C, D> {
    fn norm_linear_forward_unchecked<W: Dim, V: Dim>(
        &self,
        l: &Linear<D>,
        x: &Tensor<Self, W>,
        w: &Vector<D>,
        eps: f32,
        normed: &mut Tensor<Self, W>,
        out: &mut Tensor<Self, V>,
    ) {
        if !self.bf16_inputs(l) {
            self.rms_norm_unchecked(x.all(), w, eps, normed);
            return self.linear_forward_unchecked(l, normed, out);
        }
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

    fn swiglu_linear_add_unchecked<V: Dim>(
        &self,
        l: &Linear<D>,
        gate_up: &Tensor<Self>,
        act: &mut Tensor<Self>,
        residual: &mut Tensor<Self, V>,
    ) {
        if !self.bf16_inputs(l) {
            self.glu_unchecked(Glu::Silu, gate_up, act);
            return self.linear_add_unchecked(l, act, residual);
        }
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

    fn norm_gated_mlp_add_unchecked<H: Dim>(
        &self,
        gate_up: &Linear<D>,
        down: &Linear<D>,
        w: &Vector<D>,
        eps: f32,
        x: &mut Tensor<Self, H>,
        bufs: MlpBufs<'_, Self, H>,
    ) {
        let MlpBufs { normed, gate_up: gate_up_out, act } = bufs;
        if !self.bf16_inputs(gate_up) || !self.bf16_inputs(down) || gate_up.kind == Parallel::Row {
            self.norm_linear_forward_unchecked(gate_up, x, w, eps, normed, gate_up_out);
            return self.swiglu_linear_add_unchecked(down, gate_up_out, act, x);
        }
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

    fn norm_attention_add_unchecked<H: Dim>(
        &self,
        a: &AttnBlock<'_, Self>,
        x: &mut Tensor<Self, H>,
        bufs: AttnBufs<'_, Self, H>,
        rope: &RopeTable<D>,
        batch: &PackedBatch,
        kv: LayerState<'_, KvCache<D>>,
    ) {
        let (l, (w, eps)) = (a.qkv_proj, a.norm);
        // (A norm over all heads sums its squares across ranks between two
        // f32 ops: that block runs op by op.)
        let all_heads = a.qk_norm.as_ref().is_some_and(|n| n.all_heads);
        if !self.bf16_inputs(l) || l.kind == Parallel::Row || all_heads {
            return crate::backend::fused::attention_block_unchecked(self, a, x, bufs, rope, batch, kv);
        }
        let (AttnBufs { qkv, out, .. }, LayerState { state: cache, layer }) = (bufs, kv);
        let s = a.shape;
        let (nh, nkv, hd) = (s.heads, s.kv_heads, s.head_dim);
        let spans = [HeadSpan::heads(0, nh, hd), HeadSpan::heads(nh * hd, nkv, hd)];
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
        self.linear_add_unchecked(a.o_proj, out, x);
    }
}
