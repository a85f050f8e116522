//! Snapshot files: the whole state at one log position, so that start-up replays only the log
//! after it.
//!
//! `snapshot-<position, 20 digits>.snap`: a header (magic, format version, the log position
//! it covers, payload length, CRC-32), then the payload.
//!
//! Format 3 (written now): the workers' liveness and fencing state (id, bridge incarnation and
//! batch number, last-seen time, expired flag) as one length-prefixed section, then the index's
//! own layout (`kv_index::Index::write_image`), both streamed, so that loading is large
//! sequential reads with no per-placement work and no second copy of the file in memory. Its
//! CRC covers the payload and then the header's position and length.
//!
//! Formats 1 and 2 (CRC of the payload: every worker with its placements per tier as
//! `(hash, component mask, tokens)`, imported block by block) still load.
//!
//! A snapshot is written to a `.tmp` file, synced and renamed, so a crash mid-write never
//! leaves a file with the final name: only whole snapshots are ever read. How the bytes reach
//! and leave the file (written back a slice at a time, summed on the way) is `file`'s.

mod file;

use std::io::{BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use kv_index::{
    CacheSpec, Export, ExportedWorker, Held, ImageError, ImageInput, Index, TableLayout,
};

use crate::log::{StateFileError, corrupt, io, sync_dir};
use crate::meta::{Meta, WorkerMeta};
use file::{Summed, Trickle};

const MAGIC: &[u8; 8] = b"SGLKVSNP";
/// The snapshot format this server writes and reads.
/// 2: each worker's bridge batch number after its incarnation (version 1, without it, still
/// loads, with none). 3: the index's own layout (1 and 2 still load). 4: the block table in
/// 8-byte slots (a format-3 table is re-homed as it loads). 5: slots a table doubles from
/// (a format-4 table is filled anew from the live blocks as it loads).
pub const VERSION: u32 = 5;
const HEADER_LEN: usize = 8 + 4 + 8 + 8 + 4;
/// Buffer of the streamed reads and writes.
const IO_BUFFER: usize = 1 << 20;

/// A snapshot's contents: the index and each worker's liveness and fencing state.
#[derive(Debug, Default)]
pub struct Contents {
    pub position: u64,
    pub index: Index,
    pub meta: Meta,
}

/// The snapshot files in `dir`, oldest first, as (position, path).
pub fn list(dir: &Path) -> Result<Vec<(u64, PathBuf)>, StateFileError> {
    crate::log::numbered_files(dir, "snapshot-", ".snap")
}

pub fn path(dir: &Path, position: u64) -> PathBuf {
    dir.join(format!("snapshot-{position:020}.snap"))
}

/// Starts `build` on a thread of its own at the idle scheduling class (`SCHED_IDLE`, else the
/// lowest priority): it runs only on CPU that queries and applies leave, and a waking writer
/// or query thread preempts it at once. With the server on one core, nice 19 was not enough
/// (apply p99 3x with a snapshot every second).
pub fn spawn_builder<T: Send + 'static>(
    build: impl FnOnce() -> T + Send + 'static,
) -> std::io::Result<std::thread::JoinHandle<T>> {
    std::thread::Builder::new()
        .name("kv-indexer-snapshot".into())
        .spawn(move || {
            use thread_priority::{
                NormalThreadSchedulePolicy, ThreadPriority, ThreadSchedulePolicy,
            };
            let idle = ThreadSchedulePolicy::Normal(NormalThreadSchedulePolicy::Idle);
            let lowered = thread_priority::set_thread_priority_and_policy(
                thread_priority::thread_native_id(),
                ThreadPriority::Min,
                idle,
            )
            .or_else(|_| ThreadPriority::Min.set_for_current());
            if let Err(error) = lowered {
                tracing::warn!(?error, "cannot lower the snapshot thread's priority");
            }
            build()
        })
}

/// A snapshot written in the background, as its builder reports it.
#[derive(Debug)]
pub(crate) struct Built {
    pub(crate) position: u64,
    pub(crate) bytes: u64,
    pub(crate) took: Duration,
    /// How long the fork paused the process (zero: built without a child).
    pub(crate) fork: Duration,
}

