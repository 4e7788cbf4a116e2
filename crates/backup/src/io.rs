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
}

// SAFETY: AlignedBuf owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared references only give out &[u8].
unsafe impl Sync for AlignedBuf {}

/// Size of a transparent huge page on x86-64 and most aarch64 kernels.
const HUGE_PAGE_BYTES: usize = 2 << 20;

impl AlignedBuf {
    /// A buffer of `cap` bytes (rounded up to a page), all zero, with length 0.
    pub fn new(cap: usize) -> AlignedBuf {
        let cap = cap.max(PAGE_BYTES).div_ceil(PAGE_BYTES) * PAGE_BYTES;
        let layout = Self::layout(cap);
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        if cap >= HUGE_PAGE_BYTES {
            // Large buffers (segments, flush blocks) are backed by transparent huge pages where
            // the kernel allows it: an O_DIRECT write pins the buffer's pages, and pinning 2 MiB
            // pages costs a fraction of pinning 4 KiB ones. Advice only; failure changes nothing.
            // SAFETY: ptr..ptr+cap is a live allocation owned by this buffer.
            unsafe { libc::madvise(ptr.cast(), cap, libc::MADV_HUGEPAGE) };
        }
        AlignedBuf { ptr, cap, len: 0 }
    }

    fn layout(cap: usize) -> Layout {
        let align = if cap >= HUGE_PAGE_BYTES {
            HUGE_PAGE_BYTES
        } else {
            PAGE_BYTES
        };
        Layout::from_size_align(cap, align).expect("page layout")
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

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for cap >= len initialised bytes.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout = Self::layout(self.cap);
        // SAFETY: ptr was allocated with exactly this layout and is freed once.
        unsafe { dealloc(self.ptr, layout) }
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
