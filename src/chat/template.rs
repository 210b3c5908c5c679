//! Chat templates rendered as transformers' `apply_chat_template` renders
//! them: Jinja with `trim_blocks` and `lstrip_blocks`, Python's string
//! methods, `raise_exception`, `strftime_now` (one fixed date per run), a
//! `tojson` that prints what Python's `json.dumps` prints, and the
//! `{% generation %}` blocks of `return_assistant_tokens_mask`.

use super::ChatError;
use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, ErrorKind};

const NAME: &str = "chat_template";
/// The longest message of a failed render quoted (a `raise_exception` message can be megabytes).
const MESSAGE_MAX: usize = 400;
/// Template instructions one render may run at most: a hostile template or
/// conversation stops with an error instead of running for ever.
const FUEL: u64 = 200_000_000;
/// minijinja charges a byte a template makes one unit of fuel and an
/// instruction this many: a render of `memory` bytes gets `memory / 64` fuel.
const UNITS_PER_FUEL: u64 = 64;

/// Why one render failed.
#[derive(Debug, thiserror::Error)]
pub enum RenderError {
    /// The template uses something Strata does not implement: fatal for the run.
    #[error("{0}")]
    Unsupported(String),
    /// The template refused this conversation (`raise_exception`, marker text in it): that conversation only.
    #[error("{0}")]
    Rejected(String),
    /// The render failed otherwise (an operation on the wrong types, a missing
    /// field): the data's fault or the template's, which only the first
    /// conversations tell apart.
    #[error("{0}")]
    Failed(String),
}

/// A rendered conversation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rendered {
    /// The text.
    pub text: String,
    /// Byte ranges of `text` inside `{% generation %}` blocks.
    pub generation: Vec<std::ops::Range<usize>>,
}

/// A compiled chat template with the variables every render gets.
pub struct Template {
    env: Environment<'static>,
    origin: String,
    generation: bool,
    // What `{% generation %}` and `{% endgeneration %}` print: noncharacters
    // around a nonce of this template, so text in a conversation cannot forge them.
    markers: (String, String),
    globals: Vec<(String, Value)>,
    // Whether the source calls `strftime_now`: then the date is part of the output.
    dated: bool,
    // The bytes one render may make.
    memory: u64,
}

impl std::fmt::Debug for Template {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Template").field("origin", &self.origin).field("generation", &self.generation).finish()
    }
}

/// `{% generation %}` and `{% endgeneration %}` become empty filter blocks
/// that print a marker; the whitespace control of the tags is kept. The
/// tags must pair up without nesting, as Jinja's parser requires.
fn rewrite_generation(source: &str, origin: &str) -> Result<(String, bool), ChatError> {
    let re = regex::Regex::new(r"\{%([-+]?)\s*(generation|endgeneration)\s*([-+]?)%\}").expect("a valid regex");
    let line = |at: usize| source[..at].matches('\n').count() + 1;
    let mut open: Option<usize> = None;
    for m in re.captures_iter(source) {
        let at = m.get(0).expect("the whole match").start();
        match (&m[2], open) {
            ("generation", None) => open = Some(at),
            ("generation", Some(o)) => {
                return Err(ChatError::Template(format!(
                    "chat template {origin}, line {}: {{% generation %}} inside the block opened on line {}",
                    line(at),
                    line(o)
                )))
            }
            (_, Some(_)) => open = None,
            (_, None) => {
                return Err(ChatError::Template(format!(
                    "chat template {origin}, line {}: {{% endgeneration %}} without {{% generation %}}",
                    line(at)
                )))
            }
        }
    }
    if let Some(o) = open {
        return Err(ChatError::Template(format!(
            "chat template {origin}, line {}: {{% generation %}} is never closed with {{% endgeneration %}}",
            line(o)
        )));
    }
    let mut found = false;
    let out = re.replace_all(source, |c: &regex::Captures| {
        found = true;
        let filter = if &c[2] == "generation" { "__strata_generation_open" } else { "__strata_generation_close" };
        format!("{{%{} filter {filter} %}}{{% endfilter {}%}}", &c[1], &c[3])
    });
    Ok((out.into_owned(), found))
}

