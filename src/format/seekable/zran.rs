//! Deflate at block boundaries, both ways (zran-style checkpoints):
//!
//! - [`BlockInflater`], a gzip inflater that stops at deflate block boundaries and says where
//!   it is, bit by bit: what building a seekable index needs. The safe inflaters (flate2,
//!   zlib-rs's `Inflate`) hide the block boundary and the bit position; zlib's own API gives
//!   both through `Z_BLOCK` and `data_type`, so this wraps that API (libz-rs-sys, zlib in
//!   Rust) in one small owner of a `z_stream`.
//! - [`inflate_span`], decoding a span from its checkpoint with a safe inflater: the window
//!   and the span's first bits are replayed as a stored-and-literal deflate prefix.

use libz_rs_sys as z;

use crate::error::{Error, Result};

/// The deflate window a checkpoint carries.
pub const WINDOW: usize = 32 << 10;

/// What one [`BlockInflater::inflate`] call did.
pub struct Step {
    /// Input bytes consumed.
    pub consumed: usize,
    /// Output bytes written.
    pub produced: usize,
    /// The gzip member (and its trailer) ended.
    pub end: bool,
    /// The inflater stands at a deflate block boundary that is not the end of the stream:
    /// a place to start decoding from, given the window.
    pub at_boundary: bool,
    /// Bits of the last consumed byte not used yet (0–7): they begin the next block.
    pub pending_bits: u8,
}

/// A gzip inflater over a caller's buffers that returns at every deflate block boundary.
pub struct BlockInflater {
    // Boxed: zlib keeps a pointer to the stream in its state, so it must not move.
    stream: Box<z::z_stream>,
}

// SAFETY: the stream owns its state and is only used through `&mut self`.
#[allow(unsafe_code)]
unsafe impl Send for BlockInflater {}

impl BlockInflater {
    /// An inflater for one gzip member (header and trailer checked).
    #[allow(unsafe_code)]
    pub fn gzip() -> Result<Self> {
        let mut stream = Box::new(z::z_stream::default());
        // SAFETY: `stream` is a valid, default-initialised z_stream that stays boxed (it
        // does not move) until `inflateEnd` in Drop; version and size are this library's.
        let ret = unsafe {
            z::inflateInit2_(
                stream.as_mut(),
                15 + 16,
                z::zlibVersion(),
                std::mem::size_of::<z::z_stream>() as i32,
            )
        };
        if ret != z::Z_OK {
            return Err(Error::corrupt(format!(
                "starting the gzip decoder failed ({ret})"
            )));
        }
        Ok(BlockInflater { stream })
    }

    /// Inflates from `input` into `output` until a block boundary, the end of the member, the
    /// end of `input` or a full `output`.
    #[allow(unsafe_code)]
    pub fn inflate(&mut self, input: &[u8], output: &mut [u8]) -> Result<Step> {
        let s = self.stream.as_mut();
        s.next_in = input.as_ptr();
        s.avail_in = input.len().min(u32::MAX as usize) as u32;
        s.next_out = output.as_mut_ptr();
        s.avail_out = output.len().min(u32::MAX as usize) as u32;
        let (avail_in, avail_out) = (s.avail_in, s.avail_out);
        // SAFETY: the stream was initialised by `inflateInit2_`; next_in/next_out point into
        // `input` and `output`, which outlive this call, with their lengths as avail_in/out.
        let ret = unsafe { z::inflate(s, z::Z_BLOCK) };
        let consumed = (avail_in - s.avail_in) as usize;
        let produced = (avail_out - s.avail_out) as usize;
        // The stream must not keep pointers into buffers that are about to go away.
        s.next_in = std::ptr::null();
        s.next_out = std::ptr::null_mut();
        s.avail_in = 0;
        s.avail_out = 0;
        let (data_type, total_in) = (s.data_type, s.total_in);
        if !matches!(ret, z::Z_OK | z::Z_STREAM_END | z::Z_BUF_ERROR) {
            return Err(Error::corrupt(format!(
                "the gzip stream is not valid at compressed byte {total_in}: {}",
                self.message()
            )));
        }
        Ok(Step {
            consumed,
            produced,
            end: ret == z::Z_STREAM_END,
            // Bit 7: at the end of a block (or the header); bit 6: that block was the last.
            at_boundary: ret != z::Z_STREAM_END && data_type & 128 != 0 && data_type & 64 == 0,
            pending_bits: (data_type & 7) as u8,
        })
    }

    #[allow(unsafe_code)]
    fn message(&self) -> String {
        let msg = self.stream.msg;
        if msg.is_null() {
            return "corrupt deflate data".into();
        }
        // SAFETY: zlib sets `msg` to a static NUL-terminated string or leaves it null.
        unsafe { std::ffi::CStr::from_ptr(msg) }
            .to_string_lossy()
            .into_owned()
    }
}

