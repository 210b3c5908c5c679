//! Opening files without trusting them: regular files only (a FIFO or a
//! device would hang a read or never end it), bounded reads, exclusive
//! creation that never follows a planted link, and paths kept inside a
//! directory. Every stage that touches the filesystem goes through here.

use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Component, Path, PathBuf};

fn not_regular(path: &Path, kind: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("{} is {kind}, not a regular file (pipes, devices and directories are refused)", path.display()),
    )
}

fn kind(meta: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_char_device() || t.is_block_device() {
        "a device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

/// Opens `path` for reading if it is a regular file (links are followed).
/// Opened non-blocking and checked on the open descriptor, so a FIFO put in
/// place of the file is refused instead of blocking, with no race between check and open.
pub fn open_regular(path: &Path) -> io::Result<File> {
    open_regular_with(path, libc::O_NONBLOCK)
}

/// Opens `path` for reading if it is a regular file and not a link.
pub fn open_regular_nofollow(path: &Path) -> io::Result<File> {
    open_regular_with(path, libc::O_NONBLOCK | libc::O_NOFOLLOW)
}

fn open_regular_with(path: &Path, flags: i32) -> io::Result<File> {
    let f = std::fs::OpenOptions::new().read(true).custom_flags(flags).open(path)?;
    let meta = f.metadata()?;
    if !meta.is_file() {
        return Err(not_regular(path, kind(&meta)));
    }
    Ok(f)
}

/// An input stream: a regular file (its length known), or a pipe or FIFO
/// (`-` is stdin). Devices and directories are refused: `/dev/zero` would
/// never end and a terminal would wait for typing.
pub fn open_stream(path: &Path) -> io::Result<(Box<dyn Read + Send>, Option<u64>)> {
    use std::os::unix::fs::FileTypeExt;
    let (reader, meta): (Box<dyn Read + Send>, _) = if path == Path::new("-") {
        let meta = std::fs::metadata("/dev/stdin")?;
        (Box::new(io::stdin()), meta)
    } else {
        // A FIFO's open waits for its writer, as a reader of a FIFO expects.
        let f = File::open(path)?;
        let meta = f.metadata()?;
        (Box::new(f), meta)
    };
    let t = meta.file_type();
    if t.is_file() {
        Ok((reader, Some(meta.len())))
    } else if t.is_fifo() || t.is_socket() {
        Ok((reader, None))
    } else {
        Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is {}: give a file, a pipe or a FIFO", path.display(), kind(&meta)),
        ))
    }
}

/// Whether `path` names a regular file (following links); `Ok(false)` when absent.
pub fn is_regular(path: &Path) -> io::Result<bool> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() => Ok(true),
        Ok(m) => Err(not_regular(path, kind(&m))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// Reads a regular file of at most `max` bytes as UTF-8 text.
pub fn read_text(path: &Path, max: u64) -> io::Result<String> {
    let f = open_regular(path)?;
    let len = f.metadata()?.len();
    if len > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{} is {len} bytes, more than the {max} this file may have", path.display()),
        ));
    }
    let mut text = String::with_capacity(len as usize);
    f.take(max + 1).read_to_string(&mut text)?;
    if text.len() as u64 > max {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("{} grew past {max} bytes", path.display())));
    }
    Ok(text)
}

/// Creates `path` for writing, failing if anything (a file, a link, a FIFO)
/// already has its name: a link planted at a temporary name is never followed.
pub fn create_exclusive(path: &Path) -> io::Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW)
        .mode(0o644)
        .open(path)
}

/// Joins a relative path read from a file (a manifest's shard name) to `dir`,
/// refusing absolute paths, `..`, and links that lead outside `dir`.
/// Subdirectories are allowed. The target need not exist yet; when it does,
/// its resolved path must stay inside `dir`'s.
pub fn inside(dir: &Path, rel: &str) -> Result<PathBuf, String> {
    let p = Path::new(rel);
    if rel.is_empty() {
        return Err("an empty path".into());
    }
    for c in p.components() {
        match c {
            Component::Normal(_) => {}
            Component::CurDir => {}
            Component::ParentDir => return Err(format!("path {rel:?} has a `..` component")),
            Component::RootDir | Component::Prefix(_) => return Err(format!("path {rel:?} is absolute")),
        }
    }
    let joined = dir.join(p);
    match joined.canonicalize() {
        Ok(real) => {
            let root = dir.canonicalize().map_err(|e| format!("cannot resolve {}: {e}", dir.display()))?;
            if !real.starts_with(&root) {
                return Err(format!("path {rel:?} leads outside {} (to {})", dir.display(), real.display()));
            }
        }
        // A link whose target is missing could be pointed anywhere later.
        Err(_) if joined.symlink_metadata().is_ok() => return Err(format!("path {rel:?} is a dangling link")),
        Err(_) => {}
    }
    Ok(joined)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_fifos_and_escapes() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("f");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
        let e = open_regular(&fifo).unwrap_err().to_string();
        assert!(e.contains("is a FIFO"), "{e}");
        assert!(read_text(Path::new("/dev/zero"), 10).unwrap_err().to_string().contains("a device"));
        std::fs::write(dir.path().join("a"), "x").unwrap();
        assert!(inside(dir.path(), "a").is_ok());
        assert!(inside(dir.path(), "sub/b").is_ok());
        assert!(inside(dir.path(), "../a").unwrap_err().contains(".."));
        assert!(inside(dir.path(), "/etc/passwd").unwrap_err().contains("absolute"));
        std::os::unix::fs::symlink("/etc/passwd", dir.path().join("l")).unwrap();
        assert!(inside(dir.path(), "l").unwrap_err().contains("outside"));
        std::os::unix::fs::symlink("/nonexistent/x", dir.path().join("t")).unwrap();
        assert!(create_exclusive(&dir.path().join("t")).is_err());
        assert!(!Path::new("/nonexistent/x").exists());
    }
}
