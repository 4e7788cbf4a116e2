//! Scan queries: key filters, table schemas, predicates, projection and aggregation.
//!
//! What it owns: everything a scan evaluates per record, with no knowledge of the log.
//! - [`KeyFilter`] (all, Redis glob, prefix, byte range); the glob is `ramlog_common`'s
//!   [`glob_match`], re-exported here.
//! - [`Schema`]: a table's typed, nullable fields, the **record encoding** of a row (an object's
//!   value bytes) and the schema's own byte encoding. [`Schema::field`] reads one field of a record
//!   in O(1) without decoding the others.
//! - [`Query`]: key filter, a CNF predicate ([`Cnf`] of [`Predicate`]s), a projection or
//!   aggregates, with a bounded wire encoding ([`Query::to_bytes`]).
//! - [`CompiledQuery`]: a query checked against a schema and laid out for the scan's hot loop;
//!   [`CompiledQuery::matches`] allocates nothing and reads only the fields the predicate names.
//!   [`AggState`] accumulates aggregates and merges the states of several tablets.
//!
//! What it hides: the byte layouts (documented in docs/formats.md, "Schema records"), the
//! per-field offsets precomputed from a schema, and the predicate program.
//!
//! Semantics, decided here:
//! - SQL NULL: any comparison with a NULL field is false; only `IsNull` is true on NULL. A NULL
//!   constant is only allowed with `IsNull`.
//! - Types: a constant must have the field's type, except that integer fields and constants mix
//!   (an i32 field against an i64 constant, and the reverse, compare as i64). Bool orders
//!   false < true; String and Bytes compare byte-wise (for UTF-8 this is code-point order).
//! - f64: IEEE comparison, and every comparison with a NaN on either side is false (`Ne` too).
//! - An empty [`Cnf`] matches every record; an empty OR-clause inside it matches none.
//! - Aggregates ignore NULLs (SQL). Count counts matching records. Sum of i32/i64 is exact (an
//!   i128 accumulator, so the order of updates and merges does not matter); a total outside i64
//!   saturates in [`AggState::finish`] and is an error in [`AggState::try_finish`]. Sum of f64 is
//!   IEEE addition (a NaN makes it NaN). Min/Max of f64 skip NaN. Sum, Min and Max of no value
//!   are NULL (SQL), Count of nothing is 0.

/// The key filter's glob, kept at its earlier path.
pub use ramlog_common::{glob_match, glob_match_nocase};
use std::fmt;
use std::ops::Bound;
use std::sync::Arc;
use thiserror::Error;

// ---------------------------------------------------------------------------------------------
// Key filters
// ---------------------------------------------------------------------------------------------

/// Which keys a scan returns, decided from the key alone.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum KeyFilter {
    /// Every key.
    #[default]
    All,
    /// Keys matching a Redis glob pattern ([`glob_match`]).
    Glob(Vec<u8>),
    /// Keys starting with these bytes.
    Prefix(Vec<u8>),
    /// Keys within the bounds, in byte-wise (memcmp) order.
    Range {
        start: Bound<Vec<u8>>,
        end: Bound<Vec<u8>>,
    },
}

impl KeyFilter {
    /// Whether `key` passes the filter. The no-filter case is inlined into the scan loops; the
    /// others are a call.
    #[inline(always)]
    pub fn matches(&self, key: &[u8]) -> bool {
        matches!(self, KeyFilter::All) || self.matches_filtered(key)
    }

    #[inline(never)]
    fn matches_filtered(&self, key: &[u8]) -> bool {
        match self {
            KeyFilter::All => true,
            KeyFilter::Glob(pattern) => glob_match(pattern, key),
            KeyFilter::Prefix(prefix) => key.starts_with(prefix),
            KeyFilter::Range { start, end } => {
                let above = match start {
                    Bound::Unbounded => true,
                    Bound::Included(s) => key >= s.as_slice(),
                    Bound::Excluded(s) => key > s.as_slice(),
                };
                above
                    && match end {
                        Bound::Unbounded => true,
                        Bound::Included(e) => key <= e.as_slice(),
                        Bound::Excluded(e) => key < e.as_slice(),
                    }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Schema, values and the record encoding
// ---------------------------------------------------------------------------------------------

/// Most fields a schema may have (field indexes fit in one byte on the wire).
pub const SCHEMA_FIELDS_MAX: usize = 255;
/// Longest field name, in bytes.
pub const FIELD_NAME_BYTES_MAX: usize = 255;
/// Version in the high six bits of a record's first byte.
pub const RECORD_FORMAT_VERSION: u8 = 1;
/// First byte of a schema's encoding.
pub const SCHEMA_FORMAT_VERSION: u8 = 1;
/// First byte of a query's wire encoding.
pub const QUERY_FORMAT_VERSION: u8 = 1;

/// A field's type. Every field is nullable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FieldType {
    I32,
    I64,
    F64,
    Bool,
    /// UTF-8 text.
    String,
    Bytes,
}

impl FieldType {
    /// Width in the record's fixed area, or None for a variable-length type.
    pub fn fixed_width(self) -> Option<usize> {
        match self {
            FieldType::I32 => Some(4),
            FieldType::I64 | FieldType::F64 => Some(8),
            FieldType::Bool => Some(1),
            FieldType::String | FieldType::Bytes => None,
        }
    }

    /// i32, i64 or f64.
    pub fn is_numeric(self) -> bool {
        matches!(self, FieldType::I32 | FieldType::I64 | FieldType::F64)
    }

    fn code(self) -> u8 {
        match self {
            FieldType::I32 => 1,
            FieldType::I64 => 2,
            FieldType::F64 => 3,
            FieldType::Bool => 4,
            FieldType::String => 5,
            FieldType::Bytes => 6,
        }
    }

    fn from_code(code: u8) -> Option<FieldType> {
        Some(match code {
            1 => FieldType::I32,
            2 => FieldType::I64,
            3 => FieldType::F64,
            4 => FieldType::Bool,
            5 => FieldType::String,
            6 => FieldType::Bytes,
            _ => return None,
        })
    }
}

/// One named, typed, nullable field.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Field {
    pub name: String,
    pub ty: FieldType,
}

impl Field {
    pub fn new(name: impl Into<String>, ty: FieldType) -> Field {
        Field {
            name: name.into(),
            ty,
        }
    }
}

/// A field value. Equality is structural: `F64` values compare by bit pattern (so a NaN equals
/// itself and `0.0 != -0.0`); predicates use IEEE comparison instead.
#[derive(Clone, Debug)]
pub enum Value {
    Null,
    I32(i32),
    I64(i64),
    F64(f64),
    Bool(bool),
    Str(String),
    Bytes(Vec<u8>),
}

impl PartialEq for Value {
    fn eq(&self, other: &Value) -> bool {
        self.as_ref() == other.as_ref()
    }
}

impl Eq for Value {}

impl Value {
    /// The borrowed form.
    pub fn as_ref(&self) -> FieldRef<'_> {
        match self {
            Value::Null => FieldRef::Null,
            Value::I32(v) => FieldRef::I32(*v),
            Value::I64(v) => FieldRef::I64(*v),
            Value::F64(v) => FieldRef::F64(*v),
            Value::Bool(v) => FieldRef::Bool(*v),
            Value::Str(v) => FieldRef::Str(v),
            Value::Bytes(v) => FieldRef::Bytes(v),
        }
    }

    /// The value's type, None for NULL.
    pub fn field_type(&self) -> Option<FieldType> {
        self.as_ref().field_type()
    }
}

/// A field value borrowed from a record (zero-copy). Equality as for [`Value`].
#[derive(Clone, Copy, Debug)]
pub enum FieldRef<'a> {
    Null,
    I32(i32),
    I64(i64),
    F64(f64),
    Bool(bool),
    Str(&'a str),
    Bytes(&'a [u8]),
}

impl PartialEq for FieldRef<'_> {
    fn eq(&self, other: &FieldRef<'_>) -> bool {
        match (self, other) {
            (FieldRef::Null, FieldRef::Null) => true,
            (FieldRef::I32(a), FieldRef::I32(b)) => a == b,
            (FieldRef::I64(a), FieldRef::I64(b)) => a == b,
            (FieldRef::F64(a), FieldRef::F64(b)) => a.to_bits() == b.to_bits(),
            (FieldRef::Bool(a), FieldRef::Bool(b)) => a == b,
            (FieldRef::Str(a), FieldRef::Str(b)) => a == b,
            (FieldRef::Bytes(a), FieldRef::Bytes(b)) => a == b,
            _ => false,
        }
    }
}

impl Eq for FieldRef<'_> {}

impl FieldRef<'_> {
    /// An owned copy.
    pub fn to_value(&self) -> Value {
        match *self {
            FieldRef::Null => Value::Null,
            FieldRef::I32(v) => Value::I32(v),
            FieldRef::I64(v) => Value::I64(v),
            FieldRef::F64(v) => Value::F64(v),
            FieldRef::Bool(v) => Value::Bool(v),
            FieldRef::Str(v) => Value::Str(v.to_owned()),
            FieldRef::Bytes(v) => Value::Bytes(v.to_vec()),
        }
    }

    /// The value's type, None for NULL.
    pub fn field_type(&self) -> Option<FieldType> {
        Some(match self {
            FieldRef::Null => return None,
            FieldRef::I32(_) => FieldType::I32,
            FieldRef::I64(_) => FieldType::I64,
            FieldRef::F64(_) => FieldType::F64,
            FieldRef::Bool(_) => FieldType::Bool,
            FieldRef::Str(_) => FieldType::String,
            FieldRef::Bytes(_) => FieldType::Bytes,
        })
    }

    fn type_name(&self) -> &'static str {
        match self {
            FieldRef::Null => "null",
            FieldRef::I32(_) => "i32",
            FieldRef::I64(_) => "i64",
            FieldRef::F64(_) => "f64",
            FieldRef::Bool(_) => "bool",
            FieldRef::Str(_) => "string",
            FieldRef::Bytes(_) => "bytes",
        }
    }
}

/// Errors of schemas and records.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum SchemaError {
    #[error("a schema has at most {SCHEMA_FIELDS_MAX} fields, got {0}")]
    TooManyFields(usize),
    #[error("field names are 1 to {FIELD_NAME_BYTES_MAX} bytes, got {0} bytes")]
    BadNameLength(usize),
    #[error("field name {0:?} appears twice")]
    DuplicateName(String),
    #[error("field {index} does not exist (the schema has {count} fields)")]
    NoSuchField { index: usize, count: usize },
    #[error("a record of this schema has {expected} values, got {got}")]
    Arity { expected: usize, got: usize },
    #[error("field {index} is {expected:?}, got a {got} value")]
    TypeMismatch {
        index: usize,
        expected: FieldType,
        got: &'static str,
    },
    #[error("record too large: {0} bytes of variable-length data (at most 2^32 - 1)")]
    RecordTooLarge(usize),
    #[error("malformed record: {0}")]
    MalformedRecord(&'static str),
    #[error("malformed schema bytes: {0}")]
    MalformedSchema(&'static str),
}

/// Where a field lives in a record, precomputed from the schema.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Slot {
    ty: FieldType,
    /// Fixed types: byte offset from the record's start. Variable types: index among them.
    pos: u32,
    /// Byte of the null bitmap (from the record's start) and the field's bit in it.
    null_byte: u32,
    null_mask: u8,
}

/// A table's fields, with the record layout they imply.
///
/// Record layout (all integers little-endian; docs/formats.md, "Schema records"):
/// ```text
/// u8        header       bits 2-7: format version (1); bits 0-1: offset width W
///                        (0: 1 byte, 1: 2 bytes, 2: 4 bytes), the smallest that holds D
/// [B]       null bitmap  B = ceil(n/8); bit i%8 of byte i/8 set = field i is NULL; unused bits 0
/// [F]       fixed area   i32 (4), i64 (8), f64 (8, IEEE bits), bool (1: 0 or 1) fields in
///                        schema order; a NULL field's bytes are 0
/// [V × W]   end offsets  one per string/bytes field in schema order: the end of its bytes,
///                        relative to the variable area; the last one equals D
/// [D]       variable area  the string (UTF-8) and bytes fields' contents, back to back;
///                        a NULL field is empty
/// ```
/// A record with one string field of 20 bytes among 3 fixed fields carries 3 bytes of overhead
/// (header, bitmap, one offset). The encoding is canonical: every valid record is exactly what
/// [`Schema::encode`] produces for its decoded values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schema {
    fields: Vec<Field>,
    slots: Vec<Slot>,
    /// 1 + bitmap bytes + fixed bytes: where the offset table starts.
    fixed_end: usize,
    var_count: usize,
    /// Bits of the bitmap's last byte that must be zero.
    bitmap_pad_mask: u8,
}

/// A record whose envelope (header, sizes, last offset) has been checked.
#[derive(Clone, Copy)]
struct RecordView<'a> {
    bytes: &'a [u8],
    width: usize,
    table: usize,
    data: usize,
}

impl<'a> RecordView<'a> {
    #[inline(always)]
    fn offset(&self, k: usize) -> usize {
        let at = self.table + k * self.width;
        let b = self.bytes;
        match self.width {
            1 => b[at] as usize,
            2 => u16::from_le_bytes([b[at], b[at + 1]]) as usize,
            _ => u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]) as usize,
        }
    }

    #[inline(always)]
    fn var(&self, k: usize) -> Result<&'a [u8], SchemaError> {
        let end = self.offset(k);
        let start = if k == 0 { 0 } else { self.offset(k - 1) };
        let data = &self.bytes[self.data..];
        if start > end || end > data.len() {
            return Err(SchemaError::MalformedRecord(
                "variable field offsets out of order or past the end",
            ));
        }
        Ok(&data[start..end])
    }

    #[inline(always)]
    fn is_null(&self, slot: &Slot) -> bool {
        self.bytes[slot.null_byte as usize] & slot.null_mask != 0
    }

    /// Reads one field, checking everything about it (canonical NULLs, bool bytes, offsets, UTF-8).
    #[inline(always)]
    fn get(&self, slot: &Slot) -> Result<FieldRef<'a>, SchemaError> {
        let null = self.is_null(slot);
        let pos = slot.pos as usize;
        let b = self.bytes;
        match slot.ty {
            FieldType::I32 => {
                let v = i32::from_le_bytes([b[pos], b[pos + 1], b[pos + 2], b[pos + 3]]);
                fixed_or_null(null, v == 0, FieldRef::I32(v))
            }
            FieldType::I64 | FieldType::F64 => {
                let raw = u64::from_le_bytes(b[pos..pos + 8].try_into().unwrap_or([0; 8]));
                let v = if slot.ty == FieldType::I64 {
                    FieldRef::I64(raw as i64)
                } else {
                    FieldRef::F64(f64::from_bits(raw))
                };
                fixed_or_null(null, raw == 0, v)
            }
            FieldType::Bool => match (null, b[pos]) {
                (true, 0) => Ok(FieldRef::Null),
                (false, 0) => Ok(FieldRef::Bool(false)),
                (false, 1) => Ok(FieldRef::Bool(true)),
                (true, _) => Err(SchemaError::MalformedRecord(
                    "NULL field with nonzero bytes",
                )),
                (false, _) => Err(SchemaError::MalformedRecord("bool byte is neither 0 nor 1")),
            },
            FieldType::String | FieldType::Bytes => {
                let bytes = self.var(pos)?;
                if null {
                    return if bytes.is_empty() {
                        Ok(FieldRef::Null)
                    } else {
                        Err(SchemaError::MalformedRecord(
                            "NULL field with nonzero length",
                        ))
                    };
                }
                if slot.ty == FieldType::Bytes {
                    Ok(FieldRef::Bytes(bytes))
                } else {
                    std::str::from_utf8(bytes)
                        .map(FieldRef::Str)
                        .map_err(|_| SchemaError::MalformedRecord("string field is not UTF-8"))
                }
            }
        }
    }
}

