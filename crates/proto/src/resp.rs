//! RESP (the Redis serialization protocol), server side: a request decoder and a reply encoder.
//!
//! Requests arrive either as arrays of bulk strings (`*2\r\n$3\r\nGET\r\n$1\r\nk\r\n`, what every
//! client library sends) or as inline commands (`GET k\r\n`, what a person types into telnet).
//! [`RequestDecoder::decode`] looks at a byte buffer and either finds one complete request in it,
//! says that more bytes are needed, or reports a protocol error in Redis's own words. It never
//! allocates by a length read from the wire: bulk and array lengths are checked against
//! [`RequestLimits`] before anything else happens, and a bulk's bytes are only referenced, not copied.
//!
//! Replies are written by [`ReplyEncoder`], which knows the connection's protocol version (2 or 3)
//! and picks the RESP3 type or its RESP2 fallback (null, map, double, boolean, verbatim string).
//!
//! [`ReplyDecoder`] is the client side of replies, used by tests and benchmarks that speak RESP
//! without a client library.

use std::ops::Range;

/// Bounds on what one request may contain. Lengths beyond them are refused before any allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestLimits {
    /// Largest bulk string (one argument) in bytes.
    pub bulk_len_max: usize,
    /// Largest number of arguments in one request.
    pub array_len_max: usize,
    /// Largest inline command line in bytes (Redis: 64 KiB).
    pub inline_len_max: usize,
    /// Largest whole request (all arguments plus framing) in bytes.
    pub request_len_max: usize,
}

impl Default for RequestLimits {
    fn default() -> Self {
        RequestLimits {
            bulk_len_max: 512 * 1024 * 1024,
            array_len_max: 1024 * 1024,
            inline_len_max: 64 * 1024,
            request_len_max: 512 * 1024 * 1024,
        }
    }
}

/// A request that violates the protocol or a limit. The connection cannot be resynchronised after
/// one of these: the server answers with [`RespError::message`] and closes the connection, as Redis does.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RespError {
    #[error("Protocol error: invalid multibulk length")]
    InvalidMultibulkLength,
    #[error("Protocol error: invalid bulk length")]
    InvalidBulkLength,
    #[error("Protocol error: expected '$', got '{0}'")]
    ExpectedBulk(char),
    #[error("Protocol error: too big inline request")]
    InlineTooBig,
    #[error("Protocol error: too big mbulk count string")]
    MultibulkCountTooBig,
    #[error("Protocol error: too big bulk count string")]
    BulkCountTooBig,
    #[error("Protocol error: unbalanced quotes in request")]
    UnbalancedQuotes,
    #[error("Protocol error: request of {len} bytes exceeds the limit of {max} bytes")]
    RequestTooLarge { len: usize, max: usize },
}

impl RespError {
    /// The error line Redis sends before closing the connection (without the leading `-`).
    pub fn message(&self) -> String {
        format!("ERR {self}")
    }
}

/// The arguments of one decoded request.
#[derive(Debug, Default)]
pub struct Request {
    /// Multibulk requests: byte ranges of each argument inside the decoded buffer.
    spans: Vec<Range<usize>>,
    /// Inline requests: unquoted arguments, owned (quotes and escapes change the bytes).
    owned: Vec<Vec<u8>>,
    inline: bool,
    /// An incomplete multibulk request: its argument count and where its next argument starts.
    /// The arguments before it stay in `spans`, so that a large request arriving in many reads is
    /// not decoded again from its start on every read.
    resume: Option<(usize, usize)>,
}

