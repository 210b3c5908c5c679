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
    read_bounded(open_regular(path)?, path, max)
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
pub fn inside(dir: &Path, rel: &str) -> Result<PathBuf, OutsideError> {
    let p = Path::new(rel);
    if rel.is_empty() {
        return Err(OutsideError::Empty);
    }
    let rel_ = || rel.to_string();
    for c in p.components() {
        match c {
            Component::Normal(_) => {}
            Component::CurDir => {}
            Component::ParentDir => return Err(OutsideError::Parent { rel: rel_() }),
            Component::RootDir | Component::Prefix(_) => return Err(OutsideError::Absolute { rel: rel_() }),
        }
    }
    let joined = dir.join(p);
    match joined.canonicalize() {
        Ok(real) => {
            let root = dir
                .canonicalize()
                .map_err(|cause| OutsideError::Unresolvable { dir: dir.display().to_string(), cause })?;
            if !real.starts_with(&root) {
                return Err(OutsideError::Leads { rel: rel_(), dir: dir.display().to_string(), to: real });
            }
        }
        // A link whose target is missing could be pointed anywhere later.
        Err(_) if joined.symlink_metadata().is_ok() => return Err(OutsideError::Dangling { rel: rel_() }),
        Err(_) => {}
    }
    Ok(joined)
}

/// Why [`inside`] refused a relative path read from a file.
#[derive(Debug, thiserror::Error)]
pub enum OutsideError {
    /// No path.
    #[error("an empty path")]
    Empty,
    /// A `..` component.
    #[error("path {rel:?} has a `..` component")]
    Parent {
        /// The path as read.
        rel: String,
    },
    /// An absolute path.
    #[error("path {rel:?} is absolute")]
    Absolute {
        /// The path as read.
        rel: String,
    },
    /// The directory itself cannot be resolved.
    #[error("cannot resolve {dir}: {cause}")]
    Unresolvable {
        /// The directory.
        dir: String,
        /// The OS error.
        cause: std::io::Error,
    },
    /// A path (through a link) that resolves outside the directory.
    #[error("path {rel:?} leads outside {dir} (to {})", to.display())]
    Leads {
        /// The path as read.
        rel: String,
        /// The directory.
        dir: String,
        /// Where it leads.
        to: PathBuf,
    },
    /// A link whose target is missing.
    #[error("path {rel:?} is a dangling link")]
    Dangling {
        /// The path as read.
        rel: String,
    },
}

/// What a name in a [`Dir`] is, links not followed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A regular file of this many bytes.
    File(u64),
    /// A directory.
    Dir,
    /// A symbolic link.
    Link,
    /// A FIFO, socket or device.
    Other,
}

impl Kind {
    /// How a message names it.
    pub fn describe(self) -> &'static str {
        match self {
            Kind::File(_) => "a regular file",
            Kind::Dir => "a directory",
            Kind::Link => "a symbolic link",
            Kind::Other => "a FIFO, socket or device",
        }
    }
}

/// A directory opened once: every name in it is reached through its handle
/// (`openat`, `renameat`, `unlinkat`, ...), never by a path resolved again,
/// and a subdirectory is entered without following a link
/// (`O_NOFOLLOW | O_DIRECTORY`). A link swapped in for a subdirectory after a
/// check is therefore refused too, and a file created here lands here.
#[derive(Debug)]
pub struct Dir {
    fd: std::os::fd::OwnedFd,
    path: PathBuf,
}

/// A single name inside a directory: no `/`, not `.` or `..`, not empty.
fn one_name(name: &str) -> io::Result<&str> {
    if name.is_empty() || name == "." || name == ".." || name.contains('/') || name.contains('\0') {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{name:?} is not a single file name")));
    }
    Ok(name)
}

/// The error of a name that is a link where Strata enters or writes.
fn linked() -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        "it is a symbolic link, and Strata does not follow links inside an output directory \
         (move it away; --out itself may be a link)",
    )
}

impl Dir {
    /// Opens the directory `path` (a link to a directory is followed: the
    /// root a user names may be one).
    pub fn open(path: &Path) -> io::Result<Dir> {
        use rustix::fs::{Mode, OFlags};
        let fd = rustix::fs::open(path, OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())
            .map_err(io::Error::from)?;
        Ok(Dir { fd, path: path.to_path_buf() })
    }

    /// [`Dir::open`], creating the directory and its parents first when missing.
    pub fn create(path: &Path) -> io::Result<Dir> {
        std::fs::create_dir_all(path)?;
        Dir::open(path)
    }

