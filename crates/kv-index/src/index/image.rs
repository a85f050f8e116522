//! The index's own layout as bytes, and back: what a snapshot stores since format 3.
//!
//! [`Index::write_image`] writes the structures as they are (workers, chunks with their hashes,
//! tokens and pieces, the hash table's buckets, hit counts, counters) and
//! [`Index::read_image`] reads them back with large sequential reads and no per-placement work:
//! no table probe, no piece split, no reverse-holding update. The result is the same index,
//! layout included (stale table entries, dead pieces and free chunks too; entries a twin ahead
//! filled are written as garbage: `BlockTable::write_image`), so it answers alike and has the
//! same digest. [`Index::write_image_with_fresh_table`] writes the same
//! sections with a table built from the live blocks instead (no stale entry, perhaps fewer
//! buckets): the same index but for the table's layout. Reading checks every index that could
//! otherwise point out of bounds (workers of placements, chunks of holdings, table entries and
//! free slots), the piece shape, each chunk's live count, that free slots are empty and the
//! table's fill; what is left unchecked (that the table points at the right positions and
//! holds each hash once, the index's counters) is what the caller's checksum vouches for.
//!
//! All integers are little-endian. Sections, in order:
//! - workers: count, then per worker its id, address, spec, non-zero-mask count and reverse
//!   holdings per tier (compacted length, chunk list); ranks are recomputed from the ids;
//! - chunks: count, then per chunk its length, live count, flags (hit counts, per-block tokens),
//!   tokens (one value or one per position), hashes, pieces (begin, placements as
//!   `(holder, mask)` pairs);
//! - free chunk slots; the table (buckets, entries, fingerprint bits dropped, then per run of
//!   buckets their occupied slot counts and those slots: see `BlockTable::write_image`);
//! - hit counts `(hash, count)`; the counters (placements, blocks; format 3 had a third, an
//!   estimate of stale table entries, read and dropped).

use std::io::{self, Read, Write};

use smallvec::SmallVec;

use crate::image_io::{ImageError, ImageInput, malformed, put_all, put_str, put_u32, put_u64};
use crate::table::{BlockTable, Loc, MAX_CHUNKS, SharedTable};
use crate::types::CacheSpec;

use super::layout::{Chunk, Holder, Holdings, Piece, Placement, ScanProfile, Tokens, Worker};
use super::{Index, MAX_WORKERS};

/// How an image lays out the block table's slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableLayout {
    /// 16-byte slots holding whole hashes, four to a bucket (snapshot format 3).
    Wide,
    /// 8-byte slots holding fingerprints from fixed bits of the hash, eight to a bucket
    /// (snapshot format 4).
    FixedFingerprints,
    /// 8-byte slots holding fingerprints from the bits below the home bucket's and how far
    /// from home each sits, eight to a bucket (snapshot format 5).
    Packed,
}

impl Index {
    /// Writes this index's image (see the module docs) to `out`.
    pub fn write_image(&self, out: &mut impl Write) -> io::Result<()> {
        self.write_image_with(out, &self.table)
    }

    /// Writes the image of the same index with a block table built afresh from the live
    /// blocks, without reading this index's own table: for a forked child that was not given
    /// the table's memory (see [`Index::table_memory`]). It holds no stale entry, and it may
    /// have fewer buckets; it loads as [`Index::write_image`]'s does and answers alike.
    pub fn write_image_with_fresh_table(&self, out: &mut impl Write) -> io::Result<()> {
        let table = BlockTable::with_entries(self.blocks, self.live_blocks());
        self.write_image_with(out, &table)
    }

