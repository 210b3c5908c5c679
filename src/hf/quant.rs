//! Quantised weights as real checkpoints store them.
//!
//! Three schemes, read exactly (every weight decodes to the f32 value the
//! reference dequantisation gives):
//! - FP8 blocks (DeepSeek-V3, Kimi-K2): `F8_E4M3 [out, in]` weights and an
//!   f32 `weight_scale_inv [ceil(out/128), ceil(in/128)]`,
//!   `W[i, j] = w[i, j] · s[i/128, j/128]`.
//! - compressed-tensors `pack-quantized` INT4 (Kimi-K2.5): `weight_packed
//!   I32 [out, ceil(in/8)]` (element `8j+i` in bits `4i..4i+3` of word `j`,
//!   stored as `q + 8`), `weight_scale [out, ceil(in/32)]`, symmetric groups
//!   of 32 along the input: `W[i, j] = q · s[i, j/32]`.
//! - MXFP4 (gpt-oss's experts, `quant_method: mxfp4`): E2M1 codes two per
//!   byte in `*_blocks`, E8M0 exponents per 32 inputs in `*_scales`:
//!   `W[i, j] = fp4(q) · 2^(s[i, j/32] - 127)` (read by the gpt-oss config
//!   and [`crate::hf::Checkpoint::read_mxfp4`], not through [`QuantConfig`]).
//!
//! Weights stay in these codes in memory ([`QuantRows`], then the GEMM's
//! panels) and are decoded one tile at a time inside the GEMM; plain bf16
//! weights are kept the same way (as codes with scale 1). Any other
//! `quantization_config` is refused with an error that names it.

use super::ConfigError;
use regex::Regex;
use serde_json::Value;
use std::sync::Arc;

/// How one linear layer's weight is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightFormat {
    /// `weight` in f32, bf16 or f16.
    Plain,
    /// FP8 E4M3 codes with a scale per `[rows, cols]` block (when the tensor is `F8_E4M3`).
    Fp8 {
        /// Block size along the output and input dims.
        block: [usize; 2],
    },
    /// Packed INT4 with a scale per `group` inputs.
    Int4 {
        /// Group size along the input dim.
        group: usize,
    },
}

/// A module selector of compressed-tensors: a class name, an exact module
/// name, or `re:` and a regex matched at the name's start (Python's `re.match`).
#[derive(Clone, Debug)]
enum Target {
    Class(String),
    Name(String),
    Regex(Regex),
}

impl PartialEq for Target {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Target::Class(a), Target::Class(b)) | (Target::Name(a), Target::Name(b)) => a == b,
            (Target::Regex(a), Target::Regex(b)) => a.as_str() == b.as_str(),
            _ => false,
        }
    }
}

impl Target {
    fn parse(s: &str) -> Result<Self, ConfigError> {
        if let Some(re) = s.strip_prefix("re:") {
            // Anchored at the start like `re.match`, free at the end.
            let re = Regex::new(&format!("^(?:{re})"))
                .map_err(|e| invalid(format!("target {s:?} is not a valid regex: {e}")))?;
            Ok(Target::Regex(re))
        } else if s.chars().next().is_some_and(|c| c.is_ascii_uppercase()) && !s.contains('.') {
            Ok(Target::Class(s.to_string()))
        } else {
            Ok(Target::Name(s.to_string()))
        }
    }

    /// Whether the linear layer `module` is selected. Every layer Strata
    /// reads through here is an `nn.Linear`; the router (`mlp.gate`) is not.
    fn matches(&self, module: &str) -> bool {
        match self {
            Target::Class(c) => c == "Linear" && !module.ends_with(".mlp.gate"),
            Target::Name(n) => n == module,
            Target::Regex(r) => r.is_match(module),
        }
    }
}

/// One compressed-tensors config group: the modules it targets and its group size.
#[derive(Clone, Debug, PartialEq)]
struct Group {
    targets: Vec<Target>,
    group_size: usize,
}

/// A checkpoint's `quantization_config`, for the schemes Strata reads.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantConfig(Scheme);

