//! Property tests of the scan query module against an oracle: rows kept decoded in a
//! `BTreeMap<key, Vec<Value>>`, predicates, projections and aggregates evaluated by straightforward
//! code here (glob key filters by `ramlog_common::glob_match`, itself checked against Redis's
//! algorithm in ramlog-common's tests). Also round trips of records, schemas and queries, and
//! random or mutated bytes fed to every decoder.

use proptest::prelude::*;
use ramlog_query::*;
use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::ops::{Bound, RangeBounds};

// ------------------------------------------------------------------ reference implementations

fn oracle_key(filter: &KeyFilter, key: &[u8]) -> bool {
    match filter {
        KeyFilter::All => true,
        KeyFilter::Glob(p) => ramlog_common::glob_match(p, key),
        KeyFilter::Prefix(p) => key.len() >= p.len() && &key[..p.len()] == p.as_slice(),
        KeyFilter::Range { start, end } => (
            start.as_ref().map(|v| v.as_slice()),
            end.as_ref().map(|v| v.as_slice()),
        )
            .contains(key),
    }
}

fn holds(op: Op, o: Ordering) -> bool {
    match op {
        Op::Lt => o.is_lt(),
        Op::Le => o.is_le(),
        Op::Eq => o.is_eq(),
        Op::Ne => o.is_ne(),
        Op::Ge => o.is_ge(),
        Op::Gt => o.is_gt(),
        Op::Prefix | Op::IsNull => unreachable!(),
    }
}

fn oracle_predicate(p: &Predicate, row: &[Value]) -> bool {
    let v = &row[p.field];
    if p.op == Op::IsNull {
        return matches!(v, Value::Null);
    }
    if matches!(v, Value::Null) {
        return false;
    }
    if p.op == Op::Prefix {
        return match (v, &p.constant) {
            (Value::Str(a), Value::Str(b)) => a.starts_with(b.as_str()),
            (Value::Bytes(a), Value::Bytes(b)) => a.starts_with(b),
            _ => unreachable!("compiler accepted a bad prefix"),
        };
    }
    let ord = match (v, &p.constant) {
        (Value::I32(a), Value::I32(b)) => Some(a.cmp(b)),
        (Value::I32(a), Value::I64(b)) => Some((*a as i64).cmp(b)),
        (Value::I64(a), Value::I32(b)) => Some(a.cmp(&(*b as i64))),
        (Value::I64(a), Value::I64(b)) => Some(a.cmp(b)),
        (Value::F64(a), Value::F64(b)) => a.partial_cmp(b),
        (Value::Bool(a), Value::Bool(b)) => Some(a.cmp(b)),
        (Value::Str(a), Value::Str(b)) => Some(a.cmp(b)),
        (Value::Bytes(a), Value::Bytes(b)) => Some(a.cmp(b)),
        _ => unreachable!("compiler accepted a type mismatch"),
    };
    ord.is_some_and(|o| holds(p.op, o))
}

fn oracle_matches(q: &Query, key: &[u8], row: &[Value]) -> bool {
    oracle_key(&q.key_filter, key)
        && q.predicate
            .clauses
            .iter()
            .all(|c| c.iter().any(|p| oracle_predicate(p, row)))
}

