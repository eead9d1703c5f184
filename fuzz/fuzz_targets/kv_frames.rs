//! libFuzzer entry point (cargo-fuzz) for [`kvmesh_fuzz::targets::kv_frames`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvmesh_fuzz::targets::kv_frames(data));
