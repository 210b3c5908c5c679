//! The long help of each subcommand (`strata extract --help` and kin).

pub const GENERATE_HELP: &str = "\
On-policy regeneration in one pass: the target model writes its own response to each
prompt, and the hidden states of every token of the row (prompt and response) are
captured as they are computed, into the speculators trainer's dataset directory (the
one `strata extract --format speculators` writes).

INPUT: JSON Lines. Conversations ({\"messages\": [...]} or {\"conversations\": [...]}, with
\"tools\"; or {\"prompt\": \"...\"}) are regenerated as `speculators regenerate-responses`
(0.9) regenerates them against vLLM: system and user turns drive it, assistant turns are
dropped and regenerated, a row per generation. The history holds each reply's content
as vLLM returns it (special tokens skipped, the stop token dropped, reasoning split off
with --reasoning-parser); a generated tool call (--tool-call-parser hermes) is answered
with the row's next cached tool message. A conversation stops, its rows kept, when
prompt + completion pass --max-tokens (a turn cut by max_tokens always does), on a
parallel call, a call for another tool than the cached result names, or no result left.
A turn continues the previous turn's cache: the tokens its prompt shares with the last
row are not prefilled again (hybrid Gated DeltaNet models: only a whole previous row).
Text prompts ({\"text\": ...}) and token-id prompts ({\"input_ids\": [...]}) give one
generation each.

ROWS: input_ids = the prompt's tokens + the tokens drawn (a stop token included);
loss_mask 0 on the prompt, 1 on the response. Generated text is never re-tokenized.
hidden_states/hs_{i}.safetensors holds every row token's states, the last token fed
once more so that it has them too. --rows auto merges a conversation's row into the next
where it is that row's token prefix. regenerated.jsonl holds a line per generation as
`speculators regenerate-responses` writes it (id {primary_id}_gen{k}, primary_id,
input_ids, loss_mask, text when the model has a tokenizer, metadata).

ONE PASS EQUALS TWO: on the cpu and reference backends a row's file is byte for byte the
one `strata extract --format speculators` writes for the same ids, and the tokens do not
depend on --max-batch-tokens, --max-num-seqs or --kv-cache-memory: each draw depends only
on (seed, record, generation, position), through a counter-based generator. The cuda
backend has not been measured on a GPU.

SAMPLING: vLLM 0.19.1's V1 sampler, in its order: penalties, temperature (0 is greedy),
min-p, top-k, top-p. Defaults come from the checkpoint's generation_config.json as vLLM's
--generation-config auto takes them (temperature, top_k, top_p, min_p, repetition_penalty,
max_new_tokens, cut to the room a prompt leaves); its eos_token_id (else config.json's) and
the tokenizer's EOS are stop ids unless --ignore-eos. --no-generation-config turns the
sampling defaults off. A value out of range is refused with vLLM's message.

LEFT OUT: a record with ids outside the vocabulary, a prompt that leaves no position, an
explicit --max-tokens the prompt leaves no room for, one whose cache cannot fit
--kv-cache-memory, a conversation with no user turn, one the template cannot render a
generation prompt for, one with tools but no --tool-call-parser, or one whose reply is
wholly empty (the tool fails it) is left out by name (in the manifest), its rows
with it, and the run goes on.

MEMORY: --kv-cache-memory bounds the cache of the sequences in flight: a sequence enters
when its prompt and its longest response fit (the cost per position is measured on the
model at start), and waits otherwise; nothing is preempted.

PARTS: --part-index I --num-parts N write OUT/part-IIII-of-NNNN/; `strata merge OUT` joins
them and their regenerated.jsonl into the bytes of one run. --no-states writes the rows
only (for online training); --draft-vocab-size N counts the generated tokens.

RESUME: --resume keeps the rows an interrupted run wrote, reads their records again
(checked to be the same input), and draws with the seed the output recorded: on the cpu
and reference backends the rows that follow are those an uninterrupted run writes (on
cuda a step's batch can change the last bits, and so a token).

EXAMPLES:
  strata generate --model DIR --data prompts.jsonl --out regen --temperature 0.7 \\
      --max-tokens 2048 --seed 1 --kv-cache-memory 8GiB";

pub const MERGE_HELP: &str = "\
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

pub const SERVE_HELP: &str = "\
The speculators trainer trains online against a vLLM server by default (--on-missing
generate): for each sample it has no file for, it sends the token ids to
POST /v1/completions (max_tokens 1), loads the safetensors file named in the reply's
kv_transfer_params.hidden_states_path, checks it and deletes it. strata serve is
that server. Each file is the one `strata extract --format speculators` writes for
the same ids (token_ids, loss_mask of ones, hidden_states [T, L, H]), byte for byte
on the cpu and reference backends, whatever else shared its forward step.

ROUTES: GET /health (200 once loaded), GET /v1/models, POST /v1/completions (token
ids, or text with the model's tokenizer), POST /v1/chat/completions (text parts,
rendered with the chat template), GET /metrics (Prometheus).

GENERATION: a request with max_tokens other than 1 generates (not streamed), on the
engine of `strata generate`, in the same steps as the trainer's prompts: temperature,
top_p, top_k, min_p, seed, repetition/presence/frequency_penalty, stop_token_ids,
ignore_eos, skip_special_tokens and return_token_ids as vLLM applies them, defaults
from generation_config.json; completions default to 16 tokens, chat to the room the
prompt leaves. It writes no file unless kv_transfer_params.include_output_tokens is
true: then the states of prompt_token_ids + token_ids[:-1] (vLLM's contract), the
bytes `strata extract` writes for those ids. Fields that would change the reply and are not
applied (stop strings, logprobs, logit_bias, structured output, n > 1, stream, a
required or named tool_choice) get a 400 naming them. Chat requests take
chat_template_kwargs and reasoning_effort; with tools, --tool-call-parser hermes
reads the reply's calls into message.tool_calls (finish_reason tool_calls), and
--reasoning-parser qwen3|deepseek_r1 splits off message.reasoning (also as
reasoning_content). The model's LM head is loaded for it (a checkpoint without one
serves max_tokens 1 only).

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

pub const EXTRACT_HELP: &str = "\
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

pub const INSPECT_HELP: &str = "\
EXAMPLES:
  strata inspect ./hidden_states                    # native dataset: manifest + statistics
  strata inspect ./hidden_states --max-samples 100  # statistics over the first 100 samples
  strata inspect ./hidden_states/shard-00000.safetensors
  strata inspect ./spec_out                         # a directory of hs_{i}.safetensors";

pub const VERIFY_HELP: &str = "\
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