impl Template {
    /// Compiles `source`; `origin` names it in messages; `date` is what
    /// `strftime_now` formats; `globals` (special tokens, extra variables) go
    /// to every render. `memory` bounds the bytes one render makes (strings,
    /// lists, maps and output, as minijinja's fuel counts them, an
    /// instruction weighing 64 bytes), and so its instructions too.
    pub fn new(
        source: &str,
        origin: &str,
        date: chrono::NaiveDate,
        globals: Vec<(String, serde_json::Value)>,
        memory: u64,
    ) -> Result<Self, ChatError> {
        let dated = source.contains("strftime_now");
        let (source, generation) = rewrite_generation(source, origin)?;
        let mut env = Environment::new();
        let mut syntax = minijinja::syntax::SyntaxConfig::builder();
        syntax.trim_blocks(true).lstrip_blocks(true).keep_trailing_newline(false);
        env.set_syntax(syntax.build().expect("the default delimiters"));
        env.set_unknown_method_callback(python_methods);
        env.set_fuel(Some(FUEL.min(memory / UNITS_PER_FUEL).max(1)));
        env.set_debug(true);
        env.set_recursion_limit(100);
        env.add_function("raise_exception", |msg: String| -> Result<Value, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, format!("raise_exception: {msg}")))
        });
        let midnight = date.and_hms_opt(0, 0, 0).expect("midnight exists");
        env.add_function("strftime_now", move |fmt: String| -> Result<String, minijinja::Error> {
            strftime(&midnight, &fmt)
        });
        env.add_filter("tojson", tojson);
        let markers = markers();
        let (open, close) = markers.clone();
        let print = |state: &minijinja::State, m: &str| {
            if state.lookup(MARKERS).is_some_and(|v| v.is_true()) {
                m.to_string()
            } else {
                String::new()
            }
        };
        env.add_filter("__strata_generation_open", move |state: &minijinja::State, _: String| print(state, &open));
        env.add_filter("__strata_generation_close", move |state: &minijinja::State, _: String| print(state, &close));
        env.add_template_owned(NAME, source).map_err(|e| ChatError::Template(describe(origin, &e)))?;
        let globals = globals.into_iter().map(|(k, v)| (k, json_value(&v))).collect();
        Ok(Template { env, origin: origin.into(), generation, markers, globals, dated, memory })
    }

    /// Whether renders depend on the date (the template calls `strftime_now`).
    pub fn renders_date(&self) -> bool {
        self.dated
    }

    /// Whether the template marks assistant text with `{% generation %}` blocks.
    pub fn has_generation(&self) -> bool {
        self.generation
    }

    /// Renders `messages` (with `tools`, when given).
    pub fn render(
        &self,
        messages: &Value,
        tools: Option<&Value>,
        add_generation_prompt: bool,
    ) -> Result<Rendered, RenderError> {
        self.render_with(messages, tools, add_generation_prompt, &serde_json::Map::new())
    }

    /// [`render`](Self::render) with variables of one request (a server's
    /// `chat_template_kwargs`, `reasoning_effort`) over the template's own.
    pub fn render_with(
        &self,
        messages: &Value,
        tools: Option<&Value>,
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<Rendered, RenderError> {
        let mut buf = Bounded(Vec::new());
        let extra: Vec<(String, Value)> = extra.iter().map(|(k, v)| (k.clone(), json_value(v))).collect();
        self.run(messages, tools, add_generation_prompt, self.generation, &extra, &mut buf)?;
        let text = String::from_utf8(buf.0).map_err(|_| RenderError::Rejected("the render is not UTF-8".into()))?;
        if !self.generation {
            return Ok(Rendered { text, generation: vec![] });
        }
        split_markers(&text, &self.markers).map_err(RenderError::Rejected)
    }

    /// Renders `messages` without generation markers, comparing the text
    /// with `base` as it is written: a render that is `base`'s first bytes
    /// is not copied, and one still `base`'s at byte `stop` is stopped there.
    pub fn render_against(
        &self,
        messages: &Value,
        tools: Option<&Value>,
        add_generation_prompt: bool,
        base: &str,
        stop: Option<usize>,
    ) -> Result<Against, RenderError> {
        let mut w = AgainstWriter { base: base.as_bytes(), stop, matched: 0, own: None, stopped: false };
        match self.run(messages, tools, add_generation_prompt, false, &[], &mut w) {
            Err(_) if w.stopped => return Ok(Against::Stopped),
            r => r?,
        }
        Ok(match w.own {
            None => Against::Prefix(w.matched),
            Some(v) => Against::Text(
                String::from_utf8(v).map_err(|_| RenderError::Rejected("the render is not UTF-8".into()))?,
            ),
        })
    }

    /// Renders into `out`; `markers`: whether `{% generation %}` blocks print their markers.
    fn run(
        &self,
        messages: &Value,
        tools: Option<&Value>,
        add_generation_prompt: bool,
        markers: bool,
        extra: &[(String, Value)],
        out: &mut impl std::io::Write,
    ) -> Result<(), RenderError> {
        let tmpl = self.env.get_template(NAME).expect("added in new");
        // Later entries win: a request's variables over the template's globals, the render's own last.
        let mut ctx: Vec<(String, Value)> = self.globals.clone();
        ctx.extend(extra.iter().cloned());
        ctx.push(("messages".into(), messages.clone()));
        ctx.push(("tools".into(), tools.cloned().unwrap_or(Value::from(()))));
        ctx.push(("documents".into(), Value::from(())));
        ctx.push(("add_generation_prompt".into(), Value::from(add_generation_prompt)));
        ctx.push((MARKERS.into(), Value::from(markers)));
        let ctx: Value = ctx.into_iter().collect::<std::collections::BTreeMap<_, _>>().into();
        match tmpl.render_captured_to(ctx, out) {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == ErrorKind::WriteFailure => {
                Err(RenderError::Rejected(format!("the rendered text is over {MAX_RENDER} bytes")))
            }
            Err(e) if e.kind() == ErrorKind::OutOfFuel => Err(RenderError::Rejected(format!(
                "the chat template ran out of its budget for one render: --template-memory {} MiB (the bytes its \
                 strings, lists and output take, an instruction counting 64), at {}",
                self.memory >> 20,
                describe(&self.origin, &e)
            ))),
            Err(e) => Err(classify(&self.origin, &e)),
        }
    }
}

