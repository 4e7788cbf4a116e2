//! MessagePack values as Redis's Lua `cmsgpack` library reads and writes them (its `pack` and
//! `unpack`): nil, booleans, integers, floats, strings (str and bin both read as strings),
//! arrays and maps. Extension types are refused. Fuzz target `msgpack` in `crates/proto/fuzz`.

/// A MessagePack value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Nil,
    Bool(bool),
    Int(i64),
    /// An unsigned integer above `i64::MAX`.
    UInt(u64),
    Float(f64),
    Str(Vec<u8>),
    Array(Vec<Value>),
    Map(Vec<(Value, Value)>),
}

/// Why bytes are not MessagePack.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    #[error("truncated MessagePack value")]
    Truncated,
    #[error("MessagePack extension types are not supported (byte {0:#04x})")]
    Extension(u8),
    #[error("MessagePack byte 0xc1 is never used")]
    Reserved,
    #[error("MessagePack values nested deeper than {NESTING_MAX}")]
    TooDeep,
}

/// The deepest nesting of arrays and maps read or written.
pub const NESTING_MAX: usize = 64;

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Error> {
        let end = self.pos.checked_add(n).ok_or(Error::Truncated)?;
        let out = self.buf.get(self.pos..end).ok_or(Error::Truncated)?;
        self.pos = end;
        Ok(out)
    }

    fn byte(&mut self) -> Result<u8, Error> {
        Ok(self.take(1)?[0])
    }

    fn be(&mut self, n: usize) -> Result<u64, Error> {
        Ok(self
            .take(n)?
            .iter()
            .fold(0u64, |acc, b| (acc << 8) | u64::from(*b)))
    }

    /// A container's count, checked against the bytes left (each item takes at least one).
    fn count(&mut self, n: usize, per_item: usize) -> Result<usize, Error> {
        let count = self.be(n)? as usize;
        if count.saturating_mul(per_item) > self.buf.len() - self.pos {
            return Err(Error::Truncated);
        }
        Ok(count)
    }

    fn value(&mut self, depth: usize) -> Result<Value, Error> {
        let b = self.byte()?;
        Ok(match b {
            0x00..=0x7f => Value::Int(i64::from(b)),
            0x80..=0x8f => self.map(usize::from(b & 0x0f), depth)?,
            0x90..=0x9f => self.array(usize::from(b & 0x0f), depth)?,
            0xa0..=0xbf => Value::Str(self.take(usize::from(b & 0x1f))?.to_vec()),
            0xc0 => Value::Nil,
            0xc1 => return Err(Error::Reserved),
            0xc2 => Value::Bool(false),
            0xc3 => Value::Bool(true),
            0xc4 | 0xd9 => {
                let n = self.be(1)? as usize;
                Value::Str(self.take(n)?.to_vec())
            }
            0xc5 | 0xda => {
                let n = self.be(2)? as usize;
                Value::Str(self.take(n)?.to_vec())
            }
            0xc6 | 0xdb => {
                let n = self.be(4)? as usize;
                Value::Str(self.take(n)?.to_vec())
            }
            0xc7..=0xc9 | 0xd4..=0xd8 => return Err(Error::Extension(b)),
            0xca => Value::Float(f64::from(f32::from_bits(self.be(4)? as u32))),
            0xcb => Value::Float(f64::from_bits(self.be(8)?)),
            0xcc => Value::Int(self.be(1)? as i64),
            0xcd => Value::Int(self.be(2)? as i64),
            0xce => Value::Int(self.be(4)? as i64),
            0xcf => {
                let v = self.be(8)?;
                i64::try_from(v).map_or(Value::UInt(v), Value::Int)
            }
            0xd0 => Value::Int(i64::from(self.be(1)? as u8 as i8)),
            0xd1 => Value::Int(i64::from(self.be(2)? as u16 as i16)),
            0xd2 => Value::Int(i64::from(self.be(4)? as u32 as i32)),
            0xd3 => Value::Int(self.be(8)? as i64),
            0xdc => {
                let n = self.count(2, 1)?;
                self.array(n, depth)?
            }
            0xdd => {
                let n = self.count(4, 1)?;
                self.array(n, depth)?
            }
            0xde => {
                let n = self.count(2, 2)?;
                self.map(n, depth)?
            }
            0xdf => {
                let n = self.count(4, 2)?;
                self.map(n, depth)?
            }
            0xe0..=0xff => Value::Int(i64::from(b as i8)),
        })
    }

    fn array(&mut self, n: usize, depth: usize) -> Result<Value, Error> {
        if depth >= NESTING_MAX {
            return Err(Error::TooDeep);
        }
        let mut out = Vec::with_capacity(n.min(self.buf.len() - self.pos));
        for _ in 0..n {
            out.push(self.value(depth + 1)?);
        }
        Ok(Value::Array(out))
    }

    fn map(&mut self, n: usize, depth: usize) -> Result<Value, Error> {
        if depth >= NESTING_MAX {
            return Err(Error::TooDeep);
        }
        let mut out = Vec::with_capacity(n.min((self.buf.len() - self.pos) / 2));
        for _ in 0..n {
            let k = self.value(depth + 1)?;
            let v = self.value(depth + 1)?;
            out.push((k, v));
        }
        Ok(Value::Map(out))
    }
}

