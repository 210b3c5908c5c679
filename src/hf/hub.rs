//! `--model org/name`: a Hugging Face hub id, found in the local hub cache as
//! transformers finds it offline, never downloaded. The cache is
//! `HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`; a
//! model lives in `models--org--name/`, whose `refs/<revision>` names the
//! commit whose files are in `snapshots/<commit>/` (a revision may also be
//! the commit itself). A directory of the name given wins over the id.

use std::path::{Path, PathBuf};

/// The environment the cache is found from (read once, so tests can give their own).
#[derive(Clone, Debug, Default)]
pub struct HubEnv {
    /// `HF_HUB_CACHE`.
    pub hub_cache: Option<PathBuf>,
    /// `HF_HOME`.
    pub hf_home: Option<PathBuf>,
    /// `HOME`.
    pub home: Option<PathBuf>,
}

impl HubEnv {
    /// This process's environment.
    pub fn from_process() -> Self {
        let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
        HubEnv { hub_cache: var("HF_HUB_CACHE"), hf_home: var("HF_HOME"), home: var("HOME") }
    }

    /// The cache directory, and which setting chose it (for messages).
    pub fn cache(&self) -> Option<(PathBuf, &'static str)> {
        if let Some(c) = &self.hub_cache {
            return Some((c.clone(), "HF_HUB_CACHE"));
        }
        if let Some(h) = &self.hf_home {
            return Some((h.join("hub"), "HF_HOME/hub"));
        }
        self.home.as_ref().map(|h| (h.join(".cache/huggingface/hub"), "the default, ~/.cache/huggingface/hub"))
    }
}

/// Where `--model` leads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Located {
    /// A checkpoint directory, as given.
    Dir(PathBuf),
    /// A hub id found in the cache.
    Hub {
        /// The id as given (what messages, manifests and `/v1/models` name).
        id: String,
        /// The revision asked for.
        revision: String,
        /// The commit it names.
        commit: String,
        /// `snapshots/<commit>/`: the checkpoint directory.
        snapshot: PathBuf,
    },
}

/// Why `--model` leads nowhere.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    /// Neither a directory nor an id the cache has.
    #[error(
        "--model {id} is not a directory, and the Hugging Face cache has no {id} at revision {revision}: looked \
         for {looked} (the cache is {cache_from}). Strata downloads nothing: fetch the model with \
         `huggingface-cli download {id}{rev_flag}`, or give the checkpoint's directory"
    )]
    NotCached {
        /// The id.
        id: String,
        /// The revision.
        revision: String,
        /// What was looked at.
        looked: String,
        /// Which setting chose the cache.
        cache_from: String,
        /// ` --revision R` when not `main`.
        rev_flag: String,
    },
    /// The cache names a snapshot that is not complete.
    #[error("--model {id} (revision {revision}): {snapshot} has no config.json: an incomplete download? fetch it again with `huggingface-cli download {id}`")]
    Incomplete {
        /// The id.
        id: String,
        /// The revision.
        revision: String,
        /// The snapshot directory.
        snapshot: String,
    },
    /// `--revision` with a directory.
    #[error("--revision {revision} applies to hub ids; {dir} is a directory, whose files are used as they are")]
    RevisionOfDir {
        /// The revision given.
        revision: String,
        /// The directory.
        dir: String,
    },
}

/// Whether `s` has the form of a hub id: `name` or `org/name`, each part of
/// letters, digits, `-`, `_` and `.` (not starting with `.` or `-`), as the hub allows.
pub fn is_hub_id(s: &str) -> bool {
    let part = |p: &str| {
        !p.is_empty()
            && p.len() <= 96
            && !p.starts_with(['.', '-'])
            && !p.contains("..")
            && !p.contains("--")
            && p.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
    };
    match s.split_once('/') {
        Some((org, name)) => part(org) && part(name),
        None => part(s),
    }
}

/// The snapshot of `id` at `revision` in the cache, if the cache has it:
/// `(commit, snapshot dir)`; `Err` lists what was looked at.
fn find(id: &str, revision: &str, cache: &Path) -> Result<(String, PathBuf), String> {
    let repo = cache.join(format!("models--{}", id.replace('/', "--")));
    let r = repo.join("refs").join(revision);
    // A ref names its commit in one line; a revision may also be the commit itself.
    let one_name = !revision.is_empty() && !revision.contains(['/', '\0']) && revision != "." && revision != "..";
    if one_name {
        if let Ok(text) = crate::files::read_text(&r, 4096) {
            let commit = text.trim().to_string();
            if !commit.is_empty() && commit.bytes().all(|b| b.is_ascii_alphanumeric()) {
                return Ok((commit.clone(), repo.join("snapshots").join(commit)));
            }
        }
        let snap = repo.join("snapshots").join(revision);
        if snap.is_dir() {
            return Ok((revision.to_string(), snap));
        }
    }
    Err(format!("{} and {}", r.display(), repo.join("snapshots").join(revision).display()))
}