/// Aggregates over the selected rows; Err(field) if an integer sum leaves i64.
fn oracle_aggregates(
    aggs: &[Aggregate],
    schema: &Schema,
    rows: &[&Vec<Value>],
) -> Result<Vec<Value>, usize> {
    let mut out = Vec::new();
    for a in aggs {
        out.push(match *a {
            Aggregate::Count => Value::I64(rows.len() as i64),
            Aggregate::Sum(f) => {
                let vals: Vec<&Value> = rows
                    .iter()
                    .map(|r| &r[f])
                    .filter(|v| !matches!(v, Value::Null))
                    .collect();
                if vals.is_empty() {
                    Value::Null
                } else if schema.fields()[f].ty == FieldType::F64 {
                    let mut s = 0.0;
                    for v in vals {
                        let Value::F64(x) = v else { unreachable!() };
                        s += x;
                    }
                    Value::F64(s)
                } else {
                    let mut s: i128 = 0;
                    for v in vals {
                        s += match v {
                            Value::I32(x) => *x as i128,
                            Value::I64(x) => *x as i128,
                            _ => unreachable!(),
                        };
                    }
                    Value::I64(i64::try_from(s).map_err(|_| f)?)
                }
            }
            Aggregate::CountOf(f) => {
                Value::I64(rows.iter().filter(|r| !matches!(r[f], Value::Null)).count() as i64)
            }
            Aggregate::Avg(f) => {
                let vals: Vec<&Value> = rows
                    .iter()
                    .map(|r| &r[f])
                    .filter(|v| !matches!(v, Value::Null))
                    .collect();
                if vals.is_empty() {
                    Value::Null
                } else if schema.fields()[f].ty == FieldType::F64 {
                    let mut s = 0.0;
                    for v in &vals {
                        let Value::F64(x) = v else { unreachable!() };
                        s += x;
                    }
                    Value::F64(s / vals.len() as f64)
                } else {
                    let mut s: i128 = 0;
                    for v in &vals {
                        s += match v {
                            Value::I32(x) => *x as i128,
                            Value::I64(x) => *x as i128,
                            _ => unreachable!(),
                        };
                    }
                    Value::F64(s as f64 / vals.len() as f64)
                }
            }
            Aggregate::Min(f) | Aggregate::Max(f) => {
                let max = matches!(a, Aggregate::Max(_));
                let mut best: Option<&Value> = None;
                for r in rows {
                    let v = &r[f];
                    if matches!(v, Value::Null) {
                        continue;
                    }
                    if let Value::F64(x) = v {
                        if x.is_nan() {
                            continue;
                        }
                    }
                    best = match best {
                        None => Some(v),
                        Some(b) => {
                            let o = cmp_values(v, b);
                            if (max && o == Ordering::Greater) || (!max && o == Ordering::Less) {
                                Some(v)
                            } else {
                                Some(b)
                            }
                        }
                    };
                }
                best.cloned().unwrap_or(Value::Null)
            }
        });
    }
    Ok(out)
}

/// A group of the oracle: its value's encoding, the value, its rows.
type OracleGroup<'a> = (Vec<u8>, Value, Vec<&'a Vec<Value>>);

fn cmp_values(a: &Value, b: &Value) -> Ordering {
    match (a, b) {
        (Value::I32(a), Value::I32(b)) => a.cmp(b),
        (Value::I64(a), Value::I64(b)) => a.cmp(b),
        (Value::F64(a), Value::F64(b)) => a.partial_cmp(b).unwrap(),
        (Value::Bool(a), Value::Bool(b)) => a.cmp(b),
        (Value::Str(a), Value::Str(b)) => a.cmp(b),
        (Value::Bytes(a), Value::Bytes(b)) => a.cmp(b),
        _ => unreachable!(),
    }
}

/// Aggregate results compare as numbers for f64 (0.0 == -0.0, NaN == NaN), exactly otherwise.
fn same_results(a: &[Value], b: &[Value]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| match (x, y) {
            (Value::F64(x), Value::F64(y)) => x == y || (x.is_nan() && y.is_nan()),
            _ => x == y,
        })
}

fn same_finish(a: &AggState, b: &AggState) -> bool {
    match (a.try_finish(), b.try_finish()) {
        (Ok(x), Ok(y)) => same_results(&x, &y),
        (x, y) => x == y,
    }
}

// ------------------------------------------------------------------ strategies

fn field_type() -> impl Strategy<Value = FieldType> {
    prop::sample::select(vec![
        FieldType::I32,
        FieldType::I64,
        FieldType::F64,
        FieldType::Bool,
        FieldType::String,
        FieldType::Bytes,
    ])
}

fn schema_of(tys: &[FieldType]) -> Schema {
    Schema::new(
        tys.iter()
            .enumerate()
            .map(|(i, t)| Field::new(format!("f{i}"), *t))
            .collect(),
    )
    .unwrap()
}