#[inline(always)]
fn fixed_or_null(null: bool, zero: bool, v: FieldRef<'_>) -> Result<FieldRef<'_>, SchemaError> {
    match (null, zero) {
        (false, _) => Ok(v),
        (true, true) => Ok(FieldRef::Null),
        (true, false) => Err(SchemaError::MalformedRecord(
            "NULL field with nonzero bytes",
        )),
    }
}

/// Offset width code and width for `var_len` bytes of variable data.
fn width_for(var_len: usize) -> (u8, usize) {
    if var_len <= u8::MAX as usize {
        (0, 1)
    } else if var_len <= u16::MAX as usize {
        (1, 2)
    } else {
        (2, 4)
    }
}

impl Schema {
    /// Checks the field list (at most 255 fields, names of 1-255 bytes, unique) and precomputes
    /// the record layout.
    pub fn new(fields: Vec<Field>) -> Result<Schema, SchemaError> {
        if fields.len() > SCHEMA_FIELDS_MAX {
            return Err(SchemaError::TooManyFields(fields.len()));
        }
        for (i, f) in fields.iter().enumerate() {
            if f.name.is_empty() || f.name.len() > FIELD_NAME_BYTES_MAX {
                return Err(SchemaError::BadNameLength(f.name.len()));
            }
            if fields[..i].iter().any(|g| g.name == f.name) {
                return Err(SchemaError::DuplicateName(f.name.clone()));
            }
        }
        let bitmap_bytes = fields.len().div_ceil(8);
        let mut fixed = 1 + bitmap_bytes;
        let mut var_count = 0;
        let mut slots = Vec::with_capacity(fields.len());
        for (i, f) in fields.iter().enumerate() {
            let pos = match f.ty.fixed_width() {
                Some(w) => {
                    fixed += w;
                    fixed - w
                }
                None => {
                    var_count += 1;
                    var_count - 1
                }
            };
            slots.push(Slot {
                ty: f.ty,
                pos: pos as u32,
                null_byte: (1 + i / 8) as u32,
                null_mask: 1 << (i % 8),
            });
        }
        let used = fields.len() % 8;
        let bitmap_pad_mask = if used == 0 { 0 } else { !((1u8 << used) - 1) };
        Ok(Schema {
            fields,
            slots,
            fixed_end: fixed,
            var_count,
            bitmap_pad_mask,
        })
    }

    pub fn fields(&self) -> &[Field] {
        &self.fields
    }

    pub fn len(&self) -> usize {
        self.fields.len()
    }

    pub fn is_empty(&self) -> bool {
        self.fields.is_empty()
    }

    /// Index of the field called `name`.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.fields.iter().position(|f| f.name == name)
    }

    /// The schema of the chosen fields, in the order given (each at most once).
    pub fn project(&self, fields: &[usize]) -> Result<Schema, SchemaError> {
        let mut chosen = Vec::with_capacity(fields.len());
        for &i in fields {
            chosen.push(
                self.fields
                    .get(i)
                    .cloned()
                    .ok_or(SchemaError::NoSuchField {
                        index: i,
                        count: self.fields.len(),
                    })?,
            );
        }
        Schema::new(chosen)
    }

    /// Encodes a row as a record (see the type's documentation for the layout).
    pub fn encode(&self, values: &[Value]) -> Result<Vec<u8>, SchemaError> {
        let mut out = Vec::new();
        self.encode_into(values, &mut out)?;
        Ok(out)
    }

    /// [`Schema::encode`] appending to `out` (left unchanged on error).
    pub fn encode_into(&self, values: &[Value], out: &mut Vec<u8>) -> Result<(), SchemaError> {
        if values.len() != self.fields.len() {
            return Err(SchemaError::Arity {
                expected: self.fields.len(),
                got: values.len(),
            });
        }
        let mut var_len = 0usize;
        for (i, (v, slot)) in values.iter().zip(&self.slots).enumerate() {
            let r = v.as_ref();
            match (slot.ty, &r) {
                (_, FieldRef::Null)
                | (FieldType::I32, FieldRef::I32(_))
                | (FieldType::I64, FieldRef::I64(_))
                | (FieldType::F64, FieldRef::F64(_))
                | (FieldType::Bool, FieldRef::Bool(_)) => {}
                (FieldType::String, FieldRef::Str(s)) => var_len += s.len(),
                (FieldType::Bytes, FieldRef::Bytes(b)) => var_len += b.len(),
                _ => {
                    return Err(SchemaError::TypeMismatch {
                        index: i,
                        expected: slot.ty,
                        got: r.type_name(),
                    })
                }
            }
        }
        if var_len > u32::MAX as usize {
            return Err(SchemaError::RecordTooLarge(var_len));
        }
        let (code, width) = if self.var_count == 0 {
            (0, 1)
        } else {
            width_for(var_len)
        };
        let base = out.len();
        let data_start = self.fixed_end + self.var_count * width;
        out.resize(base + data_start, 0);
        out.reserve(var_len);
        let rec = &mut out[base..];
        rec[0] = (RECORD_FORMAT_VERSION << 2) | code;
        let mut end = 0usize;
        for (v, slot) in values.iter().zip(&self.slots) {
            let pos = slot.pos as usize;
            match v {
                Value::Null => {
                    rec[slot.null_byte as usize] |= slot.null_mask;
                    if slot.ty.fixed_width().is_none() {
                        write_offset(rec, self.fixed_end + pos * width, width, end);
                    }
                }
                Value::I32(x) => rec[pos..pos + 4].copy_from_slice(&x.to_le_bytes()),
                Value::I64(x) => rec[pos..pos + 8].copy_from_slice(&x.to_le_bytes()),
                Value::F64(x) => rec[pos..pos + 8].copy_from_slice(&x.to_bits().to_le_bytes()),
                Value::Bool(x) => rec[pos] = *x as u8,
                Value::Str(s) => {
                    end += s.len();
                    write_offset(rec, self.fixed_end + pos * width, width, end);
                }
                Value::Bytes(b) => {
                    end += b.len();
                    write_offset(rec, self.fixed_end + pos * width, width, end);
                }
            }
        }
        for v in values {
            match v {
                Value::Str(s) => out.extend_from_slice(s.as_bytes()),
                Value::Bytes(b) => out.extend_from_slice(b),
                _ => {}
            }
        }
        debug_assert_eq!(out.len(), base + data_start + var_len);
        Ok(())
    }

    /// Decodes a whole record, checking every byte of it.
    pub fn decode(&self, record: &[u8]) -> Result<Vec<Value>, SchemaError> {
        let view = self.open(record)?;
        self.slots
            .iter()
            .map(|slot| view.get(slot).map(|f| f.to_value()))
            .collect()
    }

    /// Checks that `record` is a valid record of this schema, without allocating.
    pub fn validate(&self, record: &[u8]) -> Result<(), SchemaError> {
        let view = self.open(record)?;
        for slot in &self.slots {
            view.get(slot)?;
        }
        Ok(())
    }

    /// Field `i` of `record`, borrowed, in O(1): checks the record's envelope (header, sizes,
    /// total length) and field `i` itself, but not the other fields.
    pub fn field<'a>(&self, record: &'a [u8], i: usize) -> Result<FieldRef<'a>, SchemaError> {
        let slot = self.slots.get(i).ok_or(SchemaError::NoSuchField {
            index: i,
            count: self.fields.len(),
        })?;
        self.open(record)?.get(slot)
    }

    /// Checks the envelope of a record in O(1): header byte, minimal length, unused bitmap bits,
    /// canonical offset width, and that the last offset accounts for every remaining byte (so a
    /// truncated record or trailing garbage is caught here).
    #[inline(always)]
    fn open<'a>(&self, record: &'a [u8]) -> Result<RecordView<'a>, SchemaError> {
        let Some(&header) = record.first() else {
            return Err(SchemaError::MalformedRecord("empty record"));
        };
        if header >> 2 != RECORD_FORMAT_VERSION {
            return Err(SchemaError::MalformedRecord(
                "unknown record format version",
            ));
        }
        let code = header & 3;
        let width = match code {
            0 => 1,
            1 => 2,
            2 => 4,
            _ => return Err(SchemaError::MalformedRecord("bad offset width")),
        };
        let table = self.fixed_end;
        let data = table + self.var_count * width;
        if record.len() < data {
            return Err(SchemaError::MalformedRecord("record truncated"));
        }
        if self.bitmap_pad_mask != 0
            && record[self.fixed_end_bitmap_last()] & self.bitmap_pad_mask != 0
        {
            return Err(SchemaError::MalformedRecord(
                "null bit set past the last field",
            ));
        }
        let view = RecordView {
            bytes: record,
            width,
            table,
            data,
        };
        let var_len = record.len() - data;
        if self.var_count == 0 {
            if code != 0 {
                return Err(SchemaError::MalformedRecord(
                    "offset width without variable fields",
                ));
            }
            if var_len != 0 {
                return Err(SchemaError::MalformedRecord(
                    "trailing bytes after the record",
                ));
            }
        } else {
            if view.offset(self.var_count - 1) != var_len {
                return Err(SchemaError::MalformedRecord(
                    "variable area length does not match the last offset",
                ));
            }
            if width_for(var_len).0 != code {
                return Err(SchemaError::MalformedRecord(
                    "offset width is not the smallest",
                ));
            }
        }
        Ok(view)
    }

    /// Whether `record` passes [`Schema::open`]'s envelope checks: the same answer, decided
    /// without building a view or an error (batch evaluation asks this of every record).
    #[inline(always)]
    fn envelope_ok(&self, record: &[u8]) -> bool {
        let Some(&header) = record.first() else {
            return false;
        };
        let code = header & 3;
        if header >> 2 != RECORD_FORMAT_VERSION || code == 3 {
            return false;
        }
        let width = 1usize << code;
        let data = self.fixed_end + self.var_count * width;
        if record.len() < data
            || (self.bitmap_pad_mask != 0
                && record[self.fixed_end_bitmap_last()] & self.bitmap_pad_mask != 0)
        {
            return false;
        }
        let var_len = record.len() - data;
        if self.var_count == 0 {
            return code == 0 && var_len == 0;
        }
        let at = self.fixed_end + (self.var_count - 1) * width;
        let last = if code == 0 {
            record[at] as usize
        } else if code == 1 {
            u16::from_le_bytes([record[at], record[at + 1]]) as usize
        } else {
            u32::from_le_bytes([record[at], record[at + 1], record[at + 2], record[at + 3]])
                as usize
        };
        last == var_len && width_for(var_len).0 == code
    }

    /// [`Schema::envelope_ok`] of each of up to 64 records, as a bit mask (bit i for
    /// `records[i]`). A record whose variable area uses one-byte offsets (every record of small
    /// objects) is decided by three compares without branches: its header byte, the bitmap's
    /// padding, and the last offset against the record's length (a last offset that equals the
    /// variable area's length and fits a byte also proves one-byte offsets are the smallest).
    /// Any other record goes through `envelope_ok`.
    ///
    /// Also returns the OR over the records of their byte `probe.0` masked with `probe.1` (a
    /// byte of the null bitmap, so in bounds of every record long enough to be checked), and
    /// sets `ptrs[i]` to record i if it passed, else to [`ZERO_RECORD`] (for the column readers,
    /// which then read every slot without a branch).
    #[inline(always)]
    fn envelope_mask(
        &self,
        records: &[&[u8]],
        probe: (usize, u8),
        ptrs: &mut [*const u8; BATCH_RECORDS],
    ) -> (u64, u8) {
        let header = RECORD_FORMAT_VERSION << 2;
        // Where the data starts with one-byte offsets; the last offset is the byte before it.
        let data = self.fixed_end + self.var_count;
        let pad_at = self.fixed_end_bitmap_last();
        assert!(probe.0 < self.fixed_end && pad_at < self.fixed_end);
        let (mut valid, mut probed) = (0u64, 0u8);
        for (i, (r, p)) in records.iter().zip(ptrs.iter_mut()).enumerate() {
            // Wider offsets only start the data later, so a shorter record is malformed.
            let ok = r.len() >= data && {
                // SAFETY: every index read is below `data` (asserted above), so below `r.len()`.
                let at = |k: usize| unsafe { *r.get_unchecked(k) };
                probed |= at(probe.0) & probe.1;
                let var_len = r.len() - data;
                let last_ok = if self.var_count == 0 {
                    var_len == 0
                } else {
                    at(data - 1) as usize == var_len
                };
                let fast = (at(0) == header) & (at(pad_at) & self.bitmap_pad_mask == 0) & last_ok;
                fast || self.envelope_ok(r)
            };
            debug_assert_eq!(ok, self.envelope_ok(r));
            valid |= (ok as u64) << i;
            *p = if ok { r.as_ptr() } else { ZERO_RECORD.as_ptr() };
        }
        (valid, probed)
    }

    /// Index of the null bitmap's last byte.
    #[inline(always)]
    fn fixed_end_bitmap_last(&self) -> usize {
        self.fields.len().div_ceil(8)
    }

    /// The schema's own encoding (docs/formats.md, "Schema records"):
    /// `u8 version (1), u8 field count, then per field: u8 type, u8 name length, name (UTF-8)`.
    /// Types: 1 i32, 2 i64, 3 f64, 4 bool, 5 string, 6 bytes. At most 2 + 255 × 257 bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out =
            Vec::with_capacity(2 + self.fields.iter().map(|f| 2 + f.name.len()).sum::<usize>());
        out.push(SCHEMA_FORMAT_VERSION);
        out.push(self.fields.len() as u8);
        for f in &self.fields {
            out.push(f.ty.code());
            out.push(f.name.len() as u8);
            out.extend_from_slice(f.name.as_bytes());
        }
        out
    }

    /// Parses [`Schema::to_bytes`]; any other input (bad version or type, truncation, bad UTF-8,
    /// duplicate names, trailing bytes) is an error.
    pub fn from_bytes(bytes: &[u8]) -> Result<Schema, SchemaError> {
        let bad = SchemaError::MalformedSchema;
        let mut r = Reader::new(bytes);
        fn next<'a>(r: &mut Reader<'a>, n: usize) -> Result<&'a [u8], SchemaError> {
            r.take(n).ok_or(SchemaError::MalformedSchema("truncated"))
        }
        if next(&mut r, 1)?[0] != SCHEMA_FORMAT_VERSION {
            return Err(bad("unknown schema format version"));
        }
        let count = next(&mut r, 1)?[0] as usize;
        let mut fields = Vec::with_capacity(count);
        for _ in 0..count {
            let ty = FieldType::from_code(next(&mut r, 1)?[0]).ok_or(bad("unknown field type"))?;
            let len = next(&mut r, 1)?[0] as usize;
            let name = std::str::from_utf8(next(&mut r, len)?)
                .map_err(|_| bad("field name is not UTF-8"))?;
            fields.push(Field::new(name, ty));
        }
        if !r.is_done() {
            return Err(bad("trailing bytes"));
        }
        Schema::new(fields)
    }
}

