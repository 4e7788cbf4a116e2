//! The `cjson` and `cmsgpack` libraries of Redis's Lua (queue libraries such as BullMQ pass job
//! options and arguments through them): `cjson.encode`, `cjson.decode`, `cjson.null`,
//! `cmsgpack.pack` and `cmsgpack.unpack`, converting as Redis's bundled libraries do:
//! - a table whose keys are exactly 1..n is an array; any other table is an object or map (an
//!   empty table is `{}` in JSON and an empty array in MessagePack);
//! - a number with no fraction is written as an integer;
//! - JSON `null` reads as `cjson.null`; MessagePack nil as `nil`.
//!
//! Tables nested deeper than [`DEPTH_MAX`] are refused, as Redis refuses them.
//!
//! Also the `bit` library (LuaBitOp, which Redis bundles): `tobit`, `tohex`, `bnot`, `band`, `bor`,
//! `bxor`, `lshift`, `rshift`, `arshift`, `rol`, `ror`, `bswap`, on 32-bit integers (a number is
//! rounded to the nearest integer, ties to even, and taken modulo 2^32, as LuaBitOp does).

use mlua::{LightUserData, Lua, MultiValue, Table, Value};
use ramlog_proto::msgpack;

/// The deepest nesting of tables encoded or decoded.
const DEPTH_MAX: usize = 64;

pub(super) fn install(lua: &Lua) -> mlua::Result<()> {
    let cjson = lua.create_table()?;
    cjson.set(
        "null",
        Value::LightUserData(LightUserData(std::ptr::null_mut())),
    )?;
    cjson.set(
        "encode",
        lua.create_function(|lua, v: Value| {
            let json = to_json(&v, 0).map_err(mlua::Error::external)?;
            lua.create_string(json.to_string())
        })?,
    )?;
    cjson.set(
        "decode",
        lua.create_function(|lua, s: mlua::String| {
            let json: serde_json::Value = serde_json::from_slice(&s.as_bytes()).map_err(|e| {
                mlua::Error::external(format!("Expected value but found invalid JSON: {e}"))
            })?;
            from_json(lua, &json, 0)
        })?,
    )?;
    lua.globals().set("cjson", cjson)?;

    let cmsgpack = lua.create_table()?;
    cmsgpack.set(
        "pack",
        lua.create_function(|lua, args: MultiValue| {
            let mut out = Vec::new();
            for v in args.iter() {
                msgpack::encode(&to_msgpack(v, 0).map_err(mlua::Error::external)?, &mut out);
            }
            lua.create_string(&out)
        })?,
    )?;
    cmsgpack.set(
        "unpack",
        lua.create_function(|lua, s: mlua::String| {
            let values = msgpack::decode_all(&s.as_bytes()).map_err(mlua::Error::external)?;
            let mut out = Vec::with_capacity(values.len());
            for v in &values {
                out.push(from_msgpack(lua, v)?);
            }
            Ok(MultiValue::from_iter(out))
        })?,
    )?;
    lua.globals().set("cmsgpack", cmsgpack)?;
    install_bit(lua)?;
    install_struct(lua)
}

/// The `struct` library Redis bundles (Roberto Ierusalimschy's lua_struct): `pack`, `unpack`
/// and `size` of binary records with C's sizes on a 64-bit machine (`l`, `L` and `T` take 8
/// bytes), little-endian unless `>`, no alignment unless `!`.
fn install_struct(lua: &Lua) -> mlua::Result<()> {
    let t = lua.create_table()?;
    t.set(
        "pack",
        lua.create_function(|lua, args: MultiValue| {
            let mut args = args.into_iter();
            let packed = struct_string(args.next(), 1, "pack").and_then(|fmt| {
                let rest: Vec<Value> = args.collect();
                struct_pack(&fmt, &rest)
            });
            lua.create_string(&packed.map_err(|m| struct_raise(lua, m))?)
        })?,
    )?;
    t.set(
        "unpack",
        lua.create_function(|lua, args: MultiValue| {
            let mut args = args.into_iter();
            let unpacked = (|| {
                let fmt = struct_string(args.next(), 1, "unpack")?;
                let data = struct_string(args.next(), 2, "unpack")?;
                let pos = match args.next() {
                    None | Some(Value::Nil) => 1.0,
                    Some(v) => struct_number(&v, 3, "unpack")?,
                };
                struct_unpack(lua, &fmt, &data, pos)
            })();
            Ok(MultiValue::from_iter(
                unpacked.map_err(|m| struct_raise(lua, m))?,
            ))
        })?,
    )?;
    t.set(
        "size",
        lua.create_function(|lua, fmt: Value| {
            let size = struct_string(Some(fmt), 1, "size").and_then(|f| struct_size(&f));
            Ok(size.map_err(|m| struct_raise(lua, m))? as f64)
        })?,
    )?;
    lua.globals().set("struct", t)?;
    Ok(())
}