fn non_null(ty: FieldType) -> BoxedStrategy<Value> {
    match ty {
        FieldType::I32 => prop_oneof![4 => -3i32..3, 1 => Just(i32::MIN), 1 => Just(i32::MAX)]
            .prop_map(Value::I32)
            .boxed(),
        FieldType::I64 => prop_oneof![
            4 => -3i64..3,
            1 => Just(i64::MIN),
            1 => Just(i64::MAX),
            1 => any::<i64>()
        ]
        .prop_map(Value::I64)
        .boxed(),
        FieldType::F64 => prop_oneof![
            6 => (-8i32..8).prop_map(|x| x as f64 / 2.0),
            1 => Just(f64::NAN),
            1 => Just(f64::INFINITY),
            1 => Just(f64::NEG_INFINITY),
            1 => Just(-0.0),
        ]
        .prop_map(Value::F64)
        .boxed(),
        FieldType::Bool => any::<bool>().prop_map(Value::Bool).boxed(),
        FieldType::String => "[abé]{0,4}".prop_map(Value::Str).boxed(),
        FieldType::Bytes => prop::collection::vec(prop::sample::select(vec![0u8, 1, 0xff]), 0..4)
            .prop_map(Value::Bytes)
            .boxed(),
    }
}

fn value(ty: FieldType) -> BoxedStrategy<Value> {
    prop_oneof![1 => Just(Value::Null), 3 => non_null(ty)].boxed()
}

/// A comparison constant for a field of type `ty`: its own type, or the other integer width.
fn constant(ty: FieldType) -> BoxedStrategy<Value> {
    match ty {
        FieldType::I32 => prop_oneof![3 => non_null(ty), 1 => non_null(FieldType::I64)].boxed(),
        FieldType::I64 => prop_oneof![3 => non_null(ty), 1 => non_null(FieldType::I32)].boxed(),
        _ => non_null(ty),
    }
}

fn predicate(tys: Vec<FieldType>) -> BoxedStrategy<Predicate> {
    (0..tys.len())
        .prop_flat_map(move |f| {
            let ty = tys[f];
            let ops = prop::sample::select(vec![Op::Lt, Op::Le, Op::Eq, Op::Ne, Op::Ge, Op::Gt]);
            let cmp = (ops, constant(ty)).prop_map(move |(op, c)| Predicate::new(f, op, c));
            let is_null = Just(Predicate::new(f, Op::IsNull, Value::Null));
            match ty {
                FieldType::String | FieldType::Bytes => prop_oneof![
                    4 => cmp,
                    1 => is_null,
                    3 => non_null(ty).prop_map(move |c| Predicate::new(f, Op::Prefix, c)),
                ]
                .boxed(),
                _ => prop_oneof![4 => cmp, 1 => is_null].boxed(),
            }
        })
        .boxed()
}

fn cnf(tys: Vec<FieldType>) -> impl Strategy<Value = Cnf> {
    let clause = prop_oneof![
        12 => prop::collection::vec(predicate(tys), 1..4),
        1 => Just(Vec::new()),
    ];
    prop::collection::vec(clause, 0..4).prop_map(|clauses| Cnf { clauses })
}

fn key() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(prop::sample::select(b"abc*".to_vec()), 0..5)
}

fn glob_pattern() -> impl Strategy<Value = Vec<u8>> {
    // Single bytes plus whole class shapes, so that Redis's corner cases come up often.
    let tokens: Vec<&'static [u8]> = vec![
        b"a", b"b", b"A", b"*", b"?", b"\\", b"[", b"]", b"^", b"-", b"[a-b]", b"[^a]", b"[a-]",
        b"[\\]]", b"[b-a", b"[]", b"[^]", b"[-a]", b"[A-b]", b"[^", b"[\\A]", b"[\\a",
    ];
    prop::collection::vec(prop::sample::select(tokens), 0..5).prop_map(|t| t.concat())
}

