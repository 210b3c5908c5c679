//! Capture points: where in the residual stream a state is read, in one explicit convention.
//!
//! Every point is defined against Hugging Face's `output_hidden_states` tuple
//! (`hs`, `N + 1` entries for `N` decoder layers):
//!
//! | point              | CLI        | meaning                                   | HF index |
//! |--------------------|------------|-------------------------------------------|----------|
//! | `Embeddings`       | embeddings | token embeddings (input of layer 0)       | `hs[0]`  |
//! | `LayerInput(k)`    | input:K    | residual stream entering layer `k`        | `hs[k]`  |
//! | `LayerOutput(k)`   | output:K   | HF's entry after layer `k`                | `hs[k+1]`|
//! | `FinalPreNorm`     | final      | residual stream after the last layer      | (none)   |
//! | `FinalPostNorm`    | final-norm | after the final norm (what the LM head reads) | `hs[N]` |
//!
//! vLLM's EAGLE-3 aux layer `k` is `LayerInput(k)`; SGLang, SpecForge and
//! modelopt's layer `k` is `LayerOutput(k)`. Beware one HF quirk this keeps:
//! `hs[N]` is post-norm, so `LayerOutput(N-1)` equals `FinalPostNorm`; the raw
//! output of the last layer is `FinalPreNorm`.

use crate::shape::{dim_from_size, Dim, ShapeError};
use std::fmt;
use std::str::FromStr;

/// A point of the residual stream to capture.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CapturePoint {
    /// Token embeddings, HF `hs[0]`.
    Embeddings,
    /// Residual stream at the input of decoder layer `k`, HF `hs[k]`.
    LayerInput(usize),
    /// HF `hs[k+1]`: the residual after layer `k` (post-norm for the last layer, as in HF).
    LayerOutput(usize),
    /// Residual stream after the last decoder layer, before the final norm.
    FinalPreNorm,
    /// After the final norm, HF `hs[N]`.
    FinalPostNorm,
}

/// Where the forward reads a capture: before layer `k` (`k = N` means after the
/// last layer), or after the final norm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tap {
    /// The residual stream entering layer `k`; `k = num_layers` is after the last layer.
    Residual(usize),
    /// After the final norm.
    PostNorm,
}

/// A capture point that the model cannot provide.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CaptureError {
    /// Text that is not a capture point.
    #[error("cannot parse capture point {0:?}: expected embeddings, input:K, output:K, final, final-norm or eagle3")]
    Parse(String),
    /// A layer index past the model's last layer.
    #[error("capture point {point} needs layer {layer}, but the model has {num_layers} layers (0..={last})", last = .num_layers.saturating_sub(1))]
    LayerOutOfRange {
        /// The offending point.
        point: CapturePoint,
        /// Its layer index.
        layer: usize,
        /// The model's layer count.
        num_layers: usize,
    },
    /// An empty capture list.
    #[error("the capture list is empty")]
    Empty,
    /// A point listed twice: it would be computed and written twice.
    #[error("capture point {point} is listed twice{note}; list each point once")]
    Duplicate {
        /// The repeated point.
        point: CapturePoint,
        /// Where the second copy came from, if not plain text.
        note: &'static str,
    },
    /// The `eagle3` preset on a model too shallow for its `input:2`.
    #[error(
        "the eagle3 preset (input:2, input:N/2, input:N-3, final) needs at least 3 decoder layers, \
         but the model has {num_layers}; pass an explicit --capture list instead (e.g. --capture input:0,final)"
    )]
    Eagle3TooShallow {
        /// The model's layer count.
        num_layers: usize,
    },
    /// The list's length disagrees with the job's layers type.
    #[error(transparent)]
    Shape(#[from] ShapeError),
}

impl CapturePoint {
    /// Index into HF `output_hidden_states`, or `None` for `FinalPreNorm` (not in HF's tuple).
    pub fn hf_index(self, num_layers: usize) -> Option<usize> {
        match self {
            CapturePoint::Embeddings => Some(0),
            CapturePoint::LayerInput(k) => Some(k),
            CapturePoint::LayerOutput(k) => Some(k + 1),
            CapturePoint::FinalPreNorm => None,
            CapturePoint::FinalPostNorm => Some(num_layers),
        }
    }