/// lua_struct's errors as `luaL_error` raises them: prefixed with the calling script's
/// position (`user_script:1: `).
fn struct_raise(lua: &Lua, message: String) -> mlua::Error {
    let position = lua
        .inspect_stack(1)
        .filter(|d| d.curr_line() > 0)
        .map(|d| {
            let src = d
                .source()
                .short_src
                .map(|s| s.to_string())
                .unwrap_or_default();
            format!("{src}:{}: ", d.curr_line())
        })
        .unwrap_or_default();
    mlua::Error::external(format!("{position}{message}"))
}

/// Largest integer lua_struct packs, in bytes.
const STRUCT_INT_MAX: usize = 32;
/// Its default `!` alignment (a double's on x86-64).
const STRUCT_ALIGN_MAX: usize = 8;

fn struct_error(n: usize, f: &str, what: &str) -> String {
    format!("bad argument #{n} to '{f}' ({what})")
}

/// luaL_checklstring: a string, or a number as Lua writes it.
fn struct_string(v: Option<Value>, n: usize, f: &str) -> Result<Vec<u8>, String> {
    match v {
        Some(Value::String(s)) => Ok(s.as_bytes().to_vec()),
        Some(Value::Integer(i)) => Ok(i.to_string().into_bytes()),
        Some(Value::Number(x)) => Ok(lua_number_text(x).into_bytes()),
        Some(other) => Err(struct_error(
            n,
            f,
            &format!("string expected, got {}", other.type_name()),
        )),
        None => Err(struct_error(n, f, "string expected, got no value")),
    }
}

/// Lua 5.1's `%.14g` of a number.
fn lua_number_text(x: f64) -> String {
    if x.fract() == 0.0 && x.abs() < 1e15 {
        format!("{}", x as i64)
    } else {
        let t = format!("{:.13e}", x);
        match t.split_once('e') {
            Some((m, e)) => {
                let m = m.trim_end_matches('0').trim_end_matches('.');
                let e: i32 = e.parse().unwrap_or(0);
                if (-5..14).contains(&e) {
                    format!("{}", x)
                } else {
                    format!("{m}e{}{:02}", if e < 0 { '-' } else { '+' }, e.abs())
                }
            }
            None => t,
        }
    }
}

/// luaL_checknumber: a number, or a string that reads as one.
fn struct_number(v: &Value, n: usize, f: &str) -> Result<f64, String> {
    match v {
        Value::Number(x) => Ok(*x),
        Value::Integer(i) => Ok(*i as f64),
        Value::String(s) => {
            let text = s.to_str().map(|t| t.trim().to_string()).unwrap_or_default();
            let parsed = match text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
                Some(hex) => u64::from_str_radix(hex, 16).ok().map(|v| v as f64),
                None => text.parse::<f64>().ok(),
            };
            parsed.ok_or_else(|| struct_error(n, f, "number expected, got string"))
        }
        other => Err(struct_error(
            n,
            f,
            &format!("number expected, got {}", other.type_name()),
        )),
    }
}

/// A format being read, with its options.
struct StructFormat<'a> {
    fmt: &'a [u8],
    at: usize,
    little: bool,
    align: usize,
}

impl<'a> StructFormat<'a> {
    fn new(fmt: &'a [u8]) -> Self {
        StructFormat {
            fmt,
            at: 0,
            little: true,
            align: 1,
        }
    }

    fn next(&mut self) -> Option<u8> {
        let c = self.fmt.get(self.at).copied()?;
        self.at += 1;
        Some(c)
    }

    fn number(&mut self, default: usize) -> Result<usize, String> {
        if !self.fmt.get(self.at).is_some_and(u8::is_ascii_digit) {
            return Ok(default);
        }
        let mut a: usize = 0;
        while let Some(d) = self.fmt.get(self.at).filter(|d| d.is_ascii_digit()) {
            let digit = usize::from(d - b'0');
            if a > (i32::MAX as usize) / 10 || a * 10 > i32::MAX as usize - digit {
                return Err("integral size overflow".to_string());
            }
            a = a * 10 + digit;
            self.at += 1;
        }
        Ok(a)
    }

