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
