//! `[layers, tokens, hidden]` host storage, the unit every stage hands on.

use super::{check_dim, DType, Dim, Element, ShapeError};
use rayon::prelude::*;
use std::mem::MaybeUninit;
use std::ops::Range;

/// Captured residual-stream states of one sample (or one packed batch):
/// `[L, T, H]`, row-major, `T` known only at run time.
#[derive(Clone, Debug, PartialEq)]
pub struct CapturedStates<L: Dim, H: Dim, E: Element = f32> {
    layers: L,
    tokens: usize,
    hidden: H,
    data: Vec<E>,
}

/// An axis of `[L, T, H]` storage, for operations that take one as a type.
pub trait StatesAxis {
    /// The axis name used in errors.
    const NAME: &'static str;
}

/// The layers axis.
pub struct LayerAxis;
/// The tokens axis.
pub struct TokenAxis;
/// The hidden axis.
pub struct HiddenAxis;

impl StatesAxis for LayerAxis {
    const NAME: &'static str = "layers";
}
impl StatesAxis for TokenAxis {
    const NAME: &'static str = "tokens";
}
impl StatesAxis for HiddenAxis {
    const NAME: &'static str = "hidden";
}

/// Axes along which captures may be concatenated. Only tokens: joining two
/// samples' (or chunks') states along hidden or layers yields a buffer whose
/// type would lie about its shape.
#[diagnostic::on_unimplemented(
    message = "captured states concatenate along tokens only, not along `{Self}`",
    label = "use `TokenAxis`: layers and hidden are fixed by the capture set and the model",
    note = "concatenating along hidden or layers is the layout bug Strata exists to reject"
)]
pub trait ConcatAxis: StatesAxis {}
impl ConcatAxis for TokenAxis {}

impl<L: Dim, H: Dim, E: Element> CapturedStates<L, H, E> {
    /// Zero-filled states.
    pub fn zeros(layers: L, tokens: usize, hidden: H) -> Self {
        let n = layers.size() * tokens * hidden.size();
        CapturedStates { layers, tokens, hidden, data: vec![E::default(); n] }
    }

    /// Wraps a buffer, checking its length against `[layers, tokens, hidden]`.
    pub fn try_from_vec(data: Vec<E>, layers: L, tokens: usize, hidden: H) -> Result<Self, ShapeError> {
        let expected = layers.size() * tokens * hidden.size();
        if data.len() != expected {
            return Err(ShapeError::new("captured states buffer", "elements", expected, data.len()));
        }
        Ok(CapturedStates { layers, tokens, hidden, data })
    }

    /// Decodes raw little-endian bytes of `dtype` with a run-time shape, checking
    /// dtype, every axis against the type's dims, and the byte count.
    pub fn try_from_bytes(
        context: &str,
        bytes: &[u8],
        dtype: DType,
        shape: &[usize],
        layers: L,
        hidden: H,
    ) -> Result<Self, ShapeError> {
        if shape.len() != 3 {
            return Err(ShapeError::new(context, "rank", 3, shape.len()));
        }
        check_dim(context, "layers", layers, shape[0])?;
        check_dim(context, "hidden", hidden, shape[2])?;
        let tokens = shape[1];
        let n = layers.size() * tokens * hidden.size();
        if bytes.len() != n * dtype.size() {
            return Err(ShapeError::new(context, "bytes", n * dtype.size(), bytes.len()));
        }
        let mut f = vec![0f32; n];
        dtype.decode_into(bytes, &mut f);
        let data = f.into_iter().map(E::from_f32).collect();
        Ok(CapturedStates { layers, tokens, hidden, data })
    }

    /// The layers dim.
    pub fn layers(&self) -> L {
        self.layers
    }
    /// Number of tokens.
    pub fn tokens(&self) -> usize {
        self.tokens
    }
    /// The hidden dim.
    pub fn hidden(&self) -> H {
        self.hidden
    }
    /// `[L, T, H]` as run-time sizes.
    pub fn shape(&self) -> [usize; 3] {
        [self.layers.size(), self.tokens, self.hidden.size()]
    }
    /// The whole buffer, `[L, T, H]` row-major.
    pub fn as_slice(&self) -> &[E] {
        &self.data
    }
    /// The whole buffer, mutable.
    pub fn as_mut_slice(&mut self) -> &mut [E] {
        &mut self.data
    }
    /// Takes the buffer out.
    pub fn into_vec(self) -> Vec<E> {
        self.data
    }

    /// One captured layer, `[T, H]`.
    pub fn layer(&self, l: usize) -> &[E] {
        let n = self.tokens * self.hidden.size();
        &self.data[l * n..(l + 1) * n]
    }

    /// One captured layer, mutable.
    pub fn layer_mut(&mut self, l: usize) -> &mut [E] {
        let n = self.tokens * self.hidden.size();
        &mut self.data[l * n..(l + 1) * n]
    }