    /// `optsize`: the bytes an option takes (0 for the control options).
    fn size(&mut self, opt: u8) -> Result<usize, String> {
        Ok(match opt {
            b'B' | b'b' | b'x' => 1,
            b'H' | b'h' => 2,
            b'L' | b'l' | b'T' | b'd' => 8,
            b'f' => 4,
            b'c' => self.number(1)?,
            b'i' | b'I' => {
                let n = self.number(4)?;
                if n > STRUCT_INT_MAX {
                    return Err(format!(
                        "integral size {n} is larger than limit of {STRUCT_INT_MAX}"
                    ));
                }
                n
            }
            _ => 0,
        })
    }

    /// `gettoalign`: padding before an item of `size` at `len`.
    fn padding(&self, len: usize, opt: u8, size: usize) -> usize {
        if size == 0 || opt == b'c' {
            return 0;
        }
        let size = size.min(self.align);
        (size.wrapping_sub(len & (size - 1))) & (size - 1)
    }

    /// `controloptions`.
    fn control(&mut self, opt: u8, f: &str) -> Result<(), String> {
        match opt {
            b' ' => {}
            b'>' => self.little = false,
            b'<' => self.little = true,
            b'!' => {
                let a = self.number(STRUCT_ALIGN_MAX)?;
                if a == 0 || a & (a - 1) != 0 {
                    return Err(format!("alignment {a} is not a power of 2"));
                }
                self.align = a;
            }
            other => {
                return Err(struct_error(
                    1,
                    f,
                    &format!("invalid format option '{}'", other as char),
                ))
            }
        }
        Ok(())
    }
}

fn struct_pack(fmt: &[u8], args: &[Value]) -> Result<Vec<u8>, String> {
    let mut f = StructFormat::new(fmt);
    let mut out = Vec::new();
    let mut arg = 0usize;
    let next_arg = |arg: &mut usize| -> (usize, Value) {
        let v = args.get(*arg).cloned().unwrap_or(Value::Nil);
        *arg += 1;
        (*arg + 1, v)
    };
    while let Some(opt) = f.next() {
        let mut size = f.size(opt)?;
        let pad = f.padding(out.len(), opt, size);
        out.resize(out.len() + pad, 0);
        match opt {
            b'b' | b'B' | b'h' | b'H' | b'l' | b'L' | b'T' | b'i' | b'I' => {
                let (n, v) = next_arg(&mut arg);
                let x = struct_number(&v, n, "pack")?;
                let mut value: u64 = if x < 0.0 { x as i64 as u64 } else { x as u64 };
                let mut bytes = vec![0u8; size];
                for i in 0..size {
                    let at = if f.little { i } else { size - 1 - i };
                    bytes[at] = (value & 0xff) as u8;
                    value = value.checked_shr(8).unwrap_or(0);
                }
                out.extend_from_slice(&bytes);
            }
            b'x' => out.push(0),
            b'f' => {
                let (n, v) = next_arg(&mut arg);
                let x = struct_number(&v, n, "pack")? as f32;
                out.extend_from_slice(&if f.little {
                    x.to_le_bytes()
                } else {
                    x.to_be_bytes()
                });
            }
            b'd' => {
                let (n, v) = next_arg(&mut arg);
                let x = struct_number(&v, n, "pack")?;
                out.extend_from_slice(&if f.little {
                    x.to_le_bytes()
                } else {
                    x.to_be_bytes()
                });
            }
            b'c' | b's' => {
                let (n, v) = next_arg(&mut arg);
                let s = struct_string(Some(v), n, "pack")?;
                if size == 0 {
                    size = s.len();
                }
                if s.len() < size {
                    return Err(struct_error(n + 1, "pack", "string too short"));
                }
                out.extend_from_slice(&s[..size]);
                if opt == b's' {
                    out.push(0);
                }
            }
            other => f.control(other, "pack")?,
        }
    }
    Ok(out)
}

