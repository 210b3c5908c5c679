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
mod verify;

use anyhow::Context;
use clap::{Parser, Subcommand};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};
use strata::chat::{MaskSource, RowMode};
use strata::input::InputFormat;
use strata::job::extract::{DataSource, ExtractJob, Format, InputProgress, PrepareArgs, Summary};
use strata::job::launch::launcher_gpus;
use strata::job::Progress;
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
    #[command(after_long_help = EXTRACT_HELP)]
    Extract(ExtractArgs),
    /// Describe an output directory or file: shapes, dtypes, capture points, token and per-layer statistics.
    #[command(after_long_help = INSPECT_HELP)]
    Inspect(InspectArgs),
    /// Check every sample of a native-format output against its manifest; exit 1 on any problem.
    #[command(after_long_help = VERIFY_HELP)]
    Verify(VerifyArgs),
    /// Serve hidden states to the speculators trainer online (its vLLM protocol): no dataset on disk.
    #[command(after_long_help = SERVE_HELP)]
    Serve(ServeArgs),
    /// Join the parts many processes wrote into OUT/part-IIII-of-NNNN/ into one dataset, copying nothing.
    #[command(after_long_help = MERGE_HELP)]
    Merge(MergeArgs),
}

const MERGE_HELP: &str = "\
Every part must be complete and of one job: the same model and weights digest,
capture points, storage and compute dtype, kernel path, input (its length and
fingerprint), and parts that tile the input in order. A missing or incomplete
part is named, with the command that finishes it.

  --format strata:      OUT/manifest.json indexes every part's shards where they lie.
  --format speculators: OUT becomes the trainer's dataset directory: the rows of all
                        parts in order (data-00000-of-00001.arrow) and
                        OUT/hidden_states/hs_{i}.safetensors, hard links to the parts' files.

`strata inspect OUT` and `strata verify OUT` read the merged dataset. The parts stay
as they are: a part can still be rerun with --resume, and merging again is safe.

EXAMPLES:
  # 16 Slurm array tasks, then one merge:
  sbatch --array=0-15 examples/slurm/extract.sbatch
  strata merge /scratch/run1 && strata verify /scratch/run1";

const SERVE_HELP: &str = "\
The speculators trainer trains online against a vLLM server by default (--on-missing
generate): for each sample it has no file for, it sends the token ids to
POST /v1/completions (max_tokens 1), loads the safetensors file named in the reply's
kv_transfer_params.hidden_states_path, checks it and deletes it. strata serve is
that server. Each file is the one `strata extract --format speculators` writes for
the same ids (token_ids, loss_mask of ones, hidden_states [T, L, H]), byte for byte
on the cpu and reference backends, whatever else shared its forward step.

ROUTES: GET /health (200 once loaded), GET /v1/models, POST /v1/completions (token
ids), POST /v1/chat/completions (text parts, rendered with the chat template), GET
/metrics (Prometheus).

LAYER IDS: the file's last slot must be `final` (the trainer normalises it itself),
so --capture ends with final. At start the server prints the ids it serves (input:K
is id K, final is id N) and the trainer's --target-layer-ids: the ids before the
final one. Nothing in the protocol checks them: other ids train on the wrong states.

FILES: written whole under a temporary name and renamed before the reply, named
unguessably (strata-RUN-<128 bits>.safetensors) in --hidden-states-dir, which the
trainer must be able to read and delete in (the same path on its machine).
--max-pending-bytes bounds the files served and not yet deleted plus those being
made: a request waits for room up to --max-queue-time, then gets a 503; one larger
than the cap is served alone. A file whose client hung up is removed at once; one
nobody deletes within --pending-ttl is removed then.