impl Request {
    /// Number of arguments (0 for an empty inline line, which a server ignores).
    pub fn len(&self) -> usize {
        if self.inline {
            self.owned.len()
        } else {
            self.spans.len()
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether this request came as an inline command line.
    pub fn is_inline(&self) -> bool {
        self.inline
    }

    /// The arguments as slices; `buf` must be the buffer that was passed to `decode`.
    pub fn args<'a>(&'a self, buf: &'a [u8]) -> Vec<&'a [u8]> {
        if self.inline {
            self.owned.iter().map(|a| a.as_slice()).collect()
        } else {
            self.spans.iter().map(|r| &buf[r.clone()]).collect()
        }
    }

    /// The arguments of a request that came as a RESP array, as ranges of the buffer passed to
    /// `decode` (none for an inline command).
    pub fn spans(&self) -> &[std::ops::Range<usize>] {
        if self.inline {
            &[]
        } else {
            &self.spans
        }
    }

    /// Forgets the request, and the progress of an incomplete one: the next `decode` starts
    /// afresh, at whatever bytes it is given.
    pub fn clear(&mut self) {
        self.spans.clear();
        self.owned.clear();
        self.inline = false;
        self.resume = None;
    }
}

/// Decodes requests one at a time from the front of a buffer.
#[derive(Debug, Default)]
pub struct RequestDecoder {
    limits: RequestLimits,
}

impl RequestDecoder {
    pub fn new(limits: RequestLimits) -> Self {
        RequestDecoder { limits }
    }

    pub fn limits(&self) -> &RequestLimits {
        &self.limits
    }

    /// Decodes one request from the front of `buf` into `request`.
    ///
    /// Returns `Ok(Some(consumed))` when a whole request was found (its arguments are in `request`,
    /// as ranges of `buf[..consumed]`), `Ok(None)` when `buf` holds only part of one, and an error
    /// when the bytes can never become a valid request.
    ///
    /// After `Ok(None)`, the next call with the same `request` must pass the same bytes again
    /// (possibly followed by more): decoding resumes where it stopped.
    pub fn decode(&self, buf: &[u8], request: &mut Request) -> Result<Option<usize>, RespError> {
        if let Some((count, pos)) = request.resume.take() {
            if buf.first() == Some(&b'*') && pos <= buf.len() && request.spans.len() < count {
                return self.decode_bulks(buf, request, count, pos);
            }
        }
        request.clear();
        match buf.first() {
            None => Ok(None),
            Some(b'*') => self.decode_multibulk(buf, request),
            Some(_) => self.decode_inline(buf, request),
        }
    }

    fn decode_multibulk(
        &self,
        buf: &[u8],
        request: &mut Request,
    ) -> Result<Option<usize>, RespError> {
        debug_assert_eq!(buf.first(), Some(&b'*'));
        let Some(line_end) = find_crlf(buf, 1) else {
            if buf.len() > self.limits.inline_len_max {
                return Err(RespError::MultibulkCountTooBig);
            }
            return Ok(None);
        };
        let count = parse_len(&buf[1..line_end]).ok_or(RespError::InvalidMultibulkLength)?;
        if count > self.limits.array_len_max as i64 {
            return Err(RespError::InvalidMultibulkLength);
        }
        let pos = line_end + 2;
        if count <= 0 {
            // `*0` and `*-1` are empty requests that Redis skips.
            return Ok(Some(pos));
        }
        let count = count as usize;
        // Reserve only for what can be present in the buffer, never by the claimed count alone.
        request.spans.reserve(count.min(buf.len() / 4 + 1));
        self.decode_bulks(buf, request, count, pos)
    }

    /// Decodes the bulk strings of a multibulk request from `pos`, after `request.spans` already
    /// holds the ones before it.
    fn decode_bulks(
        &self,
        buf: &[u8],
        request: &mut Request,
        count: usize,
        mut pos: usize,
    ) -> Result<Option<usize>, RespError> {
        while request.spans.len() < count {
            let Some(&marker) = buf.get(pos) else {
                request.resume = Some((count, pos));
                return Ok(None);
            };
            if marker != b'$' {
                return Err(RespError::ExpectedBulk(marker as char));
            }
            let Some(len_end) = find_crlf(buf, pos + 1) else {
                if buf.len() - pos > 32 {
                    return Err(RespError::BulkCountTooBig);
                }
                request.resume = Some((count, pos));
                return Ok(None);
            };
            let len = parse_len(&buf[pos + 1..len_end]).ok_or(RespError::InvalidBulkLength)?;
            if len < 0 || len as u64 > self.limits.bulk_len_max as u64 {
                return Err(RespError::InvalidBulkLength);
            }
            let len = len as usize;
            let start = len_end + 2;
            let end = start + len;
            if end + 2 > self.limits.request_len_max {
                return Err(RespError::RequestTooLarge {
                    len: end + 2,
                    max: self.limits.request_len_max,
                });
            }
            if buf.len() < end + 2 {
                request.resume = Some((count, pos));
                return Ok(None);
            }
            if &buf[end..end + 2] != b"\r\n" {
                return Err(RespError::InvalidBulkLength);
            }
            request.spans.push(start..end);
            pos = end + 2;
        }
        debug_assert_eq!(request.spans.len(), count);
        Ok(Some(pos))
    }

    fn decode_inline(&self, buf: &[u8], request: &mut Request) -> Result<Option<usize>, RespError> {
        let Some(newline) = buf.iter().position(|&b| b == b'\n') else {
            if buf.len() > self.limits.inline_len_max {
                return Err(RespError::InlineTooBig);
            }
            return Ok(None);
        };
        if newline > self.limits.inline_len_max {
            return Err(RespError::InlineTooBig);
        }
        let mut line = &buf[..newline];
        if line.last() == Some(&b'\r') {
            line = &line[..line.len() - 1];
        }
        request.inline = true;
        split_inline_args(line, &mut request.owned)?;
        if request.owned.len() > self.limits.array_len_max {
            return Err(RespError::InvalidMultibulkLength);
        }
        Ok(Some(newline + 1))
    }
}

fn find_crlf(buf: &[u8], from: usize) -> Option<usize> {
    if from >= buf.len() {
        return None;
    }
    let rel = buf[from..].iter().position(|&b| b == b'\r')?;
    let at = from + rel;
    match buf.get(at + 1) {
        Some(b'\n') => Some(at),
        Some(_) => Some(at), // a lone '\r' in a length line: the length fails to parse below
        None => None,
    }
}

/// Parses a signed decimal length (`-1`, `0`, `123`); at most 19 digits, no '+', no spaces.
fn parse_len(digits: &[u8]) -> Option<i64> {
    let (negative, digits) = match digits.first() {
        Some(b'-') => (true, &digits[1..]),
        _ => (false, digits),
    };
    if digits.is_empty() || digits.len() > 18 {
        return None;
    }
    let mut value: i64 = 0;
    for &d in digits {
        if !d.is_ascii_digit() {
            return None;
        }
        value = value * 10 + i64::from(d - b'0');
    }
    Some(if negative { -value } else { value })
}

/// Splits an inline command line the way Redis's `sdssplitargs` does: blanks separate arguments,
/// "double quotes" take C escapes (`\n`, `\xff`, ...), 'single quotes' take only `\'`.
pub fn split_inline_args(line: &[u8], out: &mut Vec<Vec<u8>>) -> Result<(), RespError> {
    let mut i = 0;
    let n = line.len();
    loop {
        while i < n && is_blank(line[i]) {
            i += 1;
        }
        if i >= n {
            return Ok(());
        }
        let mut arg = Vec::new();
        let mut in_double = false;
        let mut in_single = false;
        loop {
            if in_double {
                if i >= n {
                    return Err(RespError::UnbalancedQuotes);
                }
                let c = line[i];
                if c == b'\\'
                    && i + 3 < n
                    && line[i + 1] == b'x'
                    && is_hex(line[i + 2])
                    && is_hex(line[i + 3])
                {
                    arg.push(hex_value(line[i + 2]) * 16 + hex_value(line[i + 3]));
                    i += 4;
                    continue;
                } else if c == b'\\' && i + 1 < n {
                    let escaped = match line[i + 1] {
                        b'n' => b'\n',
                        b'r' => b'\r',
                        b't' => b'\t',
                        b'b' => 0x08,
                        b'a' => 0x07,
                        other => other,
                    };
                    arg.push(escaped);
                    i += 2;
                    continue;
                } else if c == b'"' {
                    // The closing quote must be followed by a blank or the end.
                    if i + 1 < n && !is_blank(line[i + 1]) {
                        return Err(RespError::UnbalancedQuotes);
                    }
                    i += 1;
                    break;
                }
                arg.push(c);
                i += 1;
            } else if in_single {
                if i >= n {
                    return Err(RespError::UnbalancedQuotes);
                }
                let c = line[i];
                if c == b'\\' && i + 1 < n && line[i + 1] == b'\'' {
                    arg.push(b'\'');
                    i += 2;
                    continue;
                } else if c == b'\'' {
                    if i + 1 < n && !is_blank(line[i + 1]) {
                        return Err(RespError::UnbalancedQuotes);
                    }
                    i += 1;
                    break;
                }
                arg.push(c);
                i += 1;
            } else {
                if i >= n {
                    break;
                }
                match line[i] {
                    c if is_blank(c) => break,
                    b'"' => in_double = true,
                    b'\'' => in_single = true,
                    c => arg.push(c),
                }
                i += 1;
            }
        }
        out.push(arg);
    }
}

fn is_blank(c: u8) -> bool {
    matches!(c, b' ' | b'\n' | b'\r' | b'\t' | 0)
}

fn is_hex(c: u8) -> bool {
    c.is_ascii_hexdigit()
}

fn hex_value(c: u8) -> u8 {
    match c {
        b'0'..=b'9' => c - b'0',
        b'a'..=b'f' => c - b'a' + 10,
        b'A'..=b'F' => c - b'A' + 10,
        _ => 0,
    }
}

/// Writes replies in RESP2 or RESP3 into a byte buffer.
///
/// Types that RESP2 lacks fall back as Redis does: null → `$-1`, map → flat array, double → bulk
/// string, boolean → integer, verbatim string → bulk string, set → array.
#[derive(Debug)]
pub struct ReplyEncoder<'a> {
    out: &'a mut Vec<u8>,
    protocol: u8,
}

impl<'a> ReplyEncoder<'a> {
    /// `protocol` is 2 or 3.
    pub fn new(out: &'a mut Vec<u8>, protocol: u8) -> Self {
        debug_assert!(protocol == 2 || protocol == 3);
        ReplyEncoder { out, protocol }
    }