/// What [`Template::render_against`] gave.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Against {
    /// The base's first bytes, this many.
    Prefix(usize),
    /// Another text.
    Text(String),
    /// Still the base's at the stop byte: stopped there.
    Stopped,
}

/// The context variable that tells `{% generation %}` blocks whether to print their markers.
const MARKERS: &str = "__strata_markers";

/// A render's output compared with a base text as it comes; kept only from
/// where it differs (with the base's bytes before that).
struct AgainstWriter<'a> {
    base: &'a [u8],
    stop: Option<usize>,
    matched: usize,
    own: Option<Vec<u8>>,
    stopped: bool,
}

impl std::io::Write for AgainstWriter<'_> {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if let Some(v) = &mut self.own {
            if v.len() + b.len() > MAX_RENDER {
                return Err(std::io::Error::other("render too long"));
            }
            v.extend_from_slice(b);
            return Ok(b.len());
        }
        let rest = &self.base[self.matched..];
        let n = super::pieces::common_start(rest, b);
        if n == b.len() {
            self.matched += n;
            if self.stop.is_some_and(|s| self.matched >= s) {
                self.stopped = true;
                return Err(std::io::Error::other("stopped"));
            }
        } else {
            let mut v = Vec::with_capacity(self.matched + b.len());
            v.extend_from_slice(&self.base[..self.matched]);
            v.extend_from_slice(b);
            self.own = Some(v);
        }
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A template's generation markers: U+FDD0/U+FDD1 around 16 hex digits from
/// the clock, the process and an address, unknown to the data rendered.
fn markers() -> (String, String) {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let local = 0u8;
    let nonce = xxhash_rust::xxh3::xxh3_64(format!("{t}:{}:{:p}", std::process::id(), &local).as_bytes());
    (format!("\u{FDD0}{nonce:016x}\u{FDD1}"), format!("\u{FDD1}{nonce:016x}\u{FDD0}"))
}

