//! The `strata` command line: argument parsing, progress and summaries, and
//! the jobs that compose the library (`extract`, `verify`, `inspect`).

/// Prints a line to stdout; a closed pipe (`strata inspect DIR | head`) is not an error.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

/// Large buffers on cache lines: the GEMM's tiles load whole lines (see the allocator's docs).
#[global_allocator]
static ALLOC: strata::backend::cpu::CacheAligned = strata::backend::cpu::CacheAligned;

mod embedded;
mod help;
mod report;
mod verify;

use anyhow::Context;
use clap::builder::TypedValueParser as _;
use clap::{Parser, Subcommand};
use report::{print_summary, Reporter};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;
use strata::chat::{MaskSource, RowMode};
use strata::generate::conversation::{ReasoningParser, ToolParser};
use strata::input::InputFormat;
use strata::job::extract::{DataSource, ExtractJob, Format, PrepareArgs};
use strata::job::launch::launcher_gpus;
use strata::job::{ModelRequest, ModelSource};
use strata::model::{BackendKind, ComputeChoice};
use strata::shape::DType;
use strata::sink::{OnNonFinite, OpenMode};

#[derive(Parser)]
#[command(name = "strata", version, about = "Shape-verified hidden-state extraction from transformer LLMs")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a model over token ids, text or conversations and write the hidden states of chosen capture points.
    #[command(after_long_help = help::EXTRACT_HELP)]
    Extract(ExtractArgs),
    /// Describe an output directory or file: shapes, dtypes, capture points, token and per-layer statistics.
    #[command(after_long_help = help::INSPECT_HELP)]
    Inspect(InspectArgs),
    /// Check every sample of a native-format output against its manifest; exit 1 on any problem.
    #[command(after_long_help = help::VERIFY_HELP)]
    Verify(VerifyArgs),
    /// Serve hidden states to the speculators trainer online (its vLLM protocol): no dataset on disk.
    #[command(after_long_help = help::SERVE_HELP)]
    Serve(ServeArgs),
    /// Regenerate responses with the target model and capture their hidden states in the same pass.
    #[command(after_long_help = help::GENERATE_HELP)]
    Generate(GenerateArgs),
    /// Join the parts many processes wrote into OUT/part-IIII-of-NNNN/ into one dataset, copying nothing.
    #[command(after_long_help = help::MERGE_HELP)]
    Merge(MergeArgs),
}

#[derive(clap::Args)]
struct ServeArgs {
    #[command(flatten)]
    run: ModelArgs,
    #[command(flatten)]
    template: TemplateArgs,
    /// The longest prompt served, in tokens; longer ones get a 400. Default:
    /// the model's max_position_embeddings.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    max_seq_len: Option<u64>,
    /// How a generation's tool calls are read, as vLLM's --tool-call-parser
    /// (hermes): a chat request with tools ("auto" tool choice) gets them
    /// in message.tool_calls, finish_reason "tool_calls". Without it such a
    /// request gets vLLM's 400.
    #[arg(long, value_name = "NAME", value_parser = ToolParser::named)]
    tool_call_parser: Option<ToolParser>,
    /// Accepted for vLLM's command line (auto tool choice is on with --tool-call-parser).
    #[arg(long)]
    enable_auto_tool_choice: bool,
    /// Split a chat generation's reasoning off its content, as vLLM's
    /// --reasoning-parser (qwen3, deepseek_r1): into message.reasoning
    /// (vLLM's field) and message.reasoning_content (SGLang's).
    #[arg(long, value_name = "NAME", value_parser = ReasoningParser::named)]
    reasoning_parser: Option<ReasoningParser>,
    /// Where the hidden-state files go (created if missing). The trainer reads
    /// each file at the absolute path in the reply, then deletes it: use a
    /// directory both see at the same path (local disk or /dev/shm for one
    /// node, a shared filesystem across nodes).
    #[arg(long, value_name = "DIR")]
    hidden_states_dir: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: any free port, printed at start).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// The model name /v1/models lists: the trainer's --verifier-name-or-path
    /// must be exactly this string. Default: --model as given (as vLLM does).
    #[arg(long, value_name = "NAME")]
    served_model_name: Option<String>,
    /// Bytes of files served and not yet deleted, plus those being made, at
    /// most (a request waits for room; one larger is served alone).
    #[arg(long, value_name = "SIZE", default_value = "16GiB", value_parser = parse_size)]
    max_pending_bytes: u64,
    /// A served file not deleted this long after its reply is removed (its
    /// reader is gone), e.g. 300s, 10m; at least 10s.
    #[arg(long, value_name = "TIME", default_value = "300s", value_parser = parse_duration)]
    pending_ttl: Duration,
    /// The work the queue holds, in seconds at the measured speed (measured
    /// before the port answers, so a cold burst is bounded too; the trainer
    /// resends after 120 s); and the longest a request waits for room in
    /// --hidden-states-dir. Past either, a 503.
    #[arg(long, value_name = "TIME", default_value = "60s", value_parser = parse_duration)]
    max_queue_time: Duration,
    /// Request bodies held in memory at once, all connections together
    /// (each open connection also takes up to 32 KiB: its read buffer and state); a body
    /// waits for room up to 30 s, then gets a 503.
    #[arg(long, value_name = "SIZE", default_value = "256MiB", value_parser = parse_size)]
    max_body_bytes: u64,
    /// Require `Authorization: Bearer KEY` on every route but /health and
    /// /metrics. Prefer the environment variable: a key on the command line
    /// shows in `ps`. The speculators trainer cannot send a key (see SECURITY).
    #[arg(long, value_name = "KEY", env = "STRATA_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// After SIGTERM, how long requests already in a forward step may finish.
    #[arg(long, value_name = "TIME", default_value = "5s", value_parser = parse_duration)]
    shutdown_grace: Duration,
    /// Connections open at once at most; more wait to be accepted.
    #[arg(long, value_name = "N", default_value_t = 1024)]
    max_connections: usize,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("{s:?} is not a duration (e.g. 5s, 300s, 10m)"))?;
    let secs = match unit.trim() {
        "" | "s" => n,
        "ms" => n / 1000.0,
        "m" | "min" => n * 60.0,
        "h" => n * 3600.0,
        other => return Err(format!("unknown time unit {other:?} in {s:?} (ms, s, m, h)")),
    };
    Duration::try_from_secs_f64(secs).map_err(|e| format!("{s:?}: {e}"))
}

