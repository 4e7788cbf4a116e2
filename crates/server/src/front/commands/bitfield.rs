//! BITFIELD and BITFIELD_RO (Redis's `bitops.c`): signed and unsigned integers of 1 to 64 bits
//! (unsigned up to 63) at any bit offset of a string, read (GET), written (SET) and incremented
//! (INCRBY) with WRAP, SAT or FAIL overflow, all the operations of one command applied to the
//! string in one conditional write.

use super::typed::*;
use super::*;

#[derive(Clone, Copy, PartialEq)]
enum Overflow {
    Wrap,
    Sat,
    Fail,
}

#[derive(Clone, Copy)]
struct Field {
    signed: bool,
    bits: u32,
    offset: u64,
}

enum Op {
    Get(Field),
    /// SET honours the OVERFLOW in force too (Redis checks the value against the type).
    Set(Field, i64, Overflow),
    IncrBy(Field, i64, Overflow),
}

fn parse_type(t: &[u8]) -> Option<(bool, u32)> {
    let (signed, digits) = match t.first()? {
        b'i' | b'I' => (true, &t[1..]),
        b'u' | b'U' => (false, &t[1..]),
        _ => return None,
    };
    let bits: u32 = std::str::from_utf8(digits).ok()?.parse().ok()?;
    let max = if signed { 64 } else { 63 };
    (1..=max).contains(&bits).then_some((signed, bits))
}

fn parse_offset(ctx: &Ctx<'_>, arg: &[u8], bits: u32) -> Option<u64> {
    let (multiply, digits) = match arg.first() {
        Some(b'#') => (true, &arg[1..]),
        _ => (false, arg),
    };
    let n = parse_i64(digits).filter(|n| *n >= 0)? as u64;
    let offset = if multiply {
        n.checked_mul(u64::from(bits))?
    } else {
        n
    };
    let max_bits = ctx.node.config.value_size_max_bytes * 8;
    (offset + u64::from(bits) <= max_bits).then_some(offset)
}

const ERR_TYPE: &str =
    "ERR Invalid bitfield type. Use something like i16 u8. Note that u64 is not supported but i64 is.";
const ERR_OFFSET: &str = "ERR bit offset is not an integer or out of range";

fn parse_ops(ctx: &mut Ctx<'_>, args: &[&[u8]], read_only: bool) -> Result<Vec<Op>, Replied> {
    let mut ops = Vec::new();
    let mut overflow = Overflow::Wrap;
    let mut i = 2;
    let fail = |ctx: &mut Ctx<'_>, m: &str| {
        ctx.enc.error(m);
        Err(Replied)
    };
    while i < args.len() {
        let sub = args[i];
        let left = args.len() - i - 1;
        if eq_ignore_case(sub, "overflow") && left >= 1 {
            overflow = match args[i + 1] {
                o if eq_ignore_case(o, "wrap") => Overflow::Wrap,
                o if eq_ignore_case(o, "sat") => Overflow::Sat,
                o if eq_ignore_case(o, "fail") => Overflow::Fail,
                _ => return fail(ctx, "ERR Invalid OVERFLOW type specified"),
            };
            i += 2;
            continue;
        }
        let arity = if eq_ignore_case(sub, "get") {
            2
        } else if eq_ignore_case(sub, "set") || eq_ignore_case(sub, "incrby") {
            3
        } else {
            return fail(ctx, ERR_SYNTAX);
        };
        if left < arity {
            return fail(ctx, ERR_SYNTAX);
        }
        let Some((signed, bits)) = parse_type(args[i + 1]) else {
            return fail(ctx, ERR_TYPE);
        };
        let Some(offset) = parse_offset(ctx, args[i + 2], bits) else {
            return fail(ctx, ERR_OFFSET);
        };
        let field = Field {
            signed,
            bits,
            offset,
        };
        if arity == 2 {
            ops.push(Op::Get(field));
        } else {
            if read_only {
                return fail(ctx, "ERR BITFIELD_RO only supports the GET subcommand");
            }
            let Some(v) = parse_i64(args[i + 3]) else {
                return fail(ctx, ERR_NOT_INTEGER);
            };
            ops.push(if eq_ignore_case(sub, "set") {
                Op::Set(field, v, overflow)
            } else {
                Op::IncrBy(field, v, overflow)
            });
        }
        i += arity + 1;
    }
    Ok(ops)
}