    /// Every live block's hash and where it is stored, chunk by chunk: a table built afresh
    /// (here, and a purge's in `compaction`).
    pub(super) fn live_blocks(&self) -> impl Iterator<Item = (i64, Loc)> + '_ {
        self.chunks.iter().enumerate().flat_map(|(c, chunk)| {
            let live = chunk
                .pieces
                .iter()
                .enumerate()
                .filter(|(_, piece)| !piece.placements.is_empty());
            live.flat_map(move |(i, piece)| {
                (piece.begin..chunk.piece_end(i) as u32).map(move |offset| {
                    let loc = Loc {
                        chunk: c as u32,
                        offset,
                    };
                    (chunk.hashes[offset as usize], loc)
                })
            })
        })
    }

    /// The image with `table` in place of the index's own.
    fn write_image_with(&self, out: &mut impl Write, table: &BlockTable) -> io::Result<()> {
        let mut scratch = Vec::new();
        put_u32(out, self.workers.len() as u32)?;
        for worker in &self.workers {
            put_str(out, &worker.id)?;
            put_str(out, &worker.address)?;
            put_spec(out, worker.spec)?;
            put_u64(out, worker.nonzero_masks as u64)?;
            for holdings in &worker.holdings {
                put_u32(out, holdings.compacted as u32)?;
                put_u32(out, holdings.chunks.len() as u32)?;
                put_all(out, &mut scratch, &holdings.chunks, |c| c.to_le_bytes())?;
            }
        }
        put_u64(out, self.chunks.len() as u64)?;
        for chunk in &self.chunks {
            write_chunk(out, &mut scratch, chunk)?;
        }
        put_u32(out, self.free_chunks.len() as u32)?;
        put_all(out, &mut scratch, &self.free_chunks, |c| c.to_le_bytes())?;
        table.write_image(self.chunks.len(), out, &mut scratch)?;
        put_u64(out, self.hits.len() as u64)?;
        let mut hits: Vec<(i64, u64)> = self.hits.iter().map(|(&h, &c)| (h, c)).collect();
        hits.sort_unstable();
        put_all(out, &mut scratch, &hits, |&(hash, count)| {
            let mut bytes = [0; 16];
            bytes[..8].copy_from_slice(&hash.to_le_bytes());
            bytes[8..].copy_from_slice(&count.to_le_bytes());
            bytes
        })?;
        for counter in [self.placements, self.blocks] {
            put_u64(out, counter as u64)?;
        }
        Ok(())
    }

    /// Reads an image that [`Index::write_image`] (or [`Index::write_image_with_fresh_table`])
    /// wrote.
    pub fn read_image(input: &mut ImageInput<impl Read>) -> Result<Index, ImageError> {
        Index::read_image_of(input, TableLayout::Packed)
    }

    /// Reads an image whose block table has `layout`: an older one's is re-homed into today's,
    /// or filled anew.
    pub fn read_image_of(
        input: &mut ImageInput<impl Read>,
        layout: TableLayout,
    ) -> Result<Index, ImageError> {
        let mut index = Index::new();
        let workers = input.u32()? as usize;
        if workers > MAX_WORKERS {
            return Err(malformed(format!("{workers} workers")));
        }
        for _ in 0..workers {
            let worker = read_worker(input)?;
            if index.worker_ids.contains_key(&worker.id) {
                return Err(malformed(format!("worker {:?} twice", worker.id)));
            }
            let w = index.workers.len() as u32;
            index.worker_ids.insert(worker.id.clone(), w);
            index.workers.push(worker);
        }
        let chunks = input.u64()? as usize;
        if chunks > MAX_CHUNKS as usize {
            return Err(malformed(format!(
                "{chunks} chunks, past the {MAX_CHUNKS} a table names"
            )));
        }
        // A chunk takes at least 17 bytes; the vector grows as they arrive.
        input.expect(chunks as u128 * 17)?;
        index.chunks.reserve(chunks.min(1 << 16));
        for c in 0..chunks {
            let chunk = read_chunk(input, workers)
                .map_err(|error| in_context(error, &format!("chunk {c}")))?;
            count_placements(&mut index.workers, &chunk);
            index.chunks.push(chunk);
        }
        let free = input.u32()? as usize;
        index.free_chunks = input.all(free, u32::from_le_bytes)?;
        let in_range = |c: u32| (c as usize) < chunks;
        let free = |c: u32| in_range(c) && index.chunks[c as usize].hashes.is_empty();
        if !index.free_chunks.iter().all(|&c| free(c)) {
            return Err(malformed("a free chunk slot past the chunks or not empty"));
        }
        for (w, worker) in index.workers.iter().enumerate() {
            if !worker
                .holdings
                .iter()
                .all(|h| h.chunks.iter().all(|&c| in_range(c)))
            {
                return Err(malformed(format!(
                    "worker {w} holds a chunk past the chunks"
                )));
            }
        }
        index.table = SharedTable::new(index.read_table(input, layout)?);
        let hits = input.u64()? as usize;
        input.expect(hits as u128 * 16)?;
        index.hits.reserve(hits.min(1 << 16));
        input.each(hits, |b: [u8; 16]| {
            let (hash, count) = b.split_at(8);
            index.hits.insert(
                i64::from_le_bytes(hash.try_into().expect("8 bytes")),
                u64::from_le_bytes(count.try_into().expect("8 bytes")),
            );
        })?;
        index.placements = input.u64()? as usize;
        index.blocks = input.u64()? as usize;
        if layout == TableLayout::Wide {
            // Format 3's estimate of stale entries, which no longer decides anything.
            input.u64()?;
        }
        index.rank_all();
        Ok(index)
    }

    /// Reads the block table's image, laid out as `layout`, for this index's chunks (read).
    fn read_table(
        &self,
        input: &mut ImageInput<impl Read>,
        layout: TableLayout,
    ) -> Result<BlockTable, ImageError> {
        let chunks = self.chunks.len();
        Ok(match layout {
            TableLayout::Packed => BlockTable::read_image(input, chunks)?,
            TableLayout::FixedFingerprints => {
                // Its slots cannot be re-homed: read (and checked), then filled anew from
                // the live blocks.
                BlockTable::read_image_fixed(input, chunks)?;
                BlockTable::with_entries(self.live_blocks().count(), self.live_blocks())
            }
            TableLayout::Wide => BlockTable::read_image_wide(input, chunks)?,
        })
    }

    /// Ranks every worker by id and refreshes every scan profile.
    fn rank_all(&mut self) {
        let workers = &self.workers;
        self.by_rank = (0..workers.len() as u32).collect();
        self.by_rank
            .sort_unstable_by(|&a, &b| workers[a as usize].id.cmp(&workers[b as usize].id));
        for (rank, &w) in self.by_rank.iter().enumerate() {
            self.workers[w as usize].rank = rank as u32;
        }
        self.profiles = self.workers.iter().map(ScanProfile::of).collect();
    }
}