    pub fn protocol(&self) -> u8 {
        self.protocol
    }

    /// The buffer replies are appended to (to nest replies written by other code, as EXEC does).
    pub fn buffer(&mut self) -> &mut Vec<u8> {
        self.out
    }

    /// Switches the protocol for the replies that follow (HELLO answers in the version it selects).
    pub fn set_protocol(&mut self, protocol: u8) {
        debug_assert!(protocol == 2 || protocol == 3);
        self.protocol = protocol;
    }

    pub fn resp3(&self) -> bool {
        self.protocol >= 3
    }

    /// `+text`; CR and LF in `text` become spaces so that the frame stays one line.
    pub fn simple(&mut self, text: &str) {
        self.out.push(b'+');
        push_line_safe(self.out, text.as_bytes());
        self.out.extend_from_slice(b"\r\n");
    }

    pub fn ok(&mut self) {
        self.out.extend_from_slice(b"+OK\r\n");
    }

    /// `-message`; the message starts with its code (`ERR ...`, `WRONGPASS ...`).
    pub fn error(&mut self, message: &str) {
        self.out.push(b'-');
        push_line_safe(self.out, message.as_bytes());
        self.out.extend_from_slice(b"\r\n");
    }

    pub fn integer(&mut self, value: i64) {
        self.out.push(b':');
        push_decimal(self.out, value);
        self.out.extend_from_slice(b"\r\n");
    }