#[derive(clap::Args)]
struct MergeArgs {
    /// The --out directory the parts were written into.
    dir: PathBuf,
    /// Where the input the parts were made from lies now (default: the
    /// --data path the parts recorded). Each part's byte range is read again
    /// and checked against the digest the part recorded.
    #[arg(long, value_name = "FILE")]
    data: Option<PathBuf>,
}

/// The model and how it runs: the flags `extract` and `serve` share (one contract).
#[derive(clap::Args)]
struct ModelArgs {
    /// HF checkpoint directory (config.json + *.safetensors), or a hub id
    /// (org/name) found in the local Hugging Face cache (HF_HUB_CACHE, else
    /// HF_HOME/hub, else ~/.cache/huggingface/hub; nothing is downloaded; a
    /// directory of that name wins). Default: the embedded demo model.
    #[arg(long, value_name = "DIR|ORG/NAME")]
    model: Option<PathBuf>,
    /// With a hub id: the revision read from the cache (a branch, tag or
    /// commit; its ref names the snapshot). Default: main.
    #[arg(long, value_name = "REV")]
    revision: Option<String>,
    /// Comma list of capture points (see below), in output order.
    #[arg(long, value_name = "LIST", default_value = "eagle3")]
    capture: String,
    /// Storage dtype of hidden states. Default: the checkpoint's dtype.
    #[arg(long, value_enum)]
    dtype: Option<DType>,
    /// Tokens per forward step; longer samples are split across steps.
    #[arg(long, value_name = "N", default_value_t = 8192)]
    max_batch_tokens: usize,
    /// What to do with a sample whose captured states hold NaN or Inf.
    #[arg(long, value_enum, value_name = "WHAT", default_value = "fail")]
    on_nonfinite: OnNonFinite,
    /// Tensor-parallel ranks: the model's heads and MLP split over N threads.
    #[arg(long, value_name = "N", default_value_t = 1)]
    tp: usize,
    /// Where the model runs. (`--device` is taken as another spelling of it.)
    #[arg(long, alias = "device", value_enum, default_value = "cpu")]
    backend: BackendKind,
    /// GPUs of --backend cuda, one per tensor-parallel rank in rank order
    /// (`0,1,2,3` with --tp 4). Default: from the launcher's local rank r
    /// (LOCAL_RANK, SLURM_LOCALID), GPUs r·tp..r·tp+tp, unless
    /// CUDA_VISIBLE_DEVICES shows fewer; else GPUs 0..tp.
    #[arg(long, value_name = "IDS", value_delimiter = ',')]
    devices: Vec<usize>,
    /// The dtype of GEMM and attention inputs. Recorded in the manifest with
    /// the kernel path; --resume refuses a run that would mix them.
    #[arg(long, value_enum, value_name = "DTYPE", default_value = "auto")]
    compute: ComputeChoice,
}

