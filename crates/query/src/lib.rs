//! ramlog-query: what a scan evaluates per record, with no knowledge of the log.
//!
//! What it owns, one module per concern:
//! - `filter`: [`KeyFilter`] (all, Redis glob, prefix, byte range); the glob is `ramlog_common`'s
//!   [`glob_match`], re-exported here.
//! - `schema`: [`Schema`], a table's typed, nullable fields, the **record encoding** of a row (an
//!   object's value bytes) and the schema's own byte encoding. [`Schema::field`] reads one field
//!   of a record in O(1) without decoding the others.
//! - `codec`: [`Query`] (key filter, a CNF predicate ([`Cnf`] of [`Predicate`]s), a projection or
//!   aggregates) with a bounded wire encoding ([`Query::to_bytes`]), and the encoding of result
//!   values ([`encode_values`]).
//! - `compile`: [`CompiledQuery`], a query checked against a schema and laid out for the scan's
//!   hot loop; [`CompiledQuery::matches`] allocates nothing and reads only the fields the
//!   predicate names.
//! - `batch`: aggregates over fixed-width fields evaluated 64 records at a time, column by column
//!   ([`CompiledQuery::aggregate_batch`]), also for several queries sharing a pass
//!   ([`BatchGroup`]).
//! - `agg`: [`AggState`] accumulates aggregates and merges the states of several tablets.
//!
//! What it hides: the byte layouts (documented in docs/formats.md, "Schema records"), the
//! per-field offsets precomputed from a schema, the predicate program, and the batch plans with
//! their column buffers. Every public item is at the crate root.
//!
//! The engine (`ramlog-logmem`) runs compiled queries inside its scans; the client
//! (`ramlog-client`) builds queries and schemas and decodes results with this crate alone.
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

mod agg;
mod batch;
mod codec;
mod compile;
mod filter;
mod reader;
mod schema;

pub use agg::{compare_values, AggState};
pub use batch::{BatchGroup, GroupMember, BATCH_RECORDS};
pub use codec::{
    decode_groups, decode_values, encode_groups, encode_values, is_groups, scan_cursor,
    scan_position, Aggregate, Cnf, GroupBy, Op, Predicate, Query, QueryError, AGGREGATES_MAX,
    CNF_CLAUSES_MAX, CNF_PREDICATES_MAX, CONSTANT_BYTES_MAX, GROUPS_MARK, GROUPS_MAX,
    KEY_FILTER_BYTES_MAX, QUERY_FORMAT_VERSION, SCAN_CHUNK_FIRST, SCAN_CHUNK_MAX, VALUES_MAX,
};
pub use compile::CompiledQuery;
pub use filter::KeyFilter;
/// The key filter's glob: Redis's `stringmatchlen`, from `ramlog_common`.
pub use ramlog_common::{glob_match, glob_match_nocase};
pub use schema::{
    Field, FieldRef, FieldType, Schema, SchemaError, Value, FIELD_NAME_BYTES_MAX,
    RECORD_FORMAT_VERSION, SCHEMA_FIELDS_MAX, SCHEMA_FORMAT_VERSION,
};