/// Every value in `bytes`, one after another (what `cmsgpack.unpack` returns).
pub fn decode_all(bytes: &[u8]) -> Result<Vec<Value>, Error> {
    let mut r = Reader { buf: bytes, pos: 0 };
    let mut out = Vec::new();
    while r.pos < bytes.len() {
        out.push(r.value(0)?);
    }
    Ok(out)
}

/// Appends the shortest encoding of `v`.
pub fn encode(v: &Value, out: &mut Vec<u8>) {
    match v {
        Value::Nil => out.push(0xc0),
        Value::Bool(b) => out.push(if *b { 0xc3 } else { 0xc2 }),
        Value::Int(i) => encode_int(*i, out),
        Value::UInt(u) => {
            out.push(0xcf);
            out.extend_from_slice(&u.to_be_bytes());
        }
        Value::Float(f) => {
            out.push(0xcb);
            out.extend_from_slice(&f.to_bits().to_be_bytes());
        }
        Value::Str(s) => {
            match s.len() {
                n if n < 32 => out.push(0xa0 | n as u8),
                n if n <= 0xff => out.extend_from_slice(&[0xd9, n as u8]),
                n if n <= 0xffff => {
                    out.push(0xda);
                    out.extend_from_slice(&(n as u16).to_be_bytes());
                }
                n => {
                    out.push(0xdb);
                    out.extend_from_slice(&(n as u32).to_be_bytes());
                }
            }
            out.extend_from_slice(s);
        }
        Value::Array(items) => {
            header(items.len(), 0x90, 0xdc, out);
            for i in items {
                encode(i, out);
            }
        }
        Value::Map(pairs) => {
            header(pairs.len(), 0x80, 0xde, out);
            for (k, v) in pairs {
                encode(k, out);
                encode(v, out);
            }
        }
    }
}

fn header(n: usize, fix: u8, wide: u8, out: &mut Vec<u8>) {
    if n < 16 {
        out.push(fix | n as u8);
    } else if n <= 0xffff {
        out.push(wide);
        out.extend_from_slice(&(n as u16).to_be_bytes());
    } else {
        out.push(wide + 1);
        out.extend_from_slice(&(n as u32).to_be_bytes());
    }
}

fn encode_int(i: i64, out: &mut Vec<u8>) {
    match i {
        0..=0x7f => out.push(i as u8),
        -32..=-1 => out.push(i as i8 as u8),
        0x80..=0xff => out.extend_from_slice(&[0xcc, i as u8]),
        0x100..=0xffff => {
            out.push(0xcd);
            out.extend_from_slice(&(i as u16).to_be_bytes());
        }
        0x1_0000..=0xffff_ffff => {
            out.push(0xce);
            out.extend_from_slice(&(i as u32).to_be_bytes());
        }
        -128..=-33 => out.extend_from_slice(&[0xd0, i as i8 as u8]),
        -32768..=-129 => {
            out.push(0xd1);
            out.extend_from_slice(&(i as i16).to_be_bytes());
        }
        -2_147_483_648..=-32769 => {
            out.push(0xd2);
            out.extend_from_slice(&(i as i32).to_be_bytes());
        }
        _ => {
            out.push(0xd3);
            out.extend_from_slice(&i.to_be_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_round_trip_in_their_shortest_form() {
        let v = Value::Map(vec![
            (Value::Str(b"name".to_vec()), Value::Str(b"job".to_vec())),
            (
                Value::Str(b"list".to_vec()),
                Value::Array(vec![
                    Value::Int(1),
                    Value::Int(-1),
                    Value::Int(300),
                    Value::Int(-40000),
                    Value::Int(i64::MIN),
                    Value::UInt(u64::MAX),
                    Value::Float(1.5),
                    Value::Nil,
                    Value::Bool(true),
                ]),
            ),
            (Value::Int(7), Value::Str(vec![b'x'; 300])),
        ]);
        let mut out = Vec::new();
        encode(&v, &mut out);
        assert_eq!(decode_all(&out), Ok(vec![v.clone()]));
        let mut two = out.clone();
        two.extend_from_slice(&out);
        assert_eq!(decode_all(&two), Ok(vec![v.clone(), v]));
        // What msgpackr writes for {a: 1, b: "x"}: a fixmap.
        assert_eq!(
            decode_all(&[0x82, 0xa1, b'a', 0x01, 0xa1, b'b', 0xa1, b'x']).unwrap()[0],
            Value::Map(vec![
                (Value::Str(b"a".to_vec()), Value::Int(1)),
                (Value::Str(b"b".to_vec()), Value::Str(b"x".to_vec()))
            ])
        );
    }

    #[test]
    fn bad_input_is_refused() {
        assert_eq!(decode_all(&[0x92, 0x01]), Err(Error::Truncated));
        assert_eq!(decode_all(&[0xc1]), Err(Error::Reserved));
        assert_eq!(decode_all(&[0xd4, 0x01, 0x02]), Err(Error::Extension(0xd4)));
        assert_eq!(
            decode_all(&[0xdd, 0xff, 0xff, 0xff, 0xff]),
            Err(Error::Truncated)
        );
        assert_eq!(decode_all(&[0x91; 100]), Err(Error::TooDeep));
        assert_eq!(
            decode_all(&[0xdb, 0xff, 0xff, 0xff, 0xff, 0x00]),
            Err(Error::Truncated)
        );
    }
}
