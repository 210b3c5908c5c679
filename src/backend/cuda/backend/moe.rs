//! The CUDA backend's mixtures of experts ([`MoeOps`]).

use super::*;

impl<C: ComputeDtype, D: Device> MoeOps for Cuda<C, D> {
    type Routes = Routes<D>;

    fn moe_route_unchecked(&self, logits: &Tensor<Self>, r: &Router, correction: Option<&Vector<D>>) -> Routes<D> {
        let (t, e) = (logits.rows(), logits.width());
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

    fn moe_experts_unchecked<H: Dim>(
        &self,
        experts: &[GatedLinear<Self>],
        shared: Option<&GatedLinear<Self>>,
        x: &Tensor<Self, H>,
        routes: &Routes<D>,
        gating: Gating,
        out: &mut Tensor<Self, H>,
    ) {
        let (t, h, top_k) = (x.rows(), x.width().size(), routes.top_k);
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
}

impl<C: ComputeDtype, D: Device> Cuda<C, D> {
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
                fn pick<B: Weights>(m: &GatedLinear<B>, down: bool) -> &B::Linear {
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
}