#[derive(Clone, Debug, PartialEq)]
enum Scheme {
    /// `quant_method: fp8` with `weight_block_size`: every `F8_E4M3` weight is block-scaled.
    Fp8Block { block: [usize; 2] },
    /// `quant_method: compressed-tensors`, `format: pack-quantized`, symmetric INT4 groups;
    /// the first group whose targets match a module wins.
    PackInt4 { groups: Vec<Group>, ignore: Vec<Target> },
}

fn invalid(problem: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { field: "quantization_config", problem: problem.into() }
}

const SUPPORTED: &str =
    "Strata reads `fp8` with `weight_block_size` (DeepSeek-V3, Kimi-K2, MiniMax-M2) and `compressed-tensors` \
     `pack-quantized` symmetric INT4 groups (Kimi-K2.5)";

impl QuantConfig {
    /// Parses a `quantization_config` object; `Ok(None)` when it is absent or null.
    pub fn from_json(v: Option<&Value>) -> Result<Option<Self>, ConfigError> {
        let Some(v) = v.filter(|v| !v.is_null()) else { return Ok(None) };
        let method = v.get("quant_method").and_then(Value::as_str).unwrap_or("<none>");
        match method {
            "fp8" => Self::fp8(v).map(Some),
            "compressed-tensors" => Self::compressed(v).map(Some),
            other => Err(invalid(format!("quant_method {other:?} is not supported; {SUPPORTED}"))),
        }
    }