/// The chat template and its variables: shared by `extract` and `serve`.
#[derive(clap::Args)]
struct TemplateArgs {
    /// Chat template (Jinja) to render conversations with, instead of the
    /// model's chat_template.jinja or tokenizer_config.json's.
    #[arg(long, value_name = "FILE", help_heading = "Input")]
    chat_template: Option<PathBuf>,
    /// Extra template variables as a JSON object, e.g. '{"enable_thinking": false}'.
    #[arg(long, value_name = "JSON", value_parser = parse_kwargs, help_heading = "Input")]
    chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    /// The date strftime_now renders, YYYY-MM-DD (recorded; a resume reuses it). Default: today.
    #[arg(long, value_name = "DATE", value_parser = parse_date, help_heading = "Input")]
    chat_date: Option<chrono::NaiveDate>,
    /// The memory one render of the chat template may take (its strings,
    /// lists and output; an instruction counts 64 bytes), e.g. 1GiB, 256MiB.
    /// Renders run in a process of their own held to it: a conversation
    /// that needs more is refused, saying so, and the run goes on.
    #[arg(long, value_name = "SIZE", default_value = "1GiB", value_parser = parse_size, help_heading = "Input")]
    template_memory: u64,
}

#[derive(clap::Args)]
struct ExtractArgs {
    #[command(flatten)]
    run: ModelArgs,
    /// JSON Lines of token ids, conversations or text (see INPUT below): a
    /// file, a pipe or FIFO, or - for stdin; or a datasets directory
    /// (save_to_disk). Read once, checked as it streams. Default: the embedded demo data.
    #[arg(long, value_name = "FILE.jsonl|DIR")]
    data: Option<PathBuf>,
    /// Output directory (created if missing; must be empty unless --resume or --overwrite).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// Output format.
    #[arg(long, value_enum, default_value = "strata")]
    format: Format,
    /// Target size of each shard (native format), e.g. 1GiB, 256MiB, 1000000.
    #[arg(long, value_name = "SIZE", default_value = "1GiB", value_parser = parse_size)]
    shard_size: u64,
    /// Continue an interrupted run in --out: keep finished files, skip their samples.
    #[arg(long, conflicts_with = "overwrite")]
    resume: bool,
    /// Replace the output an earlier run (of either format) left in --out.
    #[arg(long)]
    overwrite: bool,
    /// With --format speculators: count the loss-masked tokens of the rows
    /// and write the trainer's draft-vocabulary files for each size, as
    /// `speculators prepare-data` would: d2t-N.npy, t2d-N.npy and
    /// token_freq.pt (from which the trainer builds any other size). Then
    /// `speculators train --draft-vocab-size N` needs no prepare step.
    #[arg(long, value_name = "N[,N...]", value_delimiter = ',')]
    draft_vocab_size: Vec<usize>,
    /// What the --data records are. Default: detected from the first line
    /// (`input_ids`, `conversations`, `messages` or `text`).
    #[arg(long, value_enum, value_name = "FORMAT", default_value = "auto", help_heading = "Input")]
    input_format: InputFormat,
    #[command(flatten)]
    template: TemplateArgs,
    /// Where conversations' loss masks come from.
    #[arg(long, value_enum, value_name = "FROM", default_value = "boundary", help_heading = "Input")]
    loss_mask: MaskSource,
    /// Rows per conversation.
    #[arg(long, value_enum, value_name = "MODE", default_value = "auto", help_heading = "Input")]
    rows: RowMode,
    /// Cut every row to N tokens on the right; N is at most the model's
    /// max_position_embeddings, which conversations are cut to by default
    /// (other records must fit it unless this is given).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..), help_heading = "Input")]
    max_seq_len: Option<u64>,
    /// Leave rows longer than the limit out instead of cutting them.
    #[arg(long, help_heading = "Input")]
    skip_long: bool,
    /// Stop once the chat template fails on this many conversations in a
    /// row (refused, out of memory or instructions), naming the template
    /// and the last error; 0: never stop.
    #[arg(long, value_name = "N", default_value_t = 100, help_heading = "Input")]
    max_template_failures: usize,
    /// This process's part of the input (0-based), with --num-parts: the
    /// input is split into contiguous parts of about equal bytes and this
    /// run writes OUT/part-IIII-of-NNNN/. Default: from the launcher's
    /// environment (see PARTS below), else the whole input.
    #[arg(long, value_name = "I", help_heading = "Parts (many processes, one input)")]
    part_index: Option<usize>,
    /// Number of parts. Given alone, the index comes from the launcher
    /// (e.g. JOB_COMPLETION_INDEX of a Kubernetes Indexed Job, which has no count).
    #[arg(long, value_name = "N", help_heading = "Parts (many processes, one input)")]
    num_parts: Option<usize>,
}