/// Where `model` (as given to `--model`) leads, with `revision` (`--revision`, default `main`).
/// A directory wins; the note says so when the cache also has the id.
pub fn locate(model: &str, revision: Option<&str>, env: &HubEnv) -> Result<(Located, Option<String>), HubError> {
    let path = Path::new(model);
    let rev = revision.unwrap_or("main");
    if path.is_dir() {
        if let Some(r) = revision {
            return Err(HubError::RevisionOfDir { revision: r.to_string(), dir: model.to_string() });
        }
        let note = (is_hub_id(model))
            .then(|| env.cache())
            .flatten()
            .filter(|(cache, _)| find(model, rev, cache).is_ok())
            .map(|_| {
                format!("--model {model}: the directory ./{model} is used, not the hub id {model} in the cache (a directory of that name wins)")
            });
        return Ok((Located::Dir(path.to_path_buf()), note));
    }
    if !is_hub_id(model) || path.exists() {
        return Ok((Located::Dir(path.to_path_buf()), None));
    }
    let rev_flag = if rev == "main" { String::new() } else { format!(" --revision {rev}") };
    let Some((cache, cache_from)) = env.cache() else {
        return Err(HubError::NotCached {
            id: model.into(),
            revision: rev.into(),
            looked: "nothing (none of HF_HUB_CACHE, HF_HOME and HOME is set)".into(),
            cache_from: "unknown".into(),
            rev_flag,
        });
    };
    match find(model, rev, &cache) {
        Ok((commit, snapshot)) => {
            if !snapshot.join("config.json").exists() {
                return Err(HubError::Incomplete {
                    id: model.into(),
                    revision: rev.into(),
                    snapshot: snapshot.display().to_string(),
                });
            }
            Ok((Located::Hub { id: model.into(), revision: rev.into(), commit, snapshot }, None))
        }
        Err(looked) => Err(HubError::NotCached {
            id: model.into(),
            revision: rev.into(),
            looked,
            cache_from: format!("{} ({cache_from})", cache.display()),
            rev_flag,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cache holding `org/name` at commit `c0ffee` (ref `main`) and `beef01` (ref `v2`), files as links to blobs.
    fn cache() -> tempfile::TempDir {
        let t = tempfile::tempdir().unwrap();
        let repo = t.path().join("hub/models--org--name");
        std::fs::create_dir_all(repo.join("blobs")).unwrap();
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        for (rev, commit) in [("main", "c0ffee"), ("v2", "beef01")] {
            std::fs::write(repo.join("refs").join(rev), format!("{commit}\n")).unwrap();
            let snap = repo.join("snapshots").join(commit);
            std::fs::create_dir_all(&snap).unwrap();
            std::fs::write(repo.join("blobs").join(commit), "{}").unwrap();
            std::os::unix::fs::symlink(format!("../../blobs/{commit}"), snap.join("config.json")).unwrap();
        }
        t
    }

    #[test]
    fn ids_resolve_through_refs_or_commits_in_the_cache_the_environment_names() {
        let t = cache();
        let env = HubEnv { hub_cache: Some(t.path().join("hub")), ..Default::default() };
        let (found, note) = locate("org/name", None, &env).unwrap();
        let Located::Hub { commit, snapshot, .. } = found else { panic!("{found:?}") };
        assert_eq!((commit.as_str(), note), ("c0ffee", None));
        assert!(snapshot.ends_with("models--org--name/snapshots/c0ffee"));
        let (found, _) = locate("org/name", Some("v2"), &env).unwrap();
        assert!(matches!(found, Located::Hub { ref commit, .. } if commit == "beef01"));
        let (found, _) = locate("org/name", Some("beef01"), &env).unwrap();
        assert!(matches!(found, Located::Hub { ref commit, .. } if commit == "beef01"));
        // HF_HOME/hub, then ~/.cache/huggingface/hub.
        let env = HubEnv { hf_home: Some(t.path().to_path_buf()), ..Default::default() };
        assert!(matches!(locate("org/name", None, &env).unwrap().0, Located::Hub { .. }));
        std::fs::create_dir_all(t.path().join("home/.cache/huggingface")).unwrap();
        std::fs::rename(t.path().join("hub"), t.path().join("home/.cache/huggingface/hub")).unwrap();
        let env = HubEnv { home: Some(t.path().join("home")), ..Default::default() };
        assert!(matches!(locate("org/name", None, &env).unwrap().0, Located::Hub { .. }));
    }

    #[test]
    fn a_missing_id_says_where_it_looked_and_how_to_fetch_it() {
        let t = cache();
        let env = HubEnv { hub_cache: Some(t.path().join("hub")), ..Default::default() };
        let e = locate("org/other", None, &env).unwrap_err().to_string();
        assert!(e.contains("models--org--other/refs/main") && e.contains("huggingface-cli download org/other"), "{e}");
        assert!(e.contains("HF_HUB_CACHE"), "{e}");
        let e = locate("org/name", Some("v9"), &env).unwrap_err().to_string();
        assert!(e.contains("refs/v9") && e.contains("--revision v9"), "{e}");
        // Not an id: a plain missing directory.
        assert!(matches!(locate("./nope/x", None, &env).unwrap().0, Located::Dir(_)));
        assert!(!is_hub_id("../x") && !is_hub_id("a/b/c") && !is_hub_id("/abs") && !is_hub_id("a--b/c"));
        assert!(is_hub_id("meta-llama/Llama-3.1-8B") && is_hub_id("gpt2") && is_hub_id("Qwen/Qwen3.5-9B"));
    }
}