    fn fp8(v: &Value) -> Result<Self, ConfigError> {
        let fmt = v.get("fmt").and_then(Value::as_str).unwrap_or("e4m3");
        // DeepSeek's files say "e4m3", MiniMax-M2's torch's name for it.
        if fmt != "e4m3" && fmt != "float8_e4m3fn" {
            return Err(invalid(format!("fp8 fmt {fmt:?} is not supported (only e4m3, float8_e4m3fn)")));
        }
        // Absent: FineGrainedFP8Config's default, 128 × 128 blocks; null: per-tensor FP8.
        let default_block = serde_json::json!([128, 128]);
        let block = match v.get("weight_block_size") {
            None => &default_block,
            Some(Value::Null) => {
                return Err(invalid(format!(
                    "fp8 with `weight_block_size: null` (per-tensor FP8) is not supported; {SUPPORTED}"
                )))
            }
            Some(b) => b,
        };
        let dims: Vec<usize> = block
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_u64).map(|x| x as usize).collect())
            .unwrap_or_default();
        match dims[..] {
            [r, c] if r > 0 && c > 0 => Ok(QuantConfig(Scheme::Fp8Block { block: [r, c] })),
            _ => Err(invalid(format!("weight_block_size {block} is not two positive integers"))),
        }
    }

    fn compressed(v: &Value) -> Result<Self, ConfigError> {
        let top_format = v.get("format").and_then(Value::as_str);
        let groups_v = v
            .get("config_groups")
            .and_then(Value::as_object)
            .ok_or_else(|| invalid("compressed-tensors config has no `config_groups` object"))?;
        let mut groups = Vec::new();
        for (name, g) in groups_v {
            let bad = |what: String| invalid(format!("config_groups.{name}: {what}; {SUPPORTED}"));
            let format = g.get("format").and_then(Value::as_str).or(top_format).unwrap_or("<none>");
            if format != "pack-quantized" {
                return Err(bad(format!("format {format:?} is not supported")));
            }
            if g.get("input_activations").is_some_and(|a| !a.is_null()) {
                return Err(bad("input activation quantisation is not supported".into()));
            }
            let w = g.get("weights").filter(|w| !w.is_null()).ok_or_else(|| bad("no `weights` arguments".into()))?;
            let field = |k: &str| w.get(k).filter(|x| !x.is_null());
            let bits = field("num_bits").and_then(Value::as_u64);
            let kind = field("type").and_then(Value::as_str).unwrap_or("int");
            let symmetric = field("symmetric").and_then(Value::as_bool).unwrap_or(true);
            let strategy = field("strategy").and_then(Value::as_str).unwrap_or("<none>");
            let dynamic = field("dynamic").and_then(Value::as_bool).unwrap_or(false);
            if bits != Some(4) || kind != "int" {
                return Err(bad(format!("{}-bit {kind} weights are not supported (only 4-bit int)", fmt_bits(bits))));
            }
            if !symmetric {
                return Err(bad("asymmetric weights (zero points) are not supported".into()));
            }
            if strategy != "group" || dynamic {
                return Err(bad(format!("strategy {strategy:?} is not supported (only static \"group\")")));
            }
            let group_size = field("group_size")
                .and_then(Value::as_u64)
                .filter(|&g| g > 0)
                .ok_or_else(|| bad("group strategy without a positive `group_size`".into()))?
                as usize;
            let targets = g
                .get("targets")
                .and_then(Value::as_array)
                .ok_or_else(|| bad("no `targets` list".into()))?
                .iter()
                .map(|t| t.as_str().ok_or_else(|| bad(format!("target {t} is not a string"))).and_then(Target::parse))
                .collect::<Result<_, _>>()?;
            groups.push(Group { targets, group_size });
        }
        if groups.is_empty() {
            return Err(invalid("compressed-tensors config has no config groups"));
        }
        let ignore = match v.get("ignore") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => a
                .iter()
                .map(|t| t.as_str().ok_or_else(|| invalid(format!("ignore entry {t} is not a string"))))
                .map(|s| s.and_then(Target::parse))
                .collect::<Result<_, _>>()?,
            Some(other) => return Err(invalid(format!("`ignore` is {other}, not a list"))),
        };
        Ok(QuantConfig(Scheme::PackInt4 { groups, ignore }))
    }

    /// How the linear layer named `module` (its full checkpoint name, without
    /// `.weight`) is stored. For FP8 this is the block scheme, which applies
    /// to the tensors whose dtype is `F8_E4M3`; the others are plain.
    pub fn format_for(&self, module: &str) -> WeightFormat {
        match &self.0 {
            Scheme::Fp8Block { block } => WeightFormat::Fp8 { block: *block },
            Scheme::PackInt4 { groups, ignore } => {
                if ignore.iter().any(|t| t.matches(module)) {
                    return WeightFormat::Plain;
                }
                groups
                    .iter()
                    .find(|g| g.targets.iter().any(|t| t.matches(module)))
                    .map_or(WeightFormat::Plain, |g| WeightFormat::Int4 { group: g.group_size })
            }
        }
    }

    /// Block-scaled FP8 (`quant_method: fp8` with `weight_block_size`).
    pub fn is_fp8_block(&self) -> bool {
        matches!(self.0, Scheme::Fp8Block { .. })
    }

    /// A short name for logs and `inspect`.
    pub fn describe(&self) -> String {
        match &self.0 {
            Scheme::Fp8Block { block } => format!("fp8 e4m3 in {}x{} blocks", block[0], block[1]),
            Scheme::PackInt4 { groups, .. } => {
                format!("int4 pack-quantized in groups of {}", groups[0].group_size)
            }
        }
    }
}

fn fmt_bits(b: Option<u64>) -> String {
    b.map_or("unknown".into(), |b| b.to_string())
}

/// The f32 value of an FP8 E4M3 (`e4m3fn`) code: 1 sign, 4 exponent (bias 7),
/// 3 mantissa bits; no infinities, `0x7f`/`0xff` are NaN.
pub fn fp8_e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = ((b >> 3) & 0xf, b & 7);
    if e == 15 && m == 7 {
        return f32::NAN;
    }
    if e == 0 {
        sign * m as f32 * (1.0 / 512.0) // subnormal: m · 2^-9
    } else {
        sign * f32::from_bits(((e as u32 + 120) << 23) | ((m as u32) << 20))
    }
}

/// The kind of codes in a [`QuantRows`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantKind {
    /// One FP8 E4M3 byte per weight.
    Fp8,
    /// One INT4 value `q + 8` (0..=15) per weight.
    Int4,
    /// A plain bf16 weight (two little-endian bytes) with scale 1: kept at
    /// its checkpoint size rather than widened to f32.
    Bf16,
    /// One MXFP4 (E2M1) code (0..=15) per weight, with an E8M0 scale per 32 inputs.
    Mxfp4,
}

