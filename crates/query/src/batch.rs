//! Column-at-a-time evaluation of aggregates whose every field is fixed-width (i32, i64, f64,
//! bool), up to [`BATCH_RECORDS`] records at a time: each record's envelope is checked once, each
//! field read once per batch, and predicates and accumulators run over the columns without
//! data-dependent branches. A record with a non-canonical field goes to the per-record path, so
//! results and errors are the same. [`BatchGroup`] evaluates several queries over one batch.
//!
//! The column readers read raw pointers: each `unsafe` block notes why the bytes are there.

use crate::agg::{ordering_wins, Acc, AggState};
use crate::codec::Op;
use crate::compile::{AggKind, CompiledPredicate, CompiledQuery, Test};
use crate::schema::{FieldType, Schema, Slot, RECORD_FORMAT_VERSION, SCHEMA_FIELDS_MAX};

impl CompiledQuery {
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
}

impl Schema {
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
    pub(crate) fn envelope_mask(
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
pub(crate) struct FixedPlan {
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
    pub(crate) fn new(
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
    pub(crate) fn select(&self, b: &[u8]) -> Option<bool> {
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
                // A count of a field's non-NULL values.
                Acc::Count(k) => *k += take.count_ones() as u64,
                Acc::AvgInt(s, k) => {
                    // i32 columns hold their values sign-extended, as the sums above read them.
                    let (mut sum, mut rest) = (0i128, take);
                    while rest != 0 {
                        sum += raws[rest.trailing_zeros() as usize] as i64 as i128;
                        rest &= rest - 1;
                    }
                    *s = s.saturating_add(sum);
                    *k += take.count_ones() as u64;
                }
                Acc::AvgF64(s, k) => {
                    for (i, &r) in raws.iter().enumerate() {
                        *s += if bit(i) { f64::from_bits(r) } else { 0.0 };
                    }
                    *k += take.count_ones() as u64;
                }
                // Compilation gives fixed-width fields no byte accumulator.
                Acc::Bytes(_) => {}
            }
        }
        (selected, odd & valid)
    }
}

/// Fixed-width columns read from one batch of records.
#[derive(Clone)]
pub(crate) struct Columns {
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
