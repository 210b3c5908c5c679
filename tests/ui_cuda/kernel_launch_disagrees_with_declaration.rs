// A kernel launch whose arguments disagree with the kernel's declaration
// (kernels/norm.cu: `rms_norm(const float* x, int stride, int offset, int
// width, const float* w, float eps, float* out)`) does not compile: here eps
// and the width are swapped.
use strata::backend::cuda::device::Launch;
use strata::backend::cuda::kernels as launch;
use strata::backend::cuda::Driver;

fn norm(dev: &Driver, x: u64, w: u64, out: u64) {
    let cfg = Launch { grid: (1, 1), block: 256, smem: 0 };
    let _ = launch::rms_norm(dev, cfg, x, 4096, 0, 1e-6, w, 4096, out);
}

fn main() {
    let _ = norm;
}