    pub fn bulk(&mut self, data: &[u8]) {
        self.out.push(b'$');
        push_decimal(self.out, data.len() as i64);
        self.out.extend_from_slice(b"\r\n");
        self.out.extend_from_slice(data);
        self.out.extend_from_slice(b"\r\n");
    }

    /// A bulk string, or null for `None`.
    pub fn bulk_or_null(&mut self, data: Option<&[u8]>) {
        match data {
            Some(d) => self.bulk(d),
            None => self.null(),
        }
    }

    /// The null reply: `_` in RESP3, the null bulk string `$-1` in RESP2.
    pub fn null(&mut self) {
        if self.resp3() {
            self.out.extend_from_slice(b"_\r\n");
        } else {
            self.out.extend_from_slice(b"$-1\r\n");
        }
    }

    /// The null array: `_` in RESP3, `*-1` in RESP2.
    pub fn null_array(&mut self) {
        if self.resp3() {
            self.out.extend_from_slice(b"_\r\n");
        } else {
            self.out.extend_from_slice(b"*-1\r\n");
        }
    }

    pub fn array(&mut self, len: usize) {
        self.header(b'*', len);
    }

    /// A set header (`~` in RESP3, an array in RESP2).
    pub fn set(&mut self, len: usize) {
        self.header(if self.resp3() { b'~' } else { b'*' }, len);
    }

    /// A map of `pairs` entries: `%n` in RESP3, an array of 2n in RESP2. Write key, value, key, value...
    pub fn map(&mut self, pairs: usize) {
        if self.resp3() {
            self.header(b'%', pairs);
        } else {
            self.header(b'*', pairs * 2);
        }
    }

    pub fn boolean(&mut self, value: bool) {
        if self.resp3() {
            self.out
                .extend_from_slice(if value { b"#t\r\n" } else { b"#f\r\n" });
        } else {
            self.integer(i64::from(value));
        }
    }

    pub fn double(&mut self, value: f64) {
        let text = format_double(value);
        if self.resp3() {
            self.out.push(b',');
            self.out.extend_from_slice(text.as_bytes());
            self.out.extend_from_slice(b"\r\n");
        } else {
            self.bulk(text.as_bytes());
        }
    }

    /// A verbatim string (`=len\r\ntxt:...` in RESP3, a bulk string in RESP2); `format` is 3 bytes.
    pub fn verbatim(&mut self, format: &str, text: &[u8]) {
        debug_assert_eq!(format.len(), 3);
        if self.resp3() {
            self.out.push(b'=');
            push_decimal(self.out, (text.len() + 4) as i64);
            self.out.extend_from_slice(b"\r\n");
            self.out.extend_from_slice(format.as_bytes());
            self.out.push(b':');
            self.out.extend_from_slice(text);
            self.out.extend_from_slice(b"\r\n");
        } else {
            self.bulk(text);
        }
    }

