//! The local append-only log: segment files of framed records in a state directory.
//!
//! A segment is `log-<first position, 20 digits>.seg`: a header (magic, format version, the
//! position of its first record), then records framed as `[payload length u32 LE][CRC-32 of
//! that length u32 LE][CRC-32 of the payload u32 LE][payload]`. A record's position is its
//! index in the whole log (0, 1, …). The length has a checksum of its own, so that a damaged
//! length is told from a record cut short by a crash.
//!
//! Reading stops at the first frame that does not check. In the last segment, a frame that runs
//! past the end of the file, or a bad checksum on the very last frame, is a torn write (the
//! process died mid-append): it is cut, with a WARN. Anything else (a bad frame with more
//! frames after it, a bad frame in an older segment, a bad header) is corruption, reported with
//! the file and the byte offset: the log no longer explains the index, so start-up stops.
//!
//! A fleet's replicas share a log on Redis instead (`crate::stream`), with the same records.

use std::fs::{File, OpenOptions};
use std::io::{BufReader, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use tracing::{info, warn};

const MAGIC: &[u8; 8] = b"SGLKVLOG";
const VERSION: u32 = 1;
const HEADER_LEN: u64 = 8 + 4 + 8;
const FRAME_LEN: usize = 12;
/// A record larger than this cannot be one we wrote (an apply is at most 8 MiB on the wire).
pub const MAX_RECORD_BYTES: usize = 64 * 1024 * 1024;

/// What can go wrong with a file of the state directory (the log, a snapshot, the directory
/// itself); every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum StateFileError {
    #[error("{op} {path:?}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path:?} at byte {offset}: {what}")]
    Corrupt {
        path: PathBuf,
        offset: u64,
        what: String,
    },
    #[error("{path:?}: log format version {version} is newer than this server reads ({VERSION})")]
    NewerVersion { path: PathBuf, version: u32 },
    #[error(
        "the log starts at position {first} but position {wanted} is needed: records were trimmed away"
    )]
    Gap { first: u64, wanted: u64 },
}

impl StateFileError {
    /// Whether this is a write that found no room (ENOSPC, or EDQUOT: over a quota): the
    /// state directory's disk is full, which passes once room is made. A failed sync never is
    /// (what it failed to write back is unknown, so it is not retried).
    pub fn is_disk_full(&self) -> bool {
        match self {
            StateFileError::Io { op, source, .. } => {
                *op != "syncing"
                    && matches!(source.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT))
            }
            _ => false,
        }
    }
}

pub(crate) fn io<'a>(
    op: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> StateFileError + 'a {
    move |source| StateFileError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// One segment file on disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    pub first: u64,
    pub path: PathBuf,
}

/// The segments in `dir`, oldest first.
pub fn segments(dir: &Path) -> Result<Vec<Segment>, StateFileError> {
    Ok(numbered_files(dir, "log-", ".seg")?
        .into_iter()
        .map(|(first, path)| Segment { first, path })
        .collect())
}

/// The files of `dir` named `<prefix><number><suffix>`, as (number, path), by number.
pub fn numbered_files(
    dir: &Path,
    prefix: &str,
    suffix: &str,
) -> Result<Vec<(u64, PathBuf)>, StateFileError> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io("listing", dir))? {
        let entry = entry.map_err(io("listing", dir))?;
        let name = entry.file_name();
        let number = name
            .to_str()
            .and_then(|n| n.strip_prefix(prefix))
            .and_then(|n| n.strip_suffix(suffix))
            .and_then(|n| n.parse::<u64>().ok());
        if let Some(number) = number {
            found.push((number, entry.path()));
        }
    }
    found.sort();
    Ok(found)
}

fn segment_path(dir: &Path, first: u64) -> PathBuf {
    dir.join(format!("log-{first:020}.seg"))
}

