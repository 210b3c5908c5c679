//! Conversations to token rows: the model's tokenizer (`tokenizer.json` or
//! a tiktoken BPE), its chat template, and loss masks by render boundaries
//! or `{% generation %}` blocks. No server, no Python.

pub mod conversation;
pub mod isolate;
pub mod pieces;
pub mod rows;
pub mod template;
pub mod tiktoken;
pub mod tokenizer;

use std::path::{Path, PathBuf};

pub use conversation::{Conversation, Role, Style};
pub use pieces::Prefix;
pub use rows::{LongRows, MaskSource, Row, RowMode, RowOptions, Rows, RowsError};
pub use template::Template;
pub use tokenizer::{Encoded, Tokenizer};

/// A tokenizer or chat template that cannot be loaded or used.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    /// The tokenizer files.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template.
    #[error("{0}")]
    Template(String),
    /// This one text cannot be tokenized (the pre-tokenisation pattern fails
    /// on it or does not cover it): that record is refused, the run goes on.
    #[error("{0}")]
    Text(String),
}

/// Where a run's chat template and variables come from.
#[derive(Clone, Debug)]
pub struct ChatOptions {
    /// `--chat-template FILE`: overrides the model's.
    pub template_file: Option<PathBuf>,
    /// The date `strftime_now` renders.
    pub date: chrono::NaiveDate,
    /// Extra template variables (`--chat-template-kwargs`, e.g. `enable_thinking`).
    pub kwargs: serde_json::Map<String, serde_json::Value>,
    /// The bytes one render may make (`--template-memory`); see [`template::Template::new`].
    pub template_memory: u64,
}

/// `--template-memory`'s default: 1 GiB per render.
pub const DEFAULT_TEMPLATE_MEMORY: u64 = 1 << 30;

impl Default for ChatOptions {
    fn default() -> Self {
        ChatOptions {
            template_file: None,
            date: chrono::NaiveDate::default(),
            kwargs: Default::default(),
            template_memory: DEFAULT_TEMPLATE_MEMORY,
        }
    }
}

/// The model's tokenizer and chat template, loaded once per run.
#[derive(Debug)]
pub struct Chat {
    /// The tokenizer.
    pub tokenizer: Tokenizer,
    /// The chat template; `None` when the model has none (text and token inputs still work).
    pub template: Option<Template>,
    /// Where the template came from (a file, `tokenizer_config.json`).
    pub template_origin: Option<String>,
    /// `xxh3:` of the template text, for the manifest.
    pub template_digest: Option<String>,
    /// The model directory and options it was loaded from (a render process loads them again).
    pub loaded_from: (PathBuf, ChatOptions),
    /// `xxh3:` of what was read: the tokenizer file, `tokenizer_config.json` and the template.
    pub digest: String,
}

/// Special-token variables every render gets, from `tokenizer_config.json`.
const SPECIAL_VARS: [&str; 7] =
    ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"];

fn token_text(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        // An AddedToken object.
        serde_json::Value::Object(m) => m.get("content").and_then(|c| c.as_str()).map(String::from),
        _ => None,
    }
}

fn read_json(path: &Path) -> Result<Option<serde_json::Value>, ChatError> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = crate::files::read_text(path, 256 << 20)
        .map_err(|e| ChatError::Template(format!("{}: {e}", path.display())))?;
    serde_json::from_str(&text).map(Some).map_err(|e| ChatError::Template(format!("{}: {e}", path.display())))
}

