//! The parts of a query (key filter, CNF predicate, projection, aggregates), the limits on each,
//! and the wire encodings of queries and of result values (docs/formats.md, "Schema records").
//! Decoding bounds every count and length before it allocates.

use crate::filter::KeyFilter;
use crate::reader::Reader;
use crate::schema::{SchemaError, Value, SCHEMA_FIELDS_MAX};
use std::ops::Bound;
use thiserror::Error;

/// First byte of a query's wire encoding.
pub const QUERY_FORMAT_VERSION: u8 = 1;
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
    pub(crate) fn holds(self, ord: std::cmp::Ordering) -> bool {
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
    /// Number of matching records whose field is not NULL (→ I64).
    CountOf(usize),
    /// Mean of a numeric field's non-NULL values (→ F64; NULL if none). Over several tablets it
    /// is computed from their [`Aggregate::Sum`] and [`Aggregate::CountOf`] (see
    /// [`Query::partial`]).
    Avg(usize),
}

impl Aggregate {
    /// The field it reads (None for Count).
    pub fn field(&self) -> Option<usize> {
        match *self {
            Aggregate::Count => None,
            Aggregate::Sum(f)
            | Aggregate::Min(f)
            | Aggregate::Max(f)
            | Aggregate::CountOf(f)
            | Aggregate::Avg(f) => Some(f),
        }
    }
}

/// Most slots one step of a resumable scan reads ([`scan_cursor`]).
pub const SCAN_CHUNK_MAX: u16 = 16384;
/// Slots per step of a resumable scan that starts (cursor 0).
pub const SCAN_CHUNK_FIRST: u16 = 64;

/// A resumable scan's cursor for the next step: the next hash slot to read, above the number of
/// slots per step (never 0, which starts and ends a scan).
pub fn scan_cursor(slot: u16, chunk: u16) -> u64 {
    (u64::from(slot) << 16) | u64::from(chunk.clamp(1, SCAN_CHUNK_MAX))
}

/// The (slot, slots per step) of a [`scan_cursor`]; 0 is the start. A cursor no scan gave out
/// is an error.
pub fn scan_position(cursor: u64) -> Result<(u16, u16), QueryError> {
    if cursor == 0 {
        return Ok((0, SCAN_CHUNK_FIRST));
    }
    let slot = cursor >> 16;
    let chunk = (cursor & 0xFFFF) as u16;
    if slot >= 16384 || chunk == 0 || chunk > SCAN_CHUNK_MAX {
        return Err(QueryError::Malformed("not a scan cursor"));
    }
    Ok((slot as u16, chunk))
}

/// Most groups a grouped query may ask for.
pub const GROUPS_MAX: u32 = 100_000;

/// Aggregates per distinct value of one field, at most `groups_max` groups (more fail the scan
/// with [`QueryError::TooManyGroups`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GroupBy {
    pub field: usize,
    pub groups_max: u32,
}

