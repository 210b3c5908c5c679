//! Rendering and tokenizing in a process of their own.
//!
//! A chat template is a program from the model directory, and minijinja can
//! only bound what it counts: its fuel bounds instructions and most of the
//! bytes a render makes, but not every allocation (a `join` of one large
//! string repeated), and nothing bounds how deep the values a template
//! builds may nest (a list a million levels deep overflows the stack when
//! it is printed, compared or only dropped). A tokenizer's normalizer is a
//! program of the same kind. So `strata extract` renders and tokenizes in a
//! child process (the `strata` binary itself, by a hidden subcommand) whose
//! address space is limited for each request (`RLIMIT_AS`: the bytes it
//! held before it, plus `--template-memory`, plus room to tokenize). A
//! request that passes it, or overflows the stack, kills the child, not the
//! run: that conversation is refused, saying why, and the next request
//! starts a new child.
//!
//! Requests and replies are length-prefixed JSON on the child's stdin and
//! stdout. The child dies with its parent (`PR_SET_PDEATHSIG`).

use super::rows::{RowOptions, Rows, RowsError};
use super::{Chat, ChatError, ChatOptions, Conversation};
use std::io::{BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Arc, Mutex};

/// How to start a render process: this program with these arguments
/// (the `strata` binary and its hidden `__render` subcommand).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Isolation {
    /// The program.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<String>,
}

/// What a render process loads: the model's tokenizer and chat template.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct Init {
    model: PathBuf,
    template_file: Option<PathBuf>,
    date: String,
    kwargs: serde_json::Map<String, serde_json::Value>,
    template_memory: u64,
    /// [`Chat::digest`] of what the parent loaded: the child must read the same files.
    digest: String,
}

/// A request, as the child reads it.
#[derive(serde::Deserialize)]
enum Request {
    Rows { conversation: Conversation, opts: RowOptions },
    Text { text: String, add_special: bool, cap: usize },
}

/// The same, as the parent writes it (borrowed: a 64 MiB conversation is not copied first).
#[derive(serde::Serialize)]
enum RequestRef<'a> {
    Rows { conversation: &'a Conversation, opts: &'a RowOptions },
    Text { text: &'a str, add_special: bool, cap: usize },
}

/// [`RowsError`] and [`ChatError`] as they cross the pipe.
#[derive(serde::Serialize, serde::Deserialize)]
enum Failure {
    Empty,
    NoAssistant,
    Conversation(String),
    Refused(String),
    Render(String),
    Tokenizer(String),
    Template(String),
    Text(String),
}

impl From<RowsError> for Failure {
    fn from(e: RowsError) -> Self {
        match e {
            RowsError::Empty => Failure::Empty,
            RowsError::NoAssistant => Failure::NoAssistant,
            RowsError::Conversation(m) => Failure::Conversation(m),
            RowsError::Refused(m) => Failure::Refused(m),
            RowsError::Render(m) => Failure::Render(m),
            RowsError::Fatal(e) => e.into(),
        }
    }
}

impl From<ChatError> for Failure {
    fn from(e: ChatError) -> Self {
        match e {
            ChatError::Tokenizer(m) => Failure::Tokenizer(m),
            ChatError::Template(m) => Failure::Template(m),
            ChatError::Text(m) => Failure::Text(m),
        }
    }
}

impl From<Failure> for RowsError {
    fn from(f: Failure) -> Self {
        match f {
            Failure::Empty => RowsError::Empty,
            Failure::NoAssistant => RowsError::NoAssistant,
            Failure::Conversation(m) => RowsError::Conversation(m),
            Failure::Refused(m) => RowsError::Refused(m),
            Failure::Render(m) => RowsError::Render(m),
            Failure::Tokenizer(m) => RowsError::Fatal(ChatError::Tokenizer(m)),
            Failure::Template(m) => RowsError::Fatal(ChatError::Template(m)),
            Failure::Text(m) => RowsError::Conversation(m),
        }
    }
}

