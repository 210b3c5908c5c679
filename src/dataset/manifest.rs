//! `manifest.json` of the native format: what a dataset holds and how to check it.
//! See docs/FORMAT.md.

use crate::pipeline::capture::CapturePoint;
use crate::shape::DType;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// Version of the manifest and shard layout.
pub const SCHEMA_VERSION: u32 = 1;
/// The file name.
pub const MANIFEST: &str = "manifest.json";

/// The model a dataset came from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelInfo {
    /// Checkpoint directory as given, or `<embedded llama-default>`.
    pub path: String,
    /// `model_type`.
    pub architecture: String,
    /// `xxh3:` hash of the `config.json` bytes.
    pub config_hash: String,
    /// Decoder layers.
    pub num_layers: usize,
    /// Hidden width `H`.
    pub hidden_size: usize,
}

/// One captured layer of the `L` axis.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CaptureInfo {
    /// The point as on the CLI (`input:2`, `final`, ...).
    pub point: String,
    /// Index into HF `output_hidden_states`; `null` for `final` (not in HF's tuple).
    pub hf_index: Option<usize>,
}

/// One shard file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardInfo {
    /// File name inside the dataset directory.
    pub file: String,
    /// Samples in the shard.
    pub samples: usize,
    /// File size in bytes.
    pub bytes: u64,
}

/// One sample.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SampleInfo {
    /// The sample's id (tensor names are `{id}.hidden_states`, ...).
    pub id: String,
    /// Index into `shards`.
    pub shard: usize,
    /// Tokens `T`.
    pub tokens: usize,
    /// `xxh3:` hash of the sample's bytes as stored: `input_ids`, `loss_mask`, `hidden_states`.
    pub checksum: String,
}

/// The manifest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`SCHEMA_VERSION`].
    pub schema_version: u32,
    /// Strata's version that wrote the dataset.
    pub strata_version: String,
    /// Always `"strata"`.
    pub format: String,
    /// Axis order of `hidden_states`: `"LTH"`.
    pub layout: String,
    /// The model.
    pub model: ModelInfo,
    /// The `L` axis, in order.
    pub capture: Vec<CaptureInfo>,
    /// Storage dtype of `hidden_states`: `f32`, `bf16` or `f16`.
    pub dtype: String,
    /// Target shard size in bytes.
    pub shard_size: u64,
    /// False while a run is writing (or was interrupted); true once it finished.
    pub complete: bool,
    /// Shard files, in order.
    pub shards: Vec<ShardInfo>,
    /// Samples, in input order.
    pub samples: Vec<SampleInfo>,
}

impl ModelInfo {
    /// Describes a model from its `config.json` text and where it was loaded from.
    pub fn new(path: &str, config: &crate::hf::ArchInfo, config_json: &str) -> Self {
        ModelInfo {
            path: path.to_string(),
            architecture: config.architecture.clone(),
            config_hash: hash_hex(xxhash_rust::xxh3::xxh3_64(config_json.as_bytes())),
            num_layers: config.num_layers,
            hidden_size: config.hidden_size,
        }
    }
}

impl Manifest {
    /// The manifest of a new run: no shards or samples yet.
    pub fn new(model: ModelInfo, points: &[CapturePoint], dtype: DType, shard_size: u64) -> Self {
        let capture = points
            .iter()
            .map(|p| CaptureInfo { point: p.to_string(), hf_index: p.hf_index(model.num_layers) })
            .collect();
        Manifest {
            schema_version: SCHEMA_VERSION,
            strata_version: env!("CARGO_PKG_VERSION").to_string(),
            format: "strata".into(),
            layout: "LTH".into(),
            model,
            capture,
            dtype: dtype.to_string(),
            shard_size,
            complete: false,
            shards: vec![],
            samples: vec![],
        }
    }

    /// Reads `DIR/manifest.json`.
    pub fn read(dir: &Path) -> Result<Self, String> {
        let path = dir.join(MANIFEST);
        let text = std::fs::read_to_string(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let m: Manifest = serde_json::from_str(&text).map_err(|e| format!("malformed {}: {e}", path.display()))?;
        if m.schema_version != SCHEMA_VERSION {
            return Err(format!(
                "{}: schema_version {} is not supported (this strata reads {SCHEMA_VERSION})",
                path.display(),
                m.schema_version
            ));
        }
        Ok(m)
    }

    /// The fields that say what a run writes (everything but progress).
    pub fn same_job(&self, other: &Manifest) -> Result<(), String> {
        let pairs: [(&str, String, String); 6] = [
            ("strata_version", self.strata_version.clone(), other.strata_version.clone()),
            ("model.config_hash", self.model.config_hash.clone(), other.model.config_hash.clone()),
            ("capture", format!("{:?}", self.capture), format!("{:?}", other.capture)),
            ("dtype", self.dtype.clone(), other.dtype.clone()),
            ("shard_size", self.shard_size.to_string(), other.shard_size.to_string()),
            ("layout", self.layout.clone(), other.layout.clone()),
        ];
        for (field, a, b) in pairs {
            if a != b {
                return Err(format!("{field} differs: the existing run has {a}, this run {b}"));
            }
        }
        Ok(())
    }
}

/// `xxh3:` + 16 hex digits.
pub fn hash_hex(h: u64) -> String {
    format!("xxh3:{h:016x}")
}