/// Writes the snapshot of `index` and `meta` at `position` into `dir`, streamed (tmp, sync,
/// rename, sync the directory); returns its size in bytes.
pub fn write(dir: &Path, position: u64, index: &Index, meta: &Meta) -> Result<u64, StateFileError> {
    let written = write_tmp(dir, position, index, meta, true, TableImage::Own)?;
    publish(dir, position, true)?;
    Ok(written)
}

/// Writes the snapshot's temporary file, whole but not synced; with `trickle` its pages go
/// to disk as it is written ([`Trickle`]), else they are left to [`publish`]. Returns its size.
pub(crate) fn write_tmp(
    dir: &Path,
    position: u64,
    index: &Index,
    meta: &Meta,
    trickle: bool,
    table: TableImage,
) -> Result<u64, StateFileError> {
    let tmp = tmp_path(dir, position);
    let file = std::fs::File::create(&tmp).map_err(io("creating", &tmp))?;
    let mut out = BufWriter::with_capacity(IO_BUFFER, Trickle::new(file, trickle));
    (|| {
        out.write_all(&header(position, 0, 0))?;
        let (len, crc) = write_payload(&mut out, position, index, meta, table)?;
        let mut file = out.into_inner().map_err(|error| error.into_error())?.file;
        file.seek(SeekFrom::Start(0))?;
        file.write_all(&header(position, len, crc))?;
        Ok(HEADER_LEN as u64 + len)
    })()
    .map_err(io("writing", &tmp))
}

/// Makes the temporary file [`write_tmp`] wrote the snapshot at `position`: its pages written
/// back [`TRICKLE`] bytes at a time unless already `written_back`, synced, renamed, and the
/// directory synced.
pub(crate) fn publish(dir: &Path, position: u64, written_back: bool) -> Result<(), StateFileError> {
    let (tmp, target) = (tmp_path(dir, position), path(dir, position));
    (|| {
        let file = std::fs::OpenOptions::new().write(true).open(&tmp)?;
        if !written_back {
            Trickle::new(file.try_clone()?, true).write_back_all(file.metadata()?.len())?;
        }
        file.sync_all()
    })()
    .map_err(io("syncing", &tmp))?;
    std::fs::rename(&tmp, &target).map_err(io("renaming", &tmp))?;
    sync_dir(dir)
}

/// Where the snapshot at `position` is written before it is renamed into place.
pub(crate) fn tmp_path(dir: &Path, position: u64) -> PathBuf {
    path(dir, position).with_extension("snap.tmp")
}

/// The whole snapshot file of `index` and `meta` at `position`, in memory (a fleet publishes
/// it in the shared log).
pub fn to_bytes(position: u64, index: &Index, meta: &Meta) -> Vec<u8> {
    let mut bytes = header(position, 0, 0).to_vec();
    let (len, crc) = write_payload(&mut bytes, position, index, meta, TableImage::Own)
        .expect("writing to memory");
    bytes[..HEADER_LEN].copy_from_slice(&header(position, len, crc));
    bytes
}

/// Writes the snapshot file `bytes` (of the snapshot at `position`) into `dir`: tmp, sync,
/// rename, sync the directory.
pub fn write_bytes(dir: &Path, position: u64, bytes: &[u8]) -> Result<(), StateFileError> {
    let target = path(dir, position);
    let tmp = target.with_extension("snap.tmp");
    {
        let mut file = std::fs::File::create(&tmp).map_err(io("creating", &tmp))?;
        file.write_all(bytes).map_err(io("writing", &tmp))?;
        file.sync_all().map_err(io("syncing", &tmp))?;
    }
    std::fs::rename(&tmp, &target).map_err(io("renaming", &tmp))?;
    sync_dir(dir)
}

fn header(position: u64, len: u64, crc: u32) -> [u8; HEADER_LEN] {
    let mut header = [0; HEADER_LEN];
    header[..8].copy_from_slice(MAGIC);
    header[8..12].copy_from_slice(&VERSION.to_le_bytes());
    header[12..20].copy_from_slice(&position.to_le_bytes());
    header[20..28].copy_from_slice(&len.to_le_bytes());
    header[28..32].copy_from_slice(&crc.to_le_bytes());
    header
}

/// Which block table a snapshot's image holds.
#[derive(Debug, Clone, Copy)]
pub(crate) enum TableImage {
    /// The index's own ([`Index::write_image`]).
    Own,
    /// One built from the live blocks ([`Index::write_image_with_fresh_table`]): the forked
    /// child's, which does not have the index's table.
    Fresh,
}