    /// The states of a token range (e.g. one sample of a packed batch), as a new buffer.
    pub fn slice_tokens(&self, range: Range<usize>) -> Result<Self, ShapeError> {
        Ok(self.view_tokens(range)?.to_owned())
    }

    /// Concatenates parts along an axis; only [`TokenAxis`] is allowed, which
    /// the compiler enforces. Parts share `L` and `H` by type; their run-time
    /// sizes (for `usize` dims) are checked.
    pub fn concat<A: ConcatAxis>(parts: &[Self]) -> Result<Self, ShapeError> {
        let Some(first) = parts.first() else {
            return Err(ShapeError::new("concat", A::NAME, 1, 0));
        };
        let (layers, hidden) = (first.layers, first.hidden);
        for p in parts {
            check_dim("concat", "layers", layers, p.layers.size())?;
            check_dim("concat", "hidden", hidden, p.hidden.size())?;
        }
        let tokens: usize = parts.iter().map(|p| p.tokens).sum();
        let h = hidden.size();
        let mut data = Vec::with_capacity(layers.size() * tokens * h);
        for l in 0..layers.size() {
            for p in parts {
                data.extend_from_slice(p.layer(l));
            }
        }
        debug_assert_eq!(data.len(), layers.size() * tokens * h);
        Ok(CapturedStates { layers, tokens, hidden, data })
    }

    /// Converts the element type (e.g. f32 → bf16 for storage).
    pub fn to_element<E2: Element>(&self) -> CapturedStates<L, H, E2> {
        CapturedStates {
            layers: self.layers,
            tokens: self.tokens,
            hidden: self.hidden,
            data: self.data.iter().map(|v| E2::from_f32(v.to_f32())).collect(),
        }
    }

    /// A borrowed view of a token range (one sample of a packed batch), without copying.
    pub fn view_tokens(&self, range: Range<usize>) -> Result<StatesView<'_, L, H, E>, ShapeError> {
        if range.start > range.end || range.end > self.tokens {
            return Err(ShapeError::new("view_tokens", "tokens", self.tokens, range.end));
        }
        Ok(StatesView { states: self, range })
    }

    /// A view of all tokens.
    pub fn view(&self) -> StatesView<'_, L, H, E> {
        StatesView { states: self, range: 0..self.tokens }
    }
}

/// A borrowed `[L, T', H]` window of [`CapturedStates`] over a token range.
#[derive(Clone, Debug)]
pub struct StatesView<'a, L: Dim, H: Dim, E: Element = f32> {
    states: &'a CapturedStates<L, H, E>,
    range: Range<usize>,
}