fn struct_unpack(lua: &Lua, fmt: &[u8], data: &[u8], pos: f64) -> Result<Vec<Value>, String> {
    if pos < 1.0 {
        return Err(struct_error(3, "unpack", "offset must be 1 or greater"));
    }
    let mut pos = pos as usize - 1;
    let mut f = StructFormat::new(fmt);
    let mut out: Vec<Value> = Vec::new();
    let too_short = || struct_error(2, "unpack", "data string too short");
    while let Some(opt) = f.next() {
        let mut size = f.size(opt)?;
        pos += f.padding(pos, opt, size);
        if size > data.len() || pos > data.len() - size {
            return Err(too_short());
        }
        match opt {
            b'b' | b'B' | b'h' | b'H' | b'l' | b'L' | b'T' | b'i' | b'I' => {
                let bytes = &data[pos..pos + size];
                let mut l: u64 = 0;
                for i in 0..size {
                    let b = if f.little {
                        bytes[size - 1 - i]
                    } else {
                        bytes[i]
                    };
                    l = l.wrapping_shl(8) | u64::from(b);
                }
                let value = if opt.is_ascii_lowercase() {
                    let mask = u64::MAX.wrapping_shl((size * 8).wrapping_sub(1) as u32);
                    if l & mask != 0 {
                        l |= mask;
                    }
                    l as i64 as f64
                } else {
                    l as f64
                };
                out.push(Value::Number(value));
            }
            b'x' => {}
            b'f' => {
                let raw: [u8; 4] = data[pos..pos + 4].try_into().expect("4 bytes");
                let x = if f.little {
                    f32::from_le_bytes(raw)
                } else {
                    f32::from_be_bytes(raw)
                };
                out.push(Value::Number(f64::from(x)));
            }
            b'd' => {
                let raw: [u8; 8] = data[pos..pos + 8].try_into().expect("8 bytes");
                let x = if f.little {
                    f64::from_le_bytes(raw)
                } else {
                    f64::from_be_bytes(raw)
                };
                out.push(Value::Number(x));
            }
            b'c' => {
                if size == 0 {
                    size = match out.pop() {
                        Some(Value::Number(n)) if n >= 0.0 => n as usize,
                        Some(Value::Integer(n)) if n >= 0 => n as usize,
                        _ => return Err("format 'c0' needs a previous size".to_string()),
                    };
                    if size > data.len() || pos > data.len() - size {
                        return Err(too_short());
                    }
                }
                out.push(Value::String(
                    lua.create_string(&data[pos..pos + size])
                        .map_err(|e| e.to_string())?,
                ));
            }
            b's' => {
                let Some(end) = data[pos..].iter().position(|&b| b == 0) else {
                    return Err("unfinished string in data".to_string());
                };
                out.push(Value::String(
                    lua.create_string(&data[pos..pos + end])
                        .map_err(|e| e.to_string())?,
                ));
                size = end + 1;
            }
            other => f.control(other, "unpack")?,
        }
        pos += size;
    }
    out.push(Value::Number((pos + 1) as f64));
    Ok(out)
}

fn struct_size(fmt: &[u8]) -> Result<usize, String> {
    let mut f = StructFormat::new(fmt);
    let mut pos = 0usize;
    while let Some(opt) = f.next() {
        let size = f.size(opt)?;
        pos += f.padding(pos, opt, size);
        if opt == b's' {
            return Err(struct_error(1, "size", "option 's' has no fixed size"));
        }
        if opt == b'c' && size == 0 {
            return Err(struct_error(1, "size", "option 'c0' has no fixed size"));
        }
        if !opt.is_ascii_alphanumeric() {
            f.control(opt, "size")?;
        }
        pos += size;
    }
    Ok(pos)
}

/// LuaBitOp's conversion of a number to a 32-bit integer.
fn tobit(x: f64) -> i32 {
    if !x.is_finite() {
        return 0;
    }
    (x.round_ties_even().rem_euclid(4_294_967_296.0) as u64 as u32) as i32
}

fn tohex(x: f64, n: Option<f64>) -> String {
    let n = n.map_or(8, |n| tobit(n) as i64);
    let upper = n < 0;
    let digits = n.unsigned_abs().clamp(1, 8) as usize;
    let mut v = tobit(x) as u32 as u64;
    if digits < 8 {
        v &= (1u64 << (4 * digits)) - 1;
    }
    if upper {
        format!("{v:0digits$X}")
    } else {
        format!("{v:0digits$x}")
    }
}

