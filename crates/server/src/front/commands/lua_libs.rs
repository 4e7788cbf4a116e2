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
    install_bit(lua)
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
