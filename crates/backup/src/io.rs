//! File access: page-aligned buffers, O_DIRECT with a run-time probe and a buffered fallback,
//! positional reads and writes that retry short transfers, and preallocation.
//!
//! All `unsafe` of the crate lives here, in [`AlignedBuf`].

use crate::format::PAGE_BYTES;
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

/// How log files are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoMode {
    /// O_DIRECT: page-aligned writes that bypass the page cache.
    Direct,
    /// The file system refused O_DIRECT: buffered writes made durable with fdatasync.
    Buffered,
}

impl IoMode {
    pub fn name(self) -> &'static str {
        match self {
            IoMode::Direct => "O_DIRECT",
            IoMode::Buffered => "buffered+fdatasync",
        }
    }
}

/// A zero-initialised, page-aligned byte buffer (O_DIRECT needs aligned memory).
pub struct AlignedBuf {
    ptr: *mut u8,
    cap: usize,
    len: usize,
    backing: Backing,
}

/// Where an [`AlignedBuf`]'s memory comes from, and so how it is released.
enum Backing {
    /// The global allocator.
    Heap,
    /// Its own mapping from `AlignedBuf::map_huge`, unmapped on drop.
    Mapped,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared references only give out &[u8].
unsafe impl Sync for AlignedBuf {}

/// Size of a transparent huge page on x86-64 and most aarch64 kernels.
const HUGE_PAGE_BYTES: usize = 2 << 20;

impl AlignedBuf {
    /// A buffer of `cap` bytes (rounded up to a page), all zero, with length 0, from the heap.
    pub fn new(cap: usize) -> AlignedBuf {
        let cap = cap.max(PAGE_BYTES).div_ceil(PAGE_BYTES) * PAGE_BYTES;
        let layout = Self::layout(cap);
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        AlignedBuf {
            ptr,
            cap,
            len: 0,
            backing: Backing::Heap,
        }
    }

    /// Like [`AlignedBuf::new`], but a buffer of 2 MiB or more is backed by transparent huge
    /// pages (see `map_huge`). For buffers that are reused many times (the write pool, the
    /// reorganizer's segments): on this virtual machine first touching fresh huge pages is
    /// slow (a probe logging 512 MiB on one tablet spent 119–459 ms in the processor, four of six
    /// runs over 280 ms, when its block buffers were fresh huge pages, against 165–196 ms with
    /// 4 KiB pages), so a buffer used once gains nothing from them.
    pub fn huge(cap: usize) -> AlignedBuf {
        let cap = cap.max(PAGE_BYTES).div_ceil(PAGE_BYTES) * PAGE_BYTES;
        if cap >= HUGE_PAGE_BYTES {
            if let Some(ptr) = Self::map_huge(cap) {
                return AlignedBuf {
                    ptr,
                    cap,
                    len: 0,
                    backing: Backing::Mapped,
                };
            }
        }
        Self::new(cap)
    }

    /// Large buffers (segments, flush blocks) are mapped on their own, 2 MiB aligned, and advised
    /// to use transparent huge pages before anything touches them (advice given after the first
    /// touch, as an allocator's zeroing does, leaves 4 KiB pages). An O_DIRECT write pins the
    /// buffer's pages and hands the device one segment per physically contiguous run: with 4 KiB
    /// pages a 1 MiB write is 256 segments, more than a virtio disk takes in one request. Writing
    /// 512 MiB in 1 MiB pieces from a huge-page buffer ran at 1.55–1.66 GB/s against 1.22–1.36
    /// from 4 KiB pages here. Anonymous memory is zero. None if the mapping fails.
    fn map_huge(cap: usize) -> Option<*mut u8> {
        let span = cap + HUGE_PAGE_BYTES;
        // SAFETY: an anonymous private mapping of `span` bytes; no existing memory is affected.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                span,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return None;
        }
        let start = raw as usize;
        let aligned = start.next_multiple_of(HUGE_PAGE_BYTES);
        let head = aligned - start;
        let tail = span - head - cap;
        // SAFETY: the head and tail ranges lie inside the mapping just made and are not used.
        unsafe {
            if head > 0 {
                libc::munmap(raw, head);
            }
            if tail > 0 {
                libc::munmap((aligned + cap) as *mut libc::c_void, tail);
            }
            // Advice only; failure leaves 4 KiB pages.
            libc::madvise(aligned as *mut libc::c_void, cap, libc::MADV_HUGEPAGE);
        }
        Some(aligned as *mut u8)
    }

    fn layout(cap: usize) -> Layout {
        Layout::from_size_align(cap, PAGE_BYTES).expect("page layout")
    }

    /// Faults every page in (writes a zero to each; the buffer stays all zero).
    pub fn touch(&mut self) {
        for at in (0..self.cap).step_by(PAGE_BYTES) {
            // SAFETY: at < cap, inside the buffer, which this &mut borrows uniquely.
            unsafe { self.ptr.add(at).write_volatile(0) };
        }
    }