    fn header(&mut self, marker: u8, len: usize) {
        self.out.push(marker);
        push_decimal(self.out, len as i64);
        self.out.extend_from_slice(b"\r\n");
    }
}

fn format_double(value: f64) -> String {
    if value.is_infinite() {
        if value > 0.0 {
            "inf".into()
        } else {
            "-inf".into()
        }
    } else if value.is_nan() {
        "nan".into()
    } else {
        // The shortest digits that read back as `value`, laid out as C's `%.17g` lays them
        // out (Redis 7.2's fpconv): an exponent below -4 or from 17 up is written `d.ddde+XX`.
        let sci = format!("{value:e}");
        let (mantissa, exp) = sci.split_once('e').expect("{:e} writes an exponent");
        let exp: i32 = exp.parse().expect("a decimal exponent");
        if (-4..17).contains(&exp) {
            format!("{value}")
        } else {
            let sign = if exp < 0 { '-' } else { '+' };
            format!("{mantissa}e{sign}{:02}", exp.unsigned_abs())
        }
    }
}

#[cfg(test)]
mod double_tests {
    #[test]
    fn doubles_are_written_as_redis_writes_them() {
        for (v, text) in [
            (1e20, "1e+20"),
            (1e17, "1e+17"),
            (1e16, "10000000000000000"),
            (123456789012345678.0, "1.2345678901234568e+17"),
            (0.1, "0.1"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (-1.5e-7, "-1.5e-07"),
            (f64::MAX, "1.7976931348623157e+308"),
            (3.0, "3"),
            (-2.5, "-2.5"),
            (0.0, "0"),
        ] {
            assert_eq!(super::format_double(v), text);
        }
    }
}

fn push_line_safe(out: &mut Vec<u8>, text: &[u8]) {
    out.extend(
        text.iter()
            .map(|&b| if b == b'\r' || b == b'\n' { b' ' } else { b }),
    );
}

/// Appends the decimal form of `value` without allocating.
pub fn push_decimal(out: &mut Vec<u8>, value: i64) {
    let mut digits = [0u8; 20];
    let mut n = value.unsigned_abs();
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    if value < 0 {
        out.push(b'-');
    }
    out.extend_from_slice(&digits[i..]);
}

/// A decoded reply (client side).
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    Simple(String),
    Error(String),
    Integer(i64),
    Bulk(Vec<u8>),
    Null,
    Array(Vec<Reply>),
    Map(Vec<(Reply, Reply)>),
    Set(Vec<Reply>),
    Boolean(bool),
    Double(String),
    Verbatim(String, Vec<u8>),
    BigNumber(String),
    Push(Vec<Reply>),
}

/// Why a reply could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReplyError {
    #[error("unknown reply type byte {0:#04x}")]
    UnknownType(u8),
    #[error("invalid length or number in reply")]
    InvalidNumber,
    #[error("reply nested deeper than {0} levels")]
    TooDeep(usize),
    #[error("reply element of {len} bytes exceeds the limit of {max}")]
    TooLarge { len: usize, max: usize },
    #[error("malformed reply framing")]
    Framing,
}

/// Decodes replies (RESP2 and RESP3) from the front of a buffer, with bounds on sizes and depth.
#[derive(Debug, Clone, Copy)]
pub struct ReplyDecoder {
    pub bulk_len_max: usize,
    pub aggregate_len_max: usize,
    pub depth_max: usize,
}

impl Default for ReplyDecoder {
    fn default() -> Self {
        ReplyDecoder {
            bulk_len_max: 512 * 1024 * 1024,
            aggregate_len_max: 1 << 24,
            depth_max: 32,
        }
    }
}

impl ReplyDecoder {
    /// Returns the reply and the bytes it took, or `None` if `buf` holds only part of one.
    pub fn decode(&self, buf: &[u8]) -> Result<Option<(Reply, usize)>, ReplyError> {
        self.decode_at(buf, 0, 0)
    }

