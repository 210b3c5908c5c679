//! The job behind `strata verify`: every sample against the manifest, the
//! layout against an expected one, and with `--recompute` the stored states
//! against a fresh forward of the model.

use crate::embedded;
use anyhow::{bail, Context};
use std::io::IsTerminal;
use std::path::PathBuf;
use strata::backend::Compute;
use strata::dataset::verify::{clip, verify, Layout, QUOTE_MAX};
use strata::dataset::Dataset;
use strata::format::manifest::hash_hex;
use strata::job::recompute::{recompute, Recompute};
use strata::job::{ModelRequest, ModelSource};
use strata::model::{BackendKind, ComputeChoice};

/// Everything `strata verify` needs.
pub struct VerifyJob {
    /// The dataset directory.
    pub dir: PathBuf,
    /// An expected layout file.
    pub layout: Option<PathBuf>,
    /// Samples to run again.
    pub recompute: Option<usize>,
    /// Seed of their choice.
    pub seed: u64,
    /// The model to run them on; default: the manifest's.
    pub model: Option<PathBuf>,
    /// Where to run it.
    pub backend: BackendKind,
    /// Over how many tensor-parallel ranks.
    pub tp: usize,
    /// GPU indices, one per rank (`--devices`); empty: the first `tp`.
    pub devices: Vec<usize>,
    /// In which compute dtype; default: the dataset's (f32 on the reference backend).
    pub compute: Option<ComputeChoice>,
}

impl VerifyJob {
    /// Runs every check asked for; an error (exit 1) if any fails.
    pub fn run(&self) -> anyhow::Result<()> {
        let dir = &self.dir;
        let layout = match &self.layout {
            Some(p) => Some(Layout::read(p).map_err(anyhow::Error::msg)?),
            None => None,
        };
        let problems = verify(dir, layout.as_ref()).with_context(|| format!("strata verify {}", dir.display()))?;
        let ds = Dataset::open(dir).with_context(|| format!("strata verify {}", dir.display()))?;
        let m = &ds.manifest;
        if problems.is_empty() {
            say!(
                "ok: {} samples in {} shards match the manifest{}",
                m.samples.len(),
                m.shards.len(),
                if layout.is_some() { " and the layout" } else { "" }
            );
        } else {
            for p in &problems {
                say!("problem: {p}");
            }
        }
        let recomputed = match self.recompute {
            Some(n) => Some(self.recompute(&ds, n).with_context(|| format!("strata verify --recompute {n}"))?),
            None => None,
        };
        let failed_points = recomputed.as_ref().map_or(0, |r| r.0.points.iter().filter(|p| !p.passed()).count());
        let other_weights = recomputed.and_then(|r| r.1);
        match (problems.len(), failed_points, other_weights) {
            (0, 0, _) => Ok(()),
            (0, f, Some(w)) => {
                bail!("{f} capture point(s) of {} differ from a fresh forward, as expected: {w}", dir.display())
            }
            (0, f, None) => bail!("{f} capture point(s) of {} differ from a fresh forward", dir.display()),
            (p, _, _) => bail!("{p} problem(s) in {}", dir.display()),
        }
    }

    /// Loads the model and compares `n` samples; prints the table. Also
    /// returns, when the model's weights digest is not the one the manifest
    /// records, a sentence saying so (checked first: other weights give
    /// other states, and that is the finding, not the states).
    fn recompute(&self, ds: &Dataset, n: usize) -> anyhow::Result<(Recompute, Option<String>)> {
        let m = &ds.manifest;
        // The model: --model, else the manifest's path (or the embedded demo model).
        let source = match &self.model {
            Some(dir) => crate::model_source(Some(dir), None)?,
            None if m.model.path == embedded::NAME => embedded::source(),
            None => {
                // The path comes from the manifest and may be of any length.
                let shown = clip(&m.model.path, 4 * QUOTE_MAX);
                // A hub id is found in the cache again; a directory must still hold the model.
                let found = ModelSource::locate(&m.model.path, None)
                    .map_err(|e| anyhow::anyhow!("the dataset's model {shown}: {e}; or pass --model DIR"))?
                    .0;
                if let ModelSource::Dir(dir) = &found {
                    if !dir.join("config.json").is_file() {
                        bail!("the dataset's model {shown} has no config.json here; pass --model DIR");
                    }
                }
                found
            }
        };
        let name = source.name();
        let stored: Option<Compute> = m.run.as_ref().and_then(|r| r.compute.parse().ok());
        // --compute as extract and serve resolve it; by default the dataset's own (CPU), f32 elsewhere.
        let compute = match (self.compute, self.backend) {
            (Some(c), _) => c,
            (None, BackendKind::Cpu) => ComputeChoice::Fixed(stored.unwrap_or(Compute::F32)),
            (None, _) => ComputeChoice::Fixed(Compute::F32),
        };
        let request =
            ModelRequest { source, backend: self.backend, compute, tp: self.tp, devices: self.devices.clone() };
        let checked = request.check().with_context(|| format!("model {name}"))?;
        let hash = hash_hex(xxhash_rust::xxh3::xxh3_64(checked.text.as_bytes()));
        if hash != m.model.config_hash {
            eprintln!(
                "warning: the config.json of {name} ({hash}) is not the one the dataset was written with ({}); \
                 comparing anyway",
                m.model.config_hash
            );
        }
        let opened = request.open(checked).with_context(|| format!("model {name}"))?;
        let digest = &opened.weights_digest;
        let recorded = &m.model.weights_digest;
        let other_weights = (!recorded.is_empty() && digest != recorded).then(|| {
            format!(
                "the weights of {name} (digest {digest}) are not the ones the dataset was written with (digest \
                 {recorded}, in its manifest)"
            )
        });
        if let Some(w) = &other_weights {
            say!("weights: {w}; the states are compared anyway");
        }
        let model = &opened.model;
        let compute = model.compute();
        // States written or recomputed in bf16 are compared at bf16's tolerance.
        let tolerance_of = if stored == Some(Compute::Bf16) { Compute::Bf16 } else { compute };
        let bar = std::io::stderr().is_terminal().then(|| indicatif::ProgressBar::new(n.min(m.samples.len()) as u64));
        let report = recompute(ds, model, tolerance_of, n, self.seed, |done, _| {
            if let Some(b) = &bar {
                b.set_position(done as u64);
            }
        })?;
        if let Some(b) = bar {
            b.finish_and_clear();
        }
        let t = &report.tolerance;
        say!(
            "recompute: {} of {} samples ({} tokens), seed {}, {name} on the {} backend ({} compute, --tp {})",
            report.samples.len(),
            m.samples.len(),
            report.tokens,
            self.seed,
            self.backend,
            model.compute(),
            self.tp
        );
        let fp8 = if m.dtype == "fp8" { " + 2^-9*scale of its row" } else { "" };
        say!(
            "  allowed |fresh - stored| = {:.1e}*|stored| + {:.1e}*max(1, |stored|){fp8} ({} storage, fresh states rounded to it)",
            t.storage,
            t.compute,
            m.dtype
        );
        let width = report.points.iter().map(|p| p.point.len()).max().unwrap_or(0);
        for p in &report.points {
            let verdict = match (p.passed(), p.identical()) {
                (true, true) => "identical",
                (true, false) => "ok",
                (false, _) => "DIFFERS",
            };
            say!(
                "  {:width$}  max abs {:.3e}  max rel {:.3e}  worst {:.3} of allowed  {verdict}",
                p.point,
                p.max_abs,
                p.max_rel,
                p.worst,
                width = width
            );
        }
        Ok((report, other_weights))
    }
}
