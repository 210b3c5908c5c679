//! The CUDA backend's Gated DeltaNet layers ([`RecurrentOps`]).

use super::*;

impl<C: ComputeDtype, D: Device> RecurrentOps for Cuda<C, D> {
    type DeltaState = crate::backend::DeltaCache<DeltaLayer<D>>;

    fn causal_conv1d_unchecked(
        &self,
        x: Cols<'_, Self>,
        w: &Vector<D>,
        shape: crate::backend::DeltaShape,
        batch: &PackedBatch,
        state: LayerState<'_, Self::DeltaState>,
        out: &mut Tensor<Self>,
    ) {
        let LayerState { state, layer } = state;
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

    fn gated_delta_rule_unchecked(
        &self,
        qkv: &Tensor<Self>,
        gates: DeltaGates<'_, Self>,
        rule: &crate::backend::DeltaRule<'_, Self>,
        batch: &PackedBatch,
        state: LayerState<'_, Self::DeltaState>,
        out: &mut Tensor<Self>,
    ) {
        let (DeltaGates { z, ba }, LayerState { state, layer }) = (gates, state);
        use crate::backend::DELTA_CHUNK;
        let sh = rule.shape;
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
}
