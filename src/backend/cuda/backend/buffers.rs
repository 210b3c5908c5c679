//! The CUDA backend's device facts and collective ([`DeviceOps`]) and its
//! buffers ([`Buffers`]): device memory, and captures staged to the host.

use super::*;

impl<C: ComputeDtype, D: Device> DeviceOps for Cuda<C, D> {
    type Compute = C;

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

    fn all_reduce<W: Dim>(&self, x: &mut Tensor<Self, W>) {
        self.join_all_reduce(x.storage().ptr, x.len());
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

impl<C: ComputeDtype, D: Device> Buffers for Cuda<C, D> {
    type Storage = Buf<D>;
    type Vector = Vector<D>;
    type Embedding = Embedding<D>;

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

    fn capture_unchecked<L: Dim, H: Dim>(&self, x: &Tensor<Self, H>, out: &mut CapturedStates<L, H>, slot: usize) {
        // Into pinned staging, in stream order (later ops may overwrite `x`
        // only after the copy): the host thread goes on issuing the forward.
        let bytes = out.layer(slot).len() * 4;
        if bytes == 0 {
            return;
        }
        self.run(|| {
            self.dev.stage(x.storage().ptr, bytes)?;
            self.staged.lock().unwrap_or_else(|e| e.into_inner()).push(slot);
            Ok(())
        });
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
}