/// The records of one segment, checked. `last` says whether it is the newest segment (where
/// a torn tail is cut rather than reported); returns the records and the byte length of the
/// part that checks.
fn read_segment(segment: &Segment, last: bool) -> Result<(Vec<Vec<u8>>, u64), StateFileError> {
    let path = &segment.path;
    let file = File::open(path).map_err(io("opening", path))?;
    let size = file
        .metadata()
        .map_err(io("reading the size of", path))?
        .len();
    let mut reader = BufReader::with_capacity(1 << 20, file);
    let mut header = [0u8; HEADER_LEN as usize];
    if size < HEADER_LEN || reader.read_exact(&mut header).is_err() {
        if last && size < HEADER_LEN {
            // A crash right after creating the file, before its header was out.
            return Ok((Vec::new(), 0));
        }
        return Err(corrupt(path, 0, "no segment header"));
    }
    check_header(path, &header, segment.first)?;
    let mut records = Vec::new();
    let mut offset = HEADER_LEN;
    while offset < size {
        match read_frame(&mut reader, size - offset) {
            Ok(payload) => {
                offset += (FRAME_LEN + payload.len()) as u64;
                records.push(payload);
            }
            Err(bad) => {
                let at_tail = bad.runs_past_end || offset + bad.frame_len >= size;
                if last && at_tail {
                    warn!(
                        file = %path.display(),
                        offset,
                        reason = bad.what,
                        "cutting a torn record at the end of the log (the server stopped mid-write)"
                    );
                    return Ok((records, offset));
                }
                return Err(corrupt(path, offset, bad.what));
            }
        }
    }
    Ok((records, offset))
}

pub(crate) fn corrupt(path: &Path, offset: u64, what: impl Into<String>) -> StateFileError {
    StateFileError::Corrupt {
        path: path.to_path_buf(),
        offset,
        what: what.into(),
    }
}