#[derive(clap::Args)]
struct GenerateArgs {
    #[command(flatten)]
    run: ModelArgs,
    /// JSON Lines, one record a line: conversations ({"messages": [...]},
    /// {"conversations": [...]}, with "tools"; or {"prompt": "..."}),
    /// regenerated turn by turn as speculators regenerate-responses does;
    /// text prompts ({"text": "..."}); or token-id prompts
    /// ({"input_ids": [...]}), one generation each, the prompt as given.
    #[arg(long, value_name = "FILE.jsonl")]
    data: PathBuf,
    /// Output directory: the speculators trainer's dataset directory
    /// (created if missing; must be empty unless --overwrite).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// Replace the output an earlier run left in --out.
    #[arg(long)]
    overwrite: bool,
    /// Continue an interrupted run in --out: keep its rows, skip their
    /// records, draw with the seed it recorded. The rows written after are
    /// those an uninterrupted run writes.
    #[arg(long, conflicts_with = "overwrite")]
    resume: bool,
    /// Most sequences in flight (prefilling or decoding) at once.
    #[arg(long, value_name = "N", default_value_t = 256, help_heading = "Scheduling")]
    max_num_seqs: usize,
    /// Bytes of cache (keys, values, recurrent state) the sequences in flight
    /// hold together at most, e.g. 8GiB. A sequence enters when its prompt
    /// and its longest response fit beside the others' (its cache is
    /// allocated at once; it waits otherwise). Default: no bound but --max-num-seqs.
    #[arg(long, value_name = "SIZE", value_parser = parse_size, help_heading = "Scheduling")]
    kv_cache_memory: Option<u64>,
    /// 0 is greedy. Default: generation_config.json's, else 1.
    #[arg(long, value_name = "T", allow_negative_numbers = true, help_heading = "Sampling (vLLM's meaning)")]
    temperature: Option<f32>,
    /// Keep the k most likely tokens (ties kept); 0 or -1: all. Default: generation_config.json's, else 0.
    #[arg(long, value_name = "K", allow_negative_numbers = true, help_heading = "Sampling (vLLM's meaning)")]
    top_k: Option<i64>,
    /// Keep the most likely tokens up to mass P (the one crossing P kept). Default: generation_config.json's, else 1.
    #[arg(long, value_name = "P", allow_negative_numbers = true, help_heading = "Sampling (vLLM's meaning)")]
    top_p: Option<f32>,
    /// Drop tokens less likely than P times the most likely. Default: generation_config.json's, else 0.
    #[arg(long, value_name = "P", allow_negative_numbers = true, help_heading = "Sampling (vLLM's meaning)")]
    min_p: Option<f32>,
    /// > 1 discourages tokens of the prompt and the response. Default: generation_config.json's, else 1.
    #[arg(long, value_name = "R", allow_negative_numbers = true, help_heading = "Sampling (vLLM's meaning)")]
    repetition_penalty: Option<f32>,
    /// Subtracted once from the logit of each token the response holds, in [-2, 2].
    #[arg(long, value_name = "X", allow_negative_numbers = true, help_heading = "Sampling (vLLM's meaning)")]
    presence_penalty: Option<f32>,
    /// Subtracted per occurrence in the response, in [-2, 2].
    #[arg(long, value_name = "X", allow_negative_numbers = true, help_heading = "Sampling (vLLM's meaning)")]
    frequency_penalty: Option<f32>,
    /// Most tokens per response. Default: generation_config.json's max_new_tokens, else up to the model's last position.
    #[arg(long, value_name = "N", help_heading = "Sampling (vLLM's meaning)")]
    max_tokens: Option<usize>,
    /// Every draw depends only on (seed, record, generation, position).
    /// Default: drawn once, printed and recorded in the manifest.
    #[arg(long, value_name = "S", help_heading = "Sampling (vLLM's meaning)")]
    seed: Option<u64>,
    /// Token ids that end a response besides EOS (generation_config.json's
    /// eos_token_id, else config.json's, and the tokenizer's).
    #[arg(long, value_name = "IDS", value_delimiter = ',', help_heading = "Sampling (vLLM's meaning)")]
    stop_token_ids: Vec<u32>,
    /// EOS is an ordinary token: never a stop (--stop-token-ids still stop).
    #[arg(long, help_heading = "Sampling (vLLM's meaning)")]
    ignore_eos: bool,
    /// Ignore generation_config.json's sampling defaults and max_new_tokens
    /// (its eos_token_id still stops, unless --ignore-eos).
    #[arg(long, help_heading = "Sampling (vLLM's meaning)")]
    no_generation_config: bool,
    #[command(flatten)]
    template: TemplateArgs,
    /// How a reply's tool calls are read, as vLLM's --tool-call-parser
    /// (hermes). Rows with "tools" need one; a generated call is answered
    /// with the row's next cached "tool" message.
    #[arg(long, value_name = "NAME", value_parser = ToolParser::named, help_heading = "Input")]
    tool_call_parser: Option<ToolParser>,
    /// Split the reasoning off each reply before it goes into the history,
    /// as vLLM's --reasoning-parser (qwen3, deepseek_r1). The row keeps every
    /// generated token either way.
    #[arg(long, value_name = "NAME", value_parser = ReasoningParser::named, help_heading = "Input")]
    reasoning_parser: Option<ReasoningParser>,
    /// Rows per conversation: per-turn writes one row per generation (as
    /// speculators does); auto merges a row into the next where it is that
    /// row's token prefix (one row, a loss span per generation).
    #[arg(long, value_name = "MODE", default_value = "per-turn", help_heading = "Input",
          value_parser = clap::builder::PossibleValuesParser::new(["per-turn", "auto"])
              .map(|m| if m == "auto" { RowMode::Auto } else { RowMode::PerTurn }))]
    rows: RowMode,
    /// Count the generated (loss-masked) tokens of the rows and write the
    /// trainer's draft-vocabulary files for each size (d2t-N.npy, t2d-N.npy,
    /// token_freq.pt), as `speculators prepare-data` would.
    #[arg(long, value_name = "N[,N...]", value_delimiter = ',')]
    draft_vocab_size: Vec<usize>,
    /// Regenerate only: the rows (the dataset's table, regenerated.jsonl)
    /// for online training against `strata serve`, no hidden states kept
    /// (each row's file holds zero capture points; --capture is ignored).
    #[arg(long)]
    no_states: bool,
    /// This process's part of the input (0-based), with --num-parts: the
    /// input is split into contiguous parts of about equal bytes and this
    /// run writes OUT/part-IIII-of-NNNN/; `strata merge OUT` joins them (and
    /// their regenerated.jsonl). Default: from the launcher's environment.
    #[arg(long, value_name = "I", help_heading = "Parts (many processes, one input)")]
    part_index: Option<usize>,
    /// Number of parts.
    #[arg(long, value_name = "N", help_heading = "Parts (many processes, one input)")]
    num_parts: Option<usize>,
}