impl From<Failure> for ChatError {
    fn from(f: Failure) -> Self {
        match f {
            Failure::Tokenizer(m) => ChatError::Tokenizer(m),
            Failure::Template(m) => ChatError::Template(m),
            Failure::Empty | Failure::NoAssistant => ChatError::Text("no text".into()),
            Failure::Conversation(m) | Failure::Refused(m) | Failure::Render(m) | Failure::Text(m) => {
                ChatError::Text(m)
            }
        }
    }
}

#[derive(serde::Serialize, serde::Deserialize)]
enum Reply {
    Ready,
    Rows(Result<Rows, Failure>),
    Text(Result<(Vec<u32>, bool), Failure>),
    /// The child could not load the tokenizer or template.
    Failed(Failure),
}

/// The largest frame read (a conversation's line is at most 64 MiB; its per-turn rows less than this).
const MAX_FRAME: usize = 1 << 30;
/// Address space a request may take beyond `--template-memory`: the text
/// rendered (256 MiB at most) and its tokenizing.
const SLACK: u64 = 768 << 20;
/// The child's working thread's stack (macros and templates recurse).
const STACK: usize = 64 << 20;
/// The last bytes of the child's stderr kept, to say why it died.
const STDERR_TAIL: usize = 8 << 10;

fn write_frame(w: &mut impl Write, v: &impl serde::Serialize) -> std::io::Result<()> {
    let body = serde_json::to_vec(v).map_err(std::io::Error::other)?;
    w.write_all(&(body.len() as u64).to_le_bytes())?;
    w.write_all(&body)?;
    w.flush()
}

/// `None` at the end of the stream.
fn read_frame<T: serde::de::DeserializeOwned>(r: &mut impl Read) -> std::io::Result<Option<T>> {
    let mut len = [0u8; 8];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u64::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(std::io::Error::other(format!("a frame of {len} bytes")));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    serde_json::from_slice(&body).map(Some).map_err(std::io::Error::other)
}

/// The longest one request may take before its process is killed: fuel
/// bounds a render's instructions and the limit its tokenizing, so this is
/// a backstop, never reached by a template that renders.
const REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

/// The child's stdout, read no later than a deadline.
struct Deadline {
    inner: ChildStdout,
    until: Option<std::time::Instant>,
}

impl Read for Deadline {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        use std::os::fd::AsRawFd;
        if let Some(until) = self.until {
            loop {
                let left = until.saturating_duration_since(std::time::Instant::now());
                if left.is_zero() {
                    return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "no reply in time"));
                }
                let mut fd = libc::pollfd { fd: self.inner.as_raw_fd(), events: libc::POLLIN, revents: 0 };
                let ms = left.as_millis().min(i32::MAX as u128) as i32;
                // SAFETY: poll reads and writes the one pollfd given.
                match unsafe { libc::poll(&mut fd, 1, ms) } {
                    n if n > 0 => break,
                    0 => continue,
                    _ if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted => continue,
                    _ => return Err(std::io::Error::last_os_error()),
                }
            }
        }
        self.inner.read(buf)
    }
}

/// A running render process.
struct Running {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<Deadline>,
    stderr: Arc<Mutex<Vec<u8>>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

/// Renders and tokenizes in a child process, started when first needed
/// and again after a request killed it.
pub struct RenderProcess {
    how: Isolation,
    init: Init,
    running: Option<Running>,
}

impl std::fmt::Debug for RenderProcess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RenderProcess").field("how", &self.how).field("running", &self.running.is_some()).finish()
    }
}

impl RenderProcess {
    /// A render process for what `chat` was loaded from (nothing starts yet).
    pub fn new(how: Isolation, chat: &Chat) -> Self {
        let (model, opts) = &chat.loaded_from;
        let init = Init {
            model: model.clone(),
            template_file: opts.template_file.clone(),
            date: opts.date.format("%Y-%m-%d").to_string(),
            kwargs: opts.kwargs.clone(),
            template_memory: opts.template_memory,
            digest: chat.digest.clone(),
        };
        RenderProcess { how, init, running: None }
    }

