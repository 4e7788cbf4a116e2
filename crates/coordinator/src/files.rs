//! Checksummed record files: the on-disk format under the coordinator's storage.
//!
//! Owns: a record's framing (4-byte little-endian length, 4-byte little-endian CRC32C of the
//! body, the body), reading a file of records back with torn-tail detection, and replacing a
//! whole file atomically (temporary file, fsync, rename, fsync of the directory). Hides: offsets,
//! checksums and the temporary file's name.
//!
//! A record that is cut short, or whose checksum fails, at the very end of a file is a write that a
//! crash interrupted; it was never reported durable, so the reader drops it and says how many
//! bytes are valid. A bad checksum anywhere before the end is corruption and an error that names
//! the file and the offset.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

/// Largest record body accepted on reading (a bigger length is corruption).
pub const RECORD_MAX_BYTES: usize = 256 << 20;

const HEADER: usize = 8;

/// Frames `body` as one record.
pub fn encode_record(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + body.len());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&crc32c::crc32c(body).to_le_bytes());
    out.extend_from_slice(body);
    out
}

/// The records of a file, and how many of its bytes they cover (less than the file's length when
/// the last record was torn).
pub struct Records {
    pub bodies: Vec<Vec<u8>>,
    pub valid_len: u64,
    pub torn: bool,
}

/// Reads every record of `path`; a missing file has none.
pub fn read_records(path: &Path) -> Result<Records, String> {
    let mut bytes = Vec::new();
    match File::open(path) {
        Ok(mut f) => {
            f.read_to_end(&mut bytes)
                .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(Records {
                bodies: Vec::new(),
                valid_len: 0,
                torn: false,
            })
        }
        Err(e) => return Err(format!("cannot open {}: {e}", path.display())),
    }
    decode_records(&bytes).map_err(|e| format!("{} is corrupt: {e}", path.display()))
}

/// Splits `bytes` into records (see [`read_records`]).
pub fn decode_records(bytes: &[u8]) -> Result<Records, String> {
    let mut bodies = Vec::new();
    let mut at = 0usize;
    while at < bytes.len() {
        let rest = &bytes[at..];
        if rest.len() < HEADER {
            return Ok(torn(bodies, at));
        }
        let len = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
        let crc = u32::from_le_bytes([rest[4], rest[5], rest[6], rest[7]]);
        if len > RECORD_MAX_BYTES {
            if rest.len() < HEADER + len.min(RECORD_MAX_BYTES) {
                // A length that reaches past the end may be a torn header.
                return Ok(torn(bodies, at));
            }
            return Err(format!(
                "the record at offset {at} claims {len} bytes, above the limit of {RECORD_MAX_BYTES}"
            ));
        }
        if rest.len() < HEADER + len {
            return Ok(torn(bodies, at));
        }
        let body = &rest[HEADER..HEADER + len];
        if crc32c::crc32c(body) != crc {
            if rest.len() == HEADER + len {
                return Ok(torn(bodies, at));
            }
            return Err(format!("the record at offset {at} fails its checksum"));
        }
        bodies.push(body.to_vec());
        at += HEADER + len;
    }
    Ok(Records {
        bodies,
        valid_len: at as u64,
        torn: false,
    })
}

fn torn(bodies: Vec<Vec<u8>>, at: usize) -> Records {
    Records {
        bodies,
        valid_len: at as u64,
        torn: true,
    }
}

/// Fsyncs a directory, so that a rename or a new file in it survives a crash.
pub fn sync_dir(dir: &Path) -> Result<(), String> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| format!("cannot sync the directory {}: {e}", dir.display()))
}

/// Replaces `path` with exactly `records`, atomically and durably.
pub fn replace_file(path: &Path, records: &[Vec<u8>]) -> Result<(), String> {
    let tmp = tmp_path(path);
    let write = || -> std::io::Result<()> {
        let mut f = File::create(&tmp)?;
        for body in records {
            f.write_all(&encode_record(body))?;
        }
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    };
    write().map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    sync_dir(path.parent().unwrap_or(Path::new(".")))
}

fn tmp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    path.with_file_name(name)
}

/// An append-only file of records.
pub struct AppendFile {
    path: PathBuf,
    file: File,
}

impl AppendFile {
    /// Opens (creating) `path` for appending after its first `valid_len` bytes; anything after
    /// them (a torn record) is cut off durably.
    pub fn open(path: &Path, valid_len: u64) -> Result<AppendFile, String> {
        let file = OpenOptions::new()
            .create(true)
            .read(true)
            .write(true)
            .truncate(false)
            .open(path)
            .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
        let len = file
            .metadata()
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?
            .len();
        if len != valid_len {
            file.set_len(valid_len)
                .and_then(|_| file.sync_all())
                .map_err(|e| format!("cannot cut the torn tail of {}: {e}", path.display()))?;
        }
        let mut af = AppendFile {
            path: path.to_path_buf(),
            file,
        };
        af.seek_end()?;
        Ok(af)
    }

    fn seek_end(&mut self) -> Result<(), String> {
        use std::io::Seek;
        self.file
            .seek(std::io::SeekFrom::End(0))
            .map(|_| ())
            .map_err(|e| format!("cannot seek in {}: {e}", self.path.display()))
    }

    /// Appends `bodies` as records and fsyncs.
    pub fn append(&mut self, bodies: &[Vec<u8>]) -> Result<(), String> {
        let mut buf = Vec::new();
        for body in bodies {
            buf.extend_from_slice(&encode_record(body));
        }
        self.file
            .write_all(&buf)
            .and_then(|_| self.file.sync_data())
            .map_err(|e| format!("cannot append to {}: {e}", self.path.display()))
    }

    /// Replaces the whole file with `bodies` (compaction) and keeps appending to the new one.
    pub fn rewrite(&mut self, bodies: &[Vec<u8>]) -> Result<(), String> {
        replace_file(&self.path, bodies)?;
        self.file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&self.path)
            .map_err(|e| format!("cannot open {}: {e}", self.path.display()))?;
        self.seek_end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torn_tails_are_dropped_and_corruption_is_an_error() {
        let mut bytes = encode_record(b"one");
        bytes.extend(encode_record(b"two"));
        let whole = decode_records(&bytes).unwrap();
        assert_eq!(whole.bodies, vec![b"one".to_vec(), b"two".to_vec()]);
        assert!(!whole.torn);
        for cut in 1..11 {
            let r = decode_records(&bytes[..bytes.len() - cut]).unwrap();
            assert_eq!(r.bodies, vec![b"one".to_vec()]);
            assert!(r.torn);
            assert_eq!(r.valid_len, 11);
        }
        let mut last_bad = bytes.clone();
        *last_bad.last_mut().unwrap() ^= 1;
        assert!(decode_records(&last_bad).unwrap().torn);
        let mut first_bad = bytes.clone();
        first_bad[9] ^= 1;
        let e = decode_records(&first_bad).err().unwrap();
        assert!(e.contains("offset 0"), "{e}");
    }
}
