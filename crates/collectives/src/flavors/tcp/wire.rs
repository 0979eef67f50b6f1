//! What goes over the sockets: the connection handshake, the frame header, and the little-endian
//! writer and reader that call descriptions ([`OpDesc`](crate::flavors::desc::OpDesc)) use too.
//!
//! Every integer of the protocol itself (handshake fields, frame headers, descriptions) is
//! little-endian. Element data is sent in the machine's native byte order, which is
//! little-endian on every platform this crate supports; the handshake carries a byte-order probe
//! and the element sizes, and refuses a peer that differs, so that elements are never
//! misread.

use std::io::{self, Read, Write};
use std::sync::{Arc, Mutex};

/// First bytes of every connection.
pub(crate) const MAGIC: [u8; 8] = *b"FSDPTCP\x01";
/// Protocol version.
pub(crate) const VERSION: u32 = 1;
/// Written in native order: a peer of the other byte order reads it reversed.
const ENDIAN_PROBE: u32 = 0x0102_0304;

/// Frame kinds.
pub(crate) const KIND_DESC: u8 = 1;
pub(crate) const KIND_DATA: u8 = 2;
pub(crate) const KIND_ABORT: u8 = 3;

/// Bytes of a frame header: kind (1), seq (8), origin rank (4), payload bytes (8).
pub(crate) const HEADER_BYTES: usize = 21;

/// Element sizes of f32, f64, bf16, f16 on this machine.
fn element_sizes() -> [u8; 4] {
    [
        std::mem::size_of::<f32>() as u8,
        std::mem::size_of::<f64>() as u8,
        std::mem::size_of::<fsdp_device::half::bf16>() as u8,
        std::mem::size_of::<fsdp_device::half::f16>() as u8,
    ]
}

/// What a connecting rank says about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Hello {
    pub group: String,
    pub world: u64,
    pub from: u64,
    pub to: u64,
}

impl Hello {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.bytes(&MAGIC);
        w.u32(VERSION);
        w.buf.extend_from_slice(&ENDIAN_PROBE.to_ne_bytes());
        w.bytes(&element_sizes());
        w.u64(self.world);
        w.u64(self.from);
        w.u64(self.to);
        w.str(&self.group);
        w.buf
    }

    /// Read a hello from `r`; a connection that is not one of ours, or that comes from a machine
    /// of another byte order or element layout, is an error saying so.
    pub fn read(r: &mut impl Read) -> Result<Hello, String> {
        let mut fixed = [0u8; 8 + 4 + 4 + 4 + 8 * 3 + 4];
        r.read_exact(&mut fixed)
            .map_err(|e| format!("reading the handshake: {e}"))?;
        if fixed[..8] != MAGIC {
            return Err(format!(
                "not an fsdp tcp connection (first bytes {:02x?}, expected {:02x?})",
                &fixed[..8],
                MAGIC
            ));
        }
        let mut rd = Reader::new(&fixed[8..]);
        let version = rd.u32()?;
        if version != VERSION {
            return Err(format!(
                "protocol version {version}, this rank speaks version {VERSION}"
            ));
        }
        let probe = u32::from_ne_bytes(rd.take(4)?.try_into().expect("4 bytes"));
        if probe != ENDIAN_PROBE {
            return Err(
                "the peer has a different byte order (element data is sent in native order)".into(),
            );
        }
        let sizes = rd.take(4)?;
        if sizes != element_sizes() {
            return Err(format!(
                "the peer's element sizes (f32, f64, bf16, f16) are {sizes:?}, ours are {:?}",
                element_sizes()
            ));
        }
        let world = rd.u64()?;
        let from = rd.u64()?;
        let to = rd.u64()?;
        let glen = rd.u32()? as usize;
        if glen > 4096 {
            return Err(format!("group name of {glen} bytes"));
        }
        let mut g = vec![0u8; glen];
        r.read_exact(&mut g)
            .map_err(|e| format!("reading the handshake: {e}"))?;
        let group = String::from_utf8(g).map_err(|_| "group name is not UTF-8".to_string())?;
        Ok(Hello {
            group,
            world,
            from,
            to,
        })
    }
}

/// The acceptor's answer: empty for "accepted", else why not.
pub(crate) fn encode_reply(refusal: Option<&str>) -> Vec<u8> {
    let mut w = Writer::default();
    match refusal {
        None => w.u8(0),
        Some(why) => {
            w.u8(1);
            w.str(why);
        }
    }
    w.buf
}

/// Read the acceptor's answer: `Ok(None)` accepted, `Ok(Some(why))` refused.
pub(crate) fn read_reply(r: &mut impl Read) -> io::Result<Option<String>> {
    let mut status = [0u8; 1];
    r.read_exact(&mut status)?;
    if status[0] == 0 {
        return Ok(None);
    }
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = (u32::from_le_bytes(len) as usize).min(1 << 16);
    let mut why = vec![0u8; len];
    r.read_exact(&mut why)?;
    Ok(Some(String::from_utf8_lossy(&why).into_owned()))
}

/// A frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub kind: u8,
    pub seq: u64,
    pub origin: u32,
    pub len: u64,
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut h = [0u8; HEADER_BYTES];
        h[0] = self.kind;
        h[1..9].copy_from_slice(&self.seq.to_le_bytes());
        h[9..13].copy_from_slice(&self.origin.to_le_bytes());
        h[13..21].copy_from_slice(&self.len.to_le_bytes());
        h
    }

    pub fn decode(h: &[u8; HEADER_BYTES]) -> Header {
        Header {
            kind: h[0],
            seq: u64::from_le_bytes(h[1..9].try_into().expect("8 bytes")),
            origin: u32::from_le_bytes(h[9..13].try_into().expect("4 bytes")),
            len: u64::from_le_bytes(h[13..21].try_into().expect("8 bytes")),
        }
    }
}