    fn start(&mut self) -> Result<&mut Running, ChatError> {
        if self.running.is_none() {
            let fail = |e: std::io::Error| {
                ChatError::Template(format!("cannot start a render process ({}): {e}", self.how.program.display()))
            };
            let mut child = Command::new(&self.how.program)
                .args(&self.how.args)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .env("RUST_BACKTRACE", "0")
                .spawn()
                .map_err(fail)?;
            let (stdin, stdout, err) = (
                child.stdin.take().expect("piped"),
                child.stdout.take().expect("piped"),
                child.stderr.take().expect("piped"),
            );
            // stderr is drained on a thread (a full pipe would block the child); its tail says why it died.
            let stderr = Arc::new(Mutex::new(Vec::new()));
            let tail = stderr.clone();
            let reader = std::thread::Builder::new()
                .name("strata-render-stderr".into())
                .spawn(move || {
                    let mut err = err;
                    let mut buf = [0u8; 4096];
                    while let Ok(n @ 1..) = err.read(&mut buf) {
                        let mut t = tail.lock().unwrap_or_else(|e| e.into_inner());
                        t.extend_from_slice(&buf[..n]);
                        if t.len() > STDERR_TAIL {
                            let cut = t.len() - STDERR_TAIL;
                            t.drain(..cut);
                        }
                    }
                })
                .map_err(fail)?;
            let stdout = BufReader::new(Deadline { inner: stdout, until: None });
            let mut r = Running { child, stdin, stdout, stderr, reader: Some(reader) };
            r.stdout.get_mut().until = Some(std::time::Instant::now() + REQUEST_TIMEOUT);
            let ready = write_frame(&mut r.stdin, &self.init).and_then(|()| read_frame::<Reply>(&mut r.stdout));
            match ready {
                Ok(Some(Reply::Ready)) => {}
                Ok(Some(Reply::Failed(f))) => {
                    r.stop(None, true);
                    return Err(f.into());
                }
                answer => {
                    let why = r.stop(answer.err(), true);
                    return Err(ChatError::Template(format!("the render process did not start: {why}")));
                }
            }
            self.running = Some(r);
        }
        Ok(self.running.as_mut().expect("started above"))
    }

    /// Sends `req`: the reply, or why there is none.
    fn call(&mut self, req: &RequestRef<'_>) -> Result<Reply, Failed> {
        let memory = self.init.template_memory;
        let r = self.start().map_err(Failed::Start)?;
        r.stdout.get_mut().until = Some(std::time::Instant::now() + REQUEST_TIMEOUT);
        let answer = write_frame(&mut r.stdin, req).and_then(|()| read_frame::<Reply>(&mut r.stdout));
        match answer {
            Ok(Some(reply)) => Ok(reply),
            // The request killed the child (or took too long, or its reply cannot be
            // read): it is gone, and the next request starts another.
            answer => {
                let mut r = self.running.take().expect("started");
                Err(Failed::Died(describe_death(&r.stop(answer.err(), true), memory)))
            }
        }
    }

    /// A conversation's rows, rendered and tokenized in the child.
    pub fn rows(&mut self, conversation: &Conversation, opts: &RowOptions) -> Result<Rows, RowsError> {
        let req = RequestRef::Rows { conversation, opts };
        match self.call(&req) {
            Ok(Reply::Rows(r)) => r.map_err(RowsError::from),
            Ok(_) => Err(RowsError::Fatal(out_of_turn())),
            Err(Failed::Start(e)) => Err(RowsError::Fatal(e)),
            Err(Failed::Died(why)) => Err(RowsError::Refused(why)),
        }
    }

