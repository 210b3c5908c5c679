//! A file written on its own thread: the sink encodes and hashes the next
//! buffer while the previous one is being written, so the dtype conversion
//! and checksums overlap the write instead of adding to it. The bytes, and
//! their order, are exactly those given.

use std::fs::File;
use std::io::Write;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::thread::JoinHandle;

/// A buffer is handed to the writer once it holds this many bytes.
const FLUSH: usize = 4 << 20;
/// Buffers queued for the writer at most (memory: about (DEPTH + 2) × FLUSH).
const DEPTH: usize = 2;

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
                for mut buf in rx {
                    file.write_all(&buf)?;
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
