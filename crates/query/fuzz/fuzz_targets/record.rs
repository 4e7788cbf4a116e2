//! Fuzzes the schema and record decoders: the first byte says how many of the following bytes
//! are a schema encoding (`Schema::from_bytes`); the rest is a record of that schema, read whole
//! (`decode`, `validate`) and field by field (`field`). Nothing may panic, the three must agree,
//! and whatever decodes must re-encode to the same bytes (the encodings are canonical).
#![no_main]

use libfuzzer_sys::fuzz_target;
use ramlog_query::Schema;

fuzz_target!(|data: &[u8]| {
    let Some((&n, rest)) = data.split_first() else {
        return;
    };
    let (schema_bytes, record) = rest.split_at((n as usize).min(rest.len()));
    let Ok(schema) = Schema::from_bytes(schema_bytes) else {
        return;
    };
    assert_eq!(schema.to_bytes(), schema_bytes);
    let decoded = schema.decode(record);
    assert_eq!(decoded.is_ok(), schema.validate(record).is_ok());
    let fields: Vec<_> = (0..=schema.len())
        .map(|i| schema.field(record, i))
        .collect();
    assert!(fields[schema.len()].is_err());
    if let Ok(values) = decoded {
        assert_eq!(
            schema.encode(&values).expect("decoded values encode"),
            record
        );
        for (f, v) in fields.iter().zip(&values) {
            assert_eq!(&f.as_ref().expect("field of a valid record").to_value(), v);
        }
    }
});