fn install_bit(lua: &Lua) -> mlua::Result<()> {
    let bit = lua.create_table()?;
    let fold = |lua: &Lua, op: fn(i32, i32) -> i32| {
        lua.create_function(move |_, args: mlua::Variadic<f64>| {
            let mut it = args.iter();
            let first = it.next().ok_or_else(|| {
                mlua::Error::external("bad argument #1 (number expected, got no value)")
            })?;
            Ok(f64::from(
                it.fold(tobit(*first), |acc, &x| op(acc, tobit(x))),
            ))
        })
    };
    bit.set("band", fold(lua, |a, b| a & b)?)?;
    bit.set("bor", fold(lua, |a, b| a | b)?)?;
    bit.set("bxor", fold(lua, |a, b| a ^ b)?)?;
    bit.set(
        "tobit",
        lua.create_function(|_, x: f64| Ok(f64::from(tobit(x))))?,
    )?;
    bit.set(
        "bnot",
        lua.create_function(|_, x: f64| Ok(f64::from(!tobit(x))))?,
    )?;
    bit.set(
        "bswap",
        lua.create_function(|_, x: f64| Ok(f64::from(tobit(x).swap_bytes())))?,
    )?;
    bit.set(
        "tohex",
        lua.create_function(|_, (x, n): (f64, Option<f64>)| Ok(tohex(x, n)))?,
    )?;
    let shift = |lua: &Lua, op: fn(i32, u32) -> i32| {
        lua.create_function(move |_, (x, n): (f64, f64)| {
            Ok(f64::from(op(tobit(x), (tobit(n) & 31) as u32)))
        })
    };
    bit.set("lshift", shift(lua, |x, n| ((x as u32) << n) as i32)?)?;
    bit.set("rshift", shift(lua, |x, n| ((x as u32) >> n) as i32)?)?;
    bit.set("arshift", shift(lua, |x, n| x >> n)?)?;
    bit.set("rol", shift(lua, |x, n| (x as u32).rotate_left(n) as i32)?)?;
    bit.set("ror", shift(lua, |x, n| (x as u32).rotate_right(n) as i32)?)?;
    lua.globals().set("bit", bit)?;
    Ok(())
}

/// The length n of a table whose keys are exactly 1..n (0 for an empty table); None otherwise.
fn array_len(t: &Table) -> Option<usize> {
    let mut count = 0usize;
    let mut max = 0usize;
    for pair in t.clone().pairs::<Value, Value>() {
        let (k, _) = pair.ok()?;
        let index = match k {
            Value::Integer(i) if i >= 1 => i as usize,
            Value::Number(n) if n >= 1.0 && n.fract() == 0.0 && n < 9.0e15 => n as usize,
            _ => return None,
        };
        count += 1;
        max = max.max(index);
    }
    (count == max).then_some(count)
}

fn number(n: f64) -> serde_json::Value {
    if n.fract() == 0.0 && n.abs() < 1.0e15 {
        serde_json::Value::from(n as i64)
    } else {
        serde_json::Number::from_f64(n).map_or(serde_json::Value::Null, serde_json::Value::Number)
    }
}

fn to_json(v: &Value, depth: usize) -> Result<serde_json::Value, String> {
    if depth > DEPTH_MAX {
        return Err("Cannot serialise, excessive nesting".into());
    }
    Ok(match v {
        Value::Nil => serde_json::Value::Null,
        Value::LightUserData(u) if u.0.is_null() => serde_json::Value::Null,
        Value::Boolean(b) => serde_json::Value::Bool(*b),
        Value::Integer(i) => serde_json::Value::from(*i),
        Value::Number(n) if !n.is_finite() => {
            return Err("Cannot serialise number: must not be NaN or Inf".into())
        }
        Value::Number(n) => number(*n),
        Value::String(s) => {
            serde_json::Value::String(String::from_utf8_lossy(&s.as_bytes()).into_owned())
        }
        Value::Table(t) => match array_len(t) {
            Some(n) if n > 0 => {
                let mut items = Vec::with_capacity(n);
                for i in 1..=n {
                    let item: Value = t.raw_get(i).map_err(|e| e.to_string())?;
                    items.push(to_json(&item, depth + 1)?);
                }
                serde_json::Value::Array(items)
            }
            _ => {
                let mut map = serde_json::Map::new();
                for pair in t.clone().pairs::<Value, Value>() {
                    let (k, item) = pair.map_err(|e| e.to_string())?;
                    let key = match &k {
                        Value::String(s) => String::from_utf8_lossy(&s.as_bytes()).into_owned(),
                        Value::Integer(i) => i.to_string(),
                        Value::Number(n) => number(*n).to_string(),
                        _ => {
                            return Err(
                                "Cannot serialise table: key must be a number or string".into()
                            )
                        }
                    };
                    map.insert(key, to_json(&item, depth + 1)?);
                }
                serde_json::Value::Object(map)
            }
        },
        other => {
            return Err(format!(
                "Cannot serialise {}: type not supported",
                other.type_name()
            ))
        }
    })
}

