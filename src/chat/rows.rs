//! Token rows and loss masks from a conversation, by render boundaries (as
//! the speculators stack derives them) or by the template's
//! `{% generation %}` blocks (as transformers' `return_assistant_tokens_mask`).

use super::conversation::{Conversation, Role};
use super::pieces::{Derived, Prefix};
use super::template::{json_value, Against, RenderError, Template};
use super::tokenizer::{Encoded, Tokenizer};
use super::ChatError;
use minijinja::Value;

/// Where the loss mask comes from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum MaskSource {
    /// Each assistant turn from where its generation prompt ends.
    #[cfg_attr(
        feature = "cli",
        value(help = "Each assistant turn from where its generation prompt ends (as the speculators stack)")
    )]
    #[default]
    Boundary,
    /// The template's `{% generation %}` blocks.
    #[cfg_attr(
        feature = "cli",
        value(help = "The template's {% generation %} blocks (as transformers' return_assistant_tokens_mask)")
    )]
    Generation,
}

/// How a conversation becomes rows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum RowMode {
    /// One row per conversation where that is exact (prefix-stable), else one per assistant turn.
    #[cfg_attr(
        feature = "cli",
        value(
            help = "One row per conversation where that is exact (prefix-stable templates), else one per assistant turn"
        )
    )]
    #[default]
    Auto,
    /// One row per assistant turn.
    #[cfg_attr(feature = "cli", value(help = "One row per assistant turn"))]
    PerTurn,
    /// One row per conversation; a conversation that is not prefix-stable is an error.
    #[cfg_attr(
        feature = "cli",
        value(help = "One row per conversation; a conversation whose template rewrites earlier turns is an error")
    )]
    PerConversation,
}

/// How rows are cut to a length limit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum LongRows {
    /// Cut on the right.
    #[default]
    Truncate,
    /// Leave the row out.
    Skip,
}

/// Options of the conversion.
#[derive(Clone, Copy, Debug, Default, serde::Serialize, serde::Deserialize)]
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
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Row {
    /// Token ids.
    pub input_ids: Vec<u32>,
    /// 1 where the token is supervised.
    pub loss_mask: Vec<u8>,
    /// The assistant turn (message index) of a per-turn row; `None` for a whole conversation.
    pub turn: Option<usize>,
}

/// What one conversation gave.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Rows {
    /// The rows, in turn order.
    pub rows: Vec<Row>,
    /// Whether the rows are per-turn (or one per conversation).
    pub per_turn: bool,
    /// Tokens a per-turn run would have stored beyond these rows (each row cut to the limit).
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
    /// This conversation cannot be turned into rows (its renders diverge, its
    /// text cannot be tokenized); the run goes on.
    #[error("{0}")]
    Conversation(String),
    /// The template did not render this conversation: it refused it
    /// (`raise_exception`), ran out of its budget, or its render process
    /// died; the run goes on (unless that happens to every conversation).
    #[error("{0}")]
    Refused(String),
    /// The template failed on this conversation in a way that may be the
    /// template's (see [`RenderError::Failed`]): the caller decides.
    #[error("{0}")]
    Render(String),
    /// The template or tokenizer cannot be used at all: the run stops.
    #[error(transparent)]
    Fatal(#[from] ChatError),
}

/// Why a conversation gives no row before anything is rendered: it is
/// empty, or has no assistant turn after its first message (with
/// generation masks: none at all) once trailing turns are dropped.
pub fn skipped(c: &Conversation, mask: MaskSource) -> Option<RowsError> {
    if c.messages.is_empty() {
        return Some(RowsError::Empty);
    }
    let last = c.roles.iter().rposition(|r| *r == Role::Assistant);
    let first = if mask == MaskSource::Boundary { 1 } else { 0 };
    match last {
        Some(i) if i >= first => None,
        _ => Some(RowsError::NoAssistant),
    }
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
        RenderError::Rejected(m) => RowsError::Refused(m),
        RenderError::Failed(m) => RowsError::Render(m),
    }
}

/// A kept assistant turn: its row's first tokens and where its supervised part starts.
struct Turn {
    at: usize,
    row: Derived,
    boundary: usize,
}

/// Renders and tokenizes conversations.
pub struct Renderer<'a> {
    /// The tokenizer.
    pub tokenizer: &'a Tokenizer,
    /// The chat template.
    pub template: &'a Template,
    // Bytes of text rendered for the current conversation, and the most allowed.
    spent: usize,
    budget: usize,
}