/// Writes the format-5 payload of the snapshot at `position`; returns its length and CRC-32.
fn write_payload(
    out: &mut impl Write,
    position: u64,
    index: &Index,
    meta: &Meta,
    table: TableImage,
) -> std::io::Result<(u64, u32)> {
    let mut out = Summed::new(out);
    let meta = encode_meta(meta);
    out.write_all(&(meta.len() as u64).to_le_bytes())?;
    out.write_all(&meta)?;
    match table {
        TableImage::Own => index.write_image(&mut out)?,
        TableImage::Fresh => index.write_image_with_fresh_table(&mut out)?,
    }
    Ok((out.len, out.crc_with(position)))
}

/// The worker state section: each worker's id and `WorkerMeta`, in id order.
fn encode_meta(meta: &Meta) -> Vec<u8> {
    let mut ids: Vec<&String> = meta.keys().collect();
    ids.sort_unstable();
    let mut out = Vec::with_capacity(64 * ids.len() + 4);
    put_u32(&mut out, ids.len() as u32);
    for id in ids {
        put_str(&mut out, id);
        put_meta(&mut out, &meta[id]);
    }
    out
}

fn decode_meta(r: &mut Reader<'_>) -> Option<Meta> {
    let count = r.u32()?;
    let mut meta = Meta::with_capacity(count.min(1 << 20) as usize);
    for _ in 0..count {
        let id = r.str()?;
        meta.insert(id, r.meta()?);
    }
    (r.at == r.bytes.len()).then_some(meta)
}

fn put_meta(out: &mut Vec<u8>, meta: &WorkerMeta) {
    out.extend_from_slice(&meta.incarnation.to_le_bytes());
    out.extend_from_slice(&meta.batch.to_le_bytes());
    out.extend_from_slice(&meta.last_seen_ms.to_le_bytes());
    out.push(u8::from(meta.expired));
}

/// Reads and checks the snapshot at `path`.
pub fn read(path: &Path) -> Result<Contents, StateFileError> {
    let mut file = std::fs::File::open(path).map_err(io("reading", path))?;
    let mut head = Vec::with_capacity(HEADER_LEN);
    (&mut file)
        .take(HEADER_LEN as u64)
        .read_to_end(&mut head)
        .map_err(io("reading", path))?;
    let header = check_header(path, &head)?;
    if header.version < 3 {
        let mut bytes = head;
        file.read_to_end(&mut bytes).map_err(io("reading", path))?;
        return from_bytes(path, &bytes);
    }
    let size = file.metadata().map_err(io("reading", path))?.len();
    let payload = size.saturating_sub(HEADER_LEN as u64);
    read_payload(
        path,
        &header,
        payload,
        BufReader::with_capacity(IO_BUFFER, file),
    )
}

/// Checks and decodes a whole snapshot file's `bytes`; `origin` names where they came from in
/// errors.
pub fn from_bytes(origin: &Path, bytes: &[u8]) -> Result<Contents, StateFileError> {
    let header = check_header(origin, bytes)?;
    let payload = &bytes[HEADER_LEN..];
    if header.version >= 3 {
        return read_payload(origin, &header, payload.len() as u64, payload);
    }
    header.check(origin, payload.len() as u64, crc32fast::hash(payload))?;
    let mut reader = Reader {
        bytes: payload,
        at: 0,
        version: header.version,
    };
    let (export, meta) = decode_export(&mut reader).ok_or_else(|| {
        corrupt(
            origin,
            (HEADER_LEN + reader.at) as u64,
            "the payload does not parse",
        )
    })?;
    Ok(Contents {
        position: header.position,
        index: Index::import(&export),
        meta,
    })
}

struct Header {
    version: u32,
    position: u64,
    len: u64,
    crc: u32,
}

impl Header {
    /// Checks a payload's length and checksum against the header's.
    fn check(&self, path: &Path, len: u64, crc: u32) -> Result<(), StateFileError> {
        if len != self.len {
            return Err(corrupt(
                path,
                20,
                "the payload length does not match the file",
            ));
        }
        if crc != self.crc {
            return Err(corrupt(
                path,
                HEADER_LEN as u64,
                "the payload checksum does not match",
            ));
        }
        Ok(())
    }
}

