//! `strata verify`: every sample against the manifest, the layout against an
//! expected one, and with `--recompute` the stored states against a fresh
//! forward of the model (its decisions are `strata::job::verify`'s); the
//! calls in order, and what they print.

use crate::embedded;
use anyhow::Context;
use std::io::IsTerminal;
use std::path::PathBuf;
use strata::dataset::verify::{verify, Layout};
use strata::dataset::Dataset;
use strata::job::recompute::{recompute, Recompute};
use strata::job::verify;
use strata::job::ModelRequest;
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
            Some(p) => Some(Layout::read(p)?),
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
        Ok(verify::verdict(dir, problems.len(), failed_points, other_weights)?)
    }

    /// Loads the model and compares `n` samples; prints the table. Also
    /// returns, when the model's weights digest is not the one the manifest
    /// records, a sentence saying so.
    fn recompute(&self, ds: &Dataset, n: usize) -> anyhow::Result<(Recompute, Option<String>)> {
        let m = &ds.manifest;
        let given = match &self.model {
            Some(dir) => Some(crate::model_source(Some(dir), None)?),
            None => None,
        };
        let source = verify::recompute_source(ds, given, (embedded::NAME, embedded::source))?;
        let name = source.name();
        let stored = verify::stored_compute(ds);
        let compute = verify::recompute_compute(self.compute, self.backend, stored);
        let request = ModelRequest {
            source,
            backend: self.backend,
            compute,
            tp: self.tp,
            devices: self.devices.clone(),
            lm_head: false,
        };
        let reopened = verify::reopen(ds, &request, |w| eprintln!("warning: {w}"))?;
        let other_weights = reopened.other_weights;
        if let Some(w) = &other_weights {
            say!("weights: {w}; the states are compared anyway");
        }
        let model = &reopened.opened.model;
        let tolerance_of = verify::tolerance_of(stored, model.compute());
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
