//! Token rows and loss masks from a conversation, by render boundaries (as
//! the speculators stack derives them) or by the template's
//! `{% generation %}` blocks (as transformers' `return_assistant_tokens_mask`).

use super::conversation::{Conversation, Role};
use super::template::{json_value, RenderError, Template};
use super::tokenizer::{Encoded, Tokenizer};
use super::ChatError;

/// Where the loss mask comes from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MaskSource {
    /// Each assistant turn from where its generation prompt ends.
    #[default]
    Boundary,
    /// The template's `{% generation %}` blocks.
    Generation,
}

/// How a conversation becomes rows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RowMode {
    /// One row per conversation where that is exact (prefix-stable), else one per assistant turn.
    #[default]
    Auto,
    /// One row per assistant turn.
    PerTurn,
    /// One row per conversation; a conversation that is not prefix-stable is an error.
    PerConversation,
}

/// How rows are cut to a length limit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LongRows {
    /// Cut on the right.
    #[default]
    Truncate,
    /// Leave the row out.
    Skip,
}

/// Options of the conversion.
#[derive(Clone, Copy, Debug, Default)]
pub struct RowOptions {
    /// Where masks come from.
    pub mask: MaskSource,
    /// Rows per conversation.
    pub rows: RowMode,
    /// The most tokens a row may have.
    pub max_len: usize,
    /// What happens to a longer row.
    pub long: LongRows,
}

/// One row: tokens and their loss mask.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Row {
    /// Token ids.
    pub input_ids: Vec<u32>,
    /// 1 where the token is supervised.
    pub loss_mask: Vec<u8>,
    /// The assistant turn (message index) of a per-turn row; `None` for a whole conversation.
    pub turn: Option<usize>,
}

/// What one conversation gave.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rows {
    /// The rows, in turn order.
    pub rows: Vec<Row>,
    /// Whether the rows are per-turn (or one per conversation).
    pub per_turn: bool,
    /// Tokens a per-turn run would have computed and stored beyond these rows.
    pub saved_tokens: usize,
    /// Turns left out because their prompt alone fills the length limit.
    pub long_prompts: usize,
    /// Rows cut to the limit.
    pub truncated: usize,
    /// Rows left out as longer than the limit (`LongRows::Skip`).
    pub skipped_long: usize,
}

/// Why a conversation gave no rows.
#[derive(Debug, thiserror::Error)]
pub enum RowsError {
    /// No messages.
    #[error("empty conversation")]
    Empty,
    /// No assistant turn after the first message.
    #[error("no assistant turn")]
    NoAssistant,
    /// This conversation cannot be turned into rows; the run goes on.
    #[error("{0}")]
    Conversation(String),
    /// The template failed on this conversation in a way that may be the
    /// template's (see [`RenderError::Failed`]): the caller decides.
    #[error("{0}")]
    Render(String),
    /// The template or tokenizer cannot be used at all: the run stops.
    #[error(transparent)]
    Fatal(#[from] ChatError),
}

/// A tokenizer error: this conversation's text, or the tokenizer as a whole.
fn token_err(e: ChatError) -> RowsError {
    match e {
        ChatError::Text(m) => RowsError::Conversation(m),
        e => RowsError::Fatal(e),
    }
}

fn render_err(e: RenderError) -> RowsError {
    match e {
        RenderError::Unsupported(m) => RowsError::Fatal(ChatError::Template(m)),
        RenderError::Rejected(m) => RowsError::Conversation(m),
        RenderError::Failed(m) => RowsError::Render(m),
    }
}

/// A per-turn row before limits: its tokens, boundary and prompt length.
struct Turn {
    at: usize,
    ids: Vec<u32>,
    boundary: usize,
    prompt: usize,
}

/// Renders and tokenizes conversations.
pub struct Renderer<'a> {
    /// The tokenizer.
    pub tokenizer: &'a Tokenizer,
    /// The chat template.
    pub template: &'a Template,
    // Scratch.
    enc: Encoded,
    // Bytes of text rendered for the current conversation, and the most allowed.
    spent: usize,
    budget: usize,
}

/// Text one conversation's renders may produce in all: the per-turn renders
/// of a long conversation grow with the square of its turns.
pub const RENDER_BUDGET: usize = 1 << 30;

impl<'a> Renderer<'a> {
    /// A renderer over a tokenizer and template.
    pub fn new(tokenizer: &'a Tokenizer, template: &'a Template) -> Self {
        Renderer { tokenizer, template, enc: Encoded::default(), spent: 0, budget: RENDER_BUDGET }
    }

    fn ids(&mut self, c: &Conversation, upto: usize, prompt: bool) -> Result<Vec<u32>, RowsError> {
        let msgs = json_value(&serde_json::Value::Array(c.messages[..upto].to_vec()));
        let tools = c.tools.as_ref().map(json_value);
        let r = self.template.render(&msgs, tools.as_ref(), prompt).map_err(render_err)?;
        // Per-turn renders cost the square of the turns: a conversation gets a budget.
        self.spent += r.text.len();
        if self.spent > self.budget {
            return Err(RowsError::Conversation(format!(
                "its per-turn renders pass {} MiB of text (turn {upto} of {}): too many turns to render one by one",
                self.budget >> 20,
                c.messages.len()
            )));
        }
        self.tokenizer.encode(&r.text, false, &mut self.enc).map_err(token_err)?;
        Ok(std::mem::take(&mut self.enc.ids))
    }

