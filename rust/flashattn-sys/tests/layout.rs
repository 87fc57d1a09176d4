//! The hand-written declarations against the C header, as the C compiler sees it.
//!
//! `layout_probe.c` is compiled with `$CC` (default `cc`) against the header that build.rs found,
//! and prints sizes, alignments, field offsets and every #define. Each must equal the Rust side.
//! The header's #define lines are also scanned so that a constant added to the header without a
//! Rust counterpart fails here.
use flashattn_sys::*;
use std::collections::BTreeMap;
use std::ffi::CStr;
use std::mem::{align_of, offset_of, size_of, size_of_val};
use std::path::{Path, PathBuf};
use std::process::Command;

fn include_dir() -> PathBuf {
    let dir = env!("FLASHATTN_INCLUDE_DIR");
    assert!(
        !dir.is_empty(),
        "build.rs found libflashattn but not include/flashattn/flashattn.h next to it"
    );
    PathBuf::from(dir)
}

/// Compiles and runs the probe; returns its "name value" lines.
fn probe() -> BTreeMap<String, i64> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/layout_probe.c");
    let exe = Path::new(env!("CARGO_TARGET_TMPDIR")).join("flashattn_layout_probe");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let status = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(include_dir())
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .status()
        .unwrap_or_else(|e| panic!("cannot run the C compiler `{cc}` (set CC to another): {e}"));
    assert!(status.success(), "compiling {} failed", src.display());
    let out = Command::new(&exe).output().expect("running the layout probe");
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    text.lines()
        .map(|l| {
            let (k, v) = l.rsplit_once(' ').expect("probe line is `name value`");
            (k.to_string(), v.parse::<i64>().expect("probe value is an integer"))
        })
        .collect()
}

macro_rules! field {
    ($t:ident, $f:ident) => {{
        let probe: $t = unsafe { std::mem::zeroed() };
        [
            (
                concat!("offsetof(", stringify!($t), ".", stringify!($f), ")"),
                offset_of!($t, $f) as i64,
            ),
            (
                concat!("sizeof(", stringify!($t), ".", stringify!($f), ")"),
                size_of_val(&probe.$f) as i64,
            ),
        ]
    }};
}

