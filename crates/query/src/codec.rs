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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::tests::people;
    use crate::CompiledQuery;

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
