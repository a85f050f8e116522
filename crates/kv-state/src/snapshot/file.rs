//! How a snapshot's bytes reach and leave its file: written back a slice at a time
//! ([`Trickle`]), and summed on the way ([`Summed`]: length and CRC-32).

use std::io::{Read, Write};

/// Bytes a snapshot writes between two write-backs of what it wrote.
const TRICKLE: u64 = 8 << 20;

/// A file written front to back whose pages go to disk every [`TRICKLE`] bytes, waited for,
/// rather than all at its fsync: a large fsync makes the journal commit that the log's next
/// append or sync joins wait for all of it (measured: apply p99 6.9 → 38 ms with a 20 MB
/// snapshot every second).
pub(super) struct Trickle {
    pub(super) file: std::fs::File,
    written: u64,
    flushed: u64,
    on: bool,
}

impl Trickle {
    /// A file whose pages are written back as it is written when `on`, else left dirty.
    pub(super) fn new(file: std::fs::File, on: bool) -> Trickle {
        Trickle {
            file,
            written: 0,
            flushed: 0,
            on,
        }
    }

    fn write_back(&mut self) -> std::io::Result<()> {
        use std::os::fd::AsRawFd;
        let (offset, len) = (self.flushed as i64, (self.written - self.flushed) as i64);
        let flags = libc::SYNC_FILE_RANGE_WAIT_BEFORE
            | libc::SYNC_FILE_RANGE_WRITE
            | libc::SYNC_FILE_RANGE_WAIT_AFTER;
        // SAFETY: a plain syscall on a file descriptor this struct owns, with no pointers.
        #[allow(unsafe_code)]
        let done = unsafe { libc::sync_file_range(self.file.as_raw_fd(), offset, len, flags) };
        if done != 0 {
            return Err(std::io::Error::last_os_error());
        }
        self.flushed = self.written;
        Ok(())
    }

    /// Writes back the first `len` bytes of a file written without waits, [`TRICKLE`] at a time.
    pub(super) fn write_back_all(&mut self, len: u64) -> std::io::Result<()> {
        while self.flushed < len {
            self.written = (self.flushed + TRICKLE).min(len);
            self.write_back()?;
        }
        Ok(())
    }
}

impl Write for Trickle {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.file.write(buf)?;
        self.written += n as u64;
        if self.on && self.written - self.flushed >= TRICKLE {
            self.write_back()?;
        }
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

/// A reader or writer that sums what passes: its length and CRC-32.
pub(super) struct Summed<T> {
    inner: T,
    pub(super) len: u64,
    crc: crc32fast::Hasher,
}

impl<T> Summed<T> {
    pub(super) fn new(inner: T) -> Summed<T> {
        Summed {
            inner,
            len: 0,
            crc: crc32fast::Hasher::new(),
        }
    }

    /// Format 3's checksum: the payload, then the header's position and length, so that a
    /// damaged header is refused as well.
    pub(super) fn crc_with(&self, position: u64) -> u32 {
        let mut crc = self.crc.clone();
        crc.update(&position.to_le_bytes());
        crc.update(&self.len.to_le_bytes());
        crc.finalize()
    }
}

impl<T: Write> Write for Summed<T> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.crc.update(&buf[..n]);
        self.len += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

impl<T: Read> Read for Summed<T> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.crc.update(&buf[..n]);
        self.len += n as u64;
        Ok(n)
    }
}
