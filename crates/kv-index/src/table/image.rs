//! The block table's image, for snapshots: written slot for slot, and read back (or, from an
//! older snapshot format, re-homed or filled anew).

use crate::image_io::{ImageError, ImageInput, put_all, put_u64};

use super::{
    BlockTable, Bucket, FP_BITS, LANES, Loc, MIN_BUCKETS, Slot, buckets_for, over_max_load,
    relocated, slot_chunk,
};

/// Buckets per run of the image (see [`BlockTable::write_image`]).
const IMAGE_RUN: usize = 1 << 12;

impl BlockTable {
    /// Writes the table as its image, for an index of `chunks` chunks: the bucket and entry
    /// counts and the fingerprint bits its slots lack (`fp_drop`), then per run of
    /// [`IMAGE_RUN`] buckets each bucket's occupied slot count (a byte) and those slots. With
    /// no removal, a bucket's occupied slots are always its first ones (a probe fills the first
    /// vacant slot it meets), so the counts say where every slot goes and vacant ones take no
    /// room. An entry naming a chunk past `chunks` was filled by a twin that is ahead (see
    /// [`super::SharedTable`]): it is written naming chunk 0's first position, garbage that
    /// keeps its slot occupied (and its displacement), so that probes still pass it. Nothing
    /// may fill the table meanwhile (a forked child's copy, or its writer's thread between
    /// changes).
    pub(crate) fn write_image(
        &self,
        chunks: usize,
        out: &mut impl std::io::Write,
        scratch: &mut Vec<u8>,
    ) -> std::io::Result<()> {
        if chunks == 0 {
            // Nothing is live, so every entry is garbage: an empty table.
            return BlockTable::default().write_image(1, out, scratch);
        }
        put_u64(out, self.buckets.len() as u64)?;
        put_u64(out, self.len() as u64)?;
        put_u64(out, u64::from(self.fp_drop))?;
        let own = |slot: Slot| match slot_chunk(slot) {
            c if c <= chunks as u64 => slot,
            _ => relocated(
                slot,
                Loc {
                    chunk: 0,
                    offset: 0,
                },
            ),
        };
        let mut slots: Vec<Slot> = Vec::with_capacity(IMAGE_RUN * LANES);
        for run in self.buckets.chunks(IMAGE_RUN) {
            slots.clear();
            let counts: Vec<u8> = run
                .iter()
                .map(|bucket| {
                    let occupied = bucket.slots().take_while(|&slot| slot != 0).map(own);
                    let before = slots.len();
                    slots.extend(occupied);
                    (slots.len() - before) as u8
                })
                .collect();
            out.write_all(&counts)?;
            put_all(out, scratch, &slots, |slot| slot.to_le_bytes())?;
        }
        Ok(())
    }

    /// Reads what [`BlockTable::write_image`] wrote, for an index of `chunks` chunks: every
    /// entry must name one of them, and the entry count must be right.
    pub(crate) fn read_image(
        input: &mut ImageInput<impl std::io::Read>,
        chunks: usize,
    ) -> Result<BlockTable, ImageError> {
        let (buckets, len) = read_sizes(input)?;
        // Any drop that leaves a bit judges alike (a debug build's tables drop more).
        let fp_drop = match input.u64()? {
            drop if drop < u64::from(FP_BITS) => drop as u32,
            drop => return Err(table_malformed(format!("{drop} fingerprint bits dropped"))),
        };
        let read = BlockTable::read_slots(input, chunks, buckets, len, true)?;
        if buckets == 0 {
            return Ok(BlockTable::default());
        }
        Ok(BlockTable {
            buckets: read.into_boxed_slice(),
            len: len.into(),
            shift: 64 - buckets.trailing_zeros(),
            fp_drop,
        })
    }

    /// Reads and checks a table image of snapshot format 4 (fingerprints from fixed bits of
    /// the hash, no displacement), keeping none of it: such a table cannot serve in this
    /// layout, so the caller fills a new one from the live blocks. (The chunk numbers are read
    /// with this layout's mask, which names every chunk an index below [`super::MAX_CHUNKS`]
    /// has.)
    pub(crate) fn read_image_fixed(
        input: &mut ImageInput<impl std::io::Read>,
        chunks: usize,
    ) -> Result<(), ImageError> {
        let (buckets, len) = read_sizes(input)?;
        BlockTable::read_slots(input, chunks, buckets, len, false).map(drop)
    }