/// What a scan evaluates: a key filter, a CNF predicate over the schema's fields, and either a
/// projection (the records returned hold only these fields, in this order) or aggregates.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Query {
    pub key_filter: KeyFilter,
    pub predicate: Cnf,
    pub projection: Option<Vec<usize>>,
    pub aggregates: Vec<Aggregate>,
    /// With aggregates: one set of them per value of this field.
    pub group_by: Option<GroupBy>,
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
    #[error("more than {max} groups (raise the query's bound on groups, or filter more)")]
    TooManyGroups { max: u32 },
    #[error("group-by needs aggregates")]
    GroupWithoutAggregates,
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
    pub(crate) fn check_limits(&self) -> Result<(), QueryError> {
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
            if let Some(f) = a.field() {
                if f >= SCHEMA_FIELDS_MAX {
                    return too_large(format!("field index {f}"));
                }
            }
        }
        if let Some(g) = &self.group_by {
            if g.field >= SCHEMA_FIELDS_MAX {
                return too_large(format!("field index {}", g.field));
            }
            if g.groups_max == 0 || g.groups_max > GROUPS_MAX {
                return too_large(format!(
                    "a bound of {} groups (1..={GROUPS_MAX})",
                    g.groups_max
                ));
            }
        }
        Ok(())
    }

    /// What each tablet of a scan spread over several computes so that the parts merge exactly:
    /// every [`Aggregate::Avg`] becomes a [`Aggregate::Sum`] and a [`Aggregate::CountOf`] of its
    /// field (appended once each); the other aggregates stay. Also returns, for each aggregate
    /// of `self`, where its value is in the partial query's: `(i, None)` as is, `(sum, Some(n))`
    /// for an average.
    pub fn partial(&self) -> (Query, Vec<(usize, Option<usize>)>) {
        let mut q = self.clone();
        q.aggregates.clear();
        let mut at = Vec::with_capacity(self.aggregates.len());
        let index_of = |q: &mut Query, a: Aggregate| match q.aggregates.iter().position(|x| *x == a)
        {
            Some(i) => i,
            None => {
                q.aggregates.push(a);
                q.aggregates.len() - 1
            }
        };
        for a in &self.aggregates {
            match *a {
                Aggregate::Avg(f) => {
                    let sum = index_of(&mut q, Aggregate::Sum(f));
                    let n = index_of(&mut q, Aggregate::CountOf(f));
                    at.push((sum, Some(n)));
                }
                other => at.push((index_of(&mut q, other), None)),
            }
        }
        (q, at)
    }

    /// The wire encoding (docs/formats.md, "Schema records"). Fails if a count or length is past
    /// its bound (the same bounds [`Query::from_bytes`] and [`CompiledQuery::new`] enforce).
    ///
    /// [`CompiledQuery::new`]: crate::CompiledQuery::new
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
                Aggregate::CountOf(f) => out.extend_from_slice(&[4, f as u8]),
                Aggregate::Avg(f) => out.extend_from_slice(&[5, f as u8]),
            }
        }
        // An optional section: absent in queries without a group-by.
        if let Some(g) = &self.group_by {
            out.push(1);
            out.push(g.field as u8);
            out.extend_from_slice(&g.groups_max.to_le_bytes());
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
                4 => Aggregate::CountOf(read_u8(&mut r)? as usize),
                5 => Aggregate::Avg(read_u8(&mut r)? as usize),
                _ => return Err(QueryError::Malformed("unknown aggregate kind")),
            });
        }
        let group_by = if r.is_done() {
            None
        } else {
            if read_u8(&mut r)? != 1 {
                return Err(QueryError::Malformed("unknown query section"));
            }
            let field = read_u8(&mut r)? as usize;
            let max = r.take(4).ok_or(QueryError::Malformed("truncated"))?;
            Some(GroupBy {
                field,
                groups_max: u32::from_le_bytes([max[0], max[1], max[2], max[3]]),
            })
        };
        if !r.is_done() {
            return Err(QueryError::Malformed("trailing bytes"));
        }
        let q = Query {
            key_filter,
            predicate: Cnf { clauses },
            projection,
            aggregates,
            group_by,
        };
        // Field indexes in one byte can reach 255, one past the largest valid index.
        q.check_limits()
            .map_err(|_| QueryError::Malformed("field index or group bound out of range"))?;
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
pub(crate) fn write_value(out: &mut Vec<u8>, v: &Value) {
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
pub const VALUES_MAX: usize = 254;

/// First byte of [`encode_groups`] (never a count of [`encode_values`]).
pub const GROUPS_MARK: u8 = 0xFF;

/// Encodes a grouped query's result: [`GROUPS_MARK`], `u32 groups`, then per group its value
/// (as a constant) and its aggregates ([`encode_values`]).
pub fn encode_groups(groups: &[(Value, Vec<Value>)], out: &mut Vec<u8>) -> Result<(), QueryError> {
    if groups.len() > GROUPS_MAX as usize {
        return Err(QueryError::TooLarge(format!("{} groups", groups.len())));
    }
    out.push(GROUPS_MARK);
    out.extend_from_slice(&(groups.len() as u32).to_le_bytes());
    for (value, values) in groups {
        if let Value::Str(s) = value {
            if s.len() > CONSTANT_BYTES_MAX {
                return Err(QueryError::TooLarge("a group value past 64 KiB".into()));
            }
        }
        if let Value::Bytes(b) = value {
            if b.len() > CONSTANT_BYTES_MAX {
                return Err(QueryError::TooLarge("a group value past 64 KiB".into()));
            }
        }
        write_value(out, value);
        encode_values(values, out)?;
    }
    Ok(())
}

/// Whether aggregate result bytes are [`encode_groups`]'s.
pub fn is_groups(bytes: &[u8]) -> bool {
    bytes.first() == Some(&GROUPS_MARK)
}

/// Parses [`encode_groups`]; at most `groups_max` groups, string/bytes values bounded by
/// `value_bytes_max` each.
pub fn decode_groups(
    bytes: &[u8],
    groups_max: usize,
    value_bytes_max: usize,
) -> Result<Vec<(Value, Vec<Value>)>, QueryError> {
    let mut r = Reader::new(bytes);
    if read_u8(&mut r)? != GROUPS_MARK {
        return Err(QueryError::Malformed("not a grouped result"));
    }
    let n = r.take(4).ok_or(QueryError::Malformed("truncated"))?;
    let n = u32::from_le_bytes([n[0], n[1], n[2], n[3]]) as usize;
    if n > groups_max.min(GROUPS_MAX as usize) {
        return Err(QueryError::Malformed("too many groups"));
    }
    // Each group takes at least 2 bytes: no allocation past what the input can hold.
    let mut out = Vec::with_capacity(n.min(bytes.len() / 2));
    for _ in 0..n {
        let value = read_value(&mut r)?;
        let rest = &r.bytes[r.pos..];
        let (values, used) = decode_values_prefix(rest, value_bytes_max)?;
        r.pos += used;
        out.push((value, values));
    }
    if !r.is_done() {
        return Err(QueryError::Malformed("trailing bytes"));
    }
    Ok(out)
}

/// Encodes a short list of values (e.g. [`AggState::finish`]'s result) for the wire:
/// `u8 count` then each value as in a query's constants (docs/formats.md). Fails past 255 values
/// or a string/bytes value past 4 GiB.
///
/// [`AggState::finish`]: crate::AggState::finish
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
    let (out, used) = decode_values_prefix(bytes, value_bytes_max)?;
    if used != bytes.len() {
        return Err(QueryError::Malformed("trailing bytes"));
    }
    Ok(out)
}

