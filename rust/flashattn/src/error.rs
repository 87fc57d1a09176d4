use core::ffi::{c_int, CStr};
use std::fmt;

use flashattn_sys as sys;

/// What kind of failure a call reported: the library's status code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// Bad shape, dtype, stride, pointer, aliasing, ... (`FLASHATTN_ERROR_INVALID_ARGUMENT`);
    /// also a slice too short for its view, found by this crate before any call.
    InvalidArgument,
    /// Valid, but no backend in this build serves it (`FLASHATTN_ERROR_UNSUPPORTED`).
    Unsupported,
    /// A CUDA call or launch failed (`FLASHATTN_ERROR_BACKEND`).
    Backend,
    /// Workspace allocation failed (`FLASHATTN_ERROR_OUT_OF_MEMORY`).
    OutOfMemory,
    /// A bug in flashattn (`FLASHATTN_ERROR_INTERNAL`).
    Internal,
    /// The options' cancel callback stopped the call (`FLASHATTN_ERROR_CANCELLED`).
    Cancelled,
    /// A status code this crate does not know (a newer library).
    Unknown(i32),
}

impl ErrorKind {
    pub(crate) fn from_status(status: c_int) -> Self {
        match status {
            sys::FLASHATTN_ERROR_INVALID_ARGUMENT => ErrorKind::InvalidArgument,
            sys::FLASHATTN_ERROR_UNSUPPORTED => ErrorKind::Unsupported,
            sys::FLASHATTN_ERROR_BACKEND => ErrorKind::Backend,
            sys::FLASHATTN_ERROR_OUT_OF_MEMORY => ErrorKind::OutOfMemory,
            sys::FLASHATTN_ERROR_INTERNAL => ErrorKind::Internal,
            sys::FLASHATTN_ERROR_CANCELLED => ErrorKind::Cancelled,
            other => ErrorKind::Unknown(other),
        }
    }

    /// The C status code.
    pub fn status(self) -> i32 {
        match self {
            ErrorKind::InvalidArgument => sys::FLASHATTN_ERROR_INVALID_ARGUMENT,
            ErrorKind::Unsupported => sys::FLASHATTN_ERROR_UNSUPPORTED,
            ErrorKind::Backend => sys::FLASHATTN_ERROR_BACKEND,
            ErrorKind::OutOfMemory => sys::FLASHATTN_ERROR_OUT_OF_MEMORY,
            ErrorKind::Internal => sys::FLASHATTN_ERROR_INTERNAL,
            ErrorKind::Cancelled => sys::FLASHATTN_ERROR_CANCELLED,
            ErrorKind::Unknown(s) => s,
        }
    }
}

/// A failed call: the status kind and the message (from `flashattn_last_error`, or from this crate
/// for the few checks it makes itself, such as a slice too short for its view).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    kind: ErrorKind,
    message: String,
}

impl Error {
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }
    pub fn message(&self) -> &str {
        &self.message
    }

    pub(crate) fn invalid(message: String) -> Self {
        Error { kind: ErrorKind::InvalidArgument, message }
    }

    /// Turns a status into a Result, reading the message right away: it is thread-local and only
    /// valid until the next call on this thread.
    pub(crate) fn check(status: c_int) -> Result<(), Error> {
        if status == sys::FLASHATTN_OK {
            return Ok(());
        }
        // SAFETY: the library returns a NUL-terminated string that is never null.
        let message =
            unsafe { CStr::from_ptr(sys::flashattn_last_error()) }.to_string_lossy().into_owned();
        Err(Error { kind: ErrorKind::from_status(status), message })
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "flashattn: {}: {}", status_string(self.kind.status()), self.message)
    }
}

impl std::error::Error for Error {}

/// The library's name for a status code ("ok", "invalid argument", ...).
pub fn status_string(status: i32) -> &'static str {
    // SAFETY: static strings owned by the library, never null, valid while it is loaded (always:
    // it is linked, not dlopen'ed).
    unsafe { CStr::from_ptr(sys::flashattn_status_string(status)) }
        .to_str()
        .unwrap_or("unknown status")
}