fn write_offset(rec: &mut [u8], at: usize, width: usize, value: usize) {
    match width {
        1 => rec[at] = value as u8,
        2 => rec[at..at + 2].copy_from_slice(&(value as u16).to_le_bytes()),
        _ => rec[at..at + 4].copy_from_slice(&(value as u32).to_le_bytes()),
    }
}

/// A bounds-checked cursor over untrusted bytes.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn new(bytes: &'a [u8]) -> Reader<'a> {
        Reader { bytes, pos: 0 }
    }

    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.pos.checked_add(n)?;
        let s = self.bytes.get(self.pos..end)?;
        self.pos = end;
        Some(s)
    }

    fn is_done(&self) -> bool {
        self.pos == self.bytes.len()
    }
}

// ---------------------------------------------------------------------------------------------
// Predicates, projection, aggregates, queries
// ---------------------------------------------------------------------------------------------

/// Most OR-clauses in a CNF (one bit each in the evaluation's bit vector).
pub const CNF_CLAUSES_MAX: usize = 64;
/// Most predicates in a CNF, over all clauses.
pub const CNF_PREDICATES_MAX: usize = 256;
/// Most aggregates in a query.
pub const AGGREGATES_MAX: usize = 64;
/// Longest string/bytes constant in a predicate.
pub const CONSTANT_BYTES_MAX: usize = 64 * 1024;
/// Longest glob pattern, prefix or range bound of a key filter (the longest key).
pub const KEY_FILTER_BYTES_MAX: usize = 64 * 1024;

/// A predicate's operator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    Lt,
    Le,
    Eq,
    Ne,
    Ge,
    Gt,
    /// String or Bytes field starts with the constant.
    Prefix,
    /// The field is NULL (the constant must be `Value::Null`).
    IsNull,
}

impl Op {
    fn code(self) -> u8 {
        match self {
            Op::Lt => 0,
            Op::Le => 1,
            Op::Eq => 2,
            Op::Ne => 3,
            Op::Ge => 4,
            Op::Gt => 5,
            Op::Prefix => 6,
            Op::IsNull => 7,
        }
    }

    fn from_code(code: u8) -> Option<Op> {
        Some(match code {
            0 => Op::Lt,
            1 => Op::Le,
            2 => Op::Eq,
            3 => Op::Ne,
            4 => Op::Ge,
            5 => Op::Gt,
            6 => Op::Prefix,
            7 => Op::IsNull,
            _ => return None,
        })
    }

    /// Whether an ordering of field vs constant satisfies a comparison operator (false for
    /// Prefix and IsNull, which are not comparisons).
    #[inline(always)]
    fn holds(self, ord: std::cmp::Ordering) -> bool {
        use std::cmp::Ordering::*;
        match self {
            Op::Lt => ord == Less,
            Op::Le => ord != Greater,
            Op::Eq => ord == Equal,
            Op::Ne => ord != Equal,
            Op::Ge => ord != Less,
            Op::Gt => ord == Greater,
            Op::Prefix | Op::IsNull => false,
        }
    }
}

/// `field op constant`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Predicate {
    pub field: usize,
    pub op: Op,
    pub constant: Value,
}

impl Predicate {
    pub fn new(field: usize, op: Op, constant: Value) -> Predicate {
        Predicate {
            field,
            op,
            constant,
        }
    }
}

/// A predicate in conjunctive normal form: an AND of OR-clauses. No clause matches everything;
/// an empty clause matches nothing.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Cnf {
    pub clauses: Vec<Vec<Predicate>>,
}

/// An aggregate over the matching records.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Aggregate {
    /// Number of matching records (→ I64).
    Count,
    /// Sum of a numeric field, NULLs ignored (→ I64 for integers, F64 for f64; NULL if none).
    Sum(usize),
    /// Smallest non-NULL value of a numeric, bool, string or bytes field (→ the field's type).
    Min(usize),
    /// Largest non-NULL value (→ the field's type).
    Max(usize),
}

/// What a scan evaluates: a key filter, a CNF predicate over the schema's fields, and either a
/// projection (the records returned hold only these fields, in this order) or aggregates.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Query {
    pub key_filter: KeyFilter,
    pub predicate: Cnf,
    pub projection: Option<Vec<usize>>,
    pub aggregates: Vec<Aggregate>,
}

/// Errors of queries: compile-time validation, wire decoding, records that do not decode, and
/// sum overflow.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum QueryError {
    /// A record (or schema) is malformed.
    #[error(transparent)]
    Schema(#[from] SchemaError),
    #[error("the query reads fields but the table has no schema")]
    NoSchema,
    #[error("field {index} does not exist (the schema has {count} fields)")]
    NoSuchField { index: usize, count: usize },
    #[error("predicate on field {field}: {reason}")]
    BadPredicate { field: usize, reason: String },
    #[error("aggregate {aggregate:?}: {reason}")]
    BadAggregate {
        aggregate: Aggregate,
        reason: &'static str,
    },
    #[error("the projection lists field {0} twice")]
    DuplicateProjection(usize),
    #[error("a query either projects or aggregates, not both")]
    ProjectionWithAggregates,
    #[error("query too large: {0}")]
    TooLarge(String),
    #[error("malformed query bytes: {0}")]
    Malformed(&'static str),
    #[error("the sum of field {field} does not fit in an i64")]
    SumOverflow { field: usize },
}

impl Query {
    /// A query with only a key filter.
    pub fn keys(key_filter: KeyFilter) -> Query {
        Query {
            key_filter,
            ..Query::default()
        }
    }

    /// Checks the counts and lengths that the wire encoding bounds.
    fn check_limits(&self) -> Result<(), QueryError> {
        let too_large = |what: String| Err(QueryError::TooLarge(what));
        let filter_len = |b: &[u8]| b.len() > KEY_FILTER_BYTES_MAX;
        let bound_len = |b: &Bound<Vec<u8>>| match b {
            Bound::Included(v) | Bound::Excluded(v) => filter_len(v),
            Bound::Unbounded => false,
        };
        let long = match &self.key_filter {
            KeyFilter::All => false,
            KeyFilter::Glob(v) | KeyFilter::Prefix(v) => filter_len(v),
            KeyFilter::Range { start, end } => bound_len(start) || bound_len(end),
        };
        if long {
            return too_large(format!(
                "key filter longer than {KEY_FILTER_BYTES_MAX} bytes"
            ));
        }
        let clauses = &self.predicate.clauses;
        if clauses.len() > CNF_CLAUSES_MAX {
            return too_large(format!(
                "{} clauses (at most {CNF_CLAUSES_MAX})",
                clauses.len()
            ));
        }
        let n: usize = clauses.iter().map(Vec::len).sum();
        if n > CNF_PREDICATES_MAX {
            return too_large(format!("{n} predicates (at most {CNF_PREDICATES_MAX})"));
        }
        for p in clauses.iter().flatten() {
            if p.field >= SCHEMA_FIELDS_MAX {
                return too_large(format!("field index {}", p.field));
            }
            let len = match &p.constant {
                Value::Str(s) => s.len(),
                Value::Bytes(b) => b.len(),
                _ => 0,
            };
            if len > CONSTANT_BYTES_MAX {
                return too_large(format!(
                    "constant of {len} bytes (at most {CONSTANT_BYTES_MAX})"
                ));
            }
        }
        if let Some(fields) = &self.projection {
            if fields.len() > SCHEMA_FIELDS_MAX {
                return too_large(format!("projection of {} fields", fields.len()));
            }
            if let Some(f) = fields.iter().find(|&&f| f >= SCHEMA_FIELDS_MAX) {
                return too_large(format!("field index {f}"));
            }
        }
        if self.aggregates.len() > AGGREGATES_MAX {
            return too_large(format!(
                "{} aggregates (at most {AGGREGATES_MAX})",
                self.aggregates.len()
            ));
        }
        for a in &self.aggregates {
            if let Aggregate::Sum(f) | Aggregate::Min(f) | Aggregate::Max(f) = a {
                if *f >= SCHEMA_FIELDS_MAX {
                    return too_large(format!("field index {f}"));
                }
            }
        }
        Ok(())
    }

    /// The wire encoding (docs/formats.md, "Schema records"). Fails if a count or length is past
    /// its bound (the same bounds [`Query::from_bytes`] and [`CompiledQuery::new`] enforce).
    pub fn to_bytes(&self) -> Result<Vec<u8>, QueryError> {
        self.check_limits()?;
        let mut out = vec![QUERY_FORMAT_VERSION];
        let put_bytes = |out: &mut Vec<u8>, b: &[u8]| {
            out.extend_from_slice(&(b.len() as u32).to_le_bytes());
            out.extend_from_slice(b);
        };
        let put_bound = |out: &mut Vec<u8>, b: &Bound<Vec<u8>>| match b {
            Bound::Unbounded => out.push(0),
            Bound::Included(v) => {
                out.push(1);
                put_bytes(out, v);
            }
            Bound::Excluded(v) => {
                out.push(2);
                put_bytes(out, v);
            }
        };
        match &self.key_filter {
            KeyFilter::All => out.push(0),
            KeyFilter::Glob(p) => {
                out.push(1);
                put_bytes(&mut out, p);
            }
            KeyFilter::Prefix(p) => {
                out.push(2);
                put_bytes(&mut out, p);
            }
            KeyFilter::Range { start, end } => {
                out.push(3);
                put_bound(&mut out, start);
                put_bound(&mut out, end);
            }
        }
        out.push(self.predicate.clauses.len() as u8);
        for clause in &self.predicate.clauses {
            out.push(clause.len() as u8);
            for p in clause {
                out.push(p.field as u8);
                out.push(p.op.code());
                write_value(&mut out, &p.constant);
            }
        }
        match &self.projection {
            None => out.push(0),
            Some(fields) => {
                out.push(1);
                out.push(fields.len() as u8);
                out.extend(fields.iter().map(|&f| f as u8));
            }
        }
        out.push(self.aggregates.len() as u8);
        for a in &self.aggregates {
            match *a {
                Aggregate::Count => out.push(0),
                Aggregate::Sum(f) => out.extend_from_slice(&[1, f as u8]),
                Aggregate::Min(f) => out.extend_from_slice(&[2, f as u8]),
                Aggregate::Max(f) => out.extend_from_slice(&[3, f as u8]),
            }
        }
        Ok(out)
    }

    /// Parses [`Query::to_bytes`]. Every count and length is bounded before anything is
    /// allocated; malformed input (unknown tags, truncation, bad UTF-8, trailing bytes) is an error.
    pub fn from_bytes(bytes: &[u8]) -> Result<Query, QueryError> {
        let mut r = Reader::new(bytes);
        if read_u8(&mut r)? != QUERY_FORMAT_VERSION {
            return Err(QueryError::Malformed("unknown query format version"));
        }
        let read_bound = |r: &mut Reader<'_>| -> Result<Bound<Vec<u8>>, QueryError> {
            Ok(match read_u8(r)? {
                0 => Bound::Unbounded,
                1 => Bound::Included(read_bytes(r, KEY_FILTER_BYTES_MAX)?.to_vec()),
                2 => Bound::Excluded(read_bytes(r, KEY_FILTER_BYTES_MAX)?.to_vec()),
                _ => return Err(QueryError::Malformed("unknown bound kind")),
            })
        };
        let key_filter = match read_u8(&mut r)? {
            0 => KeyFilter::All,
            1 => KeyFilter::Glob(read_bytes(&mut r, KEY_FILTER_BYTES_MAX)?.to_vec()),
            2 => KeyFilter::Prefix(read_bytes(&mut r, KEY_FILTER_BYTES_MAX)?.to_vec()),
            3 => {
                let start = read_bound(&mut r)?;
                let end = read_bound(&mut r)?;
                KeyFilter::Range { start, end }
            }
            _ => return Err(QueryError::Malformed("unknown key filter kind")),
        };
        let clause_count = read_u8(&mut r)? as usize;
        if clause_count > CNF_CLAUSES_MAX {
            return Err(QueryError::Malformed("too many clauses"));
        }
        let mut clauses = Vec::with_capacity(clause_count);
        let mut total = 0usize;
        for _ in 0..clause_count {
            let n = read_u8(&mut r)? as usize;
            total += n;
            if total > CNF_PREDICATES_MAX {
                return Err(QueryError::Malformed("too many predicates"));
            }
            let mut clause = Vec::with_capacity(n);
            for _ in 0..n {
                let field = read_u8(&mut r)? as usize;
                let op = Op::from_code(read_u8(&mut r)?)
                    .ok_or(QueryError::Malformed("unknown operator"))?;
                let constant = read_value(&mut r)?;
                clause.push(Predicate {
                    field,
                    op,
                    constant,
                });
            }
            clauses.push(clause);
        }
        let projection = match read_u8(&mut r)? {
            0 => None,
            1 => {
                let n = read_u8(&mut r)? as usize;
                let fields = r.take(n).ok_or(QueryError::Malformed("truncated"))?;
                Some(fields.iter().map(|&f| f as usize).collect())
            }
            _ => return Err(QueryError::Malformed("unknown projection flag")),
        };
        let agg_count = read_u8(&mut r)? as usize;
        if agg_count > AGGREGATES_MAX {
            return Err(QueryError::Malformed("too many aggregates"));
        }
        let mut aggregates = Vec::with_capacity(agg_count);
        for _ in 0..agg_count {
            aggregates.push(match read_u8(&mut r)? {
                0 => Aggregate::Count,
                1 => Aggregate::Sum(read_u8(&mut r)? as usize),
                2 => Aggregate::Min(read_u8(&mut r)? as usize),
                3 => Aggregate::Max(read_u8(&mut r)? as usize),
                _ => return Err(QueryError::Malformed("unknown aggregate kind")),
            });
        }
        if !r.is_done() {
            return Err(QueryError::Malformed("trailing bytes"));
        }
        let q = Query {
            key_filter,
            predicate: Cnf { clauses },
            projection,
            aggregates,
        };
        // Field indexes in one byte can reach 255, one past the largest valid index.
        q.check_limits()
            .map_err(|_| QueryError::Malformed("field index out of range"))?;
        Ok(q)
    }
}

fn read_u8(r: &mut Reader<'_>) -> Result<u8, QueryError> {
    r.take(1)
        .map(|b| b[0])
        .ok_or(QueryError::Malformed("truncated"))
}