/// Adds the placements of `chunk`'s pieces to their workers' per-tier counts (not in the
/// image: recounted as it is read).
fn count_placements(workers: &mut [Worker], chunk: &Chunk) {
    for (k, piece) in chunk.pieces.iter().enumerate() {
        let len = chunk.piece_end(k) - piece.begin as usize;
        for p in &piece.placements {
            workers[p.worker() as usize].placements[p.tier().index()] += len;
        }
    }
}

/// `error` with what was being read.
fn in_context(error: ImageError, what: &str) -> ImageError {
    match error {
        ImageError::Malformed(inner) => malformed(format!("{what}: {inner}")),
        other => other,
    }
}

fn read_worker(input: &mut ImageInput<impl Read>) -> Result<Worker, ImageError> {
    let id = input.str()?;
    let mut worker = Worker::new(&id);
    worker.address = input.str()?;
    worker.spec = get_spec(input)?;
    worker.nonzero_masks = input.u64()? as usize;
    for holdings in &mut worker.holdings {
        let compacted = input.u32()? as usize;
        let len = input.u32()? as usize;
        *holdings = Holdings {
            chunks: input.all(len, u32::from_le_bytes)?,
            compacted,
        };
    }
    Ok(worker)
}

const HAS_HITS: u8 = 1;
const PER_BLOCK_TOKENS: u8 = 2;

