//! Puts libflashattn's directory (found by flashattn-sys's build script) into the rpath of this
//! crate's tests, examples and binaries, so they run without LD_LIBRARY_PATH. Cargo passes link
//! search paths and libraries on to dependents but not link arguments, hence this second script.
//!
//! The tests (only they) also link libflashattn_reference, the C++ suite's float64 reference
//! behind a C ABI, built with the C++ tests and never installed (tests/common/reference.rs):
//! `FLASHATTN_REFERENCE_LIB` (the library's path), else `src/testing/` of the CMake build
//! directory in `FLASHATTN_DIR`. Without it the crate builds as usual and the tests that need the
//! reference fail, saying what to build (cfg `flashattn_reference_missing`).
use std::env;
use std::path::{Path, PathBuf};

const REFERENCE: &str = "libflashattn_reference.so";

fn reference_lib() -> (Option<PathBuf>, PathBuf) {
    if let Some(p) = env::var_os("FLASHATTN_REFERENCE_LIB").filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        return (p.is_file().then(|| p.clone()), p);
    }
    match env::var_os("FLASHATTN_DIR") {
        Some(dir) => {
            let p = Path::new(&dir).join("src/testing").join(REFERENCE);
            (p.is_file().then(|| p.clone()), p)
        }
        None => (None, PathBuf::new()),
    }
}

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_FLASHATTN_LIB_DIR");
    println!("cargo:rerun-if-env-changed=FLASHATTN_REFERENCE_LIB");
    println!("cargo:rerun-if-env-changed=FLASHATTN_DIR");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rustc-check-cfg=cfg(flashattn_reference_missing)");
    let target_os = env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if let Ok(dir) = env::var("DEP_FLASHATTN_LIB_DIR") {
        if target_os != "windows" {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
        }
    }
    match reference_lib() {
        (Some(lib), _) if target_os == "linux" => {
            let lib = lib.canonicalize().unwrap_or(lib);
            let dir = lib.parent().unwrap().display().to_string();
            let name = lib.file_stem().unwrap().to_string_lossy();
            let name = name.strip_prefix("lib").unwrap_or(&name);
            println!("cargo:rustc-link-arg-tests=-L{dir}");
            println!("cargo:rustc-link-arg-tests=-l{name}");
            println!("cargo:rustc-link-arg-tests=-Wl,-rpath,{dir}");
        }
        (_, expected) => {
            println!("cargo:rustc-cfg=flashattn_reference_missing");
            // Found again (and linked) once it is built there.
            if !expected.as_os_str().is_empty() {
                println!("cargo:rerun-if-changed={}", expected.display());
            }
        }
    }
}
