//! How much FP8 storage loses: reads a native dataset stored in f32 and
//! reports, per capture point, the relative L2 error ||q(x) - x|| / ||x|| of
//! - bf16 storage,
//! - Strata's FP8 (e4m3, one scale per token and capture point),
//! - FP8 with one scale per token across capture points (the `[T, 1, 1]`
//!   scale of the speculators stack's own FP8 writer),
//!
//! and FP8's error against bf16 storage, ||q(x) - bf16(x)|| / ||bf16(x)||.
//!
//!     strata extract --model M --data D --dtype f32 --out /tmp/f32
//!     cargo run --release --example fp8_error -- /tmp/f32

use strata::dataset::Dataset;
use strata::shape::{fp8, DType};

/// Squared error and squared norm, accumulated in f64.
#[derive(Default, Clone, Copy)]
struct L2 {
    err: f64,
    norm: f64,
}

impl L2 {
    fn add(&mut self, got: f32, want: f32) {
        self.err += ((got - want) as f64).powi(2);
        self.norm += (want as f64).powi(2);
    }
    fn rel(self) -> f64 {
        (self.err / self.norm.max(f64::MIN_POSITIVE)).sqrt()
    }
}

fn main() {
    let dir = std::env::args().nth(1).expect("usage: fp8_error DATASET_DIR (a native dataset stored in f32)");
    let ds = Dataset::open(std::path::Path::new(&dir)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(ds.manifest.dtype, "f32", "the dataset must be stored in f32 (--dtype f32)");
    let points: Vec<String> = ds.manifest.capture.iter().map(|c| c.point.clone()).collect();
    let (l, h) = (points.len(), ds.manifest.model.hidden_size);
    // Per capture point: bf16, fp8 per point, fp8 per token only, fp8 against bf16.
    let mut acc = vec![[L2::default(); 4]; l];
    let mut tokens = 0;
    let (mut codes, mut row) = (Vec::new(), vec![0f32; h]);
    for s in &ds.manifest.samples {
        let shard = ds.shard(s.shard).unwrap();
        let r = ds.sample(&shard, &s.id, s.tokens).unwrap();
        // The mapped bytes need not be 4-aligned: decoded into a copy.
        let x: Vec<f32> = r.hidden.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        let t = s.tokens;
        tokens += t;
        let at = |layer: usize, tok: usize| &x[(layer * t + tok) * h..(layer * t + tok + 1) * h];
        for tok in 0..t {
            // One scale for the token across every capture point.
            let token_scale = (0..l).map(|p| fp8::row_scale(at(p, tok))).fold(0f32, f32::max);
            for (p, a) in acc.iter_mut().enumerate() {
                let v = at(p, tok);
                for &y in v {
                    a[0].add(DType::BF16.round(y), y);
                }
                codes.clear();
                let s = fp8::quantize_row(v, &mut codes);
                fp8::dequantize_row(&codes, s, &mut row);
                for (&q, &y) in row.iter().zip(v) {
                    a[1].add(q, y);
                    a[3].add(q, DType::BF16.round(y));
                }
                codes.clear();
                fp8::encode_row(v, token_scale, &mut codes);
                fp8::dequantize_row(&codes, token_scale, &mut row);
                for (&q, &y) in row.iter().zip(v) {
                    a[2].add(q, y);
                }
            }
        }
    }
    println!(
        "{} ({}): {} samples, {tokens} tokens, hidden {h}",
        dir,
        ds.manifest.model.architecture,
        ds.manifest.samples.len()
    );
    println!("relative L2 error per capture point (rms |x|)");
    println!(
        "  {:<12} {:>10} {:>12} {:>14} {:>16} {:>12}",
        "point", "rms", "bf16 vs f32", "fp8 vs f32", "fp8/token vs f32", "fp8 vs bf16"
    );
    let mut all = [L2::default(); 4];
    for (p, a) in points.iter().zip(&acc) {
        let rms = (a[0].norm / (tokens * h) as f64).sqrt();
        println!(
            "  {p:<12} {rms:>10.3} {:>12.2e} {:>14.2e} {:>16.2e} {:>12.2e}",
            a[0].rel(),
            a[1].rel(),
            a[2].rel(),
            a[3].rel()
        );
        for k in 0..4 {
            all[k].err += a[k].err;
            all[k].norm += a[k].norm;
        }
    }
    println!(
        "  {:<12} {:>10} {:>12.2e} {:>14.2e} {:>16.2e} {:>12.2e}",
        "all",
        "",
        all[0].rel(),
        all[1].rel(),
        all[2].rel(),
        all[3].rel()
    );
}