/// A received payload, 8-byte aligned so that it can be read as elements of any [`DType`].
/// Its storage goes back to its pool when it is dropped.
pub(crate) struct Payload {
    words: Vec<u64>,
    len: usize,
    pool: Option<Arc<PayloadPool>>,
}

/// Storage of dropped payloads, reused by the reader thread so that a steady stream of
/// segments does not allocate (and zero) a fresh buffer per frame.
#[derive(Default)]
pub(crate) struct PayloadPool {
    free: Mutex<Vec<Vec<u64>>>,
}

/// Buffers a pool keeps at most.
const POOL_KEEP: usize = 16;

impl PayloadPool {
    /// A payload of `len` bytes (contents unspecified: the caller overwrites all of them).
    pub fn take(self: &Arc<Self>, len: usize) -> Payload {
        let words_len = len.div_ceil(8);
        let mut words = {
            let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
            match free.iter().position(|w| w.capacity() >= words_len) {
                Some(i) => free.swap_remove(i),
                None => Vec::new(),
            }
        };
        words.resize(words_len, 0);
        Payload {
            words,
            len,
            pool: Some(self.clone()),
        }
    }
}

impl Drop for Payload {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            let mut free = pool.free.lock().unwrap_or_else(|e| e.into_inner());
            if free.len() < POOL_KEEP && self.words.capacity() > 0 {
                free.push(std::mem::take(&mut self.words));
            }
        }
    }
}

impl Payload {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: `words` holds at least `len` initialised bytes; u8 has no alignment needs.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast::<u8>(), self.len) }
    }

    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as for `as_bytes`, and `self` is borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<u8>(), self.len) }
    }
}

/// Write `header` then `payload` to `w`, in as few system calls as possible.
pub(crate) fn write_frame(w: &mut impl Write, header: &Header, payload: &[u8]) -> io::Result<()> {
    let h = header.encode();
    let mut done = 0;
    while done < h.len() {
        let n = w.write_vectored(&[io::IoSlice::new(&h[done..]), io::IoSlice::new(payload)])?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        done += n;
    }
    let sent = done - h.len();
    w.write_all(&payload[sent..])
}

/// Builds a little-endian message.
#[derive(Default)]
pub(crate) struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    pub(crate) fn into_bytes(self) -> Vec<u8> {
        self.buf
    }
    pub(crate) fn bytes(&mut self, b: &[u8]) {
        self.buf.extend_from_slice(b);
    }
    pub(crate) fn u8(&mut self, x: u8) {
        self.buf.push(x);
    }
    pub(crate) fn u32(&mut self, x: u32) {
        self.buf.extend_from_slice(&x.to_le_bytes());
    }
    pub(crate) fn u64(&mut self, x: u64) {
        self.buf.extend_from_slice(&x.to_le_bytes());
    }
    pub(crate) fn opt_u64(&mut self, x: Option<u64>) {
        match x {
            None => self.u8(0),
            Some(v) => {
                self.u8(1);
                self.u64(v);
            }
        }
    }
    pub(crate) fn str(&mut self, s: &str) {
        self.u32(s.len() as u32);
        self.bytes(s.as_bytes());
    }
}

/// Reads a message built by [`Writer`].
pub(crate) struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn at_end(&self) -> bool {
        self.at == self.b.len()
    }
    pub(crate) fn remaining(&self) -> usize {
        self.b.len() - self.at
    }
    pub(crate) fn new(b: &'a [u8]) -> Self {
        Reader { b, at: 0 }
    }
    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.b.len())
            .ok_or_else(|| "truncated message".to_string())?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    pub(crate) fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    pub(crate) fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    pub(crate) fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
    pub(crate) fn usize(&mut self) -> Result<usize, String> {
        let v = self.u64()?;
        usize::try_from(v).map_err(|_| format!("value {v} does not fit this machine's usize"))
    }
    pub(crate) fn opt_u64(&mut self) -> Result<Option<u64>, String> {
        match self.u8()? {
            0 => Ok(None),
            _ => Ok(Some(self.u64()?)),
        }
    }
    pub(crate) fn str(&mut self) -> Result<String, String> {
        let n = self.u32()? as usize;
        let s = self.take(n)?;
        String::from_utf8(s.to_vec()).map_err(|_| "text is not UTF-8".to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_round_trips_and_rejects_strangers() {
        let h = Hello {
            group: "g1".into(),
            world: 3,
            from: 2,
            to: 0,
        };
        let bytes = h.encode();
        assert_eq!(Hello::read(&mut &bytes[..]).unwrap(), h);
        let err = Hello::read(&mut &b"GET / HTTP/1.1\r\nHost: x\r\n\r\n....................."[..])
            .unwrap_err();
        assert!(err.contains("not an fsdp tcp connection"), "{err}");
        let mut swapped = bytes.clone();
        swapped[12..16].reverse();
        let err = Hello::read(&mut &swapped[..]).unwrap_err();
        assert!(err.contains("byte order"), "{err}");
    }

    #[test]
    fn headers_round_trip() {
        let h = Header {
            kind: KIND_DATA,
            seq: 1 << 40,
            origin: 7,
            len: 12345,
        };
        assert_eq!(Header::decode(&h.encode()), h);
    }
}