    /// Where the forward reads this point, validated against the layer count.
    pub fn tap(self, num_layers: usize) -> Result<Tap, CaptureError> {
        let check = |layer: usize| {
            if layer < num_layers {
                Ok(())
            } else {
                Err(CaptureError::LayerOutOfRange { point: self, layer, num_layers })
            }
        };
        Ok(match self {
            CapturePoint::Embeddings => Tap::Residual(0),
            CapturePoint::LayerInput(k) => {
                check(k)?;
                Tap::Residual(k)
            }
            CapturePoint::LayerOutput(k) => {
                check(k)?;
                if k + 1 == num_layers {
                    Tap::PostNorm
                } else {
                    Tap::Residual(k + 1)
                }
            }
            CapturePoint::FinalPreNorm => Tap::Residual(num_layers),
            CapturePoint::FinalPostNorm => Tap::PostNorm,
        })
    }

    /// The EAGLE-3 preset: `input:2, input:N/2, input:N-3, final` (vLLM's aux layers plus the last state).
    pub fn eagle3(num_layers: usize) -> Vec<CapturePoint> {
        vec![
            CapturePoint::LayerInput(2),
            CapturePoint::LayerInput(num_layers / 2),
            CapturePoint::LayerInput(num_layers.saturating_sub(3)),
            CapturePoint::FinalPreNorm,
        ]
    }

    /// [`eagle3`](Self::eagle3) for a model of `num_layers`, refused below 3
    /// layers. Below 7 layers its three `input:` points coincide or run
    /// backwards (4 layers: `input:2, input:2, input:1`), which the
    /// speculators trainer refuses as layer ids (they must be distinct; it
    /// has no fallback). There the points are spread instead, distinct and
    /// in order: `input:1, input:N/2, input:N-1` (3 layers: `input:0, 1, 2`),
    /// and a warning names them.
    pub fn eagle3_for(num_layers: usize) -> Result<Vec<CapturePoint>, CaptureError> {
        if num_layers < 3 {
            return Err(CaptureError::Eagle3TooShallow { num_layers });
        }
        let points = CapturePoint::eagle3(num_layers);
        let ids: Vec<usize> = points.iter().filter_map(|p| p.speculators_id(num_layers)).collect();
        if ids.windows(2).all(|w| w[0] < w[1]) {
            return Ok(points);
        }
        let spread = if num_layers == 3 { [0, 1, 2] } else { [1, num_layers / 2, num_layers - 1] };
        let mut points: Vec<CapturePoint> = spread.iter().map(|&k| CapturePoint::LayerInput(k)).collect();
        points.push(CapturePoint::FinalPreNorm);
        let list: Vec<String> = points.iter().map(ToString::to_string).collect();
        tracing::warn!(
            "eagle3 on a {num_layers}-layer model: input:2, input:N/2 and input:N-3 are not distinct, so {} are \
             captured instead (the trainer then needs --target-layer-ids {} {} {}); pass --capture to choose others",
            list.join(","),
            spread[0],
            spread[1],
            spread[2]
        );
        Ok(points)
    }

    /// The speculators trainer's layer id of this point on a model of
    /// `num_layers`: `input:k` is id k (the input of layer k), the output of
    /// layer k is id k + 1, `final` (before the norm) is id N; `None` for
    /// points the trainer has no id for (`final-norm`, and `output:N-1`,
    /// which is the `final` state).
    pub fn speculators_id(&self, num_layers: usize) -> Option<usize> {
        match *self {
            CapturePoint::Embeddings => Some(0),
            CapturePoint::LayerInput(k) => Some(k),
            CapturePoint::LayerOutput(k) if k + 1 < num_layers => Some(k + 1),
            CapturePoint::FinalPreNorm => Some(num_layers),
            _ => None,
        }
    }

