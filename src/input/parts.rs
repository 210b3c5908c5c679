//! Data parts: one input split across processes that a cluster launcher
//! started (Slurm, torchrun, Kubernetes Indexed Jobs), each process writing
//! its own part of the output. The part comes from `--part-index/--num-parts`
//! or from the launcher's own environment; the split is contiguous, balanced
//! by bytes of input (a proxy for tokens that needs no tokenizing), and the
//! same in every process, so the parts concatenated in order are the input.

use crate::format::parts::{dir_name, PartInfo, MAX_PARTS};
use std::io::{Read, Seek, SeekFrom};

/// Which part of the input this process handles, and who said so.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PartSpec {
    /// 0-based part index.
    pub index: usize,
    /// Number of parts.
    pub count: usize,
    /// Where the index and count came from (the flags or the variables read).
    pub source: String,
}

impl PartSpec {
    /// The part's output directory, inside `--out`: `part-0003-of-0016`.
    pub fn dir_name(&self) -> String {
        dir_name(self.index, self.count)
    }
}

/// The environment variable a Kubernetes Indexed Job (which exposes no count) sets for the count.
pub const NUM_PARTS_VAR: &str = "STRATA_NUM_PARTS";

/// Works out this process's part from the flags, else from the launcher's
/// environment (`env` reads a variable). The flags win. Then torchrun
/// (`RANK`/`WORLD_SIZE`: they describe this very process, so they win over
/// a Slurm allocation they run inside, and must agree with it), Slurm job
/// arrays, Slurm steps (`SLURM_PROCID`/`SLURM_NTASKS`), Kubernetes Indexed
/// Jobs (`JOB_COMPLETION_INDEX`, with `--num-parts` or `STRATA_NUM_PARTS`).
/// What is half-set or inconsistent is refused, naming every variable
/// involved. `None`: one process does the whole input.
pub fn resolve(
    part_index: Option<usize>,
    num_parts: Option<usize>,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Option<PartSpec>, String> {
    let spec = match (part_index, num_parts) {
        (Some(_), None) => return Err("--part-index needs --num-parts".into()),
        (Some(index), Some(count)) => PartSpec { index, count, source: "--part-index/--num-parts".into() },
        (None, count) => match from_env(&env, count)? {
            Some(s) => s,
            None if count.is_some() => {
                return Err(format!(
                    "--num-parts is given but no part index: pass --part-index, or run under a launcher that sets \
                     one (SLURM_ARRAY_TASK_ID, SLURM_PROCID, RANK or JOB_COMPLETION_INDEX); {NUM_PARTS_VAR} \
                     may stand for --num-parts"
                ))
            }
            None => return Ok(None),
        },
    };
    if spec.count == 0 || spec.count > MAX_PARTS {
        return Err(format!(
            "the number of parts is {} (from {}); it must be 1 to {MAX_PARTS}",
            spec.count, spec.source
        ));
    }
    if spec.index >= spec.count {
        return Err(format!("part index {} is not below the {} parts (from {})", spec.index, spec.count, spec.source));
    }
    // One part is the whole input: no part directory.
    Ok((spec.count > 1).then_some(spec))
}

/// The launcher variables read, by name: set and non-empty, or absent.
struct Vars<'a, E: Fn(&str) -> Option<String>> {
    env: &'a E,
}

impl<E: Fn(&str) -> Option<String>> Vars<'_, E> {
    /// A variable's number; an empty or non-numeric value is an error naming it.
    fn num(&self, name: &str) -> Result<Option<usize>, String> {
        match (self.env)(name) {
            None => Ok(None),
            Some(v) if v.trim().is_empty() => {
                Err(format!("{name} is set but empty: unset it, or give it the launcher's value"))
            }
            Some(v) => {
                v.trim().parse::<usize>().map(Some).map_err(|_| format!("{name}={v:?} is not a non-negative integer"))
            }
        }
    }
}