impl<L: Dim, H: Dim, E: Element> StatesView<'_, L, H, E> {
    /// `[L, T', H]` as run-time sizes.
    pub fn shape(&self) -> [usize; 3] {
        [self.states.layers.size(), self.range.len(), self.states.hidden.size()]
    }
    /// The layers dim.
    pub fn layers(&self) -> L {
        self.states.layers
    }
    /// The hidden dim.
    pub fn hidden(&self) -> H {
        self.states.hidden
    }
    /// Number of tokens in the view.
    pub fn tokens(&self) -> usize {
        self.range.len()
    }

    /// One captured layer of the view, `[T', H]`.
    pub fn layer(&self, l: usize) -> &[E] {
        let h = self.states.hidden.size();
        &self.states.layer(l)[self.range.start * h..self.range.end * h]
    }

    /// Copies the view into its own buffer.
    pub fn to_owned(&self) -> CapturedStates<L, H, E> {
        let mut data = Vec::with_capacity(self.shape().iter().product());
        for l in 0..self.states.layers.size() {
            data.extend_from_slice(self.layer(l));
        }
        CapturedStates { layers: self.states.layers, tokens: self.range.len(), hidden: self.states.hidden, data }
    }

    /// Writes the view as `[T, L, H]` (the speculators layout) in `dtype`, appending to `out`.
    /// FP8 rows are quantised each with its own scale, appended to `scales`
    /// in the same `[T, L]` order (other dtypes leave `scales` alone).
    ///
    /// A view of more than `TLH_TASK_BYTES` (512 KiB) is encoded in token ranges on
    /// rayon's threads, each straight into its part of `out` (a storage-bound
    /// writer waits for this); the bytes are the same either way.
    pub fn encode_tlh(&self, dtype: DType, out: &mut Vec<u8>, scales: &mut Vec<f32>) {
        let [layers, tokens, h] = self.shape();
        let token_bytes = layers * h * dtype.size();
        let token_scales = if dtype.scaled() { layers } else { 0 };
        let (n, n_scales) = (tokens * token_bytes, tokens * token_scales);
        out.reserve(n);
        scales.reserve(n_scales);
        let mut dst = &mut out.spare_capacity_mut()[..n];
        let mut sc = &mut scales.spare_capacity_mut()[..n_scales];
        // Token ranges of about TLH_TASK_BYTES of source each, on rayon's
        // threads when there are two of both.
        let per_task = (TLH_TASK_BYTES / (layers * h * size_of::<E>()).max(1)).max(1);
        let mut tasks = Vec::with_capacity(tokens.div_ceil(per_task));
        for t in (0..tokens).step_by(per_task) {
            let k = per_task.min(tokens - t);
            let (d, rest) = std::mem::take(&mut dst).split_at_mut(k * token_bytes);
            dst = rest;
            let (s, rest) = std::mem::take(&mut sc).split_at_mut(k * token_scales);
            sc = rest;
            tasks.push((t..t + k, d, s));
        }
        if tasks.len() > 1 && rayon::current_num_threads() > 1 {
            tasks.into_par_iter().for_each(|(range, d, s)| self.encode_tlh_into(dtype, range, d, s));
        } else {
            tasks.into_iter().for_each(|(range, d, s)| self.encode_tlh_into(dtype, range, d, s));
        }
        // SAFETY: `encode_tlh_into` wrote every byte and scale of the token
        // ranges, which cover `n` bytes and `n_scales` scales.
        unsafe {
            out.set_len(out.len() + n);
            scales.set_len(scales.len() + n_scales);
        }
    }

    /// [`Self::encode_tlh`] of the view's tokens `range` into `dst` (their
    /// bytes) and `scales` (FP8: their scales), writing every element of both.
    fn encode_tlh_into(
        &self,
        dtype: DType,
        range: Range<usize>,
        dst: &mut [MaybeUninit<u8>],
        scales: &mut [MaybeUninit<f32>],
    ) {
        let [layers, _, h] = self.shape();
        let row_bytes = h * dtype.size();
        assert_eq!(dst.len(), range.len() * layers * row_bytes);
        assert_eq!(scales.len(), if dtype.scaled() { range.len() * layers } else { 0 });
        // An f32 copy of a row when `E` is not f32; an encoded row for dtypes
        // encoded through `DType::encode_into`.
        let mut row = vec![0f32; if E::DTYPE == DType::F32 { 0 } else { h }];
        let mut encoded = Vec::new();
        // A layer at a time: the source is read in order (a row of each
        // layer in turn, `[T, L, H]` order, took about 1.4x as long: every
        // row a jump the prefetcher does not follow), and the range's output
        // stays in cache while its layers fill it in.
        for l in 0..layers {
            let layer = &self.layer(l)[range.start * h..range.end * h];
            for i in 0..range.len() {
                let src = &layer[i * h..(i + 1) * h];
                let f = match as_f32(src) {
                    Some(f) => f,
                    None => {
                        row.iter_mut().zip(src).for_each(|(r, v)| *r = v.to_f32());
                        &row[..]
                    }
                };
                let j = i * layers + l;
                let d = &mut dst[j * row_bytes..(j + 1) * row_bytes];
                match dtype {
                    DType::F8E4M3 => {
                        scales[j].write(super::fp8::quantize_row_into(f, d));
                    }
                    DType::F32 => write_bytes(d, bytemuck::cast_slice(f)),
                    _ => {
                        encoded.clear();
                        dtype.encode_into(f, &mut encoded);
                        write_bytes(d, &encoded);
                    }
                }
            }
        }
    }
}

/// Source bytes (about) of one task of [`StatesView::encode_tlh`]: enough
/// that a task is long against handing it to a thread, few enough that the
/// tasks of one sample spread over the threads.
const TLH_TASK_BYTES: usize = 512 << 10;

/// Copies `src` into uninitialised bytes of the same length.
#[inline(always)]
fn write_bytes(dst: &mut [MaybeUninit<u8>], src: &[u8]) {
    assert_eq!(dst.len(), src.len());
    // SAFETY: equal lengths, checked above; a `MaybeUninit<u8>` has the layout of a `u8`.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_mut_ptr().cast::<u8>(), src.len()) };
}

