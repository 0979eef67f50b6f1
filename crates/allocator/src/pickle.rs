//! A small writer of Python pickles (protocol 2): dictionaries, lists, tuples, strings,
//! integers, floats, booleans and `None` — what a memory snapshot holds, so that Python's
//! `pickle.load` (and PyTorch's `torch.cuda._memory_viz`) reads our snapshots.

/// A Python value.
#[derive(Clone, Debug, PartialEq)]
pub enum PyValue {
    /// `None`.
    None,
    /// `True` / `False`.
    Bool(bool),
    /// An `int` (any value of `i128`).
    Int(i128),
    /// A `float`.
    Float(f64),
    /// A `str`.
    Str(String),
    /// A `list`.
    List(Vec<PyValue>),
    /// A `tuple`.
    Tuple(Vec<PyValue>),
    /// A `dict` with string keys, in insertion order.
    Dict(Vec<(String, PyValue)>),
}

impl From<&str> for PyValue {
    fn from(s: &str) -> Self {
        PyValue::Str(s.to_string())
    }
}

impl From<String> for PyValue {
    fn from(s: String) -> Self {
        PyValue::Str(s)
    }
}

impl From<u64> for PyValue {
    fn from(v: u64) -> Self {
        PyValue::Int(v.into())
    }
}

impl From<i64> for PyValue {
    fn from(v: i64) -> Self {
        PyValue::Int(v.into())
    }
}

impl From<bool> for PyValue {
    fn from(v: bool) -> Self {
        PyValue::Bool(v)
    }
}

/// Opcodes of the pickle protocol (Python's `pickletools`).
mod op {
    pub const PROTO: u8 = 0x80;
    pub const STOP: u8 = b'.';
    pub const NONE: u8 = b'N';
    pub const NEWTRUE: u8 = 0x88;
    pub const NEWFALSE: u8 = 0x89;
    pub const BININT: u8 = b'J';
    pub const LONG1: u8 = 0x8a;
    pub const BINFLOAT: u8 = b'G';
    pub const BINUNICODE: u8 = b'X';
    pub const EMPTY_LIST: u8 = b']';
    pub const EMPTY_DICT: u8 = b'}';
    pub const MARK: u8 = b'(';
    pub const APPENDS: u8 = b'e';
    pub const SETITEMS: u8 = b'u';
    pub const TUPLE: u8 = b't';
    pub const EMPTY_TUPLE: u8 = b')';
}

/// The pickle (protocol 2) of `value`.
pub fn to_pickle(value: &PyValue) -> Vec<u8> {
    let mut out = vec![op::PROTO, 2];
    write(&mut out, value);
    out.push(op::STOP);
    out
}

fn write_str(out: &mut Vec<u8>, s: &str) {
    out.push(op::BINUNICODE);
    // A str longer than 4 GiB cannot be pickled with BINUNICODE; snapshot strings are short.
    let len = u32::try_from(s.len()).unwrap_or(u32::MAX);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&s.as_bytes()[..len as usize]);
}

fn write(out: &mut Vec<u8>, value: &PyValue) {
    match value {
        PyValue::None => out.push(op::NONE),
        PyValue::Bool(true) => out.push(op::NEWTRUE),
        PyValue::Bool(false) => out.push(op::NEWFALSE),
        PyValue::Int(v) => match i32::try_from(*v) {
            Ok(small) => {
                out.push(op::BININT);
                out.extend_from_slice(&small.to_le_bytes());
            }
            Err(_) => {
                // LONG1: little-endian two's complement, as few bytes as keep the sign.
                let bytes = v.to_le_bytes();
                let mut n = bytes.len();
                while n > 1 {
                    let (top, next) = (bytes[n - 1], bytes[n - 2]);
                    let redundant =
                        (top == 0 && next & 0x80 == 0) || (top == 0xff && next & 0x80 != 0);
                    if !redundant {
                        break;
                    }
                    n -= 1;
                }
                out.push(op::LONG1);
                out.push(n as u8);
                out.extend_from_slice(&bytes[..n]);
            }
        },
        PyValue::Float(f) => {
            out.push(op::BINFLOAT);
            out.extend_from_slice(&f.to_be_bytes());
        }
        PyValue::Str(s) => write_str(out, s),
        PyValue::List(items) => {
            out.push(op::EMPTY_LIST);
            if !items.is_empty() {
                out.push(op::MARK);
                for item in items {
                    write(out, item);
                }
                out.push(op::APPENDS);
            }
        }
        PyValue::Tuple(items) => {
            if items.is_empty() {
                out.push(op::EMPTY_TUPLE);
            } else {
                out.push(op::MARK);
                for item in items {
                    write(out, item);
                }
                out.push(op::TUPLE);
            }
        }
        PyValue::Dict(entries) => {
            out.push(op::EMPTY_DICT);
            if !entries.is_empty() {
                out.push(op::MARK);
                for (k, v) in entries {
                    write_str(out, k);
                    write(out, v);
                }
                out.push(op::SETITEMS);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opcodes_match_pythons_own_pickles() {
        // The opcodes as Python's `pickletools` documents them (tests/history.rs loads whole
        // snapshots with python3's `pickle`).
        assert_eq!(to_pickle(&PyValue::None), b"\x80\x02N.");
        assert_eq!(to_pickle(&PyValue::Int(1)), b"\x80\x02J\x01\x00\x00\x00.");
        assert_eq!(
            to_pickle(&PyValue::Int(1 << 40)),
            b"\x80\x02\x8a\x06\x00\x00\x00\x00\x00\x01."
        );
        assert_eq!(
            to_pickle(&PyValue::Int(-(1 << 40))),
            b"\x80\x02\x8a\x06\x00\x00\x00\x00\x00\xff."
        );
        assert_eq!(
            to_pickle(&PyValue::Int(1 << 31)),
            b"\x80\x02\x8a\x05\x00\x00\x00\x80\x00."
        );
        assert_eq!(
            to_pickle(&PyValue::Int(u64::MAX.into())),
            b"\x80\x02\x8a\x09\xff\xff\xff\xff\xff\xff\xff\xff\x00."
        );
        assert_eq!(
            to_pickle(&PyValue::Float(1.5)),
            b"\x80\x02G?\xf8\x00\x00\x00\x00\x00\x00."
        );
        assert_eq!(to_pickle(&"ab".into()), b"\x80\x02X\x02\x00\x00\x00ab.");
        assert_eq!(
            to_pickle(&PyValue::Dict(vec![(
                "a".into(),
                PyValue::List(vec![true.into()])
            )])),
            b"\x80\x02}(X\x01\x00\x00\x00a](\x88eu."
        );
        assert_eq!(
            to_pickle(&PyValue::Tuple(vec![PyValue::Int(0), PyValue::Int(0)])),
            b"\x80\x02(J\x00\x00\x00\x00J\x00\x00\x00\x00t."
        );
    }
}