fn key_filter() -> impl Strategy<Value = KeyFilter> {
    let bound = prop_oneof![
        Just(Bound::Unbounded),
        key().prop_map(Bound::Included),
        key().prop_map(Bound::Excluded),
    ];
    prop_oneof![
        Just(KeyFilter::All),
        glob_pattern().prop_map(KeyFilter::Glob),
        key().prop_map(KeyFilter::Prefix),
        (bound.clone(), bound).prop_map(|(start, end)| KeyFilter::Range { start, end }),
    ]
}

fn aggregate(tys: &[FieldType]) -> BoxedStrategy<Aggregate> {
    let all: Vec<usize> = (0..tys.len()).collect();
    let numeric: Vec<usize> = all
        .iter()
        .copied()
        .filter(|&i| tys[i].is_numeric())
        .collect();
    let mut options = vec![
        Just(Aggregate::Count).boxed(),
        prop::sample::select(all.clone())
            .prop_map(Aggregate::Min)
            .boxed(),
        prop::sample::select(all).prop_map(Aggregate::Max).boxed(),
    ];
    options.push(
        prop::sample::select((0..tys.len()).collect::<Vec<_>>())
            .prop_map(Aggregate::CountOf)
            .boxed(),
    );
    if !numeric.is_empty() {
        options.push(
            prop::sample::select(numeric.clone())
                .prop_map(Aggregate::Sum)
                .boxed(),
        );
        options.push(
            prop::sample::select(numeric)
                .prop_map(Aggregate::Avg)
                .boxed(),
        );
    }
    prop::strategy::Union::new(options).boxed()
}

fn projection(n: usize) -> impl Strategy<Value = Vec<usize>> {
    prop::sample::subsequence((0..n).collect::<Vec<_>>(), 0..=n).prop_shuffle()
}

fn query(tys: Vec<FieldType>) -> impl Strategy<Value = Query> {
    let n = tys.len();
    let aggs = prop::collection::vec(aggregate(&tys), 1..5);
    let group = prop::option::of(0..n);
    (key_filter(), cnf(tys), 0..3u8, projection(n), aggs, group).prop_map(
        |(key_filter, predicate, mode, proj, aggregates, group)| Query {
            key_filter,
            predicate,
            projection: (mode == 1).then_some(proj),
            aggregates: if mode == 2 { aggregates } else { Vec::new() },
            group_by: group.filter(|_| mode == 2).map(|field| GroupBy {
                field,
                groups_max: 1000,
            }),
        },
    )
}

#[derive(Debug, Clone)]
struct Case {
    schema: Schema,
    rows: BTreeMap<Vec<u8>, Vec<Value>>,
    query: Query,
}

fn case() -> impl Strategy<Value = Case> {
    prop::collection::vec(field_type(), 1..8)
        .prop_flat_map(|tys| {
            let row: Vec<BoxedStrategy<Value>> = tys.iter().map(|t| value(*t)).collect();
            (
                Just(schema_of(&tys)),
                prop::collection::btree_map(key(), row, 0..40),
                query(tys),
            )
        })
        .prop_map(|(schema, rows, query)| Case {
            schema,
            rows,
            query,
        })
}

fn mutate(bytes: &mut Vec<u8>, edits: &[(u8, usize, u8)]) {
    for &(kind, at, b) in edits {
        let at = if bytes.is_empty() {
            0
        } else {
            at % (bytes.len() + 1)
        };
        match kind % 4 {
            0 if at < bytes.len() => bytes[at] = b,
            1 if at < bytes.len() => bytes[at] ^= 1 << (b % 8),
            2 => bytes.insert(at, b),
            _ => bytes.truncate(at),
        }
    }
}