fn from_env(env: &impl Fn(&str) -> Option<String>, flag_count: Option<usize>) -> Result<Option<PartSpec>, String> {
    let v = Vars { env };
    // The count from the flag wins over the environment's, but they must agree.
    let count = |found: usize, from: &str| -> Result<usize, String> {
        match flag_count {
            Some(c) if c != found => {
                Err(format!("--num-parts {c} disagrees with {from}={found}; drop --num-parts or fix the launch"))
            }
            _ => Ok(found),
        }
    };
    let (rank, world) = (v.num("RANK")?, v.num("WORLD_SIZE")?);
    let (array_id, array_count) = (v.num("SLURM_ARRAY_TASK_ID")?, v.num("SLURM_ARRAY_TASK_COUNT")?);
    let (procid, ntasks) = (v.num("SLURM_PROCID")?, v.num("SLURM_NTASKS")?);
    match (rank, world) {
        (Some(r), None) => return Err(format!("RANK={r} is set without WORLD_SIZE: a launcher sets both, or neither")),
        (None, Some(w)) => return Err(format!("WORLD_SIZE={w} is set without RANK: a launcher sets both, or neither")),
        _ => {}
    }
    if let (Some(rank), Some(world)) = (rank, world) {
        // torchrun (or any launcher that sets RANK/WORLD_SIZE) describes this process.
        if let Some(id) = array_id {
            return Err(format!(
                "SLURM_ARRAY_TASK_ID={id} and RANK={rank}/WORLD_SIZE={world} are both set: a Slurm array task \
                 running torchrun would split the input twice. Run one launcher per split, or pass \
                 --part-index/--num-parts"
            ));
        }
        if let (Some(p), Some(n)) = (procid, ntasks) {
            // torchrun inside an sbatch: SLURM_NTASKS nodes (tasks) of LOCAL_WORLD_SIZE workers each.
            let lws = match v.num("LOCAL_WORLD_SIZE")? {
                Some(l) => l,
                None if n > 0 => world / n,
                None => 0,
            };
            let ok = n > 0 && world % n == 0 && lws > 0 && rank / lws == p;
            if !ok {
                let local = env("LOCAL_WORLD_SIZE").map_or(String::new(), |l| format!(", LOCAL_WORLD_SIZE={l}"));
                return Err(format!(
                    "RANK={rank}, WORLD_SIZE={world}{local} disagree with SLURM_PROCID={p}, SLURM_NTASKS={n}: \
                     WORLD_SIZE must be a multiple of SLURM_NTASKS and RANK / LOCAL_WORLD_SIZE must be \
                     SLURM_PROCID (one torchrun per Slurm task). Fix the launch, or pass --part-index/--num-parts"
                ));
            }
        }
        return Ok(Some(PartSpec {
            index: rank,
            count: count(world, "WORLD_SIZE")?,
            source: "RANK/WORLD_SIZE".into(),
        }));
    }
    // Slurm job arrays: every array task sees SLURM_PROCID=0, so the array comes first.
    if let (Some(id), None) = (array_id, array_count) {
        return Err(format!(
            "SLURM_ARRAY_TASK_ID={id} is set without SLURM_ARRAY_TASK_COUNT (a Slurm older than 17.11?): \
             pass --part-index and --num-parts"
        ));
    }
    if let (Some(id), Some(n)) = (array_id, array_count) {
        let min = v.num("SLURM_ARRAY_TASK_MIN")?.unwrap_or(0);
        let step = v.num("SLURM_ARRAY_TASK_STEP")?.unwrap_or(1).max(1);
        let off = id
            .checked_sub(min)
            .ok_or_else(|| format!("SLURM_ARRAY_TASK_ID={id} is below SLURM_ARRAY_TASK_MIN={min}"))?;
        if !off.is_multiple_of(step) {
            return Err(format!("SLURM_ARRAY_TASK_ID={id} is not on the array's step {step} from {min}"));
        }
        let source = "SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT".to_string();
        return Ok(Some(PartSpec { index: off / step, count: count(n, "SLURM_ARRAY_TASK_COUNT")?, source }));
    }
    // A batch script run without --ntasks may see SLURM_PROCID alone: one process.
    if let (Some(index), Some(n)) = (procid, ntasks) {
        let source = "SLURM_PROCID/SLURM_NTASKS".to_string();
        return Ok(Some(PartSpec { index, count: count(n, "SLURM_NTASKS")?, source }));
    }
    let strata_count = v.num(NUM_PARTS_VAR)?;
    if let (Some(f), Some(e)) = (flag_count, strata_count) {
        if f != e {
            return Err(format!("--num-parts {f} disagrees with {NUM_PARTS_VAR}={e}: give one, or make them agree"));
        }
    }
    if let Some(index) = v.num("JOB_COMPLETION_INDEX")? {
        let (n, from) = match (flag_count, strata_count) {
            (Some(c), _) => (c, "JOB_COMPLETION_INDEX, --num-parts".to_string()),
            (None, Some(c)) => (c, format!("JOB_COMPLETION_INDEX/{NUM_PARTS_VAR}")),
            (None, None) => {
                return Err(format!(
                    "JOB_COMPLETION_INDEX={index} is set (a Kubernetes Indexed Job), but Kubernetes gives no count: \
                     pass --num-parts (the Job's completions) or set {NUM_PARTS_VAR}"
                ))
            }
        };
        return Ok(Some(PartSpec { index, count: n, source: from }));
    }
    Ok(None)
}

