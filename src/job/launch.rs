//! What the launcher (torchrun, Slurm) tells a process about its place on
//! the node: which GPUs it takes when `--devices` is not given.

/// A launcher variable that does not say what it should.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum LaunchError {
    /// `LOCAL_RANK` or `SLURM_LOCALID` is not a non-negative integer.
    #[error("{var}={value:?} is not a local rank (a non-negative integer)")]
    LocalRank {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
    },
}

/// The GPUs of this process when `--devices` is not given, from the
/// launcher's local rank: torchrun's `LOCAL_RANK` or Slurm's `SLURM_LOCALID`
/// (process `r` of a node takes GPUs `r·tp .. r·tp + tp`). `None` (GPUs
/// `0..tp`) without a local rank, or when `CUDA_VISIBLE_DEVICES` shows this
/// process fewer than `(r + 1)·tp` GPUs: then the launcher gave each process
/// its own (Slurm's `--gpus-per-task`), numbered from 0.
pub fn launcher_gpus(
    tp: usize,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Option<(Vec<usize>, String)>, LaunchError> {
    let visible = env("CUDA_VISIBLE_DEVICES").map(|v| v.split(',').filter(|g| !g.trim().is_empty()).count());
    for var in ["LOCAL_RANK", "SLURM_LOCALID"] {
        let Some(v) = env(var).filter(|v| !v.trim().is_empty()) else { continue };
        let r: usize = v.trim().parse().map_err(|_| LaunchError::LocalRank { var, value: v.clone() })?;
        if visible.is_some_and(|n| n < (r + 1) * tp) {
            return Ok(None);
        }
        return Ok(Some(((r * tp..r * tp + tp).collect(), format!("{var}={r}"))));
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::launcher_gpus;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }

    #[test]
    fn each_local_process_takes_its_own_gpus() {
        assert_eq!(launcher_gpus(1, env(&[])), Ok(None));
        assert_eq!(launcher_gpus(1, env(&[("LOCAL_RANK", "3")])), Ok(Some((vec![3], "LOCAL_RANK=3".into()))));
        assert_eq!(launcher_gpus(2, env(&[("SLURM_LOCALID", "1")])), Ok(Some((vec![2, 3], "SLURM_LOCALID=1".into()))));
        // torchrun's variable first.
        let both = [("LOCAL_RANK", "0"), ("SLURM_LOCALID", "5")];
        assert_eq!(launcher_gpus(1, env(&both)), Ok(Some((vec![0], "LOCAL_RANK=0".into()))));
        // A launcher that gave each process its own GPUs: they are 0..tp.
        let own = [("LOCAL_RANK", "3"), ("CUDA_VISIBLE_DEVICES", "6,7")];
        assert_eq!(launcher_gpus(2, env(&own)), Ok(None));
        let all = [("LOCAL_RANK", "3"), ("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")];
        assert_eq!(launcher_gpus(2, env(&all)), Ok(Some((vec![6, 7], "LOCAL_RANK=3".into()))));
        // Slurm --gpus-per-task=2 with --tp 1: each task sees its own two, from 0.
        let per_task = [("SLURM_LOCALID", "2"), ("CUDA_VISIBLE_DEVICES", "4,5")];
        assert_eq!(launcher_gpus(1, env(&per_task)), Ok(None));
        let e = launcher_gpus(1, env(&[("LOCAL_RANK", "x")])).unwrap_err().to_string();
        assert!(e.contains("LOCAL_RANK=\"x\""), "{e}");
    }
}
