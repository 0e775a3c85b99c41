//! Run from a build tree without LD_LIBRARY_PATH: rpath to $MOEBLAZE_LIB_DIR (as CTest sets it).
fn main() {
    println!("cargo:rerun-if-env-changed=MOEBLAZE_LIB_DIR");
    if let Ok(dir) = std::env::var("MOEBLAZE_LIB_DIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
}