fn read_bytes<'a>(r: &mut Reader<'a>, max: usize) -> Result<&'a [u8], QueryError> {
    let len = r.take(4).ok_or(QueryError::Malformed("truncated"))?;
    let len = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
    if len > max {
        return Err(QueryError::Malformed("length past its bound"));
    }
    r.take(len).ok_or(QueryError::Malformed("truncated"))
}

/// Value encoding shared by query constants and [`encode_values`]: a tag byte, then
/// 0 NULL, 1 i32 (4), 2 i64 (8), 3 f64 (8, IEEE bits), 4 bool (1: 0 or 1),
/// 5 string (u32 length + UTF-8), 6 bytes (u32 length + bytes); little-endian.
fn write_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::Null => out.push(0),
        Value::I32(x) => {
            out.push(1);
            out.extend_from_slice(&x.to_le_bytes());
        }
        Value::I64(x) => {
            out.push(2);
            out.extend_from_slice(&x.to_le_bytes());
        }
        Value::F64(x) => {
            out.push(3);
            out.extend_from_slice(&x.to_bits().to_le_bytes());
        }
        Value::Bool(x) => out.extend_from_slice(&[4, *x as u8]),
        Value::Str(s) => {
            out.push(5);
            out.extend_from_slice(&(s.len() as u32).to_le_bytes());
            out.extend_from_slice(s.as_bytes());
        }
        Value::Bytes(b) => {
            out.push(6);
            out.extend_from_slice(&(b.len() as u32).to_le_bytes());
            out.extend_from_slice(b);
        }
    }
}

fn read_value(r: &mut Reader<'_>) -> Result<Value, QueryError> {
    let truncated = QueryError::Malformed("truncated");
    let fixed = |r: &mut Reader<'_>, n: usize| -> Result<[u8; 8], QueryError> {
        let b = r.take(n).ok_or(truncated.clone())?;
        let mut a = [0u8; 8];
        a[..n].copy_from_slice(b);
        Ok(a)
    };
    Ok(match read_u8(r)? {
        0 => Value::Null,
        1 => {
            let a = fixed(r, 4)?;
            Value::I32(i32::from_le_bytes([a[0], a[1], a[2], a[3]]))
        }
        2 => Value::I64(i64::from_le_bytes(fixed(r, 8)?)),
        3 => Value::F64(f64::from_bits(u64::from_le_bytes(fixed(r, 8)?))),
        4 => match read_u8(r)? {
            0 => Value::Bool(false),
            1 => Value::Bool(true),
            _ => return Err(QueryError::Malformed("bool is neither 0 nor 1")),
        },
        5 => {
            let b = read_bytes(r, CONSTANT_BYTES_MAX)?;
            Value::Str(
                std::str::from_utf8(b)
                    .map_err(|_| QueryError::Malformed("string is not UTF-8"))?
                    .to_owned(),
            )
        }
        6 => Value::Bytes(read_bytes(r, CONSTANT_BYTES_MAX)?.to_vec()),
        _ => return Err(QueryError::Malformed("unknown value type")),
    })
}

/// Most values in [`encode_values`] (a query's aggregates fit).
pub const VALUES_MAX: usize = 255;

/// Encodes a short list of values (e.g. [`AggState::finish`]'s result) for the wire:
/// `u8 count` then each value as in a query's constants (docs/formats.md). Fails past 255 values
/// or a string/bytes value past 4 GiB.
pub fn encode_values(values: &[Value], out: &mut Vec<u8>) -> Result<(), QueryError> {
    if values.len() > VALUES_MAX {
        return Err(QueryError::TooLarge(format!("{} values", values.len())));
    }
    if values.iter().any(|v| match v {
        Value::Str(s) => s.len() > u32::MAX as usize,
        Value::Bytes(b) => b.len() > u32::MAX as usize,
        _ => false,
    }) {
        return Err(QueryError::TooLarge("value longer than 4 GiB".into()));
    }
    out.push(values.len() as u8);
    for v in values {
        write_value(out, v);
    }
    Ok(())
}

