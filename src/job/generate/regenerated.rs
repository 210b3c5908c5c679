//! `OUT/regenerated.jsonl`: one line per generation, in the layout
//! `speculators regenerate-responses` (0.9) writes, so that its downstream
//! steps (`speculators prepare-data`) read it. Written at the end of a run
//! from the dataset itself, read back in order: a resumed or merged run
//! writes what an uninterrupted one does.

use super::GenerateError;
use crate::format::manifest::{Entry, FinishReason, Manifest};
use crate::sink::SinkError;
use std::io::Write;
use std::path::Path;

/// The file's name.
pub const REGENERATED: &str = "regenerated.jsonl";

/// A row's generations: the spans of loss-mask ones, as `(start, end)`.
fn spans(mask: &[u8]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut start = None;
    for (i, &m) in mask.iter().chain(std::iter::once(&0)).enumerate() {
        match (m == 1, start) {
            (true, None) => start = Some(i),
            (false, Some(s)) => {
                out.push((s, i));
                start = None;
            }
            _ => {}
        }
    }
    out
}

/// `{primary_id}_gen{k}` split; an id without the suffix is its own primary id, generation 0.
fn split_id(id: &str) -> (&str, usize) {
    match id.rsplit_once("_gen") {
        Some((p, k)) if !k.is_empty() && k.bytes().all(|b| b.is_ascii_digit()) => (p, k.parse().unwrap_or(0)),
        _ => (id, 0),
    }
}

/// Writes `OUT/regenerated.jsonl` from the finished dataset in `out`: per
/// generation (a row merged by `--rows auto` holds several) `id`
/// (`{primary_id}_gen{k}`), `primary_id`, `input_ids` and `loss_mask` (the
/// row up to the generation's end, ones on it alone), `text` (decoded with
/// special tokens kept; absent without a tokenizer) and `metadata` (`idx`,
/// `finish_reason`, `is_tool_call`, `usage`, `endpoint`, `sampling_params`
/// with the seed). Written under a temporary name and renamed.
pub fn write(out: &Path, tokenizer: Option<&crate::chat::Tokenizer>) -> Result<usize, GenerateError> {
    let io = |p: &Path| {
        let path = p.display().to_string();
        move |cause| GenerateError::Sink(SinkError::Io { path, cause })
    };
    let dir = crate::files::Dir::open(out).map_err(io(out))?;
    // The shards' files, then the samples in order (the manifest lists them so).
    let mut files: Vec<String> = Vec::new();
    let mut samples = Vec::new();
    let m = Manifest::read_each(&dir, &mut |e| {
        match e {
            Entry::Shard(s) => files.push(s.file),
            Entry::Sample(s) => samples.push(s),
            Entry::Skipped(_) => {}
        }
        Ok::<(), std::convert::Infallible>(())
    })?;
    let g = m.generation.clone().unwrap_or_default();
    // A part's indices count from its first record: `idx` is the whole input's.
    let first_record = m.part.as_ref().map_or(0, |p| p.first_record);
    let sampling = serde_json::json!({
        "temperature": g.temperature, "top_p": g.top_p, "top_k": g.top_k, "min_p": g.min_p,
        "repetition_penalty": g.repetition_penalty, "presence_penalty": g.presence_penalty,
        "frequency_penalty": g.frequency_penalty, "max_tokens": g.max_tokens, "seed": g.seed,
        "stop_token_ids": g.stop_token_ids, "ignore_eos": g.ignore_eos,
    });
    replace(&dir, |w, tmp| {
        let mut lines = 0;
        for (i, s) in samples.iter().enumerate() {
            let file = files.get(s.shard).ok_or_else(|| {
                SinkError::Directory(format!("{}: sample {i} names file {} of {}", out.display(), s.shard, files.len()))
            })?;
            let path = out.join(file);
            let f = crate::format::MappedFile::open(&path).map_err(SinkError::from)?;
            let tensor = |name: &str| {
                f.tensors.get(name).map(|e| f.bytes(e)).ok_or_else(|| {
                    GenerateError::Sink(SinkError::Directory(format!("{}: no tensor {name}", path.display())))
                })
            };
            let ids: Vec<u32> = tensor("token_ids")?
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().expect("8")) as u32)
                .collect();
            let mask: Vec<u8> = tensor("loss_mask")?.to_vec();
            let spans = spans(&mask);
            let (primary, last) = split_id(&s.id);
            for (k, &(start, end)) in spans.iter().enumerate() {
                let generation = (last + 1 + k).saturating_sub(spans.len());
                let finish = s.finish.get(k).copied().unwrap_or_else(|| {
                    // A row written before finish reasons were recorded: its last token says.
                    if ids[end - 1..end].iter().any(|t| g.stop_token_ids.contains(t)) {
                        FinishReason::Stop
                    } else {
                        FinishReason::Length
                    }
                });
                let mut one = vec![0u8; end];
                one[start..end].fill(1);
                let mut line = serde_json::Map::new();
                line.insert("id".into(), format!("{primary}_gen{generation}").into());
                line.insert("primary_id".into(), primary.into());
                line.insert("input_ids".into(), ids[..end].into());
                line.insert("loss_mask".into(), one.into());
                match tokenizer.map(|t| t.decode(&ids[..end])) {
                    Some(Ok(text)) => {
                        line.insert("text".into(), text.into());
                    }
                    Some(Err(e)) => tracing::warn!("regenerated.jsonl, row {i}: no text ({e})"),
                    None => {}
                }
                line.insert(
                    "metadata".into(),
                    serde_json::json!({
                        "idx": s.index.unwrap_or(i) + first_record,
                        "finish_reason": finish.as_str(),
                        "is_tool_call": finish == FinishReason::ToolCalls,
                        "usage": {"prompt_tokens": start, "completion_tokens": end - start, "total_tokens": end},
                        "endpoint": "strata generate",
                        "sampling_params": sampling,
                    }),
                );
                serde_json::to_writer(&mut *w, &line).map_err(|e| io(tmp)(e.into()))?;
                w.write_all(b"\n").map_err(io(tmp))?;
                lines += 1;
            }
        }
        Ok(lines)
    })
}