/// The `bits` bits at `offset` (most significant first), 0 past the end of `s`.
fn read_bits(s: &[u8], offset: u64, bits: u32) -> u64 {
    let mut v = 0u64;
    for b in 0..u64::from(bits) {
        let at = offset + b;
        let byte = s.get((at / 8) as usize).copied().unwrap_or(0);
        let bit = (byte >> (7 - (at % 8))) & 1;
        v = (v << 1) | u64::from(bit);
    }
    v
}

fn write_bits(s: &mut Vec<u8>, offset: u64, bits: u32, v: u64) {
    let end = ((offset + u64::from(bits)).div_ceil(8)) as usize;
    if s.len() < end {
        s.resize(end, 0);
    }
    for b in 0..u64::from(bits) {
        let at = offset + b;
        let bit = (v >> (u64::from(bits) - 1 - b)) & 1;
        let mask = 1u8 << (7 - (at % 8));
        let byte = &mut s[(at / 8) as usize];
        if bit == 1 {
            *byte |= mask;
        } else {
            *byte &= !mask;
        }
    }
}

fn as_value(f: Field, raw: u64) -> i64 {
    if f.signed && f.bits < 64 && raw & (1u64 << (f.bits - 1)) != 0 {
        (raw | (u64::MAX << f.bits)) as i64
    } else {
        raw as i64
    }
}

fn range(f: Field) -> (i128, i128) {
    if f.signed {
        (-(1i128 << (f.bits - 1)), (1i128 << (f.bits - 1)) - 1)
    } else {
        (0, (1i128 << f.bits) - 1)
    }
}

/// `value` for the field under `overflow`: Some(the value to store), None when FAIL refuses it.
fn fit(f: Field, value: i128, overflow: Overflow) -> Option<i64> {
    let (min, max) = range(f);
    if (min..=max).contains(&value) {
        return Some(value as i64);
    }
    match overflow {
        Overflow::Fail => None,
        Overflow::Sat => Some(if value < min { min } else { max } as i64),
        Overflow::Wrap => {
            let mask = if f.bits == 64 {
                u64::MAX
            } else {
                (1u64 << f.bits) - 1
            };
            Some(as_value(f, (value as u64) & mask))
        }
    }
}

/// Runs the operations on `s`: the replies (None for an operation FAIL refused) and whether
/// `s` changed.
fn apply(s: &mut Vec<u8>, ops: &[Op]) -> (Vec<Option<i64>>, bool) {
    let mut out = Vec::with_capacity(ops.len());
    let mut changed = false;
    for op in ops {
        match *op {
            Op::Get(f) => out.push(Some(as_value(f, read_bits(s, f.offset, f.bits)))),
            Op::Set(f, v, overflow) => {
                let old = as_value(f, read_bits(s, f.offset, f.bits));
                // As Redis: an unsigned field takes the value's 64 bits as unsigned.
                let value = if f.signed {
                    i128::from(v)
                } else {
                    i128::from(v as u64)
                };
                match fit(f, value, overflow) {
                    Some(new) => {
                        write_bits(s, f.offset, f.bits, new as u64);
                        changed = true;
                        out.push(Some(old));
                    }
                    None => out.push(None),
                }
            }
            Op::IncrBy(f, by, overflow) => {
                let old = as_value(f, read_bits(s, f.offset, f.bits));
                match fit(f, i128::from(old) + i128::from(by), overflow) {
                    Some(new) => {
                        write_bits(s, f.offset, f.bits, new as u64);
                        changed = true;
                        out.push(Some(new));
                    }
                    None => out.push(None),
                }
            }
        }
    }
    (out, changed)
}

