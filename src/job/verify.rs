//! What `strata verify --recompute` decides before it runs a dataset's
//! samples again: which model (the manifest's, found again), in which
//! compute dtype, whether its config and weights are the ones the dataset
//! was written with, at which tolerance; and the verdict. The CLI calls
//! these in order and prints between them.

use super::{ModelRequest, ModelSource, OpenedModel};
use crate::backend::Compute;
use crate::dataset::verify::{clip, QUOTE_MAX};
use crate::dataset::Dataset;
use crate::format::manifest::hash_hex;
use crate::hf::hub::HubError;
use crate::model::{BackendKind, ComputeChoice, ModelError};
use std::path::{Path, PathBuf};

/// Why a verification could not run, or what it found wrong.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    /// The manifest names a hub id or directory that is not found again.
    #[error("the dataset's model {shown}: {cause}; or pass --model DIR")]
    ModelNotFound {
        /// The manifest's model path, clipped for the message.
        shown: String,
        /// Why the cache did not give it.
        cause: Box<HubError>,
    },
    /// The manifest's model directory no longer holds a model.
    #[error("the dataset's model {shown} has no config.json here; pass --model DIR")]
    NoConfig {
        /// The manifest's model path, clipped for the message.
        shown: String,
    },
    /// The model cannot be checked or loaded.
    #[error("model {name}")]
    Model {
        /// How the model is named.
        name: String,
        /// Why.
        #[source]
        source: Box<ModelError>,
    },
    /// Some capture points differ from a fresh forward, and the model's
    /// weights are not the dataset's (which is the finding).
    #[error("{failed} capture point(s) of {} differ from a fresh forward, as expected: {weights}", dir.display())]
    OtherWeights {
        /// Capture points that differ.
        failed: usize,
        /// The dataset.
        dir: PathBuf,
        /// Which weights ran, and which the manifest records.
        weights: String,
    },
    /// Some capture points differ from a fresh forward.
    #[error("{failed} capture point(s) of {} differ from a fresh forward", dir.display())]
    Differ {
        /// Capture points that differ.
        failed: usize,
        /// The dataset.
        dir: PathBuf,
    },
    /// The files do not match the manifest (or the expected layout).
    #[error("{count} problem(s) in {}", dir.display())]
    Problems {
        /// How many.
        count: usize,
        /// The dataset.
        dir: PathBuf,
    },
}

/// The model `--recompute` runs: `given` (`--model`), else `builtin` when the
/// manifest names it (a model the caller carries, as the CLI's embedded
/// demo), else the manifest's own, found again (a hub id in the cache; a
/// directory that must still hold `config.json`).
pub fn recompute_source(
    ds: &Dataset,
    given: Option<ModelSource>,
    builtin: (&str, fn() -> ModelSource),
) -> Result<ModelSource, VerifyError> {
    let m = &ds.manifest;
    if let Some(source) = given {
        return Ok(source);
    }
    if m.model.path == builtin.0 {
        return Ok(builtin.1());
    }
    // The path comes from the manifest and may be of any length.
    let shown = clip(&m.model.path, 4 * QUOTE_MAX).into_owned();
    let found = ModelSource::locate(&m.model.path, None)
        .map_err(|cause| VerifyError::ModelNotFound { shown: shown.clone(), cause: Box::new(cause) })?
        .0;
    if let ModelSource::Dir(dir) = &found {
        if !dir.join("config.json").is_file() {
            return Err(VerifyError::NoConfig { shown });
        }
    }
    Ok(found)
}

/// The compute dtype the dataset was written in, as its manifest records it.
pub fn stored_compute(ds: &Dataset) -> Option<Compute> {
    ds.manifest.run.as_ref().and_then(|r| r.compute.parse().ok())
}

/// `--compute` of a recomputation: as asked (resolved as extract and serve
/// resolve it), else the dataset's own on the CPU backend, f32 elsewhere.
pub fn recompute_compute(asked: Option<ComputeChoice>, backend: BackendKind, stored: Option<Compute>) -> ComputeChoice {
    match (asked, backend) {
        (Some(c), _) => c,
        (None, BackendKind::Cpu) => ComputeChoice::Fixed(stored.unwrap_or(Compute::F32)),
        (None, _) => ComputeChoice::Fixed(Compute::F32),
    }
}

/// A model opened to recompute a dataset, and how it differs from the one
/// the dataset was written with.
pub struct Reopened {
    /// The model.
    pub opened: OpenedModel,
    /// When its weights digest is not the manifest's: a sentence saying so.
    /// Other weights give other states, and that is then the finding.
    pub other_weights: Option<String>,
}

/// Checks `request` against `ds`, then loads it. `warn` hears, before the
/// weights are read, that the model's `config.json` is not the dataset's
/// (the comparison goes on).
pub fn reopen(ds: &Dataset, request: &ModelRequest, mut warn: impl FnMut(&str)) -> Result<Reopened, VerifyError> {
    let name = request.source.name();
    let model_err = |source| VerifyError::Model { name: name.clone(), source: Box::new(source) };
    let checked = request.check().map_err(model_err)?;
    let hash = hash_hex(xxhash_rust::xxh3::xxh3_64(checked.text.as_bytes()));
    let m = &ds.manifest;
    if hash != m.model.config_hash {
        warn(&format!(
            "the config.json of {name} ({hash}) is not the one the dataset was written with ({}); comparing anyway",
            m.model.config_hash
        ));
    }
    let opened = request.open(checked).map_err(model_err)?;
    let digest = &opened.weights_digest;
    let recorded = &m.model.weights_digest;
    let other_weights = (!recorded.is_empty() && digest != recorded).then(|| {
        format!(
            "the weights of {name} (digest {digest}) are not the ones the dataset was written with (digest \
             {recorded}, in its manifest)"
        )
    });
    Ok(Reopened { opened, other_weights })
}

/// The dtype whose tolerance the comparison takes: states written or
/// recomputed in bf16 are compared at bf16's.
pub fn tolerance_of(stored: Option<Compute>, fresh: Compute) -> Compute {
    if stored == Some(Compute::Bf16) {
        Compute::Bf16
    } else {
        fresh
    }
}

/// The verdict on `dir`: its file problems first, then the capture points
/// that differ from a fresh forward (`other_weights`: why, when the
/// weights were not the dataset's).
pub fn verdict(dir: &Path, problems: usize, failed: usize, other_weights: Option<String>) -> Result<(), VerifyError> {
    let dir = dir.to_path_buf();
    match (problems, failed, other_weights) {
        (0, 0, _) => Ok(()),
        (0, failed, Some(weights)) => Err(VerifyError::OtherWeights { failed, dir, weights }),
        (0, failed, None) => Err(VerifyError::Differ { failed, dir }),
        (count, _, _) => Err(VerifyError::Problems { count, dir }),
    }
}
