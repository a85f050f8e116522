//! Where the block table asks the machine directly, because a rebuild waits on memory more than
//! on anything it computes: its pages are mapped in one call, not one fault at a time, and the
//! cache line an insert is about to need is fetched well before it (`table.rs`'s fill). Both
//! are advice: neither changes what the program reads.

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

/// Room for `len` values of `T`, its pages already mapped for writing where the kernel can
/// (Linux 5.14 and later: `MADV_POPULATE_WRITE`), so that filling it takes no page fault:
/// a fault per 4 KB page costs a new table more than writing it (128 MB: 60 ms faulting in
/// order, 35 ms mapped at once, then 14 ms to write). Only advice: elsewhere, or if the kernel
/// refuses, the pages fault in as they are first written.
pub(crate) fn mapped_for_writing<T>(len: usize) -> Vec<T> {
    let vec = Vec::<T>::with_capacity(len);
    #[cfg(target_os = "linux")]
    {
        const PAGE: usize = 4096;
        let start = vec.as_ptr() as usize;
        let end = start + len * std::mem::size_of::<T>();
        // Whole pages only: madvise needs an aligned start (a larger page size makes the call
        // fail, which costs only the advice).
        let (first, last) = (start.next_multiple_of(PAGE), end - end % PAGE);
        if last > first {
            // SAFETY: whole pages inside the vector's own allocation, which nothing has
            // written yet; populating maps them (zeroed, as fresh anonymous pages are, or
            // unchanged if already mapped) and changes no byte the program could read.
            #[allow(unsafe_code)]
            let _ = unsafe {
                libc::madvise(
                    first as *mut libc::c_void,
                    last - first,
                    libc::MADV_POPULATE_WRITE,
                )
            };
        }
    }
    vec
}
