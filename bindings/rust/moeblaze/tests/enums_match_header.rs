//! The safe crate's enums against include/moeblaze.h (the codes) and src/common/activations.def
//! (which activations are gated): every header code maps to a variant of the same name and back,
//! and no variant lacks a code. moeblaze-sys is regenerated from the header and checked by
//! regenerate.sh --check; this covers the hand-written layer above it.
use moeblaze::{Activation, Backend, Checkpoint, DType, ScoreFunction};

const HEADER: &str = include_str!("../../../../include/moeblaze.h");
const ACTIVATIONS_DEF: &str = include_str!("../../../../src/common/activations.def");

/// (suffix, code) of the header's enumerators `MOEBLAZE_<prefix>_<suffix> = <code>`.
fn header_codes(prefix: &str) -> Vec<(String, i32)> {
    let start = format!("MOEBLAZE_{}_", prefix);
    let mut codes = Vec::new();
    for line in HEADER.lines() {
        let line = line.trim();
        if let Some(rest) = line.strip_prefix(start.as_str()) {
            let mut parts = rest.splitn(2, " = ");
            let (Some(name), Some(value)) = (parts.next(), parts.next()) else { continue };
            let digits: String = value.chars().take_while(|c| c.is_ascii_digit()).collect();
            if let Ok(code) = digits.parse() {
                codes.push((name.to_string(), code));
            }
        }
    }
    assert!(!codes.is_empty(), "no MOEBLAZE_{}_* codes in the header", prefix);
    codes
}

/// A variant's name as the header spells it: `SwiGlu` -> `SWIGLU`, `SaveAll` -> `SAVEALL`.
fn spelled<T: std::fmt::Debug>(value: T) -> String {
    format!("{:?}", value).to_uppercase()
}

fn check<T: std::fmt::Debug + Copy>(prefix: &str, from_code: fn(i32) -> Option<T>, code: fn(T) -> i32) {
    let header = header_codes(prefix);
    for (name, value) in &header {
        let variant = from_code(*value)
            .unwrap_or_else(|| panic!("MOEBLAZE_{}_{} = {} has no variant", prefix, name, value));
        assert_eq!(code(variant), *value, "{:?}", variant);
        assert_eq!(spelled(variant), name.replace('_', ""), "code {}", value);
    }
    // No variant beyond the header's codes (they are small and dense from 0 or 1).
    let max = header.iter().map(|(_, c)| *c).max().unwrap();
    for value in -1..=max + 8 {
        if !header.iter().any(|(_, c)| *c == value) {
            assert!(from_code(value).is_none(), "{} code {} is not in the header", prefix, value);
        }
    }
}

#[test]
fn backends_match_header() {
    check("BACKEND", Backend::from_code, Backend::code);
}

#[test]
fn dtypes_match_header() {
    check("DTYPE", DType::from_code, DType::code);
}

#[test]
fn activations_match_header() {
    check("ACTIVATION", Activation::from_code, Activation::code);
}

#[test]
fn checkpoints_match_header() {
    check("CHECKPOINT", Checkpoint::from_code, Checkpoint::code);
}

#[test]
fn score_functions_match_header() {
    check("SCORE", ScoreFunction::from_code, ScoreFunction::code);
}

#[test]
fn gated_activations_match_the_library_list() {
    let mut listed = 0;
    for line in ACTIVATIONS_DEF.lines() {
        let Some(rest) = line.strip_prefix("MOEBLAZE_ACTIVATION(") else { continue };
        let fields: Vec<&str> = rest.trim_end_matches(')').split(", ").collect();
        let (code_name, gated) = (fields[1], fields[2] == "true");
        let (_, code) = header_codes("ACTIVATION")
            .into_iter()
            .find(|(name, _)| format!("MOEBLAZE_ACTIVATION_{}", name) == code_name)
            .unwrap_or_else(|| panic!("{} is not in the header", code_name));
        assert_eq!(Activation::from_code(code).unwrap().is_gated(), gated, "{}", code_name);
        listed += 1;
    }
    assert_eq!(listed, header_codes("ACTIVATION").len());
}