/// Text one conversation's renders may produce in all: a conversation of n
/// turns renders n prompts and n rows. Each render is also charged
/// [`MESSAGE_COST`] per message it is given (a render stopped early still
/// took them all), so turns times messages is bounded too.
pub const RENDER_BUDGET: usize = 1 << 30;
/// What one message given to a render costs of [`RENDER_BUDGET`], in bytes.
pub const MESSAGE_COST: usize = 64;

impl<'a> Renderer<'a> {
    /// A renderer over a tokenizer and template.
    pub fn new(tokenizer: &'a Tokenizer, template: &'a Template) -> Self {
        Renderer { tokenizer, template, spent: 0, budget: RENDER_BUDGET }
    }

    fn charge(&mut self, bytes: usize, c: &Conversation) -> Result<(), RowsError> {
        self.spent += bytes;
        if self.spent > self.budget {
            return Err(RowsError::Refused(format!(
                "its renders pass {} MiB of text ({} messages): too many turns to render one by one",
                self.budget >> 20,
                c.messages.len()
            )));
        }
        Ok(())
    }

    /// The first tokens of the render of `msgs` (with the generation prompt
    /// when `gen`), from those of `base` up to where the two texts part. A
    /// render that is `base`'s text past `long_from` is stopped there: it
    /// has more tokens than the limit, and its first ones are `base`'s.
    #[allow(clippy::too_many_arguments)]
    fn tokens(
        &mut self,
        c: &Conversation,
        msgs: &[Value],
        tools: Option<&Value>,
        gen: bool,
        base_text: &str,
        base: &Prefix,
    ) -> Result<Derived, RowsError> {
        // Charged first: the messages are copied into the render's context.
        self.charge(MESSAGE_COST * msgs.len(), c)?;
        let v = Value::from(msgs.to_vec());
        let stop = base.long_from();
        match self.template.render_against(&v, tools, gen, base_text, stop).map_err(render_err)? {
            Against::Stopped => {
                self.charge(stop.unwrap_or(0), c)?;
                Ok(Derived { shared: base.enc.ids.len(), more: true, ..Default::default() })
            }
            Against::Prefix(n) => {
                self.charge(n, c)?;
                base.derive(self.tokenizer, base_text, &base_text[..n]).map_err(token_err)
            }
            Against::Text(t) => {
                self.charge(t.len(), c)?;
                base.derive(self.tokenizer, base_text, &t).map_err(token_err)
            }
        }
    }