impl Chat {
    /// Loads the tokenizer and chat template of the model in `dir`. The
    /// template is `opts.template_file`, else `chat_template.jinja`, else
    /// `tokenizer_config.json`'s `chat_template` (its `default` when it lists several),
    /// else `chat_template.json`'s.
    pub fn load(dir: &Path, opts: &ChatOptions) -> Result<Self, ChatError> {
        let config = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(serde_json::Value::Null);
        let (tokenizer, tokenizer_digest) = Tokenizer::load_digest(dir, &config)?;
        let read = |p: &Path| {
            crate::files::read_text(p, 16 << 20)
                .map_err(|e| ChatError::Template(format!("chat template {}: {e}", p.display())))
        };
        // A `chat_template` field: a string, or transformers' list of named
        // templates, of which `default` is the one `apply_chat_template` renders.
        let from_config = |v: Option<&serde_json::Value>, file: &str| -> Result<Option<String>, ChatError> {
            let bad = |why: String| {
                ChatError::Template(format!(
                    "{}/{file}: `chat_template` {why}; pass --chat-template FILE to choose one",
                    dir.display()
                ))
            };
            match v {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
                Some(serde_json::Value::Array(list)) => {
                    let name = |t: &serde_json::Value| t.get("name").and_then(|n| n.as_str()).map(String::from);
                    match list.iter().find(|t| name(t).as_deref() == Some("default")) {
                        Some(t) => match t.get("template").and_then(|t| t.as_str()) {
                            Some(t) => Ok(Some(t.to_string())),
                            None => Err(bad("lists a \"default\" entry without a string `template`".into())),
                        },
                        None => {
                            let names: Vec<String> =
                                list.iter().map(|t| name(t).map_or("(unnamed)".into(), |n| crate::quote(&n))).collect();
                            Err(bad(format!(
                                "is a list of named templates without \"default\" (it has {}), as transformers \
                                 refuses too",
                                crate::clip(&names.join(", "), 200)
                            )))
                        }
                    }
                }
                Some(other) => Err(bad(format!(
                    "must be a string or a list of {{\"name\", \"template\"}} entries, not {}",
                    match other {
                        serde_json::Value::Bool(_) => "a boolean",
                        serde_json::Value::Number(_) => "a number",
                        _ => "an object",
                    }
                ))),
            }
        };
        let jinja = dir.join("chat_template.jinja");
        let (source, origin) = if let Some(f) = &opts.template_file {
            (Some(read(f)?), f.display().to_string())
        } else if jinja.is_file() {
            (Some(read(&jinja)?), jinja.display().to_string())
        } else if let Some(t) = from_config(config.get("chat_template"), "tokenizer_config.json")? {
            (Some(t), format!("{}/tokenizer_config.json", dir.display()))
        } else {
            let j = read_json(&dir.join("chat_template.json"))?;
            let t = match &j {
                Some(j) => from_config(j.get("chat_template"), "chat_template.json")?,
                None => None,
            };
            (t, format!("{}/chat_template.json", dir.display()))
        };
        let mut globals: Vec<(String, serde_json::Value)> = Vec::new();
        for k in SPECIAL_VARS {
            if let Some(t) = config.get(k).and_then(token_text) {
                globals.push((k.into(), t.into()));
            }
        }
        if let Some(list) = config.get("additional_special_tokens").and_then(|v| v.as_array()) {
            let list: Vec<serde_json::Value> = list.iter().filter_map(token_text).map(Into::into).collect();
            globals.push(("additional_special_tokens".into(), list.into()));
        }
        for (k, v) in &opts.kwargs {
            globals.retain(|(g, _)| g != k);
            globals.push((k.clone(), v.clone()));
        }
        let (template, template_origin, template_digest) = match source {
            Some(src) => {
                let digest = format!("xxh3:{:016x}", xxhash_rust::xxh3::xxh3_64(src.as_bytes()));
                let t = Template::new(&src, &origin, opts.date, globals, opts.template_memory)?;
                (Some(t), Some(origin), Some(digest))
            }
            None => (None, None, None),
        };
        // What was read: a render process that loads the model again must find the same.
        let digest = format!(
            "xxh3:{:016x}",
            xxhash_rust::xxh3::xxh3_64(
                format!("{tokenizer_digest:016x} {config} {}", template_digest.as_deref().unwrap_or("")).as_bytes()
            )
        );
        Ok(Chat {
            tokenizer,
            template,
            template_origin,
            template_digest,
            digest,
            loaded_from: (dir.to_path_buf(), opts.clone()),
        })
    }

    /// A renderer for conversations; an error when the model has no chat template.
    pub fn renderer(&self) -> Result<rows::Renderer<'_>, ChatError> {
        let t = self.template.as_ref().ok_or_else(|| {
            ChatError::Template(
                "the input holds conversations, but the model has no chat template (no chat_template.jinja, and \
                 none in tokenizer_config.json): pass --chat-template FILE"
                    .into(),
            )
        })?;
        Ok(rows::Renderer::new(&self.tokenizer, t))
    }
}