fn write_chunk(out: &mut impl Write, scratch: &mut Vec<u8>, chunk: &Chunk) -> io::Result<()> {
    put_u32(out, chunk.hashes.len() as u32)?;
    put_u32(out, chunk.live)?;
    let per_block = matches!(chunk.tokens, Tokens::PerBlock(_));
    let flags = u8::from(chunk.has_hits) * HAS_HITS + u8::from(per_block) * PER_BLOCK_TOKENS;
    out.write_all(&[flags])?;
    match &chunk.tokens {
        Tokens::Uniform(tokens) => put_u32(out, *tokens)?,
        Tokens::PerBlock(tokens) => put_all(out, scratch, tokens, |t| t.to_le_bytes())?,
    }
    put_all(out, scratch, &chunk.hashes, |h| h.to_le_bytes())?;
    put_u32(out, chunk.pieces.len() as u32)?;
    for piece in &chunk.pieces {
        put_u32(out, piece.begin)?;
        put_u32(out, piece.placements.len() as u32)?;
        for p in &piece.placements {
            put_u32(out, p.holder.0)?;
            put_u32(out, p.mask)?;
        }
    }
    Ok(())
}

fn read_chunk(input: &mut ImageInput<impl Read>, workers: usize) -> Result<Chunk, ImageError> {
    let len = input.u32()? as usize;
    let live = input.u32()?;
    let flags = input.u8()?;
    let tokens = if flags & PER_BLOCK_TOKENS != 0 {
        Tokens::PerBlock(input.all(len, u32::from_le_bytes)?)
    } else {
        Tokens::Uniform(input.u32()?)
    };
    let hashes = input.all(len, i64::from_le_bytes)?;
    let count = input.u32()? as usize;
    if (count == 0) != (len == 0) || count > len || live as usize > len {
        return Err(malformed(format!(
            "{count} pieces and {live} live positions over {len}"
        )));
    }
    let mut pieces = Vec::with_capacity(count);
    for k in 0..count {
        let begin = input.u32()?;
        let at_order = match k {
            0 => begin == 0,
            _ => begin > pieces.last().map_or(0, |p: &Piece| p.begin),
        };
        if !at_order || begin as usize >= len {
            return Err(malformed(format!("piece {k} begins at {begin}")));
        }
        let n = input.u32()? as usize;
        if n > workers * 3 {
            return Err(malformed(format!("piece {k} has {n} placements")));
        }
        let mut placements = SmallVec::with_capacity(n);
        for _ in 0..n {
            let holder = input.u32()?;
            let mask = input.u32()?;
            if (holder >> 2) as usize >= workers || holder & 3 == 0 {
                return Err(malformed(format!("piece {k} names holder {holder}")));
            }
            placements.push(Placement {
                holder: Holder(holder),
                mask,
            });
        }
        if !placements
            .windows(2)
            .all(|w: &[Placement]| w[0].holder < w[1].holder)
        {
            return Err(malformed(format!("piece {k}'s placements are not sorted")));
        }
        pieces.push(Piece { begin, placements });
    }
    let chunk = Chunk {
        hashes,
        tokens,
        pieces,
        live,
        has_hits: flags & HAS_HITS != 0,
    };
    let counted: usize = (0..chunk.pieces.len())
        .filter(|&k| !chunk.pieces[k].placements.is_empty())
        .map(|k| chunk.piece_end(k) - chunk.pieces[k].begin as usize)
        .sum();
    if counted != live as usize || flags & !(HAS_HITS | PER_BLOCK_TOKENS) != 0 {
        return Err(malformed(format!(
            "{live} live positions where the pieces hold {counted}, flags {flags}"
        )));
    }
    Ok(chunk)
}

fn put_spec(out: &mut impl Write, spec: Option<CacheSpec>) -> io::Result<()> {
    let Some(spec) = spec else {
        return out.write_all(&[0]);
    };
    out.write_all(&[1])?;
    for value in spec.to_words() {
        put_u32(out, value)?;
    }
    Ok(())
}

fn get_spec(input: &mut ImageInput<impl Read>) -> Result<Option<CacheSpec>, ImageError> {
    match input.u8()? {
        0 => Ok(None),
        1 => {
            let mut words = [0; 6];
            for word in &mut words {
                *word = input.u32()?;
            }
            Ok(Some(CacheSpec::from_words(words)))
        }
        tag => Err(malformed(format!("spec tag {tag}"))),
    }
}
