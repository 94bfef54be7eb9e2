//! A gzip inflater that stops at deflate block boundaries and says where it is, bit by bit:
//! what building a seekable index needs (zran-style checkpoints). The safe inflaters
//! (flate2, zlib-rs's `Inflate`) hide the block boundary and the bit position; zlib's own API
//! gives both through `Z_BLOCK` and `data_type`, so this wraps that API (libz-rs-sys, zlib in
//! Rust) in one small owner of a `z_stream`. Reading spans later needs none of this (see
//! [`super::seekable`]).

#![allow(unsafe_code)]

use libz_rs_sys as z;

use crate::error::{Error, Result};

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
unsafe impl Send for BlockInflater {}

impl BlockInflater {
    /// An inflater for one gzip member (header and trailer checked).
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
    fn drop(&mut self) {
        // SAFETY: the stream was initialised by `inflateInit2_` and is ended once, here.
        unsafe {
            z::inflateEnd(self.stream.as_mut());
        }
    }
}
