use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

use crate::error::{Error, Result, Status};

/// Alignment of workspace and saved buffers (the library requires 16 bytes).
pub const BUFFER_ALIGNMENT: usize = 64;

/// An owned, 64-byte-aligned host byte buffer: workspace and saved state for the CPU backend.
pub struct AlignedBytes {
    ptr: NonNull<u8>,
    len: usize,
}

// Plain owned memory.
unsafe impl Send for AlignedBytes {}
unsafe impl Sync for AlignedBytes {}

impl AlignedBytes {
    pub fn zeroed(len: usize) -> AlignedBytes {
        if len == 0 {
            return AlignedBytes {
                ptr: NonNull::dangling(),
                len: 0,
            };
        }
        let layout = Layout::from_size_align(len, BUFFER_ALIGNMENT).expect("buffer too large");
        // Zeroed so that no uninitialised bytes are ever observable from safe code.
        let ptr = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBytes { ptr, len }
    }

    /// As [`AlignedBytes::zeroed`], but a size the allocator cannot serve is an
    /// `Err(OUT_OF_MEMORY)` naming `name` instead of a panic or a process abort.
    pub fn try_zeroed(name: &str, len: usize) -> Result<AlignedBytes> {
        if len == 0 {
            return Ok(AlignedBytes::zeroed(0));
        }
        let too_large = || {
            Error::new(
                Status::OUT_OF_MEMORY,
                format!("{name}: cannot allocate {len} bytes"),
            )
        };
        let layout = Layout::from_size_align(len, BUFFER_ALIGNMENT).map_err(|_| too_large())?;
        let ptr = NonNull::new(unsafe { alloc_zeroed(layout) }).ok_or_else(too_large)?;
        Ok(AlignedBytes { ptr, len })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// NULL for an empty buffer (the library accepts NULL when 0 bytes are needed).
    pub fn as_ptr(&self) -> *const u8 {
        if self.len == 0 {
            std::ptr::null()
        } else {
            self.ptr.as_ptr()
        }
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        if self.len == 0 {
            std::ptr::null_mut()
        } else {
            self.ptr.as_ptr()
        }
    }

    pub fn as_slice(&self) -> &[u8] {
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBytes {
    fn drop(&mut self) {
        if self.len != 0 {
            let layout = Layout::from_size_align(self.len, BUFFER_ALIGNMENT).unwrap();
            unsafe { dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

impl Clone for AlignedBytes {
    fn clone(&self) -> Self {
        let mut copy = AlignedBytes::zeroed(self.len);
        copy.as_mut_slice().copy_from_slice(self.as_slice());
        copy
    }
}

impl std::fmt::Debug for AlignedBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBytes({} bytes)", self.len)
    }
}
