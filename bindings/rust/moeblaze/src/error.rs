use std::ffi::CStr;
use std::fmt;

use moeblaze_sys as sys;

/// A `moeblaze_status_t`. A newtype over `i32`, not an enum: a newer library may return codes this
/// crate does not know.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Status(pub i32);

impl Status {
    pub const OK: Status = Status(sys::moeblaze_status_code::MOEBLAZE_OK as i32);
    pub const INVALID_ARGUMENT: Status =
        Status(sys::moeblaze_status_code::MOEBLAZE_ERR_INVALID_ARGUMENT as i32);
    pub const INVALID_HANDLE: Status =
        Status(sys::moeblaze_status_code::MOEBLAZE_ERR_INVALID_HANDLE as i32);
    pub const NOT_SUPPORTED: Status =
        Status(sys::moeblaze_status_code::MOEBLAZE_ERR_NOT_SUPPORTED as i32);
    pub const INSUFFICIENT_WORKSPACE: Status =
        Status(sys::moeblaze_status_code::MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE as i32);
    pub const OUT_OF_MEMORY: Status =
        Status(sys::moeblaze_status_code::MOEBLAZE_ERR_OUT_OF_MEMORY as i32);
    pub const CUDA: Status = Status(sys::moeblaze_status_code::MOEBLAZE_ERR_CUDA as i32);
    pub const VERSION_MISMATCH: Status =
        Status(sys::moeblaze_status_code::MOEBLAZE_ERR_VERSION_MISMATCH as i32);
    pub const NON_FINITE: Status =
        Status(sys::moeblaze_status_code::MOEBLAZE_ERR_NON_FINITE as i32);
    pub const INTERNAL: Status = Status(sys::moeblaze_status_code::MOEBLAZE_ERR_INTERNAL as i32);

    /// The enumerator name, e.g. "MOEBLAZE_ERR_INVALID_ARGUMENT" (static text of the library).
    pub fn name(self) -> &'static str {
        unsafe { static_str(sys::moeblaze_status_name(self.0)) }
    }

    /// A one-line description, e.g. "invalid argument".
    pub fn description(self) -> &'static str {
        unsafe { static_str(sys::moeblaze_status_string(self.0)) }
    }
}

unsafe fn static_str(ptr: *const std::os::raw::c_char) -> &'static str {
    if ptr.is_null() {
        return "";
    }
    CStr::from_ptr(ptr).to_str().unwrap_or("")
}

impl fmt::Debug for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}({})", self.name(), self.0)
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A failed call: its status and the library's message for it (copied at once from the
/// thread-local last error).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub status: Status,
    pub message: String,
}

impl Error {
    /// An error raised by this crate before calling the library (same status vocabulary).
    pub(crate) fn new(status: Status, message: impl Into<String>) -> Self {
        Error {
            status,
            message: message.into(),
        }
    }

    pub(crate) fn invalid_argument(message: impl Into<String>) -> Self {
        Error::new(Status::INVALID_ARGUMENT, message)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.message.is_empty() {
            write!(f, "{}", self.status)
        } else {
            f.write_str(&self.message)
        }
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

/// The calling thread's last error message ("" after a successful call).
pub fn last_error() -> String {
    unsafe {
        let ptr = sys::moeblaze_last_error();
        if ptr.is_null() {
            return String::new(); // the header promises non-NULL; do not trust it blindly
        }
        CStr::from_ptr(ptr).to_string_lossy().into_owned()
    }
}

/// Turns a status into a Result, reading the message before any other call can replace it.
pub(crate) fn check(status: sys::moeblaze_status_t) -> Result<()> {
    if status == 0 {
        Ok(())
    } else {
        Err(Error {
            status: Status(status),
            message: last_error(),
        })
    }
}