/// The E2M1 values of the 16 MXFP4 codes: sign bit 3, then exponent and mantissa.
pub const FP4_VALUES: [f32; 16] =
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// `2^(s - 127)`, the value of an E8M0 scale byte below 0xFF (its NaN), exact in f32.
pub fn e8m0_to_f32(s: u8) -> f32 {
    match s {
        0 => f32::from_bits(1 << 22), // 2^-127, an f32 subnormal
        s => f32::from_bits((s as u32) << 23),
    }
}

impl QuantKind {
    /// Bytes per weight in a [`QuantRows`].
    pub fn code_bytes(self) -> usize {
        match self {
            QuantKind::Fp8 | QuantKind::Int4 | QuantKind::Mxfp4 => 1,
            QuantKind::Bf16 => 2,
        }
    }

    /// The f32 value of the code at the start of `c`, before scaling.
    #[inline]
    pub fn decode(self, c: &[u8]) -> f32 {
        match self {
            QuantKind::Fp8 => fp8_e4m3_to_f32(c[0]),
            QuantKind::Int4 => (c[0] as i32 - 8) as f32,
            QuantKind::Bf16 => f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16),
            QuantKind::Mxfp4 => FP4_VALUES[(c[0] & 0xf) as usize],
        }
    }
}

/// A block of a quantised `[rows, cols]` weight as read from the checkpoint:
/// one code per weight, row-major, and one scale per row and input segment.
/// Segments are the runs of input columns that share a scale (FP8 blocks,
/// INT4 groups), cut where the global block boundaries fall inside the block.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantRows {
    /// Code kind.
    pub kind: QuantKind,
    /// Output rows.
    pub rows: usize,
    /// Input columns.
    pub cols: usize,
    /// `[rows][cols]` codes of [`QuantKind::code_bytes`] each.
    pub codes: Vec<u8>,
    /// Segment starts along the input, then `cols`: `seg[0] = 0`, `seg[n] = cols`.
    pub seg: Vec<usize>,
    /// `[rows][seg.len() - 1]` scales.
    pub scales: Vec<f32>,
}

impl QuantRows {
    /// The segment boundaries of columns `c0..c0+cols` of a tensor whose scale
    /// blocks are `block` wide.
    pub fn segments(c0: usize, cols: usize, block: usize) -> Vec<usize> {
        let mut seg = vec![0];
        let mut next = (c0 / block + 1) * block - c0;
        while next < cols {
            seg.push(next);
            next += block;
        }
        seg.push(cols);
        seg
    }

    /// An empty block of `rows × cols` weights with room for its codes and
    /// scales, to be filled row by row.
    pub fn with_capacity(kind: QuantKind, rows: usize, cols: usize, seg: Vec<usize>) -> Self {
        let ns = seg.len() - 1;
        QuantRows {
            kind,
            rows,
            cols,
            codes: Vec::with_capacity(rows * cols * kind.code_bytes()),
            scales: Vec::with_capacity(rows * ns),
            seg,
        }
    }

    /// Segments per row.
    pub fn num_segments(&self) -> usize {
        self.seg.len() - 1
    }

    /// The exact f32 weights `[rows][cols]`.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        for (r, row) in out.chunks_exact_mut(self.cols.max(1)).enumerate().take(self.rows) {
            self.dequantize_row(r, row);
        }
        out
    }

    /// The exact f32 weights of row `r` into `out` (`cols` values): `code · scale`.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let (ns, cb) = (self.num_segments(), self.kind.code_bytes());
        let codes = &self.codes[r * self.cols * cb..(r + 1) * self.cols * cb];
        for s in 0..ns {
            let sc = self.scales[r * ns + s];
            let (c0, c1) = (self.seg[s], self.seg[s + 1]);
            for (o, code) in out[c0..c1].iter_mut().zip(codes[c0 * cb..c1 * cb].chunks_exact(cb)) {
                *o = self.kind.decode(code) * sc;
            }
        }
    }
}