fn check_header(path: &Path, bytes: &[u8]) -> Result<Header, StateFileError> {
    crate::log::check_magic_and_version(path, bytes, MAGIC, VERSION, "snapshot")?;
    if bytes.len() < HEADER_LEN {
        return Err(corrupt(path, 0, "a snapshot header cut short"));
    }
    let word = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
    Ok(Header {
        version: u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes")),
        position: word(12),
        len: word(20),
        crc: u32::from_le_bytes(bytes[28..32].try_into().expect("4 bytes")),
    })
}

/// Reads a format-3, 4 or 5 payload of `size` bytes from `input` (positioned after the header): the
/// worker state section, then the index image; all of it must be the header's length and
/// checksum. When the payload does not parse, the rest is read too, so that damage is reported
/// as a checksum mismatch and only an intact payload that does not parse as malformed.
fn read_payload(
    path: &Path,
    header: &Header,
    size: u64,
    input: impl Read,
) -> Result<Contents, StateFileError> {
    // Bounded by what the file holds too: the header's length is only checked at the end.
    let mut input = ImageInput::new(Summed::new(input), header.len.min(size));
    let parsed = read_meta_section(&mut input).and_then(|meta| {
        let layout = match header.version {
            3 => TableLayout::Wide,
            4 => TableLayout::FixedFingerprints,
            _ => TableLayout::Packed,
        };
        let index = Index::read_image_of(&mut input, layout).map_err(|error| {
            let what = match error {
                ImageError::Io(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => {
                    "the payload is cut short".to_string()
                }
                other => other.to_string(),
            };
            (input.offset(), what)
        })?;
        Ok((meta, index))
    });
    let offset = input.offset();
    let mut summed = input.into_inner();
    let rest = std::io::copy(&mut summed, &mut std::io::sink()).map_err(io("reading", path))?;
    header.check(path, summed.len, summed.crc_with(header.position))?;
    let (meta, index) = parsed.map_err(|(at, what)| corrupt(path, HEADER_LEN as u64 + at, what))?;
    if rest != 0 {
        return Err(corrupt(
            path,
            HEADER_LEN as u64 + offset,
            "the payload has bytes after its end",
        ));
    }
    Ok(Contents {
        position: header.position,
        index,
        meta,
    })
}

/// The worker state section, read through `input`; an error carries its offset.
fn read_meta_section(input: &mut ImageInput<impl Read>) -> Result<Meta, (u64, String)> {
    let len = input.u64().map_err(|e| (input.offset(), e.to_string()))?;
    let start = input.offset();
    let bytes = input.bytes(len).map_err(|e| (start, e.to_string()))?;
    let mut reader = Reader {
        bytes: &bytes,
        at: 0,
        version: VERSION,
    };
    decode_meta(&mut reader).ok_or((
        start + reader.at as u64,
        "the worker state does not parse".into(),
    ))
}

/// Formats 1 and 2's payload (kept to test that they still load).
#[cfg(test)]
fn encode_export(export: &Export, meta: &Meta) -> Vec<u8> {
    let placements: usize = export
        .workers
        .iter()
        .map(|w| w.held.iter().map(Vec::len).sum::<usize>())
        .sum();
    let mut out = Vec::with_capacity(16 * placements + 64 * export.workers.len());
    put_u32(&mut out, export.workers.len() as u32);
    for worker in &export.workers {
        put_str(&mut out, &worker.id);
        put_str(&mut out, &worker.address);
        match worker.spec {
            None => out.push(0),
            Some(spec) => {
                out.push(1);
                for value in spec.to_words() {
                    put_u32(&mut out, value);
                }
            }
        }
        put_meta(&mut out, &meta.get(&worker.id).copied().unwrap_or_default());
        for held in &worker.held {
            put_u32(&mut out, held.len() as u32);
            for block in held {
                out.extend_from_slice(&block.hash.to_le_bytes());
                put_u32(&mut out, block.mask);
                put_u32(&mut out, block.tokens);
            }
        }
    }
    put_u32(&mut out, export.hits.len() as u32);
    for &(hash, count) in &export.hits {
        out.extend_from_slice(&hash.to_le_bytes());
        out.extend_from_slice(&count.to_le_bytes());
    }
    out
}

fn put_u32(out: &mut Vec<u8>, value: u32) {
    out.extend_from_slice(&value.to_le_bytes());
}

fn put_str(out: &mut Vec<u8>, value: &str) {
    put_u32(out, value.len() as u32);
    out.extend_from_slice(value.as_bytes());
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    /// The snapshot's format version.
    version: u32,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        let slice = self.bytes.get(self.at..self.at.checked_add(n)?)?;
        self.at += n;
        Some(slice)
    }
    fn u8(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
    fn str(&mut self) -> Option<String> {
        let len = self.u32()? as usize;
        String::from_utf8(self.take(len)?.to_vec()).ok()
    }
    fn meta(&mut self) -> Option<WorkerMeta> {
        Some(WorkerMeta {
            incarnation: self.u64()?,
            batch: if self.version >= 2 { self.u64()? } else { 0 },
            last_seen_ms: self.u64()?,
            expired: self.u8()? != 0,
        })
    }
}

/// Formats 1 and 2's payload.
fn decode_export(r: &mut Reader<'_>) -> Option<(Export, Meta)> {
    let count = r.u32()?;
    let (mut export, mut meta) = (Export::default(), Meta::new());
    for _ in 0..count {
        let (worker, worker_meta) = decode_worker(r)?;
        meta.insert(worker.id.clone(), worker_meta);
        export.workers.push(worker);
    }
    let hits = r.u32()?;
    for _ in 0..hits {
        let hash = r.u64()? as i64;
        export.hits.push((hash, r.u64()?));
    }
    (r.at == r.bytes.len()).then_some((export, meta))
}

fn decode_worker(r: &mut Reader<'_>) -> Option<(ExportedWorker, WorkerMeta)> {
    let id = r.str()?;
    let address = r.str()?;
    let spec = match r.u8()? {
        0 => None,
        1 => {
            let mut words = [0; 6];
            for word in &mut words {
                *word = r.u32()?;
            }
            Some(CacheSpec::from_words(words))
        }
        _ => return None,
    };
    let meta = r.meta()?;
    let mut held: [Vec<Held>; 3] = Default::default();
    for tier in &mut held {
        let n = r.u32()? as usize;
        tier.reserve(n.min(r.bytes.len() / 16));
        for _ in 0..n {
            tier.push(Held {
                hash: r.u64()? as i64,
                mask: r.u32()?,
                tokens: r.u32()?,
            });
        }
    }
    Some((
        ExportedWorker {
            id,
            address,
            spec,
            held,
        },
        meta,
    ))
}

#[cfg(test)]
pub(crate) mod tests {
    use kv_index::{ActionRequest, ApplyRequest};

    use super::*;

    /// Three workers, two tiers, a component-aware spec, a revoke that leaves a dead piece,
    /// hit counts, and fencing state, one worker of which holds nothing.
    pub(crate) fn sample() -> (Index, Meta) {
        let mut index = Index::new();
        let (report, revoke, hbm, dram) = (1, 2, 1, 2);
        let action = |action_type, tier, hashes: Vec<i64>, mask| ActionRequest {
            action_type,
            tier,
            component_masks: vec![mask; hashes.len()],
            block_sizes: vec![16; hashes.len()],
            hashes,
            parent_block_hash: None,
        };
        let mut apply = |id: &str, cache_spec, actions| {
            let request = ApplyRequest {
                worker_id: id.into(),
                seq: 0,
                worker_address: format!("http://{id}"),
                cache_spec,
                actions,
            };
            index.apply(&request.validate().unwrap());
        };
        apply("w-b", None, vec![action(report, hbm, (0..40).collect(), 0)]);
        let spec = CacheSpec {
            version: 1,
            components: 1,
            swa_window_tokens: 0,
            full_tier_mask: 6,
            swa_tier_mask: 0,
            mamba_tier_mask: 0,
        };
        apply(
            "w-a",
            Some(spec),
            vec![
                action(report, hbm, (0..20).collect(), 1),
                action(report, dram, (100..130).collect(), 1),
            ],
        );
        apply(
            "w-b",
            None,
            vec![action(revoke, hbm, (10..15).collect(), 0)],
        );
        index.count_hits(&[1, 2, 101]);
        let mut meta = Meta::new();
        for (id, incarnation) in [("w-a", 7), ("w-b", 9), ("w-c", 11)] {
            meta.insert(
                id.to_string(),
                WorkerMeta {
                    incarnation,
                    batch: incarnation + 1,
                    last_seen_ms: 1_000 * incarnation,
                    expired: id == "w-c",
                },
            );
        }
        (index, meta)
    }

    pub(crate) fn scratch_dir(name: &str) -> PathBuf {
        let dir = kv_testkit::temp_dir("kv-state-snapshot", name);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    pub(crate) fn same(a: &Contents, index: &Index, meta: &Meta, position: u64) {
        assert_eq!(a.position, position);
        assert_eq!(a.index.export(), index.export());
        assert_eq!(&a.meta, meta);
        a.index.check_invariants();
    }

    #[test]
    fn a_snapshot_reads_back_from_a_file_and_from_memory() {
        let (index, meta) = sample();
        let dir = scratch_dir("round-trip");
        let size = write(&dir, 42, &index, &meta).unwrap();
        let file = path(&dir, 42);
        assert_eq!(std::fs::metadata(&file).unwrap().len(), size);
        same(&read(&file).unwrap(), &index, &meta, 42);
        let bytes = to_bytes(42, &index, &meta);
        assert_eq!(bytes, std::fs::read(&file).unwrap());
        same(&from_bytes(&file, &bytes).unwrap(), &index, &meta, 42);
    }

    #[test]
    fn a_version_2_snapshot_still_loads() {
        let (index, meta) = sample();
        let payload = encode_export(&index.export(), &meta);
        let mut bytes = header(5, payload.len() as u64, crc32fast::hash(&payload)).to_vec();
        bytes[8..12].copy_from_slice(&2u32.to_le_bytes());
        bytes.extend_from_slice(&payload);
        let dir = scratch_dir("version-2");
        let file = path(&dir, 5);
        std::fs::write(&file, &bytes).unwrap();
        let loaded = read(&file).unwrap();
        assert_eq!(loaded.position, 5);
        assert_eq!(
            loaded.index.export().canonical(),
            index.export().canonical()
        );
        // Format 2 kept only the workers the index knows.
        let known: Meta = meta.into_iter().filter(|(id, _)| id != "w-c").collect();
        assert_eq!(loaded.meta, known);
    }

    /// Format-3 snapshots (16-byte slots, whole hashes) and format-4 ones (fingerprints from
    /// fixed bits) load as the index they held, the table re-homed or filled anew.
    #[test]
    fn version_3_and_4_snapshots_still_load() {
        let (index, meta) = sample();
        let fixtures: [(u32, &[u8]); 2] = [
            (3, include_bytes!("snapshot/fixtures/format-3-sample.snap")),
            (4, include_bytes!("snapshot/fixtures/format-4-sample.snap")),
        ];
        for (version, bytes) in fixtures {
            assert_eq!(bytes[8..12], version.to_le_bytes());
            let loaded = from_bytes(Path::new("fixture"), bytes).unwrap();
            same(&loaded, &index, &meta, 7);
            let file = path(&scratch_dir(&format!("version-{version}")), 7);
            std::fs::write(&file, bytes).unwrap();
            same(&read(&file).unwrap(), &index, &meta, 7);
        }
    }

    /// Every cut and every flipped byte of a snapshot is refused with a corruption error
    /// naming the file, never a panic and never a different state.
    #[test]
    fn damage_anywhere_is_refused() {
        let (index, meta) = sample();
        let bytes = to_bytes(3, &index, &meta);
        let origin = Path::new("snapshot-under-test");
        let refused = |damaged: &[u8], what: &str| match from_bytes(origin, damaged) {
            Err(StateFileError::Corrupt { path, .. }) => assert_eq!(path, origin, "{what}"),
            other => panic!("{what}: {other:?}"),
        };
        for cut in HEADER_LEN..bytes.len() {
            refused(&bytes[..cut], &format!("cut at {cut}"));
        }
        for at in 12..bytes.len() {
            let mut damaged = bytes.clone();
            damaged[at] ^= 0x5a;
            refused(&damaged, &format!("byte {at} flipped"));
        }
        let mut longer = bytes.clone();
        longer.push(0);
        refused(&longer, "a byte appended");
    }
}