    /// Parses a comma list (`embeddings,input:2,eagle3,...`); `eagle3` expands
    /// with `num_layers` (see [`eagle3_for`](Self::eagle3_for)). A point listed
    /// twice is refused; two names of one state (`output:0` and `input:1`)
    /// are allowed, as HF's own tuple has them, with a warning.
    pub fn parse_list(text: &str, num_layers: usize) -> Result<Vec<CapturePoint>, CaptureError> {
        let mut out: Vec<CapturePoint> = Vec::new();
        let mut by_eagle3: Vec<bool> = Vec::new(); // per point of `out`: whether the preset put it there
        for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let eagle3 = item.eq_ignore_ascii_case("eagle3");
            let points = if eagle3 { CapturePoint::eagle3_for(num_layers)? } else { vec![item.parse()?] };
            for point in points {
                if let Some(i) = out.iter().position(|p| *p == point) {
                    let note = if eagle3 || by_eagle3[i] {
                        " (eagle3 stands for input:2, input:N/2, input:N-3, final)"
                    } else {
                        ""
                    };
                    return Err(CaptureError::Duplicate { point, note });
                }
                out.push(point);
                by_eagle3.push(eagle3);
            }
        }
        if out.is_empty() {
            return Err(CaptureError::Empty);
        }
        let taps = out.iter().map(|p| p.tap(num_layers)).collect::<Result<Vec<_>, _>>()?;
        for (i, tap) in taps.iter().enumerate() {
            if let Some(j) = taps[..i].iter().position(|t| t == tap) {
                tracing::warn!("capture points {} and {} are the same state; it is written twice", out[j], out[i]);
            }
        }
        Ok(out)
    }
}

impl fmt::Display for CapturePoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CapturePoint::Embeddings => f.write_str("embeddings"),
            CapturePoint::LayerInput(k) => write!(f, "input:{k}"),
            CapturePoint::LayerOutput(k) => write!(f, "output:{k}"),
            CapturePoint::FinalPreNorm => f.write_str("final"),
            CapturePoint::FinalPostNorm => f.write_str("final-norm"),
        }
    }
}

impl FromStr for CapturePoint {
    type Err = CaptureError;
    fn from_str(s: &str) -> Result<Self, CaptureError> {
        let bad = || CaptureError::Parse(s.to_string());
        let lower = s.trim().to_ascii_lowercase();
        let layer = |rest: &str| rest.trim().parse::<usize>().map_err(|_| bad());
        match lower.as_str() {
            "embeddings" | "embed" => Ok(CapturePoint::Embeddings),
            "final" => Ok(CapturePoint::FinalPreNorm),
            "final-norm" | "final_norm" => Ok(CapturePoint::FinalPostNorm),
            _ => {
                if let Some(rest) = lower.strip_prefix("input:") {
                    Ok(CapturePoint::LayerInput(layer(rest)?))
                } else if let Some(rest) = lower.strip_prefix("output:") {
                    Ok(CapturePoint::LayerOutput(layer(rest)?))
                } else {
                    Err(bad())
                }
            }
        }
    }
}

/// An ordered list of capture points whose length is the job's layers dim `L`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CaptureSet<L: Dim> {
    layers: L,
    points: Vec<CapturePoint>,
}

impl<L: Dim + Default> CaptureSet<L> {
    /// Checks that the list has `L` entries (any count for `L = usize`).
    pub fn try_new(points: Vec<CapturePoint>) -> Result<Self, CaptureError> {
        if points.is_empty() {
            return Err(CaptureError::Empty);
        }
        let layers = dim_from_size::<L>("capture list", "layers", points.len())?;
        Ok(CaptureSet { layers, points })
    }
}