/// A fingerprint of a whole input that needs no full read: its length, its
/// first and last 64 KiB and 64 evenly spaced 4 KiB blocks. Every part
/// computes the same one, and `strata merge` checks that they agree.
pub fn fingerprint<R: Read + Seek>(r: &mut R, len: u64) -> std::io::Result<String> {
    const EDGE: u64 = 64 << 10;
    const BLOCK: u64 = 4 << 10;
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(&len.to_le_bytes());
    let mut buf = vec![0u8; EDGE as usize];
    let mut read_at = |h: &mut xxhash_rust::xxh3::Xxh3, at: u64, n: u64| -> std::io::Result<()> {
        let n = n.min(len.saturating_sub(at)) as usize;
        r.seek(SeekFrom::Start(at))?;
        r.read_exact(&mut buf[..n])?;
        h.update(&buf[..n]);
        Ok(())
    };
    read_at(&mut h, 0, EDGE)?;
    for k in 1..=64u64 {
        read_at(&mut h, (len as u128 * k as u128 / 65) as u64, BLOCK)?;
    }
    read_at(&mut h, len.saturating_sub(EDGE), EDGE)?;
    Ok(format!("xxh3:{:016x}", h.digest()))
}

/// Where part `spec` lies in an input of `len` bytes: the byte range of
/// its whole lines, and how many lines and records come before it (so that
/// default ids and line numbers are the ones a single process gives).
pub fn locate<R: Read + Seek>(r: &mut R, len: u64, spec: &PartSpec) -> std::io::Result<PartInfo> {
    let start = boundary(r, len, spec.index, spec.count)?;
    let end = boundary(r, len, spec.index + 1, spec.count)?;
    let (lines, records) = count_lines(r, start)?;
    Ok(PartInfo {
        index: spec.index,
        count: spec.count,
        source: spec.source.clone(),
        input_bytes: len,
        input_fingerprint: fingerprint(r, len)?,
        start,
        end,
        first_line: lines + 1,
        first_record: records,
    })
}

/// The first line start at or after `k/n` of the input.
fn boundary<R: Read + Seek>(r: &mut R, len: u64, k: usize, n: usize) -> std::io::Result<u64> {
    if k == 0 {
        return Ok(0);
    }
    if k >= n {
        return Ok(len);
    }
    let p = (len as u128 * k as u128 / n as u128) as u64;
    if p == 0 {
        // More parts than bytes: this one starts at the top (and is empty).
        return Ok(0);
    }
    // A line starts at `p` when the byte before it ends a line.
    r.seek(SeekFrom::Start(p - 1))?;
    let mut buf = vec![0u8; 64 << 10];
    let mut at = p - 1;
    loop {
        let got = r.read(&mut buf)?;
        if got == 0 {
            return Ok(len);
        }
        if let Some(i) = buf[..got].iter().position(|&b| b == b'\n') {
            return Ok(at + i as u64 + 1);
        }
        at += got as u64;
    }
}

