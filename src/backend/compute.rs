//! The compute dtype a backend runs its GEMMs and attention in, as a value
//! and as a type parameter.

/// The dtype a backend feeds its GEMMs and attention (the residual stream,
/// norms, softmax and accumulations stay f32 whatever it is).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Compute {
    /// f32 inputs: the exact path.
    F32,
    /// bf16 inputs, f32 accumulation.
    Bf16,
}

impl Compute {
    /// Every compute dtype.
    pub const ALL: [Compute; 2] = [Compute::F32, Compute::Bf16];

    /// The name `--compute` takes and the manifest records.
    pub fn name(self) -> &'static str {
        match self {
            Compute::F32 => "f32",
            Compute::Bf16 => "bf16",
        }
    }

    /// `v` rounded to this dtype (to nearest even).
    pub fn round(self, v: f32) -> f32 {
        match self {
            Compute::F32 => v,
            Compute::Bf16 => half::bf16::from_f32(v).to_f32(),
        }
    }
}

impl std::fmt::Display for Compute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.name())
    }
}

impl std::str::FromStr for Compute {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Compute::ALL
            .into_iter()
            .find(|c| c.name() == s)
            .ok_or_else(|| format!("unknown compute dtype {s:?} (expected f32 or bf16)"))
    }
}

/// A compute dtype as a type: the parameter a backend is instantiated with
/// (`Cpu<F32>`), so a bf16 or CUDA path is a new backend type, not a change
/// to any model file.
pub trait ComputeDtype: Copy + Default + Send + Sync + std::fmt::Debug + 'static {
    /// Its run-time value.
    const COMPUTE: Compute;
}

/// f32 compute.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct F32;

impl ComputeDtype for F32 {
    const COMPUTE: Compute = Compute::F32;
}

/// bf16 compute: GEMM and attention inputs rounded to bf16, f32 accumulation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Bf16;

impl ComputeDtype for Bf16 {
    const COMPUTE: Compute = Compute::Bf16;
}