    /// [`super::Tokenizer::encode_limited`] in the child: the ids, and whether there are more.
    pub fn encode_limited(&mut self, text: &str, add_special: bool, cap: usize) -> Result<(Vec<u32>, bool), ChatError> {
        let req = RequestRef::Text { text, add_special, cap };
        match self.call(&req) {
            Ok(Reply::Text(r)) => r.map_err(ChatError::from),
            Ok(_) => Err(out_of_turn()),
            Err(Failed::Start(e)) => Err(e),
            Err(Failed::Died(why)) => Err(ChatError::Text(why)),
        }
    }
}

/// Why a request got no reply.
enum Failed {
    /// The child could not be started (or load the tokenizer and template): the run cannot go on.
    Start(ChatError),
    /// The request killed it: that record's.
    Died(String),
}

fn out_of_turn() -> ChatError {
    ChatError::Template("the render process answered out of turn".into())
}

impl Running {
    /// Ends the child (killed if it is still running: then `error` says why
    /// its reply was not read) and says how it ended, with the telling line it wrote.
    fn stop(&mut self, error: Option<std::io::Error>, grace: bool) -> String {
        // A child that closed its pipes is on its way out: a moment to exit by itself, unless it timed out.
        let timed_out = error.as_ref().is_some_and(|e| e.kind() == std::io::ErrorKind::TimedOut);
        let mut waited = 0;
        while grace && !timed_out && waited < 100 && matches!(self.child.try_wait(), Ok(None)) {
            std::thread::sleep(std::time::Duration::from_millis(10));
            waited += 1;
        }
        let alive = matches!(self.child.try_wait(), Ok(None));
        if alive {
            let _ = self.child.kill();
        }
        let status = self.child.wait();
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        let tail = self.stderr.lock().unwrap_or_else(|e| e.into_inner());
        let text = String::from_utf8_lossy(&tail);
        // The line that says why: an allocation, the stack, a panic; else the last.
        let lines: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
        let telling = ["memory allocation of", "overflowed its stack", "panicked at", "error"];
        let why =
            telling.iter().find_map(|t| lines.iter().find(|l| l.contains(t))).or(lines.last()).copied().unwrap_or("");
        let status = status.map_or_else(|e| e.to_string(), |s| s.to_string());
        match (alive, error) {
            (true, Some(e)) if e.kind() == std::io::ErrorKind::TimedOut => {
                format!("it took more than {} s and was killed", REQUEST_TIMEOUT.as_secs())
            }
            (true, Some(e)) => format!("its reply could not be read ({e}) and it was killed"),
            _ => format!("{status}; {}", crate::clip(why, 300)),
        }
    }
}

impl Drop for RenderProcess {
    fn drop(&mut self) {
        if let Some(mut r) = self.running.take() {
            r.stop(None, false);
        }
    }
}

/// Why the render process died, for the conversation's message.
fn describe_death(how: &str, memory: u64) -> String {
    if how.contains("memory allocation of") || how.contains("out of memory") {
        format!(
            "the chat template (or the tokenizer) needed more memory than one render may have: --template-memory \
             {} MiB and {} MiB to tokenize (its render process died: {how})",
            memory >> 20,
            SLACK >> 20
        )
    } else if how.contains("took more than") || how.contains("could not be read") {
        format!("its render process failed: {how}")
    } else if how.contains("overflowed its stack") {
        format!(
            "the chat template built values nested too deep: its render overflowed the stack (its render process \
             died: {how})"
        )
    } else {
        format!("the render process died: {how}")
    }
}

