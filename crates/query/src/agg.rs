//! Aggregate accumulators: [`AggState`] folds in the records a query selected, merges the states
//! of several tablets, and finishes to one value per aggregate.

use crate::batch::Columns;
use crate::codec::QueryError;
use crate::compile::{AggKind, AggPlan};
use crate::schema::{FieldRef, FieldType, RecordView, Value};
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

/// One aggregate's accumulator.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Acc {
    Count(u64),
    /// Exact integer sum and whether any non-NULL value was seen.
    SumInt(i128, bool),
    SumF64(f64, bool),
    /// Min/Max of i32/i64 (widened), f64 (NaN skipped), bool, string/bytes.
    Int(Option<i64>),
    F64(Option<f64>),
    Bool(Option<bool>),
    Bytes(Option<Vec<u8>>),
    /// Average: exact integer sum or float sum, and the count of values.
    AvgInt(i128, u64),
    AvgF64(f64, u64),
}

impl Acc {
    pub(crate) fn new(kind: AggKind, ty: FieldType) -> Acc {
        match (kind, ty) {
            (AggKind::Count | AggKind::CountOf, _) => Acc::Count(0),
            (AggKind::Avg, FieldType::F64) => Acc::AvgF64(0.0, 0),
            (AggKind::Avg, _) => Acc::AvgInt(0, 0),
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
            (Acc::Count(n), _) => *n += 1,
            (Acc::AvgInt(s, n), FieldRef::I32(v)) => {
                *s = s.saturating_add(v as i128);
                *n += 1;
            }
            (Acc::AvgInt(s, n), FieldRef::I64(v)) => {
                *s = s.saturating_add(v as i128);
                *n += 1;
            }
            (Acc::AvgF64(s, n), FieldRef::F64(v)) => {
                *s += v;
                *n += 1;
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
            (Acc::AvgInt(a, na), Acc::AvgInt(b, nb)) => {
                *a = a.saturating_add(*b);
                *na += *nb;
            }
            (Acc::AvgF64(a, na), Acc::AvgF64(b, nb)) => {
                if *nb > 0 {
                    *a += *b;
                }
                *na += *nb;
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

/// The order of group values: NULL first, then by value (values of one field share a type;
/// floats by total order).
pub fn compare_values(a: &Value, b: &Value) -> std::cmp::Ordering {
    use std::cmp::Ordering;
    match (a, b) {
        (Value::Null, Value::Null) => Ordering::Equal,
        (Value::Null, _) => Ordering::Less,
        (_, Value::Null) => Ordering::Greater,
        (Value::I32(x), Value::I32(y)) => x.cmp(y),
        (Value::I64(x), Value::I64(y)) => x.cmp(y),
        (Value::F64(x), Value::F64(y)) => x.total_cmp(y),
        (Value::Bool(x), Value::Bool(y)) => x.cmp(y),
        (Value::Str(x), Value::Str(y)) => x.cmp(y),
        (Value::Bytes(x), Value::Bytes(y)) => x.cmp(y),
        _ => Ordering::Equal,
    }
}

/// Whether a candidate that compares `o` to the current Min (`max` false) or Max wins.
pub(crate) fn ordering_wins(max: bool, o: std::cmp::Ordering) -> bool {
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

/// A grouped query's groups: by the group value's encoding, the value and its accumulators.
#[derive(Clone, Debug, Default)]
pub(crate) struct Groups {
    map: HashMap<Vec<u8>, (Value, Vec<Acc>)>,
    /// A record of a new group came past the bound: the result is an error.
    overflow: bool,
}

/// Running aggregates of one scan (or one tablet's part of it); from
/// [`CompiledQuery::agg_state`]. Feed it the values that [`CompiledQuery::matches`] selected.
///
/// [`CompiledQuery::agg_state`]: crate::CompiledQuery::agg_state
/// [`CompiledQuery::matches`]: crate::CompiledQuery::matches
#[derive(Clone)]
pub struct AggState {
    pub(crate) plan: Arc<AggPlan>,
    pub(crate) acc: Vec<Acc>,
    /// A grouped query's accumulators per group (`acc` is then unused).
    pub(crate) groups: Option<Groups>,
    /// Column space of batch evaluation, kept between batches (not part of the result).
    pub(crate) columns: Option<Box<Columns>>,
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
    pub(crate) fn update_view(&mut self, view: &RecordView<'_>) -> Result<(), QueryError> {
        for (kind, slot, _) in &self.plan.aggs {
            if *kind != AggKind::Count {
                view.get(slot)?;
            }
        }
        let accs = match (&mut self.groups, self.plan.group) {
            (Some(groups), Some((slot, _, max))) => {
                let value = view.get(&slot)?.to_value();
                let mut key = Vec::new();
                crate::codec::write_value(&mut key, &value);
                if !groups.map.contains_key(&key) {
                    if groups.map.len() >= max as usize {
                        groups.overflow = true;
                        return Ok(());
                    }
                    let fresh = self
                        .plan
                        .aggs
                        .iter()
                        .map(|(kind, slot, _)| Acc::new(*kind, slot.ty))
                        .collect();
                    groups.map.insert(key.clone(), (value, fresh));
                }
                &mut groups.map.get_mut(&key).expect("inserted above").1
            }
            _ => &mut self.acc,
        };
        for ((kind, slot, _), acc) in self.plan.aggs.iter().zip(accs.iter_mut()) {
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
        let aggs = &self.plan.aggs;
        let merge = |mine: &mut [Acc], theirs: &[Acc]| {
            for (((kind, _, _), acc), theirs) in aggs.iter().zip(mine).zip(theirs) {
                acc.merge(*kind == AggKind::Max, theirs);
            }
        };
        merge(&mut self.acc, &other.acc);
        if let (Some(mine), Some(theirs), Some((_, _, max))) =
            (&mut self.groups, &other.groups, self.plan.group)
        {
            mine.overflow |= theirs.overflow;
            for (key, (value, accs)) in &theirs.map {
                let full = mine.map.len() >= max as usize;
                match mine.map.get_mut(key) {
                    Some((_, acc)) => merge(acc, accs),
                    None if full => mine.overflow = true,
                    None => {
                        mine.map.insert(key.clone(), (value.clone(), accs.clone()));
                    }
                }
            }
        }
    }

    /// Whether the query groups (then [`AggState::finish_groups`] gives its result).
    pub fn grouped(&self) -> bool {
        self.groups.is_some()
    }

    /// A grouped query's result: each group's value and its aggregates (as
    /// [`AggState::try_finish`]), groups in order of their values (NULL first). Fails when more
    /// groups came than the query's bound.
    pub fn finish_groups(&self) -> Result<Vec<(Value, Vec<Value>)>, QueryError> {
        let Some(groups) = &self.groups else {
            return Ok(Vec::new());
        };
        if groups.overflow {
            return Err(QueryError::TooManyGroups {
                max: self.plan.group.map_or(0, |g| g.2),
            });
        }
        let mut out = groups
            .map
            .values()
            .map(|(value, accs)| Ok((value.clone(), self.results_of(accs, true)?)))
            .collect::<Result<Vec<_>, QueryError>>()?;
        out.sort_by(|a, b| compare_values(&a.0, &b.0));
        Ok(out)
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
        self.results_of(&self.acc, strict)
    }

    fn results_of(&self, accs: &[Acc], strict: bool) -> Result<Vec<Value>, QueryError> {
        self.plan
            .aggs
            .iter()
            .zip(accs)
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
                    Acc::AvgInt(_, 0) | Acc::AvgF64(_, 0) => Value::Null,
                    Acc::AvgInt(s, n) => Value::F64(*s as f64 / *n as f64),
                    Acc::AvgF64(s, n) => Value::F64(*s / *n as f64),
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
    use crate::codec::Aggregate;
    use crate::schema::{Field, Schema};
    use crate::{CompiledQuery, Query};

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
}