DIRECTORY: one server per --hidden-states-dir. A server locks DIR/.strata-serve.lock
while it runs (a second server there is refused, naming the first's pid); the same
file records the runs that wrote there. Only files of the exact served form whose
RUN is recorded are ever deleted: after a restart, a dead run's temporary files at
once and its unread files after --pending-ttl. Anything else in the directory is
never touched, so it may be shared (/dev/shm, a home directory).

SECURITY: listens on 127.0.0.1 by default, with no authentication unless a key is
set (STRATA_API_KEY, or --api-key, which shows in `ps`). With a key every route but
/health and /metrics needs `Authorization: Bearer KEY`; a missing or wrong one gets
a 401. The speculators trainer always sends `Bearer EMPTY`: keep its server on
loopback, or behind a proxy that adds the key. Listening beyond loopback without a
key prints a warning.

CLIENTS: request bodies held in memory are bounded in total by --max-body-bytes (a
body waits up to 30 s for room, then 503); a Content-Length over the largest valid
request gets a 413 at once. When all --max-connections are open, the one idle
longest is closed to make room. A client that closes its sending side (a
half-close, or a hang-up) before its completion is done is taken as gone: the
request is dropped and answered 400 saying why (a GET is always answered).

BATCHING: requests from all connections are packed into forward steps of
--max-batch-tokens; a longer prompt is split across steps. A request whose client
hung up while queued is dropped before its forward. The queue holds --max-queue-time
of work at the measured throughput (measured before the port answers 200, so a cold
burst is bounded too; never less than one step), then answers 503.

STOPPING: SIGTERM or SIGINT stops accepting, lets requests in a step finish within
--shutdown-grace, answers the rest 503 (removing their files) and exits 0.

EXAMPLES:
  # One server per node, the trainer's ranks on the same node:
  strata serve --model ./Llama-3.1-8B --capture eagle3 --dtype bf16 \\
      --hidden-states-dir /dev/shm/hs --port 8000
  speculators train --verifier-name-or-path ./Llama-3.1-8B --data-path ./data \\
      --vllm-endpoint http://127.0.0.1:8000/v1 --on-missing generate --target-layer-ids 2 16 29";

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

const EXTRACT_HELP: &str = "\
CAPTURE POINTS (each defined against HF output_hidden_states `hs`, N layers):
  embeddings   token embeddings                      hs[0]
  input:K      residual stream entering layer K      hs[K]    (vLLM's aux layer K)
  output:K     HF's entry after layer K              hs[K+1]  (SGLang/SpecForge layer K)
  final        residual after the last layer, before the final norm
  final-norm   after the final norm (what the LM head reads)  hs[N]
  eagle3       input:2, input:N/2, input:N-3, final

INPUT (--data): JSON Lines, one record per line, each with an optional \"id\";
the first line decides the kind (or --input-format):
  {\"input_ids\": [128000, 9906, 1917], \"loss_mask\": [0, 1, 1]}       token ids (mask default: all 1)
  {\"conversations\": [{\"from\": \"human\", \"value\": \"Hi\"}, {\"from\": \"gpt\", ...}]}   ShareGPT
  {\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}, ...], \"tools\": [...]}     OpenAI
  {\"text\": \"...\"}                                                      plain text (mask: all 1)
  --data may be a file, a pipe or FIFO, or - for stdin: it is read once, and each
  line is checked as it streams (ids unique, token ids below vocab_size, at most
  max_position_embeddings tokens, 2048 when config.json has none). A bad line stops
  the run there: samples before it are written, and --resume continues once it is
  fixed. A run whose input fails before its first sample is written leaves nothing.
  --data may also be a Hugging Face datasets directory (save_to_disk, e.g. the
  speculators prepare step's output) with input_ids and optional loss_mask columns.

CONVERSATIONS are rendered with the model's chat template (chat_template.jinja, else
tokenizer_config.json's; --chat-template FILE overrides) and tokenized with its
tokenizer (tokenizer.json, or Kimi-K2's tiktoken.model), as transformers'
apply_chat_template does. Loss masks by render boundaries (as the speculators
stack): for assistant turn j, conv[:j] rendered with the generation prompt is the
prompt and conv[:j+1] the row; the row's tokens past the prompt are supervised.
Roles: human/user, gpt/assistant, system, tool (any other counts as assistant).
--rows auto gives one row per conversation where the template is prefix-stable
(every turn's row is a prefix of the last: same states, computed once) and one row
per assistant turn ({id}#{turn}) where it rewrites history (Qwen3's reasoning).
--loss-mask generation uses the template's {% generation %} blocks instead.
Empty conversations and ones without an assistant turn are skipped; one whose
renders diverge is reported and left out; the summary counts them all.
--max-seq-len N cuts rows (conversations default: max_position_embeddings);
--skip-long drops them; a turn whose prompt alone fills the limit is left out.
A conversation is rendered once and tokenized up to the limit, each turn's prompt
and row against it; long texts are tokenized in pieces and left once the limit is
passed, so a long input costs what the limit keeps.
strftime_now renders --chat-date (default today), recorded for --resume.
Renders run in a child process bounded by --template-memory (default 1GiB): a
conversation the template needs more for (or nests values too deep in) is refused,
saying so; --max-template-failures N in a row (default 100) stops the run.

OUTPUT (--format strata, the default): OUT/shard-NNNNN.safetensors holding per sample
  {id}.hidden_states [L, T, H], {id}.input_ids [T] i64, {id}.loss_mask [T] u8,
  and OUT/manifest.json (capture points, dtype, checksums). See docs/FORMAT.md.
OUTPUT (--format speculators): OUT is the dataset directory the speculators trainer
  loads: a datasets table (data-00000-of-00001.arrow, dataset_info.json, state.json;
  input_ids, loss_mask, seq_len; torch format) and OUT/hidden_states/hs_{i}.safetensors
  for row i with token_ids [T] i64, loss_mask [T] u8 and hidden_states [T, L, H].
  At the end it prints the trainer's --target-layer-ids (the points before final;
  the capture must end with final). --draft-vocab-size N adds the trainer's
  d2t-N.npy, t2d-N.npy and token_freq.pt: then `speculators train --draft-vocab-size N`
  needs no prepare-data step. --resume, --overwrite and merge remove the vocabulary
  files the trainer cached there (they describe the rows as they were).

FP8 (--dtype fp8): one byte per value, e4m3 codes with an f32 scale per token and
  capture point: {id}.hidden_states_scales [L, T, 1] (native), hidden_states_scales
  [T, L, 1] (speculators); the states are hidden_states * hidden_states_scales. About
  2.5% relative L2 error against f32 (bf16: 0.17%). The speculators layout is that of
  the speculators stack's FP8 hidden-states backend: train with it, since the stack's
  default reader does not dequantise (speculators 0.9's check_hidden_states fails on
  FP8, so each sample is skipped, and 20 in a row stop training).

PARTS (many processes, one input): each process takes a contiguous part of --data
(a regular file; about equal bytes, whole lines) and writes OUT/part-IIII-of-NNNN/
with its own manifest; `strata merge OUT` then joins them without copying. The part
is --part-index I --num-parts N, else the launcher's environment, first match wins:
  torchrun & co.    RANK, WORLD_SIZE (they describe this process: inside an sbatch they
                    win, and must agree: WORLD_SIZE a multiple of SLURM_NTASKS, and
                    RANK / LOCAL_WORLD_SIZE = SLURM_PROCID)
  Slurm job array   SLURM_ARRAY_TASK_ID, SLURM_ARRAY_TASK_COUNT (less _MIN, over _STEP)
  Slurm steps       SLURM_PROCID, SLURM_NTASKS
  Kubernetes        JOB_COMPLETION_INDEX, with --num-parts N or STRATA_NUM_PARTS=N
                    (an Indexed Job exposes no count: set it to the Job's completions)
A half-set or inconsistent launch is refused, naming the variables: RANK without
WORLD_SIZE, an empty variable, a Slurm array task running torchrun, --num-parts
against STRATA_NUM_PARTS.
A count of 1 is the whole input, written to OUT itself. The summary says which source
was used. A part that died is rerun, on any machine with the same backend and kernel
path, with the same command and --resume (which also starts a part that has nothing
yet). A chat template that renders the date (strftime_now) needs --chat-date in
every part. With --tp N one process drives a node's devices and the launcher's rank
is the data part.

MODELS: llama, mistral, qwen2, qwen3, the mixtures of experts qwen3_moe, mixtral,
glm4_moe (GLM-4.5/4.6) and minimax_m2,
deepseek_v2, deepseek_v3, kimi_k2, and Kimi-K2.5's kimi_k25 wrapper (its vision
tower is not read). Weights stay in
memory as stored, decoded per GEMM tile: f32, bf16, FP8 128x128 blocks
(DeepSeek-V3, Kimi-K2, MiniMax-M2) and compressed-tensors INT4 experts (Kimi-K2.5);
f16 weights are widened to f32.

Samples are packed into steps of --max-batch-tokens; longer samples are split
across steps (chunked prefill). The files do not depend on that setting.
An interrupted run (crash, kill -9, full disk) continues with --resume and ends
with the same files as an uninterrupted one. --resume checks that it continues
the same job: model config and weights (digest), capture points, dtype, shard
size, backend, --tp, kernel path, and that the head of the input is the one the
output was made from (ids, token counts and a digest of its bytes); a listed
file that is missing or truncated is redone. It deletes only files the run
wrote. --overwrite replaces an output of either format, old manifest first.
One run at a time may write a directory (a lock on OUT/.strata.lock).

NaN or Inf in the captured states (or values past the stored dtype's range)
stop the run, naming the sample and capture point; --on-nonfinite skip leaves
such samples out and lists them in the manifest's `skipped` (in the speculators
format such a sample has neither a table row nor a file: rows and hs_{i} stay in step).

BACKENDS: --backend cpu (default) runs the fast CPU kernels, with --tp ranks as
threads. --backend reference runs every op as a plain loop accumulating in f64,
on one thread and one rank: much slower, and the oracle the CPU backend is
tested against. Both agree with HF transformers to 1e-4 on every test fixture.
--backend cuda (a build with --features cuda) runs on NVIDIA GPUs, one rank
per GPU: --devices 0,1 --tp 2. It needs a CUDA driver; NVRTC compiles its
kernels on first use and caches them in ~/.cache/strata/kernels.

EXAMPLES:
  # The embedded demo model and data (no download):
  strata extract --out /tmp/strata-demo

  # A local HF checkpoint, EAGLE-3 layers, stored as bf16:
  strata extract --model ./Llama-3.1-8B --data tokens.jsonl --capture eagle3 \\
      --dtype bf16 --out ./hidden_states

  # Kimi-K2.5 as released (INT4 experts), EAGLE-3 layers, 8 tensor-parallel ranks:
  strata extract --model ./Kimi-K2.5 --data tokens.jsonl --tp 8 \
      --capture input:2,input:30,input:58,input:60 --out ./kimi-eagle3

  # Conversations (ShareGPT or OpenAI JSONL) into the speculators trainer's dataset:
  strata extract --model ./Qwen3-8B --data ultrachat.jsonl --capture eagle3 \\
      --format speculators --out ./qwen3-eagle3

  # Tokens from another program, through a pipe:
  tokenize.py corpus.txt | strata extract --model ./Llama-3.1-8B --data - --out ./hidden_states

  # Four processes side by side (torchrun sets RANK/WORLD_SIZE), then one dataset:
  torchrun --nproc-per-node 4 --no-python strata extract --model ./Llama-3.1-8B \\
      --data tokens.jsonl --dtype fp8 --format speculators --out ./hs --resume
  strata merge ./hs

  # Continue after an interruption, then check the result:
  strata extract --model ./Llama-3.1-8B --data tokens.jsonl --out ./hidden_states --resume
  strata verify ./hidden_states --recompute 20

  # The same job on the plain reference backend (slow; one rank), to cross-check:
  strata extract --model ./Llama-3.1-8B --data tokens.jsonl --backend reference --out ./ref";

const INSPECT_HELP: &str = "\
EXAMPLES:
  strata inspect ./hidden_states                    # native dataset: manifest + statistics
  strata inspect ./hidden_states --max-samples 100  # statistics over the first 100 samples
  strata inspect ./hidden_states/shard-00000.safetensors
  strata inspect ./spec_out                         # a directory of hs_{i}.safetensors";

const VERIFY_HELP: &str = "\
Checks shapes, dtypes, token counts, checksums and NaN/Inf of every sample, that
every shard is whole, and that the run finished. With --layout it also checks
the capture points, hidden size and dtype against a JSON file, e.g.
  {\"capture\": [\"input:2\", \"input:16\", \"input:29\", \"final\"], \"hidden_size\": 4096, \"dtype\": \"bf16\"}
or against another dataset's manifest.json: a CI guard against layout regressions.

With --recompute N it also runs N randomly chosen samples (--seed) through the
model again and reports, per capture point, the largest absolute and relative
difference |fresh - stored| / max(1, |stored|) from the stored states. The
model is the one the manifest names, or --model DIR; it runs on the CPU
backend in the dataset's compute dtype (or --compute), or on the plain
reference backend (f32) with --backend reference. The fresh states are
rounded to the stored dtype first, so a recompute on the backend, compute
dtype and --tp the dataset was written with is \"identical\". The run fails
(exit 1) where |fresh - stored| exceeds the stored dtype's last unit
(2^-7 |stored| for bf16, 2^-10 |stored| for f16, 0 for f32) plus what the
compute may change: 1e-4 max(1, |stored|) for f32, 1e-1 max(1, |stored|) when
either side computes in bf16 (that only tells rounding from other weights).
For MoE models recompute with the dataset's own --tp. No other check compares the states with the model: use it
when a draft trains badly, or after copying a dataset.

EXAMPLES:
  strata verify ./hidden_states
  strata verify ./hidden_states --layout expected-layout.json
  strata verify ./hidden_states --recompute 20 --seed 7
  strata verify ./hidden_states --recompute 5 --model ./Llama-3.1-8B --backend reference";

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

/// Progress on stderr: a bar on a terminal, a log line every 10 s otherwise.
/// The input is read once, as it streams, so progress is in bytes of input
/// (a pipe's length is unknown: then samples and tokens only).
struct Reporter {
    bar: Option<indicatif::ProgressBar>,
    last_line: Instant,
}

impl Reporter {
    fn new() -> Self {
        Reporter { bar: None, last_line: Instant::now() }
    }

    fn update(&mut self, p: &Progress, input: &InputProgress) {
        let secs = p.elapsed.as_secs_f64().max(1e-9);
        let tps = p.tokens as f64 / secs;
        let done = p.resumed + p.samples;
        if std::io::stderr().is_terminal() {
            let bar = self.bar.get_or_insert_with(|| {
                let (b, template) = match input.total {
                    Some(n) => (
                        indicatif::ProgressBar::new(n),
                        "{bar:40.cyan/blue} {percent}% of input  {msg}  elapsed {elapsed_precise}  eta {eta}",
                    ),
                    None => (indicatif::ProgressBar::new_spinner(), "{spinner} {msg}  elapsed {elapsed_precise}"),
                };
                b.set_style(indicatif::ProgressStyle::with_template(template).expect("valid template"));
                b
            });
            bar.set_position(input.read);
            bar.set_message(format!("{done} samples, {tps:.0} tokens/s"));
        } else if self.last_line.elapsed() >= Duration::from_secs(10) {
            self.last_line = Instant::now();
            let of = match input.total {
                Some(n) if n > 0 => format!(" ({:.1}% of the input)", 100.0 * input.read as f64 / n as f64),
                _ => String::new(),
            };
            eprintln!("progress: {done} samples{of}, {} tokens, {tps:.0} tokens/s", p.tokens);
        }
    }
}

fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: f64 = status.lines().find(|l| l.starts_with("VmHWM:"))?.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

fn print_summary(s: &Summary, out: &std::path::Path) {
    let r = &s.report;
    let p = &r.progress;
    let secs = p.elapsed.as_secs_f64().max(1e-9);
    let points: Vec<String> = s.points.iter().map(|p| p.to_string()).collect();
    say!("wrote {} samples ({} tokens) to {}", p.samples, p.tokens, out.display());
    if p.resumed > 0 {
        say!("  resumed     {} samples were already written", p.resumed);
    }
    if s.skipped > 0 {
        say!("  skipped     {} samples with NaN or Inf states (listed in the manifest's `skipped`)", s.skipped);
    }
    if let Some(part) = &s.part {
        say!(
            "  part        {} of {} (from {}): input lines {}.., bytes {}..{} of {}; `strata merge` joins the parts",
            part.index,
            part.count,
            part.source,
            part.first_line,
            part.start,
            part.end,
            part.input_bytes
        );
    }
    print_prepare(s);
    say!("  capture     {} ({})", points.join(","), s.dtype.map_or("?".into(), |d| d.to_string()));
    say!("  bytes       {}", r.bytes);
    if s.dtype == Some(DType::F8E4M3) {
        say!(
            "  fp8         e4m3 codes with hidden_states_scales (one per token and capture point); the speculators \
             trainer must read them with its FP8 hidden-states backend (--hidden-states-backend fp8): its default \
             reader does not dequantise and fails on them"
        );
    }
    say!("  weights     {:.1} MiB in memory ({})", s.weight_bytes as f64 / (1 << 20) as f64, s.weight_storage);
    if s.state_bytes > 0 {
        say!(
            "  state       {:.2} MiB per sample split across steps (Gated DeltaNet conv and recurrent state)",
            s.state_bytes as f64 / (1 << 20) as f64
        );
    }
    say!("  throughput  {:.0} tokens/s over {:.2}s ({} steps)", p.tokens as f64 / secs, secs, r.steps);
    say!(
        "  stages      load {:.2}s, read {:.2}s, forward {:.2}s, gather {:.2}s, write {:.2}s",
        s.load_time.as_secs_f64(),
        r.schedule_time.as_secs_f64(),
        r.forward_time.as_secs_f64(),
        r.gather_time.as_secs_f64(),
        r.write_time.as_secs_f64()
    );
    if let Some(m) = peak_rss_mib() {
        say!("  peak memory {m:.0} MiB");
    }
    print_trainer_flags(s);
}

/// Speculators format: the trainer's flags for this output, or why it cannot read it.
fn print_trainer_flags(s: &Summary) {
    let Some(ids) = &s.target_layer_ids else { return };
    match ids {
        Ok(ids) => {
            let list: Vec<String> = ids.iter().map(usize::to_string).collect();
            let vocab = match s.draft_vocab_sizes.as_slice() {
                [] => String::new(),
                [n] => format!(" --draft-vocab-size {n}"),
                _ => " --draft-vocab-size N".into(),
            };
            let fp8 = if s.dtype == Some(DType::F8E4M3) { " --hidden-states-backend fp8" } else { "" };
            say!("  trainer     speculators train --target-layer-ids {}{vocab}{fp8} ...", list.join(" "));
            if !s.draft_vocab_sizes.is_empty() {
                say!(
                    "  vocab       token_freq.pt, and d2t-N.npy and t2d-N.npy for N = {}: the trainer loads them",
                    s.draft_vocab_sizes.iter().map(usize::to_string).collect::<Vec<_>>().join(", ")
                );
            }
            if ids.len() != 3 {
                say!(
                    "  note        EAGLE-3 drafts read three layers besides the final one; this capture gives {}, \
                     so a draft trained on it takes these {} ids",
                    ids.len(),
                    ids.len()
                );
            }
        }
        Err(why) => say!("  trainer     the speculators trainer cannot read this capture: {why}"),
    }
}

/// What preparing the input did: rows of each kind, skips, errors, cuts.
fn print_prepare(s: &Summary) {
    let p = &s.prepare;
    if p.conversations > 0 {
        say!(
            "  input       {} conversations ({}): {} rows of a whole conversation, {} of one turn; {} tokens \
             saved against one row per turn",
            p.conversations,
            s.input_format.name(),
            p.rows_per_conversation,
            p.rows_per_turn,
            p.saved_tokens
        );
        if let Some(t) = &s.chat_template {
            let date = s.chat_date.map_or(String::new(), |d| format!(", dates render as {d}"));
            say!("  template    {t}{date}");
        }
    } else if p.records > 0 {
        say!("  input       {} records ({})", p.records, s.input_format.name());
    }
    if p.skipped_empty + p.skipped_no_assistant > 0 {
        say!(
            "  skipped     {} empty conversations, {} without an assistant turn",
            p.skipped_empty,
            p.skipped_no_assistant
        );
    }
    if p.errors > 0 {
        say!("  errors      {} records could not be rendered or tokenized and were left out:", p.errors);
        for e in &p.first_errors {
            say!("                {e}");
        }
    }
    if p.long_prompts + p.truncated + p.skipped_long > 0 {
        say!(
            "  limit       {} rows cut, {} rows left out as too long, {} turns left out (prompt alone fills the limit)",
            p.truncated,
            p.skipped_long,
            p.long_prompts
        );
    }
    if !p.unknown_roles.is_empty() {
        let more = p.unknown_role_count - p.unknown_roles.len();
        let more = if more > 0 { format!(" and {more} more") } else { String::new() };
        say!("  roles       counted as assistant: {}{more}", p.unknown_roles.join(", "));
    }
}

impl ModelArgs {
    /// The model request these flags make, checked; GPUs from the launcher when --devices is not given.
    fn request(&self) -> anyhow::Result<ModelRequest> {
        strata::backend::cpu::bf16::kernel_override().map_err(anyhow::Error::msg)?;
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
        mode: if a.resume {
            OpenMode::Resume
        } else if a.overwrite {
            OpenMode::Overwrite
        } else {
            OpenMode::Create
        },
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
    use strata::serve::Event;
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
        api_key: a.api_key.clone().and_then(strata::serve::ApiKey::new),
        shutdown_grace: a.shutdown_grace,
        max_connections: a.max_connections,
        header_timeout: Duration::from_secs(10),
    };
    if a.run.on_nonfinite == OnNonFinite::Skip {
        eprintln!("note: a served prompt whose states hold NaN or Inf gets a 500 either way (--on-nonfinite skip has nothing to skip)");
    }
    let mut addr = None;
    if a.api_key.as_deref() == Some("") {
        anyhow::bail!("--api-key (or STRATA_API_KEY) is empty: an empty key would let every request through");
    }
    strata::serve::serve(opts, |event| match event {
        Event::Warning(w) => eprintln!("warning: {w}"),
        Event::Listening(at) => {
            addr = Some(at);
            say!("listening on http://{at} (GET /health answers 503 until the model is loaded)");
        }
        Event::Ready(r) => {
            let at = addr.map_or("HOST:PORT".into(), |a| a.to_string());
            let points: Vec<String> = r.points.iter().map(|p| p.to_string()).collect();
            let ids = |v: &[usize]| v.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(" ");
            let fp8 = if r.dtype == DType::F8E4M3 { " --hidden-states-backend fp8" } else { "" };
            say!(
                "serving {:?} on http://{at}/v1 ({} backend, {} compute, loaded in {:.1}s)",
                r.served_model_name,
                r.backend,
                r.compute,
                r.load_time.as_secs_f64()
            );
            say!(
                "  capture     {} ({}), files [T, {}, H] in {}",
                points.join(","),
                r.dtype,
                r.points.len(),
                r.states_dir.display()
            );
            say!(
                "  layer ids   {} (input:K is id K; the last, {}, is final: the trainer's verifier_last_hidden_states)",
                ids(&r.layer_ids),
                r.layer_ids.last().copied().unwrap_or(0)
            );
            say!(
                "  trainer     --target-layer-ids {} : the ids before the final one, in this order. Nothing in the \
                 protocol checks them: other ids train silently on the wrong states",
                ids(&r.target_layer_ids)
            );
            say!(
                "  command     speculators train --verifier-name-or-path {} --vllm-endpoint http://{at}/v1 \
                 --on-missing generate --target-layer-ids {}{fp8} --data-path DIR",
                shell_quote(&r.served_model_name),
                ids(&r.target_layer_ids)
            );
            say!("  prompts     at most {} tokens", r.max_tokens);
            if r.state_bytes > 0 {
                say!(
                    "  state       {:.2} MiB per request split across steps (Gated DeltaNet conv and recurrent state)",
                    r.state_bytes as f64 / (1 << 20) as f64
                );
            }
            if let Some(why) = &r.no_chat {
                say!("  chat        /v1/chat/completions is off: {why}");
            }
        }
        Event::Progress(p) => {
            if p.served + p.errors + p.steps > 0 || p.queued > 0 {
                eprintln!(
                    "served {} requests ({} tokens) in {:.0}s: {:.0} tokens/s; {} steps, {:.0}% full; queue {}; \
                     pending {} files ({:.1} MiB); {} errors",
                    p.served,
                    p.tokens,
                    p.secs,
                    p.tokens as f64 / p.secs.max(1e-9),
                    p.steps,
                    100.0 * p.fill,
                    p.queued,
                    p.pending.0,
                    p.pending.1 as f64 / (1 << 20) as f64,
                    p.errors
                );
            }
        }
        Event::Stopping => {
            eprintln!("stopping: no new requests; those in a forward step finish within --shutdown-grace")
        }
        Event::Stopped { abandoned } => {
            eprintln!("stopped ({abandoned} requests still in a step were answered 503; their files are removed)")
        }
    })
    .with_context(|| format!("strata serve failed (model {name})"))
}

/// `s` as a shell word.
fn shell_quote(s: &str) -> String {
    if !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_./:@+=".contains(c)) {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

fn merge(dir: &std::path::Path, data: Option<&std::path::Path>) -> anyhow::Result<()> {
    use strata::sink::merge::InputCheck;
    let r = strata::sink::merge::merge(dir, data).with_context(|| format!("strata merge {}", dir.display()))?;
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
    strata::backend::cpu::bf16::kernel_override().map_err(anyhow::Error::msg)?;
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
