//! Finds libmoeblaze: $MOEBLAZE_LIB_DIR (set by CMake/CTest), else `pkg-config moeblaze`, else
//! fails with instructions. Publishes `lib_dir` and `include` as DEP_MOEBLAZE_* metadata so that
//! dependents can add an rpath (link arguments of a -sys build script do not reach them).
use std::env;
use std::path::PathBuf;
use std::process::Command;

fn pkg_config_lib_dir() -> Option<String> {
    let output = Command::new("pkg-config")
        .args(["--variable=libdir", "moeblaze"])
        .output()
        .ok()?;
    if !output.status.success() {
        return None;
    }
    let dir = String::from_utf8(output.stdout).ok()?.trim().to_string();
    if dir.is_empty() {
        None
    } else {
        Some(dir)
    }
}

fn main() {
    println!("cargo:rerun-if-env-changed=MOEBLAZE_LIB_DIR");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    let lib_dir = match env::var("MOEBLAZE_LIB_DIR") {
        Ok(dir) if !dir.is_empty() => dir,
        _ => pkg_config_lib_dir().unwrap_or_else(|| {
            panic!(
                "libmoeblaze not found: set MOEBLAZE_LIB_DIR to the folder holding \
                 libmoeblaze.so (e.g. <build>/src), or install moeblaze where pkg-config finds it"
            )
        }),
    };
    let include = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../include");
    println!("cargo:rustc-link-search=native={lib_dir}");
    println!("cargo:rustc-link-lib=dylib=moeblaze");
    println!("cargo:lib_dir={lib_dir}");
    println!("cargo:include={}", include.display());
    // Tests of this crate run from the build tree too.
    println!("cargo:rustc-link-arg=-Wl,-rpath,{lib_dir}");
}
