//! Finding the GPUs before any CUDA call: the driver library, then its device
//! count, then the indices `--devices` names. Each step that fails is a
//! [`CudaError`] that says what is missing, never a panic inside cudarc
//! (which panics when a dynamically loaded library is absent).

use super::CudaError;
use cudarc::driver::{result, sys};

/// A GPU found by [`probe`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Its index (`--devices`).
    pub ordinal: usize,
    /// Its name, as the driver gives it.
    pub name: String,
    /// Compute capability `(major, minor)`: NVRTC compiles for `sm_{major}{minor}`.
    pub capability: (i32, i32),
    /// Device memory, bytes.
    pub memory: usize,
}

impl DeviceInfo {
    /// The architecture NVRTC compiles for: `sm_90` for compute capability 9.0.
    pub fn arch(&self) -> String {
        format!("sm_{}{}", self.capability.0, self.capability.1)
    }
}

/// Whether the driver library can be loaded.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library's candidate names.
    unsafe { sys::is_culib_present() }
}

fn driver(call: &str, e: impl std::fmt::Debug) -> CudaError {
    CudaError::Driver { call: call.into(), error: format!("{e:?}") }
}

/// The number of GPUs the driver reports.
pub fn device_count() -> Result<usize, CudaError> {
    if !driver_present() {
        return Err(CudaError::NoDriver);
    }
    if let Err(e) = result::init() {
        // No device, or a driver that cannot start (e.g. a container without GPUs).
        return Err(CudaError::NoDevice(format!(" (cuInit: {e:?})")));
    }
    result::device::get_count().map(|n| n.max(0) as usize).map_err(|e| driver("cuDeviceGetCount", e))
}

/// The GPUs `devices` names (all of them when empty), checked to exist.
pub fn probe(devices: &[usize]) -> Result<Vec<DeviceInfo>, CudaError> {
    let count = device_count()?;
    if count == 0 {
        return Err(CudaError::NoDevice(String::new()));
    }
    let wanted: Vec<usize> = if devices.is_empty() { (0..count).collect() } else { devices.to_vec() };
    wanted
        .into_iter()
        .map(|ordinal| {
            if ordinal >= count {
                return Err(CudaError::BadDevice { asked: ordinal, count });
            }
            let dev = result::device::get(ordinal as i32).map_err(|e| driver("cuDeviceGet", e))?;
            let name = result::device::get_name(dev).map_err(|e| driver("cuDeviceGetName", e))?;
            let attr = |a| {
                // SAFETY: `dev` is a valid device handle from cuDeviceGet.
                unsafe { result::device::get_attribute(dev, a) }.map_err(|e| driver("cuDeviceGetAttribute", e))
            };
            let capability = (
                attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            );
            // SAFETY: as above.
            let memory = unsafe { result::device::total_mem(dev) }.map_err(|e| driver("cuDeviceTotalMem", e))?;
            Ok(DeviceInfo { ordinal, name, capability, memory })
        })
        .collect()
}

/// The versions of the CUDA libraries the backend loads; `None` where a
/// library cannot be loaded. Printed by `scripts/gpu-check.sh` and logged when
/// a CUDA model opens: the first thing to read when a GPU run fails.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Versions {
    /// The CUDA version the driver supports, `(13, 0)` for R580.
    pub driver: Option<(i32, i32)>,
    /// NVRTC's `(major, minor)`.
    pub nvrtc: Option<(i32, i32)>,
    /// cuBLAS's `(major, minor, patch)`.
    pub cublas: Option<(i32, i32, i32)>,
    /// NCCL's `(major, minor, patch)`.
    pub nccl: Option<(i32, i32, i32)>,
}

/// The versions of whatever CUDA libraries can be loaded (no GPU needed).
pub fn versions() -> Versions {
    let mut v = Versions::default();
    if driver_present() {
        let mut code = 0;
        // SAFETY: the library is present; cuDriverGetVersion needs no cuInit.
        if unsafe { sys::cuDriverGetVersion(&mut code) } == sys::CUresult::CUDA_SUCCESS {
            v.driver = Some((code / 1000, code % 1000 / 10));
        }
    }
    v.nvrtc = super::nvrtc::version().ok();
    use cudarc::cublas::sys as blas;
    // SAFETY: only dlopen attempts, then a query of the library's own constants.
    if unsafe { blas::is_culib_present() } {
        let get = |p| {
            let mut x = 0;
            // SAFETY: as above; `x` is a live local.
            (unsafe { blas::cublasGetProperty(p, &mut x) } == blas::cublasStatus_t::CUBLAS_STATUS_SUCCESS).then_some(x)
        };
        use blas::libraryPropertyType_t as P;
        if let (Some(a), Some(b), Some(c)) = (get(P::MAJOR_VERSION), get(P::MINOR_VERSION), get(P::PATCH_LEVEL)) {
            v.cublas = Some((a, b, c));
        }
    }
    use cudarc::nccl::sys as nccl;
    // SAFETY: as above.
    if unsafe { nccl::is_culib_present() } {
        let mut code = 0;
        // SAFETY: as above; NCCL encodes its version as major·10000 + minor·100 + patch since 2.9.
        if unsafe { nccl::ncclGetVersion(&mut code) } == nccl::ncclResult_t::ncclSuccess {
            v.nccl = Some((code / 10000, code % 10000 / 100, code % 100));
        }
    }
    v
}

impl std::fmt::Display for Versions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let none = "not loadable";
        let two = |v: Option<(i32, i32)>| v.map_or(none.to_string(), |(a, b)| format!("{a}.{b}"));
        let three = |v: Option<(i32, i32, i32)>| v.map_or(none.to_string(), |(a, b, c)| format!("{a}.{b}.{c}"));
        write!(
            f,
            "driver (CUDA) {}, NVRTC {}, cuBLAS {}, NCCL {}",
            two(self.driver),
            two(self.nvrtc),
            three(self.cublas),
            three(self.nccl)
        )
    }
}
