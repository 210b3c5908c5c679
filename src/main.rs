//! The `strata` command line.

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use std::path::PathBuf;
use std::process::ExitCode;
use strata::extract::{ExtractJob, Format};
use strata::shape::DType;

#[derive(Parser)]
#[command(name = "strata", version, about = "Shape-verified hidden-state extraction from transformer LLMs")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a model over token samples and write the hidden states of chosen capture points.
    #[command(after_long_help = EXTRACT_HELP)]
    Extract(ExtractArgs),
}

const EXTRACT_HELP: &str = "\
CAPTURE POINTS (each defined against HF output_hidden_states `hs`, N layers):
  embeddings   token embeddings                      hs[0]
  input:K      residual stream entering layer K      hs[K]    (vLLM's aux layer K)
  output:K     HF's entry after layer K              hs[K+1]  (SGLang/SpecForge layer K)
  final        residual after the last layer, before the final norm
  final-norm   after the final norm (what the LM head reads)  hs[N]
  eagle3       input:2, input:N/2, input:N-3, final

OUTPUT (--format speculators):
  OUT/hs_{i}.safetensors for the i-th sample (0-based, blank lines skipped), holding
  token_ids (I64 [T]) and hidden_states ([T, L, H], layers in --capture order).

EXAMPLES:
  # The embedded demo model and data (no download):
  strata extract --out /tmp/strata-demo

  # A local HF checkpoint, EAGLE-3 layers, stored as bf16:
  strata extract --model ./Llama-3.1-8B --data tokens.jsonl --capture eagle3 \\
      --dtype bf16 --out ./hidden_states

  # data.jsonl holds one sample per line:
  {\"input_ids\": [128000, 9906, 1917]}";

#[derive(Clone, Copy, ValueEnum)]
enum DTypeArg {
    F32,
    Bf16,
    F16,
}

#[derive(Clone, Copy, ValueEnum)]
enum FormatArg {
    /// Per-sample hs_{i}.safetensors with token_ids [T] and hidden_states [T, L, H].
    Speculators,
}

#[derive(clap::Args)]
struct ExtractArgs {
    /// HF checkpoint directory (config.json + *.safetensors). Default: the embedded demo model.
    #[arg(long, value_name = "DIR")]
    model: Option<PathBuf>,
    /// JSON Lines file, one {"input_ids": [...]} per line. Default: the embedded demo data.
    #[arg(long, value_name = "FILE.jsonl")]
    data: Option<PathBuf>,
    /// Comma list of capture points (see below), in output order.
    #[arg(long, value_name = "LIST", default_value = "eagle3")]
    capture: String,
    /// Output directory (created if missing; must be empty unless --overwrite).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// Storage dtype of hidden states. Default: the checkpoint's dtype.
    #[arg(long, value_enum)]
    dtype: Option<DTypeArg>,
    /// Output format.
    #[arg(long, value_enum, default_value = "speculators")]
    format: FormatArg,
    /// Token budget of one forward step; a longer sample runs on its own.
    #[arg(long, value_name = "N", default_value_t = 8192)]
    max_batch_tokens: usize,
    /// Replace hs_*.safetensors files left in --out by an earlier run.
    #[arg(long)]
    overwrite: bool,
}

fn extract(a: ExtractArgs) -> anyhow::Result<()> {
    if a.max_batch_tokens == 0 {
        anyhow::bail!("--max-batch-tokens must be at least 1");
    }
    let job = ExtractJob {
        model: a.model.clone(),
        data: a.data,
        capture: a.capture,
        out: a.out.clone(),
        dtype: a.dtype.map(|d| match d {
            DTypeArg::F32 => DType::F32,
            DTypeArg::Bf16 => DType::BF16,
            DTypeArg::F16 => DType::F16,
        }),
        format: match a.format {
            FormatArg::Speculators => Format::Speculators,
        },
        max_batch_tokens: a.max_batch_tokens,
        overwrite: a.overwrite,
    };
    let model = a.model.as_ref().map_or("<embedded llama-default>".into(), |p| p.display().to_string());
    let s = job.run().with_context(|| format!("strata extract failed (model {model})"))?;
    let secs = s.forward_time.as_secs_f64().max(1e-9);
    let points: Vec<String> = s.points.iter().map(|p| p.to_string()).collect();
    println!("wrote {} samples ({} tokens) to {}", s.samples, s.tokens, a.out.display());
    println!("  capture   {} ({})", points.join(","), s.dtype.map_or("?".into(), |d| d.to_string()));
    println!("  bytes     {}", s.bytes);
    println!(
        "  time      load {:.2}s, forward {:.2}s ({:.0} tokens/s, {} steps), write {:.2}s",
        s.load_time.as_secs_f64(),
        secs,
        s.tokens as f64 / secs,
        s.batches,
        s.write_time.as_secs_f64()
    );
    Ok(())
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Extract(a) => extract(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
