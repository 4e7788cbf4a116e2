//! Table schemas, field values and the record encoding of a row.
//!
//! A [`Schema`] precomputes where each field lives in a record (its slot), so that a predicate
//! reads one field in O(1) after an O(1) check of the record's envelope ([`RecordView`]). The
//! layouts are in docs/formats.md, "Schema records"; every decoder here checks all it reads.

use crate::reader::Reader;
use thiserror::Error;

/// Most fields a schema may have (field indexes fit in one byte on the wire).
pub const SCHEMA_FIELDS_MAX: usize = 255;
/// Longest field name, in bytes.
pub const FIELD_NAME_BYTES_MAX: usize = 255;
/// Version in the high six bits of a record's first byte.
pub const RECORD_FORMAT_VERSION: u8 = 1;
/// First byte of a schema's encoding.
pub const SCHEMA_FORMAT_VERSION: u8 = 1;

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

    pub(crate) fn type_name(&self) -> &'static str {
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
pub(crate) struct Slot {
    pub(crate) ty: FieldType,
    /// Fixed types: byte offset from the record's start. Variable types: index among them.
    pub(crate) pos: u32,
    /// Byte of the null bitmap (from the record's start) and the field's bit in it.
    pub(crate) null_byte: u32,
    pub(crate) null_mask: u8,
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
    pub(crate) slots: Vec<Slot>,
    /// 1 + bitmap bytes + fixed bytes: where the offset table starts.
    pub(crate) fixed_end: usize,
    pub(crate) var_count: usize,
    /// Bits of the bitmap's last byte that must be zero.
    pub(crate) bitmap_pad_mask: u8,
}

/// A record whose envelope (header, sizes, last offset) has been checked.
#[derive(Clone, Copy)]
pub(crate) struct RecordView<'a> {
    pub(crate) bytes: &'a [u8],
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
    pub(crate) fn var(&self, k: usize) -> Result<&'a [u8], SchemaError> {
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
    pub(crate) fn is_null(&self, slot: &Slot) -> bool {
        self.bytes[slot.null_byte as usize] & slot.null_mask != 0
    }

    /// Reads one field, checking everything about it (canonical NULLs, bool bytes, offsets, UTF-8).
    #[inline(always)]
    pub(crate) fn get(&self, slot: &Slot) -> Result<FieldRef<'a>, SchemaError> {
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
pub(crate) fn width_for(var_len: usize) -> (u8, usize) {
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
    pub(crate) fn open<'a>(&self, record: &'a [u8]) -> Result<RecordView<'a>, SchemaError> {
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
    pub(crate) fn envelope_ok(&self, record: &[u8]) -> bool {
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

    /// Index of the null bitmap's last byte.
    #[inline(always)]
    pub(crate) fn fixed_end_bitmap_last(&self) -> usize {
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

pub(crate) fn write_offset(rec: &mut [u8], at: usize, width: usize, value: usize) {
    match width {
        1 => rec[at] = value as u8,
        2 => rec[at..at + 2].copy_from_slice(&(value as u16).to_le_bytes()),
        _ => rec[at..at + 4].copy_from_slice(&(value as u32).to_le_bytes()),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn people() -> Schema {
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
}