/// Weight rows read in place from a mapped checkpoint, never copied: where
/// each output row's `cols` values (`T`: f32, or bf16 bits as `u16`) start,
/// and the mappings that hold them. A tensor-parallel block or a fused
/// gate/up is just a different list of row starts.
pub struct MappedRows<T> {
    /// Output rows.
    pub rows: usize,
    /// Input columns.
    pub cols: usize,
    // [rows] addresses of each row's first value (`T`-aligned, `cols` readable).
    starts: Vec<usize>,
    // Keeps the mapped files alive (empty for 'static bytes).
    keep: Vec<Arc<dyn Send + Sync>>,
    _elem: std::marker::PhantomData<T>,
}

// Derived `Clone` would ask `T: Clone` for a list of addresses.
impl<T> Clone for MappedRows<T> {
    fn clone(&self) -> Self {
        MappedRows {
            rows: self.rows,
            cols: self.cols,
            starts: self.starts.clone(),
            keep: self.keep.clone(),
            _elem: std::marker::PhantomData,
        }
    }
}

impl<T: Copy> MappedRows<T> {
    /// Rows `rows` × columns `cols` of the row-major little-endian tensor of
    /// `width` columns of `T` in `bytes`, kept alive by `keep`. `None` when
    /// the bytes are not aligned for `T`, or the CPU is big-endian (the
    /// caller copies instead).
    ///
    /// # Safety
    /// `bytes` must stay valid and unchanged for as long as the result (or a
    /// clone or stack of it) lives: owned by `keep`, or `'static`; and every
    /// bit pattern must be a valid `T` (as for `f32` and `u16`).
    pub unsafe fn new(
        bytes: &[u8],
        width: usize,
        rows: std::ops::Range<usize>,
        cols: std::ops::Range<usize>,
        keep: Option<Arc<dyn Send + Sync>>,
    ) -> Option<Self> {
        let (base, size) = (bytes.as_ptr() as usize, std::mem::size_of::<T>());
        if !base.is_multiple_of(std::mem::align_of::<T>()) || cfg!(target_endian = "big") {
            return None;
        }
        let need = rows.end.checked_mul(width).and_then(|v| v.checked_mul(size));
        assert!(need.is_some_and(|n| n <= bytes.len()) && cols.end <= width, "mapped block outside its tensor");
        let starts = rows.clone().map(|r| base + (r * width + cols.start) * size).collect();
        let keep = keep.into_iter().collect();
        Some(MappedRows { rows: rows.len(), cols: cols.len(), starts, keep, _elem: std::marker::PhantomData })
    }

    /// Where output row `r`'s `cols` values start.
    pub(crate) fn start(&self, r: usize) -> *const T {
        self.starts[r] as *const T
    }

    /// Output row `r`'s values.
    pub fn row(&self, r: usize) -> &[T] {
        // SAFETY: `new` checked that each start is aligned for `T` with `cols`
        // values inside a mapping that `keep` (or 'static) holds for our lifetime.
        unsafe { std::slice::from_raw_parts(self.start(r), self.cols) }
    }

    /// The rows as one `[rows][cols]` vector (a copy).
    pub fn to_vec(&self) -> Vec<T> {
        let mut w = Vec::with_capacity(self.rows * self.cols);
        (0..self.rows).for_each(|r| w.extend_from_slice(self.row(r)));
        w
    }

    /// The blocks' rows one after another (a fused gate/up): still in
    /// place. At least one block, all of one input width.
    fn join(mut blocks: impl Iterator<Item = MappedRows<T>>) -> Self {
        let mut out = blocks.next().expect("at least one block to join");
        for b in blocks {
            assert_eq!(out.cols, b.cols, "stacked weights must share their input width");
            out.rows += b.rows;
            out.starts.extend_from_slice(&b.starts);
            out.keep.extend(b.keep);
        }
        out
    }
}

impl MappedRows<u16> {
    /// The exact f32 value of row `r`'s bf16 weights into `out`.
    pub fn widen_row(&self, r: usize, out: &mut [f32]) {
        for (o, &b) in out.iter_mut().zip(self.row(r)) {
            *o = f32::from_bits((b as u32) << 16);
        }
    }