/// Python's string methods: minijinja-contrib's, plus the padding and
/// affix ones it lacks (`ljust`, `rjust`, `center`, `zfill`, `removeprefix`,
/// `removesuffix`, `rsplit`, `partition`, `rpartition`).
fn python_methods(
    state: &mut minijinja::State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, minijinja::Error> {
    use minijinja::value::from_args;
    let Some(s) = value.as_str() else {
        return minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args);
    };
    let pad = |width: usize, fill: Option<String>| -> Result<(usize, char), minijinja::Error> {
        let fill = fill.unwrap_or_else(|| " ".into());
        let mut chars = fill.chars();
        match (chars.next(), chars.next()) {
            (Some(c), None) => Ok((width.saturating_sub(s.chars().count()).min(1 << 20), c)),
            _ => Err(minijinja::Error::new(ErrorKind::InvalidOperation, "the fill character must be one character")),
        }
    };
    let rep = |n: usize, c: char| std::iter::repeat_n(c, n).collect::<String>();
    Ok(match method {
        "ljust" | "rjust" | "center" => {
            let (width, fill): (usize, Option<String>) = from_args(args)?;
            let (n, c) = pad(width, fill)?;
            match method {
                "ljust" => Value::from(format!("{s}{}", rep(n, c))),
                "rjust" => Value::from(format!("{}{s}", rep(n, c))),
                // Python's rule for the odd fill character: left = n/2 + (n & width & 1).
                _ => {
                    let left = n / 2 + (n & width & 1);
                    Value::from(format!("{}{s}{}", rep(left, c), rep(n - left, c)))
                }
            }
        }
        "zfill" => {
            let (width,): (usize,) = from_args(args)?;
            let (n, _) = pad(width, None)?;
            let (sign, rest) = match s.chars().next() {
                Some(c @ ('+' | '-')) => (c.to_string(), &s[1..]),
                _ => (String::new(), s),
            };
            Value::from(format!("{sign}{}{rest}", rep(n, '0')))
        }
        "removeprefix" => {
            let (p,): (String,) = from_args(args)?;
            Value::from(s.strip_prefix(p.as_str()).unwrap_or(s))
        }
        "removesuffix" => {
            let (p,): (String,) = from_args(args)?;
            Value::from(s.strip_suffix(p.as_str()).unwrap_or(s))
        }
        "rsplit" => {
            let (sep, max): (Option<String>, Option<i64>) = from_args(args)?;
            let max = max.filter(|m| *m >= 0).map_or(usize::MAX, |m| m as usize);
            let mut parts: Vec<String> = match sep {
                Some(sep) if !sep.is_empty() => {
                    s.rsplitn(max.saturating_add(1), sep.as_str()).map(String::from).collect()
                }
                Some(_) => return Err(minijinja::Error::new(ErrorKind::InvalidOperation, "empty separator")),
                None => {
                    let mut out = Vec::new();
                    // Python's whitespace: Unicode's plus the separators \x1c-\x1f.
                    let space = |c: char| c.is_whitespace() || ('\x1c'..='\x1f').contains(&c);
                    let mut rest = s.trim_end_matches(space);
                    while !rest.is_empty() {
                        if out.len() == max {
                            out.push(rest.to_string());
                            break;
                        }
                        match rest.rfind(space) {
                            Some(i) => {
                                let w = rest[i..].chars().next().map_or(1, char::len_utf8);
                                out.push(rest[i + w..].to_string());
                                rest = rest[..i].trim_end_matches(space);
                            }
                            None => {
                                out.push(rest.to_string());
                                break;
                            }
                        }
                    }
                    out
                }
            };
            parts.reverse();
            Value::from(parts)
        }
        "partition" | "rpartition" => {
            let (sep,): (String,) = from_args(args)?;
            if sep.is_empty() {
                return Err(minijinja::Error::new(ErrorKind::InvalidOperation, "empty separator"));
            }
            let at = if method == "partition" { s.find(sep.as_str()) } else { s.rfind(sep.as_str()) };
            let parts = match at {
                Some(i) => vec![&s[..i], sep.as_str(), &s[i + sep.len()..]],
                None if method == "partition" => vec![s, "", ""],
                None => vec!["", "", s],
            };
            Value::from(parts.into_iter().map(String::from).collect::<Vec<_>>())
        }
        _ => return minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args),
    })
}