    pub fn capacity(&self) -> usize {
        self.cap
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Sets the length; the bytes up to it are whatever the buffer holds (initialised memory).
    pub fn set_len(&mut self, len: usize) {
        assert!(len <= self.cap);
        self.len = len;
    }

    /// The whole capacity as a mutable slice.
    pub fn full_mut(&mut self) -> &mut [u8] {
        // SAFETY: ptr is valid for cap bytes, initialised (zeroed at allocation), and uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.cap) }
    }

    /// The whole capacity.
    pub fn full(&self) -> &[u8] {
        // SAFETY: ptr is valid for cap initialised bytes (zeroed at allocation).
        unsafe { std::slice::from_raw_parts(self.ptr, self.cap) }
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for cap >= len initialised bytes.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        match self.backing {
            // SAFETY: ptr was allocated with exactly this layout and is freed once.
            Backing::Heap => unsafe { dealloc(self.ptr, Self::layout(self.cap)) },
            // SAFETY: `map_huge` mapped exactly `cap` bytes at ptr; unmapped once.
            Backing::Mapped => unsafe {
                libc::munmap(self.ptr.cast(), self.cap);
            },
        }
    }
}

/// Hands heap memory freed by the process back to the system where the allocator keeps it
/// (glibc keeps freed memory in its arenas; the store calls this once it is at rest, after
/// freeing its buffers and tables). Elsewhere it does nothing.
pub fn return_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks and trims glibc's own heaps; it takes no pointers.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Opens (creating if asked) a log file in the given mode.
pub fn open_log(path: &Path, mode: IoMode, create: bool) -> io::Result<File> {
    let mut o = OpenOptions::new();
    o.read(true).write(true).create(create);
    if mode == IoMode::Direct {
        o.custom_flags(libc::O_DIRECT);
    }
    o.open(path)
}

/// Tries an aligned O_DIRECT write and read in `dir`; falls back to buffered I/O if refused.
pub fn probe_direct(dir: &Path) -> IoMode {
    let path = dir.join(".odirect-probe");
    let result = (|| -> io::Result<()> {
        let f = open_log(&path, IoMode::Direct, true)?;
        let mut buf = AlignedBuf::new(PAGE_BYTES);
        buf.full_mut()[0] = 0xAB;
        buf.set_len(PAGE_BYTES);
        f.write_all_at(buf.as_slice(), 0)?;
        let mut back = AlignedBuf::new(PAGE_BYTES);
        read_exact_at(&f, back.full_mut(), 0)?;
        if back.full_mut()[0] != 0xAB {
            return Err(io::Error::other("O_DIRECT read-back mismatch"));
        }
        Ok(())
    })();
    let _ = std::fs::remove_file(&path);
    match result {
        Ok(()) => IoMode::Direct,
        Err(e) => {
            tracing::warn!(
                "O_DIRECT not usable in {}: {e}; using buffered writes + fdatasync",
                dir.display()
            );
            IoMode::Buffered
        }
    }
}

/// pread that retries short reads; stops early (returning the count) at end of file.
pub fn read_exact_at(f: &File, buf: &mut [u8], mut offset: u64) -> io::Result<usize> {
    let mut done = 0usize;
    while done < buf.len() {
        match f.read_at(&mut buf[done..], offset) {
            Ok(0) => break,
            Ok(n) => {
                done += n;
                offset += n as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// Reserves `len` bytes at `offset` so that later writes never extend the file (fallocate;
/// falls back to set_len on file systems without it).
pub fn preallocate(f: &File, offset: u64, len: u64) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: fallocate on a valid descriptor with in-range arguments.
    let rc =
        unsafe { libc::fallocate(f.as_raw_fd(), 0, offset as libc::off_t, len as libc::off_t) };
    if rc == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) => {
            let end = offset + len;
            if f.metadata()?.len() < end {
                f.set_len(end)?;
            }
            Ok(())
        }
        _ => Err(err),
    }
}

/// fsyncs a directory so that renames and unlinks in it are durable.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// True if the error means the disk (or quota) is full.
pub fn is_no_space(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT))
}

/// The device a file lives on (st_dev), to tell whether one syncfs covers a set of files.
pub fn device_of(f: &File) -> io::Result<u64> {
    use std::os::unix::fs::MetadataExt;
    Ok(f.metadata()?.dev())
}

/// syncfs(2): writes back and commits everything on the file system holding `f`, with one
/// journal commit and one device cache flush, where fdatasync on each of many files issues one
/// flush per file. Durable for every file on that file system when it returns Ok; writeback
/// errors of any of them are reported (Linux ≥ 5.8 keeps them per file system).
pub fn sync_filesystem(f: &File) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: syncfs on a valid descriptor.
    if unsafe { libc::syncfs(f.as_raw_fd()) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_buffers_are_zero_huge_page_aligned_and_writable() {
        for cap in [HUGE_PAGE_BYTES, 3 * HUGE_PAGE_BYTES + PAGE_BYTES, 8 << 20] {
            let mut b = AlignedBuf::huge(cap);
            assert!(matches!(b.backing, Backing::Mapped), "{cap}: not mapped");
            assert_eq!(
                b.ptr as usize % HUGE_PAGE_BYTES,
                0,
                "{cap}: not 2 MiB aligned"
            );
            assert!(b.capacity() >= cap);
            assert!(b.full_mut().iter().all(|&x| x == 0), "{cap}: not zero");
            b.full_mut().fill(0xA5);
            b.set_len(cap);
            assert!(b.as_slice().iter().all(|&x| x == 0xA5));
            b.touch();
            assert!(b.as_slice().iter().step_by(PAGE_BYTES).all(|&x| x == 0));
        }
    }

    #[test]
    fn small_buffers_come_from_the_heap_page_aligned_and_zero() {
        assert!(matches!(AlignedBuf::new(8 << 20).backing, Backing::Heap));
        let b = AlignedBuf::huge(5000);
        assert!(matches!(b.backing, Backing::Heap));
        assert_eq!(b.capacity(), 2 * PAGE_BYTES);
        assert_eq!(b.ptr as usize % PAGE_BYTES, 0);
        let mut b = b;
        assert!(b.full_mut().iter().all(|&x| x == 0));
    }
}
