//! The loaded library matches the header these declarations were generated from.
use moeblaze_sys as sys;

#[test]
fn version_and_abi_match_the_header() {
    unsafe {
        assert_eq!(
            sys::moeblaze_get_abi_version() as u32,
            sys::MOEBLAZE_ABI_VERSION
        );
        assert_eq!(sys::moeblaze_get_version() as u32, sys::MOEBLAZE_VERSION);
    }
}

#[test]
fn struct_init_accepts_the_generated_layout() {
    unsafe {
        let mut config = std::mem::zeroed::<sys::moeblaze_layer_config_t>();
        let status = sys::moeblaze_layer_config_init(&mut config, std::mem::size_of_val(&config));
        assert_eq!(status, 0);
        assert_eq!(
            config.struct_size as usize,
            std::mem::size_of::<sys::moeblaze_layer_config_t>()
        );
        assert_eq!(config.top_k, 1);
        let mut fwd = std::mem::zeroed::<sys::moeblaze_forward_args_t>();
        assert_eq!(
            sys::moeblaze_forward_args_init(&mut fwd, std::mem::size_of_val(&fwd)),
            0
        );
        let mut bwd = std::mem::zeroed::<sys::moeblaze_backward_args_t>();
        assert_eq!(
            sys::moeblaze_backward_args_init(&mut bwd, std::mem::size_of_val(&bwd)),
            0
        );
    }
}