    fn decode_at(
        &self,
        buf: &[u8],
        pos: usize,
        depth: usize,
    ) -> Result<Option<(Reply, usize)>, ReplyError> {
        if depth > self.depth_max {
            return Err(ReplyError::TooDeep(self.depth_max));
        }
        let Some(&marker) = buf.get(pos) else {
            return Ok(None);
        };
        let Some(line_end) = find_line(buf, pos + 1) else {
            return Ok(None);
        };
        let line = &buf[pos + 1..line_end];
        let next = line_end + 2;
        let text = || String::from_utf8_lossy(line).into_owned();
        match marker {
            b'+' => Ok(Some((Reply::Simple(text()), next))),
            b'-' => Ok(Some((Reply::Error(text()), next))),
            b':' => {
                let v = std::str::from_utf8(line)
                    .ok()
                    .and_then(|s| s.parse().ok())
                    .ok_or(ReplyError::InvalidNumber)?;
                Ok(Some((Reply::Integer(v), next)))
            }
            b',' => Ok(Some((Reply::Double(text()), next))),
            b'(' => Ok(Some((Reply::BigNumber(text()), next))),
            b'_' => Ok(Some((Reply::Null, next))),
            b'#' => match line {
                b"t" => Ok(Some((Reply::Boolean(true), next))),
                b"f" => Ok(Some((Reply::Boolean(false), next))),
                _ => Err(ReplyError::Framing),
            },
            b'$' | b'=' | b'!' => {
                let len = parse_len(line).ok_or(ReplyError::InvalidNumber)?;
                if len < 0 {
                    return Ok(Some((Reply::Null, next)));
                }
                let len = len as usize;
                if len > self.bulk_len_max {
                    return Err(ReplyError::TooLarge {
                        len,
                        max: self.bulk_len_max,
                    });
                }
                if buf.len() < next + len + 2 {
                    return Ok(None);
                }
                if &buf[next + len..next + len + 2] != b"\r\n" {
                    return Err(ReplyError::Framing);
                }
                let data = buf[next..next + len].to_vec();
                let reply = match marker {
                    b'$' => Reply::Bulk(data),
                    b'!' => Reply::Error(String::from_utf8_lossy(&data).into_owned()),
                    _ => {
                        if data.len() < 4 || data[3] != b':' {
                            return Err(ReplyError::Framing);
                        }
                        Reply::Verbatim(
                            String::from_utf8_lossy(&data[..3]).into_owned(),
                            data[4..].to_vec(),
                        )
                    }
                };
                Ok(Some((reply, next + len + 2)))
            }
            b'*' | b'~' | b'>' | b'%' => {
                let len = parse_len(line).ok_or(ReplyError::InvalidNumber)?;
                if len < 0 {
                    return Ok(Some((Reply::Null, next)));
                }
                let len = len as usize;
                if len > self.aggregate_len_max {
                    return Err(ReplyError::TooLarge {
                        len,
                        max: self.aggregate_len_max,
                    });
                }
                let elements = if marker == b'%' { len * 2 } else { len };
                let mut items = Vec::with_capacity(elements.min(buf.len() - next));
                let mut at = next;
                for _ in 0..elements {
                    match self.decode_at(buf, at, depth + 1)? {
                        Some((item, after)) => {
                            items.push(item);
                            at = after;
                        }
                        None => return Ok(None),
                    }
                }
                let reply = match marker {
                    b'*' => Reply::Array(items),
                    b'~' => Reply::Set(items),
                    b'>' => Reply::Push(items),
                    _ => {
                        let mut pairs = Vec::with_capacity(len);
                        let mut it = items.into_iter();
                        while let (Some(k), Some(v)) = (it.next(), it.next()) {
                            pairs.push((k, v));
                        }
                        Reply::Map(pairs)
                    }
                };
                Ok(Some((reply, at)))
            }
            other => Err(ReplyError::UnknownType(other)),
        }
    }
}

fn find_line(buf: &[u8], from: usize) -> Option<usize> {
    if from > buf.len() {
        return None;
    }
    let rel = buf[from..].windows(2).position(|w| w == b"\r\n")?;
    Some(from + rel)
}