fn parse_kwargs(s: &str) -> Result<serde_json::Map<String, serde_json::Value>, String> {
    match serde_json::from_str(s) {
        Ok(serde_json::Value::Object(m)) => Ok(m),
        Ok(_) => Err("expected a JSON object, e.g. '{\"enable_thinking\": false}'".into()),
        Err(e) => Err(format!("not JSON: {e}")),
    }
}

fn parse_date(s: &str) -> Result<chrono::NaiveDate, String> {
    chrono::NaiveDate::parse_from_str(s, "%Y-%m-%d").map_err(|e| format!("expected YYYY-MM-DD: {e}"))
}

#[derive(clap::Args)]
struct InspectArgs {
    /// A native output directory, a speculators one (either layout), or one safetensors file.
    path: PathBuf,
    /// Compute statistics over at most this many samples.
    #[arg(long, value_name = "N")]
    max_samples: Option<usize>,
}

#[derive(clap::Args)]
struct VerifyArgs {
    /// A native-format output directory.
    dir: PathBuf,
    /// Expected layout: JSON with capture / hidden_size / dtype, or a manifest.json.
    #[arg(long, value_name = "FILE")]
    layout: Option<PathBuf>,
    /// Also run N randomly chosen samples through the model again and compare.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    recompute: Option<u64>,
    /// Seed of the --recompute choice.
    #[arg(long, value_name = "S", default_value_t = 0, requires = "recompute")]
    seed: u64,
    /// The model for --recompute. Default: the one the manifest names.
    #[arg(long, value_name = "DIR", requires = "recompute")]
    model: Option<PathBuf>,
    /// Where --recompute runs the model.
    #[arg(long, alias = "device", value_enum, default_value = "cpu", requires = "recompute")]
    backend: BackendKind,
    /// Tensor-parallel ranks of --recompute. For MoE models use the dataset's
    /// own --tp: another split changes the router's last bits and can flip a
    /// near-tie expert choice.
    #[arg(long, value_name = "N", default_value_t = 1, requires = "recompute")]
    tp: usize,
    /// GPUs of --recompute on --backend cuda, one per rank. Default: 0..tp.
    #[arg(long, value_name = "IDS", value_delimiter = ',', requires = "recompute")]
    devices: Vec<usize>,
    /// The compute dtype of --recompute. Default: the dataset's, on the cpu
    /// backend (f32 on the reference backend).
    #[arg(long, value_enum, value_name = "DTYPE", requires = "recompute")]
    compute: Option<ComputeChoice>,
}

fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("{s:?} is not a size (e.g. 1GiB, 512MiB, 1000000)"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1000,
        "kib" => 1 << 10,
        "m" | "mb" => 1_000_000,
        "mib" => 1 << 20,
        "g" | "gb" => 1_000_000_000,
        "gib" => 1 << 30,
        "t" | "tb" => 1_000_000_000_000,
        "tib" => 1 << 40,
        other => return Err(format!("unknown size unit {other:?} in {s:?}")),
    };
    let v = (n * mult as f64) as u64;
    if v == 0 {
        return Err("size must be positive".into());
    }
    Ok(v)
}

impl ModelArgs {
    /// The model request these flags make, checked; GPUs from the launcher when --devices is not given.
    fn request(&self) -> anyhow::Result<ModelRequest> {
        if self.tp == 0 {
            anyhow::bail!("--tp must be at least 1");
        }
        if self.max_batch_tokens == 0 {
            anyhow::bail!("--max-batch-tokens must be at least 1");
        }
        let devices = match (&self.backend, self.devices.is_empty()) {
            (BackendKind::Cuda, true) => match launcher_gpus(self.tp, |k| std::env::var(k).ok())? {
                Some((gpus, from)) => {
                    let list: Vec<String> = gpus.iter().map(|g| g.to_string()).collect();
                    say!("GPUs {} (from {from}; --devices chooses others)", list.join(","));
                    gpus
                }
                None => Vec::new(),
            },
            _ => self.devices.clone(),
        };
        Ok(ModelRequest {
            source: model_source(self.model.as_deref(), self.revision.as_deref())?,
            backend: self.backend,
            compute: self.compute,
            tp: self.tp,
            devices,
            lm_head: false,
        })
    }
}

fn extract(a: ExtractArgs) -> anyhow::Result<()> {
    let request = a.run.request()?;
    let part = strata::input::parts::resolve(a.part_index, a.num_parts, |k| std::env::var(k).ok())
        .map_err(|e| anyhow::anyhow!("cannot tell this process's part of the input: {e}"))?;
    if a.run.model.is_some() && a.data.is_none() {
        anyhow::bail!("--model needs --data FILE.jsonl (the embedded demo data is made for the embedded model)");
    }
    let r = &a.run;
    let job = ExtractJob {
        model: request,
        data: match a.data {
            Some(p) => DataSource::File(p),
            None => DataSource::Static { name: embedded::DATA_NAME, text: embedded::DATA_JSONL },
        },
        capture: r.capture.clone(),
        out: a.out.clone(),
        dtype: r.dtype,
        format: a.format,
        max_batch_tokens: r.max_batch_tokens,
        shard_size: a.shard_size,
        mode: open_mode(a.resume, a.overwrite),
        on_nonfinite: r.on_nonfinite,
        prepare: PrepareArgs {
            input_format: a.input_format,
            chat_template: a.template.chat_template,
            kwargs: a.template.chat_template_kwargs.unwrap_or_default(),
            date: a.template.chat_date,
            mask: a.loss_mask,
            rows: a.rows,
            max_seq_len: a.max_seq_len.map(|n| n as usize),
            skip_long: a.skip_long,
            template_memory: a.template.template_memory,
            max_template_failures: a.max_template_failures,
            isolation: render_process(),
        },
        part,
        draft_vocab_sizes: {
            let mut v = a.draft_vocab_size.clone();
            v.sort_unstable();
            v.dedup();
            v
        },
    };
    let out = job.out_dir();
    let model = a.run.model.as_ref().map_or("<embedded llama-default>".into(), |p| p.display().to_string());
    let mut reporter = Reporter::new();
    let summary = job
        .run(|p, input| reporter.update(p, input))
        .with_context(|| format!("strata extract failed (model {model})"))?;
    if let Some(bar) = reporter.bar.take() {
        bar.finish_and_clear();
    }
    print_summary(&summary, &out);
    summary.check_samples(&out)?;
    if summary.produced() == 0 {
        eprintln!("warning: the input holds no samples; the output is empty");
    }
    Ok(())
}

