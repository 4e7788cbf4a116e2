//! Queries compiled against a table's schema for the scan's hot loop: each predicate becomes a
//! test specialised to its field's type, the CNF is evaluated one bit per OR-clause, and a
//! projection writes a record of the sub-schema. Column-at-a-time evaluation of aggregates
//! ([`CompiledQuery::aggregate_batch`]) is in `batch.rs`, the accumulators in `agg.rs`.

use crate::agg::{Acc, AggState};
use crate::batch::FixedPlan;
use crate::codec::{Aggregate, Op, Predicate, Query, QueryError};
use crate::filter::KeyFilter;
use crate::schema::{
    width_for, write_offset, FieldRef, FieldType, RecordView, Schema, SchemaError, Slot,
    RECORD_FORMAT_VERSION,
};
use std::sync::Arc;

/// A predicate's test, specialised to the field's type at compile time.
#[derive(Clone, Debug)]
pub(crate) enum Test {
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
pub(crate) struct CompiledPredicate {
    pub(crate) slot: Slot,
    /// This predicate's OR-clause's bit.
    pub(crate) bit: u64,
    /// Last predicate of its clause: if the clause's bit is still clear after it, the record fails.
    pub(crate) last_in_clause: bool,
    pub(crate) test: Test,
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
pub(crate) enum AggKind {
    Count,
    Sum,
    Min,
    Max,
    /// Count of non-NULL values of a field.
    CountOf,
    Avg,
}

#[derive(Clone, Debug)]
pub(crate) struct AggPlan {
    pub(crate) schema: Option<Schema>,
    /// (kind, slot of the field; unused for Count, field index for errors).
    pub(crate) aggs: Vec<(AggKind, Slot, usize)>,
    /// Group-by: the field's slot, its index, and the most groups.
    pub(crate) group: Option<(Slot, usize, u32)>,
}

/// A [`Query`] validated against a table's schema and laid out for the scan's hot loop.
/// Cheap to share across scan threads (`Send + Sync`, evaluation takes `&self`).
#[derive(Clone, Debug)]
pub struct CompiledQuery {
    query: Query,
    key_filter: KeyFilter,
    /// Only keys of these hash slots (first, last) are selected ([`CompiledQuery::with_slots`]):
    /// a cluster scan of one tablet, whose engine tablet may also hold copies of other slots for a
    /// while (a split's before its cleanup, a merge's while it copies).
    slots: Option<(u16, u16)>,
    pub(crate) schema: Option<Schema>,
    predicates: Vec<CompiledPredicate>,
    /// One bit per OR-clause.
    all_clauses: u64,
    projection: Option<(Vec<usize>, Schema)>,
    plan: Arc<AggPlan>,
    /// The same predicates and aggregates flattened for fixed-width fields, when every field the
    /// query reads is one (the common analytic case); evaluation then takes this path.
    pub(crate) fixed: Option<FixedPlan>,
}

impl CompiledQuery {
    /// Validates `query` against `schema` (None for a table without one, where only the key
    /// filter is allowed): field indexes, constant types, operators per type, projection fields
    /// (unique), aggregate types, and the counts the wire format bounds.
    pub fn new(query: Query, schema: Option<&Schema>) -> Result<CompiledQuery, QueryError> {
        query.check_limits()?;
        let reads_fields = !query.predicate.clauses.is_empty()
            || query.projection.is_some()
            || query.group_by.is_some()
            || query.aggregates.iter().any(|a| *a != Aggregate::Count);
        if reads_fields && schema.is_none() {
            return Err(QueryError::NoSchema);
        }
        if query.projection.is_some() && !query.aggregates.is_empty() {
            return Err(QueryError::ProjectionWithAggregates);
        }
        if query.group_by.is_some() && query.aggregates.is_empty() {
            return Err(QueryError::GroupWithoutAggregates);
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
                Aggregate::CountOf(f) => (AggKind::CountOf, f),
                Aggregate::Avg(f) => (AggKind::Avg, f),
            };
            let (slot, ty) = slot_of(field)?;
            if kind == AggKind::Sum && !ty.is_numeric() {
                return Err(bad("sum needs an i32, i64 or f64 field"));
            }
            if kind == AggKind::Avg && !ty.is_numeric() {
                return Err(bad("avg needs an i32, i64 or f64 field"));
            }
            aggs.push((kind, slot, field));
        }
        let group = match &query.group_by {
            None => None,
            Some(g) => Some((slot_of(g.field)?.0, g.field, g.groups_max)),
        };

        // Groups are kept by the general path only.
        let fixed = if group.is_some() {
            None
        } else {
            FixedPlan::new(&predicates, &aggs, all_clauses)
        };
        Ok(CompiledQuery {
            key_filter: query.key_filter.clone(),
            slots: None,
            schema: schema.cloned(),
            predicates,
            all_clauses,
            projection,
            plan: Arc::new(AggPlan {
                schema: schema.cloned(),
                aggs,
                group,
            }),
            fixed,
            query,
        })
    }

    /// Selects only keys whose hash slot lies in `first..=last`.
    pub fn with_slots(mut self, first: u16, last: u16) -> CompiledQuery {
        self.slots = Some((first, last));
        self
    }

    /// The slot range [`CompiledQuery::with_slots`] set, if any.
    pub fn slots(&self) -> Option<(u16, u16)> {
        self.slots
    }

    /// Whether the key filter and the slot range let `key` through.
    #[inline]
    pub fn key_selected(&self, key: &[u8]) -> bool {
        self.key_filter.matches(key)
            && self.slots.is_none_or(|(first, last)| {
                let slot = ramlog_common::key_slot(key);
                first <= slot && slot <= last
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
        if !self.key_selected(key) {
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
        if !self.key_selected(key) {
            return Ok(false);
        }
        self.select_and_aggregate_general(agg, value)
    }

    /// `matches_and_aggregate` without the key filter, through the general evaluator.
    pub(crate) fn select_and_aggregate_general(
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
            groups: self.plan.group.map(|_| Default::default()),
            plan: self.plan.clone(),
            columns: None,
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::Cnf;
    use crate::schema::tests::people;
    use crate::schema::Value;

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
}
