//! Adds an rpath to the library folder the -sys crate found, so tests and binaries of this crate
//! run from the build tree without LD_LIBRARY_PATH.
fn main() {
    if let Ok(dir) = std::env::var("DEP_MOEBLAZE_LIB_DIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
}