fn rust_side() -> BTreeMap<String, i64> {
    let mut m: Vec<(&str, i64)> = vec![
        ("sizeof(flashattn_tensor)", size_of::<flashattn_tensor>() as i64),
        ("alignof(flashattn_tensor)", align_of::<flashattn_tensor>() as i64),
        ("sizeof(flashattn_options)", size_of::<flashattn_options>() as i64),
        ("alignof(flashattn_options)", align_of::<flashattn_options>() as i64),
        ("sizeof(int)", size_of::<core::ffi::c_int>() as i64),
        ("FLASHATTN_VERSION_MAJOR", FLASHATTN_VERSION_MAJOR as i64),
        ("FLASHATTN_VERSION_MINOR", FLASHATTN_VERSION_MINOR as i64),
        ("FLASHATTN_VERSION_PATCH", FLASHATTN_VERSION_PATCH as i64),
        ("FLASHATTN_FLOAT32", FLASHATTN_FLOAT32 as i64),
        ("FLASHATTN_FLOAT16", FLASHATTN_FLOAT16 as i64),
        ("FLASHATTN_BFLOAT16", FLASHATTN_BFLOAT16 as i64),
        ("FLASHATTN_FLOAT64", FLASHATTN_FLOAT64 as i64),
        ("FLASHATTN_INT32", FLASHATTN_INT32 as i64),
        ("sizeof(flashattn_varlen)", size_of::<flashattn_varlen>() as i64),
        ("sizeof(flashattn_kvcache)", size_of::<flashattn_kvcache>() as i64),
        ("alignof(flashattn_kvcache)", align_of::<flashattn_kvcache>() as i64),
        ("FLASHATTN_CPU", FLASHATTN_CPU as i64),
        ("FLASHATTN_MASK_NONE", FLASHATTN_MASK_NONE as i64),
        ("FLASHATTN_MASK_CAUSAL_TOP_LEFT", FLASHATTN_MASK_CAUSAL_TOP_LEFT as i64),
        ("FLASHATTN_MASK_CAUSAL_BOTTOM_RIGHT", FLASHATTN_MASK_CAUSAL_BOTTOM_RIGHT as i64),
        ("FLASHATTN_PRECISION_FP32", FLASHATTN_PRECISION_FP32 as i64),
        ("FLASHATTN_PRECISION_TF32", FLASHATTN_PRECISION_TF32 as i64),
        ("FLASHATTN_OK", FLASHATTN_OK as i64),
        ("FLASHATTN_ERROR_INVALID_ARGUMENT", FLASHATTN_ERROR_INVALID_ARGUMENT as i64),
        ("FLASHATTN_ERROR_UNSUPPORTED", FLASHATTN_ERROR_UNSUPPORTED as i64),
        ("FLASHATTN_ERROR_BACKEND", FLASHATTN_ERROR_BACKEND as i64),
        ("FLASHATTN_ERROR_OUT_OF_MEMORY", FLASHATTN_ERROR_OUT_OF_MEMORY as i64),
        ("FLASHATTN_ERROR_INTERNAL", FLASHATTN_ERROR_INTERNAL as i64),
        ("FLASHATTN_ERROR_CANCELLED", FLASHATTN_ERROR_CANCELLED as i64),
        ("FLASHATTN_OPTIONS_V1_SIZE", FLASHATTN_OPTIONS_V1_SIZE as i64),
        ("FLASHATTN_OPTIONS_V2_SIZE", FLASHATTN_OPTIONS_V2_SIZE as i64),
        ("FLASHATTN_OPTIONS_V3_SIZE", FLASHATTN_OPTIONS_V3_SIZE as i64),
        ("FLASHATTN_OPTIONS_V4_SIZE", FLASHATTN_OPTIONS_V4_SIZE as i64),
        ("FLASHATTN_MAX_THREADS", FLASHATTN_MAX_THREADS as i64),
        ("FLASHATTN_MAX_SOFTMAX_SCALE", FLASHATTN_MAX_SOFTMAX_SCALE as i64),
    ];
    m.extend(field!(flashattn_tensor, data));
    m.extend(field!(flashattn_tensor, dtype));
    m.extend(field!(flashattn_tensor, device));
    m.extend(field!(flashattn_tensor, ndim));
    m.extend(field!(flashattn_tensor, shape));
    m.extend(field!(flashattn_tensor, stride));
    m.extend(field!(flashattn_options, struct_size));
    m.extend(field!(flashattn_options, softmax_scale));
    m.extend(field!(flashattn_options, mask));
    m.extend(field!(flashattn_options, stream));
    m.extend(field!(flashattn_options, num_threads));
    m.extend(field!(flashattn_options, precision));
    m.extend(field!(flashattn_options, deterministic));
    m.extend(field!(flashattn_options, reserved0));
    m.extend(field!(flashattn_options, window_left));
    m.extend(field!(flashattn_options, window_right));
    m.extend(field!(flashattn_options, softcap));
    m.extend(field!(flashattn_options, sliding_window));
    m.extend(field!(flashattn_options, alibi_slopes));
    m.extend(field!(flashattn_options, max_flops));
    m.extend(field!(flashattn_options, cancel));
    m.extend(field!(flashattn_options, cancel_arg));
    m.extend(field!(flashattn_options, workspace));
    m.extend(field!(flashattn_options, workspace_bytes));
    m.extend(field!(flashattn_options, workspace_query));
    m.extend(field!(flashattn_varlen, struct_size));
    m.extend(field!(flashattn_varlen, cu_seqlens_q));
    m.extend(field!(flashattn_varlen, cu_seqlens_k));
    m.extend(field!(flashattn_varlen, seqused_k));
    m.extend(field!(flashattn_varlen, max_seqlen_q));
    m.extend(field!(flashattn_varlen, max_seqlen_k));
    m.extend(field!(flashattn_kvcache, struct_size));
    m.extend(field!(flashattn_kvcache, k_new));
    m.extend(field!(flashattn_kvcache, v_new));
    m.extend(field!(flashattn_kvcache, cache_seqlens));
    m.extend(field!(flashattn_kvcache, cache_batch_idx));
    m.extend(field!(flashattn_kvcache, cache_leftpad));
    m.extend(field!(flashattn_kvcache, block_table));
    m.extend(field!(flashattn_kvcache, rotary_cos));
    m.extend(field!(flashattn_kvcache, rotary_sin));
    m.extend(field!(flashattn_kvcache, rotary_interleaved));
    m.extend(field!(flashattn_kvcache, num_splits));
    m.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

#[test]
fn layout_and_constants_match_the_c_header() {
    let c = probe();
    let rust = rust_side();
    let mut diffs = Vec::new();
    for (name, cv) in &c {
        match rust.get(name) {
            Some(rv) if rv == cv => {}
            Some(rv) => diffs.push(format!("{name}: C {cv}, Rust {rv}")),
            None => diffs.push(format!("{name}: C {cv}, not checked on the Rust side")),
        }
    }
    for name in rust.keys().filter(|n| !c.contains_key(*n)) {
        diffs.push(format!("{name}: not printed by the C probe"));
    }
    assert!(diffs.is_empty(), "Rust declarations differ from the header:\n{}", diffs.join("\n"));
    // Guards against a probe that printed nothing useful.
    assert!(c.len() >= 40, "probe printed only {} values", c.len());
}

#[test]
fn every_define_in_the_header_is_mirrored() {
    let header = std::fs::read_to_string(include_dir().join("flashattn/flashattn.h")).unwrap();
    let rust = rust_side();
    // Include guard and export macro are not values.
    let skip = ["FLASHATTN_FLASHATTN_H", "FLASHATTN_API"];
    let mut missing = Vec::new();
    let mut seen = 0;
    for line in header.lines() {
        let Some(rest) = line.trim_start().strip_prefix("#define ") else { continue };
        let name = rest.split_whitespace().next().unwrap_or("");
        if !name.starts_with("FLASHATTN_") || skip.contains(&name) {
            continue;
        }
        seen += 1;
        if !rust.contains_key(name) {
            missing.push(name.to_string());
        }
    }
    assert!(seen >= 20, "found only {seen} #defines in the header");
    assert!(missing.is_empty(), "header #defines with no Rust constant: {missing:?}");
}

#[test]
fn options_init_fills_struct_size_and_defaults() {
    let mut o: flashattn_options = unsafe { std::mem::zeroed() };
    o.struct_size = 7;
    o.mask = 9;
    o.num_threads = -3;
    o.precision = 5;
    o.deterministic = 1;
    o.softmax_scale = 2.5;
    o.stream = 16 as *mut _;
    o.reserved0 = 4;
    o.window_left = 3;
    o.window_right = -1;
    o.softcap = 30.0;
    o.sliding_window = 1;
    o.alibi_slopes = 32 as *const _;
    unsafe { flashattn_options_init(&mut o) };
    assert_eq!(o.struct_size as usize, size_of::<flashattn_options>());
    assert_eq!(o.softmax_scale, 0.0);
    assert_eq!(o.mask, FLASHATTN_MASK_NONE);
    assert!(o.stream.is_null());
    assert_eq!(o.num_threads, 0);
    assert_eq!(o.precision, FLASHATTN_PRECISION_FP32);
    assert_eq!(o.deterministic, 0);
    assert_eq!(o.reserved0, 0);
    assert_eq!((o.window_left, o.window_right, o.sliding_window), (0, 0, 0));
    assert_eq!(o.softcap, 0.0);
    assert!(o.alibi_slopes.is_null());
}

#[test]
fn kvcache_init_fills_struct_size_and_defaults() {
    let mut kv: flashattn_kvcache = unsafe { std::mem::zeroed() };
    kv.struct_size = 3;
    kv.k_new = 16 as *const _;
    kv.v_new = 16 as *const _;
    kv.cache_seqlens = 16 as *const _;
    kv.cache_batch_idx = 16 as *const _;
    kv.cache_leftpad = 16 as *const _;
    kv.block_table = 16 as *const _;
    kv.rotary_cos = 16 as *const _;
    kv.rotary_sin = 16 as *const _;
    kv.rotary_interleaved = 0;
    kv.num_splits = 5;
    unsafe { flashattn_kvcache_init(&mut kv) };
    assert_eq!(kv.struct_size as usize, size_of::<flashattn_kvcache>());
    for p in [
        kv.k_new,
        kv.v_new,
        kv.cache_seqlens,
        kv.cache_batch_idx,
        kv.cache_leftpad,
        kv.block_table,
        kv.rotary_cos,
        kv.rotary_sin,
    ] {
        assert!(p.is_null());
    }
    assert_eq!((kv.rotary_interleaved, kv.num_splits), (1, 0));
}

#[test]
fn null_kvcache_arguments_are_errors_with_a_message() {
    let rc = unsafe {
        flashattn_forward_kvcache(
            std::ptr::null(),
            std::ptr::null(),
            std::ptr::null(),
            std::ptr::null(),
            std::ptr::null(),
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    assert_eq!(rc, FLASHATTN_ERROR_INVALID_ARGUMENT);
    let msg = unsafe { CStr::from_ptr(flashattn_last_error()) }.to_str().unwrap();
    assert!(msg.contains("NULL"), "message: {msg}");
}

/// The version sizes are the offsets at which the next version's fields start: an older
/// caller's struct_size must cover exactly the fields it knows.
#[test]
fn version_sizes_end_where_the_next_fields_begin() {
    assert_eq!(offset_of!(flashattn_options, num_threads), FLASHATTN_OPTIONS_V1_SIZE as usize);
    assert_eq!(offset_of!(flashattn_options, window_left), FLASHATTN_OPTIONS_V2_SIZE as usize);
    assert_eq!(offset_of!(flashattn_options, max_flops), FLASHATTN_OPTIONS_V3_SIZE as usize);
    assert_eq!(offset_of!(flashattn_options, workspace), FLASHATTN_OPTIONS_V4_SIZE as usize);
    assert!(size_of::<flashattn_options>() > FLASHATTN_OPTIONS_V2_SIZE as usize);
}

#[test]
fn version_and_status_strings() {
    let v = unsafe { CStr::from_ptr(flashattn_version()) }.to_str().unwrap();
    assert_eq!(
        v,
        format!("{FLASHATTN_VERSION_MAJOR}.{FLASHATTN_VERSION_MINOR}.{FLASHATTN_VERSION_PATCH}"),
        "the loaded library's version differs from the header the crate mirrors"
    );
    let name =
        |s| unsafe { CStr::from_ptr(flashattn_status_string(s)) }.to_str().unwrap().to_string();
    assert_eq!(name(FLASHATTN_OK), "ok");
    assert_eq!(name(FLASHATTN_ERROR_INVALID_ARGUMENT), "invalid argument");
    assert_eq!(name(FLASHATTN_ERROR_UNSUPPORTED), "unsupported");
    assert_eq!(name(12345), "unknown status");
    let cuda = unsafe { flashattn_cuda_available() };
    assert!(cuda == 0 || cuda == 1);
}

#[test]
fn null_tensor_is_an_error_with_a_message() {
    let rc = unsafe {
        flashattn_forward(
            std::ptr::null(),
            std::ptr::null(),
            std::ptr::null(),
            std::ptr::null(),
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    assert_eq!(rc, FLASHATTN_ERROR_INVALID_ARGUMENT);
    let msg = unsafe { CStr::from_ptr(flashattn_last_error()) }.to_str().unwrap();
    // Which NULL argument is named first is up to the library (C++ argument evaluation order).
    assert!(msg.contains(" is NULL (a flashattn_tensor pointer is required)"), "message: {msg}");
}
