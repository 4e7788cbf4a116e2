//! Fuzzes the query wire decoder and the compiled evaluation: the input is split at its first
//! two bytes' worth of lengths into a schema, a query and a value; `Query::from_bytes`,
//! `CompiledQuery::new`, `matches`, `project` and an aggregate update run on whatever parses.
//! Nothing may panic; a parsed query re-encodes to the same bytes; a record that decodes is
//! never an error for `matches`. Batch evaluation of the value (alone, and cut into several
//! records) must agree with evaluating record by record.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ramlog_query::{CompiledQuery, Query, Schema, BATCH_RECORDS};

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let (lens, rest) = data.split_at(2);
    let (schema_bytes, rest) = rest.split_at((lens[0] as usize).min(rest.len()));
    let (query_bytes, value) = rest.split_at((lens[1] as usize).min(rest.len()));
    let schema = Schema::from_bytes(schema_bytes).ok();
    let Ok(query) = Query::from_bytes(query_bytes) else {
        return;
    };
    assert_eq!(
        query.to_bytes().expect("a parsed query encodes"),
        query_bytes
    );
    let Ok(compiled) = CompiledQuery::new(query, schema.as_ref()) else {
        return;
    };
    let key = value.get(..value.len().min(8)).unwrap_or_default();
    let matched = compiled.matches(key, value);
    if let Some(s) = &schema {
        if s.validate(value).is_ok() {
            assert!(matched.is_ok(), "a valid record is never an error");
        }
    }
    let mut out = Vec::new();
    if compiled.project(value, &mut out).is_ok() {
        if let Some(out_schema) = compiled.output_schema() {
            out_schema
                .validate(&out)
                .expect("a projection is a valid record");
        }
    }
    let mut agg = compiled.agg_state();
    let _ = agg.update(value);
    let _ = agg.finish();
    if compiled.is_aggregate() {
        // The value, and its pieces at every 7th byte, as one batch and one record at a time.
        let mut records: Vec<&[u8]> = vec![value];
        records.extend(value.chunks(7));
        records.truncate(BATCH_RECORDS);
        let mut batched = compiled.agg_state();
        let counts = compiled.aggregate_batch(&mut batched, &records);
        let mut single = compiled.agg_state();
        let (mut matched, mut malformed) = (0u64, 0u64);
        for r in &records {
            if !compiled.query().key_filter.matches(b"") {
                break;
            }
            match compiled.matches_and_aggregate(&mut single, b"", r) {
                Ok(true) => matched += 1,
                Ok(false) => {}
                Err(_) => malformed += 1,
            }
        }
        if compiled.query().key_filter.matches(b"") {
            assert_eq!(counts, (matched, malformed), "batch and single counts differ");
            let (a, b) = (batched.try_finish(), single.try_finish());
            assert_eq!(format!("{a:?}"), format!("{b:?}"), "batch and single results differ");
        }
    }
});