    /// The rows as bf16 codes (scale 1), copied.
    pub fn to_quant_rows(&self) -> QuantRows {
        let mut q = QuantRows::with_capacity(QuantKind::Bf16, self.rows, self.cols, vec![0, self.cols]);
        for r in 0..self.rows {
            q.codes.extend(self.row(r).iter().flat_map(|b| b.to_le_bytes()));
            q.scales.push(1.0);
        }
        q
    }
}

impl<T> std::fmt::Debug for MappedRows<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MappedRows<{}> {{ rows: {}, cols: {} }}", std::any::type_name::<T>(), self.rows, self.cols)
    }
}

impl<T: Copy + PartialEq> PartialEq for MappedRows<T> {
    fn eq(&self, other: &Self) -> bool {
        (self.rows, self.cols) == (other.rows, other.cols) && (0..self.rows).all(|r| self.row(r) == other.row(r))
    }
}

/// One linear layer's weight block, as stored.
#[derive(Clone, Debug, PartialEq)]
pub enum LinearWeight {
    /// f32 `[rows][cols]`.
    Dense {
        /// Output rows.
        rows: usize,
        /// Input columns.
        cols: usize,
        /// Weights.
        w: Vec<f32>,
    },
    /// f32 rows in place in the mapped checkpoint.
    Mapped(MappedRows<f32>),
    /// bf16 rows (the bits, scale 1) in place in the mapped checkpoint.
    MappedBf16(MappedRows<u16>),
    /// Codes and scales.
    Quant(QuantRows),
}

impl LinearWeight {
    /// Output rows.
    pub fn rows(&self) -> usize {
        match self {
            LinearWeight::Dense { rows, .. } => *rows,
            LinearWeight::Mapped(m) => m.rows,
            LinearWeight::MappedBf16(m) => m.rows,
            LinearWeight::Quant(q) => q.rows,
        }
    }

    /// Input columns.
    pub fn cols(&self) -> usize {
        match self {
            LinearWeight::Dense { cols, .. } => *cols,
            LinearWeight::Mapped(m) => m.cols,
            LinearWeight::MappedBf16(m) => m.cols,
            LinearWeight::Quant(q) => q.cols,
        }
    }

    /// The exact f32 weights of output row `r` into `out` (`cols` values).
    pub fn row(&self, r: usize, out: &mut [f32]) {
        match self {
            LinearWeight::Dense { cols, w, .. } => out.copy_from_slice(&w[r * cols..(r + 1) * cols]),
            LinearWeight::Mapped(m) => out.copy_from_slice(m.row(r)),
            LinearWeight::MappedBf16(m) => m.widen_row(r, out),
            LinearWeight::Quant(q) => q.dequantize_row(r, out),
        }
    }