    /// A conversation's rows under `opts`.
    ///
    /// The whole conversation is rendered once and tokenized up to the
    /// limit. Each assistant turn's prompt and row are rendered against that
    /// text: a render that is its beginning is not copied, and one that is
    /// still its beginning where it has more tokens than the limit is
    /// stopped there; the tokens up to the last special token before a
    /// render parts from it are reused, the rest is tokenized. A turn whose
    /// prompt alone fills the limit is left out before its row is rendered
    /// (as the speculators stack skips it). The rows are prefix-stable when
    /// every kept turn's row, cut to the limit, is the start of the whole
    /// conversation's, cut to the limit: then one row holds every turn.
    pub fn rows(&mut self, c: &Conversation, opts: &RowOptions) -> Result<Rows, RowsError> {
        self.spent = 0;
        if let Some(skip) = skipped(c, opts.mask) {
            return Err(skip);
        }
        // The turns after the last assistant turn supervise nothing.
        let keep = c.roles.iter().rposition(|r| *r == Role::Assistant).map_or(0, |i| i + 1);
        let msgs: Vec<Value> = c.messages[..keep].iter().map(json_value).collect();
        let roles = &c.roles[..keep];
        let tools = c.tools.as_ref().map(json_value);
        let tools = tools.as_ref();
        let mut out = Rows::default();
        if opts.mask == MaskSource::Generation {
            let (row, more) = self.generation_row(c, &msgs, opts.max_len)?;
            push_limited(&mut out, row, more, opts);
            return Ok(out);
        }
        let cap = opts.max_len;
        // The whole conversation: the last row, and the text every render is compared with.
        let text = match self
            .template
            .render_against(&Value::from(msgs.clone()), tools, false, "", None)
            .map_err(render_err)?
        {
            Against::Text(t) => t,
            _ => String::new(),
        };
        self.charge(text.len(), c)?;
        let whole = self.tokenizer.prefix(&text, cap).map_err(token_err)?;
        let mut turns = Vec::new();
        for (j, role) in roles.iter().enumerate() {
            // An assistant turn that opens the conversation is context only.
            if *role != Role::Assistant || j == 0 {
                continue;
            }
            let prompt = self.tokens(c, &msgs[..j], tools, true, &text, &whole)?;
            if prompt.more || prompt.len() >= cap {
                // A prompt that alone fills the limit leaves that turn out.
                out.long_prompts += 1;
                continue;
            }
            let row = self.tokens(c, &msgs[..=j], tools, false, &text, &whole)?;
            let boundary = if whole.starts_with(&row, &prompt) {
                prompt.len()
            } else {
                // The template changes the text at the boundary (a space or
                // newline merged into the next token): the common prefix,
                // valid only when the history without the generation prompt
                // starts the row and ends within it.
                let common = whole.common(&prompt, &row);
                let hist = self.tokens(c, &msgs[..j], tools, false, &text, &whole)?;
                if !whole.starts_with(&row, &hist) || common < hist.len() {
                    return Err(RowsError::Conversation(format!(
                        "turn {j}: the renders diverge: neither the prompt nor the history is a token prefix of \
                         the conversation through this turn (the template rewrites earlier turns)"
                    )));
                }
                common
            };
            turns.push(Turn { at: j, row, boundary });
        }
        if turns.is_empty() {
            return Ok(out);
        }
        // Judged on the tokens a row keeps: past the limit nothing is stored.
        let all = whole.whole();
        let stable = turns.iter().all(|t| whole.starts_with(&all, &t.row));
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
        if per_turn {
            for t in turns {
                let n = t.row.len();
                let mut loss_mask = vec![0u8; n];
                loss_mask[t.boundary.min(n)..].fill(1);
                let row = Row { input_ids: whole.ids(&t.row), loss_mask, turn: Some(t.at) };
                push_limited(&mut out, row, t.row.more, opts);
            }
            out.per_turn = true;
        } else {
            let ids = whole.ids(&all);
            let mut loss_mask = vec![0u8; ids.len()];
            for t in &turns {
                // Prefix-stable: this turn's supervised tokens sit at the same places in the last row.
                loss_mask[t.boundary.min(ids.len())..t.row.len()].fill(1);
            }
            let per_turn_tokens: usize = turns.iter().map(|t| t.row.len()).sum();
            out.saved_tokens = per_turn_tokens.saturating_sub(ids.len());
            push_limited(&mut out, Row { input_ids: ids, loss_mask, turn: None }, whole.more, opts);
        }
        Ok(out)
    }

    /// The whole conversation, masked by its `{% generation %}` blocks: a
    /// token is supervised from the one holding a block's first byte through
    /// the one holding its last, as transformers marks them. Its first `cap`
    /// tokens, and whether there are more.
    fn generation_row(&mut self, c: &Conversation, msgs: &[Value], cap: usize) -> Result<(Row, bool), RowsError> {
        if !self.template.has_generation() {
            return Err(RowsError::Fatal(ChatError::Template(
                "--loss-mask generation needs a chat template with {% generation %} blocks, and this one has none"
                    .into(),
            )));
        }
        let tools = c.tools.as_ref().map(json_value);
        let r = self.template.render(&Value::from(msgs.to_vec()), tools.as_ref(), false).map_err(render_err)?;
        self.charge(r.text.len(), c)?;
        let mut enc = Encoded::default();
        let more = self.tokenizer.encode_limited(&r.text, false, cap, &mut enc).map_err(token_err)?;
        let n = enc.ids.len();
        let mut loss_mask = vec![0u8; n];
        for span in &r.generation {
            let Some(start) = enc.token_at(span.start) else { break };
            // transformers: no token at the last byte (or token 0) runs the mask to the end.
            let last = span.end.checked_sub(1).and_then(|b| enc.token_at(b));
            let end = match last {
                Some(e) if e > 0 => e + 1,
                _ => n,
            };
            if end > start {
                loss_mask[start..end].fill(1);
            }
        }
        Ok((Row { input_ids: enc.ids, loss_mask, turn: None }, more))
    }
}

/// Adds `row` (its first `opts.max_len` tokens; `more` when it had more) under the limit's rule.
fn push_limited(out: &mut Rows, row: Row, more: bool, opts: &RowOptions) {
    if more {
        if opts.long == LongRows::Skip {
            out.skipped_long += 1;
            return;
        }
        out.truncated += 1;
    }
    out.rows.push(row);
}
