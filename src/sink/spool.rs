//! A file written on its own thread: the sink encodes and hashes the next
//! buffer while the previous one is being written, so the dtype conversion
//! and checksums overlap the write instead of adding to it. The bytes, and
//! their order, are exactly those given.
//!
//! The writer also starts the disk writeback of each buffer as soon as it is
//! written, and waits for the writeback of the data [`LAG`] bytes behind, so
//! the disk works while the next buffers are encoded: the fsync at close
//! then has little left to do, and the page cache holds at most about `LAG`
//! dirty bytes of the file instead of the whole shard.

use std::fs::File;
use std::io::Write;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::thread::JoinHandle;

/// A buffer is handed to the writer once it holds this many bytes.
const FLUSH: usize = 4 << 20;
/// Buffers queued for the writer at most (memory: about (DEPTH + 2) × FLUSH).
const DEPTH: usize = 2;
/// Written bytes whose writeback may still be under way (Linux).
const LAG: u64 = 64 << 20;

/// The writing end of a file whose writes run on a thread.
pub(crate) struct Spool {
    // The buffer being filled; handed over at FLUSH bytes.
    cur: Vec<u8>,
    tx: Option<SyncSender<Vec<u8>>>,
    // Buffers the writer is done with, for reuse.
    back: Receiver<Vec<u8>>,
    handle: Option<JoinHandle<std::io::Result<File>>>,
}

impl Spool {
    /// Starts the writer thread for `file`.
    pub(crate) fn new(mut file: File) -> Self {
        let (tx, rx) = sync_channel::<Vec<u8>>(DEPTH);
        let (back_tx, back) = sync_channel::<Vec<u8>>(DEPTH + 2);
        let handle = std::thread::Builder::new()
            .name("strata-writer".into())
            .spawn(move || {
                let mut written = 0u64;
                let mut waited = 0u64;
                for mut buf in rx {
                    file.write_all(&buf)?;
                    writeback(&file, written, buf.len() as u64, false);
                    written += buf.len() as u64;
                    if written - waited > LAG {
                        let upto = written - LAG;
                        writeback(&file, waited, upto - waited, true);
                        waited = upto;
                    }
                    buf.clear();
                    let _ = back_tx.try_send(buf);
                }
                Ok(file)
            })
            .ok();
        Spool { cur: Vec::with_capacity(FLUSH), tx: Some(tx), back, handle }
    }

    /// Appends bytes with `fill`, which receives the buffer (it must only
    /// append); returns the appended bytes, for hashing.
    pub(crate) fn put(&mut self, fill: impl FnOnce(&mut Vec<u8>)) -> std::io::Result<&[u8]> {
        if self.cur.len() >= FLUSH {
            self.hand_over()?;
        }
        let start = self.cur.len();
        fill(&mut self.cur);
        Ok(&self.cur[start..])
    }

    fn hand_over(&mut self) -> std::io::Result<()> {
        let next = self.back.try_recv().unwrap_or_else(|_| Vec::with_capacity(FLUSH));
        let full = std::mem::replace(&mut self.cur, next);
        let sent = self.tx.as_ref().is_some_and(|tx| tx.send(full).is_ok());
        if sent {
            Ok(())
        } else {
            // The writer stopped: its error says why.
            Err(self.join().err().unwrap_or_else(|| std::io::Error::other("the writer thread stopped")))
        }
    }

    fn join(&mut self) -> std::io::Result<File> {
        self.tx = None;
        match self.handle.take() {
            Some(h) => h.join().unwrap_or_else(|_| Err(std::io::Error::other("the writer thread panicked"))),
            None => Err(std::io::Error::other("the writer thread could not be started")),
        }
    }

    /// Writes what is left and returns the file (positioned at its end).
    pub(crate) fn finish(mut self) -> std::io::Result<File> {
        if !self.cur.is_empty() {
            self.hand_over()?;
        }
        self.join()
    }
}

/// Starts the writeback of `len` bytes at `offset` (and with `wait`, waits
/// until they are on disk). A hint only: the fsync at close is what makes the
/// data durable and reports any error, so failures here are ignored.
#[cfg(target_os = "linux")]
fn writeback(file: &File, offset: u64, len: u64, wait: bool) {
    use std::os::fd::AsRawFd;
    let flags = if wait {
        libc::SYNC_FILE_RANGE_WAIT_BEFORE | libc::SYNC_FILE_RANGE_WRITE | libc::SYNC_FILE_RANGE_WAIT_AFTER
    } else {
        libc::SYNC_FILE_RANGE_WRITE
    };
    // SAFETY: a plain syscall on a file descriptor this thread owns.
    unsafe { libc::sync_file_range(file.as_raw_fd(), offset as i64, len as i64, flags) };
}

/// Elsewhere the fsync at close does all the writeback.
#[cfg(not(target_os = "linux"))]
fn writeback(_file: &File, _offset: u64, _len: u64, _wait: bool) {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[test]
    fn writes_exactly_the_bytes_given_in_order() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("f");
        let mut s = Spool::new(File::create(&path).unwrap());
        let mut want = Vec::new();
        for i in 0..200u32 {
            let chunk: Vec<u8> = (0..(i * 997) % 70_000).map(|j| (i + j) as u8).collect();
            let got = s.put(|b| b.extend_from_slice(&chunk)).unwrap().to_vec();
            assert_eq!(got, chunk);
            want.extend_from_slice(&chunk);
        }
        drop(s.finish().unwrap());
        let mut have = Vec::new();
        File::open(&path).unwrap().read_to_end(&mut have).unwrap();
        assert!(have == want, "{} bytes written, {} given", have.len(), want.len());
    }
}
