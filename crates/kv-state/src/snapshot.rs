//! Snapshot files: the whole state at one log position, so that start-up replays only the log
//! after it.
//!
//! `snapshot-<position, 20 digits>.snap`: a header (magic, format version, the log position
//! it covers, payload length, CRC-32 of the payload), then the payload: every worker (id,
//! address, spec, bridge incarnation and batch number, last-seen time, expired flag, and its placements per tier
//! in chain order as `(hash, component mask, tokens)`), then the hit counts. A snapshot is
//! written to a `.tmp` file, synced and renamed, so a crash mid-write never leaves a file with
//! the final name: only whole snapshots are ever read.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use kv_index::{CacheSpec, Export, ExportedWorker, Held};

use crate::log::{LogError, sync_dir};
use crate::meta::WorkerMeta;

const MAGIC: &[u8; 8] = b"SGLKVSNP";
/// The snapshot format this server writes and reads.
/// 2: each worker's bridge batch number after its incarnation (version 1, without it, still
/// loads, with none).
pub const VERSION: u32 = 2;
const HEADER_LEN: usize = 8 + 4 + 8 + 8 + 4;

/// A snapshot's contents: the index export and each worker's liveness and fencing state.
#[derive(Debug, Default)]
pub struct Contents {
    pub position: u64,
    pub export: Export,
    pub meta: HashMap<String, WorkerMeta>,
}

/// The snapshot files in `dir`, oldest first, as (position, path).
pub fn list(dir: &Path) -> Result<Vec<(u64, PathBuf)>, LogError> {
    crate::log::numbered_files(dir, "snapshot-", ".snap")
}

pub fn path(dir: &Path, position: u64) -> PathBuf {
    dir.join(format!("snapshot-{position:020}.snap"))
}

/// Writes `contents` as the snapshot at its position (tmp, sync, rename, sync the directory);
/// returns its size in bytes.
pub fn write(dir: &Path, contents: &Contents) -> Result<u64, LogError> {
    let bytes = to_bytes(contents);
    write_bytes(dir, contents.position, &bytes)?;
    Ok(bytes.len() as u64)
}

/// The whole snapshot file of `contents`: header and payload.
pub fn to_bytes(contents: &Contents) -> Vec<u8> {
    let payload = encode(contents);
    let mut bytes = Vec::with_capacity(HEADER_LEN + payload.len());
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&VERSION.to_le_bytes());
    bytes.extend_from_slice(&contents.position.to_le_bytes());
    bytes.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
    bytes.extend_from_slice(&payload);
    bytes
}

/// Writes the snapshot file `bytes` (of the snapshot at `position`) into `dir`: tmp, sync,
/// rename, sync the directory.
pub fn write_bytes(dir: &Path, position: u64, bytes: &[u8]) -> Result<(), LogError> {
    let target = path(dir, position);
    let tmp = target.with_extension("snap.tmp");
    let io = |op: &'static str, path: &Path| {
        let path = path.to_path_buf();
        move |source| LogError::Io { op, path, source }
    };
    {
        use std::io::Write;
        let mut file = std::fs::File::create(&tmp).map_err(io("creating", &tmp))?;
        file.write_all(bytes).map_err(io("writing", &tmp))?;
        file.sync_all().map_err(io("syncing", &tmp))?;
    }
    std::fs::rename(&tmp, &target).map_err(io("renaming", &tmp))?;
    sync_dir(dir)
}

/// Reads and checks the snapshot at `path`.
pub fn read(path: &Path) -> Result<Contents, LogError> {
    let bytes = std::fs::read(path).map_err(|source| LogError::Io {
        op: "reading",
        path: path.to_path_buf(),
        source,
    })?;
    from_bytes(path, &bytes)
}

