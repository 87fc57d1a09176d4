//! Puts libflashattn's directory (found by flashattn-sys's build script) into the rpath of this
//! crate's tests, examples and binaries, so they run without LD_LIBRARY_PATH. Cargo passes link
//! search paths and libraries on to dependents but not link arguments, hence this second script.
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_FLASHATTN_LIB_DIR");
    let target_os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if let Ok(dir) = std::env::var("DEP_FLASHATTN_LIB_DIR") {
        if target_os != "windows" {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
        }
    }
}