impl<L: Dim> CaptureSet<L> {
    /// The layers dim.
    pub fn layers(&self) -> L {
        self.layers
    }
    /// The points, in output order.
    pub fn points(&self) -> &[CapturePoint] {
        &self.points
    }
    /// Each point's tap, validated against the model's layer count.
    pub fn taps(&self, num_layers: usize) -> Result<Vec<Tap>, CaptureError> {
        self.points.iter().map(|p| p.tap(num_layers)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shape::Layers;

    #[test]
    fn parse_print_round_trip() {
        for p in [
            CapturePoint::Embeddings,
            CapturePoint::LayerInput(3),
            CapturePoint::LayerOutput(0),
            CapturePoint::FinalPreNorm,
            CapturePoint::FinalPostNorm,
        ] {
            assert_eq!(p.to_string().parse::<CapturePoint>().unwrap(), p);
        }
        assert!("input:x".parse::<CapturePoint>().is_err());
        assert!("layer:3".parse::<CapturePoint>().is_err());
    }

    #[test]
    fn hf_indices_and_taps() {
        let n = 8;
        assert_eq!(CapturePoint::LayerInput(3).hf_index(n), Some(3));
        assert_eq!(CapturePoint::LayerOutput(3).hf_index(n), Some(4));
        assert_eq!(CapturePoint::FinalPostNorm.hf_index(n), Some(8));
        assert_eq!(CapturePoint::FinalPreNorm.hf_index(n), None);
        assert_eq!(CapturePoint::LayerOutput(3).tap(n).unwrap(), Tap::Residual(4));
        assert_eq!(CapturePoint::LayerOutput(7).tap(n).unwrap(), Tap::PostNorm);
        assert_eq!(CapturePoint::FinalPreNorm.tap(n).unwrap(), Tap::Residual(8));
        assert!(matches!(CapturePoint::LayerInput(8).tap(n), Err(CaptureError::LayerOutOfRange { .. })));
    }

    #[test]
    fn eagle3_preset_and_lists() {
        let l = CapturePoint::parse_list("eagle3", 61).unwrap();
        let want = [
            CapturePoint::LayerInput(2),
            CapturePoint::LayerInput(30),
            CapturePoint::LayerInput(58),
            CapturePoint::FinalPreNorm,
        ];
        assert_eq!(l, want);
        let l = CapturePoint::parse_list("embeddings, output:1,final-norm", 4).unwrap();
        assert_eq!(l.len(), 3);
        assert!(matches!(CapturePoint::parse_list("", 4), Err(CaptureError::Empty)));
        assert!(CapturePoint::parse_list("input:4", 4).is_err());
    }

    #[test]
    fn eagle3_gives_three_distinct_increasing_layer_ids_on_every_depth() {
        for n in 3..=80 {
            let points = CapturePoint::eagle3_for(n).unwrap();
            let ids: Vec<usize> = points.iter().map(|p| p.speculators_id(n).unwrap()).collect();
            assert_eq!(ids.len(), 4, "{n} layers");
            assert!(ids.windows(2).all(|w| w[0] < w[1]), "{n} layers: {ids:?}");
            assert_eq!(ids[3], n);
            if n >= 7 {
                // speculators' own default there: [2, N/2, N-3]
                assert_eq!(&ids[..3], &[2, n / 2, n - 3]);
            }
        }
        let ids = |n| {
            CapturePoint::eagle3_for(n).unwrap()[..3].iter().map(|p| p.speculators_id(n).unwrap()).collect::<Vec<_>>()
        };
        assert_eq!(ids(3), [0, 1, 2]);
        assert_eq!(ids(4), [1, 2, 3]);
        assert_eq!(ids(6), [1, 3, 5]);
    }

    #[test]
    fn duplicates_and_shallow_eagle3() {
        let e = CapturePoint::parse_list("input:2,input:2", 8).unwrap_err();
        assert_eq!(e.to_string(), "capture point input:2 is listed twice; list each point once");
        let e = CapturePoint::parse_list("eagle3,final", 8).unwrap_err();
        assert!(e.to_string().contains("final is listed twice (eagle3 stands for"), "{e}");
        // Two names of one state are HF's own convention: allowed.
        assert_eq!(CapturePoint::parse_list("output:0,input:1", 8).unwrap().len(), 2);
        let e = CapturePoint::parse_list("eagle3", 2).unwrap_err();
        assert!(e.to_string().contains("needs at least 3 decoder layers, but the model has 2"), "{e}");
        // input:2, input:2, input:1 would be ids the trainer refuses: spread instead.
        let four = CapturePoint::parse_list("eagle3", 4).unwrap();
        let want = [1, 2, 3].map(CapturePoint::LayerInput);
        assert_eq!(four, [&want[..], &[CapturePoint::FinalPreNorm]].concat());
        assert_eq!(CapturePoint::parse_list("eagle3", 7).unwrap().len(), 4);
    }

    #[test]
    fn capture_set_checks_static_layers() {
        let pts = CapturePoint::eagle3(32);
        assert!(CaptureSet::<Layers<4>>::try_new(pts.clone()).is_ok());
        let err = CaptureSet::<Layers<3>>::try_new(pts).unwrap_err();
        assert_eq!(err.to_string(), "capture list: axis layers: expected 3, got 4");
    }
}