impl Drop for BlockInflater {
    #[allow(unsafe_code)]
    fn drop(&mut self) {
        // SAFETY: the stream was initialised by `inflateInit2_` and is ended once, here.
        unsafe {
            z::inflateEnd(self.stream.as_mut());
        }
    }
}

/// Deflate bits, least significant first, as a deflate stream packs them.
struct BitWriter {
    out: Vec<u8>,
    acc: u64,
    used: u32,
}

impl BitWriter {
    fn with_capacity(bytes: usize) -> Self {
        BitWriter {
            out: Vec::with_capacity(bytes),
            acc: 0,
            used: 0,
        }
    }

    /// Appends the low `n` bits of `value`, first bit first.
    fn put(&mut self, value: u32, n: u32) {
        self.acc |= u64::from(value) << self.used;
        self.used += n;
        while self.used >= 8 {
            self.out.push(self.acc as u8);
            self.acc >>= 8;
            self.used -= 8;
        }
    }

    /// Appends a Huffman code of `len` bits (deflate stores codes most significant bit first).
    fn put_code(&mut self, code: u32, len: u32) {
        self.put(code.reverse_bits() >> (32 - len), len);
    }

    /// Appends literal `byte` with the fixed Huffman code (RFC 1951, 3.2.6).
    fn put_literal(&mut self, byte: u8) {
        match byte {
            0..=143 => self.put_code(0x30 + u32::from(byte), 8),
            _ => self.put_code(0x190 + u32::from(byte - 144), 9),
        }
    }
}

/// A literal whose fixed Huffman code is 9 bits long: each one moves where the next block
/// starts by one bit (mod 8).
const FILLER: u8 = 144;

/// Inflates `size` bytes of raw deflate that start `bits` bits from the end of `input[0]`
/// (all of it if 0), after `window`. Deflate has no way to start mid-stream with a given
/// history, so a fixed-Huffman block of literals goes first — a few filler bytes, then the
/// window — ending exactly at the bit alignment the span had in the layer; the span's own
/// bytes follow unshifted (a stored block's padding depends on that alignment), and the
/// prefix's bytes are dropped from the output.
pub(super) fn inflate_span(window: &[u8], bits: u8, input: &[u8], size: usize) -> Result<Vec<u8>> {
    if bits > 7 || window.len() > WINDOW {
        return Err(Error::corrupt(format!(
            "a checkpoint at bit {bits} with a {}-byte window",
            window.len()
        )));
    }
    let mut prefix_len = 0;
    let feed = if window.is_empty() && bits == 0 {
        input.to_vec()
    } else {
        // The span starts at bit 8 − bits of its first byte: the prefix must end there.
        let target = (8 - u32::from(bits)) % 8;
        let nine_bit = window.iter().filter(|&&b| b >= FILLER).count() as u32;
        // Header (3) + end of block (7) + 8 per literal + 1 per 9-bit literal.
        let base = (10 + nine_bit) % 8;
        let fillers = (target + 8 - base) % 8;
        let mut w = BitWriter::with_capacity(window.len() * 9 / 8 + input.len() + 8);
        w.put(0, 1); // BFINAL 0
        w.put(1, 2); // BTYPE 01: fixed Huffman codes
        for _ in 0..fillers {
            w.put_literal(FILLER);
        }
        for &b in window {
            w.put_literal(b);
        }
        w.put_code(0, 7); // end of block
        debug_assert_eq!(w.used, target);
        prefix_len = fillers as usize + window.len();
        let mut feed = w.out;
        match input.split_first() {
            Some((&first, rest)) if bits > 0 => {
                // The low 8 − bits bits of the first byte belong to the block before the span.
                let span_bits = first & !(0xffu8 >> bits);
                feed.push(w.acc as u8 | span_bits);
                feed.extend_from_slice(rest);
            }
            _ => feed.extend_from_slice(input),
        }
        feed
    };
    let want = prefix_len + size;
    let mut out = Vec::with_capacity(want);
    let mut d = flate2::Decompress::new(false);
    while out.len() < want {
        let (before_in, before_out) = (d.total_in(), out.len());
        let status = d
            .decompress_vec(
                &feed[d.total_in() as usize..],
                &mut out,
                flate2::FlushDecompress::None,
            )
            .map_err(|e| Error::corrupt(format!("the deflate data is not valid: {e}")))?;
        if status == flate2::Status::StreamEnd
            || (d.total_in() == before_in && out.len() == before_out)
        {
            break;
        }
    }
    if out.len() != want || out[prefix_len - window.len()..prefix_len] != *window {
        return Err(Error::corrupt(format!(
            "decoded to {} bytes, expected {size}",
            out.len().saturating_sub(prefix_len)
        )));
    }
    Ok(out.split_off(prefix_len))
}