/// A JSON value as a template value (maps keep their order).
pub fn json_value(v: &serde_json::Value) -> Value {
    Value::from(minijinja::value::Serde(v))
}

/// The longest text one render may produce.
const MAX_RENDER: usize = 256 << 20;

/// A buffer that refuses to grow past [`MAX_RENDER`] bytes.
struct Bounded(Vec<u8>);

impl std::io::Write for Bounded {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if self.0.len() + b.len() > MAX_RENDER {
            return Err(std::io::Error::other("render too long"));
        }
        self.0.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Removes the generation markers, returning the clean text and the byte ranges between them.
fn split_markers(marked: &str, (open_m, close_m): &(String, String)) -> Result<Rendered, String> {
    let mut out = Rendered { text: String::with_capacity(marked.len()), generation: vec![] };
    let mut open: Option<usize> = None;
    let mut rest = marked;
    // Markers start with a noncharacter: search for those, then compare.
    while let Some(at) = rest.find(['\u{FDD0}', '\u{FDD1}']) {
        out.text.push_str(&rest[..at]);
        rest = &rest[at..];
        if let Some(r) = rest.strip_prefix(open_m.as_str()) {
            if open.is_some() {
                return Err("the template opens a {% generation %} block inside another one".into());
            }
            open = Some(out.text.len());
            rest = r;
        } else if let Some(r) = rest.strip_prefix(close_m.as_str()) {
            match open.take() {
                Some(s) => out.generation.push(s..out.text.len()),
                None => return Err("the template closes a {% generation %} block it did not open".into()),
            }
            rest = r;
        } else {
            // A noncharacter in the conversation itself: plain text.
            let c = rest.chars().next().expect("found above");
            out.text.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    out.text.push_str(rest);
    if open.is_some() {
        return Err("the template leaves a {% generation %} block open".into());
    }
    Ok(out)
}

fn describe(origin: &str, e: &minijinja::Error) -> String {
    let mut msg = format!("chat template {origin}");
    if let Some(line) = e.line() {
        msg += &format!(", line {line}");
    }
    msg += &format!(": {}", e.detail().map_or_else(|| e.kind().to_string(), |d| format!("{}: {d}", e.kind())));
    if let (Some(src), Some(r)) = (e.template_source(), e.range()) {
        if let Some(s) = src.get(r) {
            msg += &format!(" (at `{}`)", crate::clip(s.trim(), 60));
        }
    }
    msg
}

fn classify(origin: &str, e: &minijinja::Error) -> RenderError {
    match classify_unclipped(origin, e) {
        RenderError::Unsupported(m) => RenderError::Unsupported(crate::clip(&m, MESSAGE_MAX).into_owned()),
        RenderError::Rejected(m) => RenderError::Rejected(crate::clip(&m, MESSAGE_MAX).into_owned()),
        RenderError::Failed(m) => RenderError::Failed(crate::clip(&m, MESSAGE_MAX).into_owned()),
    }
}

fn classify_unclipped(origin: &str, e: &minijinja::Error) -> RenderError {
    match e.kind() {
        ErrorKind::SyntaxError
        | ErrorKind::UnknownFilter
        | ErrorKind::UnknownTest
        | ErrorKind::UnknownFunction
        | ErrorKind::TemplateNotFound
        | ErrorKind::BadInclude => {
            RenderError::Unsupported(format!("{}; Strata cannot render this construct", describe(origin, e)))
        }
        // A method call fails on data too (`.strip()` of a list content): it is
        // judged like other failures, by whether any conversation rendered.
        ErrorKind::UnknownMethod => {
            RenderError::Failed(format!("{}; Strata cannot render this construct", describe(origin, e)))
        }
        _ => match e.detail().and_then(|d| d.strip_prefix("raise_exception: ")) {
            Some(msg) => RenderError::Rejected(format!("the chat template refused the conversation: {msg}")),
            None => RenderError::Failed(describe(origin, e)),
        },
    }
}

/// Python's `datetime.strftime` for the specifiers chrono shares with it.
fn strftime(at: &chrono::NaiveDateTime, fmt: &str) -> Result<String, minijinja::Error> {
    use chrono::format::{Item, StrftimeItems};
    use std::fmt::Write as _;
    let bad = || {
        minijinja::Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: format {fmt:?} has a specifier Strata does not know"),
        )
    };
    // A naive date has no zone: Python prints "" for %z and %Z there.
    let fmt = fmt.replace("%z", "").replace("%Z", "");
    let items: Vec<Item> = StrftimeItems::new(&fmt).collect();
    if items.iter().any(|i| matches!(i, Item::Error)) {
        return Err(bad());
    }
    let mut out = String::new();
    write!(out, "{}", at.format_with_items(items.into_iter())).map_err(|_| bad())?;
    Ok(out)
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=indent,
/// separators=separators, sort_keys=sort_keys)`, byte for byte.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    if indent.is_some_and(|n| n > MAX_INDENT) {
        return Err(minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: indent over {MAX_INDENT}")));
    }
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let (item, key) = match separators.as_deref() {
        Some([a, b]) => (a.clone(), b.clone()),
        Some(_) => return Err(minijinja::Error::new(ErrorKind::InvalidOperation, "separators must be a pair")),
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let opts = JsonOpts { indent, ascii: ensure_ascii.unwrap_or(false), sort: sort_keys.unwrap_or(false), item, key };
    let mut out = String::new();
    py_json(value, &opts, 0, &mut out)?;
    // A string, so it prints as is (never escaped again).
    Ok(Value::from(out))
}

struct JsonOpts {
    indent: Option<usize>,
    ascii: bool,
    sort: bool,
    item: String,
    key: String,
}

/// The widest `tojson` indent accepted.
const MAX_INDENT: usize = 64;
/// The deepest value `tojson` writes (the thread's stack bounds recursion).
const MAX_JSON_DEPTH: usize = 512;

fn py_json(v: &Value, o: &JsonOpts, depth: usize, out: &mut String) -> Result<(), minijinja::Error> {
    if depth > MAX_JSON_DEPTH {
        return Err(minijinja::Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: a value nested more than {MAX_JSON_DEPTH} deep"),
        ));
    }
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = o.indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    };
    match v.kind() {
        ValueKind::Undefined => {
            return Err(minijinja::Error::new(ErrorKind::UndefinedError, "tojson of an undefined value"))
        }
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        // Integers of any width print as Python prints them.
        ValueKind::Number if v.is_integer() => out.push_str(&v.to_string()),
        ValueKind::Number => out.push_str(&py_float(f64::try_from(v.clone()).unwrap_or(f64::NAN))),
        ValueKind::String => py_string(v.as_str().unwrap_or_default(), o.ascii, out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item);
                }
                newline(out, depth + 1);
                py_json(item, o, depth + 1, out)?;
            }
            newline(out, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if o.sort {
                keys.sort();
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item);
                }
                newline(out, depth + 1);
                match k.as_str() {
                    Some(s) => py_string(s, o.ascii, out),
                    None => py_string(&k.to_string(), o.ascii, out),
                }
                out.push_str(&o.key);
                py_json(&v.get_item(k)?, o, depth + 1, out)?;
            }
            newline(out, depth);
            out.push('}');
        }
        _ => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: a {} is not JSON serializable", v.kind()),
            ))
        }
    }
    Ok(())
}