fn generate(a: GenerateArgs) -> anyhow::Result<()> {
    let part = strata::input::parts::resolve(a.part_index, a.num_parts, |k| std::env::var(k).ok())
        .map_err(|e| anyhow::anyhow!("cannot tell this process's part of the input: {e}"))?;
    use strata::job::generate::{GenerateJob, SamplingArgs};
    let r = &a.run;
    if r.on_nonfinite == OnNonFinite::Skip {
        anyhow::bail!(
            "--on-nonfinite skip: strata generate stops at a state that holds NaN or Inf (a row cannot be left \
             out of a conversation whose next turns it begins); drop the flag"
        );
    }
    let job = GenerateJob {
        model: r.request()?,
        data: a.data.clone(),
        capture: r.capture.clone(),
        out: a.out.clone(),
        dtype: r.dtype,
        mode: open_mode(a.resume, a.overwrite),
        sampling: SamplingArgs {
            asked: strata::generate::AskedSampling {
                temperature: a.temperature,
                top_k: a.top_k,
                top_p: a.top_p,
                min_p: a.min_p,
                repetition_penalty: a.repetition_penalty,
                presence_penalty: a.presence_penalty,
                frequency_penalty: a.frequency_penalty,
            },
            max_tokens: a.max_tokens,
            seed: a.seed,
            stop_token_ids: a.stop_token_ids.clone(),
            ignore_eos: a.ignore_eos,
            generation_config: !a.no_generation_config,
        },
        max_batch_tokens: r.max_batch_tokens,
        max_num_seqs: a.max_num_seqs,
        kv_cache_memory: a.kv_cache_memory,
        chat: strata::chat::ChatOptions {
            template_file: a.template.chat_template.clone(),
            date: a.template.chat_date.unwrap_or_else(|| chrono::Local::now().date_naive()),
            kwargs: a.template.chat_template_kwargs.clone().unwrap_or_default(),
            template_memory: a.template.template_memory,
        },
        tool_call_parser: a.tool_call_parser,
        reasoning_parser: a.reasoning_parser,
        rows: a.rows,
        draft_vocab_sizes: a.draft_vocab_size.clone(),
        states: !a.no_states,
        part,
    };
    let model = r.model.as_ref().map_or("<embedded llama-default>".into(), |p| p.display().to_string());
    let mut last = std::time::Instant::now();
    let summary = job
        .run(|p| {
            if last.elapsed() >= Duration::from_secs(2) {
                last = std::time::Instant::now();
                report::generate_progress(p);
            }
        })
        .with_context(|| format!("strata generate failed (model {model})"))?;
    report::generate_summary(&summary, &a.out);
    Ok(())
}

/// `--resume` and `--overwrite` (clap refuses both at once).
fn open_mode(resume: bool, overwrite: bool) -> OpenMode {
    if resume {
        OpenMode::Resume
    } else if overwrite {
        OpenMode::Overwrite
    } else {
        OpenMode::Create
    }
}

/// `--model DIR|ORG/NAME` (with `--revision`), or the embedded demo model.
fn model_source(model: Option<&std::path::Path>, revision: Option<&str>) -> anyhow::Result<ModelSource> {
    let Some(model) = model else {
        if let Some(r) = revision {
            anyhow::bail!("--revision {r} needs --model with a hub id (org/name)");
        }
        return Ok(embedded::source());
    };
    // A path that is not UTF-8 cannot be a hub id.
    let Some(text) = model.to_str() else { return Ok(ModelSource::Dir(model.to_path_buf())) };
    let (source, note) = ModelSource::locate(text, revision)?;
    if let Some(note) = note {
        eprintln!("note: {note}");
    }
    Ok(source)
}

/// Keeps freed memory in the process for reuse. glibc returns large blocks to
/// the kernel at once (mmap above 128 KiB, trimming the heap top), so every
/// forward step and every weight read would fault in fresh zeroed pages: on
/// a VM that was a third of a MoE model's run time. Working buffers are
/// bounded by the batch, so what is kept is too.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator thresholds; called before any thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}

/// A write past `ulimit -f` then fails with EFBIG, which the stage that
/// wrote reports (a 500 for that request in `serve`, an error naming the
/// file in `extract`, whose temporary file goes), instead of SIGXFSZ
/// killing the process and leaving the temporary file behind.
fn ignore_file_size_signal() {
    // SAFETY: setting a signal's disposition to SIG_IGN, before any thread starts.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
    }
}

/// Renders and tokenizing run in a child process: this binary's hidden
/// subcommand. Without a path to this binary, in this process (with a warning).
fn render_process() -> Option<strata::chat::isolate::Isolation> {
    match std::env::current_exe() {
        Ok(program) => Some(strata::chat::isolate::Isolation { program, args: vec![RENDER_COMMAND.into()] }),
        Err(e) => {
            tracing::warn!("renders run in this process, bounded by their instructions only: {e}");
            None
        }
    }
}

/// The hidden subcommand a render process runs.
const RENDER_COMMAND: &str = "__render";