/// Parses [`encode_values`]; string/bytes values are bounded by `value_bytes_max` each.
pub fn decode_values(bytes: &[u8], value_bytes_max: usize) -> Result<Vec<Value>, QueryError> {
    let mut r = Reader::new(bytes);
    let n = read_u8(&mut r)? as usize;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let v = match r.bytes.get(r.pos) {
            Some(5) | Some(6) => {
                let tag = read_u8(&mut r)?;
                let b = read_bytes(&mut r, value_bytes_max)?;
                if tag == 5 {
                    Value::Str(
                        std::str::from_utf8(b)
                            .map_err(|_| QueryError::Malformed("string is not UTF-8"))?
                            .to_owned(),
                    )
                } else {
                    Value::Bytes(b.to_vec())
                }
            }
            _ => read_value(&mut r)?,
        };
        out.push(v);
    }
    if !r.is_done() {
        return Err(QueryError::Malformed("trailing bytes"));
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// Compiled queries
// ---------------------------------------------------------------------------------------------

/// A predicate's test, specialised to the field's type at compile time.
#[derive(Clone, Debug)]
enum Test {
    IsNull,
    /// i32 or i64 field (widened), against an i64 constant.
    Int(Op, i64),
    F64(Op, f64),
    Bool(Op, bool),
    /// String or Bytes field compared byte-wise.
    Bytes(Op, Box<[u8]>),
    Prefix(Box<[u8]>),
}

#[derive(Clone, Debug)]
struct CompiledPredicate {
    slot: Slot,
    /// This predicate's OR-clause's bit.
    bit: u64,
    /// Last predicate of its clause: if the clause's bit is still clear after it, the record fails.
    last_in_clause: bool,
    test: Test,
}

impl CompiledPredicate {
    #[inline(always)]
    fn eval(&self, view: &RecordView<'_>) -> Result<bool, SchemaError> {
        // String and bytes fields compare as bytes: skip the UTF-8 check of `get`.
        if self.slot.ty.fixed_width().is_none() {
            let bytes = view.var(self.slot.pos as usize)?;
            let null = view.is_null(&self.slot);
            if null && !bytes.is_empty() {
                return Err(SchemaError::MalformedRecord(
                    "NULL field with nonzero length",
                ));
            }
            return Ok(match &self.test {
                Test::IsNull => null,
                _ if null => false,
                Test::Bytes(op, c) => op.holds(bytes.cmp(c)),
                Test::Prefix(c) => bytes.starts_with(c),
                _ => false,
            });
        }
        let field = view.get(&self.slot)?;
        Ok(match (&self.test, field) {
            (Test::IsNull, f) => matches!(f, FieldRef::Null),
            (_, FieldRef::Null) => false,
            (Test::Int(op, c), FieldRef::I32(v)) => op.holds((v as i64).cmp(c)),
            (Test::Int(op, c), FieldRef::I64(v)) => op.holds(v.cmp(c)),
            // partial_cmp is None with a NaN on either side: every comparison is false.
            (Test::F64(op, c), FieldRef::F64(v)) => v.partial_cmp(c).is_some_and(|o| op.holds(o)),
            (Test::Bool(op, c), FieldRef::Bool(v)) => op.holds(v.cmp(c)),
            (Test::Bytes(op, c), FieldRef::Str(v)) => op.holds(v.as_bytes().cmp(c)),
            (Test::Bytes(op, c), FieldRef::Bytes(v)) => op.holds(v.cmp(c)),
            (Test::Prefix(c), FieldRef::Str(v)) => v.as_bytes().starts_with(c),
            (Test::Prefix(c), FieldRef::Bytes(v)) => v.starts_with(c),
            // Compilation pairs each test with its field's type; nothing else reaches here.
            _ => false,
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum AggKind {
    Count,
    Sum,
    Min,
    Max,
}

#[derive(Clone, Debug)]
struct AggPlan {
    schema: Option<Schema>,
    /// (kind, slot of the field; unused for Count, field index for errors).
    aggs: Vec<(AggKind, Slot, usize)>,
}

/// A [`Query`] validated against a table's schema and laid out for the scan's hot loop.
/// Cheap to share across scan threads (`Send + Sync`, evaluation takes `&self`).
#[derive(Clone, Debug)]
pub struct CompiledQuery {
    query: Query,
    key_filter: KeyFilter,
    schema: Option<Schema>,
    predicates: Vec<CompiledPredicate>,
    /// One bit per OR-clause.
    all_clauses: u64,
    projection: Option<(Vec<usize>, Schema)>,
    plan: Arc<AggPlan>,
    /// The same predicates and aggregates flattened for fixed-width fields, when every field the
    /// query reads is one (the common analytic case); evaluation then takes this path.
    fixed: Option<FixedPlan>,
}

impl CompiledQuery {
    /// Validates `query` against `schema` (None for a table without one, where only the key
    /// filter is allowed): field indexes, constant types, operators per type, projection fields
    /// (unique), aggregate types, and the counts the wire format bounds.
    pub fn new(query: Query, schema: Option<&Schema>) -> Result<CompiledQuery, QueryError> {
        query.check_limits()?;
        let reads_fields = !query.predicate.clauses.is_empty()
            || query.projection.is_some()
            || query.aggregates.iter().any(|a| *a != Aggregate::Count);
        if reads_fields && schema.is_none() {
            return Err(QueryError::NoSchema);
        }
        if query.projection.is_some() && !query.aggregates.is_empty() {
            return Err(QueryError::ProjectionWithAggregates);
        }
        let slot_of = |index: usize| -> Result<(Slot, FieldType), QueryError> {
            let s = schema.ok_or(QueryError::NoSchema)?;
            let slot = *s.slots.get(index).ok_or(QueryError::NoSuchField {
                index,
                count: s.len(),
            })?;
            Ok((slot, slot.ty))
        };

        let mut predicates = Vec::new();
        let mut all_clauses = 0u64;
        for (c, clause) in query.predicate.clauses.iter().enumerate() {
            let bit = 1u64 << c;
            all_clauses |= bit;
            for (j, p) in clause.iter().enumerate() {
                let (slot, ty) = slot_of(p.field)?;
                predicates.push(CompiledPredicate {
                    slot,
                    bit,
                    last_in_clause: j + 1 == clause.len(),
                    test: compile_test(p, ty)?,
                });
            }
        }

        let projection = match &query.projection {
            None => None,
            Some(fields) => {
                for (i, f) in fields.iter().enumerate() {
                    slot_of(*f)?;
                    if fields[..i].contains(f) {
                        return Err(QueryError::DuplicateProjection(*f));
                    }
                }
                let sub = schema.ok_or(QueryError::NoSchema)?.project(fields)?;
                Some((fields.clone(), sub))
            }
        };

        let mut aggs = Vec::with_capacity(query.aggregates.len());
        for a in &query.aggregates {
            let bad = |reason| QueryError::BadAggregate {
                aggregate: *a,
                reason,
            };
            let (kind, field) = match *a {
                Aggregate::Count => {
                    let dummy = Slot {
                        ty: FieldType::Bool,
                        pos: 0,
                        null_byte: 0,
                        null_mask: 0,
                    };
                    aggs.push((AggKind::Count, dummy, 0));
                    continue;
                }
                Aggregate::Sum(f) => (AggKind::Sum, f),
                Aggregate::Min(f) => (AggKind::Min, f),
                Aggregate::Max(f) => (AggKind::Max, f),
            };
            let (slot, ty) = slot_of(field)?;
            if kind == AggKind::Sum && !ty.is_numeric() {
                return Err(bad("sum needs an i32, i64 or f64 field"));
            }
            aggs.push((kind, slot, field));
        }

        let fixed = FixedPlan::new(&predicates, &aggs, all_clauses);
        Ok(CompiledQuery {
            key_filter: query.key_filter.clone(),
            schema: schema.cloned(),
            predicates,
            all_clauses,
            projection,
            plan: Arc::new(AggPlan {
                schema: schema.cloned(),
                aggs,
            }),
            fixed,
            query,
        })
    }

    /// The query this was compiled from.
    pub fn query(&self) -> &Query {
        &self.query
    }

    /// The table's schema, if any.
    pub fn schema(&self) -> Option<&Schema> {
        self.schema.as_ref()
    }

    /// The schema of the records [`CompiledQuery::project`] writes: the projected sub-schema, or
    /// the table's schema when the query has no projection.
    pub fn output_schema(&self) -> Option<&Schema> {
        match &self.projection {
            Some((_, sub)) => Some(sub),
            None => self.schema.as_ref(),
        }
    }

    /// Whether the query aggregates (the scan then feeds an [`AggState`] instead of returning
    /// records).
    pub fn is_aggregate(&self) -> bool {
        !self.query.aggregates.is_empty()
    }

    /// Whether the object with this key and value is selected: key filter first, then (on a
    /// table with a schema) the record's envelope and the CNF, one bit per OR-clause, skipping
    /// predicates of clauses already true and stopping at the first clause found false.
    ///
    /// Allocates nothing and reads only the fields the predicate names. Err means the value is
    /// not a record of the schema; checked are the envelope (header, sizes, total length) and the
    /// fields evaluated, except that string contents compare as bytes and are not UTF-8-checked.
    /// So a defect confined to a field the predicate does not read, or bad UTF-8 in a string, is
    /// not seen here ([`Schema::validate`] sees everything; [`CompiledQuery::project`] checks
    /// every field it copies).
    #[inline]
    pub fn matches(&self, key: &[u8], value: &[u8]) -> Result<bool, QueryError> {
        if !self.key_filter.matches(key) {
            return Ok(false);
        }
        let Some(schema) = &self.schema else {
            return Ok(true);
        };
        let view = schema.open(value)?;
        match self.fixed.as_ref().and_then(|f| f.select(view.bytes)) {
            Some(selected) => Ok(selected),
            None => self.cnf_holds(&view),
        }
    }

    /// `matches`, then (if it matched) `agg.update`, opening the record once. Returns whether the
    /// record matched; `agg` is unchanged on error.
    #[inline]
    pub fn matches_and_aggregate(
        &self,
        agg: &mut AggState,
        key: &[u8],
        value: &[u8],
    ) -> Result<bool, QueryError> {
        if !self.key_filter.matches(key) {
            return Ok(false);
        }
        self.select_and_aggregate_general(agg, value)
    }

    /// Whether [`CompiledQuery::aggregate_batch`] evaluates this query column by column: an
    /// aggregate on a table with a schema, reading fixed-width fields only.
    pub fn batches(&self) -> bool {
        self.fixed.is_some() && self.schema.is_some() && self.is_aggregate()
    }

    /// `matches_and_aggregate` for up to [`BATCH_RECORDS`] values whose keys already passed the
    /// key filter, evaluated a field at a time over the whole batch, without data-dependent
    /// branches. Returns (records selected, records malformed), the same counts and
    /// accumulators as calling `matches_and_aggregate` on each value.
    pub fn aggregate_batch(&self, agg: &mut AggState, values: &[&[u8]]) -> (u64, u64) {
        #[cfg(target_arch = "x86_64")]
        if has_batch_features() {
            // SAFETY: the CPU has AVX2, BMI1 and POPCNT.
            return unsafe { self.aggregate_batch_avx2(agg, values) };
        }
        self.aggregate_batch_impl(agg, values)
    }

    /// [`CompiledQuery::aggregate_batch`] compiled for AVX2 (the batch's column loops several
    /// records per instruction), BMI1 and POPCNT (bit masks of records).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,bmi1,popcnt")]
    unsafe fn aggregate_batch_avx2(&self, agg: &mut AggState, values: &[&[u8]]) -> (u64, u64) {
        self.aggregate_batch_impl(agg, values)
    }

    #[inline(always)]
    fn aggregate_batch_impl(&self, agg: &mut AggState, values: &[&[u8]]) -> (u64, u64) {
        let (Some(schema), Some(fixed), true) =
            (&self.schema, &self.fixed, values.len() <= BATCH_RECORDS)
        else {
            let (mut matched, mut malformed) = (0, 0);
            for v in values {
                match self.select_and_aggregate_general(agg, v) {
                    Ok(true) => matched += 1,
                    Ok(false) => {}
                    Err(_) => malformed += 1,
                }
            }
            return (matched, malformed);
        };
        let mut ptrs = [ZERO_RECORD.as_ptr(); BATCH_RECORDS];
        let (valid, any_null) =
            schema.envelope_mask(values, fixed.null_probe.unwrap_or((0, 0)), &mut ptrs);
        debug_assert!(values
            .iter()
            .enumerate()
            .all(|(i, v)| (valid >> i & 1 == 1) == schema.open(v).is_ok()));
        let mut malformed = values.len() as u64 - valid.count_ones() as u64;
        let any_null = fixed.null_probe.map(|_| any_null);
        let (selected, odd) = fixed.eval_batch(agg, &ptrs[..values.len()], valid, any_null);
        let mut matched = selected.count_ones() as u64;
        // Records with a non-canonical field: the general path decides what they are.
        let mut rest = odd;
        while rest != 0 {
            let i = rest.trailing_zeros() as usize;
            rest &= rest - 1;
            match self.select_and_aggregate_general(agg, values[i]) {
                Ok(true) => matched += 1,
                Ok(false) => {}
                Err(_) => malformed += 1,
            }
        }
        (matched, malformed)
    }

    /// `matches_and_aggregate` without the key filter, through the general evaluator.
    fn select_and_aggregate_general(
        &self,
        agg: &mut AggState,
        value: &[u8],
    ) -> Result<bool, QueryError> {
        let Some(schema) = &self.schema else {
            agg.update(value)?;
            return Ok(true);
        };
        let view = schema.open(value)?;
        if !self.cnf_holds(&view)? {
            return Ok(false);
        }
        agg.update_view(&view)?;
        Ok(true)
    }

    #[inline]
    fn cnf_holds(&self, view: &RecordView<'_>) -> Result<bool, QueryError> {
        let mut satisfied = 0u64;
        for p in &self.predicates {
            if satisfied & p.bit != 0 {
                continue;
            }
            if p.eval(view)? {
                satisfied |= p.bit;
            } else if p.last_in_clause {
                return Ok(false);
            }
        }
        Ok(satisfied == self.all_clauses)
    }

    /// Appends the value as the scan returns it to `out`: the projected record (a valid record of
    /// [`CompiledQuery::output_schema`]), or the whole value when the query has no projection
    /// (checked against the schema if the table has one). `out` is unchanged on error.
    pub fn project(&self, value: &[u8], out: &mut Vec<u8>) -> Result<(), QueryError> {
        let Some(schema) = &self.schema else {
            out.extend_from_slice(value);
            return Ok(());
        };
        let Some((fields, sub)) = &self.projection else {
            schema.validate(value)?;
            out.extend_from_slice(value);
            return Ok(());
        };
        let view = schema.open(value)?;
        // Pass 1: check every projected field and size the variable area.
        let mut var_len = 0usize;
        for &f in fields {
            match view.get(&schema.slots[f])? {
                FieldRef::Str(s) => var_len += s.len(),
                FieldRef::Bytes(b) => var_len += b.len(),
                _ => {}
            }
        }
        let (code, width) = if sub.var_count == 0 {
            (0, 1)
        } else {
            width_for(var_len)
        };
        // Pass 2: write. Source fields are valid, so copying bytes keeps the record canonical.
        let base = out.len();
        let data_start = sub.fixed_end + sub.var_count * width;
        out.resize(base + data_start, 0);
        out.reserve(var_len);
        let mut end = 0usize;
        for (j, &f) in fields.iter().enumerate() {
            let (from, to) = (&schema.slots[f], &sub.slots[j]);
            let rec = &mut out[base..];
            if view.is_null(from) {
                rec[to.null_byte as usize] |= to.null_mask;
            }
            let pos = to.pos as usize;
            match from.ty.fixed_width() {
                Some(w) => {
                    let src = from.pos as usize;
                    rec[pos..pos + w].copy_from_slice(&view.bytes[src..src + w]);
                }
                None => {
                    // Checked in pass 1, so this does not fail; keep `out` clean if it did.
                    let bytes = match view.var(from.pos as usize) {
                        Ok(b) => b,
                        Err(e) => {
                            out.truncate(base);
                            return Err(e.into());
                        }
                    };
                    end += bytes.len();
                    write_offset(rec, sub.fixed_end + pos * width, width, end);
                    out.extend_from_slice(bytes);
                }
            }
        }
        out[base] = (RECORD_FORMAT_VERSION << 2) | code;
        debug_assert_eq!(out.len(), base + data_start + var_len);
        Ok(())
    }

    /// A fresh aggregate state for this query's aggregates.
    pub fn agg_state(&self) -> AggState {
        AggState {
            acc: self
                .plan
                .aggs
                .iter()
                .map(|(kind, slot, _)| Acc::new(*kind, slot.ty))
                .collect(),
            plan: self.plan.clone(),
            columns: None,
        }
    }
}

/// A fixed-width field's place in a record: where it is, its type, and its null bit. Reading it
/// needs no view of the variable area: the record's envelope (checked by `Schema::open`)
/// guarantees the bytes are there.
#[derive(Clone, Copy, Debug)]
struct FixedField {
    ty: FieldType,
    pos: u32,
    null_byte: u32,
    null_mask: u8,
}

/// One read of a fixed-width field, without branching on its contents.
#[derive(Clone, Copy, Debug)]
struct FixedRead {
    /// The value: i32 sign-extended, i64 and f64 bits, a bool byte (0 or 1).
    raw: u64,
    null: bool,
    /// Not a canonical value (a NULL with nonzero bytes, a bool byte above 1). The general path,
    /// which knows which of these an evaluation must report, then handles the record.
    odd: bool,
}

impl FixedField {
    fn of(slot: &Slot) -> Option<FixedField> {
        slot.ty.fixed_width()?;
        Some(FixedField {
            ty: slot.ty,
            pos: slot.pos,
            null_byte: slot.null_byte,
            null_mask: slot.null_mask,
        })
    }

    #[inline(always)]
    fn read(&self, b: &[u8]) -> FixedRead {
        let pos = self.pos as usize;
        let raw = match self.ty {
            FieldType::I32 => i32::from_le_bytes(read_array(b, pos)) as i64 as u64,
            FieldType::Bool => b[pos] as u64,
            _ => u64::from_le_bytes(read_array(b, pos)),
        };
        let null = b[self.null_byte as usize] & self.null_mask != 0;
        let odd = (null & (raw != 0)) | ((self.ty == FieldType::Bool) & (raw > 1));
        FixedRead { raw, null, odd }
    }
}

#[inline(always)]
fn read_array<const N: usize>(b: &[u8], pos: usize) -> [u8; N] {
    b[pos..pos + N].try_into().unwrap_or([0; N])
}

/// A predicate on a fixed-width field.
#[derive(Clone, Copy, Debug)]
struct FixedPred {
    field: FixedField,
    test: FixedTest,
    bit: u64,
    last_in_clause: bool,
}

#[derive(Clone, Copy, Debug)]
enum FixedTest {
    IsNull,
    /// i32, i64 or bool (0/1) against an i64 constant.
    Int(Op, i64),
    F64(Op, f64),
}

/// The predicates and aggregates of a query whose every field is fixed-width, evaluated straight
/// from the record's bytes without data-dependent branches: every predicate is evaluated (no
/// short-circuit), and a record feeds the accumulators through masks. A record with a
/// non-canonical field goes to the general path instead, so results and errors are the same
/// (the property tests compare the two).
#[derive(Clone, Debug)]
struct FixedPlan {
    preds: Vec<FixedPred>,
    /// Column (index into `columns`) of each predicate, in order.
    pred_columns: Vec<usize>,
    /// One per aggregate, in order: whether it is a Max, and its column (None for Count).
    aggs: Vec<(bool, Option<usize>)>,
    /// The distinct fields the query reads; a batch reads each once.
    columns: Vec<FixedField>,
    all_clauses: u64,
    /// The one bitmap byte holding the NULL bits of every column, with their mask, when there is
    /// one (always for schemas of up to eight fields): the envelope check reads it on the way.
    null_probe: Option<(usize, u8)>,
}

/// The byte of the null bitmap holding the NULL bits of all these columns, and their mask, if
/// one byte holds them all.
fn null_probe(columns: &[FixedField]) -> Option<(usize, u8)> {
    let byte = columns.first()?.null_byte;
    columns.iter().all(|c| c.null_byte == byte).then(|| {
        (
            byte as usize,
            columns.iter().fold(0, |m, c| m | c.null_mask),
        )
    })
}

/// Distinct fields a fixed plan reads at most (more go to the general path).
const FIXED_COLUMNS_MAX: usize = 8;

impl FixedPlan {
    fn new(
        predicates: &[CompiledPredicate],
        aggs: &[(AggKind, Slot, usize)],
        all_clauses: u64,
    ) -> Option<FixedPlan> {
        let mut columns: Vec<FixedField> = Vec::new();
        let mut column_of = |f: FixedField| -> usize {
            match columns.iter().position(|c| c.pos == f.pos && c.ty == f.ty) {
                Some(i) => i,
                None => {
                    columns.push(f);
                    columns.len() - 1
                }
            }
        };
        let mut preds = Vec::with_capacity(predicates.len());
        for p in predicates {
            let test = match &p.test {
                Test::IsNull => FixedTest::IsNull,
                Test::Int(op, c) => FixedTest::Int(*op, *c),
                Test::F64(op, c) => FixedTest::F64(*op, *c),
                Test::Bool(op, c) => FixedTest::Int(*op, *c as i64),
                Test::Bytes(..) | Test::Prefix(_) => return None,
            };
            preds.push(FixedPred {
                field: FixedField::of(&p.slot)?,
                test,
                bit: p.bit,
                last_in_clause: p.last_in_clause,
            });
        }
        let pred_columns: Vec<usize> = preds.iter().map(|p| column_of(p.field)).collect();
        let mut fields = Vec::with_capacity(aggs.len());
        for (kind, slot, _) in aggs {
            fields.push(match kind {
                AggKind::Count => (false, None),
                _ => (
                    *kind == AggKind::Max,
                    Some(column_of(FixedField::of(slot)?)),
                ),
            });
        }
        if columns.len() > FIXED_COLUMNS_MAX {
            return None;
        }
        Some(FixedPlan {
            preds,
            pred_columns,
            aggs: fields,
            null_probe: null_probe(&columns),
            columns,
            all_clauses,
        })
    }

    /// Whether the record is selected; None if a predicate's field is not canonical.
    #[inline(always)]
    fn select(&self, b: &[u8]) -> Option<bool> {
        let mut satisfied = 0u64;
        let mut odd = false;
        for p in &self.preds {
            let r = p.field.read(b);
            odd |= r.odd;
            satisfied |= p.bit & (p.test.holds(r) as u64).wrapping_neg();
        }
        (!odd).then_some(satisfied == self.all_clauses)
    }

    /// Evaluates a batch: reads each column once for the records in `valid` (envelope checked),
    /// selects by the CNF, and adds the selected records to the accumulators. Returns (selected,
    /// odd): records with a non-canonical field are neither selected nor added, and are left to
    /// the general path. `any_null` is the OR of the records' `null_probe` bytes, if probed.
    #[inline(always)]
    fn eval_batch(
        &self,
        agg: &mut AggState,
        ptrs: &[*const u8],
        valid: u64,
        any_null: Option<u8>,
    ) -> (u64, u64) {
        let mut cols = agg.columns.take().unwrap_or_default();
        cols.read_all(&self.columns, ptrs, valid, any_null);
        let map: [usize; FIXED_COLUMNS_MAX] = std::array::from_fn(|i| i);
        let out = self.eval_columns(agg, &cols, &map, ptrs.len(), valid);
        agg.columns = Some(cols);
        out
    }

    /// `eval_batch` on columns already read: column `c` of this plan is `cols` column `map[c]`.
    #[inline(always)]
    fn eval_columns(
        &self,
        agg: &mut AggState,
        cols: &Columns,
        map: &[usize],
        n: usize,
        valid: u64,
    ) -> (u64, u64) {
        let odd = (0..self.columns.len()).fold(0, |m, c| m | cols.odd[map[c]]);
        let raws = |c: usize| &cols.raws[map[c]][..n];
        let nulls = |c: usize| cols.nulls[map[c]];
        // A clause without predicates (an empty OR) is false: nothing is selected.
        let covered = self.preds.iter().fold(0, |m, p| m | p.bit);
        let mut selected = if covered == self.all_clauses {
            valid & !odd
        } else {
            0
        };
        let mut clause = 0u64;
        for (p, &c) in self.preds.iter().zip(&self.pred_columns) {
            clause |= p.test.column(raws(c), nulls(c));
            if p.last_in_clause {
                selected &= clause;
                clause = 0;
            }
        }
        for ((max, col), acc) in self.aggs.iter().zip(&mut agg.acc) {
            let Some(c) = *col else {
                if let Acc::Count(k) = acc {
                    *k += selected.count_ones() as u64;
                }
                continue;
            };
            let take = selected & !nulls(c);
            if take == 0 {
                continue;
            }
            let raws = raws(c);
            let bit = |i: usize| take >> i & 1 == 1;
            match acc {
                Acc::SumInt(s, seen) => {
                    let sum = if self.columns[c].ty == FieldType::I64 {
                        let (mut sum, mut rest) = (0i128, take);
                        while rest != 0 {
                            sum += raws[rest.trailing_zeros() as usize] as i64 as i128;
                            rest &= rest - 1;
                        }
                        sum
                    } else {
                        // At most 64 values of 32 bits: their sum fits in an i64.
                        let (mut sum, mut rest) = (0i64, take);
                        while rest != 0 {
                            sum += raws[rest.trailing_zeros() as usize] as i64;
                            rest &= rest - 1;
                        }
                        sum as i128
                    };
                    *s = s.saturating_add(sum);
                    *seen = true;
                }
                Acc::SumF64(s, seen) => {
                    // In record order, so the rounding is that of one record at a time (adding
                    // +0.0 for the others changes nothing: the sum starts at +0.0).
                    for (i, &r) in raws.iter().enumerate() {
                        *s += if bit(i) { f64::from_bits(r) } else { 0.0 };
                    }
                    *seen = true;
                }
                Acc::Int(m) => {
                    let mut rest = take;
                    let mut cur = m.unwrap_or(raws[rest.trailing_zeros() as usize] as i64);
                    while rest != 0 {
                        let v = raws[rest.trailing_zeros() as usize] as i64;
                        rest &= rest - 1;
                        cur = if *max { cur.max(v) } else { cur.min(v) };
                    }
                    *m = Some(cur);
                }
                Acc::F64(m) => {
                    // NaN never wins: comparisons with it are false.
                    let mut cur = m.unwrap_or(f64::NAN);
                    let mut rest = take;
                    if *max {
                        while rest != 0 {
                            let v = f64::from_bits(raws[rest.trailing_zeros() as usize]);
                            rest &= rest - 1;
                            if v > cur || cur.is_nan() {
                                cur = v;
                            }
                        }
                    } else {
                        while rest != 0 {
                            let v = f64::from_bits(raws[rest.trailing_zeros() as usize]);
                            rest &= rest - 1;
                            if v < cur || cur.is_nan() {
                                cur = v;
                            }
                        }
                    }
                    if !cur.is_nan() {
                        *m = Some(cur);
                    }
                }
                Acc::Bool(m) => {
                    for (i, &r) in raws.iter().enumerate() {
                        let v = r != 0;
                        if bit(i) && m.is_none_or(|cur| ordering_wins(*max, v.cmp(&cur))) {
                            *m = Some(v);
                        }
                    }
                }
                // Compilation gives fixed-width fields no byte accumulator; Count is above.
                Acc::Bytes(_) | Acc::Count(_) => {}
            }
        }
        (selected, odd & valid)
    }
}

/// Fixed-width columns read from one batch of records.
#[derive(Clone)]
struct Columns {
    raws: [[u64; BATCH_RECORDS]; FIXED_COLUMNS_MAX],
    nulls: [u64; FIXED_COLUMNS_MAX],
    odd: [u64; FIXED_COLUMNS_MAX],
    len: usize,
}

impl Default for Columns {
    fn default() -> Columns {
        Columns {
            raws: [[0; BATCH_RECORDS]; FIXED_COLUMNS_MAX],
            nulls: [0; FIXED_COLUMNS_MAX],
            odd: [0; FIXED_COLUMNS_MAX],
            len: 0,
        }
    }
}

impl Columns {
    /// Reads the columns `fields` (fields of the schema) of the records `ptrs` points at (from
    /// [`Schema::envelope_mask`]: records in `valid`, which passed that schema's envelope check,
    /// and [`ZERO_RECORD`] for the others). Records outside `valid` get no NULL or non-canonical
    /// bit: evaluation never selects them. `any_null`, when given, is the OR over the batch of
    /// the bytes holding these fields' NULL bits, masked to those bits (zero: no field read is
    /// NULL anywhere in the batch).
    #[inline(always)]
    fn read_all(
        &mut self,
        fields: &[FixedField],
        ptrs: &[*const u8],
        valid: u64,
        any_null: Option<u8>,
    ) {
        let n = ptrs.len().min(BATCH_RECORDS);
        self.len = fields.len();
        if valid == 0 {
            return;
        }
        // Whether any record has one of these fields NULL: most batches have none, and their
        // columns are read without the per-record NULL bits.
        let any_null = any_null.unwrap_or_else(|| Self::any_null(fields, &ptrs[..n]));
        for (c, f) in fields.iter().enumerate() {
            let (nulls, odd) = if any_null == 0 {
                f.read_column::<false>(&ptrs[..n], &mut self.raws[c])
            } else {
                f.read_column::<true>(&ptrs[..n], &mut self.raws[c])
            };
            self.nulls[c] = nulls & valid;
            self.odd[c] = odd & valid;
        }
    }

    /// The OR over the records of the bitmap bytes holding these fields' NULL bits, masked to
    /// those bits.
    #[inline(always)]
    fn any_null(fields: &[FixedField], ptrs: &[*const u8]) -> u8 {
        let mut bitmap: [(usize, u8); FIXED_COLUMNS_MAX] = [(0, 0); FIXED_COLUMNS_MAX];
        let mut bytes = 0;
        for f in fields {
            let at = bitmap[..bytes]
                .iter()
                .position(|&(b, _)| b == f.null_byte as usize)
                .unwrap_or_else(|| {
                    bytes += 1;
                    bitmap[bytes - 1].0 = f.null_byte as usize;
                    bytes - 1
                });
            bitmap[at].1 |= f.null_mask;
        }
        let mut any_null = 0u8;
        for &p in ptrs {
            for &(b, m) in &bitmap[..bytes] {
                // SAFETY: as in `FixedField::read_column`: the bitmap lies in the fixed area.
                any_null |= unsafe { *p.add(b) } & m;
            }
        }
        any_null
    }
}

/// Several batching queries over one schema, evaluated together over the same batches: each
/// record's envelope is checked once and each field the queries read is read once, then every
/// query selects and aggregates from those columns. Shared scan passes use this.
#[derive(Debug)]
pub struct BatchGroup {
    schema: Schema,
    /// The distinct fields of all the queries.
    columns: Vec<FixedField>,
    /// Per query, per column of its plan: the index in `columns`.
    maps: Vec<Vec<usize>>,
    /// As [`FixedPlan`]'s, for `columns`.
    null_probe: Option<(usize, u8)>,
}

/// One query's part of a [`BatchGroup`] batch.
pub struct GroupMember<'a> {
    pub query: &'a CompiledQuery,
    pub agg: &'a mut AggState,
    /// The records of the batch this query sees (visible at its snapshot, key filter passed).
    pub mask: u64,
    pub matched: u64,
    pub malformed: u64,
}

impl BatchGroup {
    /// A group for these queries, if they all batch, share one schema, and read few enough
    /// distinct fields.
    pub fn new(queries: &[&CompiledQuery]) -> Option<BatchGroup> {
        let schema = queries.first()?.schema.clone()?;
        let mut columns: Vec<FixedField> = Vec::new();
        let mut maps = Vec::with_capacity(queries.len());
        for q in queries {
            if !q.batches() || q.schema.as_ref() != Some(&schema) {
                return None;
            }
            let fixed = q.fixed.as_ref()?;
            let mut map = Vec::with_capacity(fixed.columns.len());
            for f in &fixed.columns {
                let at = match columns.iter().position(|c| c.pos == f.pos && c.ty == f.ty) {
                    Some(i) => i,
                    None => {
                        columns.push(*f);
                        columns.len() - 1
                    }
                };
                map.push(at);
            }
            maps.push(map);
        }
        (columns.len() <= FIXED_COLUMNS_MAX).then(|| BatchGroup {
            schema,
            null_probe: null_probe(&columns),
            columns,
            maps,
        })
    }

    /// Evaluates one batch (at most [`BATCH_RECORDS`] values) for every member, in the order
    /// the group was made with. Each member's counts and accumulators end as if
    /// `aggregate_batch` had run on its masked records alone.
    pub fn aggregate(&self, members: &mut [GroupMember<'_>], values: &[&[u8]]) {
        #[cfg(target_arch = "x86_64")]
        if has_batch_features() {
            // SAFETY: the CPU has the features `aggregate_avx2` is compiled for.
            return unsafe { self.aggregate_avx2(members, values) };
        }
        self.aggregate_impl(members, values)
    }

    /// [`BatchGroup::aggregate`] compiled as [`CompiledQuery::aggregate_batch`] is.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,bmi1,popcnt")]
    unsafe fn aggregate_avx2(&self, members: &mut [GroupMember<'_>], values: &[&[u8]]) {
        self.aggregate_impl(members, values)
    }

    #[inline(always)]
    fn aggregate_impl(&self, members: &mut [GroupMember<'_>], values: &[&[u8]]) {
        let n = values.len().min(BATCH_RECORDS);
        let values = &values[..n];
        let wanted = members.iter().fold(0, |m, g| m | g.mask);
        // Every value is a visible or invisible version's bytes, so all may be checked; only
        // the wanted ones count.
        let mut ptrs = [ZERO_RECORD.as_ptr(); BATCH_RECORDS];
        let (valid, any_null) =
            self.schema
                .envelope_mask(values, self.null_probe.unwrap_or((0, 0)), &mut ptrs);
        let valid = valid & wanted;
        debug_assert!(values
            .iter()
            .enumerate()
            .all(|(i, v)| wanted >> i & 1 == 0
                || (valid >> i & 1 == 1) == self.schema.open(v).is_ok()));
        // The first member keeps the column space between batches.
        let mut cols = members
            .first_mut()
            .and_then(|g| g.agg.columns.take())
            .unwrap_or_default();
        cols.read_all(
            &self.columns,
            &ptrs[..n],
            valid,
            self.null_probe.map(|_| any_null),
        );
        for (g, map) in members.iter_mut().zip(&self.maps) {
            let fixed = g
                .query
                .fixed
                .as_ref()
                .expect("a batching query has a fixed plan");
            let mine = valid & g.mask;
            g.malformed += (g.mask & !valid).count_ones() as u64;
            let (selected, odd) = fixed.eval_columns(g.agg, &cols, map, n, mine);
            g.matched += selected.count_ones() as u64;
            let mut rest = odd & mine;
            while rest != 0 {
                let i = rest.trailing_zeros() as usize;
                rest &= rest - 1;
                match g.query.select_and_aggregate_general(g.agg, values[i]) {
                    Ok(true) => g.matched += 1,
                    Ok(false) => {}
                    Err(_) => g.malformed += 1,
                }
            }
        }
        if let Some(g) = members.first_mut() {
            g.agg.columns = Some(cols);
        }
    }
}

/// Whether the CPU has what the batch evaluators' fast builds need (AVX2, BMI1, POPCNT).
#[cfg(target_arch = "x86_64")]
#[inline]
fn has_batch_features() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("bmi1")
        && std::arch::is_x86_feature_detected!("popcnt")
}

/// Records one batch of [`CompiledQuery::aggregate_batch`] takes at most (one bit each in a u64).
pub const BATCH_RECORDS: usize = 64;

/// The longest fixed area a schema can have: header, bitmap and eight bytes per field.
const FIXED_END_MAX: usize = 1 + SCHEMA_FIELDS_MAX.div_ceil(8) + 8 * SCHEMA_FIELDS_MAX;

/// A fixed area of zeros (no NULL, every fixed field zero, so canonical): what the column
/// readers read for a batch slot whose record failed its envelope check.
static ZERO_RECORD: [u8; FIXED_END_MAX] = [0; FIXED_END_MAX];

impl FixedField {
    /// Reads the field of each record of a batch, given by the address of its first byte, into
    /// `raws`. Returns (NULL bits, non-canonical bits). Every record must have passed
    /// `Schema::open` of this field's schema. With `NULLS` false the caller has checked that no
    /// record has the field NULL, and its NULL bit is not read.
    #[inline(always)]
    fn read_column<const NULLS: bool>(
        &self,
        records: &[*const u8],
        raws: &mut [u64; BATCH_RECORDS],
    ) -> (u64, u64) {
        let (mut nulls, mut odd) = (0u64, 0u64);
        let (pos, nb, nm) = (self.pos as usize, self.null_byte as usize, self.null_mask);
        macro_rules! column {
            ($width:expr, |$b:ident| $raw:expr) => {
                for (i, (&p, slot)) in records.iter().zip(raws.iter_mut()).enumerate() {
                    // SAFETY: the record passed its envelope check (or is `ZERO_RECORD`), so it
                    // holds at least the fixed area (`fixed_end` bytes), which contains the null
                    // bitmap and this field.
                    let $b = unsafe { p.add(pos).cast::<[u8; $width]>().read() };
                    let raw = $raw;
                    *slot = raw;
                    if NULLS {
                        // SAFETY: as above.
                        let null = unsafe { *p.add(nb) } & nm != 0;
                        nulls |= (null as u64) << i;
                        odd |= ((null & (raw != 0)) as u64) << i;
                    }
                }
            };
        }
        match self.ty {
            FieldType::I32 => column!(4, |b| i32::from_le_bytes(b) as i64 as u64),
            FieldType::Bool => {
                column!(1, |b| b[0] as u64);
                for (i, &r) in raws[..records.len()].iter().enumerate() {
                    odd |= ((r > 1) as u64) << i;
                }
            }
            _ => column!(8, |b| u64::from_le_bytes(b)),
        }
        (nulls, odd)
    }
}

impl FixedTest {
    /// Whether a canonical read satisfies the test: [`FixedTest::column`] over one record.
    #[inline(always)]
    fn holds(self, r: FixedRead) -> bool {
        self.column(&[r.raw], r.null as u64) & 1 == 1
    }

    /// The test over a column of canonical reads: one bit per record.
    #[inline(always)]
    fn column(self, raws: &[u64], nulls: u64) -> u64 {
        #[inline(always)]
        fn bits(raws: &[u64], f: impl Fn(u64) -> bool) -> u64 {
            // Eight records at a time, with constant shifts.
            let mut m = 0u64;
            let mut chunks = raws.chunks_exact(8);
            for (k, c) in chunks.by_ref().enumerate() {
                let mut byte = 0u64;
                for (j, &r) in c.iter().enumerate() {
                    byte |= (f(r) as u64) << j;
                }
                m |= byte << (8 * k);
            }
            let done = raws.len() - chunks.remainder().len();
            for (i, &r) in chunks.remainder().iter().enumerate() {
                m |= (f(r) as u64) << (done + i);
            }
            m
        }
        let hits = match self {
            FixedTest::IsNull => return nulls,
            FixedTest::Int(op, c) => match op {
                Op::Lt => bits(raws, |r| (r as i64) < c),
                Op::Le => bits(raws, |r| (r as i64) <= c),
                Op::Eq => bits(raws, |r| (r as i64) == c),
                Op::Ne => bits(raws, |r| (r as i64) != c),
                Op::Ge => bits(raws, |r| (r as i64) >= c),
                Op::Gt => bits(raws, |r| (r as i64) > c),
                Op::Prefix | Op::IsNull => 0,
            },
            FixedTest::F64(op, c) => {
                let f = f64::from_bits;
                match op {
                    Op::Lt => bits(raws, |r| f(r) < c),
                    Op::Le => bits(raws, |r| f(r) <= c),
                    Op::Eq => bits(raws, |r| f(r) == c),
                    Op::Ne => bits(raws, |r| (f(r) < c) | (f(r) > c)),
                    Op::Ge => bits(raws, |r| f(r) >= c),
                    Op::Gt => bits(raws, |r| f(r) > c),
                    Op::Prefix | Op::IsNull => 0,
                }
            }
        };
        hits & !nulls
    }
}

fn compile_test(p: &Predicate, ty: FieldType) -> Result<Test, QueryError> {
    let bad = |reason: String| QueryError::BadPredicate {
        field: p.field,
        reason,
    };
    let c = p.constant.as_ref();
    if p.op == Op::IsNull {
        return match c {
            FieldRef::Null => Ok(Test::IsNull),
            other => Err(bad(format!(
                "IsNull takes a NULL constant, got a {}",
                other.type_name()
            ))),
        };
    }
    if let FieldRef::Null = c {
        return Err(bad(format!(
            "{:?} with a NULL constant is never true (use IsNull)",
            p.op
        )));
    }
    let mismatch = || {
        bad(format!(
            "{:?} field compared with a {} constant",
            ty,
            c.type_name()
        ))
    };
    if p.op == Op::Prefix {
        return match (ty, c) {
            (FieldType::String, FieldRef::Str(s)) => Ok(Test::Prefix(s.as_bytes().into())),
            (FieldType::Bytes, FieldRef::Bytes(b)) => Ok(Test::Prefix(b.into())),
            (FieldType::String | FieldType::Bytes, _) => Err(mismatch()),
            _ => Err(bad(format!(
                "Prefix applies to string and bytes fields, not {ty:?}"
            ))),
        };
    }
    match (ty, c) {
        (FieldType::I32 | FieldType::I64, FieldRef::I32(v)) => Ok(Test::Int(p.op, v as i64)),
        (FieldType::I32 | FieldType::I64, FieldRef::I64(v)) => Ok(Test::Int(p.op, v)),
        (FieldType::F64, FieldRef::F64(v)) => Ok(Test::F64(p.op, v)),
        (FieldType::Bool, FieldRef::Bool(v)) => Ok(Test::Bool(p.op, v)),
        (FieldType::String, FieldRef::Str(s)) => Ok(Test::Bytes(p.op, s.as_bytes().into())),
        (FieldType::Bytes, FieldRef::Bytes(b)) => Ok(Test::Bytes(p.op, b.into())),
        _ => Err(mismatch()),
    }
}

/// One aggregate's accumulator.
#[derive(Clone, Debug, PartialEq)]
enum Acc {
    Count(u64),
    /// Exact integer sum and whether any non-NULL value was seen.
    SumInt(i128, bool),
    SumF64(f64, bool),
    /// Min/Max of i32/i64 (widened), f64 (NaN skipped), bool, string/bytes.
    Int(Option<i64>),
    F64(Option<f64>),
    Bool(Option<bool>),
    Bytes(Option<Vec<u8>>),
}

impl Acc {
    fn new(kind: AggKind, ty: FieldType) -> Acc {
        match (kind, ty) {
            (AggKind::Count, _) => Acc::Count(0),
            (AggKind::Sum, FieldType::F64) => Acc::SumF64(0.0, false),
            (AggKind::Sum, _) => Acc::SumInt(0, false),
            (_, FieldType::I32 | FieldType::I64) => Acc::Int(None),
            (_, FieldType::F64) => Acc::F64(None),
            (_, FieldType::Bool) => Acc::Bool(None),
            (_, FieldType::String | FieldType::Bytes) => Acc::Bytes(None),
        }
    }

    /// Folds a non-NULL field value in (`max` picks the direction for Min/Max).
    fn add(&mut self, max: bool, f: FieldRef<'_>) {
        let better = |o: std::cmp::Ordering| ordering_wins(max, o);
        match (self, f) {
            (Acc::SumInt(s, seen), FieldRef::I32(v)) => {
                *s = s.saturating_add(v as i128);
                *seen = true;
            }
            (Acc::SumInt(s, seen), FieldRef::I64(v)) => {
                *s = s.saturating_add(v as i128);
                *seen = true;
            }
            (Acc::SumF64(s, seen), FieldRef::F64(v)) => {
                *s += v;
                *seen = true;
            }
            (Acc::Int(m), FieldRef::I32(v)) => merge_opt(m, v as i64, |a, b| better(a.cmp(b))),
            (Acc::Int(m), FieldRef::I64(v)) => merge_opt(m, v, |a, b| better(a.cmp(b))),
            (Acc::F64(m), FieldRef::F64(v)) if !v.is_nan() => {
                merge_opt(m, v, |a, b| a.partial_cmp(b).is_some_and(better))
            }
            (Acc::Bool(m), FieldRef::Bool(v)) => merge_opt(m, v, |a, b| better(a.cmp(b))),
            (Acc::Bytes(m), FieldRef::Str(v)) => merge_bytes(m, v.as_bytes(), better),
            (Acc::Bytes(m), FieldRef::Bytes(v)) => merge_bytes(m, v, better),
            _ => {}
        }
    }

    fn merge(&mut self, max: bool, other: &Acc) {
        match (&mut *self, other) {
            (Acc::Count(a), Acc::Count(b)) => *a = a.saturating_add(*b),
            (Acc::SumInt(a, sa), Acc::SumInt(b, sb)) => {
                *a = a.saturating_add(*b);
                *sa |= *sb;
            }
            (Acc::SumF64(a, sa), Acc::SumF64(b, sb)) => {
                if *sb {
                    *a += *b;
                }
                *sa |= *sb;
            }
            (Acc::Int(m), Acc::Int(Some(v))) => {
                merge_opt(m, *v, |a, b| ordering_wins(max, a.cmp(b)))
            }
            (Acc::F64(m), Acc::F64(Some(v))) => merge_opt(m, *v, |a, b| {
                a.partial_cmp(b).is_some_and(|o| ordering_wins(max, o))
            }),
            (Acc::Bool(m), Acc::Bool(Some(v))) => {
                merge_opt(m, *v, |a, b| ordering_wins(max, a.cmp(b)))
            }
            (Acc::Bytes(m), Acc::Bytes(Some(v))) => merge_bytes(m, v, |o| ordering_wins(max, o)),
            _ => {}
        }
    }
}

/// Whether a candidate that compares `o` to the current Min (`max` false) or Max wins.
fn ordering_wins(max: bool, o: std::cmp::Ordering) -> bool {
    if max {
        o == std::cmp::Ordering::Greater
    } else {
        o == std::cmp::Ordering::Less
    }
}

fn merge_opt<T: Copy>(m: &mut Option<T>, v: T, better: impl Fn(&T, &T) -> bool) {
    match m {
        Some(cur) if !better(&v, cur) => {}
        _ => *m = Some(v),
    }
}

fn merge_bytes(m: &mut Option<Vec<u8>>, v: &[u8], better: impl Fn(std::cmp::Ordering) -> bool) {
    match m {
        Some(cur) if !better(v.cmp(cur)) => {}
        Some(cur) => {
            cur.clear();
            cur.extend_from_slice(v);
        }
        None => *m = Some(v.to_vec()),
    }
}

/// Running aggregates of one scan (or one tablet's part of it); from
/// [`CompiledQuery::agg_state`]. Feed it the values that [`CompiledQuery::matches`] selected.
#[derive(Clone)]
pub struct AggState {
    plan: Arc<AggPlan>,
    acc: Vec<Acc>,
    /// Column space of batch evaluation, kept between batches (not part of the result).
    columns: Option<Box<Columns>>,
}

impl fmt::Debug for AggState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AggState").field("acc", &self.acc).finish()
    }
}

impl AggState {
    /// Folds one selected record in. All or nothing: a record that does not decode changes
    /// nothing and returns Err.
    pub fn update(&mut self, value: &[u8]) -> Result<(), QueryError> {
        let Some(schema) = &self.plan.schema else {
            // Count only (compilation refuses field aggregates without a schema).
            for acc in &mut self.acc {
                if let Acc::Count(n) = acc {
                    *n += 1;
                }
            }
            return Ok(());
        };
        let view = schema.open(value)?;
        self.update_view(&view)
    }

    /// `update` on a record already opened.
    #[inline]
    fn update_view(&mut self, view: &RecordView<'_>) -> Result<(), QueryError> {
        for (kind, slot, _) in &self.plan.aggs {
            if *kind != AggKind::Count {
                view.get(slot)?;
            }
        }
        for ((kind, slot, _), acc) in self.plan.aggs.iter().zip(&mut self.acc) {
            match kind {
                AggKind::Count => {
                    if let Acc::Count(n) = acc {
                        *n += 1;
                    }
                }
                _ => {
                    let f = view.get(slot)?;
                    if !matches!(f, FieldRef::Null) {
                        acc.add(*kind == AggKind::Max, f);
                    }
                }
            }
        }
        Ok(())
    }

    /// Adds another state of the same query (another tablet's part of the scan). States of
    /// different queries are not mixed: mismatched accumulators are left alone.
    pub fn merge(&mut self, other: &AggState) {
        debug_assert_eq!(self.plan.aggs.len(), other.plan.aggs.len());
        for (((kind, _, _), acc), theirs) in
            self.plan.aggs.iter().zip(&mut self.acc).zip(&other.acc)
        {
            acc.merge(*kind == AggKind::Max, theirs);
        }
    }

    /// The results, one per aggregate: Count → I64; Sum → I64 (saturated if the exact sum is
    /// outside i64; see [`AggState::try_finish`]) or F64, NULL if no value was seen; Min/Max →
    /// the field's type, NULL if no value was seen.
    pub fn finish(&self) -> Vec<Value> {
        self.results(false).unwrap_or_default()
    }

    /// [`AggState::finish`], but an integer sum outside i64 is an error.
    pub fn try_finish(&self) -> Result<Vec<Value>, QueryError> {
        self.results(true)
    }

    fn results(&self, strict: bool) -> Result<Vec<Value>, QueryError> {
        self.plan
            .aggs
            .iter()
            .zip(&self.acc)
            .map(|((_, slot, field), acc)| {
                Ok(match acc {
                    Acc::Count(n) => Value::I64((*n).min(i64::MAX as u64) as i64),
                    Acc::SumInt(_, false) | Acc::SumF64(_, false) => Value::Null,
                    Acc::SumInt(s, true) => match i64::try_from(*s) {
                        Ok(v) => Value::I64(v),
                        Err(_) if strict => return Err(QueryError::SumOverflow { field: *field }),
                        Err(_) => Value::I64(if *s < 0 { i64::MIN } else { i64::MAX }),
                    },
                    Acc::SumF64(s, true) => Value::F64(*s),
                    Acc::Int(None) | Acc::F64(None) | Acc::Bool(None) | Acc::Bytes(None) => {
                        Value::Null
                    }
                    Acc::Int(Some(v)) => match slot.ty {
                        // The value came from an i32 field, so it fits.
                        FieldType::I32 => Value::I32(i32::try_from(*v).unwrap_or_default()),
                        _ => Value::I64(*v),
                    },
                    Acc::F64(Some(v)) => Value::F64(*v),
                    Acc::Bool(Some(v)) => Value::Bool(*v),
                    Acc::Bytes(Some(v)) => match slot.ty {
                        // The bytes came from a checked string field, so they are UTF-8.
                        FieldType::String => Value::Str(String::from_utf8_lossy(v).into_owned()),
                        _ => Value::Bytes(v.clone()),
                    },
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_filters() {
        assert!(KeyFilter::All.matches(b""));
        assert!(KeyFilter::Prefix(b"ab".to_vec()).matches(b"abc"));
        assert!(!KeyFilter::Prefix(b"ab".to_vec()).matches(b"a"));
        assert!(KeyFilter::Glob(b"a*".to_vec()).matches(b"abc"));
        let r = KeyFilter::Range {
            start: Bound::Included(b"b".to_vec()),
            end: Bound::Excluded(b"d".to_vec()),
        };
        assert!(!r.matches(b"a"));
        assert!(r.matches(b"b"));
        assert!(r.matches(b"c\xff"));
        assert!(!r.matches(b"d"));
        let r = KeyFilter::Range {
            start: Bound::Excluded(b"b".to_vec()),
            end: Bound::Included(b"d".to_vec()),
        };
        assert!(!r.matches(b"b"));
        assert!(r.matches(b"b\x00"));
        assert!(r.matches(b"d"));
        assert!(!r.matches(b"d\x00"));
    }

    fn people() -> Schema {
        Schema::new(vec![
            Field::new("id", FieldType::I64),
            Field::new("age", FieldType::I32),
            Field::new("score", FieldType::F64),
            Field::new("active", FieldType::Bool),
            Field::new("name", FieldType::String),
            Field::new("blob", FieldType::Bytes),
        ])
        .unwrap()
    }

    #[test]
    fn record_layout_is_as_documented() {
        let s = Schema::new(vec![
            Field::new("a", FieldType::I32),
            Field::new("s", FieldType::String),
            Field::new("b", FieldType::Bool),
            Field::new("t", FieldType::Bytes),
        ])
        .unwrap();
        let rec = s
            .encode(&[
                Value::I32(-2),
                Value::Str("hi".into()),
                Value::Null,
                Value::Bytes(vec![7]),
            ])
            .unwrap();
        assert_eq!(
            rec,
            vec![
                0x04,   // version 1, 1-byte offsets
                0b0100, // field 2 is NULL
                0xfe, 0xff, 0xff, 0xff, // a = -2
                0x00, // b (NULL)
                2, 3, // end offsets of s and t
                b'h', b'i', 7,
            ]
        );
        assert_eq!(s.field(&rec, 1).unwrap(), FieldRef::Str("hi"));
        assert_eq!(s.field(&rec, 2).unwrap(), FieldRef::Null);
        assert_eq!(s.field(&rec, 3).unwrap(), FieldRef::Bytes(&[7]));
        assert!(matches!(
            s.field(&rec, 4),
            Err(SchemaError::NoSuchField { index: 4, count: 4 })
        ));
        // Overhead of a 100-byte record: header, bitmap, one offset.
        let row = vec![
            Value::I64(1),
            Value::I32(2),
            Value::F64(3.0),
            Value::Bool(true),
            Value::Str("x".repeat(79)),
            Value::Null,
        ];
        let rec = people().encode(&row).unwrap();
        assert_eq!(rec.len(), 8 + 4 + 8 + 1 + 79 + 1 + 1 + 2);
    }

    #[test]
    fn wide_offsets_round_trip() {
        let s = people();
        for len in [0, 255, 256, 65535, 65536, 70000] {
            let row = vec![
                Value::Null,
                Value::I32(i32::MIN),
                Value::F64(f64::NAN),
                Value::Bool(false),
                Value::Str("é".repeat(len / 2)),
                Value::Bytes(vec![1; len - len / 2 * 2 + 3]),
            ];
            let rec = s.encode(&row).unwrap();
            assert_eq!(s.decode(&rec).unwrap(), row);
            s.validate(&rec).unwrap();
            // Truncation and trailing bytes are errors.
            assert!(s.decode(&rec[..rec.len() - 1]).is_err());
            let mut longer = rec.clone();
            longer.push(0);
            assert!(s.decode(&longer).is_err());
        }
    }

    #[test]
    fn malformed_records_are_errors() {
        let s = people();
        let row = vec![
            Value::I64(5),
            Value::Null,
            Value::F64(1.5),
            Value::Bool(true),
            Value::Str("ab".into()),
            Value::Bytes(vec![]),
        ];
        let rec = s.encode(&row).unwrap();
        let bad = |f: &dyn Fn(&mut Vec<u8>)| {
            let mut r = rec.clone();
            f(&mut r);
            assert!(s.decode(&r).is_err(), "{r:?} decoded");
            assert!(s.validate(&r).is_err());
        };
        bad(&|r| r.clear());
        bad(&|r| r[0] = 0x08); // version 2
        bad(&|r| r[0] = 0x07); // width code 3
        bad(&|r| r[0] = 0x05); // non-minimal 2-byte offsets
        bad(&|r| r[1] |= 0x80); // null bit past the last field
        bad(&|r| r[1 + 1 + 8 + 4 + 8] = 2); // bool byte 2
        bad(&|r| {
            let n = r.len();
            r[n - 1] = 0xff; // invalid UTF-8 in name
        });
        bad(&|r| r.truncate(r.len() - 1));
        bad(&|r| r.push(b'x'));
        bad(&|r| {
            r[1] |= 0x10; // name NULL but 2 bytes long
        });
        bad(&|r| {
            r[1] |= 0x01; // id NULL but nonzero bytes
        });
        // Offsets out of order: name ends at 3 > blob's end 2... swap them.
        bad(&|r| {
            let t = 1 + 1 + 8 + 4 + 8 + 1;
            r[t] = 3;
        });
        assert!(matches!(
            s.field(&rec[..3], 0),
            Err(SchemaError::MalformedRecord(_))
        ));
        // A record that would be valid with 2-byte offsets, but 1-byte offsets are enough.
        let one = Schema::new(vec![Field::new("s", FieldType::String)]).unwrap();
        assert_eq!(
            one.encode(&[Value::Str("ab".into())]).unwrap(),
            vec![0x04, 0, 2, b'a', b'b']
        );
        assert_eq!(
            one.decode(&[0x05, 0, 2, 0, b'a', b'b']),
            Err(SchemaError::MalformedRecord(
                "offset width is not the smallest"
            ))
        );
        assert!(
            one.field(&[0x04, 0, 3, b'a', b'b'], 0).is_err(),
            "last offset past the end"
        );
        assert!(
            one.field(&[0x04, 0, 1, b'a', b'b'], 0).is_err(),
            "trailing byte"
        );
    }

    #[test]
    fn encode_checks_types_and_arity() {
        let s = people();
        assert!(matches!(
            s.encode(&[]),
            Err(SchemaError::Arity {
                expected: 6,
                got: 0
            })
        ));
        let mut row = vec![Value::Null; 6];
        row[1] = Value::I64(1);
        assert!(matches!(
            s.encode(&row),
            Err(SchemaError::TypeMismatch {
                index: 1,
                expected: FieldType::I32,
                ..
            })
        ));
        let all_null = s.encode(&vec![Value::Null; 6]).unwrap();
        assert_eq!(s.decode(&all_null).unwrap(), vec![Value::Null; 6]);
    }

    #[test]
    fn schema_validation_and_bytes() {
        assert!(matches!(
            Schema::new(vec![
                Field::new("a", FieldType::I32),
                Field::new("a", FieldType::Bool)
            ]),
            Err(SchemaError::DuplicateName(_))
        ));
        assert!(matches!(
            Schema::new(vec![Field::new("", FieldType::I32)]),
            Err(SchemaError::BadNameLength(0))
        ));
        let many: Vec<Field> = (0..256)
            .map(|i| Field::new(format!("f{i}"), FieldType::Bool))
            .collect();
        assert!(matches!(
            Schema::new(many.clone()),
            Err(SchemaError::TooManyFields(256))
        ));
        let s = Schema::new(many[..255].to_vec()).unwrap();
        assert_eq!(Schema::from_bytes(&s.to_bytes()).unwrap(), s);
        let p = people();
        let bytes = p.to_bytes();
        assert_eq!(&bytes[..5], &[1, 6, 2, 2, b'i']);
        assert_eq!(Schema::from_bytes(&bytes).unwrap(), p);
        assert!(Schema::from_bytes(&bytes[..bytes.len() - 1]).is_err());
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(Schema::from_bytes(&longer).is_err());
        let mut bad_type = bytes.clone();
        bad_type[2] = 7;
        assert!(Schema::from_bytes(&bad_type).is_err());
        let empty = Schema::new(vec![]).unwrap();
        assert_eq!(empty.encode(&[]).unwrap(), vec![0x04]);
        assert_eq!(empty.decode(&[0x04]).unwrap(), vec![]);
        assert!(empty.decode(&[0x04, 0]).is_err());
        assert_eq!(p.project(&[4, 0]).unwrap().fields()[0].name, "name");
    }

    fn q(clauses: Vec<Vec<Predicate>>) -> Query {
        Query {
            predicate: Cnf { clauses },
            ..Query::default()
        }
    }

    #[test]
    fn null_semantics() {
        let s = people();
        let rec = s.encode(&vec![Value::Null; 6]).unwrap();
        let ops = [Op::Lt, Op::Le, Op::Eq, Op::Ne, Op::Ge, Op::Gt];
        let constants = [
            Value::I64(0),
            Value::I32(0),
            Value::F64(0.0),
            Value::Bool(false),
            Value::Str(String::new()),
            Value::Bytes(vec![]),
        ];
        for (field, c) in constants.iter().enumerate() {
            for op in ops {
                let cq = CompiledQuery::new(
                    q(vec![vec![Predicate::new(field, op, c.clone())]]),
                    Some(&s),
                )
                .unwrap();
                assert!(
                    !cq.matches(b"k", &rec).unwrap(),
                    "NULL {op:?} {c:?} must be false"
                );
            }
            let cq = CompiledQuery::new(
                q(vec![vec![Predicate::new(field, Op::IsNull, Value::Null)]]),
                Some(&s),
            )
            .unwrap();
            assert!(cq.matches(b"k", &rec).unwrap());
        }
        for field in [4, 5] {
            let c = if field == 4 {
                Value::Str(String::new())
            } else {
                Value::Bytes(vec![])
            };
            let cq = CompiledQuery::new(
                q(vec![vec![Predicate::new(field, Op::Prefix, c)]]),
                Some(&s),
            )
            .unwrap();
            assert!(!cq.matches(b"k", &rec).unwrap(), "NULL has no prefix");
        }
        // A NULL constant outside IsNull, and IsNull with a non-NULL constant, are refused.
        assert!(CompiledQuery::new(
            q(vec![vec![Predicate::new(0, Op::Eq, Value::Null)]]),
            Some(&s)
        )
        .is_err());
        assert!(CompiledQuery::new(
            q(vec![vec![Predicate::new(0, Op::IsNull, Value::I64(1))]]),
            Some(&s)
        )
        .is_err());
        // Aggregates ignore NULLs; Count counts the record.
        let cq = CompiledQuery::new(
            Query {
                aggregates: vec![
                    Aggregate::Count,
                    Aggregate::Sum(0),
                    Aggregate::Min(4),
                    Aggregate::Max(2),
                ],
                ..Query::default()
            },
            Some(&s),
        )
        .unwrap();
        let mut agg = cq.agg_state();
        agg.update(&rec).unwrap();
        assert_eq!(
            agg.finish(),
            vec![Value::I64(1), Value::Null, Value::Null, Value::Null]
        );
    }

    #[test]
    fn comparisons_types_and_nan() {
        let s = people();
        let rec = s
            .encode(&[
                Value::I64(10),
                Value::I32(-3),
                Value::F64(f64::NAN),
                Value::Bool(true),
                Value::Str("hello".into()),
                Value::Bytes(vec![1, 2, 3]),
            ])
            .unwrap();
        let check = |p: Predicate, expect: bool| {
            let cq = CompiledQuery::new(q(vec![vec![p.clone()]]), Some(&s)).unwrap();
            assert_eq!(cq.matches(b"k", &rec).unwrap(), expect, "{p:?}");
        };
        check(Predicate::new(0, Op::Eq, Value::I64(10)), true);
        check(Predicate::new(0, Op::Gt, Value::I32(9)), true); // i32 constant widened
        check(Predicate::new(1, Op::Lt, Value::I64(i64::MAX)), true); // i32 field widened
        check(Predicate::new(1, Op::Ge, Value::I32(-3)), true);
        for op in [Op::Lt, Op::Le, Op::Eq, Op::Ne, Op::Ge, Op::Gt] {
            check(Predicate::new(2, op, Value::F64(1.0)), false); // NaN field compares false
        }
        check(Predicate::new(3, Op::Gt, Value::Bool(false)), true);
        check(
            Predicate::new(4, Op::Prefix, Value::Str("hel".into())),
            true,
        );
        check(
            Predicate::new(4, Op::Prefix, Value::Str("help".into())),
            false,
        );
        check(Predicate::new(4, Op::Lt, Value::Str("hellp".into())), true);
        check(
            Predicate::new(5, Op::Prefix, Value::Bytes(vec![1, 2])),
            true,
        );
        check(
            Predicate::new(5, Op::Ge, Value::Bytes(vec![1, 2, 3, 0])),
            false,
        );
        let refuse = |p: Predicate| {
            assert!(
                matches!(
                    CompiledQuery::new(q(vec![vec![p.clone()]]), Some(&s)),
                    Err(QueryError::BadPredicate { .. })
                ),
                "{p:?}"
            );
        };
        refuse(Predicate::new(0, Op::Eq, Value::F64(1.0)));
        refuse(Predicate::new(2, Op::Eq, Value::I64(1)));
        refuse(Predicate::new(4, Op::Eq, Value::Bytes(vec![])));
        refuse(Predicate::new(5, Op::Prefix, Value::Str(String::new())));
        refuse(Predicate::new(0, Op::Prefix, Value::I64(1)));
        assert!(matches!(
            CompiledQuery::new(
                q(vec![vec![Predicate::new(6, Op::IsNull, Value::Null)]]),
                Some(&s)
            ),
            Err(QueryError::NoSuchField { index: 6, count: 6 })
        ));
        assert!(matches!(
            CompiledQuery::new(
                q(vec![vec![Predicate::new(0, Op::IsNull, Value::Null)]]),
                None
            ),
            Err(QueryError::NoSchema)
        ));
        // Empty CNF matches; an empty clause matches nothing.
        assert!(CompiledQuery::new(q(vec![]), Some(&s))
            .unwrap()
            .matches(b"k", &rec)
            .unwrap());
        assert!(!CompiledQuery::new(q(vec![vec![]]), Some(&s))
            .unwrap()
            .matches(b"k", &rec)
            .unwrap());
        // Key filters need no schema; a malformed value is an error on a schema'd table.
        let keys = CompiledQuery::new(Query::keys(KeyFilter::Prefix(b"k".to_vec())), None).unwrap();
        assert!(keys.matches(b"key", b"not a record").unwrap());
        assert!(!keys.matches(b"other", b"not a record").unwrap());
        let cq = CompiledQuery::new(q(vec![]), Some(&s)).unwrap();
        assert!(cq.matches(b"k", b"not a record").is_err());
    }

    #[test]
    fn sum_overflow_is_reported() {
        let s = Schema::new(vec![Field::new("x", FieldType::I64)]).unwrap();
        let cq = CompiledQuery::new(
            Query {
                aggregates: vec![Aggregate::Sum(0), Aggregate::Min(0), Aggregate::Max(0)],
                ..Query::default()
            },
            Some(&s),
        )
        .unwrap();
        let mut a = cq.agg_state();
        let big = s.encode(&[Value::I64(i64::MAX)]).unwrap();
        a.update(&big).unwrap();
        assert_eq!(a.try_finish().unwrap()[0], Value::I64(i64::MAX));
        a.update(&big).unwrap();
        assert_eq!(a.finish()[0], Value::I64(i64::MAX), "saturates");
        assert_eq!(a.try_finish(), Err(QueryError::SumOverflow { field: 0 }));
        // Back in range: the sum is exact whatever the order.
        let mut b = cq.agg_state();
        b.update(&s.encode(&[Value::I64(i64::MIN)]).unwrap())
            .unwrap();
        b.update(&s.encode(&[Value::I64(i64::MIN)]).unwrap())
            .unwrap();
        a.merge(&b);
        assert_eq!(
            a.try_finish().unwrap(),
            vec![Value::I64(-2), Value::I64(i64::MIN), Value::I64(i64::MAX)]
        );
        // A record that does not decode changes nothing.
        let before = a.finish();
        assert!(a.update(b"junk").is_err());
        assert_eq!(a.finish(), before);
    }

    #[test]
    fn projection_writes_a_record_of_the_sub_schema() {
        let s = people();
        let row = vec![
            Value::I64(7),
            Value::Null,
            Value::F64(-0.0),
            Value::Bool(false),
            Value::Str("name".into()),
            Value::Bytes(vec![9; 300]),
        ];
        let rec = s.encode(&row).unwrap();
        let fields = vec![5, 1, 4, 0];
        let cq = CompiledQuery::new(
            Query {
                projection: Some(fields.clone()),
                ..Query::default()
            },
            Some(&s),
        )
        .unwrap();
        let mut out = vec![0xaa];
        cq.project(&rec, &mut out).unwrap();
        let sub = cq.output_schema().unwrap();
        assert_eq!(sub, &s.project(&fields).unwrap());
        let expect: Vec<Value> = fields.iter().map(|&f| row[f].clone()).collect();
        assert_eq!(sub.decode(&out[1..]).unwrap(), expect);
        assert_eq!(&out[1..], &sub.encode(&expect).unwrap()[..]);
        // Errors leave `out` alone.
        let mut bad = rec.clone();
        let n = bad.len();
        bad[n - 301] = 0xff; // last byte of "name": invalid UTF-8
        let mut out = vec![1, 2];
        assert!(cq.project(&bad, &mut out).is_err());
        assert_eq!(out, vec![1, 2]);
        assert!(matches!(
            CompiledQuery::new(
                Query {
                    projection: Some(vec![1, 1]),
                    ..Query::default()
                },
                Some(&s)
            ),
            Err(QueryError::DuplicateProjection(1))
        ));
    }

    #[test]
    fn query_bytes_round_trip_and_limits() {
        let query = Query {
            key_filter: KeyFilter::Range {
                start: Bound::Excluded(b"a".to_vec()),
                end: Bound::Unbounded,
            },
            predicate: Cnf {
                clauses: vec![
                    vec![
                        Predicate::new(0, Op::Ge, Value::I64(-1)),
                        Predicate::new(4, Op::Prefix, Value::Str("x".into())),
                    ],
                    vec![Predicate::new(2, Op::IsNull, Value::Null)],
                ],
            },
            projection: None,
            aggregates: vec![Aggregate::Count, Aggregate::Max(4)],
        };
        let bytes = query.to_bytes().unwrap();
        assert_eq!(Query::from_bytes(&bytes).unwrap(), query);
        assert!(Query::from_bytes(&bytes[..bytes.len() - 1]).is_err());
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(Query::from_bytes(&longer).is_err());
        let mut too_many = Query::default();
        too_many.predicate.clauses = vec![vec![Predicate::new(0, Op::IsNull, Value::Null)]; 65];
        assert!(matches!(too_many.to_bytes(), Err(QueryError::TooLarge(_))));
        assert!(matches!(
            CompiledQuery::new(too_many, Some(&people())),
            Err(QueryError::TooLarge(_))
        ));
        let mut values = Vec::new();
        encode_values(
            &[Value::I32(1), Value::Str("é".into()), Value::Null],
            &mut values,
        )
        .unwrap();
        assert_eq!(
            decode_values(&values, 16).unwrap(),
            vec![Value::I32(1), Value::Str("é".into()), Value::Null]
        );
        assert!(decode_values(&values, 1).is_err());
    }
}