    /// The per-turn rows by render boundaries, untruncated.
    fn turns(&mut self, c: &Conversation) -> Result<Vec<Turn>, RowsError> {
        let mut turns = Vec::new();
        for (j, role) in c.roles.iter().enumerate() {
            // An assistant turn that opens the conversation is context only.
            if *role != Role::Assistant || j == 0 {
                continue;
            }
            let prompt = self.ids(c, j, true)?;
            let row = self.ids(c, j + 1, false)?;
            let boundary = if row.starts_with(&prompt) {
                prompt.len()
            } else {
                // The template changes the text at the boundary (a space or
                // newline merged into the next token): the common prefix,
                // valid only when the history without the generation prompt
                // starts the row and ends within it.
                let common = prompt.iter().zip(&row).take_while(|(a, b)| a == b).count();
                let hist = self.ids(c, j, false)?;
                if !row.starts_with(&hist) || common < hist.len() {
                    return Err(RowsError::Conversation(format!(
                        "turn {j}: the renders diverge: neither the prompt nor the history is a token prefix of \
                         the conversation through this turn (the template rewrites earlier turns)"
                    )));
                }
                common
            };
            turns.push(Turn { at: j, ids: row, boundary, prompt: prompt.len() });
        }
        Ok(turns)
    }

    /// A conversation's rows under `opts`.
    pub fn rows(&mut self, c: &Conversation, opts: &RowOptions) -> Result<Rows, RowsError> {
        self.spent = 0;
        if c.messages.is_empty() {
            return Err(RowsError::Empty);
        }
        let mut c = c.clone();
        c.drop_trailing();
        if !c.roles.iter().skip(1).any(|r| *r == Role::Assistant) && opts.mask == MaskSource::Boundary {
            return Err(RowsError::NoAssistant);
        }
        if c.roles.is_empty() {
            return Err(RowsError::NoAssistant);
        }
        let mut out = Rows::default();
        if opts.mask == MaskSource::Generation {
            let row = self.generation_row(&c)?;
            push_limited(&mut out, row, opts);
            return Ok(out);
        }
        let turns = self.turns(&c)?;
        let last = &turns.last().expect("an assistant turn after the first message").ids;
        let stable = turns.iter().all(|t| last.starts_with(&t.ids));
        let per_turn = match opts.rows {
            RowMode::PerTurn => true,
            RowMode::Auto => !stable,
            RowMode::PerConversation if stable => false,
            RowMode::PerConversation => {
                return Err(RowsError::Conversation(
                    "not prefix-stable (the template rewrites earlier turns as the conversation grows): \
                     --rows per-conversation cannot hold it; use --rows auto or per-turn"
                        .into(),
                ))
            }
        };
        // A prompt that alone fills the limit leaves that turn out.
        let kept = turns.iter().filter(|t| t.prompt < opts.max_len);
        out.long_prompts = turns.len() - kept.clone().count();
        if per_turn {
            for t in kept {
                let mut loss_mask = vec![0u8; t.ids.len()];
                loss_mask[t.boundary..].fill(1);
                push_limited(&mut out, Row { input_ids: t.ids.clone(), loss_mask, turn: Some(t.at) }, opts);
            }
            out.per_turn = true;
        } else {
            let mut loss_mask = vec![0u8; last.len()];
            let mut any = false;
            for t in kept {
                // Prefix-stable: this turn's supervised tokens sit at the same places in the last row.
                loss_mask[t.boundary..t.ids.len()].fill(1);
                any = true;
            }
            if any {
                out.saved_tokens = turns[..turns.len() - 1].iter().map(|t| t.ids.len()).sum();
                push_limited(&mut out, Row { input_ids: last.clone(), loss_mask, turn: None }, opts);
            }
        }
        Ok(out)
    }

    /// The whole conversation, masked by its `{% generation %}` blocks: a
    /// token is supervised from the one holding a block's first byte through
    /// the one holding its last, as transformers marks them.
    fn generation_row(&mut self, c: &Conversation) -> Result<Row, RowsError> {
        if !self.template.has_generation() {
            return Err(RowsError::Fatal(ChatError::Template(
                "--loss-mask generation needs a chat template with {% generation %} blocks, and this one has none"
                    .into(),
            )));
        }
        let msgs = json_value(&serde_json::Value::Array(c.messages.clone()));
        let tools = c.tools.as_ref().map(json_value);
        let r = self.template.render(&msgs, tools.as_ref(), false).map_err(render_err)?;
        self.tokenizer.encode(&r.text, false, &mut self.enc).map_err(token_err)?;
        let n = self.enc.ids.len();
        let mut loss_mask = vec![0u8; n];
        for span in &r.generation {
            let Some(start) = self.enc.token_at(span.start) else { break };
            // transformers: no token at the last byte (or token 0) runs the mask to the end.
            let last = span.end.checked_sub(1).and_then(|b| self.enc.token_at(b));
            let end = match last {
                Some(e) if e > 0 => e + 1,
                _ => n,
            };
            if end > start {
                loss_mask[start..end].fill(1);
            }
        }
        Ok(Row { input_ids: std::mem::take(&mut self.enc.ids), loss_mask, turn: None })
    }
}

fn push_limited(out: &mut Rows, mut row: Row, opts: &RowOptions) {
    if row.input_ids.len() > opts.max_len {
        if opts.long == LongRows::Skip {
            out.skipped_long += 1;
            return;
        }
        row.input_ids.truncate(opts.max_len);
        row.loss_mask.truncate(opts.max_len);
        out.truncated += 1;
    }
    out.rows.push(row);
}
