//! Finds libflashattn and links it.
//!
//! Where it looks, in order:
//! 1. `FLASHATTN_DIR`: a CMake build directory (holding `src/libflashattn.so` and `CMakeCache.txt`)
//!    or an install prefix (holding `lib*/libflashattn.so` and `include/flashattn/flashattn.h`).
//! 2. `FLASHATTN_PREFIX`, then `CMAKE_PREFIX_PATH` (path lists): install prefixes in which
//!    `lib*/cmake/flashattn/flashattnConfig.cmake` exists, i.e. where `cmake --install` put it.
//!
//! The library directory is also written into the rpath of this crate's tests and exported to the
//! `flashattn` crate (`DEP_FLASHATTN_LIB_DIR`) so that its tests and examples run without
//! `LD_LIBRARY_PATH`. The header directory goes to the layout test (`FLASHATTN_INCLUDE_DIR`).
use std::env;
use std::fs;
use std::path::{Path, PathBuf};

const LIB_FILES: &[&str] = &["libflashattn.so", "libflashattn.dylib"];
const HEADER: &str = "flashattn/flashattn.h";

struct Found {
    lib_dir: PathBuf,
    include_dir: Option<PathBuf>,
    how: String,
}

fn has_lib(dir: &Path) -> bool {
    LIB_FILES.iter().any(|f| dir.join(f).is_file())
}

fn header_dir(dir: PathBuf) -> Option<PathBuf> {
    dir.join(HEADER).is_file().then_some(dir)
}

/// Directories named lib* directly under `prefix`, and one level below them (Debian's
/// GNUInstallDirs puts libraries in lib/<multiarch triplet>).
fn lib_dirs(prefix: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = fs::read_dir(prefix) else { return out };
    let mut libs: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.is_dir() && p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("lib"))
        })
        .collect();
    libs.sort();
    for l in libs {
        if let Ok(sub) = fs::read_dir(&l) {
            let mut subs: Vec<PathBuf> =
                sub.flatten().map(|e| e.path()).filter(|p| p.is_dir()).collect();
            subs.sort();
            out.push(l);
            out.extend(subs);
        }
    }
    out
}

/// The source directory recorded in a CMake build directory's cache.
fn cmake_source_dir(build: &Path) -> Option<PathBuf> {
    let cache = fs::read_to_string(build.join("CMakeCache.txt")).ok()?;
    for key in ["flashattn_SOURCE_DIR:STATIC=", "CMAKE_HOME_DIRECTORY:INTERNAL="] {
        if let Some(line) = cache.lines().find(|l| l.starts_with(key)) {
            return Some(PathBuf::from(line[key.len()..].trim()));
        }
    }
    None
}

fn from_flashattn_dir(dir: &Path) -> Result<Found, String> {
    if dir.is_relative() {
        return Err(format!(
            "FLASHATTN_DIR={} is a relative path; build scripts run in the crate's directory, so \
             give an absolute one (e.g. FLASHATTN_DIR=$PWD/build)",
            dir.display()
        ));
    }
    // A CMake build tree: the library is in src/, the header in the source tree.
    if has_lib(&dir.join("src")) {
        let include_dir = cmake_source_dir(dir)
            .and_then(|s| header_dir(s.join("include")))
            // The crate lives in <source>/rust/flashattn-sys, which is the next best guess.
            .or_else(|| header_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../include")));
        return Ok(Found {
            lib_dir: dir.join("src"),
            include_dir,
            how: format!("FLASHATTN_DIR={} (CMake build directory)", dir.display()),
        });
    }
    // An install prefix.
    for l in lib_dirs(dir) {
        if has_lib(&l) {
            return Ok(Found {
                lib_dir: l,
                include_dir: header_dir(dir.join("include")),
                how: format!("FLASHATTN_DIR={} (install prefix)", dir.display()),
            });
        }
    }
    // The library directory itself.
    if has_lib(dir) {
        return Ok(Found {
            lib_dir: dir.to_path_buf(),
            include_dir: dir.parent().and_then(|p| header_dir(p.join("include"))),
            how: format!("FLASHATTN_DIR={} (library directory)", dir.display()),
        });
    }
    Err(format!(
        "FLASHATTN_DIR={} holds neither src/libflashattn.so (a CMake build directory) nor \
         lib*/libflashattn.so (an install prefix)",
        dir.display()
    ))
}

fn from_prefix_list(var: &str) -> Option<Found> {
    let value = env::var_os(var)?;
    for prefix in env::split_paths(&value) {
        for l in lib_dirs(&prefix) {
            if l.join("cmake/flashattn/flashattnConfig.cmake").is_file() && has_lib(&l) {
                return Some(Found {
                    lib_dir: l,
                    include_dir: header_dir(prefix.join("include")),
                    how: format!("{var} entry {} (installed CMake package)", prefix.display()),
                });
            }
        }
    }
    None
}

fn find() -> Found {
    if let Some(dir) = env::var_os("FLASHATTN_DIR") {
        match from_flashattn_dir(Path::new(&dir)) {
            Ok(f) => return f,
            Err(msg) => panic!("\n\nflashattn-sys: {msg}.\n\n"),
        }
    }
    for var in ["FLASHATTN_PREFIX", "CMAKE_PREFIX_PATH"] {
        if let Some(f) = from_prefix_list(var) {
            return f;
        }
    }
    panic!(
        "\n\nflashattn-sys: cannot find libflashattn. Build it with CMake first, then set \
         FLASHATTN_DIR to the build directory (e.g. FLASHATTN_DIR=$PWD/build, which holds \
         src/libflashattn.so) or to an install prefix; or set FLASHATTN_PREFIX (or \
         CMAKE_PREFIX_PATH) to the prefix given to `cmake --install` (searched for \
         lib*/cmake/flashattn).\n\n"
    );
}

fn main() {
    for var in ["FLASHATTN_DIR", "FLASHATTN_PREFIX", "CMAKE_PREFIX_PATH"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed=build.rs");

    let found = find();
    let lib_dir = found.lib_dir.canonicalize().unwrap_or(found.lib_dir);
    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    println!("cargo:rustc-link-lib=dylib=flashattn");
    // Metadata for dependents' build scripts (`links = "flashattn"`): DEP_FLASHATTN_LIB_DIR.
    println!("cargo:lib_dir={}", lib_dir.display());
    let target_os = env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if target_os != "windows" {
        // Applies to this crate's tests; link args do not propagate to dependents, which is why
        // the `flashattn` crate repeats this from DEP_FLASHATTN_LIB_DIR.
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib_dir.display());
    }
    match found.include_dir {
        Some(inc) => {
            let inc = inc.canonicalize().unwrap_or(inc);
            println!("cargo:include={}", inc.display());
            println!("cargo:rustc-env=FLASHATTN_INCLUDE_DIR={}", inc.display());
        }
        None => {
            println!(
                "cargo:warning=flashattn-sys: found the library through {} but not {HEADER}; \
                 the layout test will fail",
                found.how
            );
            println!("cargo:rustc-env=FLASHATTN_INCLUDE_DIR=");
        }
    }
    println!("cargo:rustc-env=FLASHATTN_LIB_DIR={}", lib_dir.display());
}