/// Lines, and lines that are not blank (records), in the first `end` bytes.
fn count_lines<R: Read + Seek>(r: &mut R, end: u64) -> std::io::Result<(usize, usize)> {
    r.seek(SeekFrom::Start(0))?;
    let mut r = r.take(end);
    let mut buf = vec![0u8; 1 << 20];
    let (mut lines, mut records, mut text) = (0usize, 0usize, false);
    loop {
        let got = r.read(&mut buf)?;
        if got == 0 {
            break;
        }
        for &b in &buf[..got] {
            if b == b'\n' {
                lines += 1;
                records += text as usize;
                text = false;
            } else {
                text |= !b.is_ascii_whitespace();
            }
        }
    }
    // `end` is a line start, so no line is left open.
    Ok((lines, records))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::parts::parse_dir_name;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }

    #[test]
    fn launchers_in_order() {
        let r = |i, n, v: &[(&str, &str)]| resolve(i, n, env(v));
        assert_eq!(r(None, None, &[]), Ok(None));
        let s = r(
            None,
            None,
            &[
                ("SLURM_ARRAY_TASK_ID", "5"),
                ("SLURM_ARRAY_TASK_COUNT", "8"),
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "1"),
            ],
        )
        .unwrap()
        .unwrap();
        assert_eq!((s.index, s.count), (5, 8));
        assert!(s.source.starts_with("SLURM_ARRAY"));
        // An array from 1 with step 2: 1, 3, 5, 7.
        let v = [
            ("SLURM_ARRAY_TASK_ID", "5"),
            ("SLURM_ARRAY_TASK_COUNT", "4"),
            ("SLURM_ARRAY_TASK_MIN", "1"),
            ("SLURM_ARRAY_TASK_STEP", "2"),
        ];
        assert_eq!(r(None, None, &v).unwrap().unwrap().index, 2);
        let s = r(None, None, &[("SLURM_PROCID", "3"), ("SLURM_NTASKS", "4")]).unwrap().unwrap();
        assert_eq!((s.index, s.count, s.source.as_str()), (3, 4, "SLURM_PROCID/SLURM_NTASKS"));
        let s = r(None, None, &[("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1")]).unwrap().unwrap();
        assert_eq!((s.index, s.count), (1, 2));
        // torchrun inside an sbatch: its variables describe the process, and must agree with Slurm's.
        let one_task = |rank: &'static str| {
            vec![
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "1"),
                ("RANK", rank),
                ("WORLD_SIZE", "4"),
                ("LOCAL_WORLD_SIZE", "4"),
            ]
        };
        for (i, rank) in ["0", "1", "2", "3"].into_iter().enumerate() {
            let s = r(None, None, &one_task(rank)).unwrap().unwrap();
            assert_eq!((s.index, s.count, s.source.as_str()), (i, 4, "RANK/WORLD_SIZE"));
        }
        let two_nodes = [
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_WORLD_SIZE", "4"),
        ];
        assert_eq!(r(None, None, &two_nodes).unwrap().unwrap().index, 5);
        let wrong_node = [
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_WORLD_SIZE", "4"),
        ];
        let e = r(None, None, &wrong_node).unwrap_err();
        assert!(
            ["RANK=5", "WORLD_SIZE=8", "LOCAL_WORLD_SIZE=4", "SLURM_PROCID=0", "SLURM_NTASKS=2"]
                .iter()
                .all(|v| e.contains(v)),
            "{e}"
        );
        let e = r(None, None, &[("SLURM_PROCID", "3"), ("SLURM_NTASKS", "4"), ("RANK", "0"), ("WORLD_SIZE", "2")])
            .unwrap_err();
        assert!(e.contains("multiple of SLURM_NTASKS"), "{e}");
        // Half-set, empty, or two launchers at once: refused, naming the variables.
        assert!(r(None, None, &[("RANK", "1")]).unwrap_err().contains("RANK=1 is set without WORLD_SIZE"));
        assert!(r(None, None, &[("WORLD_SIZE", "2")]).unwrap_err().contains("without RANK"));
        assert!(r(None, None, &[("RANK", ""), ("WORLD_SIZE", "2")]).unwrap_err().contains("RANK is set but empty"));
        let e = r(
            None,
            None,
            &[("SLURM_ARRAY_TASK_ID", "1"), ("SLURM_ARRAY_TASK_COUNT", "4"), ("RANK", "0"), ("WORLD_SIZE", "2")],
        )
        .unwrap_err();
        assert!(e.contains("SLURM_ARRAY_TASK_ID=1") && e.contains("RANK=0/WORLD_SIZE=2"), "{e}");
        // SLURM_PROCID alone (an sbatch script without --ntasks): one process, as before.
        assert_eq!(r(None, None, &[("SLURM_PROCID", "0")]), Ok(None));
        let e = r(None, Some(3), &[("JOB_COMPLETION_INDEX", "1"), (NUM_PARTS_VAR, "4")]).unwrap_err();
        assert!(e.contains("--num-parts 3") && e.contains("STRATA_NUM_PARTS=4"), "{e}");
        // Kubernetes: the count from the flag or STRATA_NUM_PARTS, never guessed.
        assert!(r(None, None, &[("JOB_COMPLETION_INDEX", "2")]).unwrap_err().contains("--num-parts"));
        assert_eq!(r(None, Some(4), &[("JOB_COMPLETION_INDEX", "2")]).unwrap().unwrap().index, 2);
        assert_eq!(r(None, None, &[("JOB_COMPLETION_INDEX", "2"), (NUM_PARTS_VAR, "3")]).unwrap().unwrap().count, 3);
        // The flags win; a disagreeing count is refused; bad values are named.
        assert_eq!(r(Some(0), Some(2), &[("RANK", "1"), ("WORLD_SIZE", "2")]).unwrap().unwrap().index, 0);
        assert!(r(None, Some(3), &[("RANK", "1"), ("WORLD_SIZE", "2")]).unwrap_err().contains("disagrees"));
        assert!(r(Some(1), None, &[]).is_err());
        assert!(r(Some(2), Some(2), &[]).unwrap_err().contains("not below"));
        assert!(r(None, None, &[("RANK", "x"), ("WORLD_SIZE", "2")]).unwrap_err().contains("RANK"));
        assert!(r(None, Some(2), &[]).unwrap_err().contains("--part-index"));
        // One part is the whole input.
        assert_eq!(r(None, None, &[("RANK", "0"), ("WORLD_SIZE", "1")]), Ok(None));
        assert_eq!(parse_dir_name(&dir_name(3, 16)), Some((3, 16)));
        assert_eq!(parse_dir_name("part-3-of-16"), None);
        assert_eq!(parse_dir_name("part-00003-of-0016"), None);
        assert_eq!(parse_dir_name("part-0000-of-99999999"), None);
        assert!(r(None, None, &[("SLURM_ARRAY_TASK_ID", "3")]).unwrap_err().contains("SLURM_ARRAY_TASK_COUNT"));
    }

    #[test]
    fn parts_are_whole_lines_that_tile_the_input_and_know_what_precedes_them() {
        let text: String = (0..200)
            .map(|i| if i % 7 == 3 { "  \n".to_string() } else { format!("{{\"x\": {}}}\n", "9".repeat(i % 13)) })
            .collect();
        let bytes = text.as_bytes();
        // More parts than bytes, and an empty input: empty parts, no panic.
        for (input, n) in [(&b""[..], 3), (&b"{}\n"[..], 16)] {
            let mut at = 0;
            for i in 0..n {
                let spec = PartSpec { index: i, count: n, source: String::new() };
                let p = locate(&mut std::io::Cursor::new(input), input.len() as u64, &spec).unwrap();
                assert_eq!(p.start, at);
                at = p.end;
            }
            assert_eq!(at, input.len() as u64);
        }
        for n in [1, 2, 3, 7, 16, 300, 5000] {
            let mut at = 0;
            let mut records = 0;
            for i in 0..n {
                let spec = PartSpec { index: i, count: n, source: String::new() };
                let p = locate(&mut std::io::Cursor::new(bytes), bytes.len() as u64, &spec).unwrap();
                assert_eq!(p.start, at, "part {i} of {n}");
                assert!(p.start == 0 || bytes[p.start as usize - 1] == b'\n');
                assert_eq!(p.first_line, text[..p.start as usize].matches('\n').count() + 1);
                assert_eq!(p.first_record, records);
                let part = &text[p.start as usize..p.end as usize];
                records += part.lines().filter(|l| !l.trim().is_empty()).count();
                at = p.end;
            }
            assert_eq!(at, bytes.len() as u64);
        }
        // Balanced by bytes: no part is more than a line off its share.
        let spec = |i| PartSpec { index: i, count: 4, source: String::new() };
        for i in 0..4 {
            let p = locate(&mut std::io::Cursor::new(bytes), bytes.len() as u64, &spec(i)).unwrap();
            assert!(((p.end - p.start) as i64 - bytes.len() as i64 / 4).abs() < 40);
        }
    }
}
