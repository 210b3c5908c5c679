//! A device as the decoder sees it: its facts (name, kernel, native bf16),
//! its rank in a tensor-parallel group and the group's collective, and the
//! end of a step, where a device reports what failed.

use super::{Buffers, Compute, ComputeDtype, Tensor};
use crate::backend::BackendError;
use crate::shape::Dim;

/// A device of one tensor-parallel rank: facts, group and collective.
pub trait DeviceOps: Buffers {
    /// The compute dtype of GEMM and attention inputs.
    type Compute: ComputeDtype;

    /// The name `--backend` takes.
    const NAME: &'static str;

    /// Whether the device has bf16 arithmetic: `--compute auto` then picks
    /// bf16 for weights stored in bf16, FP8 or INT4.
    fn native_bf16() -> bool;
    /// The kernel its GEMMs take, as the manifest records it (a resume
    /// refuses to mix kernels, whose last bits may differ).
    fn kernel(&self) -> &'static str;
    /// The compute dtype.
    fn compute(&self) -> Compute {
        <Self::Compute as ComputeDtype>::COMPUTE
    }

    /// This rank's index.
    fn rank(&self) -> usize;
    /// Ranks in this backend's tensor-parallel group.
    fn world_size(&self) -> usize;
    /// Backends for the `n` ranks of a tensor-parallel group, rank order,
    /// joined by this backend's collective.
    fn group(&self, n: usize) -> Result<Vec<Self>, BackendError>;
    /// Stops this rank's group after a failure that leaves the rank unable to
    /// join its peers' collectives (a panic): every rank waiting in one, or
    /// entering one later, fails instead of waiting forever. One rank has no
    /// peers to stop.
    fn abort_group(&self, _why: &str) {}
    /// Sums `x` over the ranks of the group, in rank order (deterministic).
    fn all_reduce<W: Dim>(&self, x: &mut Tensor<Self, W>);

    /// Ends a step (or a model's load): waits for the device and reports the
    /// first failure any op met (ops cannot return errors; a device backend
    /// records them). Host backends have nothing to report.
    fn end_step(&self) -> Result<(), BackendError> {
        Ok(())
    }
}