/// Checks and decodes a whole snapshot file's `bytes`; `origin` names where they came from in
/// errors.
pub fn from_bytes(origin: &Path, bytes: &[u8]) -> Result<Contents, LogError> {
    let path = origin;
    let corrupt = |offset: usize, what: &str| LogError::Corrupt {
        path: path.to_path_buf(),
        offset: offset as u64,
        what: what.to_string(),
    };
    crate::log::check_magic_and_version(path, bytes, MAGIC, VERSION, "snapshot")?;
    if bytes.len() < HEADER_LEN {
        return Err(corrupt(0, "a snapshot header cut short"));
    }
    let position = u64::from_le_bytes(bytes[12..20].try_into().expect("8 bytes"));
    let len = u64::from_le_bytes(bytes[20..28].try_into().expect("8 bytes"));
    let crc = u32::from_le_bytes(bytes[28..32].try_into().expect("4 bytes"));
    let payload = &bytes[HEADER_LEN..];
    if payload.len() as u64 != len {
        return Err(corrupt(20, "the payload length does not match the file"));
    }
    if crc32fast::hash(payload) != crc {
        return Err(corrupt(HEADER_LEN, "the payload checksum does not match"));
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    let mut reader = Reader {
        bytes: payload,
        at: 0,
        version,
    };
    decode(&mut reader, position)
        .ok_or_else(|| corrupt(HEADER_LEN + reader.at, "the payload does not parse"))
}

fn encode(contents: &Contents) -> Vec<u8> {
    let placements: usize = contents
        .export
        .workers
        .iter()
        .map(|w| w.held.iter().map(Vec::len).sum::<usize>())
        .sum();
    let mut out = Vec::with_capacity(16 * placements + 64 * contents.export.workers.len());
    put_u32(&mut out, contents.export.workers.len() as u32);
    for worker in &contents.export.workers {
        put_str(&mut out, &worker.id);
        put_str(&mut out, &worker.address);
        match worker.spec {
            None => out.push(0),
            Some(spec) => {
                out.push(1);
                for value in [
                    spec.version,
                    spec.components,
                    spec.swa_window_tokens,
                    spec.full_tier_mask,
                    spec.swa_tier_mask,
                    spec.mamba_tier_mask,
                ] {
                    put_u32(&mut out, value);
                }
            }
        }
        let meta = contents.meta.get(&worker.id).copied().unwrap_or_default();
        out.extend_from_slice(&meta.incarnation.to_le_bytes());
        out.extend_from_slice(&meta.batch.to_le_bytes());
        out.extend_from_slice(&meta.last_seen_ms.to_le_bytes());
        out.push(u8::from(meta.expired));
        for held in &worker.held {
            put_u32(&mut out, held.len() as u32);
            for block in held {
                out.extend_from_slice(&block.hash.to_le_bytes());
                put_u32(&mut out, block.mask);
                put_u32(&mut out, block.tokens);
            }
        }
    }
    put_u32(&mut out, contents.export.hits.len() as u32);
    for &(hash, count) in &contents.export.hits {
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
}

fn decode(r: &mut Reader<'_>, position: u64) -> Option<Contents> {
    let count = r.u32()?;
    let mut contents = Contents {
        position,
        ..Contents::default()
    };
    for _ in 0..count {
        let (worker, meta) = decode_worker(r)?;
        contents.meta.insert(worker.id.clone(), meta);
        contents.export.workers.push(worker);
    }
    let hits = r.u32()?;
    for _ in 0..hits {
        let hash = r.u64()? as i64;
        contents.export.hits.push((hash, r.u64()?));
    }
    (r.at == r.bytes.len()).then_some(contents)
}

fn decode_worker(r: &mut Reader<'_>) -> Option<(ExportedWorker, WorkerMeta)> {
    let id = r.str()?;
    let address = r.str()?;
    let spec = match r.u8()? {
        0 => None,
        1 => Some(CacheSpec {
            version: r.u32()?,
            components: r.u32()?,
            swa_window_tokens: r.u32()?,
            full_tier_mask: r.u32()?,
            swa_tier_mask: r.u32()?,
            mamba_tier_mask: r.u32()?,
        }),
        _ => return None,
    };
    let meta = WorkerMeta {
        incarnation: r.u64()?,
        batch: if r.version >= 2 { r.u64()? } else { 0 },
        last_seen_ms: r.u64()?,
        expired: r.u8()? != 0,
    };
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