fn from_json(lua: &Lua, v: &serde_json::Value, depth: usize) -> mlua::Result<Value> {
    if depth > DEPTH_MAX {
        return Err(mlua::Error::external(
            "Found too many nested data structures",
        ));
    }
    Ok(match v {
        serde_json::Value::Null => Value::LightUserData(LightUserData(std::ptr::null_mut())),
        serde_json::Value::Bool(b) => Value::Boolean(*b),
        serde_json::Value::Number(n) => Value::Number(n.as_f64().unwrap_or(0.0)),
        serde_json::Value::String(s) => Value::String(lua.create_string(s)?),
        serde_json::Value::Array(items) => {
            let t = lua.create_table_with_capacity(items.len(), 0)?;
            for (i, item) in items.iter().enumerate() {
                t.raw_set(i + 1, from_json(lua, item, depth + 1)?)?;
            }
            Value::Table(t)
        }
        serde_json::Value::Object(map) => {
            let t = lua.create_table_with_capacity(0, map.len())?;
            for (k, item) in map {
                t.raw_set(k.as_str(), from_json(lua, item, depth + 1)?)?;
            }
            Value::Table(t)
        }
    })
}

fn to_msgpack(v: &Value, depth: usize) -> Result<msgpack::Value, String> {
    if depth > DEPTH_MAX {
        return Err("cmsgpack: table nested too deeply".into());
    }
    Ok(match v {
        Value::Nil => msgpack::Value::Nil,
        Value::LightUserData(u) if u.0.is_null() => msgpack::Value::Nil,
        Value::Boolean(b) => msgpack::Value::Bool(*b),
        Value::Integer(i) => msgpack::Value::Int(*i),
        Value::Number(n) if n.fract() == 0.0 && n.abs() < 9.2e18 => msgpack::Value::Int(*n as i64),
        Value::Number(n) => msgpack::Value::Float(*n),
        Value::String(s) => msgpack::Value::Str(s.as_bytes().to_vec()),
        Value::Table(t) => match array_len(t) {
            Some(n) => {
                let mut items = Vec::with_capacity(n);
                for i in 1..=n {
                    let item: Value = t.raw_get(i).map_err(|e| e.to_string())?;
                    items.push(to_msgpack(&item, depth + 1)?);
                }
                msgpack::Value::Array(items)
            }
            None => {
                let mut pairs = Vec::new();
                for pair in t.clone().pairs::<Value, Value>() {
                    let (k, item) = pair.map_err(|e| e.to_string())?;
                    pairs.push((to_msgpack(&k, depth + 1)?, to_msgpack(&item, depth + 1)?));
                }
                msgpack::Value::Map(pairs)
            }
        },
        // Functions and other values pack as nil, as in Redis's cmsgpack.
        _ => msgpack::Value::Nil,
    })
}

fn from_msgpack(lua: &Lua, v: &msgpack::Value) -> mlua::Result<Value> {
    Ok(match v {
        msgpack::Value::Nil => Value::Nil,
        msgpack::Value::Bool(b) => Value::Boolean(*b),
        msgpack::Value::Int(i) => Value::Number(*i as f64),
        msgpack::Value::UInt(u) => Value::Number(*u as f64),
        msgpack::Value::Float(f) => Value::Number(*f),
        msgpack::Value::Str(s) => Value::String(lua.create_string(s)?),
        msgpack::Value::Array(items) => {
            let t = lua.create_table_with_capacity(items.len(), 0)?;
            for (i, item) in items.iter().enumerate() {
                t.raw_set(i + 1, from_msgpack(lua, item)?)?;
            }
            Value::Table(t)
        }
        msgpack::Value::Map(pairs) => {
            let t = lua.create_table_with_capacity(0, pairs.len())?;
            for (k, item) in pairs {
                let key = from_msgpack(lua, k)?;
                if key != Value::Nil {
                    t.raw_set(key, from_msgpack(lua, item)?)?;
                }
            }
            Value::Table(t)
        }
    })
}