    /// Stacks blocks with the same input width along the output dim (a fused
    /// gate/up). Quantised blocks of one kind and segmentation stay quantised;
    /// anything mixed is dequantised, which is exact.
    pub fn stack(parts: Vec<LinearWeight>) -> LinearWeight {
        let cols = parts.first().map_or(0, LinearWeight::cols);
        assert!(parts.iter().all(|p| p.cols() == cols), "stacked weights must share their input width");
        let first_q = match parts.first() {
            Some(LinearWeight::Quant(q)) => Some((q.kind, q.seg.clone())),
            _ => None,
        };
        let same = first_q.as_ref().is_some_and(|(k, seg)| {
            parts.iter().all(|p| matches!(p, LinearWeight::Quant(q) if q.kind == *k && q.seg == *seg))
        });
        if let (true, Some((kind, seg))) = (same, first_q) {
            let mut out = QuantRows { kind, rows: 0, cols, codes: Vec::new(), seg, scales: Vec::new() };
            for p in parts {
                if let LinearWeight::Quant(q) = p {
                    out.rows += q.rows;
                    out.codes.extend_from_slice(&q.codes);
                    out.scales.extend_from_slice(&q.scales);
                }
            }
            return LinearWeight::Quant(out);
        }
        // All in place, of one dtype: the row lists are joined.
        if !parts.is_empty() && parts.iter().all(|p| matches!(p, LinearWeight::Mapped(_))) {
            return LinearWeight::Mapped(MappedRows::join(parts.into_iter().filter_map(|p| match p {
                LinearWeight::Mapped(m) => Some(m),
                _ => None,
            })));
        }
        if !parts.is_empty() && parts.iter().all(|p| matches!(p, LinearWeight::MappedBf16(_))) {
            return LinearWeight::MappedBf16(MappedRows::join(parts.into_iter().filter_map(|p| match p {
                LinearWeight::MappedBf16(m) => Some(m),
                _ => None,
            })));
        }
        let total: usize = parts.iter().map(LinearWeight::rows).sum();
        let mut w: Vec<f32> = Vec::new();
        for p in parts {
            match p {
                // The first part's buffer grows to hold the rest: one copy fewer.
                LinearWeight::Dense { w: d, .. } if w.is_empty() => {
                    w = d;
                    w.reserve_exact(total * cols - w.len());
                }
                LinearWeight::Dense { w: d, .. } => w.extend_from_slice(&d),
                LinearWeight::Mapped(m) => (0..m.rows).for_each(|r| w.extend_from_slice(m.row(r))),
                LinearWeight::MappedBf16(m) => {
                    (0..m.rows).for_each(|r| w.extend(m.row(r).iter().map(|&b| f32::from_bits((b as u32) << 16))))
                }
                LinearWeight::Quant(q) => w.extend_from_slice(&q.dequantize()),
            }
        }
        LinearWeight::Dense { rows: total, cols, w }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_codes_decode_exactly() {
        // Reference values of float8_e4m3fn.
        for (code, want) in [
            (0x00u8, 0.0f32),
            (0x38, 1.0),
            (0xb8, -1.0),
            (0x7e, 448.0),
            (0x01, 1.0 / 512.0),
            (0x07, 7.0 / 512.0),
            (0x08, 1.0 / 64.0),
            (0x3c, 1.5),
            (0x40, 2.0),
            (0x80, -0.0),
        ] {
            assert_eq!(fp8_e4m3_to_f32(code).to_bits(), want.to_bits(), "code {code:#04x}");
        }
        assert!(fp8_e4m3_to_f32(0x7f).is_nan() && fp8_e4m3_to_f32(0xff).is_nan());
    }

    #[test]
    fn mxfp4_codes_and_scales_decode_exactly() {
        // transformers' FP4_VALUES, and E8M0 = 2^(s - 127).
        assert_eq!(QuantKind::Mxfp4.decode(&[7]), 6.0);
        assert_eq!(QuantKind::Mxfp4.decode(&[9]), -0.5);
        assert_eq!(QuantKind::Mxfp4.decode(&[8]).to_bits(), (-0.0f32).to_bits());
        assert_eq!((e8m0_to_f32(127), e8m0_to_f32(128), e8m0_to_f32(120)), (1.0, 2.0, 1.0 / 128.0));
        assert_eq!((e8m0_to_f32(254), e8m0_to_f32(0)), (2f32.powi(127), 2f32.powi(-127)));
        assert_eq!(e8m0_to_f32(1), f32::MIN_POSITIVE);
    }

    #[test]
    fn segments_follow_global_block_boundaries() {
        assert_eq!(QuantRows::segments(0, 300, 128), vec![0, 128, 256, 300]);
        assert_eq!(QuantRows::segments(100, 60, 128), vec![0, 28, 60]);
        assert_eq!(QuantRows::segments(64, 64, 32), vec![0, 32, 64]);
        assert_eq!(QuantRows::segments(0, 20, 32), vec![0, 20]);
    }

    fn parse(v: &str) -> Result<Option<QuantConfig>, ConfigError> {
        QuantConfig::from_json(Some(&serde_json::from_str(v).unwrap()))
    }

    #[test]
    fn kimi_k25_config_selects_routed_experts_only() {
        let q = parse(
            r#"{"quant_method":"compressed-tensors","format":"pack-quantized","quantization_status":"compressed",
            "config_groups":{"group_0":{"targets":["Linear"],"input_activations":null,"output_activations":null,
              "weights":{"num_bits":4,"type":"int","symmetric":true,"strategy":"group","group_size":32,
                         "dynamic":false,"observer":"minmax","actorder":null}}},
            "ignore":["lm_head","re:.*self_attn.*","re:.*shared_experts.*","re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]}"#,
        )
        .unwrap()
        .unwrap();
        let p = "language_model.model.layers.3";
        assert_eq!(q.format_for(&format!("{p}.mlp.experts.7.down_proj")), WeightFormat::Int4 { group: 32 });
        for plain in ["self_attn.q_b_proj", "mlp.shared_experts.up_proj", "mlp.gate_proj", "mlp.gate"] {
            assert_eq!(q.format_for(&format!("{p}.{plain}")), WeightFormat::Plain, "{plain}");
        }
    }

    #[test]
    fn fp8_without_a_block_size_takes_transformers_128_by_128() {
        // FineGrainedFP8Config's default weight_block_size (transformers 5.25.0): (128, 128).
        let q = parse(r#"{"quant_method":"fp8","activation_scheme":"dynamic"}"#).unwrap().unwrap();
        assert_eq!(q.format_for("model.layers.0.mlp.down_proj"), WeightFormat::Fp8 { block: [128, 128] });
    }

    #[test]
    fn other_schemes_are_refused_by_name() {
        for (cfg, needle) in [
            (r#"{"quant_method":"gptq","bits":4}"#, "quant_method \"gptq\""),
            (r#"{"quant_method":"awq"}"#, "quant_method \"awq\""),
            (r#"{"quant_method":"fp8","weight_block_size":null}"#, "per-tensor FP8"),
            // compressed-tensors validates it (nothing quantized), but a checkpoint that says it is
            // compressed-tensors and quantizes nothing is not what its file claims: refused.
            (
                r#"{"quant_method":"compressed-tensors","format":"pack-quantized","config_groups":{}}"#,
                "no config groups",
            ),
            (r#"{"quant_method":"fp8","fmt":"e5m2","weight_block_size":[128,128]}"#, "e5m2"),
            (
                r#"{"quant_method":"compressed-tensors","format":"float-quantized","config_groups":{"g":{"targets":["Linear"],"weights":{"num_bits":8,"type":"float"}}}}"#,
                "float-quantized",
            ),
            (
                r#"{"quant_method":"compressed-tensors","format":"pack-quantized","config_groups":{"g":{"targets":["Linear"],"weights":{"num_bits":4,"type":"int","symmetric":false,"strategy":"group","group_size":128}}}}"#,
                "asymmetric",
            ),
            (
                r#"{"quant_method":"compressed-tensors","format":"pack-quantized","config_groups":{"g":{"targets":["Linear"],"weights":{"num_bits":4,"type":"int","symmetric":true,"strategy":"channel"}}}}"#,
                "\"channel\"",
            ),
        ] {
            let e = parse(cfg).unwrap_err().to_string();
            assert!(e.contains(needle) && e.contains("quantization_config"), "{cfg}: {e}");
        }
        assert_eq!(parse("null").unwrap(), None);
    }

    #[test]
    fn stack_keeps_codes_or_dequantizes_mixed_parts() {
        let q = |rows: usize, c: u8| QuantRows {
            kind: QuantKind::Int4,
            rows,
            cols: 4,
            codes: vec![c; rows * 4],
            seg: vec![0, 2, 4],
            scales: vec![0.5; rows * 2],
        };
        let s = LinearWeight::stack(vec![LinearWeight::Quant(q(1, 9)), LinearWeight::Quant(q(2, 7))]);
        let LinearWeight::Quant(s) = s else { panic!("stays quantised") };
        assert_eq!((s.rows, s.dequantize()[0], s.dequantize()[11]), (3, 0.5, -0.5));
        let mixed = LinearWeight::stack(vec![
            LinearWeight::Quant(q(1, 10)),
            LinearWeight::Dense { rows: 1, cols: 4, w: vec![3.0; 4] },
        ]);
        assert_eq!(mixed, LinearWeight::Dense { rows: 2, cols: 4, w: vec![1.0, 1.0, 1.0, 1.0, 3.0, 3.0, 3.0, 3.0] });
    }
}