/// Checks a file's 8-byte magic and the format version after it (at most `newest`).
pub fn check_magic_and_version(
    path: &Path,
    bytes: &[u8],
    magic: &[u8; 8],
    newest: u32,
    what: &str,
) -> Result<(), StateFileError> {
    if bytes.len() < 12 || &bytes[..8] != magic {
        return Err(corrupt(path, 0, format!("not a {what} (bad magic)")));
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if version > newest {
        return Err(StateFileError::NewerVersion {
            path: path.to_path_buf(),
            version,
        });
    }
    Ok(())
}

fn check_header(path: &Path, header: &[u8], first: u64) -> Result<(), StateFileError> {
    check_magic_and_version(path, header, MAGIC, VERSION, "log segment")?;
    let stored = u64::from_le_bytes(header[12..20].try_into().expect("8 bytes"));
    if stored != first {
        return Err(corrupt(
            path,
            12,
            format!("the header says position {stored}, the name {first}"),
        ));
    }
    Ok(())
}

struct BadFrame {
    what: &'static str,
    frame_len: u64,
    runs_past_end: bool,
}

fn read_frame(reader: &mut impl Read, remaining: u64) -> Result<Vec<u8>, BadFrame> {
    let bad = |what, frame_len, runs_past_end| BadFrame {
        what,
        frame_len,
        runs_past_end,
    };
    if remaining < FRAME_LEN as u64 {
        return Err(bad("a frame header cut short", remaining, true));
    }
    let mut frame = [0u8; FRAME_LEN];
    reader
        .read_exact(&mut frame)
        .map_err(|_| bad("unreadable frame header", remaining, true))?;
    let word = |i: usize| u32::from_le_bytes(frame[i..i + 4].try_into().expect("4 bytes"));
    let (len, len_crc, crc) = (word(0) as usize, word(4), word(8));
    let frame_len = (FRAME_LEN + len) as u64;
    if crc32fast::hash(&frame[..4]) != len_crc || len > MAX_RECORD_BYTES {
        // Not a cut: a damaged length. Only a frame ending the file may be a torn write.
        return Err(bad(
            "a frame header whose checksum does not match",
            FRAME_LEN as u64,
            false,
        ));
    }
    if frame_len > remaining {
        return Err(bad("a record cut short", frame_len, true));
    }
    let mut payload = vec![0u8; len];
    reader
        .read_exact(&mut payload)
        .map_err(|_| bad("unreadable record", frame_len, true))?;
    if crc32fast::hash(&payload) != crc {
        return Err(bad(
            "a record whose checksum does not match",
            frame_len,
            false,
        ));
    }
    Ok(payload)
}

/// Appends the frame of `payload` to `out`.
pub fn frame(payload: &[u8], out: &mut Vec<u8>) {
    let len = (payload.len() as u32).to_le_bytes();
    out.extend_from_slice(&len);
    out.extend_from_slice(&crc32fast::hash(&len).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
    out.extend_from_slice(payload);
}

/// The log as segment files in a directory.
pub struct FileLog {
    dir: PathBuf,
    file: File,
    path: PathBuf,
    end: u64,
    /// The segment's length up to its last whole record: a failed append is cut back to it.
    len: u64,
    buffer: Vec<u8>,
}

impl FileLog {
    /// Opens the log in `dir`: checks every segment, cuts a torn tail, and appends after the
    /// last good record (in a new segment when the directory has none).
    pub fn open(dir: &Path) -> Result<FileLog, StateFileError> {
        let segments = segments(dir)?;
        let Some(newest) = segments.last() else {
            return FileLog::create(dir, 0);
        };
        let (records, good_len) = read_segment(newest, true)?;
        let end = newest.first + records.len() as u64;
        if good_len < HEADER_LEN {
            std::fs::remove_file(&newest.path).map_err(io("removing", &newest.path))?;
            return FileLog::create(dir, end);
        }
        let file = OpenOptions::new()
            .write(true)
            .open(&newest.path)
            .map_err(io("opening", &newest.path))?;
        file.set_len(good_len)
            .map_err(io("cutting", &newest.path))?;
        let mut log = FileLog {
            dir: dir.to_path_buf(),
            file,
            path: newest.path.clone(),
            end,
            len: good_len,
            buffer: Vec::new(),
        };
        log.file
            .seek(SeekFrom::Start(good_len))
            .map_err(io("seeking", &newest.path))?;
        log.sync()?;
        Ok(log)
    }

    fn create(dir: &Path, first: u64) -> Result<FileLog, StateFileError> {
        let path = segment_path(dir, first);
        let mut file = OpenOptions::new()
            .create_new(true)
            .write(true)
            .open(&path)
            .map_err(io("creating", &path))?;
        let mut header = Vec::with_capacity(HEADER_LEN as usize);
        header.extend_from_slice(MAGIC);
        header.extend_from_slice(&VERSION.to_le_bytes());
        header.extend_from_slice(&first.to_le_bytes());
        if let Err(error) = file.write_all(&header) {
            // A header that did not fit (a full disk): gone, so that a later rotation can
            // create the segment again.
            let _ = std::fs::remove_file(&path);
            return Err(io("writing", &path)(error));
        }
        file.sync_data().map_err(io("syncing", &path))?;
        sync_dir(dir)?;
        Ok(FileLog {
            dir: dir.to_path_buf(),
            file,
            path,
            end: first,
            len: HEADER_LEN,
            buffer: Vec::new(),
        })
    }

    /// Ends the current segment (synced) and starts a new one at the current end, so that
    /// everything before [`FileLog::end`] is in closed segments.
    pub fn rotate(&mut self) -> Result<(), StateFileError> {
        let started = std::time::Instant::now();
        self.sync()?;
        let synced = started.elapsed();
        let next = FileLog::create(&self.dir, self.end)?;
        info!(
            position = self.end,
            sync_us = synced.as_micros() as u64,
            took_us = started.elapsed().as_micros() as u64,
            "log segment rotated"
        );
        *self = next;
        Ok(())
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Another handle on the segment being appended to (for a syncer thread).
    pub fn segment_file(&self) -> Result<File, StateFileError> {
        self.file
            .try_clone()
            .map_err(io("duplicating the handle of", &self.path))
    }
}

/// The log's operations: records (opaque bytes) appended in order, made durable, read back
/// from any retained position, trimmed.
impl FileLog {
    /// Appends `records` in order and writes them out (not yet synced); returns the position
    /// of the first.
    pub fn append(&mut self, records: &[Vec<u8>]) -> Result<u64, StateFileError> {
        let first = self.end;
        self.buffer.clear();
        for record in records {
            frame(record, &mut self.buffer);
        }
        if let Err(error) = self.file.write_all(&self.buffer) {
            // Part of the group may be in the file (a disk that filled mid-write): cut back
            // to the last whole record, so that the next append follows it.
            self.file
                .set_len(self.len)
                .and_then(|()| self.file.seek(SeekFrom::Start(self.len)))
                .map_err(io("cutting a failed append from", &self.path))?;
            return Err(io("appending to", &self.path)(error));
        }
        self.len += self.buffer.len() as u64;
        self.end += records.len() as u64;
        Ok(first)
    }

    /// Makes everything appended so far durable (fdatasync).
    pub fn sync(&mut self) -> Result<(), StateFileError> {
        self.file.sync_data().map_err(io("syncing", &self.path))
    }

    /// The position the next record will get.
    pub fn end(&self) -> u64 {
        self.end
    }

    /// Every retained record from `position` on, in order, with its position.
    pub fn read_from(&self, position: u64) -> Result<Vec<(u64, Vec<u8>)>, StateFileError> {
        read_dir_from(&self.dir, position, None)
    }

    /// Forgets the records before `position` (whole segments only: some may remain).
    pub fn trim_before(&mut self, position: u64) -> Result<(), StateFileError> {
        trim_dir_before(&self.dir, position)
    }
}

/// Deletes the segments of `dir` whose records all come before `position`: those followed by
/// a segment starting at or before it (so never the newest one, the one being appended to).
/// The writer never rotates while this runs: it rotates only once the snapshot builder that
/// prunes has finished, and at shutdown it joins the builder first.
pub fn trim_dir_before(dir: &Path, position: u64) -> Result<(), StateFileError> {
    let segments = segments(dir)?;
    for pair in segments.windows(2) {
        // A segment holds the records up to the next one's first.
        if pair[1].first <= position {
            std::fs::remove_file(&pair[0].path).map_err(io("removing", &pair[0].path))?;
        }
    }
    Ok(())
}

/// The records of the segments in `dir` from `position` on (and before `until`, when given),
/// checked; the newest segment may end in a torn record, which is left out.
pub fn read_dir_from(
    dir: &Path,
    position: u64,
    until: Option<u64>,
) -> Result<Vec<(u64, Vec<u8>)>, StateFileError> {
    let segments = segments(dir)?;
    let mut out = Vec::new();
    let mut expected = None;
    for (i, segment) in segments.iter().enumerate() {
        let next_first = segments.get(i + 1).map(|s| s.first);
        if next_first.is_some_and(|next| next <= position) {
            continue;
        }
        if until.is_some_and(|until| segment.first >= until) {
            break;
        }
        if let Some(expected) = expected
            && segment.first != expected
        {
            return Err(corrupt(
                &segment.path,
                0,
                format!(
                    "starts at position {}, the segment before ends at {expected}",
                    segment.first
                ),
            ));
        }
        let (records, _) = read_segment(segment, next_first.is_none())?;
        if out.is_empty() && segment.first > position {
            return Err(StateFileError::Gap {
                first: segment.first,
                wanted: position,
            });
        }
        expected = Some(segment.first + records.len() as u64);
        for (k, record) in records.into_iter().enumerate() {
            let at = segment.first + k as u64;
            if at >= position && until.is_none_or(|until| at < until) {
                out.push((at, record));
            }
        }
    }
    Ok(out)
}

/// Makes a directory's entries (a new or renamed file) durable.
pub fn sync_dir(dir: &Path) -> Result<(), StateFileError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io("syncing the directory", dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn records(n: usize, size: usize) -> Vec<Vec<u8>> {
        (0..n).map(|i| vec![i as u8; size + i]).collect()
    }

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kv-log-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn positions(read: &[(u64, Vec<u8>)]) -> Vec<u64> {
        read.iter().map(|(p, _)| *p).collect()
    }

    #[test]
    fn reads_back_what_was_appended_across_segments_and_reopens() {
        let dir = temp_dir("roundtrip");
        let mut log = FileLog::open(&dir).unwrap();
        assert_eq!(log.append(&records(3, 10)).unwrap(), 0);
        log.rotate().unwrap();
        assert_eq!(log.append(&records(2, 5)).unwrap(), 3);
        log.sync().unwrap();
        let all = log.read_from(0).unwrap();
        assert_eq!(positions(&all), [0, 1, 2, 3, 4]);
        assert_eq!(all[4].1, records(2, 5)[1]);
        assert_eq!(positions(&log.read_from(2).unwrap()), [2, 3, 4]);
        drop(log);
        let mut reopened = FileLog::open(&dir).unwrap();
        assert_eq!(reopened.end(), 5);
        assert_eq!(reopened.append(&records(1, 1)).unwrap(), 5);
        assert_eq!(read_dir_from(&dir, 0, Some(3)).unwrap().len(), 3);
    }

    #[test]
    fn cuts_a_torn_tail_and_appends_after_it() {
        let dir = temp_dir("torn");
        let mut log = FileLog::open(&dir).unwrap();
        log.append(&records(4, 100)).unwrap();
        log.sync().unwrap();
        drop(log);
        let path = segment_path(&dir, 0);
        let size = std::fs::metadata(&path).unwrap().len();
        // Half of the last record made it to disk.
        OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(size - 50)
            .unwrap();
        let mut log = FileLog::open(&dir).unwrap();
        assert_eq!(log.end(), 3);
        log.append(&records(1, 7)).unwrap();
        let read = log.read_from(0).unwrap();
        assert_eq!(positions(&read), [0, 1, 2, 3]);
        assert_eq!(read[3].1, records(1, 7)[0]);
    }

    /// Three records of 100+ bytes, `damage` done to the bytes of the segment at the offset
    /// of the second record, then the error of opening the log again.
    fn open_damaged(name: &str, damage: impl FnOnce(&mut [u8], usize)) -> String {
        let dir = temp_dir(name);
        let mut log = FileLog::open(&dir).unwrap();
        log.append(&records(3, 100)).unwrap();
        drop(log);
        let path = segment_path(&dir, 0);
        let mut bytes = std::fs::read(&path).unwrap();
        damage(&mut bytes, HEADER_LEN as usize + FRAME_LEN + 100);
        std::fs::write(&path, &bytes).unwrap();
        let error = FileLog::open(&dir)
            .err()
            .expect("corruption stops the open");
        error.to_string()
    }

    const SECOND: usize = HEADER_LEN as usize + FRAME_LEN + 100;

    #[test]
    fn a_flipped_byte_before_the_tail_is_corruption_naming_file_and_offset() {
        let text = open_damaged("flip", |bytes, second| {
            bytes[second + FRAME_LEN + 3] ^= 0x40
        });
        assert!(text.contains(&format!("at byte {SECOND}")), "{text}");
        assert!(text.contains("log-00000000000000000000.seg"), "{text}");
        assert!(text.contains("checksum"), "{text}");
    }

    #[test]
    fn a_damaged_length_before_the_tail_is_corruption_not_a_cut() {
        // The length now runs far past the end of the file.
        let text = open_damaged("length", |bytes, second| bytes[second + 3] = 0x7f);
        assert!(text.contains(&format!("at byte {SECOND}")), "{text}");
    }

    /// Flips the last byte of the first segment (its last record's payload).
    fn flip_last_byte(dir: &Path) {
        let path = segment_path(dir, 0);
        let mut bytes = std::fs::read(&path).unwrap();
        *bytes.last_mut().unwrap() ^= 1;
        std::fs::write(&path, &bytes).unwrap();
    }

    #[test]
    fn a_flipped_byte_in_the_last_record_is_a_torn_write() {
        let dir = temp_dir("flip-last");
        FileLog::open(&dir)
            .unwrap()
            .append(&records(2, 100))
            .unwrap();
        flip_last_byte(&dir);
        assert_eq!(FileLog::open(&dir).unwrap().end(), 1);
    }

    #[test]
    fn corruption_in_an_older_segment_is_never_cut() {
        let dir = temp_dir("old");
        let mut log = FileLog::open(&dir).unwrap();
        log.append(&records(2, 10)).unwrap();
        log.rotate().unwrap();
        log.append(&records(2, 10)).unwrap();
        drop(log);
        flip_last_byte(&dir);
        let error = FileLog::open(&dir).unwrap().read_from(0).unwrap_err();
        assert!(matches!(error, StateFileError::Corrupt { .. }), "{error}");
    }

    #[test]
    fn a_newer_format_version_is_refused() {
        let dir = temp_dir("version");
        drop(FileLog::open(&dir).unwrap());
        let path = segment_path(&dir, 0);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[8..12].copy_from_slice(&7u32.to_le_bytes());
        std::fs::write(&path, &bytes).unwrap();
        let error = FileLog::open(&dir).err().unwrap();
        assert!(error.to_string().contains("version 7 is newer"), "{error}");
    }

    #[test]
    fn trims_whole_segments_before_a_position_and_reports_the_gap() {
        let dir = temp_dir("trim");
        let mut log = FileLog::open(&dir).unwrap();
        log.append(&records(3, 1)).unwrap();
        log.rotate().unwrap();
        log.append(&records(3, 1)).unwrap();
        log.rotate().unwrap();
        log.trim_before(4).unwrap();
        assert_eq!(positions(&log.read_from(3).unwrap()), [3, 4, 5]);
        let gap = log.read_from(1).unwrap_err();
        assert!(
            matches!(
                gap,
                StateFileError::Gap {
                    first: 3,
                    wanted: 1
                }
            ),
            "{gap}"
        );
    }
}