/// Writes `regenerated.jsonl` in `dir` through `fill` (given the writer and
/// the temporary file's path, for messages; it returns the lines written):
/// under a temporary name, flushed and synced, then renamed in. A failure
/// removes the temporary file and leaves any earlier file as it was.
fn replace(
    dir: &crate::files::Dir,
    fill: impl FnOnce(&mut std::io::BufWriter<std::fs::File>, &Path) -> Result<usize, GenerateError>,
) -> Result<usize, GenerateError> {
    let io = |p: &Path| {
        let path = p.display().to_string();
        move |cause| GenerateError::Sink(SinkError::Io { path, cause })
    };
    let tmp = format!(".{REGENERATED}.{}.tmp", std::process::id());
    let path = dir.join(&tmp);
    // A killed run's temporary file of the same name (PIDs repeat in containers).
    let _ = dir.remove(&tmp);
    let file = dir.create_new(&tmp).map_err(io(&path))?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
    let filled = fill(&mut w, &path).and_then(|n| {
        w.flush().map_err(io(&path))?;
        w.get_ref().sync_all().map_err(io(&path))?;
        Ok(n)
    });
    let n = match filled {
        Ok(n) => n,
        Err(e) => {
            let _ = dir.remove(&tmp);
            return Err(e);
        }
    };
    dir.rename(&tmp, dir, REGENERATED).map_err(io(&dir.join(REGENERATED)))?;
    dir.sync();
    Ok(n)
}

/// After `strata merge`: `OUT/regenerated.jsonl` as the parts' files one
/// after another (each line already names its record by the whole input's
/// index), written under a temporary name and renamed. `None` when `out`
/// is not a merged `strata generate` output.
pub fn join_parts(out: &Path) -> Result<Option<usize>, GenerateError> {
    let io = |p: &Path| {
        let path = p.display().to_string();
        move |cause| GenerateError::Sink(SinkError::Io { path, cause })
    };
    let dir = crate::files::Dir::open(out).map_err(io(out))?;
    let m = Manifest::read_each(&dir, &mut |_| Ok::<(), std::convert::Infallible>(()))?;
    if m.generation.is_none() || m.merged.is_empty() {
        return Ok(None);
    }
    replace(&dir, |w, tmp| {
        let mut lines = 0;
        for p in &m.merged {
            let part = crate::files::Dir::open(&out.join(&p.dir)).map_err(io(&out.join(&p.dir)))?;
            let path = out.join(&p.dir).join(REGENERATED);
            let mut f = part.open_file(REGENERATED).map_err(io(&path))?;
            // Streamed in pieces: a part's file may be larger than memory.
            let mut buf = vec![0u8; 1 << 20];
            loop {
                let n = std::io::Read::read(&mut f, &mut buf).map_err(io(&path))?;
                if n == 0 {
                    break;
                }
                lines += buf[..n].iter().filter(|&&b| b == b'\n').count();
                w.write_all(&buf[..n]).map_err(io(tmp))?;
            }
        }
        Ok(lines)
    })
    .map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_and_ids_split_a_merged_row_into_its_generations() {
        assert_eq!(spans(&[0, 0, 1, 1, 0, 1]), vec![(2, 4), (5, 6)]);
        assert_eq!(spans(&[0, 0]), vec![]);
        assert_eq!(split_id("conv_7_gen12"), ("conv_7", 12));
        assert_eq!(split_id("a_gen"), ("a_gen", 0));
        assert_eq!(split_id("plain"), ("plain", 0));
    }
}
