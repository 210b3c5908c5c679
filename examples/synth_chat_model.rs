//! Writes a small random-weight Llama with the chat fixtures' tokenizer and
//! ChatML template: a model directory that `strata extract` runs
//! conversations through without downloads.
//!
//!     cargo run --example synth_chat_model -- /tmp/chat-model

use strata_testkit::{write_llama, LlamaSpec};

fn main() -> std::io::Result<()> {
    let dir = std::path::PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| "/tmp/strata-chat-model".into()));
    std::fs::create_dir_all(&dir)?;
    let spec = LlamaSpec {
        hidden_size: 64,
        num_layers: 4,
        num_heads: 4,
        num_kv_heads: 2,
        intermediate_size: 128,
        vocab_size: 512,
    };
    write_llama(&dir, &spec, strata::shape::DType::BF16, 7)?;
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat");
    std::fs::copy(fixtures.join("tokenizer.json"), dir.join("tokenizer.json"))?;
    std::fs::copy(fixtures.join("tokenizer_config.json"), dir.join("tokenizer_config.json"))?;
    std::fs::copy(fixtures.join("templates/chatml.jinja"), dir.join("chat_template.jinja"))?;
    println!("{}", dir.display());
    Ok(())
}