/// The slice itself when `E` is f32 (no conversion pass needed).
fn as_f32<E: Element>(s: &[E]) -> Option<&[f32]> {
    (std::any::TypeId::of::<E>() == std::any::TypeId::of::<f32>())
        // SAFETY: E is f32, checked through TypeId just above.
        .then(|| unsafe { std::slice::from_raw_parts(s.as_ptr() as *const f32, s.len()) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shape::{Hidden, Layers};

    fn seq(l: usize, t: usize, h: usize, base: f32) -> Vec<f32> {
        (0..l * t * h).map(|i| base + i as f32).collect()
    }

    #[test]
    fn checked_construction() {
        let ok = CapturedStates::<Layers<2>, Hidden<3>>::try_from_vec(seq(2, 4, 3, 0.), Layers, 4, Hidden);
        assert_eq!(ok.unwrap().shape(), [2, 4, 3]);
        let err = CapturedStates::<Layers<2>, Hidden<3>>::try_from_vec(seq(2, 4, 2, 0.), Layers, 4, Hidden);
        assert_eq!(err.unwrap_err().axis, "elements");
        let bytes: Vec<u8> = seq(2, 4, 2, 0.).iter().flat_map(|v| v.to_le_bytes()).collect();
        let err = CapturedStates::<Layers<2>, Hidden<3>>::try_from_bytes(
            "capture \"input:1\"",
            &bytes,
            DType::F32,
            &[2, 4, 2],
            Layers,
            Hidden,
        )
        .unwrap_err();
        assert_eq!(err.to_string(), "capture \"input:1\": axis hidden: expected 3, got 2");
    }

    #[test]
    fn slice_then_concat_is_identity() {
        let s = CapturedStates::<usize, usize>::try_from_vec(seq(3, 7, 5, 0.), 3, 7, 5).unwrap();
        let parts = [s.slice_tokens(0..2).unwrap(), s.slice_tokens(2..3).unwrap(), s.slice_tokens(3..7).unwrap()];
        assert_eq!(CapturedStates::concat::<TokenAxis>(&parts).unwrap(), s);
        assert!(s.slice_tokens(5..8).is_err());
        let other = CapturedStates::<usize, usize>::zeros(3, 2, 4);
        let err = CapturedStates::concat::<TokenAxis>(&[s, other]).unwrap_err();
        assert_eq!((err.axis, err.expected, err.actual), ("hidden", 5, 4));
    }

    /// `[T, L, H]` a row at a time, as `encode_tlh` was written before its
    /// token ranges went to threads.
    fn tlh_by_rows<E: Element>(v: &StatesView<'_, usize, usize, E>, dtype: DType) -> (Vec<u8>, Vec<f32>) {
        let [l, t, h] = v.shape();
        let (mut out, mut scales) = (vec![7u8], vec![7f32]);
        for t in 0..t {
            for l in 0..l {
                let row: Vec<f32> = v.layer(l)[t * h..(t + 1) * h].iter().map(|x| x.to_f32()).collect();
                match dtype {
                    DType::F8E4M3 => scales.push(crate::shape::fp8::quantize_row(&row, &mut out)),
                    _ => dtype.encode_into(&row, &mut out),
                }
            }
        }
        (out, scales)
    }

    #[test]
    fn tlh_encoding_in_token_ranges_is_row_by_row() {
        // 3 × 200 f32 per token: 512 KiB is 218 tokens, so 1000 tokens are
        // five ranges (the last short), on rayon's threads when it has two.
        let (l, t, h) = (3, 1000, 200);
        let data: Vec<f32> = (0..l * t * h).map(|i| ((i as f32) * 0.37).sin() * (1 + i % 13) as f32).collect();
        let s = CapturedStates::<usize, usize>::try_from_vec(data, l, t, h).unwrap();
        let b = s.to_element::<half::bf16>();
        for dtype in [DType::F32, DType::BF16, DType::F16, DType::F8E4M3] {
            for range in [0..t, 3..997, 10..12, 5..5] {
                let v = s.view_tokens(range.clone()).unwrap();
                let (mut out, mut scales) = (vec![7u8], vec![7f32]);
                v.encode_tlh(dtype, &mut out, &mut scales);
                let (want_out, want_scales) = tlh_by_rows(&v, dtype);
                assert!(out == want_out, "{dtype}, tokens {range:?}");
                assert_eq!(scales, want_scales, "{dtype}, tokens {range:?}");
                // States kept as bf16 go through an f32 row first.
                let v = b.view_tokens(range.clone()).unwrap();
                let (mut out, mut scales) = (Vec::new(), Vec::new());
                v.encode_tlh(dtype, &mut out, &mut scales);
                let (want_out, want_scales) = tlh_by_rows(&v, dtype);
                assert!(out[..] == want_out[1..], "bf16 states, {dtype}, tokens {range:?}");
                assert_eq!(scales[..], want_scales[1..], "bf16 states, {dtype}, tokens {range:?}");
            }
        }
    }

    #[test]
    fn tlh_encoding_transposes() {
        let s = CapturedStates::<usize, usize>::try_from_vec(seq(2, 2, 1, 0.), 2, 2, 1).unwrap();
        let mut out = Vec::new();
        s.view().encode_tlh(DType::F32, &mut out, &mut Vec::new());
        let v: Vec<f32> = out.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        // [L=2,T=2] = [[0,1],[2,3]] -> [T,L] = [[0,2],[1,3]]
        assert_eq!(v, vec![0., 2., 1., 3.]);
    }
}