    /// The buckets of an image of `buckets` buckets and `len` entries, past its sizes, each
    /// entry checked (none kept unless `keep`).
    fn read_slots(
        input: &mut ImageInput<impl std::io::Read>,
        chunks: usize,
        buckets: usize,
        len: usize,
        keep: bool,
    ) -> Result<Vec<Bucket>, ImageError> {
        // Allocated as the runs arrive: a damaged count must fail on the bytes, not abort on a
        // reservation 64 times the file.
        let mut read: Vec<Bucket> = Vec::with_capacity(buckets.min(IMAGE_RUN));
        let mut total_read = 0;
        let mut bad = None;
        let mut left = buckets;
        while left > 0 {
            let counts = read_counts(input, left.min(IMAGE_RUN), LANES)?;
            let total = counts.iter().map(|&c| usize::from(c)).sum();
            let slots = input.all(total, u64::from_le_bytes)?;
            let mut slots = slots.into_iter();
            for &count in &counts {
                let mut bucket = [0; LANES];
                for slot in &mut bucket[..usize::from(count)] {
                    *slot = slots.next().expect("counted");
                    let chunk = slot_chunk(*slot);
                    if chunk == 0 || chunk > chunks as u64 {
                        bad.get_or_insert(chunk);
                    }
                }
                if keep {
                    read.push(Bucket::of(bucket));
                }
            }
            total_read += total;
            left -= counts.len();
        }
        check_read(bad, chunks, total_read, len, buckets)?;
        Ok(read)
    }

    /// Reads a table image of snapshot format 3 (16-byte slots, four to a bucket, the whole
    /// hash in each) into this layout: the same entries, re-homed.
    pub(crate) fn read_image_wide(
        input: &mut ImageInput<impl std::io::Read>,
        chunks: usize,
    ) -> Result<BlockTable, ImageError> {
        const WIDE_LANES: usize = 4;
        let (buckets, len) = read_sizes(input)?;
        let mut entries = Vec::with_capacity(len.min(1 << 20));
        let mut bad = None;
        let mut left = buckets;
        while left > 0 {
            let counts = read_counts(input, left.min(IMAGE_RUN), WIDE_LANES)?;
            let total = counts.iter().map(|&c| usize::from(c)).sum();
            input.each(total, |bytes: [u8; 16]| {
                let word = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8"));
                let (hash, value) = (word(0) as i64, word(8));
                let chunk = value >> 32;
                if chunk == 0 || chunk > chunks as u64 {
                    bad.get_or_insert(chunk);
                } else {
                    entries.push((
                        hash,
                        Loc {
                            chunk: chunk as u32 - 1,
                            offset: value as u32,
                        },
                    ));
                }
            })?;
            left -= counts.len();
        }
        check_read(
            bad,
            chunks,
            entries.len(),
            len,
            buckets_for(len, MIN_BUCKETS),
        )?;
        if entries.is_empty() {
            return Ok(BlockTable::default());
        }
        let buckets = buckets_for(entries.len() + 1, MIN_BUCKETS);
        Ok(BlockTable::filled(
            buckets,
            entries.len(),
            entries.into_iter(),
        ))
    }
}

/// The bucket and entry counts an image of the table starts with, the buckets checked.
fn read_sizes(input: &mut ImageInput<impl std::io::Read>) -> Result<(usize, usize), ImageError> {
    let buckets = input.u64()? as usize;
    let len = input.u64()? as usize;
    if buckets != 0 && (!buckets.is_power_of_two() || buckets < MIN_BUCKETS) {
        return Err(table_malformed(format!("{buckets} buckets")));
    }
    // Every bucket has its count byte; the table gets no more buckets than that allows.
    input.expect(buckets as u128)?;
    Ok((buckets, len))
}

/// One run's occupied-slot counts, each at most `lanes`.
fn read_counts(
    input: &mut ImageInput<impl std::io::Read>,
    run: usize,
    lanes: usize,
) -> Result<Vec<u8>, ImageError> {
    let counts = input.bytes(run as u64)?;
    if let Some(&count) = counts.iter().find(|&&c| usize::from(c) > lanes) {
        return Err(table_malformed(format!("a bucket of {count} slots")));
    }
    Ok(counts)
}

/// Fails when an entry named a chunk past `chunks` (`bad`), or the entries read are not the
/// `written` count or overload the buckets.
fn check_read(
    bad: Option<u64>,
    chunks: usize,
    read: usize,
    written: usize,
    buckets: usize,
) -> Result<(), ImageError> {
    if let Some(chunk) = bad {
        return Err(table_malformed(format!(
            "an entry names chunk slot {chunk} of {chunks}"
        )));
    }
    if read != written || over_max_load(written, buckets) {
        return Err(table_malformed(format!(
            "{read} entries where {written} were written, in {buckets} buckets"
        )));
    }
    Ok(())
}

fn table_malformed(what: String) -> ImageError {
    ImageError::Malformed(format!("the block table: {what}"))
}