    /// The directory's path, for messages.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `path()/name`, for messages.
    pub fn join(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    /// The subdirectory `name`, created first when `create` and missing; a
    /// link there is refused, never followed.
    pub fn sub(&self, name: &str, create: bool) -> io::Result<Dir> {
        use rustix::fs::{Mode, OFlags};
        let name = one_name(name)?;
        let path = self.join(name);
        if create {
            match rustix::fs::mkdirat(&self.fd, name, Mode::from_raw_mode(0o755)) {
                Ok(()) | Err(rustix::io::Errno::EXIST) => {}
                Err(e) => return Err(e.into()),
            }
        }
        let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        match rustix::fs::openat(&self.fd, name, flags, Mode::empty()) {
            Ok(fd) => Ok(Dir { fd, path }),
            // ELOOP: the name is a link; ENOTDIR: a link (to anything) or a file.
            Err(rustix::io::Errno::LOOP) => Err(linked()),
            Err(rustix::io::Errno::NOTDIR) if self.kind(name)? == Some(Kind::Link) => Err(linked()),
            Err(e) => Err(e.into()),
        }
    }

    /// The directory holding the relative path `rel` (subdirectories allowed,
    /// each entered by [`Dir::sub`]) and the last component's name. Absolute
    /// paths, `..` and empty components are refused.
    pub fn walk(&self, rel: &str, create: bool) -> io::Result<(Dir, String)> {
        let bad = |why: &str| io::Error::new(io::ErrorKind::InvalidInput, format!("path {rel:?} {why}"));
        if rel.starts_with('/') {
            return Err(bad("is absolute"));
        }
        let parts: Vec<&str> = rel.split('/').filter(|c| *c != ".").collect();
        let Some((last, dirs)) = parts.split_last() else { return Err(bad("is empty")) };
        if parts.iter().any(|c| c.is_empty()) {
            return Err(bad("has an empty component"));
        }
        if parts.contains(&"..") {
            return Err(bad("has a `..` component"));
        }
        let mut at = Dir { fd: self.fd.try_clone()?, path: self.path.clone() };
        for d in dirs {
            at = at.sub(d, create)?;
        }
        Ok((at, last.to_string()))
    }

    /// What `name` is, links not followed; `None` when absent.
    pub fn kind(&self, name: &str) -> io::Result<Option<Kind>> {
        use rustix::fs::{AtFlags, FileType};
        let name = one_name(name)?;
        match rustix::fs::statat(&self.fd, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => Ok(Some(match FileType::from_raw_mode(st.st_mode) {
                FileType::RegularFile => Kind::File(st.st_size as u64),
                FileType::Directory => Kind::Dir,
                FileType::Symlink => Kind::Link,
                _ => Kind::Other,
            })),
            Err(rustix::io::Errno::NOENT) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// The identity (device, inode) of the regular file `name`, links not followed.
    pub fn identity(&self, name: &str) -> io::Result<Option<(u64, u64)>> {
        use rustix::fs::AtFlags;
        let name = one_name(name)?;
        match rustix::fs::statat(&self.fd, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => Ok(Some((st.st_dev, st.st_ino))),
            Err(rustix::io::Errno::NOENT) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// The names in the directory (not `.` and `..`), in no order.
    pub fn names(&self) -> io::Result<Vec<String>> {
        let mut out = Vec::new();
        let dir = rustix::fs::Dir::read_from(&self.fd).map_err(io::Error::from)?;
        for e in dir {
            let e = e.map_err(io::Error::from)?;
            let name = e.file_name().to_string_lossy().into_owned();
            if name != "." && name != ".." {
                out.push(name);
            }
        }
        Ok(out)
    }

    /// Creates `name` for reading and writing; fails if anything (a file, a
    /// link, a FIFO) already has the name.
    pub fn create_new(&self, name: &str) -> io::Result<File> {
        use rustix::fs::{Mode, OFlags};
        let name = one_name(name)?;
        let flags = OFlags::RDWR | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let fd = rustix::fs::openat(&self.fd, name, flags, Mode::from_raw_mode(0o644)).map_err(io::Error::from)?;
        Ok(File::from(fd))
    }

    /// Opens `name` for reading and writing, creating it when missing (and
    /// appending when `append`), never through a link and without blocking
    /// on a FIFO; it must be a regular file.
    pub fn open_rw(&self, name: &str, append: bool) -> io::Result<File> {
        use rustix::fs::OFlags;
        use std::os::unix::fs::MetadataExt;
        let flags = OFlags::RDWR | OFlags::CREATE | if append { OFlags::APPEND } else { OFlags::empty() };
        let f = self.open_regular(name, flags)?;
        // A hard link planted at the name would have writes land in another file too.
        if f.metadata()?.nlink() > 1 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "it is a hard link to another file (written here, it would change that one too); move it away",
            ));
        }
        Ok(f)
    }

    /// Opens `name` for reading: a regular file, not a link, without blocking on a FIFO.
    pub fn open_file(&self, name: &str) -> io::Result<File> {
        self.open_regular(name, rustix::fs::OFlags::RDONLY)
    }

    /// `openat` with `flags`, never through a link and without blocking on a
    /// FIFO; what it opens must be a regular file.
    fn open_regular(&self, name: &str, flags: rustix::fs::OFlags) -> io::Result<File> {
        use rustix::fs::{Mode, OFlags};
        let name = one_name(name)?;
        let flags = flags | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC;
        let fd = rustix::fs::openat(&self.fd, name, flags, Mode::from_raw_mode(0o644)).map_err(|e| match e {
            rustix::io::Errno::LOOP => linked(),
            e => e.into(),
        })?;
        let f = File::from(fd);
        let meta = f.metadata()?;
        if !meta.is_file() {
            return Err(not_regular(&self.join(name), kind(&meta)));
        }
        Ok(f)
    }

    /// Reads `name` (see [`Dir::open_file`]) as UTF-8 text of at most `max` bytes.
    pub fn read_text(&self, name: &str, max: u64) -> io::Result<String> {
        read_bounded(self.open_file(name)?, &self.join(name), max)
    }

    /// Renames `from` here to `to` in `dir` (atomically replacing a file there).
    pub fn rename(&self, from: &str, dir: &Dir, to: &str) -> io::Result<()> {
        rustix::fs::renameat(&self.fd, one_name(from)?, &dir.fd, one_name(to)?).map_err(io::Error::from)
    }

    /// Makes `to` in `dir` a hard link to the file `from` here (a link at
    /// `from` is linked as a link, never followed).
    pub fn hard_link(&self, from: &str, dir: &Dir, to: &str) -> io::Result<()> {
        rustix::fs::linkat(&self.fd, one_name(from)?, &dir.fd, one_name(to)?, rustix::fs::AtFlags::empty())
            .map_err(io::Error::from)
    }

    /// When `name` (not followed if a link) was last modified, and whether it
    /// is a regular file; `None` when there is nothing by that name.
    pub fn modified(&self, name: &str) -> io::Result<Option<(std::time::SystemTime, bool)>> {
        match rustix::fs::statat(&self.fd, one_name(name)?, rustix::fs::AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => {
                let at = std::time::UNIX_EPOCH
                    + std::time::Duration::new(
                        st.st_mtime.max(0) as u64,
                        st.st_mtime_nsec.clamp(0, 999_999_999) as u32,
                    );
                let regular = rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::RegularFile;
                Ok(Some((at, regular)))
            }
            Err(rustix::io::Errno::NOENT) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Removes the file (or link) `name`; `Ok(false)` when there was none.
    pub fn remove(&self, name: &str) -> io::Result<bool> {
        match rustix::fs::unlinkat(&self.fd, one_name(name)?, rustix::fs::AtFlags::empty()) {
            Ok(()) => Ok(true),
            Err(rustix::io::Errno::NOENT) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// A second handle on the same directory (for another thread).
    pub fn try_clone(&self) -> io::Result<Dir> {
        Ok(Dir { fd: self.fd.try_clone()?, path: self.path.clone() })
    }

    /// fsyncs the directory so renames in it are durable (a no-op where the filesystem refuses).
    pub fn sync(&self) {
        if let Err(e) = rustix::fs::fsync(&self.fd) {
            tracing::debug!("fsync of directory {}: {e}", self.path.display());
        }
    }
}

fn read_bounded(f: File, path: &Path, max: u64) -> io::Result<String> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_handle_keeps_writing_where_it_was_opened_whatever_is_swapped_in() {
        let tmp = tempfile::tempdir().unwrap();
        let out = Dir::create(&tmp.path().join("out")).unwrap();
        let elsewhere = tmp.path().join("elsewhere");
        std::fs::create_dir_all(&elsewhere).unwrap();
        let sub = out.sub("hidden_states", true).unwrap();
        // The checked directory is swapped for a link after it was opened.
        std::fs::rename(out.join("hidden_states"), tmp.path().join("moved")).unwrap();
        std::os::unix::fs::symlink(&elsewhere, out.join("hidden_states")).unwrap();
        sub.create_new("a").unwrap();
        out.create_new("t").unwrap();
        out.rename("t", &sub, "b").unwrap();
        assert!(tmp.path().join("moved/a").is_file() && tmp.path().join("moved/b").is_file());
        assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0);
        // Entering it again is refused; so is a link at a file name, and `..` in a path.
        let e = out.sub("hidden_states", true).unwrap_err().to_string();
        assert!(e.contains("symbolic link"), "{e}");
        assert!(out.walk("hidden_states/x", true).unwrap_err().to_string().contains("symbolic link"));
        std::os::unix::fs::symlink(tmp.path().join("moved/a"), out.join("l")).unwrap();
        assert!(out.open_file("l").unwrap_err().to_string().contains("symbolic link"));
        assert!(out.create_new("l").is_err());
        assert_eq!(out.kind("l").unwrap(), Some(Kind::Link));
        assert!(out.walk("../x", false).unwrap_err().to_string().contains(".."));
        assert!(out.walk("/etc/passwd", false).unwrap_err().to_string().contains("absolute"));
    }

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
        assert!(inside(dir.path(), "../a").unwrap_err().to_string().contains(".."));
        assert!(inside(dir.path(), "/etc/passwd").unwrap_err().to_string().contains("absolute"));
        std::os::unix::fs::symlink("/etc/passwd", dir.path().join("l")).unwrap();
        assert!(inside(dir.path(), "l").unwrap_err().to_string().contains("outside"));
        std::os::unix::fs::symlink("/nonexistent/x", dir.path().join("t")).unwrap();
        assert!(create_exclusive(&dir.path().join("t")).is_err());
        assert!(!Path::new("/nonexistent/x").exists());
    }
}