fn main() -> ExitCode {
    // Before any thread starts: NCCL reads its environment, and setting it later races.
    #[cfg(feature = "cuda")]
    strata::backend::cuda::driver::set_nccl_env();
    if std::env::args().nth(1).as_deref() == Some(RENDER_COMMAND) {
        // A render process (see strata::chat::isolate): requests on stdin, replies on stdout.
        // Its allocator keeps glibc's defaults: large blocks are mapped and returned at once.
        return match strata::chat::isolate::serve(std::io::stdin(), std::io::BufWriter::new(std::io::stdout())) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: render process: {e}");
                ExitCode::FAILURE
            }
        };
    }
    keep_freed_memory();
    ignore_file_size_signal();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Extract(a) => extract(a),
        Command::Inspect(a) => strata::dataset::inspect::inspect(&a.path, a.max_samples)
            .map(|text| say!("{}", text.trim_end()))
            .with_context(|| format!("strata inspect {}", a.path.display())),
        Command::Verify(a) => verify(a),
        Command::Merge(a) => merge(&a.dir, a.data.as_deref()),
        Command::Generate(a) => generate(a),
        Command::Serve(a) => serve(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn serve(a: ServeArgs) -> anyhow::Result<()> {
    let request = a.run.request()?;
    let name = a.served_model_name.clone().unwrap_or_else(|| strata::serve::default_model_name(&request));
    let opts = strata::serve::ServeOptions {
        model: request,
        capture: a.run.capture.clone(),
        dtype: a.run.dtype,
        max_batch_tokens: a.run.max_batch_tokens,
        max_seq_len: a.max_seq_len.map(|n| n as usize),
        chat: strata::chat::ChatOptions {
            template_file: a.template.chat_template.clone(),
            date: a.template.chat_date.unwrap_or_else(|| chrono::Local::now().date_naive()),
            kwargs: a.template.chat_template_kwargs.clone().unwrap_or_default(),
            template_memory: a.template.template_memory,
        },
        states_dir: a.hidden_states_dir.clone(),
        host: a.host.clone(),
        port: a.port,
        served_model_name: name.clone(),
        max_pending_bytes: a.max_pending_bytes,
        pending_ttl: a.pending_ttl,
        max_queue_time: a.max_queue_time,
        max_body_bytes: a.max_body_bytes,
        api_key: a.api_key.clone().map(strata::serve::ApiKey::new).transpose()?,
        shutdown_grace: a.shutdown_grace,
        max_connections: a.max_connections,
        header_timeout: Duration::from_secs(10),
        tool_call_parser: a.tool_call_parser,
        reasoning_parser: a.reasoning_parser,
    };
    if a.run.on_nonfinite == OnNonFinite::Skip {
        eprintln!("note: a served prompt whose states hold NaN or Inf gets a 500 either way (--on-nonfinite skip has nothing to skip)");
    }
    let mut addr = None;
    strata::serve::serve(opts, |event| report::serve_event(&mut addr, event))
        .with_context(|| format!("strata serve failed (model {name})"))
}

fn merge(dir: &std::path::Path, data: Option<&std::path::Path>) -> anyhow::Result<()> {
    use strata::sink::merge::InputCheck;
    let r = strata::sink::merge::merge(dir, data).with_context(|| format!("strata merge {}", dir.display()))?;
    // The parts of a `strata generate` run: their regenerated.jsonl, joined in order.
    if let Some(lines) = strata::job::generate::regenerated::join_parts(dir)
        .with_context(|| format!("strata merge {}: regenerated.jsonl", dir.display()))?
    {
        say!("  regenerated.jsonl: the parts' {lines} lines, in order");
    }
    let skipped = if r.skipped > 0 { format!(", {} skipped (non-finite)", r.skipped) } else { String::new() };
    say!("merged {} parts ({} format): {} samples{skipped}", r.parts, r.format, r.samples);
    say!(
        "  checked     every listed file is the part's own regular file of its listed size; `strata verify {}` \
         checks their contents (checksums)",
        dir.display()
    );
    match &r.input {
        InputCheck::Checked { path, bytes } => {
            say!("  input       each part's byte range of {path} ({bytes} bytes) has the digest the part recorded")
        }
        InputCheck::Unchecked(why) => say!("  input       NOT CHECKED: {why}"),
        InputCheck::NotRun => {}
    }
    if r.format == "speculators" {
        say!(
            "  {} files linked as {}/hidden_states/hs_{{i}}.safetensors ({} bytes, none copied), and the dataset table",
            r.files,
            dir.display(),
            r.bytes
        );
        if r.dtype == "fp8" {
            say!("  fp8: train with the speculators stack's FP8 hidden-states backend (its default reader does not dequantise)");
        }
    } else {
        say!("  {} shards ({} bytes) indexed in {}/manifest.json, none copied", r.files, r.bytes, dir.display());
    }
    Ok(())
}

fn verify(a: VerifyArgs) -> anyhow::Result<()> {
    let job = verify::VerifyJob {
        dir: a.dir,
        layout: a.layout,
        recompute: a.recompute.map(|n| n as usize),
        seed: a.seed,
        model: a.model,
        backend: a.backend,
        tp: a.tp,
        devices: a.devices,
        compute: a.compute,
    };
    job.run()
}
