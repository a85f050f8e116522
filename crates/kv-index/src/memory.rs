//! Where the block table asks the machine directly, because a rebuild waits on memory more than
//! on anything it computes: its pages are mapped in one call, not one fault at a time, and the
//! cache line an insert or a probe is about to need is fetched well before it (a table's fill,
//! an apply's run of new blocks). Both are advice: neither changes what the program reads.

/// Starts loading the cache line at `line` (a bucket's), without waiting for it.
#[inline]
pub(crate) fn prefetch<T>(line: &T) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        let address: *const i8 = (line as *const T).cast();
        // SAFETY: a prefetch only moves a line into the cache: it reads nothing the program
        // sees and never faults; the address is a live reference's.
        #[allow(unsafe_code)]
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(address);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = line;
}

/// Whether [`prefetch`] does anything here: elsewhere a caller loads the line instead.
pub(crate) const PREFETCHES: bool = cfg!(target_arch = "x86_64");

/// Room for `len` values of `T`, its pages already mapped for writing where the kernel can
/// (Linux 5.14 and later: `MADV_POPULATE_WRITE`), so that filling it takes no page fault:
/// a fault per 4 KB page costs a new table more than writing it (128 MB: 60 ms faulting in
/// order, 35 ms mapped at once, then 14 ms to write). Only advice: elsewhere, or if the kernel
/// refuses, the pages fault in as they are first written.
pub(crate) fn mapped_for_writing<T>(len: usize) -> Vec<T> {
    let vec = Vec::<T>::with_capacity(len);
    #[cfg(target_os = "linux")]
    {
        // SAFETY: `sysconf` has no preconditions.
        #[allow(unsafe_code)]
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
        let start = vec.as_ptr() as usize;
        let end = start + len * std::mem::size_of::<T>();
        // Whole pages only, a piece at a time (the call holds the process's memory map).
        let (mut first, last) = (start.next_multiple_of(page), end - end % page);
        while first < last {
            let piece = (last - first).min(POPULATE_PIECE);
            // SAFETY: whole pages inside the vector's own allocation, which it has not
            // initialised: populating maps them (zeroed, as fresh anonymous pages are, or
            // unchanged if already mapped) and changes no byte of them.
            #[allow(unsafe_code)]
            let _ = unsafe {
                libc::madvise(first as *mut libc::c_void, piece, libc::MADV_POPULATE_WRITE)
            };
            first += piece;
        }
    }
    vec
}

/// Bytes [`mapped_for_writing`] asks the kernel to map in one call.
#[cfg(target_os = "linux")]
const POPULATE_PIECE: usize = 8 << 20;
