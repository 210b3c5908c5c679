//! Input records, and the stage that makes them samples: token ids pass
//! through; text is tokenized; conversations are rendered with the model's
//! chat template into rows with loss masks ([`crate::chat`]). That stage
//! runs on its own thread, ahead of the forward.

pub mod arrow;
pub mod jsonl;
pub mod parts;
pub mod prepare;

use crate::chat::Conversation;
use crate::pipeline::source::{InputPos, SourceError};

/// What an input holds, chosen with `--input-format` or detected.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum InputFormat {
    /// Detected from the first record (JSON Lines) or the path (a `datasets` directory).
    #[cfg_attr(feature = "cli", value(help = "Detect from the first record"))]
    #[default]
    Auto,
    /// `{"input_ids": [...], "loss_mask": [...]}`.
    #[cfg_attr(feature = "cli", value(help = r#"{"input_ids": [...], "loss_mask": [...]}"#))]
    Tokens,
    /// `{"text": "..."}`.
    #[cfg_attr(feature = "cli", value(help = r#"{"text": "..."}, tokenized with the model's tokenizer"#))]
    Text,
    /// `{"conversations": [{"from": ..., "value": ...}]}`.
    #[cfg_attr(
        feature = "cli",
        value(name = "sharegpt", help = r#"{"conversations": [{"from": "human", "value": "..."}, ...]}"#)
    )]
    ShareGpt,
    /// `{"messages": [{"role": ..., "content": ...}], "tools": [...]}`.
    #[cfg_attr(
        feature = "cli",
        value(name = "openai", help = r#"{"messages": [{"role": "user", "content": "..."}, ...], "tools": [...]}"#)
    )]
    OpenAi,
    /// A Hugging Face `datasets` directory (`save_to_disk`): `input_ids`, optional `loss_mask`.
    #[cfg_attr(
        feature = "cli",
        value(
            help = "A datasets directory (save_to_disk) with input_ids and optional loss_mask columns; detected from state.json"
        )
    )]
    HfDataset,
}

impl InputFormat {
    /// The name on the command line and in the manifest.
    pub fn name(self) -> &'static str {
        match self {
            InputFormat::Auto => "auto",
            InputFormat::Tokens => "tokens",
            InputFormat::Text => "text",
            InputFormat::ShareGpt => "sharegpt",
            InputFormat::OpenAi => "openai",
            InputFormat::HfDataset => "hf-dataset",
        }
    }

    /// The field a JSON line of this format must have.
    pub fn field(self) -> &'static str {
        match self {
            InputFormat::Tokens | InputFormat::HfDataset => "input_ids",
            InputFormat::Text => "text",
            InputFormat::ShareGpt => "conversations",
            InputFormat::OpenAi => "messages",
            InputFormat::Auto => "input_ids`, `text`, `conversations` or `messages",
        }
    }

    /// Whether records need the model's tokenizer.
    pub fn needs_tokenizer(self) -> bool {
        matches!(self, InputFormat::Text | InputFormat::ShareGpt | InputFormat::OpenAi)
    }
}

/// One input record's content.
#[derive(Clone, Debug, PartialEq)]
pub enum Record {
    /// Token ids, with a loss mask or not (all ones).
    Tokens {
        /// Token ids.
        input_ids: Vec<u32>,
        /// 0/1 per token.
        loss_mask: Option<Vec<u8>>,
    },
    /// Text to tokenize.
    Text(String),
    /// A conversation to render.
    Chat(Conversation),
}

/// One input record.
#[derive(Clone, Debug)]
pub struct Item {
    /// 0-based index among the input's records.
    pub index: usize,
    /// 1-based line (or row) number, for messages.
    pub line: usize,
    /// The record's id, when it has one.
    pub id: Option<String>,
    /// Its content.
    pub record: Record,
    /// The input consumed through this record.
    pub end: InputPos,
}

/// A stream of records that knows how much input it consumed.
pub trait Records: Send {
    /// The next record; `None` at the end.
    fn next_record(&mut self) -> Option<Result<Item, SourceError>>;
    /// The input consumed so far.
    fn consumed(&self) -> InputPos;
    /// The format the records are in (resolved once the first is read).
    fn format(&self) -> InputFormat;
}
