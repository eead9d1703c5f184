//! libFuzzer entry point (cargo-fuzz) for [`kvmesh_fuzz::targets::filter_splice`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvmesh_fuzz::targets::filter_splice(data));