/// Python's `repr(float)`: the shortest round-tripping digits, `1.0`, `1e-05`, `1e+16`.
fn py_float(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    // `{:e}` gives the shortest round-tripping digits: `d.ddde±x`.
    let sci = format!("{x:e}");
    let (mant, exp) = sci.split_once('e').expect("{:e} has an exponent");
    let exp: i32 = exp.parse().expect("an integer exponent");
    let (sign, mant) = mant.strip_prefix('-').map_or(("", mant), |m| ("-", m));
    let digits: String = mant.chars().filter(|c| *c != '.').collect();
    if !(-4..16).contains(&exp) {
        let m = if digits.len() > 1 { format!("{}.{}", &digits[..1], &digits[1..]) } else { digits };
        return format!("{sign}{m}e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    }
    let point = exp + 1; // digits before the point
    let s = if point <= 0 {
        format!("0.{}{}", "0".repeat((-point) as usize), digits)
    } else if point as usize >= digits.len() {
        format!("{}{}.0", digits, "0".repeat(point as usize - digits.len()))
    } else {
        format!("{}.{}", &digits[..point as usize], &digits[point as usize..])
    };
    format!("{sign}{s}")
}

/// A JSON string as Python's `json` writes it.
fn py_string(s: &str, ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ascii && (c as u32) > 0x7e) => {
                let mut buf = [0u16; 2];
                for u in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn date() -> chrono::NaiveDate {
        chrono::NaiveDate::from_ymd_opt(2026, 1, 15).unwrap()
    }

    fn render(src: &str, msgs: serde_json::Value) -> Result<Rendered, RenderError> {
        let t = Template::new(src, "t", date(), vec![("bos_token".into(), "<s>".into())], 1 << 30).unwrap();
        t.render(&json_value(&msgs), None, false)
    }

    #[test]
    fn python_json_and_floats() {
        for (x, s) in [(1.0, "1.0"), (1e-5, "1e-05"), (0.1, "0.1"), (1e16, "1e+16"), (123.25, "123.25"), (-0.5, "-0.5")]
        {
            assert_eq!(py_float(x), s);
        }
        let r = render(
            "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2) }}",
            serde_json::json!([{"b": 1, "a": [1.5, "é\n<"], "c": null}]),
        )
        .unwrap();
        assert_eq!(
            r.text,
            "[{\"b\": 1, \"a\": [1.5, \"é\\n<\"], \"c\": null}]|{\n  \"b\": 1,\n  \"a\": [\n    1.5,\n    \"é\\n<\"\n  ],\n  \"c\": null\n}"
        );
    }

    #[test]
    fn python_methods_trim_blocks_and_dates() {
        let src = "{{ bos_token }}{% for m in messages %}\n  {% if m.content.startswith('x') %}\n{{ m.content.split('-')[-1].strip() }}|{% endif %}\n{% endfor %}{{ strftime_now('%d %b %Y') }}";
        let r = render(src, serde_json::json!([{"content": "x- a "}, {"content": "y"}])).unwrap();
        assert_eq!(r.text, "<s>a|15 Jan 2026");
    }

    #[test]
    fn string_methods_python_has_and_minijinja_lacks() {
        // Expected texts from Python 3.11.
        let src = "{{ 'ab'.rjust(5, '*') }}|{{ 'ab'.ljust(4) }}|{{ 'ab'.center(5, '-') }}|{{ 'abc'.center(6, '-') }}|\
                   {{ '-7'.zfill(4) }}|{{ 'tool_x'.removeprefix('tool_') }}|{{ 'a.b.c'.rsplit('.', 1) }}|\
                   {{ ' a  b c '.rsplit() }}|{{ 'k=v=w'.partition('=')[2] }}|{{ 'k=v=w'.rpartition('=')[0] }}|{{ 'x'.upper() }}";
        let r = render(src, serde_json::json!([])).unwrap();
        assert_eq!(r.text, "***ab|ab  |--ab-|-abc--|-007|x|['a.b', 'c']|['a', 'b', 'c']|v=w|k=v|X");
    }

    #[test]
    fn hostile_dates_indents_and_depths_are_errors_not_panics() {
        let r = render("{{ strftime_now('%d %Z%z|%Y') }}", serde_json::json!([])).unwrap();
        assert_eq!(r.text, "15 |2026");
        let e = render("{{ messages | tojson(indent=1000000000000) }}", serde_json::json!([1])).unwrap_err();
        assert!(e.to_string().contains("indent over 64"), "{e}");
        let deep = "{% set ns = namespace(x=[]) %}{% for i in range(2000) %}{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x | tojson }}";
        let e = render(deep, serde_json::json!([])).unwrap_err();
        assert!(e.to_string().contains("nested more than 512"), "{e}");
        let r = render("{{ messages | tojson }}", serde_json::json!([18446744073709551615u64, -3, 2.5])).unwrap();
        assert_eq!(r.text, "[18446744073709551615, -3, 2.5]");
        let e = render("{% for i in range(200) %}{{ 'x' * 2000000 }}{% endfor %}", serde_json::json!([])).unwrap_err();
        assert!(e.to_string().contains("rendered text is over"), "{e}");
    }

    #[test]
    fn generation_blocks_give_byte_ranges() {
        let src = "{% for m in messages %}<{{ m.role }}>\n{%- if m.role == 'assistant' %}{% generation -%}\n {{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}";
        let r =
            render(src, serde_json::json!([{"role": "user", "content": "hé"}, {"role": "assistant", "content": "ok"}]))
                .unwrap();
        assert_eq!(r.text, "<user>hé<assistant>ok");
        assert_eq!(r.generation, vec![20..22]);
    }

    #[test]
    fn noncharacters_in_the_conversation_are_text_not_generation_markers() {
        let src = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}|{% endfor %}";
        let r = render(src, serde_json::json!([{"content": "a\u{FDD0}b"}, {"content": "\u{FDD1}c\u{FDD0}"}])).unwrap();
        assert_eq!(r.text, "a\u{FDD0}b|\u{FDD1}c\u{FDD0}|");
        assert_eq!(r.generation, vec![0..5, 6..13]);
        let e = render("{{ raise_exception('x' * 100000) }}", serde_json::json!([])).unwrap_err().to_string();
        assert!(e.len() < 1000 && e.ends_with(" bytes)"), "{}", e.len());
    }

    #[test]
    fn errors_say_what_and_whose() {
        let e = render("{{ raise_exception('roles must alternate') }}", serde_json::json!([])).unwrap_err();
        assert!(
            matches!(&e, RenderError::Rejected(m) if m.contains("refused the conversation: roles must alternate")),
            "{e}"
        );
        let e = render("{{ messages | frobnicate }}", serde_json::json!([])).unwrap_err();
        assert!(matches!(&e, RenderError::Unsupported(m) if m.contains("frobnicate")), "{e}");
        let e = Template::new("{% for %}", "x.jinja", date(), vec![], 1 << 30).unwrap_err().to_string();
        assert!(e.contains("chat template x.jinja, line 1"), "{e}");
    }
}