/// Encodes a command as a RESP array of bulk strings (what clients send).
pub fn encode_command(out: &mut Vec<u8>, args: &[&[u8]]) {
    out.push(b'*');
    push_decimal(out, args.len() as i64);
    out.extend_from_slice(b"\r\n");
    for arg in args {
        out.push(b'$');
        push_decimal(out, arg.len() as i64);
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(arg);
        out.extend_from_slice(b"\r\n");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn decode_all(buf: &[u8]) -> Result<Vec<Vec<Vec<u8>>>, RespError> {
        let decoder = RequestDecoder::default();
        let mut request = Request::default();
        let mut pos = 0;
        let mut out = Vec::new();
        while let Some(n) = decoder.decode(&buf[pos..], &mut request)? {
            let args = request
                .args(&buf[pos..])
                .into_iter()
                .map(|a| a.to_vec())
                .collect::<Vec<_>>();
            out.push(args);
            pos += n;
        }
        Ok(out)
    }

    #[test]
    fn multibulk_request() {
        let got = decode_all(b"*2\r\n$3\r\nGET\r\n$3\r\nfoo\r\n*1\r\n$4\r\nPING\r\n").unwrap();
        assert_eq!(
            got,
            vec![
                vec![b"GET".to_vec(), b"foo".to_vec()],
                vec![b"PING".to_vec()]
            ]
        );
    }

    #[test]
    fn binary_safe_bulk() {
        let got = decode_all(b"*1\r\n$4\r\na\r\nb\r\n").unwrap();
        assert_eq!(got, vec![vec![b"a\r\nb".to_vec()]]);
    }

    #[test]
    fn every_prefix_is_incomplete() {
        let full = b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$5\r\nhello\r\n";
        let decoder = RequestDecoder::default();
        let mut request = Request::default();
        for cut in 0..full.len() {
            assert_eq!(
                decoder.decode(&full[..cut], &mut request),
                Ok(None),
                "prefix {cut}"
            );
        }
        assert_eq!(decoder.decode(full, &mut request), Ok(Some(full.len())));
        assert_eq!(request.args(full), vec![&b"SET"[..], b"k", b"hello"]);
    }

    #[test]
    fn inline_requests_and_quotes() {
        let got = decode_all(b"set k \"a b\\x41\\n\" 'it\\'s'\r\nPING\n\r\n").unwrap();
        assert_eq!(
            got,
            vec![
                vec![
                    b"set".to_vec(),
                    b"k".to_vec(),
                    b"a bA\n".to_vec(),
                    b"it's".to_vec()
                ],
                vec![b"PING".to_vec()],
                vec![],
            ]
        );
        assert_eq!(
            decode_all(b"get \"abc\r\n"),
            Err(RespError::UnbalancedQuotes)
        );
        assert_eq!(
            decode_all(b"get \"abc\"x\r\n"),
            Err(RespError::UnbalancedQuotes)
        );
    }

    #[test]
    fn absurd_lengths_are_refused_before_allocation() {
        let limits = RequestLimits {
            bulk_len_max: 1024,
            array_len_max: 16,
            inline_len_max: 64,
            request_len_max: 3000,
        };
        let decoder = RequestDecoder::new(limits);
        let mut request = Request::default();
        assert_eq!(
            decoder.decode(b"*17\r\n", &mut request),
            Err(RespError::InvalidMultibulkLength)
        );
        assert_eq!(
            decoder.decode(b"*99999999999999999999\r\n", &mut request),
            Err(RespError::InvalidMultibulkLength)
        );
        assert_eq!(
            decoder.decode(b"*1\r\n$1025\r\n", &mut request),
            Err(RespError::InvalidBulkLength)
        );
        assert_eq!(
            decoder.decode(b"*1\r\n$-5\r\n", &mut request),
            Err(RespError::InvalidBulkLength)
        );
        assert_eq!(
            decoder.decode(b"*1\r\n$abc\r\n", &mut request),
            Err(RespError::InvalidBulkLength)
        );
        assert_eq!(
            decoder.decode(b"*1\r\n:12\r\n", &mut request),
            Err(RespError::ExpectedBulk(':'))
        );
        assert_eq!(
            decoder.decode(&[b'x'; 100], &mut request),
            Err(RespError::InlineTooBig)
        );
        let big = b"*4\r\n$1000\r\n";
        assert_eq!(decoder.decode(big, &mut request), Ok(None));
        let mut many = b"*4\r\n".to_vec();
        for _ in 0..4 {
            many.extend_from_slice(b"$1000\r\n");
            many.extend_from_slice(&[b'a'; 1000]);
            many.extend_from_slice(b"\r\n");
        }
        assert!(matches!(
            decoder.decode(&many, &mut request),
            Err(RespError::RequestTooLarge { .. })
        ));
    }

    #[test]
    fn bad_bulk_terminator_is_an_error() {
        assert_eq!(
            decode_all(b"*1\r\n$3\r\nabcXY"),
            Err(RespError::InvalidBulkLength)
        );
    }

    #[test]
    fn empty_multibulk_is_skipped() {
        let decoder = RequestDecoder::default();
        let mut request = Request::default();
        assert_eq!(decoder.decode(b"*0\r\n", &mut request), Ok(Some(4)));
        assert!(request.is_empty());
    }

    #[test]
    fn error_messages_match_redis() {
        assert_eq!(
            RespError::InvalidBulkLength.message(),
            "ERR Protocol error: invalid bulk length"
        );
        assert_eq!(
            RespError::ExpectedBulk('x').message(),
            "ERR Protocol error: expected '$', got 'x'"
        );
    }

    #[test]
    fn encoder_resp2_and_resp3() {
        let mut out = Vec::new();
        let mut e = ReplyEncoder::new(&mut out, 2);
        e.ok();
        e.null();
        e.map(1);
        e.bulk(b"k");
        e.integer(-42);
        e.boolean(true);
        e.double(1.5);
        e.error("ERR bad\r\nthing");
        assert_eq!(
            out,
            b"+OK\r\n$-1\r\n*2\r\n$1\r\nk\r\n:-42\r\n:1\r\n$3\r\n1.5\r\n-ERR bad  thing\r\n"
                .to_vec()
        );
        let mut out = Vec::new();
        let mut e = ReplyEncoder::new(&mut out, 3);
        e.null();
        e.map(1);
        e.boolean(false);
        e.double(f64::INFINITY);
        e.verbatim("txt", b"hi");
        assert_eq!(out, b"_\r\n%1\r\n#f\r\n,inf\r\n=6\r\ntxt:hi\r\n".to_vec());
    }

    #[test]
    fn reply_decoder_round_trip() {
        let mut out = Vec::new();
        let mut e = ReplyEncoder::new(&mut out, 3);
        e.map(2);
        e.simple("a");
        e.array(2);
        e.integer(1);
        e.bulk(b"x\r\ny");
        e.bulk(b"b");
        e.null();
        let (reply, used) = ReplyDecoder::default().decode(&out).unwrap().unwrap();
        assert_eq!(used, out.len());
        assert_eq!(
            reply,
            Reply::Map(vec![
                (
                    Reply::Simple("a".into()),
                    Reply::Array(vec![Reply::Integer(1), Reply::Bulk(b"x\r\ny".to_vec())])
                ),
                (Reply::Bulk(b"b".to_vec()), Reply::Null),
            ])
        );
        for cut in 0..out.len() {
            assert_eq!(ReplyDecoder::default().decode(&out[..cut]), Ok(None));
        }
    }

    #[test]
    fn push_decimal_extremes() {
        for v in [0, 1, -1, 9, 10, i64::MAX, i64::MIN] {
            let mut out = Vec::new();
            push_decimal(&mut out, v);
            assert_eq!(out, v.to_string().into_bytes());
        }
    }

    fn arb_args() -> impl Strategy<Value = Vec<Vec<u8>>> {
        prop::collection::vec(prop::collection::vec(any::<u8>(), 0..40), 1..8)
    }

    proptest! {
        /// Random bytes never panic the decoders, and whatever is decoded lies inside the input.
        #[test]
        fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
            let decoder = RequestDecoder::new(RequestLimits { bulk_len_max: 256, array_len_max: 64, inline_len_max: 128, request_len_max: 1024 });
            let mut request = Request::default();
            let mut pos = 0;
            while pos < bytes.len() {
                match decoder.decode(&bytes[pos..], &mut request) {
                    Ok(Some(n)) => {
                        prop_assert!(n > 0 && pos + n <= bytes.len());
                        for arg in request.args(&bytes[pos..]) {
                            prop_assert!(arg.len() <= bytes.len());
                        }
                        pos += n;
                    }
                    Ok(None) | Err(_) => break,
                }
            }
            let _ = ReplyDecoder { bulk_len_max: 256, aggregate_len_max: 64, depth_max: 8 }.decode(&bytes);
        }

        /// Encoded commands decode to the same arguments, also when mutated bytes follow them.
        #[test]
        fn encode_decode_round_trip(commands in prop::collection::vec(arb_args(), 1..6), tail in prop::collection::vec(any::<u8>(), 0..64)) {
            let mut buf = Vec::new();
            for c in &commands {
                let refs: Vec<&[u8]> = c.iter().map(|a| a.as_slice()).collect();
                encode_command(&mut buf, &refs);
            }
            let encoded_len = buf.len();
            buf.extend_from_slice(&tail);
            let decoder = RequestDecoder::default();
            let mut request = Request::default();
            let mut pos = 0;
            for c in &commands {
                let n = decoder.decode(&buf[pos..], &mut request).unwrap().unwrap();
                let args: Vec<Vec<u8>> = request.args(&buf[pos..]).into_iter().map(|a| a.to_vec()).collect();
                prop_assert_eq!(&args, c);
                pos += n;
            }
            prop_assert_eq!(pos, encoded_len);
        }

        /// Feeding a stream in random chunks (resuming partial requests) gives the same requests as
        /// feeding it whole.
        #[test]
        fn chunked_feeding_matches_whole(commands in prop::collection::vec(arb_args(), 1..6), cuts in prop::collection::vec(1usize..64, 1..40)) {
            let mut stream = Vec::new();
            for c in &commands {
                let refs: Vec<&[u8]> = c.iter().map(|a| a.as_slice()).collect();
                encode_command(&mut stream, &refs);
            }
            let decoder = RequestDecoder::default();
            let mut request = Request::default();
            let mut buf: Vec<u8> = Vec::new();
            let mut fed = 0;
            let mut got = Vec::new();
            let mut cut = cuts.iter().cycle();
            while fed < stream.len() {
                let n = (*cut.next().unwrap()).min(stream.len() - fed);
                buf.extend_from_slice(&stream[fed..fed + n]);
                fed += n;
                let mut pos = 0;
                while let Some(used) = decoder.decode(&buf[pos..], &mut request).unwrap() {
                    got.push(request.args(&buf[pos..]).into_iter().map(|a| a.to_vec()).collect::<Vec<_>>());
                    pos += used;
                }
                buf.drain(..pos);
            }
            prop_assert!(buf.is_empty());
            prop_assert_eq!(got, commands);
        }

        /// Mutating one byte of a valid stream yields an error, a partial result or other commands, never a panic.
        #[test]
        fn mutated_stream_never_panics(commands in prop::collection::vec(arb_args(), 1..4), at in any::<usize>(), byte in any::<u8>()) {
            let mut buf = Vec::new();
            for c in &commands {
                let refs: Vec<&[u8]> = c.iter().map(|a| a.as_slice()).collect();
                encode_command(&mut buf, &refs);
            }
            let i = at % buf.len();
            buf[i] = byte;
            let decoder = RequestDecoder::default();
            let mut request = Request::default();
            let mut pos = 0;
            while pos < buf.len() {
                match decoder.decode(&buf[pos..], &mut request) {
                    Ok(Some(n)) => pos += n,
                    _ => break,
                }
            }
        }
    }
}