/// The child's side: loads the tokenizer and template named by the first
/// frame on `input`, then answers requests until `input` ends. Called by
/// the binary's hidden subcommand.
pub fn serve(mut input: impl Read + Send, mut output: impl Write + Send) -> Result<(), String> {
    #[cfg(target_os = "linux")]
    // SAFETY: prctl with PR_SET_PDEATHSIG only sets a signal for this process.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
    }
    let init: Init = match read_frame(&mut input) {
        Ok(Some(i)) => i,
        Ok(None) => return Ok(()),
        Err(e) => return Err(e.to_string()),
    };
    let date = chrono::NaiveDate::parse_from_str(&init.date, "%Y-%m-%d").map_err(|e| e.to_string())?;
    let opts = ChatOptions {
        template_file: init.template_file.clone(),
        date,
        kwargs: init.kwargs.clone(),
        template_memory: init.template_memory,
    };
    let chat = match Chat::load(&init.model, &opts) {
        Ok(c) if c.digest == init.digest => c,
        Ok(_) => {
            let why = format!(
                "the tokenizer or chat template in {} changed since the run loaded them; rerun it",
                init.model.display()
            );
            return write_frame(&mut output, &Reply::Failed(Failure::Template(why))).map_err(|e| e.to_string());
        }
        Err(e) => return write_frame(&mut output, &Reply::Failed(e.into())).map_err(|e| e.to_string()),
    };
    write_frame(&mut output, &Reply::Ready).map_err(|e| e.to_string())?;
    let budget = init.template_memory.saturating_add(SLACK);
    // The work runs on a thread with room for the template's recursion; requests are read here.
    std::thread::scope(|s| {
        let worker = std::thread::Builder::new().name("strata-render".into()).stack_size(STACK).spawn_scoped(s, || {
            loop {
                let req: Request = match read_frame(&mut input) {
                    Ok(Some(r)) => r,
                    Ok(None) => return Ok(()),
                    Err(e) => return Err(e.to_string()),
                };
                // The request's own bytes are read; from here this much more address space at most.
                limit_address_space(Some(budget));
                let reply = match req {
                    Request::Rows { conversation, opts } => Reply::Rows(match chat.renderer() {
                        Ok(mut r) => r.rows(&conversation, &opts).map_err(Failure::from),
                        Err(e) => Err(e.into()),
                    }),
                    Request::Text { text, add_special, cap } => {
                        let mut enc = super::Encoded::default();
                        Reply::Text(
                            chat.tokenizer
                                .encode_limited(&text, add_special, cap, &mut enc)
                                .map(|more| (enc.ids, more))
                                .map_err(Failure::from),
                        )
                    }
                };
                limit_address_space(None);
                let body = serde_json::to_vec(&reply).map_err(|e| e.to_string())?;
                if body.len() > MAX_FRAME {
                    // Rows of more than a GiB to send: that conversation's, said so.
                    let why = format!(
                        "its rows take {} MiB to send, more than the {} MiB a reply may",
                        body.len() >> 20,
                        MAX_FRAME >> 20
                    );
                    let reply = match reply {
                        Reply::Text(_) => Reply::Text(Err(Failure::Text(why))),
                        _ => Reply::Rows(Err(Failure::Refused(why))),
                    };
                    write_frame(&mut output, &reply).map_err(|e| e.to_string())?;
                    continue;
                }
                output
                    .write_all(&(body.len() as u64).to_le_bytes())
                    .and_then(|()| output.write_all(&body))
                    .and_then(|()| output.flush())
                    .map_err(|e| e.to_string())?;
            }
        });
        match worker {
            Ok(w) => w.join().unwrap_or_else(|_| Err("the render thread panicked".into())),
            Err(e) => Err(e.to_string()),
        }
    })
}

/// Limits this process's address space to what it maps now plus `more`
/// bytes (its soft limit, below the hard one), or lifts that (`None`).
fn limit_address_space(more: Option<u64>) {
    #[cfg(target_os = "linux")]
    {
        let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit and setrlimit write and read the struct given.
        unsafe {
            if libc::getrlimit(libc::RLIMIT_AS, &mut lim) != 0 {
                return;
            }
        }
        let want = match more {
            None => lim.rlim_max,
            Some(m) => mapped_bytes().saturating_add(m).min(lim.rlim_max),
        };
        lim.rlim_cur = want;
        // SAFETY: as above.
        unsafe {
            libc::setrlimit(libc::RLIMIT_AS, &lim);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = more;
}

/// The address space this process maps now (`VmSize`).
fn mapped_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let l = s.lines().find(|l| l.starts_with("VmSize:"))?;
            l.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .map_or(0, |kb| kb * 1024)
}
