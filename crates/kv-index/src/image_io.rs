//! Bytes in and out for the index image (`index::image`, `table`): fixed-size records written
//! and read in bulk, and a reader that refuses a count its input cannot hold before allocating.

use std::io::{self, Read, Write};

/// Why an image does not read.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// The bytes ran out, or the reader failed.
    #[error("reading the index image: {0}")]
    Io(#[from] io::Error),
    /// The bytes read do not describe an index.
    #[error("the index image is malformed: {0}")]
    Malformed(String),
}

pub(crate) fn malformed(what: impl Into<String>) -> ImageError {
    ImageError::Malformed(what.into())
}

/// Positions converted per bulk read or write.
pub(crate) const BULK: usize = 1 << 13;

pub(crate) fn put_u32(out: &mut impl Write, value: u32) -> io::Result<()> {
    out.write_all(&value.to_le_bytes())
}

pub(crate) fn put_u64(out: &mut impl Write, value: u64) -> io::Result<()> {
    out.write_all(&value.to_le_bytes())
}

pub(crate) fn put_str(out: &mut impl Write, value: &str) -> io::Result<()> {
    put_u32(out, value.len() as u32)?;
    out.write_all(value.as_bytes())
}

/// Writes `items` as fixed-size records, `BULK` at a time through `scratch`.
pub(crate) fn put_all<T, const N: usize>(
    out: &mut impl Write,
    scratch: &mut Vec<u8>,
    items: &[T],
    to_bytes: impl Fn(&T) -> [u8; N],
) -> io::Result<()> {
    for part in items.chunks(BULK) {
        scratch.clear();
        scratch.extend(part.iter().flat_map(&to_bytes));
        out.write_all(scratch)?;
    }
    Ok(())
}

/// The image being read: the reader, how many bytes it may still hold (so that a corrupt count
/// is refused before it allocates), and a buffer for bulk reads.
pub struct ImageInput<R> {
    inner: R,
    read: u64,
    limit: u64,
    scratch: Vec<u8>,
}

impl<R: Read> ImageInput<R> {
    /// `inner` holds an image of at most `limit` bytes.
    pub fn new(inner: R, limit: u64) -> ImageInput<R> {
        ImageInput {
            inner,
            read: 0,
            limit,
            scratch: Vec::new(),
        }
    }

    /// Bytes read so far.
    pub fn offset(&self) -> u64 {
        self.read
    }

    /// Takes back the reader.
    pub fn into_inner(self) -> R {
        self.inner
    }

    /// Fails unless `bytes` more may follow.
    pub(crate) fn expect(&self, bytes: u128) -> Result<(), ImageError> {
        if u128::from(self.read) + bytes > u128::from(self.limit) {
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
        }
        Ok(())
    }

    fn fill(&mut self, buf: &mut [u8]) -> Result<(), ImageError> {
        self.expect(buf.len() as u128)?;
        self.inner.read_exact(buf)?;
        self.read += buf.len() as u64;
        Ok(())
    }

    pub(crate) fn u8(&mut self) -> Result<u8, ImageError> {
        let mut bytes = [0; 1];
        self.fill(&mut bytes)?;
        Ok(bytes[0])
    }

    pub(crate) fn u32(&mut self) -> Result<u32, ImageError> {
        let mut bytes = [0; 4];
        self.fill(&mut bytes)?;
        Ok(u32::from_le_bytes(bytes))
    }

    pub fn u64(&mut self) -> Result<u64, ImageError> {
        let mut bytes = [0; 8];
        self.fill(&mut bytes)?;
        Ok(u64::from_le_bytes(bytes))
    }

    /// The next `len` bytes.
    pub fn bytes(&mut self, len: u64) -> Result<Vec<u8>, ImageError> {
        self.expect(u128::from(len))?;
        let mut bytes = vec![0; len as usize];
        self.fill(&mut bytes)?;
        Ok(bytes)
    }

    pub(crate) fn str(&mut self) -> Result<String, ImageError> {
        let len = self.u32()?;
        String::from_utf8(self.bytes(u64::from(len))?)
            .map_err(|_| malformed("a name that is not UTF-8"))
    }

    /// Reads `count` fixed-size records, `BULK` at a time; refuses a count the input cannot
    /// hold before allocating for it.
    pub(crate) fn all<T, const N: usize>(
        &mut self,
        count: usize,
        from_bytes: impl Fn([u8; N]) -> T,
    ) -> Result<Vec<T>, ImageError> {
        self.expect(count as u128 * N as u128)?;
        let mut items = Vec::with_capacity(count);
        self.each(count, |item| items.push(from_bytes(item)))?;
        Ok(items)
    }

    /// Calls `each` on `count` fixed-size records, `BULK` at a time.
    pub(crate) fn each<const N: usize>(
        &mut self,
        count: usize,
        mut each: impl FnMut([u8; N]),
    ) -> Result<(), ImageError> {
        self.expect(count as u128 * N as u128)?;
        let mut scratch = std::mem::take(&mut self.scratch);
        let mut left = count;
        while left > 0 {
            let n = left.min(BULK);
            scratch.resize(n * N, 0);
            self.fill(&mut scratch)?;
            for bytes in scratch.chunks_exact(N) {
                each(bytes.try_into().expect("N bytes"));
            }
            left -= n;
        }
        self.scratch = scratch;
        Ok(())
    }
}