// ------------------------------------------------------------------ properties

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    /// The compiled query selects, projects and aggregates exactly what the oracle does.
    #[test]
    fn compiled_query_agrees_with_oracle(case in case()) {
        let Case { schema, rows, query } = case;
        let records: BTreeMap<&Vec<u8>, Vec<u8>> =
            rows.iter().map(|(k, r)| (k, schema.encode(r).unwrap())).collect();
        let compiled = CompiledQuery::new(query.clone(), Some(&schema)).unwrap();

        let mut got = Vec::new();
        for (k, rec) in &records {
            if compiled.matches(k, rec).unwrap() {
                got.push((*k).clone());
            }
        }
        let expect: Vec<Vec<u8>> = rows
            .iter()
            .filter(|(k, r)| oracle_matches(&query, k, r))
            .map(|(k, _)| k.clone())
            .collect();
        prop_assert_eq!(&got, &expect);

        // Projection: every returned record is the projected row, canonically encoded.
        if let Some(fields) = &query.projection {
            let sub = compiled.output_schema().unwrap();
            prop_assert_eq!(sub, &schema.project(fields).unwrap());
            let mut out = Vec::new();
            for k in &got {
                out.clear();
                compiled.project(&records[k], &mut out).unwrap();
                let want: Vec<Value> = fields.iter().map(|&f| rows[k][f].clone()).collect();
                prop_assert_eq!(sub.decode(&out).unwrap(), want.clone());
                prop_assert_eq!(&out, &sub.encode(&want).unwrap());
            }
        } else {
            for k in &got {
                let mut out = Vec::new();
                compiled.project(&records[k], &mut out).unwrap();
                prop_assert_eq!(&out, &records[k]);
            }
        }

        // Aggregates: one state, and three states (three "tablets") merged.
        if !query.aggregates.is_empty() {
            let mut one = compiled.agg_state();
            let mut parts = [compiled.agg_state(), compiled.agg_state(), compiled.agg_state()];
            for k in &got {
                one.update(&records[k]).unwrap();
                parts[k.len() % 3].update(&records[k]).unwrap();
            }
            let [mut merged, b, c] = parts;
            merged.merge(&c);
            merged.merge(&b);
            let selected: Vec<&Vec<Value>> = got.iter().map(|k| &rows[k]).collect();
            if let Some(g) = query.group_by {
                // Groups: the selected rows by the field's value (bit for bit), each group's
                // aggregates as the oracle computes them, groups in order of their values.
                let mut groups: Vec<OracleGroup<'_>> = Vec::new();
                for row in &selected {
                    let mut key = Vec::new();
                    encode_values(std::slice::from_ref(&row[g.field]), &mut key).unwrap();
                    match groups.iter_mut().find(|x| x.0 == key) {
                        Some(x) => x.2.push(row),
                        None => groups.push((key, row[g.field].clone(), vec![row])),
                    }
                }
                let want: Result<Vec<(Value, Vec<Value>)>, usize> = groups
                    .iter()
                    .map(|(_, v, rows)| Ok((v.clone(), oracle_aggregates(&query.aggregates, &schema, rows)?)))
                    .collect();
                for state in [&one, &merged] {
                    prop_assert!(state.grouped());
                    match (&want, state.finish_groups()) {
                        (Ok(want), Ok(mut got)) => {
                            let mut want = want.clone();
                            want.sort_by(|a, b| compare_values(&a.0, &b.0));
                            got.sort_by(|a, b| compare_values(&a.0, &b.0));
                            prop_assert_eq!(got.len(), want.len());
                            for ((gv, gvals), (wv, wvals)) in got.iter().zip(&want) {
                                prop_assert!(same_results(std::slice::from_ref(gv), std::slice::from_ref(wv)), "{:?} vs {:?}", gv, wv);
                                prop_assert!(same_results(gvals, wvals), "{:?}: {:?} vs oracle {:?}", gv, gvals, wvals);
                            }
                        }
                        (Err(_), got) => prop_assert!(matches!(got, Err(QueryError::SumOverflow { .. })), "{:?}", got),
                        (Ok(_), Err(e)) => prop_assert!(false, "groups failed: {e}"),
                    }
                }
            } else {
            let oracle = oracle_aggregates(&query.aggregates, &schema, &selected);
            for state in [&one, &merged] {
                match &oracle {
                    Ok(want) => {
                        let fin = state.try_finish().unwrap();
                        prop_assert!(same_results(&fin, want), "{:?} vs oracle {:?}", fin, want);
                        prop_assert!(same_results(&state.finish(), want));
                    }
                    Err(field) => {
                        prop_assert_eq!(state.try_finish(), Err(QueryError::SumOverflow { field: *field }));
                    }
                }
            }
        }
            }

        // The wire form round-trips and compiles to the same answers.
        let bytes = query.to_bytes().unwrap();
        prop_assert_eq!(Query::from_bytes(&bytes).unwrap(), query.clone());
        prop_assert_eq!(Schema::from_bytes(&schema.to_bytes()).unwrap(), schema.clone());
        // Key filters work without a schema.
        let keys_only = CompiledQuery::new(Query::keys(query.key_filter.clone()), None).unwrap();
        for k in rows.keys() {
            prop_assert_eq!(keys_only.matches(k, b"anything").unwrap(), oracle_key(&query.key_filter, k));
        }
    }

    /// Batch evaluation (column by column, as the log scan runs aggregates over fixed-width
    /// fields) gives the same counts and accumulators as evaluating record by record, damaged
    /// records included.
    #[test]
    fn batches_agree_with_single_records(
        case in case(),
        damaged in prop::collection::vec((any::<prop::sample::Index>(), prop::collection::vec((any::<u8>(), any::<usize>(), any::<u8>()), 1..3)), 0..6),
    ) {
        let Case { schema, rows, mut query } = case;
        if query.aggregates.is_empty() {
            query.aggregates = vec![Aggregate::Count];
            query.projection = None;
        }
        let compiled = CompiledQuery::new(query.clone(), Some(&schema)).unwrap();
        let mut records: Vec<(Vec<u8>, Vec<u8>)> = rows
            .iter()
            .filter(|(k, _)| oracle_key(&query.key_filter, k))
            .map(|(k, r)| (k.clone(), schema.encode(r).unwrap()))
            .collect();
        if !records.is_empty() {
            for (at, edits) in &damaged {
                let i = at.index(records.len());
                mutate(&mut records[i].1, edits);
            }
        }
        let mut one = compiled.agg_state();
        let (mut matched, mut malformed) = (0u64, 0u64);
        for (k, v) in &records {
            match compiled.matches_and_aggregate(&mut one, k, v) {
                Ok(true) => matched += 1,
                Ok(false) => {}
                Err(_) => malformed += 1,
            }
        }
        let mut batched = compiled.agg_state();
        let values: Vec<&[u8]> = records.iter().map(|(_, v)| v.as_slice()).collect();
        let mut counts = (0u64, 0u64);
        // Uneven batches, none larger than BATCH_RECORDS.
        for chunk in values.chunks(7) {
            let (m, bad) = compiled.aggregate_batch(&mut batched, chunk);
            counts.0 += m;
            counts.1 += bad;
        }
        prop_assert_eq!(counts, (matched, malformed));
        prop_assert!(same_finish(&batched, &one));
        let mut whole = compiled.agg_state();
        let n = values.len().min(ramlog_query::BATCH_RECORDS);
        let (m, bad) = compiled.aggregate_batch(&mut whole, &values[..n]);
        let mut single = compiled.agg_state();
        let (mut m1, mut bad1) = (0, 0);
        for v in &values[..n] {
            match compiled.matches_and_aggregate(&mut single, b"", v) {
                Ok(true) => m1 += 1,
                Ok(false) => {}
                Err(_) => bad1 += 1,
            }
        }
        if matches!(query.key_filter, KeyFilter::All) {
            prop_assert_eq!((m, bad), (m1, bad1));
            prop_assert!(same_finish(&whole, &single));
        }
    }

    /// A group of queries evaluated together over shared columns (shared scan passes) gives
    /// each query what it gets alone over the records it sees.
    #[test]
    fn batch_groups_agree_with_queries_alone(
        (schema, rows, queries) in prop::collection::vec(
            prop::sample::select(vec![FieldType::I32, FieldType::I64, FieldType::F64, FieldType::Bool]),
            1..6,
        ).prop_flat_map(|tys| {
            let row: Vec<BoxedStrategy<Value>> = tys.iter().map(|t| value(*t)).collect();
            (
                Just(schema_of(&tys)),
                prop::collection::vec(row, 0..80),
                prop::collection::vec(query(tys), 1..5),
            )
        }),
        masks in prop::collection::vec(any::<u64>(), 4),
        damaged in prop::collection::vec((any::<prop::sample::Index>(), prop::collection::vec((any::<u8>(), any::<usize>(), any::<u8>()), 1..3)), 0..4),
    ) {
        let compiled: Vec<CompiledQuery> = queries
            .into_iter()
            .map(|mut q| {
                if q.aggregates.is_empty() {
                    q.aggregates = vec![Aggregate::Count];
                    q.projection = None;
                }
                // Grouped queries do not batch.
                q.group_by = None;
                CompiledQuery::new(q, Some(&schema)).unwrap()
            })
            .collect();
        let refs: Vec<&CompiledQuery> = compiled.iter().collect();
        // Fixed-width fields only: every aggregate query batches, and five fields fit a group.
        let group = BatchGroup::new(&refs).expect("the queries form a group");
        let mut records: Vec<Vec<u8>> = rows.iter().map(|r| schema.encode(r).unwrap()).collect();
        if !records.is_empty() {
            for (at, edits) in &damaged {
                let i = at.index(records.len());
                mutate(&mut records[i], edits);
            }
        }
        let mut grouped: Vec<AggState> = compiled.iter().map(|q| q.agg_state()).collect();
        let mut counts = vec![(0u64, 0u64); compiled.len()];
        let mut alone: Vec<AggState> = compiled.iter().map(|q| q.agg_state()).collect();
        let mut alone_counts = vec![(0u64, 0u64); compiled.len()];
        for chunk in records.chunks(BATCH_RECORDS) {
            let values: Vec<&[u8]> = chunk.iter().map(|v| v.as_slice()).collect();
            let full = if values.len() == 64 { u64::MAX } else { (1u64 << values.len()) - 1 };
            let mut members: Vec<GroupMember<'_>> = compiled
                .iter()
                .zip(grouped.iter_mut())
                .zip(&masks)
                .map(|((query, agg), &mask)| GroupMember { query, agg, mask: mask & full, matched: 0, malformed: 0 })
                .collect();
            group.aggregate(&mut members, &values);
            for (c, m) in counts.iter_mut().zip(&members) {
                c.0 += m.matched;
                c.1 += m.malformed;
            }
            for (j, q) in compiled.iter().enumerate() {
                let mine: Vec<&[u8]> = values
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| masks[j] >> i & 1 == 1)
                    .map(|(_, v)| *v)
                    .collect();
                let (m, bad) = q.aggregate_batch(&mut alone[j], &mine);
                alone_counts[j].0 += m;
                alone_counts[j].1 += bad;
            }
        }
        prop_assert_eq!(counts, alone_counts);
        for (g, a) in grouped.iter().zip(&alone) {
            prop_assert!(same_finish(g, a));
        }
    }

    /// Records round-trip, and each field reads back alone.
    #[test]
    fn records_round_trip((tys, row) in prop::collection::vec(field_type(), 0..20).prop_flat_map(|tys| {
        let row: Vec<BoxedStrategy<Value>> = tys.iter().map(|t| value(*t)).collect();
        (Just(tys), row)
    })) {
        let schema = schema_of(&tys);
        let rec = schema.encode(&row).unwrap();
        prop_assert_eq!(schema.decode(&rec).unwrap(), row.clone());
        schema.validate(&rec).unwrap();
        for (i, v) in row.iter().enumerate() {
            prop_assert_eq!(schema.field(&rec, i).unwrap().to_value(), v.clone());
        }
        let overhead = 1 + tys.len().div_ceil(8) + tys.iter().filter(|t| t.fixed_width().is_none()).count();
        let payload: usize = tys.iter().zip(&row).map(|(t, v)| match v {
            Value::Str(s) => s.len(),
            Value::Bytes(b) => b.len(),
            _ => t.fixed_width().unwrap_or(0),
        }).sum();
        prop_assert_eq!(rec.len(), payload + overhead);
    }

    /// Random bytes never panic any decoder; what decodes is canonical and self-consistent.
    #[test]
    fn random_bytes_never_panic(tys in prop::collection::vec(field_type(), 0..10), bytes in prop::collection::vec(any::<u8>(), 0..48)) {
        let schema = schema_of(&tys);
        check_record_bytes(&schema, &bytes)?;
        if let Ok(s) = Schema::from_bytes(&bytes) {
            prop_assert_eq!(s.to_bytes(), bytes.clone());
        }
        if let Ok(q) = Query::from_bytes(&bytes) {
            prop_assert_eq!(q.to_bytes().unwrap(), bytes.clone());
            let _ = CompiledQuery::new(q, Some(&schema));
        }
    }

    /// Mutated valid records, schemas and queries never panic; the query's evaluation on a
    /// damaged record is an error or, if the record still validates, the oracle's answer.
    #[test]
    fn mutated_bytes_never_panic(case in case(), edits in prop::collection::vec((any::<u8>(), any::<usize>(), any::<u8>()), 1..4)) {
        let Case { schema, rows, query } = case;
        let compiled = CompiledQuery::new(query.clone(), Some(&schema)).unwrap();
        let mut agg = compiled.agg_state();
        let mut out = Vec::new();
        for (k, row) in rows.iter().take(5) {
            let mut rec = schema.encode(row).unwrap();
            mutate(&mut rec, &edits);
            check_record_bytes(&schema, &rec)?;
            let m = compiled.matches(k, &rec);
            if let Ok(decoded) = schema.decode(&rec) {
                prop_assert_eq!(m, Ok(oracle_matches(&query, k, &decoded)));
                out.clear();
                prop_assert!(compiled.project(&rec, &mut out).is_ok());
                prop_assert!(agg.update(&rec).is_ok());
            } else {
                out.clear();
                let _ = compiled.project(&rec, &mut out);
                if query.projection.is_none() {
                    // Without a projection the whole record is checked.
                    prop_assert!(compiled.project(&rec, &mut out).is_err());
                }
                let _ = agg.update(&rec);
            }
        }
        let _ = agg.finish();
        let mut sb = schema.to_bytes();
        mutate(&mut sb, &edits);
        if let Ok(s) = Schema::from_bytes(&sb) {
            prop_assert_eq!(s.to_bytes(), sb);
        }
        let mut qb = query.to_bytes().unwrap();
        mutate(&mut qb, &edits);
        if let Ok(q) = Query::from_bytes(&qb) {
            prop_assert_eq!(q.to_bytes().unwrap(), qb);
            if let Ok(c) = CompiledQuery::new(q, Some(&schema)) {
                for (k, row) in rows.iter().take(3) {
                    let rec = schema.encode(row).unwrap();
                    prop_assert!(c.matches(k, &rec).is_ok(), "a valid record is never an error");
                }
            }
        }
    }
}

/// decode, validate and field agree on `bytes`; a decodable record re-encodes to itself.
fn check_record_bytes(schema: &Schema, bytes: &[u8]) -> Result<(), TestCaseError> {
    let decoded = schema.decode(bytes);
    prop_assert_eq!(decoded.is_ok(), schema.validate(bytes).is_ok());
    let fields: Vec<_> = (0..schema.len()).map(|i| schema.field(bytes, i)).collect();
    prop_assert!(schema.field(bytes, schema.len()).is_err());
    match decoded {
        Ok(values) => {
            prop_assert_eq!(&schema.encode(&values).unwrap(), &bytes.to_vec());
            for (f, v) in fields.iter().zip(&values) {
                prop_assert_eq!(&f.as_ref().unwrap().to_value(), v);
            }
        }
        Err(_) => {
            // Not every field can be fine when the record as a whole is not... unless the
            // envelope is what's broken, where every field fails too.
            prop_assert!(fields.iter().any(|f| f.is_err()) || schema.is_empty());
        }
    }
    Ok(())
}