/// [`decode_values`] of the start of `bytes`; also returns the bytes it read.
fn decode_values_prefix(
    bytes: &[u8],
    value_bytes_max: usize,
) -> Result<(Vec<Value>, usize), QueryError> {
    let mut r = Reader::new(bytes);
    let n = read_u8(&mut r)? as usize;
    if n > VALUES_MAX {
        return Err(QueryError::Malformed("too many values"));
    }
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
    Ok((out, r.pos))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::tests::people;
    use crate::CompiledQuery;

    #[test]
    fn scan_cursors_round_trip_and_refuse_what_no_scan_gave() {
        assert_eq!(scan_position(0).unwrap(), (0, SCAN_CHUNK_FIRST));
        for (slot, chunk) in [(0, 1), (1, 64), (16383, 16384), (100, 3)] {
            let c = scan_cursor(slot, chunk);
            assert_ne!(c, 0);
            assert_eq!(scan_position(c).unwrap(), (slot, chunk));
        }
        for bad in [1 << 16, (16384 << 16) | 1, (1 << 16) | 16385, u64::MAX] {
            assert!(scan_position(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn grouped_queries_and_results_round_trip_within_their_bounds() {
        let query = Query {
            aggregates: vec![Aggregate::Avg(0), Aggregate::Count, Aggregate::Sum(0)],
            group_by: Some(GroupBy {
                field: 2,
                groups_max: 10,
            }),
            ..Query::default()
        };
        let bytes = query.to_bytes().unwrap();
        assert_eq!(Query::from_bytes(&bytes).unwrap(), query);
        // Each tablet computes sums and counts; the average comes from them.
        let (partial, at) = query.partial();
        assert_eq!(
            partial.aggregates,
            vec![Aggregate::Sum(0), Aggregate::CountOf(0), Aggregate::Count]
        );
        assert_eq!(at, vec![(0, Some(1)), (2, None), (0, None)]);
        assert_eq!(partial.group_by, query.group_by);
        for bad in [0, GROUPS_MAX + 1] {
            let mut q = query.clone();
            q.group_by = Some(GroupBy {
                field: 2,
                groups_max: bad,
            });
            assert!(matches!(q.to_bytes(), Err(QueryError::TooLarge(_))));
        }
        let mut unknown = bytes.clone();
        let at = bytes.len() - 6;
        unknown[at] = 2;
        assert!(Query::from_bytes(&unknown).is_err());
        let mut no_aggs = query.clone();
        no_aggs.aggregates.clear();
        assert_eq!(
            CompiledQuery::new(no_aggs, Some(&people())).err(),
            Some(QueryError::GroupWithoutAggregates)
        );

        let groups = vec![
            (Value::Null, vec![Value::I64(1)]),
            (Value::Str("a".into()), vec![Value::F64(2.5)]),
        ];
        let mut out = Vec::new();
        encode_groups(&groups, &mut out).unwrap();
        assert!(is_groups(&out));
        assert_eq!(decode_groups(&out, 10, 16).unwrap(), groups);
        assert!(
            decode_groups(&out, 1, 16).is_err(),
            "past the bound on groups"
        );
        assert!(decode_groups(&out[..out.len() - 1], 10, 16).is_err());
        let mut values = Vec::new();
        encode_values(&[Value::I64(1)], &mut values).unwrap();
        assert!(!is_groups(&values));
        assert!(
            decode_values(&out, 16).is_err(),
            "a grouped result is not a value list"
        );
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
            group_by: None,
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