pub(super) fn cmd_bitfield(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    bitfield(ctx, args, false)
}

pub(super) fn cmd_bitfield_ro(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    bitfield(ctx, args, true)
}

fn bitfield(ctx: &mut Ctx<'_>, args: &[&[u8]], read_only: bool) {
    let Ok(ops) = parse_ops(ctx, args, read_only) else {
        return;
    };
    // As Redis: a command that writes makes the string long enough for its highest field
    // first, even when OVERFLOW FAIL then refuses every write.
    let needed = ops
        .iter()
        .filter_map(|op| match op {
            Op::Set(f, ..) | Op::IncrBy(f, ..) => {
                Some((f.offset + u64::from(f.bits)).div_ceil(8) as usize)
            }
            Op::Get(_) => None,
        })
        .max();
    let replies = if let Some(needed) = needed {
        super::strings::update_string(ctx, args[1], super::strings::Change::InPlace, |current| {
            let mut s = current.map(<[u8]>::to_vec).unwrap_or_default();
            if s.len() < needed {
                s.resize(needed, 0);
            }
            let (replies, _) = apply(&mut s, &ops);
            let write = current.is_none_or(|c| c != s.as_slice());
            Ok((replies, write.then_some(s)))
        })
    } else {
        let found = match read(ctx, args[1]) {
            Ok(f) => f,
            Err(e) => return engine_error(ctx, &e),
        };
        let s = match &found {
            None => &[][..],
            Some(o) => match string_or_wrongtype(ctx, &o.value) {
                Ok(s) => s,
                Err(Replied) => return,
            },
        };
        let mut copy = s.to_vec();
        Ok(apply(&mut copy, &ops).0)
    };
    if let Ok(replies) = replies {
        ctx.enc.array(replies.len());
        for r in replies {
            match r {
                Some(v) => ctx.enc.integer(v),
                None => ctx.enc.null(),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(signed: bool, bits: u32, offset: u64) -> Field {
        Field {
            signed,
            bits,
            offset,
        }
    }

    #[test]
    fn fields_read_and_write_at_any_bit() {
        let mut s = Vec::new();
        write_bits(&mut s, 5, 8, 0xAB);
        assert_eq!(read_bits(&s, 5, 8), 0xAB);
        assert_eq!(s.len(), 2);
        write_bits(&mut s, 0, 64, u64::MAX);
        assert_eq!(as_value(field(true, 64, 0), read_bits(&s, 0, 64)), -1);
        assert_eq!(as_value(field(true, 4, 0), 0b1000), -8);
        assert_eq!(as_value(field(false, 4, 0), 0b1000), 8);
    }

    #[test]
    fn overflow_wraps_saturates_or_fails() {
        let u8f = field(false, 8, 0);
        let i8f = field(true, 8, 0);
        assert_eq!(fit(u8f, 300, Overflow::Wrap), Some(44));
        assert_eq!(fit(u8f, 300, Overflow::Sat), Some(255));
        assert_eq!(fit(u8f, -1, Overflow::Sat), Some(0));
        assert_eq!(fit(u8f, 300, Overflow::Fail), None);
        assert_eq!(fit(i8f, 128, Overflow::Wrap), Some(-128));
        assert_eq!(fit(i8f, -129, Overflow::Sat), Some(-128));
        let i64f = field(true, 64, 0);
        assert_eq!(
            fit(i64f, i128::from(i64::MAX) + 1, Overflow::Wrap),
            Some(i64::MIN)
        );
        assert_eq!(parse_type(b"u64"), None);
        assert_eq!(parse_type(b"i64"), Some((true, 64)));
        assert_eq!(parse_type(b"u0"), None);
    }
}
