//! glibc's malloc, kept from holding on to the memory of large requests.
//!
//! By default glibc serves a block over 128 KiB with its own mapping, but after freeing one it
//! raises that threshold to the block's size (up to 32 MiB) and its trim threshold to twice
//! that. After one 4 MB prompt, every later prompt-sized buffer (bodies, texts, id vectors,
//! JSON replies) comes from the per-thread arenas, and the freed space stays resident. Fixed
//! thresholds keep large blocks in mappings of their own, which go back to the system when freed.
//! 1 MiB, not glibc's 128 KiB: a mapping per block is a page fault per page, and the tokenizer's
//! buffers for one piece of a long text (`text::piecewise_encoder`, 16 KiB pieces) stay below it,
//! so that they are reused from the arenas (bench/tokenize_burst_memory.py: 256 KiB made a burst
//! of long prompts 1.6x slower).

/// Blocks this large or larger get a mapping of their own.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const MMAP_THRESHOLD_BYTES: libc::c_int = 1024 * 1024;
/// Free space at the top of an arena beyond this goes back to the system.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const TRIM_THRESHOLD_BYTES: libc::c_int = 4 * 1024 * 1024;

/// Keeps glibc's own adaptive thresholds: the off switch, to measure what fixed ones save.
pub const ADAPTIVE_ENV: &str = "SLUICE_MALLOC_ADAPTIVE";

/// Fixes glibc's thresholds, unless `SLUICE_MALLOC_ADAPTIVE=1`; called once at startup, before
/// the threads start.
pub fn keep_large_blocks_unpooled() {
    if std::env::var_os(ADAPTIVE_ENV).is_some_and(|value| value == "1") {
        return;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; it takes no pointers.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES);
        libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES);
    }
}

/// Returns the free pages of every arena to the system: the small blocks of a large encode
/// (the tokenizer's per-pre-token state) are spread over the arenas, below any threshold.
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks the allocator's own free lists; it takes no pointers.
    unsafe {
        libc::malloc_trim(0);
    }
}
